"""How long a checkpoint save stalls training: save_checkpoint(blocking=True) against
save_checkpoint(blocking=False) in the middle of a run of the recipe MLP (20 x Linear(2000), 80M
parameters, AdamW), in the same run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/async_save.py

Each round trains ``--steps`` steps three ways: without a save, with a blocking save after the
first step, and with a background save after the first step (waited for at the end of the run).
The stall is the run's wall time less the run without a save; "in call" is how long the call
itself kept the training loop. Medians over rounds. Writes benchmarks/results/async_save_W{W}.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from common import RecipeMLP  # benchmarks/common.py (the script's folder is on sys.path)
from shardwrap import ShardedModule, save_checkpoint
from shardwrap.checkpoint import wait_for_saves

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
torch.manual_seed(0)
model = ShardedModule(RecipeMLP(), auto_wrap_policy={nn.Linear})
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(16 * world, 2000, generator=torch.Generator().manual_seed(1)).chunk(world)[rank]  # (16, 2000)
box = [tempfile.mkdtemp(prefix="shardwrap-async-") if rank == 0 else None]
dist.broadcast_object_list(box, src=0)
root: str = box[0]


def step() -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def run(mode: str) -> tuple[float, float]:
    """(wall seconds of the run, seconds spent inside the save call)."""
    dist.barrier()
    t0, in_call = time.perf_counter(), 0.0
    for i in range(args.steps):
        step()
        if i == 0 and mode != "none":
            c = time.perf_counter()
            save_checkpoint(os.path.join(root, "ckpt"), model, opt, blocking=mode == "blocking")
            in_call = time.perf_counter() - c
    wait_for_saves()
    dist.barrier()
    return time.perf_counter() - t0, in_call


step()  # optimizer state exists: the checkpoint holds parameters and AdamW state
run("background")  # warm-up: the checkpoint process group, the page cache
times: dict[str, list[tuple[float, float]]] = {m: [] for m in ("none", "blocking", "background")}
for r in range(args.rounds):
    for mode in (("none", "blocking", "background") if r % 2 == 0 else ("background", "blocking", "none")):
        times[mode].append(run(mode))
if rank == 0:
    base = statistics.median(t for t, _ in times["none"])
    lines = [f"# Save stall: recipe MLP (80M parameters, AdamW), W={world}, {args.steps} steps a run, "
             f"{args.rounds} rounds, medians\n", "| save | run s | stall s (run - no save) | in call s |", "|---|---|---|---|"]
    for mode, ts in times.items():
        run_s = statistics.median(t for t, _ in ts)
        lines.append(f"| {mode} | {run_s:.2f} | {run_s - base:.2f} | {statistics.median(c for _, c in ts):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"async_save_W{world}.md"), "w") as f:
        f.write(text)
    shutil.rmtree(root, ignore_errors=True)
dist.barrier()
dist.destroy_process_group()
