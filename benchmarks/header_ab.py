"""What the gather headers cost a GPT-2 step at W=2 on a CPU, measured in pairs on one model.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/header_ab.py --blocks 20

One wrapped GPT-2 (4 x 256, the shape of bench.py) trains in blocks of ``--steps`` steps. Each
block is timed twice back to back, once as shardwrap runs and once with the 16-byte header before
each data all-gather turned off (``--phase`` forward, backward or both; ``Unit._check_in_step``,
design/notes/rank-agreement.md), the order alternating from block to block. On this machine the
step time drifts by more than the header costs within one run, so what is reported is the median
of the per-block differences and how many blocks had the headers cost time, not two medians of
separate runs.

Turning the headers off is a probe, not a mode: ranks that diverge would then abort in gloo
instead of raising (the data all-gathers then carry no check of their sizes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--blocks", type=int, default=20)
p.add_argument("--steps", type=int, default=4, help="timed steps per block and setting")
p.add_argument("--stage", type=int, default=3)
p.add_argument("--phase", choices=["both", "forward", "backward"], default="both", help="which headers the probe turns off")
args = p.parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import models  # noqa: E402  (tests/models.py: GPT-2 from a config, random weights)
from shardwrap import ShardedModule  # noqa: E402
from shardwrap.unit import Unit  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
model = ShardedModule(models.gpt2(n_layer=4, n_embd=256, n_head=4, vocab_size=256, n_positions=128, use_cache=False),
                      auto_wrap_policy={models.gpt2_block_class()}, stage=args.stage)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
headers = {"on": True}


def check_in_step(unit: Unit, *a: object, **k: object) -> None:
    in_backward = unit._root.in_backward()
    skip = not headers["on"] and (args.phase == "both" or (args.phase == "backward") == in_backward)
    if not skip:
        Unit._check_in_step(unit, *a, **k)  # type: ignore[arg-type]


for unit in model.units:
    unit._check_in_step = lambda *a, _u=unit, **k: check_in_step(_u, *a, **k)  # type: ignore[method-assign]


def step(i: int) -> float:
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 256, (4 * world, 128), generator=g).chunk(world)[rank]
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


for i in range(4):
    step(i)
times: dict[bool, list[float]] = {True: [], False: []}
for block in range(args.blocks):
    for on in (True, False) if block % 2 == 0 else (False, True):
        headers["on"] = on
        step(0)  # a step to settle into the setting (the first after a switch pays for the switch)
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(args.steps):
            step(i)
        times[on].append((time.perf_counter() - t0) / args.steps * 1e3)
if rank == 0:
    diffs = [a - b for a, b in zip(times[True], times[False])]
    print(f"GPT-2 (4 x 256), stage {args.stage}, W={world}, rank 0, {args.blocks} blocks x {args.steps} steps; "
          f"headers off in {args.phase}")
    print(f"step ms, median: with headers {statistics.median(times[True]):.1f}, without {statistics.median(times[False]):.1f}")
    print(f"what the headers cost a step, per block: median {statistics.median(diffs):.1f} ms, mean "
          f"{statistics.mean(diffs):.1f}; more with them in {sum(d > 0 for d in diffs)} of {len(diffs)} blocks")
