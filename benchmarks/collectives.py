"""Reduce-scatter and all-gather on CPU (gloo) against an all-reduce of the same buffer, torch's
collectives beside shardwrap's pairwise ones, at several sizes.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/collectives.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=3 benchmarks/collectives.py

A ring all-reduce is a reduce-scatter followed by an all-gather, so each of those should cost
about half an all-reduce. Times are medians over interleaved repetitions, each between barriers;
the table gives the all-reduce in ms and the others as a ratio to it. Writes
benchmarks/results/collectives_W{W}.md and .json (design/notes/cpu-collectives.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--sizes", default="16384,262144,1048576,4194304,16777216,41943040", help="floats per rank, comma-separated")
p.add_argument("--reps", type=int, default=9)
p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
args = p.parse_args()

import torch
import torch.distributed as dist

from shardwrap import collectives

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
group = dist.group.WORLD
collectives.PAIRWISE_MIN_BYTES = 1  # "shardwrap" columns: always the pairwise path


def median_ms(calls: dict[str, object], reps: int) -> dict[str, float]:
    """Each call ``reps`` times, the calls interleaved; medians in ms (rank 0's clock)."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(reps):
        for name, call in calls.items():
            dist.barrier()
            start = time.perf_counter()
            call()  # type: ignore[operator]
            times[name].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


rows = []
for n in [int(s) for s in args.sizes.split(",")]:
    full, shard = torch.randn(world * n), torch.randn(n)
    out, gathered = torch.empty(n), torch.empty(world * n)
    reduce_in = full.clone()
    calls = {
        "all_reduce": lambda: dist.all_reduce(reduce_in, group=group),
        "torch reduce_scatter": lambda: dist.reduce_scatter_tensor(out, full, group=group),
        "shardwrap reduce_scatter": lambda: collectives.reduce_scatter(out, full, group),
        "torch all_gather": lambda: dist.all_gather_into_tensor(gathered, shard, group=group),
        "shardwrap all_gather": lambda: collectives.all_gather(gathered, shard, group),
    }
    ms = median_ms(calls, args.reps)
    rows.append({"floats": n, **ms})
    if rank == 0:
        print(n, {k: round(v, 2) for k, v in ms.items()}, flush=True)

if rank == 0:
    names = list(rows[0])[2:]
    lines = [
        f"# CPU collectives (gloo), W={world}, fp32, medians of {args.reps} interleaved repetitions",
        "",
        "| floats per rank | all_reduce ms | " + " | ".join(f"{n} / all_reduce" for n in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        lines.append(f"| {r['floats']:,} | {r['all_reduce']:.2f} | " + " | ".join(f"{r[n] / r['all_reduce']:.2f}" for n in names) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"collectives_W{world}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, f"collectives_W{world}.json"), "w") as f:
        json.dump(rows, f, indent=1)
dist.destroy_process_group()
