"""What the checksums cost: save_checkpoint and load_checkpoint of the recipe MLP (20 x
Linear(2000), 80M parameters, AdamW state) with the manifest (as shipped) and without it (the save
skips checksumming and the manifest, the load finds none and verifies nothing: the code path of a
checkpoint saved before manifests). For reference, "before" loads the same files as
load_checkpoint did before this change (DCP's stock reader and planner filling clones, then
load_state_dict): it unpickles .metadata and non-tensor entries without restriction.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint_cost.py

Each round saves, loads with the files in the page cache ("warm": right after a save), and loads
again after every rank asked the kernel to drop the checkpoint's pages (``posix_fadvise
DONTNEED``: "cold", as a job restarting on a node that did not write them). The variants
alternate which goes first. Each time is taken between two barriers; CPU is the process time
summed over the ranks. Medians over rounds. Writes benchmarks/results/checkpoint_cost_W{W}.md
and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import shardwrap.checkpoint as ckpt
from common import RecipeMLP  # benchmarks/common.py (the script's folder is on sys.path)
from shardwrap import ShardedModule, load_checkpoint, save_checkpoint

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--dir", default="", help="where the checkpoints go (default: a new temporary directory)")
p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = ShardedModule(RecipeMLP(), auto_wrap_policy={nn.Linear})
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(16 * world, 2000, generator=torch.Generator().manual_seed(1)).chunk(world)[rank]  # (16, 2000)
model(x).pow(2).mean().backward()
opt.step()  # AdamW state exists: the checkpoint holds parameters, exp_avg and exp_avg_sq
opt.zero_grad()
count = torch.tensor([sum(p.to_local().numel() for p in model.parameters())])  # this rank's torch.chunk pieces
dist.all_reduce(count)
params = int(count.item())

box = [args.dir or (tempfile.mkdtemp(prefix="shardwrap-ckpt-cost-") if rank == 0 else None)]
dist.broadcast_object_list(box, src=0)
root: str = box[0]
shipped_record, shipped_write = ckpt._record_checksums, ckpt.files.write_manifest


def use(variant: str) -> None:
    """Checksums as shipped, or none: no checksumming and no manifest on save, so nothing to
    verify on load."""
    if variant == "checksums":
        ckpt._record_checksums, ckpt.files.write_manifest = shipped_record, shipped_write
    else:
        ckpt._record_checksums = lambda tmp, metadata, model, group: {}
        ckpt.files.write_manifest = lambda directory, records: None


def evict(path: str) -> None:
    """Drop the checkpoint's pages from the page cache (these files only; no privileges needed)."""
    for name in sorted(os.listdir(path)):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every rank together)."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    cpu = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.barrier()
    wall = time.perf_counter() - start
    dist.all_reduce(cpu)
    return wall, cpu.item()


def load_before(path: str) -> None:
    """load_checkpoint as it was before the manifest: DCP's stock reader and planner fill clones of
    the model's and optimizer's state (which exists here), then load_state_dict copies them."""
    scratch: dict = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    osd = model.sharded_optim_state_dict(opt)
    state = {n: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in e.items()} for n, e in osd["state"].items()}
    scratch["optim"] = {"state": state, "param_groups": osd["param_groups"]}
    dcp.load(scratch, checkpoint_id=path)
    model.load_state_dict(scratch["model"])
    model.load_sharded_optim_state_dict(opt, scratch["optim"])


variants = ["checksums", "none", "before"]
kinds = ["save", "load", "load_cold"]
times: dict[str, dict[str, list[float]]] = {v: {k: [] for k in kinds} for v in variants}
cpus: dict[str, dict[str, list[float]]] = {v: {k: [] for k in kinds} for v in variants}
warnings.simplefilter("ignore", ckpt.UnverifiedCheckpointWarning)  # the "none" checkpoints have no manifest
blocks = [["checksums"], ["none", "before"]]  # "before" loads what "none" saved
for r in range(args.rounds):
    for block in blocks if r % 2 == 0 else blocks[::-1]:
        for variant in block:
            use("checksums" if variant == "checksums" else "none")
            path = os.path.join(root, "checksums" if variant == "checksums" else "none")
            load = (lambda: load_before(path)) if variant == "before" else (lambda: load_checkpoint(path, model, opt))
            actions = {"load": load, "load_cold": load} if variant == "before" else {"save": lambda: save_checkpoint(path, model, opt), "load": load, "load_cold": load}
            for kind, action in actions.items():
                if kind == "load_cold":
                    evict(path)
                wall, cpu = timed(action)
                times[variant][kind].append(wall)
                cpus[variant][kind].append(cpu)
            if rank == 0:
                print(f"round {r} {variant:9s} " + " ".join(f"{k} {times[variant][k][-1]:.3f} s" for k in actions), flush=True)
use("checksums")

if rank == 0:
    size = sum(os.path.getsize(os.path.join(root, "checksums", n)) for n in os.listdir(os.path.join(root, "checksums")))
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731  (NaN: "before" saves nothing of its own)
    median = {v: {k: med(t) for k, t in by_kind.items()} for v, by_kind in times.items()}
    median_cpu = {v: {k: med(t) for k, t in by_kind.items()} for v, by_kind in cpus.items()}
    ratio = {other: {k: median["checksums"][k] / median[other][k] for k in kinds} for other in ("none", "before")}
    ratio_cpu = {other: {k: median_cpu["checksums"][k] / median_cpu[other][k] for k in kinds} for other in ("none", "before")}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"checkpoint_cost_W{world}")
    with open(stem + ".json", "w") as f:
        no_nan = lambda table: {v: {k: None if x != x else x for k, x in row.items()} for v, row in table.items()}  # noqa: E731
        json.dump({"world": world, "params": params, "bytes": size, "rounds": args.rounds, "wall": times, "cpu": cpus,
                   "median": no_nan(median), "median_cpu": no_nan(median_cpu), "ratio": no_nan(ratio), "ratio_cpu": no_nan(ratio_cpu)}, f, indent=1)
    heads = {"save": "save", "load": "load (page cache)", "load_cold": "load (pages dropped)"}
    cell = lambda x: "-" if x != x else f"{x:.3f}"  # noqa: E731
    lines = [
        f"# Cost of the checksums: W={world}, recipe MLP ({params / 1e6:.1f}M parameters, AdamW), "
        f"{size / 2**20:.0f} MiB on disk, {args.rounds} interleaved rounds, medians",
        "",
        "| | " + " | ".join(f"{heads[k]} s" for k in kinds) + " | " + " | ".join(f"{heads[k]} CPU s" for k in kinds) + " |",
        "|---|" + "---|" * (2 * len(kinds)),
        *(f"| {v} | " + " | ".join(cell(median[v][k]) for k in kinds) + " | " + " | ".join(cell(median_cpu[v][k]) for k in kinds) + " |"
          for v in variants),
        *(f"| checksums / {o} | " + " | ".join(cell(ratio[o][k]) for k in kinds) + " | " + " | ".join(cell(ratio_cpu[o][k]) for k in kinds) + " |"
          for o in ("none", "before")),
        "",
        "none: this code with the checksums off. before: the load as it was before this change (the",
        "save was the same as none). CPU: process time of both ranks together.",
        "",
        "Wall seconds of every round:",
        "",
        *(f"- {v} {k}: " + ", ".join(f"{t:.2f}" for t in times[v][k]) for v in variants for k in kinds if times[v][k]),
    ]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
dist.barrier()
dist.destroy_process_group()
