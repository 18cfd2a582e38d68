"""The optimizer step alone: a plain torch optimizer over shardwrap's DTensor parameters (which
steps their local tensors, shardwrap/local_step.py, and with that turned off, the DTensors
themselves) against the same optimizer over the plain local chunks (the same storage), foreach and
fused, and beside fully_shard's DTensor parameters, in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/optim_step.py

DTensor dispatch costs Python time per operator call; this isolates it from forward and backward.
Prints a markdown table (median ms per step over interleaved rounds) on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import models  # noqa: E402  (tests/models.py: GPT-2 from a config, random weights)
from common import apply_fully_shard  # noqa: E402
from shardwrap import ShardedModule, local_step  # noqa: E402
from shardwrap.unit import local_of  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--layers", type=int, default=4)
args = p.parse_args()
dist.init_process_group("gloo")
torch.set_num_threads(1)


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.gpt2(n_layer=args.layers, n_embd=256, n_head=4, vocab_size=256, n_positions=128)


def with_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    for q in params:
        q.grad = torch.full_like(q, 1e-3)
    return params


sharded = ShardedModule(gpt2(), auto_wrap_policy={models.gpt2_block_class()})
dparams = with_grads(list(sharded.parameters()))
plain = [local_of(q).detach().requires_grad_(True) for q in dparams]  # views of the same shard
with_grads(plain)
fs = apply_fully_shard(gpt2(), {models.gpt2_block_class()}, True)
fparams = with_grads(list(fs.parameters()))


def fused_ok(params: list[torch.Tensor]) -> bool:
    try:
        opt = torch.optim.AdamW(params, lr=1e-9, fused=True)
        opt.step()
        return True
    except Exception as exc:  # fused kernels for this device/tensor type may be missing
        if dist.get_rank() == 0:
            print(f"fused AdamW unavailable here: {type(exc).__name__}: {str(exc)[:120]}")
        return False


cases = {
    "shardwrap DTensor, AdamW foreach": torch.optim.AdamW(dparams, lr=1e-9, foreach=True),
    "shardwrap DTensor, AdamW foreach, DTensor dispatch": torch.optim.AdamW(dparams, lr=1e-9, foreach=True),
    "plain local chunks, AdamW foreach": torch.optim.AdamW(plain, lr=1e-9, foreach=True),
    "fully_shard DTensor, AdamW foreach": torch.optim.AdamW(fparams, lr=1e-9, foreach=True),
    "shardwrap DTensor, SGD momentum foreach": torch.optim.SGD(dparams, lr=1e-9, momentum=0.9, foreach=True),
    "plain local chunks, SGD momentum foreach": torch.optim.SGD(plain, lr=1e-9, momentum=0.9, foreach=True),
    "shardwrap DTensor, AdamW for-loop": torch.optim.AdamW(dparams, lr=1e-9, foreach=False),
    "shardwrap DTensor, AdamW for-loop, DTensor dispatch": torch.optim.AdamW(dparams, lr=1e-9, foreach=False),
    "plain local chunks, AdamW for-loop": torch.optim.AdamW(plain, lr=1e-9, foreach=False),
}
if fused_ok(dparams):
    cases["shardwrap DTensor, AdamW fused"] = torch.optim.AdamW(dparams, lr=1e-9, fused=True)
    cases["shardwrap DTensor, AdamW fused, DTensor dispatch"] = torch.optim.AdamW(dparams, lr=1e-9, fused=True)
if fused_ok(plain):
    cases["plain local chunks, AdamW fused"] = torch.optim.AdamW(plain, lr=1e-9, fused=True)
times: dict[str, list[float]] = {name: [] for name in cases}
for name, opt in cases.items():
    local_step.ENABLED = not name.endswith("DTensor dispatch")  # the rows that step the DTensors themselves
    opt.step()  # warm-up, state creation
for _ in range(args.rounds):
    for name, opt in cases.items():
        local_step.ENABLED = not name.endswith("DTensor dispatch")
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.step()
        times[name].append((time.perf_counter() - t0) / args.steps * 1000)
if dist.get_rank() == 0:
    n = len(dparams)
    print(f"\nOptimizer step only, GPT-2 {args.layers} layers x 256, {n} parameters, W={dist.get_world_size()}, "
          f"median of {args.rounds} rounds x {args.steps} steps\n")
    print("| optimizer over | ms / step |\n|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} |")
dist.destroy_process_group()
