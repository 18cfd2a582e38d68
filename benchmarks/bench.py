"""shardwrap side by side with torch fully_shard, FSDP1, DDP, DDP + ZeroRedundancyOptimizer and a
single process: same model, same data, same world size, one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/bench.py

Writes benchmarks/results/bench_W{W}.md and .png. Step times are medians over interleaved rounds;
ratios are to fully_shard in the same run. Memory comes from shardwrap/memory.py (live tensor
storages on CPU, sampled after every op): the peak is split into parameters (shards and unsharded
copies), gradients, optimizer state, activations (tensors autograd saved for backward) and other
(communication buffers, temporaries, gradients of activations in flight).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import statistics
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from common import HeapPeak, RecipeMLP, apply_ac, apply_fully_shard  # benchmarks/common.py (the script's folder is on sys.path)
from shardwrap.memory import (
    CATEGORIES, LiveStorages, model_state_bytes, optimizer_states, state_classifier, unsharded_tensors,
)

p = argparse.ArgumentParser()
p.add_argument("--models", default="mlp,gpt2")
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--steps", type=int, default=4, help="timed steps per implementation per round")
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
p.add_argument("--tag", default="", help="appended to the output names: bench_W{W}{tag}.md")
p.add_argument("--compile", action="store_true", help="add 'fully_shard compiled' and 'shardwrap s3 compiled': every "
               "block .compile(fullgraph=True) before wrapping (torchtitan's recipe); their compile time is reported")
p.add_argument("--previous", default="", metavar="REV", help="add 'previous s2' and 'previous s3': shardwrap stages 2 and 3 "
               "as of git revision REV (e.g. the main before a change), loaded beside the current package as shardwrap_prev")
p.add_argument("--impls", default="", help="comma-separated subset of the implementations (ddp and fully_shard always "
               "run); the '+AC' ones run on gpt2 by default and on mlp only when named here")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

IMPLS = [
    "single", "ddp", "ddp+zero", "fsdp1 FULL_SHARD", "fsdp1 SHARD_GRAD_OP", "fully_shard", "fully_shard raf=False",
    "shardwrap s1", "shardwrap s2", "shardwrap s3", "shardwrap s3 no-prefetch",
    # activation checkpointing (non-reentrant checkpoint_wrapper around every block, applied before wrapping)
    "fsdp1 FULL_SHARD +AC", "fully_shard +AC", "shardwrap s3 +AC",
]
if args.compile:
    IMPLS += ["fully_shard compiled", "shardwrap s3 compiled"]
    import torch._inductor.config

    torch._inductor.config.force_disable_caches = True  # compile for real each time: the compile times are the point
if args.previous:
    IMPLS += ["previous s2", "previous s3"]
AC_MODELS = {"gpt2"}  # the '+AC' rows run by default only here (the MLP's activations are tiny)
if args.impls:
    IMPLS = [i for i in IMPLS if i in {"ddp", "fully_shard", *args.impls.split(",")}]


def impls_for(name: str) -> list[str]:
    """The '+AC' and 'compiled' rows run on GPT-2 only (compiling a bare nn.Linear unit finds no frame
    Dynamo may trace: torch.nn's own files are skipped), unless named in --impls."""
    special = lambda i: "+AC" in i or i.endswith(" compiled")  # noqa: E731
    return [i for i in IMPLS if not special(i) or name in AC_MODELS or i in args.impls.split(",")]
ZERO = {  # steady-state (after the step) model-state bytes per element of Psi, fp32 AdamW
    "single": lambda W: 16, "ddp": lambda W: 16, "ddp+zero": lambda W: 8 + 8 / W,
    "fsdp1 FULL_SHARD": lambda W: 16 / W, "fsdp1 SHARD_GRAD_OP": lambda W: 16 / W,
    "fully_shard": lambda W: 16 / W, "fully_shard raf=False": lambda W: 16 / W,
    "shardwrap s1": lambda W: 8 + 8 / W, "shardwrap s2": lambda W: 16 / W, "shardwrap s3": lambda W: 16 / W,
    "shardwrap s3 no-prefetch": lambda W: 16 / W,
    "fsdp1 FULL_SHARD +AC": lambda W: 16 / W, "fully_shard +AC": lambda W: 16 / W, "shardwrap s3 +AC": lambda W: 16 / W,
    "fully_shard compiled": lambda W: 16 / W, "shardwrap s3 compiled": lambda W: 16 / W,
    "previous s2": lambda W: 16 / W, "previous s3": lambda W: 16 / W,
}


@functools.lru_cache(maxsize=None)  # one extraction per run, not one per round
def load_previous(rev: str):  # type: ignore[no-untyped-def]
    """The shardwrap package as of ``rev``, importable beside the current one: ``git archive`` into a
    temporary folder, renamed to ``shardwrap_prev`` with its own imports rewritten to match."""
    import re
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    root = Path(tempfile.mkdtemp(prefix="shardwrap_prev_"))
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "shardwrap"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / "shardwrap").rename(root / "shardwrap_prev")
    for f in (root / "shardwrap_prev").rglob("*.py"):
        f.write_text(re.sub(r"\bshardwrap\b", "shardwrap_prev", f.read_text()))
    sys.path.insert(0, str(root))
    import shardwrap_prev

    return shardwrap_prev


def release_memory() -> None:
    """Free what the last implementation left: its cycles (gc) and the heap pages glibc keeps for
    reuse (malloc_trim), so each implementation starts from the same resident memory. BENCH_RSS=1
    prints each rank's resident memory after every implementation (how the leak of deleted
    ShardedModules, design/architecture.md, showed up)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    if os.environ.get("BENCH_RSS"):
        with open("/proc/self/statm") as f:
            print(f"rank {rank} rss {int(f.read().split()[1]) * 4096 / 2**20:.0f} MiB", flush=True)


# ---- models and data ----------------------------------------------------------------------------
def build(name: str) -> tuple[nn.Module, set]:
    torch.manual_seed(0)
    if name == "mlp":
        return RecipeMLP(), {nn.Linear}
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = GPT2Config(vocab_size=256, n_positions=128, n_embd=256, n_layer=4, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     use_cache=False)  # training: no KV cache (under checkpoint_wrapper the recomputation would append to it)
    return GPT2LMHeadModel(cfg), {GPT2Block}


def batch(name: str, step: int, local: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16 * world, 2000, generator=g) if name == "mlp" else torch.randint(0, 256, (4 * world, 128), generator=g)
    return x.chunk(world)[rank] if local else x


def loss_of(name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean() if name == "mlp" else model(input_ids=x, labels=x).loss


def wrap(impl: str, name: str):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardwrap import ShardedModule

    model, units = build(name)
    if impl.endswith(" compiled"):
        import torch._dynamo as dynamo

        dynamo.reset()  # every compiled implementation compiles from scratch: the compile times compare
        for block in [m for m in model.modules() if isinstance(m, tuple(units))]:
            block.compile(fullgraph=True)
        impl = impl.removesuffix(" compiled")
    if impl.endswith("+AC"):
        apply_ac(model, units)  # the blocks stay findable: the policies below still make each one a unit
        impl = impl.removesuffix(" +AC")
    adamw = dict(lr=1e-4, weight_decay=0.1)
    if impl in ("single",):
        pass
    elif impl == "ddp":
        model = DDP(model)
    elif impl == "ddp+zero":
        model = DDP(model)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    elif impl.startswith("fsdp1"):
        strategy = ShardingStrategy.FULL_SHARD if "FULL" in impl else ShardingStrategy.SHARD_GRAD_OP
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(units), sharding_strategy=strategy,
                     device_id=torch.device("cpu"), use_orig_params=True)
    elif impl.startswith("fully_shard"):
        model = apply_fully_shard(model, units, reshard_after_forward="False" not in impl)
    elif impl.startswith("previous s"):
        model = load_previous(args.previous).ShardedModule(model, auto_wrap_policy=units, stage=int(impl[-1]))
    else:
        stage = int(impl.split()[1][1])
        model = ShardedModule(model, auto_wrap_policy=units, stage=stage, max_unsharded=1 if "no-prefetch" in impl else 2)
        blocks = {n for n, m in model.module.named_modules() if isinstance(m, tuple(units))}
        assert {u.name for u in model.units[1:]} == blocks, ([u.name for u in model.units], blocks)
    return model, torch.optim.AdamW(model.parameters(), **adamw)


def run_steps(impl, name, model, opt, steps, start=0, tracker=None):
    times, losses = [], []
    for step in range(start, start + steps):
        x = batch(name, step, local=impl != "single")
        t0 = time.perf_counter()
        loss = loss_of(name, model, x)
        loss.backward()
        if tracker is not None:
            tracker.sample()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if tracker is not None:
            tracker.sample()
        opt.zero_grad(set_to_none=True)
    return times, losses


class Tracker(LiveStorages):
    """LiveStorages that also counts as activations what non-reentrant checkpoint keeps for backward.

    LiveStorages sees saved tensors through its own saved_tensors_hooks, but inside a checkpointed
    region checkpoint's hooks are the innermost and win: the forward saves nothing there (right),
    and the recomputation in backward stores the saved tensors in the checkpoint frame, out of the
    tracker's sight (they would count as "other"). The block's inputs, which checkpoint saves
    outside its hooks, the tracker already sees. So while tracking, every new checkpoint frame is
    noted, and at each new peak the tensors its recomputation holds join the activations. Totals
    and peaks do not change; only the split does."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self._frames: weakref.WeakSet = weakref.WeakSet()

    def __enter__(self):  # type: ignore[no-untyped-def]
        import torch.utils.checkpoint as cp

        self._frame_init = cp._CheckpointFrame.__init__
        frames, orig = self._frames, self._frame_init

        def init(frame, *a, **k) -> None:
            orig(frame, *a, **k)
            frames.add(frame)

        cp._CheckpointFrame.__init__ = init
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        import torch.utils.checkpoint as cp

        super().__exit__(*exc)
        cp._CheckpointFrame.__init__ = self._frame_init

    def _split(self, live):  # type: ignore[no-untyped-def]
        held = [t for f in list(self._frames) for d in list(f.recomputed.values()) for t in list(d.values())]
        self._saved += [weakref.ref(t) for t in held]
        return super()._split(live)


results: dict[tuple[str, str], dict] = {}
for name in args.models.split(","):
    impls = impls_for(name)
    times: dict[str, list[float]] = {i: [] for i in impls}
    first_step: dict[str, list[float]] = {i: [] for i in impls}  # the first warm-up step (compiles, if anything does)
    losses: dict[str, float] = {}
    for rnd in range(args.rounds):
        order = impls if rnd % 2 == 0 else impls[::-1]  # interleave, alternating the order
        for impl in order:
            dist.barrier()
            if impl == "single" and rank != 0:
                dist.barrier()
                continue
            model, opt = wrap(impl, name)
            w, _ = run_steps(impl, name, model, opt, args.warmup)
            first_step[impl].append(w[0])
            t, l = run_steps(impl, name, model, opt, args.steps, start=args.warmup)
            times[impl] += t
            losses[impl] = l[-1]  # this rank's loss on its part of the batch
            del model, opt
            release_memory()
            if impl == "single":
                dist.barrier()
    # Memory pass: one implementation at a time, two steps under the tracker.
    memory = {}
    for impl in impls:
        dist.barrier()
        if impl == "single" and rank != 0:
            dist.barrier()
            continue
        model, opt = wrap(impl, name)
        run_steps(impl, name, model, opt, 1)  # optimizer state exists from here on
        heap = None
        if impl.endswith(" compiled") or f"{impl} compiled" in impls:  # compiled and eager alike, with HeapPeak
            with HeapPeak() as heap:
                run_steps(impl, name, model, opt, 1, start=1)
        if impl.endswith(" compiled"):  # torch.compile will not run under the tracker's dispatch mode
            loss_of(name, model, batch(name, 2, local=True)).backward()
            opt.step()
            memory[impl] = {"peak": None, "steady": None, **model_state_bytes(model, opt), "at_peak": None,
                            "heap_peak": heap.peak, "psi": sum(q.numel() for q in build(name)[0].parameters())}
            del model, opt
            release_memory()
            continue
        tracker = Tracker(list(model.parameters()) + list(model.buffers()) + unsharded_tensors(model), every=1,
                               classify=state_classifier(model, opt))
        tracker.track(optimizer_states(opt))  # created before the tracker
        with tracker:
            run_steps(impl, name, model, opt, 1, start=1, tracker=tracker)
            # steady state: after the step, before zero_grad
            x = batch(name, 2, local=impl != "single")
            loss_of(name, model, x).backward()
            opt.step()
            steady = tracker.sample()
            split = model_state_bytes(model, opt)
        memory[impl] = {"peak": tracker.peak, "steady": steady, **split, "at_peak": tracker.peak_split}
        psi = sum(q.numel() for q in build(name)[0].parameters())
        memory[impl]["psi"] = psi
        memory[impl]["heap_peak"] = None if heap is None else heap.peak
        tracker.classify = None  # the tracker and its hooks form a cycle: free the model now
        del model, opt, tracker
        release_memory()
        if impl == "single":
            dist.barrier()
    # Gather rank 0's and rank 1's figures.
    mine = {"times": times, "first_step": first_step, "losses": losses, "memory": memory}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    results[name] = everyone

def global_loss(ranks: list, impl: str) -> float:
    """The loss on the whole global batch: single's own, or the mean of the ranks' equal parts."""
    if impl == "single":
        return ranks[0]["losses"][impl]
    return sum(r["losses"][impl] for r in ranks) / len(ranks)


if rank == 0:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"bench_W{world}{args.tag}.json"), "w") as f:
        json.dump(results, f)
    lines = [f"# Benchmark: W={world}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
             f"{args.rounds} interleaved rounds x {args.steps} timed steps, fp32 AdamW\n"]
    for name, ranks in results.items():
        r0 = ranks[0]
        psi = r0["memory"]["ddp"]["psi"]
        ref = statistics.median(r0["times"]["fully_shard"])
        lines.append(f"\n## {name} (Psi = {psi / 1e6:.2f}M parameters)\n")
        ref_peak = r0["memory"]["fully_shard"]["peak"]
        lines.append("| implementation | step ms (median) | / fully_shard | final loss | peak MiB r0 / r1 | peak / fully_shard "
                     "| at peak r0: params / grads / optim / activations / other MiB | steady MiB r0 | model state / ZeRO formula |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        checks = []
        impls = [i for i in IMPLS if i in r0["times"]]
        for impl in impls:
            med = statistics.median(r0["times"][impl]) * 1e3
            m0 = r0["memory"][impl]
            peak1 = ranks[1]["memory"].get(impl, {}).get("peak") if world > 1 else None
            model_state = m0["params"] + m0["grads"] + m0["optim"]
            formula = ZERO[impl](world if impl != "single" else 1) * psi  # bytes
            if m0["peak"] is None:  # compiled: no tracker (see the compiled line below the table)
                lines.append(f"| {impl} | {med:.0f} | {med / (ref * 1e3):.2f} | {global_loss(ranks, impl):.5f} | - | - | - | - | "
                             f"{model_state / formula:.3f} |")
                continue
            split = " / ".join(f"{m0['at_peak'][c] / 2**20:.1f}" for c in CATEGORIES)
            lines.append(
                f"| {impl} | {med:.0f} | {med / (ref * 1e3):.2f} | {global_loss(ranks, impl):.5f} | "
                f"{m0['peak'] / 2**20:.1f} / {'-' if peak1 is None else f'{peak1 / 2**20:.1f}'} | {m0['peak'] / ref_peak:.3f} | "
                f"{split} | {m0['steady'] / 2**20:.1f} | {model_state / formula:.3f} |"
            )
            if impl.startswith("shardwrap"):
                ok = abs(model_state / formula - 1) <= 0.05
                checks.append(f"{impl}: {model_state / 2**20:.2f} MiB vs formula {formula / 2**20:.2f} MiB "
                              f"({'within' if ok else 'NOT within'} 5%)")
        lines.append("\n'model state' is the parameters, gradients and AdamW state after the optimizer step (distinct "
                     "storages, before zero_grad); the ZeRO formula is 16 bytes per parameter divided as the "
                     "implementation divides them (DDP's buckets and ZeroRedundancyOptimizer's full gradients show "
                     "above 1). 'steady' is every live storage at that moment.\n")
        lines.append("ZeRO formula check (shardwrap): " + "; ".join(checks) + ".")
        ref_loss = global_loss(ranks, "ddp")
        worst = max(impls, key=lambda i: abs(global_loss(ranks, i) - ref_loss))
        lines.append(f"\nLoss check: the largest difference from ddp's global loss ({ref_loss:.7f}) is "
                     f"{abs(global_loss(ranks, worst) - ref_loss):.2e} ({worst}).")
        compiled = [(i.removesuffix(" compiled"), i) for i in impls if i.endswith(" compiled") and i.removesuffix(" compiled") in impls]
        if compiled:
            step = lambda i: statistics.median(r0["times"][i]) * 1e3  # noqa: E731
            compile_s = lambda i: statistics.median(r0["first_step"][i]) - statistics.median(r0["times"][i])  # noqa: E731
            heap = lambda i: r0["memory"][i]["heap_peak"] / 2**20  # noqa: E731
            lines.append("\nCompiled (every block `.compile(fullgraph=True)` before wrapping; rank 0, eager -> compiled): " + "; ".join(
                f"{base}: step {step(base):.0f} -> {step(c):.0f} ms ({step(c) / step(base):.2f}x), step's heap peak "
                f"{heap(base):.1f} -> {heap(c):.1f} MiB, compile time {compile_s(c):.1f} s" for base, c in compiled) + ". "
                "Compile time is the first step's time less a steady step's (median over rounds; Dynamo is reset before each "
                "compiled model). The heap peak is the most heap in use during one step above its level before the step "
                "(glibc's mallinfo2 polled by a thread, `HeapPeak` in benchmarks/common.py), for eager and compiled alike: "
                "torch.compile will not run under the tracker that gives the table's peaks.")
        ac = [(i.removesuffix(" +AC"), i) for i in impls if i.endswith("+AC") and i.removesuffix(" +AC") in impls]
        if ac:
            act = lambda i: r0["memory"][i]["at_peak"]["activations"] / 2**20  # noqa: E731
            peak = lambda i: r0["memory"][i]["peak"] / 2**20  # noqa: E731
            step = lambda i: statistics.median(r0["times"][i]) * 1e3  # noqa: E731
            lines.append("\nActivation checkpointing (rank 0, activations at the peak / peak MiB / step ms, without -> with AC): " + "; ".join(
                f"{base}: {act(base):.1f} -> {act(withac):.1f} / {peak(base):.1f} -> {peak(withac):.1f} / "
                f"{step(base):.0f} -> {step(withac):.0f}" for base, withac in ac) + ". With AC, activations are what autograd "
                "saved outside the checkpointed blocks, the blocks' inputs checkpoint keeps, and the tensors of the block "
                "being recomputed.")
    text = "\n".join(lines) + "\n"
    path = os.path.join(args.out, f"bench_W{world}{args.tag}.md")
    with open(path, "w") as f:
        f.write(text)
    print(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(len(results), 2, figsize=(14, 4.5 * len(results)), squeeze=False)
        for row, (name, ranks) in enumerate(results.items()):
            r0 = ranks[0]
            labels = [i for i in IMPLS if i in r0["times"]]
            ax = axes[row][0]
            bottom = [0.0] * len(labels)
            for cat in CATEGORIES:
                vals = [(r0["memory"][i]["at_peak"] or {cat: 0})[cat] / 2**20 for i in labels]
                ax.bar(labels, vals, bottom=bottom, label=cat)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_title(f"{name}: rank-0 peak memory by category (MiB)")
            ax.tick_params(axis="x", rotation=60)
            ax.legend(fontsize=7)
            ax = axes[row][1]
            ax.bar(labels, [statistics.median(r0["times"][i]) * 1e3 for i in labels], color="gray")
            ax.set_title(f"{name}: median step time (ms)")
            ax.tick_params(axis="x", rotation=60)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"bench_W{world}{args.tag}.png"), dpi=80)
    except ImportError:
        print("matplotlib not installed: no plot")
dist.barrier()
dist.destroy_process_group()
