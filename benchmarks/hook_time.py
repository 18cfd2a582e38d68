"""Where shardwrap's host time goes in a backward: each hook and collective's own wall time, beside
``fully_shard``'s whole forward and backward, on one rank.

    python benchmarks/hook_time.py                    # on a GPU: GPT-2 small, batch 1 x 128 (host-bound)
    python benchmarks/hook_time.py --device cpu       # a 2-layer GPT-2 on gloo (the plumbing)

Why: on an H100 at batch 1 x 128 (stop 40, benchmarks/results/offload_cuda.md) stage 3's backward
took 50.1 ms against ``fully_shard``'s 30.1 (45.1 against 33.4 at stop 37), while on a CPU at one
rank shardwrap's backward is the shorter of the two. The difference is host work that only the
CUDA path does. On CUDA, backward runs on autograd's device thread, where ``cProfile`` started on
the main thread sees nothing; so every function of ``Unit``, ``ShardedModule``,
``CollectiveSchedule`` and the ``collectives`` and ``unit`` modules is wrapped in a timer before
any model is built. The times are inclusive (a hook's time holds its callees') and include the
timers' own cost, so they compare with each other, not with the unwrapped step.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time
import types
from typing import Any, Callable

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

import shardwrap.collectives as collectives_module  # noqa: E402
import shardwrap.schedule as schedule_module  # noqa: E402
import shardwrap.sharded_module as sharded_module  # noqa: E402
import shardwrap.unit as unit_module  # noqa: E402
from common import apply_fully_shard  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
p.add_argument("--steps", type=int, default=25, help="steps per implementation; the first 10 are warm-up")
p.add_argument("--top", type=int, default=40, help="how many functions to list")
args = p.parse_args()

GPU = args.device == "cuda"
WARMUP = 10
TIMES: dict[str, float] = collections.defaultdict(float)
COUNTS: collections.Counter[str] = collections.Counter()
timing = [False]


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        if not timing[0]:
            return fn(*a, **k)
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name] += time.perf_counter() - t0
            COUNTS[name] += 1

    return wrapper


for cls in (unit_module.Unit, sharded_module.ShardedModule, schedule_module.CollectiveSchedule):
    for name, value in list(vars(cls).items()):
        if isinstance(value, types.FunctionType) and not name.startswith("__"):
            setattr(cls, name, timed(f"{cls.__name__}.{name}", value))
for module in (collectives_module, unit_module):
    for name, value in list(vars(module).items()):
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            setattr(module, name, timed(f"{module.__name__.rsplit('.', 1)[-1]}.{name}", value))

from shardwrap import ShardedModule  # noqa: E402  (after the timers are in place)

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29541")
device = torch.device("cuda", 0) if GPU else torch.device("cpu")
if GPU:
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
else:
    dist.init_process_group("gloo", rank=0, world_size=1)


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def build() -> tuple[torch.nn.Module, set]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    shape = {} if GPU else dict(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=128)
    cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **shape)
    return GPT2LMHeadModel(cfg).to(device), {GPT2Block}


def run(impl: str) -> None:
    model, units = build()
    model = apply_fully_shard(model, units, True) if impl == "fully_shard" else ShardedModule(model, auto_wrap_policy=units, stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, model.config.vocab_size, (1, 128), device=device)
    forward, backward = [], []
    for i in range(args.steps):
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        sync()
        t1 = time.perf_counter()
        timing[0] = i >= WARMUP and impl != "fully_shard"
        loss.backward()
        timing[0] = False
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if i >= WARMUP:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    n = args.steps - WARMUP
    print(f"== {impl}: forward {statistics.median(forward) * 1e3:.1f} ms, backward {statistics.median(backward) * 1e3:.1f} ms "
          f"(medians of {n} steps)", flush=True)
    for name, total in sorted(TIMES.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {name:55s} {total / n * 1e3:8.2f} ms a backward  {COUNTS[name] / n:6.1f} calls", flush=True)
    TIMES.clear()
    COUNTS.clear()


for impl in ("fully_shard", "shardwrap s3", "fully_shard", "shardwrap s3"):  # twice: the first pair warms the host
    run(impl)
dist.destroy_process_group()
