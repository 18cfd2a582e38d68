"""The CUDA path on one GPU (one rank over NCCL): what the CPU test suite cannot see.

    python benchmarks/cuda_check.py                      # on a machine with a CUDA GPU
    python benchmarks/cuda_check.py --device cpu --quick  # the same plumbing on gloo (the tests run this)

Five checks, one report (benchmarks/results/cuda_check.md and .json); the exit status is 1 if a
check fails:

1. parity: shardwrap stages 1, 2 and 3 train the same as the unwrapped model on the same device,
   in fp32 (TF32 off), under a bf16 policy (bf16 compute, fp32 reduce, fp32 master), and with
   ``Offload("cpu")`` at stages 2 and 3, whose parameters must be the host shards themselves;
   clipping with and without offload; offload with a parameterless root, ``model.to(device)``
   after wrapping and an evaluation forward between backward and step (SGD + momentum);
   gradients unused at some steps or at every step and a block frozen after wrapping, at stages 2
   and 3 and with offload (SGD + momentum + weight decay); no host waits: one step under torch's
   sync debug mode must show no wait from shardwrap's lines, and a step queued behind a sleep
   kernel must return while the GPU is still busy (not yet run on a GPU: added at stop 37);
2. overlap: a profiler trace of stage-3 bf16 steps shows on which CUDA streams the all-gathers and
   reduce-scatters run, and how much of their time overlaps kernels on the compute stream;
3. speed and memory: median step time (CUDA events) and peak allocated memory of shardwrap s1, s2,
   s3 and s3 without prefetch beside fully_shard (reshard_after_forward True and False), FSDP1
   FULL_SHARD and DDP, on the same model and data, and shardwrap s3 and fully_shard with every
   block compiled (torch.compile, fullgraph) with their first step's time (the compile), and
   shardwrap s3 with ``Offload("cpu")`` beside fully_shard with ``CPUOffloadPolicy`` (the device
   peak is the offload's point: only the units in use and their gradients stay on the GPU);
4. the main job: examples/train_gpt2.py under torchrun with nccl, unchanged, in bf16;
5. offload on the device: benchmarks/offload_cuda.py (per-phase times, which stream each shard and
   gradient copy takes and how much of it overlaps compute, the device peak at a small batch, all
   beside fully_shard with CPUOffloadPolicy), which writes benchmarks/results/offload_cuda.md.

With one rank the collectives move no bytes across GPUs but still run as NCCL work on NCCL's
streams, which is what the overlap check needs; cross-GPU bandwidth is not measured here, and
FSDP1 turns FULL_SHARD into NO_SHARD at one rank, so the timings show per-step overheads only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

from common import apply_fully_shard, finish_gpu_report  # noqa: E402  (benchmarks/common.py)
from shardwrap import MixedPrecision, Offload, ShardedModule  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
p.add_argument("--quick", action="store_true", help="a tiny model and few steps (plumbing only)")
p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
p.add_argument("--only", default="", help="comma-separated case-name prefixes to run (e.g. 'syncs,overlap,speed'; "
               "'main job' and 'offload on the device' name the last two checks); the rest are left out of the report")
args = p.parse_args()

if args.device == "cuda" and not torch.cuda.is_available():
    sys.exit("cuda_check: no CUDA device here; run it on a GPU machine (or pass --device cpu for the plumbing)")
ON_GPU = args.device == "cuda"
device = torch.device("cuda", 0) if ON_GPU else torch.device("cpu")
if ON_GPU:
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29561")
dist.init_process_group("nccl" if ON_GPU else "gloo", rank=0, world_size=1)

# GPT-2 small (124M) on the GPU; a toy on the CPU.
SHAPE = dict(n_embd=64, n_layer=2, n_head=2, n_positions=64) if args.quick else dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024)
BATCH, SEQ = (2, 32) if args.quick else (8, 1024)
STEPS, WARMUP = (2, 1) if args.quick else (10, 3)
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build() -> tuple[nn.Module, set]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    vocab = {} if not args.quick else dict(vocab_size=256, bos_token_id=0, eos_token_id=0)
    # use_cache=False: a training step needs no key/value cache, and newer transformers guard the
    # compiled block on the cache's per-layer state, which recompiles every layer under fullgraph
    cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **vocab, **SHAPE)
    return GPT2LMHeadModel(cfg).to(device), {GPT2Block}


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    vocab = 256 if args.quick else 50257
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g).to(device)


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def wrap(impl: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, units = build()
    if impl.endswith(" compiled"):  # torchtitan's recipe: every block compiled (fullgraph) before sharding
        import torch._dynamo as dynamo

        dynamo.reset()
        for block in [m for m in model.modules() if isinstance(m, tuple(units))]:
            block.compile(fullgraph=True)
        impl = impl.removesuffix(" compiled")
    if impl == "single":
        pass
    elif impl == "ddp":
        model = DDP(model, device_ids=[0] if ON_GPU else None)
    elif impl == "fsdp1 FULL_SHARD":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(units), sharding_strategy=ShardingStrategy.FULL_SHARD,
                     device_id=device, use_orig_params=True)
    elif impl == "fully_shard cpu-offload":  # CPUOffloadPolicy: shards, grads and the step on the host
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        for m in model.modules():
            if isinstance(m, tuple(units)):
                fully_shard(m, offload_policy=CPUOffloadPolicy())
        model = fully_shard(model, offload_policy=CPUOffloadPolicy())
    elif impl.startswith("fully_shard"):
        model = apply_fully_shard(model, units, reshard_after_forward="False" not in impl)
    else:  # "shardwrap s<stage>[ bf16][ no-prefetch][ cpu-offload]"
        stage = int(impl.split()[1][1])
        model = ShardedModule(model, auto_wrap_policy=units, stage=stage, max_unsharded=1 if "no-prefetch" in impl else 2,
                              mixed_precision=BF16 if "bf16" in impl else None,
                              offload=Offload("cpu") if "cpu-offload" in impl else None)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> tuple[list[float], list[float]]:
    """``steps`` optimizer steps; returns the losses and the step times in ms."""
    losses, times = [], []
    for step in range(start, start + steps):
        x = batch(step)
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    return losses, times


report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if ON_GPU else "cpu", "torch": torch.__version__,
                          "shape": SHAPE, "batch": [BATCH, SEQ]}
failures: list[str] = []


ONLY = [o.strip() for o in args.only.split(",") if o.strip()]


def wanted(what: str) -> bool:
    return not ONLY or any(what.startswith(o) for o in ONLY)


def attempt(what: str, fn: Any, *a: Any) -> Any:
    """Run one case; a case that raises is a failure in the report, and the next case still runs
    (a GPU lease is too short to lose the rest of the run to one error). A case ``--only`` leaves
    out returns None and is not a failure."""
    if not wanted(what):
        return None
    t0 = time.perf_counter()
    try:
        out = fn(*a)
    except Exception as e:  # noqa: BLE001  (reported below, never swallowed)
        import traceback

        failures.append(f"{what}: raised {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
        out = None
    finally:
        # The wrappers hold reference cycles: without a collection one case's model and optimizer
        # stay allocated into the next case and inflate its peak (seen on an H200: +0.5 to 1.4 GiB).
        gc.collect()
        if ON_GPU:
            torch.cuda.empty_cache()
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items() if k != "streams"} if isinstance(out, dict) else out
    print(f"[cuda_check] {what}: {'RAISED' if out is None else shown} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return out

# ---- 1. parity ----------------------------------------------------------------------------------
ref_model, _ = build()
init_state = {k: v.detach().float().cpu().clone() for k, v in ref_model.state_dict().items()}
ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-4, weight_decay=0.1)
ref_losses, _ = train(ref_model, ref_opt, STEPS if wanted("parity") else 1)
ref_state = {k: v.detach().float().cpu().clone() for k, v in ref_model.state_dict().items()}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The 2-norm of the difference over every entry the two state dicts share."""
    return sum(((a[k].float() - b[k]) ** 2).sum().item() for k in b if k in a) ** 0.5


moved = distance(ref_state, init_state)  # how far training took the reference
del ref_model, ref_opt
parity: dict[str, dict[str, Any]] = {}


def parity_case(impl: str) -> dict[str, Any]:
    model, opt = wrap(impl)
    losses, _ = train(model, opt, STEPS)
    full = model.full_state_dict()
    worst = max((full[k].float() - v).abs().max().item() for k, v in ref_state.items() if k in full)
    drift = distance(full, ref_state) / moved
    loss_gap = max(abs(a - b) for a, b in zip(losses, ref_losses))
    master = {str(p.dtype) for p in model.parameters()}
    # where the optimizer's parameters live: the host with offload (the shards themselves, not
    # copies on the GPU), else the training device
    devices = sorted({p.device.type for p in model.parameters()})
    bf16 = "bf16" in impl
    # fp32: equal up to reduction order. On a GPU cuBLAS may pick another kernel for a view into a
    # flat buffer than for a parameter of its own, and AdamW turns a last-bit difference in a near-zero
    # gradient into a step of up to lr, so the parameters are compared as a distance relative to how
    # far training moved them (measured on an H200: 7e-6 to 1e-5, max abs 1.1e-5 at lr 1e-4), not
    # element by element. bf16: the loss within bf16's resolution and the parameters closer to the
    # fp32 reference than training took the reference from its initial values.
    ok = (loss_gap < 0.05 and drift < 1.0) if bf16 else (loss_gap < 1e-4 and drift < 1e-4)
    ok = ok and master == {"torch.float32"} and devices == ["cpu" if "offload" in impl else device.type]
    return {"max |param - ref|": worst, "|params - ref| / |ref - init|": drift, "max |loss - ref|": loss_gap,
            "master dtypes": sorted(master), "devices": devices, "ok": ok}


for impl in ["shardwrap s1", "shardwrap s2", "shardwrap s3", "shardwrap s1 bf16", "shardwrap s2 bf16", "shardwrap s3 bf16",
             "shardwrap s2 cpu-offload", "shardwrap s3 cpu-offload"]:
    row = attempt(f"parity {impl}", parity_case, impl)
    if row is not None:
        parity[impl] = row
        if not row["ok"]:
            failures.append(f"parity {impl}: {row}")
report["parity"] = parity


def clip_norm(impl: str) -> float:
    """The whole gradient's norm after one backward, from ``model.clip_grad_norm_`` (torch's on the
    unwrapped model); clipping must also reach offloaded gradients, which live on the host."""
    model, _ = wrap(impl)
    x = batch(0)
    model(input_ids=x, labels=x).loss.backward()
    if impl == "single":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item()
    return model.clip_grad_norm_(0.5).item()


clip_ref = attempt("clip single", clip_norm, "single")
clips: dict[str, float] = {}
for impl in ["shardwrap s3", "shardwrap s3 cpu-offload"]:
    norm = attempt(f"clip {impl}", clip_norm, impl)
    if norm is not None and clip_ref is not None:
        clips[impl] = norm
        if abs(norm - clip_ref) > 1e-4 * clip_ref:
            failures.append(f"clip {impl}: norm {norm} against {clip_ref} unwrapped")
report["clip"] = {"single": clip_ref, **clips}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def offload_extras(stage: int) -> dict[str, Any]:
    """Offload in what a training loop does besides the step: a root unit with no parameters of its
    own (the device clip_grad_norm_ computes on comes from it), ``model.to(device)`` after wrapping
    (Lightning and accelerate call it), and an evaluation forward between backward and step (its
    shard copies must be read before the host step rewrites the shards). SGD with momentum against
    the unwrapped model."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[Block() for _ in range(3)]).to(device)
    model = nn.Sequential(*[Block() for _ in range(3)]).to(device)
    model.load_state_dict(ref.state_dict())
    model = ShardedModule(model, auto_wrap_policy={Block}, stage=stage, offload=Offload("cpu"))
    model.to(device)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    for step in range(4):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(step)).to(device)
        for m, opt in zip((ref, model), opts):
            m(x).pow(2).mean().backward()
            with torch.no_grad():
                m(x * 2)  # an evaluation between backward and step
            if m is ref:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.005)  # below the norm (~0.02): it clips
            else:
                model.clip_grad_norm_(0.005)
            opt.step()
            opt.zero_grad()
    full = model.full_state_dict()
    gap = max((full[k].float().cpu() - v.float().cpu()).abs().max().item() for k, v in ref.state_dict().items())
    devices = sorted({p.device.type for p in model.parameters()})
    ok = gap < 1e-5 and devices == ["cpu"]
    if not ok:
        failures.append(f"offload extras s{stage}: max |param - ref| {gap}, parameters on {devices}")
    return {"max |param - ref|": gap, "devices": devices, "ok": ok}


extras = {f"s{stage}": attempt(f"offload extras s{stage}", offload_extras, stage) for stage in (2, 3)}
report["offload extras"] = extras


class Branchy(nn.Module):
    """Three blocks, a side block used on even steps only, and a projection never used: the
    used-flags that ride in each unit's reduce-scatter decide which gradients stay ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.side = Block()
        self.blocks[2].unused = nn.Linear(256, 8)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.side(x) if step % 2 == 0 else x


def unused_and_frozen(impl: str) -> dict[str, Any]:
    """Gradients that are unused at some steps or at every step, and a block frozen after wrapping
    (from step 2 on): SGD with momentum and weight decay (which moves a parameter handed a zero
    gradient instead of ``None``) against the unwrapped model."""
    torch.manual_seed(0)
    ref = Branchy().to(device)
    model = Branchy().to(device)
    model.load_state_dict(ref.state_dict())
    stage = int(impl[1])
    model = ShardedModule(model, auto_wrap_policy={Block}, stage=stage,
                          offload=Offload("cpu") if "offload" in impl else None)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1) for m in (ref, model)]
    unused = dict(model.named_parameters())["blocks.2.unused.weight"]
    unused_grads = []
    for step in range(5):
        if step == 2:
            ref.blocks[0].requires_grad_(False)
            model.module.blocks[0].requires_grad_(False)
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(step)).to(device)
        for m, opt in zip((ref, model), opts):
            m(x, step).pow(2).mean().backward()
            if m is model:
                unused_grads.append(unused.grad is not None)
            opt.step()
            opt.zero_grad()
    full = model.full_state_dict()
    gap = max((full[k].float().cpu() - v.float().cpu()).abs().max().item() for k, v in ref.state_dict().items())
    ok = gap < 1e-5 and not any(unused_grads)
    if not ok:
        failures.append(f"unused and frozen {impl}: max |param - ref| {gap}, a never-used parameter got a gradient "
                        f"at steps {[i for i, g in enumerate(unused_grads) if g]}")
    return {"max |param - ref|": gap, "ok": ok}


sparse = {impl: attempt(f"unused and frozen {impl}", unused_and_frozen, impl) for impl in ("s2", "s3", "s3 offload")}
report["unused and frozen"] = sparse


def host_syncs(impl: str) -> dict[str, Any]:
    """Where shardwrap makes the host wait for the device inside a training step (after warm-up):
    torch's sync debug mode warns at each synchronizing call (a read of a device value, a copy from
    pageable memory), and the warnings raised from shardwrap's own lines are listed. A wait there
    stops the host from running ahead of the GPU, and the step takes the host's time plus the
    device's (seen at stop 37: a copy of the used-flags per unit cost GPT-2 small 31 ms a step)."""
    import warnings

    model, opt = wrap(impl)
    train(model, opt, 1)
    import traceback

    pkg = os.path.join(ROOT, "shardwrap")
    torch_pkg = os.path.dirname(os.path.abspath(torch.__file__))
    found: set[str] = set()
    elsewhere: set[str] = set()  # the model's own waits (not shardwrap's), for the record

    def note(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        # the innermost frame outside torch's own package: a wait inside torch code that shardwrap
        # calls (DTensor, the optimizer, distributed_c10d) is shardwrap's, but one in the model's
        # own code is not (transformers 5's causal-mask code reads a device value on every forward,
        # seen on the H100 at stop 40: the unwrapped model waits there too)
        if "synchroniz" in str(message):
            stack = [f for f in traceback.extract_stack()[:-1]
                     if not os.path.abspath(f.filename).startswith(torch_pkg) and not f.filename.endswith("warnings.py")]
            inner = stack[-1] if stack else None
            if inner is not None and os.path.abspath(inner.filename).startswith(pkg):
                found.add(f"{os.path.relpath(inner.filename, ROOT)}:{inner.lineno}")
            elif inner is not None:
                elsewhere.add(f"{os.path.basename(inner.filename)}:{inner.lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            x = batch(1)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = sorted(found)
    if sites:
        failures.append(f"host syncs {impl}: the host waits for the device at {sites}")
    return {"sites": sites, "the model's own": sorted(elsewhere), "ok": not sites}


syncs = {impl: attempt(f"syncs {impl}", host_syncs, impl) for impl in ("shardwrap s1", "shardwrap s2", "shardwrap s3", "shardwrap s3 bf16")} \
    if ON_GPU else {}
report["host syncs"] = syncs


class CheckpointedBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, x, use_reentrant=False)


def host_runs_ahead(impl: str) -> dict[str, Any]:
    """Whether the host can queue a whole step while the GPU is still busy, which catches every
    kind of wait, also those torch's sync debug mode does not see (``Event.synchronize``, a
    blocking ``Work.wait()``, a non-blocking copy from pageable memory): a sleep kernel of about a
    second is queued on the compute stream, then one step (forward, backward,
    ``model.clip_grad_norm_``, the optimizer step; ``no_sync``: two micro-batches) of a small model
    whose launches fit in the queue. If the stream is still busy when the host is done, nothing in
    the step waited for the device."""
    block = CheckpointedBlock if "checkpointed" in impl else Block
    torch.manual_seed(0)
    model = ShardedModule(nn.Sequential(*[block() for _ in range(3)]).to(device), auto_wrap_policy={block},
                          stage=int(impl[1]), mixed_precision=BF16 if "bf16" in impl else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        # drawn on the device: a copy from pageable host memory would itself wait for the sleep
        x = torch.randn(32, 256, device=device, generator=torch.Generator(device).manual_seed(i))
        if "no_sync" in impl:
            with model.no_sync():
                model(x).pow(2).mean().backward()
        model(x).pow(2).mean().backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    for i in range(2):  # the first steps set things up (and may wait)
        step(i)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # clock cycles: about a second at the H100's ~2 GHz
    t0 = time.perf_counter()
    step(2)
    host_ms = (time.perf_counter() - t0) * 1e3
    ahead = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    if not ahead:
        failures.append(f"host runs ahead {impl}: the step waited for the device (the host took {host_ms:.0f} ms)")
    return {"host ms": host_ms, "ran ahead": ahead, "ok": ahead}


ahead = {impl: attempt(f"syncs ahead {impl}", host_runs_ahead, impl)
         for impl in ("s1", "s2", "s3", "s3 bf16", "s3 no_sync", "s3 checkpointed")} if ON_GPU else {}
report["host runs ahead"] = ahead

# ---- 2. overlap ---------------------------------------------------------------------------------


def stream_overlap(events: list[dict]) -> dict[str, Any]:
    """Per CUDA stream: busy time and how much of it overlaps the compute stream (the stream with
    the most kernel time). Collective streams are the others."""
    per_stream: dict[int, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            per_stream.setdefault(int(e["args"]["stream"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    if not per_stream:
        return {"streams": {}}
    compute = max(per_stream, key=lambda s: sum(b - a for a, b, n in per_stream[s] if "nccl" not in n.lower()))
    busy = sorted((a, b) for a, b, _ in per_stream[compute])
    out: dict[str, Any] = {"compute_stream": compute, "streams": {}}
    for stream, spans in per_stream.items():
        if stream == compute:
            continue
        total = sum(b - a for a, b, _ in spans)
        overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b, _ in spans for c, d in busy if c < b and d > a)
        kinds = sorted({k for _, _, n in spans for k in ("AllGather", "ReduceScatter") if k in n})
        out["streams"][stream] = {"events": len(spans), "busy_us": total, "overlap_us": overlap, "collectives": kinds,
                                  "names": sorted({n[:60] for _, _, n in spans})[:4]}
    return out


def overlap_case() -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    model, opt = wrap("shardwrap s3 bf16")
    train(model, opt, WARMUP)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train(model, opt, 3, start=WARMUP)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            trace = json.load(g)
    found = stream_overlap(trace["traceEvents"])
    others = found["streams"]
    if not others:
        failures.append("overlap: no CUDA work outside the compute stream (collectives ran on the compute stream?)")
    elif sum(s["overlap_us"] for s in others.values()) <= 0:
        failures.append("overlap: collective streams never overlap the compute stream")
    return found


overlap: dict[str, Any] = (attempt("overlap", overlap_case) or {"skipped": "raised (see Result)"}) if ON_GPU \
    else {"skipped": "no CUDA streams on cpu"}
report["overlap"] = overlap

# ---- 3. speed and memory ------------------------------------------------------------------------
speed: dict[str, dict[str, Any]] = {}


def speed_case(impl: str) -> dict[str, Any]:
    model, opt = wrap(impl)
    _, warm = train(model, opt, WARMUP)
    gc.collect()
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
    losses, times = train(model, opt, STEPS, start=WARMUP)
    peak = torch.cuda.max_memory_allocated() / 2**20 if ON_GPU else float("nan")
    return {"step_ms": statistics.median(times), "peak_mib": peak, "loss": losses[-1],
            "first_step_s": warm[0] / 1e3}  # with compile: compile time + one step


for impl in ["ddp", "fsdp1 FULL_SHARD", "fully_shard", "fully_shard raf=False", "shardwrap s1", "shardwrap s2",
             "shardwrap s3", "shardwrap s3 no-prefetch", "shardwrap s3 bf16",
             # the compiled rows' first step compiles (15-20 s on 2 CPU cores); the CPU plumbing that CI runs
             # leaves them out, since tests/test_compile.py compiles shardwrap's blocks already
             *(["fully_shard compiled", "shardwrap s3 compiled"] if ON_GPU or not args.quick else []),
             *(["fully_shard cpu-offload"] if ON_GPU else []),  # CPUOffloadPolicy needs an accelerator
             "shardwrap s3 cpu-offload"]:
    row = attempt(f"speed {impl}", speed_case, impl)
    if row is not None:
        speed[impl] = row
nan = float("nan")
ref = speed.get("fully_shard", {"step_ms": nan, "peak_mib": nan, "first_step_s": nan})
for row in speed.values():
    row["time / fully_shard"] = row["step_ms"] / ref["step_ms"]
    row["peak / fully_shard"] = row["peak_mib"] / ref["peak_mib"] if ON_GPU else nan
report["speed"] = speed
dist.destroy_process_group()

# ---- 4. the main job ----------------------------------------------------------------------------
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "examples/train_gpt2.py",
       "--steps", "30" if not args.quick else "4", "--log-every", "10" if not args.quick else "2"]
if ON_GPU:
    cmd += ["--mixed-precision", "bf16"]
env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0" if ON_GPU else "",
       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}  # shardwrap from this checkout
try:
    run = subprocess.run(cmd if wanted("main job") else ["true"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
except subprocess.TimeoutExpired as e:
    run = subprocess.CompletedProcess(cmd, 124, str(e.stdout or ""), f"timed out after 300 s: {e.stderr or ''}")
done = re.search(r"done: loss ([\d.]+) -> ([\d.]+)", run.stdout)
main_job = {"returncode": run.returncode, "loss": done.groups() if done else None,
            "backend line": next((ln for ln in run.stdout.splitlines() if "nccl" in ln or "gloo" in ln), "")}
report["main job"] = main_job
if wanted("main job") and (run.returncode != 0 or done is None or (not args.quick and float(done.group(2)) >= float(done.group(1)))):
    failures.append(f"main job: {main_job}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")

# ---- 5. offload on the device --------------------------------------------------------------------
# benchmarks/offload_cuda.py: per-phase times, the copy streams and the device peak of Offload("cpu")
# beside fully_shard's CPUOffloadPolicy (its own process: it starts its own process group).
cmd_off = [sys.executable, "benchmarks/offload_cuda.py", "--out", args.out]
cmd_off += [] if ON_GPU else ["--device", "cpu", "--quick", "--optimizer", "sgd"]
try:
    # a port of its own: this process's store still listens on MASTER_PORT
    # every host core for the host's optimizer step, as ZeRO-Offload's users run it
    off_env = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"} if ON_GPU else env
    off = subprocess.run(cmd_off if wanted("offload on the device") else ["echo", "all checks passed"], cwd=ROOT, env={**off_env, "MASTER_PORT": "29572"}, capture_output=True, text=True, timeout=400)
except subprocess.TimeoutExpired as e:
    off = subprocess.CompletedProcess(cmd_off, 124, str(e.stdout or ""), f"timed out after 400 s: {e.stderr or ''}")
report["offload on the device"] = {"returncode": off.returncode}
if off.returncode != 0 or "all checks passed" not in off.stdout:
    failures.append(f"offload_cuda: exit {off.returncode}\n{off.stdout[-2000:]}\n{off.stderr[-2000:]}")

# ---- report -------------------------------------------------------------------------------------
lines = [f"# CUDA check: {report['device']}, torch {report['torch']}, GPT-2 {SHAPE}, batch {BATCH} x {SEQ}, one rank\n",
         "## Parity against the unwrapped model on the same device\n",
         "| run | max abs param diff | param distance / training distance | max abs loss diff | master dtypes | on | ok |",
         "|---|---|---|---|---|---|---|"]
lines += [f"| {k} | {v['max |param - ref|']:.2e} | {v['|params - ref| / |ref - init|']:.3f} | {v['max |loss - ref|']:.2e} | "
          f"{', '.join(v['master dtypes'])} | {', '.join(v['devices'])} | {v['ok']} |" for k, v in parity.items()]
lines += [f"\n`clip_grad_norm_(0.5)` after one backward: unwrapped {clip_ref}, "
          + ", ".join(f"{k} {v}" for k, v in clips.items()) + "\n"]
lines += [f"\nOffload with a parameterless root, `model.to(device)`, an evaluation between backward and step and "
          f"clipping (SGD + momentum): " + ", ".join(f"{k}: {v}" for k, v in extras.items()) + "\n"]
lines += [f"\nUnused gradients (a side block used on even steps, a projection never used) and a block frozen after "
          f"wrapping (SGD + momentum + weight decay): " + ", ".join(f"{k}: {v}" for k, v in sparse.items()) + "\n"]
lines += ["\nWhere shardwrap's own lines make the host wait for the device in a step (torch's sync debug mode): "
          + (", ".join(f"{k}: {v['sites'] if v else 'not run'}" for k, v in syncs.items()) or "not run (no CUDA)") + "\n"]
lines += ["\nWhether the host queues a whole step (forward, backward, clip, optimizer step) while a sleep kernel "
          "holds the GPU: " + (", ".join(f"{k}: {v}" for k, v in ahead.items()) or "not run (no CUDA)") + "\n"]
lines += ["\n## Streams (stage 3, bf16)\n"]
if "streams" in overlap:
    lines += [f"compute stream: {overlap.get('compute_stream')}\n", "| stream | events | busy us | overlapping compute us | collectives | names |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {s} | {v['events']} | {v['busy_us']:.0f} | {v['overlap_us']:.0f} | {', '.join(v['collectives'])} | {'; '.join(v['names'])} |"
              for s, v in overlap["streams"].items()]
else:
    lines.append(overlap["skipped"])
lines += ["\n## Step time and peak memory (one rank)\n", "| impl | step ms | / fully_shard | peak MiB | / fully_shard | loss |",
          "|---|---|---|---|---|---|"]
lines += [f"| {k} | {v['step_ms']:.1f} | {v['time / fully_shard']:.2f} | {v['peak_mib']:.0f} | {v['peak / fully_shard']:.3f} | {v['loss']:.4f} |"
          for k, v in speed.items()]
lines += ["\nCompiled rows: every GPT-2 block `.compile(fullgraph=True)` before wrapping; first step (compile + one step): "
          + ", ".join(f"{k} {v['first_step_s']:.1f} s" for k, v in speed.items() if k.endswith("compiled"))
          + f" (eager fully_shard {ref['first_step_s']:.1f} s)."
          if ON_GPU or not args.quick else "\nCompiled rows: left out of the CPU plumbing run (`--quick` on CPU)."]
lines += [f"\n## Main job\n\n`{' '.join(cmd[1:])}`: exit {run.returncode}, loss {main_job['loss']}\n"]
lines += [f"\n## Offload on the device\n\n`{' '.join(cmd_off[1:])}`: exit {off.returncode}"
          + (" (benchmarks/results/offload_cuda.md)" if ON_GPU else "") + "\n"]
finish_gpu_report(args.out, "cuda_check", lines, report, failures, ON_GPU)
