"""ZeRO-Offload on one GPU: where the time goes, which stream each copy takes, and device memory.

    python benchmarks/offload_cuda.py                      # on a machine with a CUDA GPU
    python benchmarks/offload_cuda.py --device cpu --quick --optimizer sgd  # the plumbing only (the tests run this)

GPT-2 small (124M), AdamW, one rank over ``cpu:gloo,cuda:nccl``: shardwrap stage 3 and stage 2
with ``Offload("cpu")`` beside torch ``fully_shard`` with ``CPUOffloadPolicy``, the unwrapped
model and shardwrap stage 3 without offload, at a large batch (8 x 1024, activations dominate the
device) and a small one (1 x 128, the model states do). Per case: forward, backward and step
times with the device synchronized between them, the step time without those synchronizations,
the device peak over one step and the largest loss difference from the unwrapped model. Then a
profiler trace of two offloaded steps gives, per CUDA stream, the host-to-device and
device-to-host copies and how much of their time overlaps kernels on the compute stream.

Checks (exit status 1 if one fails): every offloaded run's losses equal the unwrapped model's to
1e-4; at the small batch the offloaded device peak is below the peak without offload; the shard
copies to the device run on a stream other than the compute stream and overlap it; at least a
quarter of the gradient copies' time to the host overlaps compute (these two not with --quick).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import finish_gpu_report  # noqa: E402  (benchmarks/common.py)
from shardwrap import Offload, ShardedModule  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
p.add_argument("--quick", action="store_true", help="a tiny model and few steps (plumbing only)")
p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
               help="sgd: SGD with momentum, which (unlike Adam) shows a gradient off by a constant factor")
p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
p.add_argument("--trace", action="store_true",
               help="also write the profiled shardwrap steps' trace (offload_cuda_trace.json.gz in --out)")
args = p.parse_args()
ON_GPU = args.device == "cuda"
if ON_GPU and not torch.cuda.is_available():
    sys.exit("offload_cuda: no CUDA device here; run it on a GPU machine (or pass --device cpu for the plumbing)")
device = torch.device("cuda", 0) if ON_GPU else torch.device("cpu")
if ON_GPU:
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29571")
dist.init_process_group("cpu:gloo,cuda:nccl" if ON_GPU else "gloo", rank=0, world_size=1)

SHAPE = dict(n_embd=64, n_layer=2, n_head=2, n_positions=64) if args.quick else dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024)
VOCAB = 256 if args.quick else 50257
BATCHES = [(2, 32), (1, 16)] if args.quick else [(8, 1024), (1, 128)]
STEPS, TIMED = (3, 2) if args.quick else (8, 6)


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def build() -> tuple[torch.nn.Module, type]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    extra = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0) if args.quick else {}
    cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **extra, **SHAPE)
    return GPT2LMHeadModel(cfg).to(device), GPT2Block


def wrap(impl: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, block = build()
    if impl.startswith("fully_shard"):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        policy = CPUOffloadPolicy() if "offload" in impl else OffloadPolicy()
        for m in [m for m in model.modules() if isinstance(m, block)]:
            fully_shard(m, offload_policy=policy)
        model = fully_shard(model, offload_policy=policy)
    elif impl != "single":  # "shardwrap s<stage>[ cpu-offload]"
        model = ShardedModule(model, auto_wrap_policy={block}, stage=int(impl.split()[1][1]),
                              offload=Offload("cpu") if "offload" in impl else None)
    if args.optimizer == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


def batch(step: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(step)).to(device)


def one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def timing_case(impl: str, shape: tuple[int, int]) -> tuple[dict[str, Any], list[float]]:
    model, opt = wrap(impl)
    phases, losses, rises = [], [], []  # rises: the device peak in backward above its start
    for step in range(STEPS):  # synchronized between phases: what each phase costs alone
        x = batch(step, shape)
        sync()
        t = [time.perf_counter()]
        loss = model(input_ids=x, labels=x).loss
        sync()
        t.append(time.perf_counter())
        if ON_GPU:
            torch.cuda.reset_peak_memory_stats()
            at_start = torch.cuda.memory_allocated()
        loss.backward()
        sync()
        if ON_GPU:
            rises.append((torch.cuda.max_memory_allocated() - at_start) / 2**20)
        t.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t.append(time.perf_counter())
        phases.append([(b - a) * 1e3 for a, b in zip(t, t[1:])])
        losses.append(loss.item())
    whole = []
    for step in range(STEPS, STEPS + TIMED):  # the whole step as a training loop runs it
        sync()
        t0 = time.perf_counter()
        losses.append(one_step(model, opt, batch(step, shape)))
        sync()
        whole.append((time.perf_counter() - t0) * 1e3)
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses.append(one_step(model, opt, batch(STEPS + TIMED, shape)))
    peak = torch.cuda.max_memory_allocated() / 2**20 if ON_GPU else float("nan")
    skip = min(3, STEPS - 1)  # warm-up
    row = {name: statistics.median(ph[i] for ph in phases[skip:]) for i, name in enumerate(("fwd_ms", "bwd_ms", "step_ms"))}
    row.update(whole_ms=statistics.median(whole[1:] if len(whole) > 1 else whole), peak_mib=peak, loss=losses[-1],
               bwd_rise_mib=statistics.median(rises[skip:]) if rises else float("nan"))
    return row, losses


def profile_case(impl: str, shape: tuple[int, int]) -> dict[str, Any]:
    """Per CUDA stream: host-to-device and device-to-host copies, kernels, and their overlap with
    the compute stream's kernels, over two steps after three warm-up steps."""
    from torch.profiler import ProfilerActivity, profile

    model, opt = wrap(impl)
    for step in range(3):
        one_step(model, opt, batch(step, shape))
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(3, 5):
            one_step(model, opt, batch(step, shape))
        sync()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            events = json.load(g)["traceEvents"]
    if args.trace and impl.startswith("shardwrap"):
        import gzip

        with gzip.open(os.path.join(args.out, "offload_cuda_trace.json.gz"), "wt") as z:
            json.dump({"traceEvents": events}, z)
    per_stream: dict[int, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            per_stream.setdefault(int(e["args"]["stream"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    compute = max(per_stream, key=lambda s: sum(b - a for a, b, n in per_stream[s] if "Memcpy" not in n))
    busy = sorted((a, b) for a, b, n in per_stream[compute] if "Memcpy" not in n and "Memset" not in n)
    rows = []
    for stream, spans in sorted(per_stream.items()):
        for kind in ("HtoD", "DtoH", "DtoD", "kernels"):
            sel = [(a, b) for a, b, n in spans if (kind in n if kind != "kernels" else "Memcpy" not in n and "Memset" not in n)]
            if not sel:
                continue
            overlap = 0.0 if stream == compute else sum(max(0.0, min(b, d) - max(a, c)) for a, b in sel for c, d in busy if c < b and d > a)
            rows.append({"stream": stream, "compute": stream == compute, "what": kind, "n": len(sel),
                         "busy_us": sum(b - a for a, b in sel), "overlap_us": overlap})
    host_waits = sum(e["dur"] for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"])
    return {"rows": rows, "host waits for the device (us, 2 steps)": host_waits}


report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if ON_GPU else "cpu", "torch": torch.__version__, "shape": SHAPE}
failures: list[str] = []
IMPLS = ["single", "shardwrap s3", "shardwrap s2 cpu-offload", "shardwrap s3 cpu-offload",
         *(["fully_shard", "fully_shard cpu-offload"] if ON_GPU else [])]  # CPUOffloadPolicy needs an accelerator
timing: dict[str, dict[str, Any]] = {}
for shape in BATCHES:
    ref: list[float] = []
    for impl in IMPLS:
        row, losses = timing_case(impl, shape)
        ref = losses if impl == "single" else ref
        row["max |loss - single|"] = max(abs(a - b) for a, b in zip(losses, ref))
        key = f"{impl} @ {shape[0]}x{shape[1]}"
        timing[key] = row
        print(f"[offload_cuda] {key}: {row}", flush=True)
        if row["max |loss - single|"] > 1e-4:
            failures.append(f"{key}: losses differ from the unwrapped model's by {row['max |loss - single|']}")
        gc.collect()
    small = f"{shape[0]}x{shape[1]}"
    if ON_GPU and shape == BATCHES[-1] and not timing[f"shardwrap s3 cpu-offload @ {small}"]["peak_mib"] < timing[f"shardwrap s3 @ {small}"]["peak_mib"]:
        failures.append(f"device peak at {small}: offload does not lower it")
report["timing"] = timing
profiles = {impl: profile_case(impl, BATCHES[0]) for impl in ["shardwrap s3 cpu-offload", "fully_shard cpu-offload"] if ON_GPU}
report["streams"] = profiles
if ON_GPU and not args.quick:  # a toy model leaves no compute to overlap
    h2d = [r for r in profiles["shardwrap s3 cpu-offload"]["rows"] if r["what"] == "HtoD" and not r["compute"]]
    if not h2d or sum(r["overlap_us"] for r in h2d) <= 0:
        failures.append(f"shard copies to the device: not on a stream of their own, or never beside compute: {h2d}")
    # A gradient is copied to the host as soon as it is reduced, beside the backward of the units
    # before it; only the last unit's copy (the root's) has no compute left to hide behind.
    d2h = [r for r in profiles["shardwrap s3 cpu-offload"]["rows"] if r["what"] == "DtoH" and not r["compute"]]
    if not d2h or sum(r["overlap_us"] for r in d2h) < 0.25 * sum(r["busy_us"] for r in d2h):
        failures.append(f"gradient copies to the host: under a quarter of their time beside compute: {d2h}")
dist.destroy_process_group()

lines = [f"# Offload on one GPU: {report['device']}, torch {report['torch']}, GPT-2 {SHAPE}, {args.optimizer}, one rank\n",
         "| impl @ batch | forward ms | backward ms | step ms | whole step ms | device peak MiB | backward's rise MiB | max abs loss diff |",
         "|---|---|---|---|---|---|---|---|"]
lines += [f"| {k} | {v['fwd_ms']:.1f} | {v['bwd_ms']:.1f} | {v['step_ms']:.1f} | {v['whole_ms']:.1f} | {v['peak_mib']:.0f} | "
          f"{v['bwd_rise_mib']:.0f} | {v['max |loss - single|']:.1e} |" for k, v in timing.items()]
lines.append("\nForward, backward and step: synchronized between phases (median after warm-up). Whole step: no synchronization "
             "inside it. Backward's rise: the device peak during backward above the memory allocated when it began.")
for impl, prof in profiles.items():
    lines += [f"\n## Streams: {impl}, batch {BATCHES[0][0]}x{BATCHES[0][1]}, two steps\n",
              "| stream | what | count | busy us | overlapping compute us |", "|---|---|---|---|---|"]
    lines += [f"| {r['stream']}{' (compute)' if r['compute'] else ''} | {r['what']} | {r['n']} | {r['busy_us']:.0f} | {r['overlap_us']:.0f} |" for r in prof["rows"]]
    lines.append(f"\nThe host waited for the device {prof['host waits for the device (us, 2 steps)'] / 1e3:.0f} ms in these two steps.")
finish_gpu_report(args.out, "offload_cuda", lines, report, failures, ON_GPU)
