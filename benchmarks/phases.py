"""Where a GPT-2 step's time goes: forward, backward and the optimizer step, per implementation,
interleaved in one run (rank 0's medians).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/phases.py --rounds 8

"shardwrap s3 no-header" turns off the 16-byte header all-gather before each data all-gather
(``Unit._check_in_step``, design/notes/rank-agreement.md) to measure what that round trip costs;
it is not a supported mode (ranks that diverge would then abort in gloo instead of raising).
"stage-2 floor" is a hand-written stage-2 step with no hooks (``Stage2Floor``): the same exchanges,
the least copying, nothing else; the distance to it is what shardwrap's own machinery costs.
"shardwrap s2 unit by unit" gathers one unit ahead in forward, as stages 1 and 3 do, instead of
every unit when the forward starts (``schedule.gather_all_ahead = False``; design/notes/prefetch.md).

Beside the wall-clock phases it reports, per step, the process's CPU time (every thread: compute,
gloo's I/O threads, shardwrap's waiter) and the main thread's, so a gap to DDP splits into work
and waiting. ``--hooks`` also times shardwrap's hooks (main-thread CPU, and wall time, whose excess
over CPU is time spent blocked in a collective or preempted), for design/notes/cpu-collectives.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--impls", default="fully_shard,shardwrap s3,shardwrap s3 no-header,fsdp1,ddp")
p.add_argument("--rounds", type=int, default=8)
p.add_argument("--steps", type=int, default=4, help="timed steps per implementation per round (after 2 warm-up)")
p.add_argument("--hooks", action="store_true", help="also time shardwrap's hooks (CPU and wall, main thread)")
args = p.parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy  # noqa: E402
from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import models  # noqa: E402  (tests/models.py: GPT-2 from a config, random weights)
from common import apply_fully_shard  # noqa: E402
from shardwrap import ShardedModule  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
BLOCK = models.gpt2_block_class()

HOOKS = {"Unit": ("pre_forward", "post_forward", "pre_backward", "_post_accumulate_grad"),
         "ShardedModule": ("_finish_backward",)}
hook_times: dict[str, dict[str, list[float]]] = {}  # impl -> hook -> [cpu s, wall s] summed over timed steps
current = {"impl": None}  # the implementation whose timed step is running (None: not timing)


def time_hooks() -> None:
    """Wrap shardwrap's hooks to add their main-thread CPU and wall time to ``hook_times`` (the
    outermost hook only: one that calls another is counted once)."""
    import functools

    import shardwrap.sharded_module
    import shardwrap.unit

    depth = [0]
    for cls in (shardwrap.unit.Unit, shardwrap.sharded_module.ShardedModule):
        for name in HOOKS[cls.__name__]:
            def timed(f, label=f"{cls.__name__}.{name}"):
                @functools.wraps(f)
                def call(*a, **k):
                    if depth[0] or current["impl"] is None:
                        return f(*a, **k)
                    depth[0] += 1
                    c, w = time.thread_time(), time.perf_counter()
                    try:
                        return f(*a, **k)
                    finally:
                        acc = hook_times.setdefault(current["impl"], {}).setdefault(label, [0.0, 0.0])
                        acc[0] += time.thread_time() - c
                        acc[1] += time.perf_counter() - w
                        depth[0] -= 1
                return call

            setattr(cls, name, timed(getattr(cls, name)))


if args.hooks:
    time_hooks()


class Stage2Floor(torch.nn.Module):
    """The least a stage-2 step does on gloo, with no hooks: every unit's flat shard (the root's own
    parameters and each block's) all-gathered pairwise at the start of the forward (one send and
    one receive per peer and unit, as shardwrap posts them) and copied out into plain parameters;
    after the backward each unit's gradients packed rank-major, averaged and reduce-scattered
    pairwise; AdamW on the flat shards. Not a usable implementation (nothing overlaps, no checks);
    the yardstick for shardwrap's own cost (design/notes/cpu-collectives.md, "The floor")."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        blocks = [m for m in model.modules() if isinstance(m, BLOCK)]
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        self.units = [[p for p in model.parameters() if id(p) not in in_blocks]] + [list(b.parameters()) for b in blocks]
        self.shards = []
        for params in self.units:
            numel = sum(p.numel() for p in params)
            flat = torch.zeros(numel + (-numel) % world)
            flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
            self.shards.append(flat.view(world, -1)[rank].clone().requires_grad_(True))
        self.reduce_group = dist.new_group(list(range(world)))

    def exchange(self, sends: list, recvs: list, group=None) -> list:
        ops = [dist.P2POp(dist.isend, t, p, group) for t, p in sends] + [dist.P2POp(dist.irecv, t, p, group) for t, p in recvs]
        return dist.batch_isend_irecv(ops)

    def forward(self, **kwargs):  # type: ignore[no-untyped-def]
        peers = [r for r in range(world) if r != rank]
        posted = []
        for params, shard in zip(self.units, self.shards):
            rows = torch.empty(world, shard.numel())
            posted.append((params, rows, self.exchange([(shard.detach(), p) for p in peers], [(rows[p], p) for p in peers])))
        with torch.no_grad():
            for (params, rows, works), shard in zip(posted, self.shards):
                rows[rank].copy_(shard)
                for w in works:
                    w.wait()
                numel = sum(p.numel() for p in params)
                torch._foreach_copy_([p.data for p in params],
                                     [v.view_as(p) for v, p in zip(rows.view(-1)[:numel].split([p.numel() for p in params]), params)])
        return self.model(**kwargs)

    def after_backward(self) -> None:
        peers = [r for r in range(world) if r != rank]
        posted = []
        for params, shard in reversed(list(zip(self.units, self.shards))):
            numel = sum(p.numel() for p in params)
            flat = torch.cat([p.grad.reshape(-1) for p in params] + [torch.zeros(world * shard.numel() - numel)]).div_(world)
            rows, out = flat.view(world, -1), torch.empty(world - 1, shard.numel())
            works = self.exchange([(rows[p], p) for p in peers], [(o, p) for o, p in zip(out, peers)], self.reduce_group)
            posted.append((shard, rows[rank], out, works))
        for shard, own, out, works in posted:
            for w in works:
                w.wait()
            shard.grad = own.clone().add_(out.sum(0)) if world > 2 else out[0].add_(own)
        for p in self.model.parameters():
            p.grad = None


def wrap(impl: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = models.gpt2(n_layer=4, n_embd=256, n_head=4, vocab_size=256, n_positions=128, use_cache=False)
    if impl == "stage-2 floor":
        floor = Stage2Floor(model)
        return floor, torch.optim.AdamW(floor.shards, lr=1e-4, weight_decay=0.1)
    if impl == "ddp":
        model = DDP(model)
    elif impl == "fsdp1":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({BLOCK}), sharding_strategy=ShardingStrategy.FULL_SHARD,
                     device_id=torch.device("cpu"), use_orig_params=True)
    elif impl == "fully_shard":
        model = apply_fully_shard(model, {BLOCK}, True)
    elif impl.startswith("shardwrap s"):
        model = ShardedModule(model, auto_wrap_policy={BLOCK}, stage=int(impl.split()[1][1]))
        if "unit by unit" in impl:  # stage 2 gathers one unit ahead, as stages 1 and 3 do
            model.schedule.gather_all_ahead = False
        if impl.endswith("no-header"):
            for unit in model.units:
                unit._check_in_step = lambda *args, **kwargs: None  # type: ignore[method-assign]
    else:
        p.error(f"unknown implementation {impl!r}")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (4 * world, 128), generator=g).chunk(world)[rank]


impls = [i.strip() for i in args.impls.split(",") if i.strip()]
built = {i: wrap(i) for i in impls}
PHASES = ("forward", "backward", "optimizer", "step", "process CPU", "main-thread CPU")
times: dict[str, dict[str, list[float]]] = {i: {k: [] for k in PHASES} for i in impls}
last_loss: dict[str, float] = {}
for _ in range(args.rounds):
    for impl in impls:
        model, opt = built[impl]
        for step in range(2 + args.steps):
            x = batch(step)
            dist.barrier()
            current["impl"] = impl if step >= 2 else None
            t0, p0, c0 = time.perf_counter(), time.process_time(), time.thread_time()
            loss = model(input_ids=x, labels=x).loss
            t1 = time.perf_counter()
            last_loss[impl] = loss.item()
            loss.backward()
            if isinstance(model, Stage2Floor):
                model.after_backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3, p3, c3 = time.perf_counter(), time.process_time(), time.thread_time()
            current["impl"] = None
            if step >= 2:
                for key, s in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, p3 - p0, c3 - c0)):
                    times[impl][key].append(s * 1000)
if rank == 0:
    print(f"\nGPT-2 (4 x 256), W={world}, rank 0, median ms over {args.rounds} interleaved rounds x {args.steps} steps\n")
    print("| implementation | " + " | ".join(PHASES) + " | last loss (rank 0) |\n|---|" + "---|" * (len(PHASES) + 1))
    for impl in impls:
        print(f"| {impl} | " + " | ".join(f"{statistics.median(v):.1f}" for v in times[impl].values()) + f" | {last_loss[impl]:.6f} |")
    if hook_times:
        timed_steps = args.rounds * args.steps
        print(f"\nshardwrap's hooks, rank 0, ms per step (mean over {timed_steps} steps): main-thread CPU / wall\n")
        labels = [f"{c}.{n}" for c, names in HOOKS.items() for n in names]
        print("| implementation | " + " | ".join(labels) + " | all hooks |\n|---|" + "---|" * (len(labels) + 1))
        for impl, per in hook_times.items():
            cells = [per.get(label, [0.0, 0.0]) for label in labels]
            cells.append([sum(c[0] for c in cells), sum(c[1] for c in cells)])
            print(f"| {impl} | " + " | ".join(f"{c * 1e3 / timed_steps:.1f} / {w * 1e3 / timed_steps:.1f}" for c, w in cells) + " |")
dist.destroy_process_group()
