"""All-gather bus bandwidth of this machine's gloo, the intra-node term of the step-time model
(``python -m shardwrap.estimate --mesh RxS --intra-gbps calibrated``).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/calibrate_bandwidth.py

At each size (bytes of the gathered fp32 output, W shards of size / W) it times
``torch.distributed.all_gather_into_tensor`` (``all_gather_single``, its new name, where torch
has it) between barriers, ``--reps`` times, and takes the
median. Bus bandwidth as nccl-tests defines it: size / time * (W - 1) / W, i.e. the bytes each rank
receives per second, which is what the estimator divides a ring all-gather's wire bytes by
(GB = 1e9 bytes). The figure is the median over the sizes. shardwrap's own pairwise all-gather
(``collectives.all_gather``, what units use on CPU groups: design/notes/cpu-collectives.md) is
timed after it at each size and recorded as ``pairwise_allgather_busbw_gbps``.
Writes benchmarks/results/gloo_bandwidth.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from shardwrap import collectives

MiB = 2**20

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--sizes-mib", default="4,16,64", help="gathered output sizes in MiB, comma-separated")
p.add_argument("--reps", type=int, default=15, help="timed repetitions per size (after one warm-up)")
p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gloo_bandwidth.json"))
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
group = dist.group.WORLD
gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the deprecated name warns


def median_seconds(call, reps: int) -> float:
    call()  # warm-up: connections and buffers
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def busbw_gbps(size: int, seconds: float) -> float:
    return size / seconds * (world - 1) / world / 1e9


rows = []
for mib in (int(s) for s in args.sizes_mib.split(",")):
    n = mib * MiB // 4 // world  # fp32 elements per rank
    size = 4 * n * world
    shard, gathered = torch.randn(n), torch.empty(n * world)
    torch_s = median_seconds(lambda: gather(gathered, shard, group=group), args.reps)
    pairwise_s = median_seconds(lambda: collectives.all_gather(gathered, shard, group), args.reps)
    rows.append({"bytes": size, "median_s": torch_s, "busbw_gbps": busbw_gbps(size, torch_s),
                 "pairwise_median_s": pairwise_s, "pairwise_busbw_gbps": busbw_gbps(size, pairwise_s)})
    if rank == 0:
        print(f"{mib} MiB: {gather.__name__} {torch_s * 1e3:.1f} ms ({rows[-1]['busbw_gbps']:.3f} GB/s), "
              f"pairwise {pairwise_s * 1e3:.1f} ms ({rows[-1]['pairwise_busbw_gbps']:.3f} GB/s)", flush=True)

if rank == 0:
    result = {
        "allgather_busbw_gbps": statistics.median(r["busbw_gbps"] for r in rows),
        "pairwise_allgather_busbw_gbps": statistics.median(r["pairwise_busbw_gbps"] for r in rows),
        "sizes": [r["bytes"] for r in rows],
        "per_size": rows,
        "world_size": world,
        "reps": args.reps,
        "backend": "gloo",
        "function": f"torch.distributed.{gather.__name__}",
        "dtype": "float32",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node={world} benchmarks/calibrate_bandwidth.py",
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"all-gather bus bandwidth {result['allgather_busbw_gbps']:.3f} GB/s (pairwise "
          f"{result['pairwise_allgather_busbw_gbps']:.3f}), W={world}: {args.out}")
dist.destroy_process_group()
