"""What a shared-memory transport between the ranks of one host would save over gloo's loopback
TCP, for one unit's all-gather with its copy-out (design/notes/cpu-collectives.md, "What is left
above the floor"). A probe of a design that is not built, not a shardwrap code path.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/shm_probe.py

"tcp": ``collectives.all_gather`` (the pairwise path: one isend and one irecv per peer) into a
rank-major buffer, then the copy-out into a parameter-major buffer of 13 pieces, as a GPT-2 block's
gather does. "shm": each rank copies its shard into a segment of /dev/shm that every rank has
mapped, a 4-byte gloo message per peer says it is there, and each rank copies every peer's rows
straight from the segment into the parameter-major buffer (the copy-out is the transfer); a second
4-byte message tells the owner its segment may be written again. Both give the same bits (checked).
Rank 0 prints wall and process CPU time (every thread: gloo's too) per gather, medians of 5 rounds
of 40 interleaved gathers.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from shardwrap import collectives  # noqa: E402

dist.init_process_group("gloo")
me, W = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
peers = [p for p in range(W) if p != me]
tag = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'probe')}-{os.getpid() if me == 0 else 0}"
tag = collectives.broadcast_object(tag, dist.group.WORLD)


def probe(n: int) -> dict[str, list[float]]:
    sizes = [n // 13] * 12 + [n - 12 * (n // 13)]  # 12 parameters' chunks and a last one
    shard = torch.randn(n, generator=torch.Generator().manual_seed(me))
    rank_major = torch.empty(W * n)
    dest = torch.empty(W * n)
    pieces = dest.split([W * s for s in sizes])
    paths = [f"/dev/shm/shardwrap-probe-{tag}-{n}-{r}" for r in range(W)]
    with open(paths[me], "wb") as f:
        f.truncate(n * 4)
    dist.barrier()
    boxes = [torch.from_file(p, shared=True, size=n) for p in paths]
    dist.barrier()
    os.unlink(paths[me])  # every rank has mapped it: nothing is left behind if a rank dies
    flag, flags, ack, acks = torch.zeros(1), [torch.zeros(1) for _ in peers], torch.zeros(1), [torch.zeros(1) for _ in peers]
    pending: list[dist.Work] = []

    def tcp() -> None:
        collectives.all_gather(rank_major, shard, dist.group.WORLD, async_op=True).wait()
        torch.split_with_sizes_copy(rank_major.view(W, n), sizes, dim=1, out=[p.view(W, s) for p, s in zip(pieces, sizes)])

    def shm() -> None:
        for w in pending:  # every peer has read this rank's segment since it was last written
            w.wait()
        boxes[me].copy_(shard)
        ops = [dist.P2POp(dist.isend, flag, p) for p in peers] + [dist.P2POp(dist.irecv, f, p) for p, f in zip(peers, flags)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        for r in range(W):
            torch.split_with_sizes_copy(shard if r == me else boxes[r], sizes, out=[p.view(W, s)[r] for p, s in zip(pieces, sizes)])
        ops = [dist.P2POp(dist.isend, ack, p) for p in peers] + [dist.P2POp(dist.irecv, a, p) for p, a in zip(peers, acks)]
        works = dist.batch_isend_irecv(ops)
        pending[:] = works

    tcp()
    expected = dest.clone()
    dest.zero_()
    shm()
    for w in pending:
        w.wait()
    pending.clear()
    assert torch.equal(dest, expected), "the shared-memory gather gave other bits"
    out: dict[str, list[float]] = {"tcp wall": [], "tcp cpu": [], "shm wall": [], "shm cpu": []}
    for _ in range(5):
        for name, fn in (("tcp", tcp), ("shm", shm)):
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            for _ in range(40):
                fn()
            for w in pending:
                w.wait()
            pending.clear()
            out[f"{name} wall"].append((time.perf_counter() - t) / 40 * 1e3)
            out[f"{name} cpu"].append((time.process_time() - c) / 40 * 1e3)
    dist.barrier()
    return out


if me == 0:
    print(f"\nOne unit's all-gather with copy-out, W={W}, fp32, 13 pieces; ms per gather on rank 0 (medians of 5 rounds)\n")
    print("| floats per rank | tcp wall | shm wall | tcp process CPU | shm process CPU |")
    print("|---|---|---|---|---|")
for n in (98_304, 395_264, 1_572_864, 6_291_456):
    r = probe(n)
    if me == 0:
        m = {k: statistics.median(v) for k, v in r.items()}
        print(f"| {n:,} | {m['tcp wall']:.2f} | {m['shm wall']:.2f} ({m['shm wall'] / m['tcp wall']:.2f}) "
              f"| {m['tcp cpu']:.2f} | {m['shm cpu']:.2f} ({m['shm cpu'] / m['tcp cpu']:.2f}) |", flush=True)
dist.destroy_process_group()
