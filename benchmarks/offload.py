"""ZeRO-Infinity on this machine: train a GPT whose fp32 AdamW model states (16 bytes per
parameter) exceed the machine's memory, with ``Offload(optimizer="disk")``, at W=2 on 2 CPU ranks.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/offload.py --path /var/tmp/offload
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/offload.py --size small --compare

``--size xl`` (default): 48 blocks of width 1600 and an untied 50257-word head, 1.63 B parameters
(16 bytes each: 26 GB). It is built on the meta device and materialized unit by unit straight
into its shards (the full model is never in memory), then trained for ``--steps`` AdamW steps.
Each step reports its time, each rank's peak anonymous memory (RssAnon, polled from
/proc/self/status: file-backed pages of the mapped shards do not count), the bytes the rank read
and wrote on disk (/proc/self/io) and the loss; the estimator's prediction for the same run and
its verdict on the run without offload are printed beside them.

``--compare`` (a size that fits): the same steps in memory and with disk offload, from the same
initial values; the parameters must end bit-identical, and the step times give the cost.
``--release-pages`` asks the kernel to write back and drop the mapped pages after each step.
``--bf16`` computes in bf16 (``MixedPrecision(param_dtype=torch.bfloat16)``; the master shards
and the state stay fp32, so the disk moves the same bytes) and ``--fused`` steps with
``AdamW(fused=True)``, which the pager runs one unit at a time: what a DeepSpeed ZeRO-Infinity
user runs (bf16 and its fused CPU Adam).
Results go to benchmarks/results/offload_{size}_W{W}.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import tempfile
import threading
import time

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--size", choices=["xl", "medium", "small"], default="xl")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--seq", type=int, default=64, help="tokens per rank per step")
p.add_argument("--path", default="", help="directory for the offload files (default: a new one under /var/tmp)")
p.add_argument("--compare", action="store_true", help="also train in memory and check the results are equal")
p.add_argument("--release-pages", action="store_true")
p.add_argument("--no-page-by-unit", action="store_true",
               help="keep each unit's file pages during the optimizer step (shardwrap.offload.PAGE_BY_UNIT = False)")
p.add_argument("--no-spares", action="store_true", help="free every unsharded buffer at once (shardwrap.spare.REUSE = False)")
p.add_argument("--no-trim", action="store_true", help="keep glibc's free heap pages (shardwrap.spare.TRIM = False)")
p.add_argument("--no-populate", action="store_true",
               help="let the optimizer step fault in its file pages one by one (shardwrap.offload.POPULATE = False)")
p.add_argument("--bf16", action="store_true", help="MixedPrecision(param_dtype=torch.bfloat16): gathers, compute and reduce-scatters in bf16; fp32 master and state")
p.add_argument("--fused", action="store_true", help="AdamW(fused=True): one kernel per unit's parameters (the pager splits it), as DeepSpeed's CPU Adam")
p.add_argument("--tag", default="", help="appended to the result files' names")
p.add_argument("--dd-mib", type=int, default=2048, help="size of the dd bandwidth probe (0: skip)")
p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
p.add_argument("--timeline", action="store_true",
               help="also report, for the disk run's last step on rank 0, the peak RssAnon while each unit runs forward or "
                    "backward, beside the gradient shards alive then")
p.add_argument("--no-thp", action="store_true",
               help="leave torch's THP_MEM_ALLOC_ENABLE unset (default: 1, huge pages for large CPU buffers, set before torch loads)")
args = p.parse_args()
if not args.no_thp:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read once, at torch's first allocation

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardwrap import MixedPrecision, Offload, ShardedModule
import shardwrap.offload
import shardwrap.spare

shardwrap.offload.PAGE_BY_UNIT = not args.no_page_by_unit
shardwrap.spare.REUSE = not args.no_spares
shardwrap.spare.TRIM = not args.no_trim
shardwrap.offload.POPULATE = shardwrap.offload.POPULATE and not args.no_populate

SIZES = {"xl": (48, 1600, 25), "medium": (24, 1024, 16), "small": (4, 256, 4)}  # blocks, width, heads
VOCAB = 50257
GiB = 2**30


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer: int, d: int, heads: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(1024, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1).float(), ids.roll(-1, 1).flatten())


def unit_policy(module: nn.Module) -> bool:  # each block, the embeddings and the head
    return isinstance(module, (Block, nn.Embedding)) or (isinstance(module, nn.Linear) and module.out_features == VOCAB)


class Sampler:
    """Peak RssAnon of this process while open (a thread polls /proc/self/status)."""

    def __enter__(self) -> "Sampler":
        self.peak, self._stop = rss_anon(), threading.Event()
        self.file_peak = rss_file()
        self.marker = ""  # --timeline: what runs now; per marker, first-seen order: [peak RssAnon, bytes alive]
        self.marks: dict[str, list[int]] = {}
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def mark(self, what: str, live: int = 0) -> None:
        self.marks.setdefault(what, [rss_anon(), live])  # before the marker: the poller reads marks[marker]
        self.marker = what

    def _poll(self) -> None:
        while not self._stop.wait(0.01):
            marker = self.marker  # before the sample: a sample taken after a new mark is not charged to the old part
            anon = rss_anon()
            self.peak = max(self.peak, anon)
            self.file_peak = max(self.file_peak, rss_file())
            if marker:
                self.marks[marker][0] = max(self.marks[marker][0], anon)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def rss_anon() -> int:
    return _status("RssAnon:")


def rss_file() -> int:
    """Resident pages of mapped files: the offload files' pages this process has touched."""
    return _status("RssFile:")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def device_io_bytes(device: str) -> tuple[int, int]:
    """Bytes read and written by the disk itself (/proc/diskstats, 512-byte sectors): what both ranks
    and the kernel's writeback moved, whenever it happened."""
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if fields[2] == device:
                return int(fields[5]) * 512, int(fields[9]) * 512
    return 0, 0


def disk_of(path: str) -> str:
    """The block device (name in /proc/diskstats) holding ``path``."""
    dev = os.stat(path).st_dev
    try:
        name = os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
    except OSError:
        return ""
    return name


def io_bytes() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def dd_bandwidth(directory: str, mib: int) -> tuple[float, float]:
    """Write and read ``mib`` MiB with O_DIRECT through dd: the disk's own MB/s, no page cache."""
    target = os.path.join(directory, "dd-probe")
    rates = []
    for cmd in (
        ["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={mib // 4}", "oflag=direct", "conv=fsync"],
        ["dd", f"if={target}", "of=/dev/null", "bs=4M", "iflag=direct"],
    ):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        rates.append(mib * 2**20 / (time.perf_counter() - start))
    os.remove(target)
    return rates[0], rates[1]


def train(offload: Offload | None, label: str) -> dict:
    n_layer, d, heads = SIZES[args.size]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(n_layer, d, heads)
    psi = sum(p.numel() for p in model.parameters())
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules() if unit_policy(m)]  # forward order
    units.insert(0, psi - sum(units))  # the root unit, first: what no policy unit took
    start = time.perf_counter()
    with Sampler() as wrap_mem:
        sharded = ShardedModule(model, auto_wrap_policy=unit_policy, stage=3, offload=offload, mixed_precision=PRECISION)
    wrap_time = time.perf_counter() - start
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4, fused=args.fused or None)
    timeline: dict[str, list[int]] = {}
    watch: list[Sampler] = []  # the sampler of the step the timeline records
    if args.timeline and offload is not None and rank == 0:
        grads = [p for p in sharded.parameters()]

        def live() -> int:  # bytes of the gradient shards alive now
            return sum(p.grad.to_local().nbytes for p in grads if p.grad is not None)

        def mark(what: str, with_live: bool) -> None:
            if watch:
                watch[0].mark(what, live() if with_live else 0)

        for name, module in sharded.named_modules():
            if unit_policy(module):
                module.register_forward_pre_hook(lambda m, a, n=name: mark(f"forward {n}", False))
                module.register_full_backward_pre_hook(lambda m, g, n=name: mark(f"backward {n}", True))
    ids = torch.randint(0, VOCAB, (1, args.seq), generator=torch.Generator().manual_seed(rank + 1))
    steps = []
    for step in range(args.steps):
        dist.barrier()
        read0, written0 = io_bytes()
        dev0 = device_io_bytes(DEVICE)
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        with Sampler() as mem:
            if args.timeline and offload is not None and rank == 0 and step == args.steps - 1:
                watch.append(mem)
                mem.mark("start of the step")
            loss = sharded(ids)
            fwd_s = time.perf_counter() - start
            usage_fwd = resource.getrusage(resource.RUSAGE_SELF)
            loss.backward()
            bwd_s = time.perf_counter() - start - fwd_s
            usage_bwd = resource.getrusage(resource.RUSAGE_SELF)
            if watch:
                mem.mark("opt.step()", sum(p.grad.to_local().nbytes for p in sharded.parameters() if p.grad is not None))
            before_step_file = rss_file()
            opt_start = time.perf_counter()
            with Sampler() as step_mem:
                opt.step()
            opt_s = time.perf_counter() - opt_start
            if watch:
                mem.mark("zero_grad()")
            opt.zero_grad(set_to_none=True)
            if watch:
                mem.mark("after zero_grad()")
            if args.release_pages and sharded._offload_store is not None:
                sharded._offload_store.release_pages()
            dist.barrier()
        read1, written1 = io_bytes()
        dev1 = device_io_bytes(DEVICE)
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
        phases = [usage0, usage_fwd, usage_bwd, usage1]
        cpu = {f"{kind}_{name}": getattr(b, field) - getattr(a, field)
               for name, a, b in zip(("fwd", "bwd", "rest"), phases, phases[1:])
               for kind, field in (("user", "ru_utime"), ("sys", "ru_stime"), ("faults", "ru_minflt"))}
        steps.append({**cpu, "user_s": usage1.ru_utime - usage0.ru_utime, "sys_s": usage1.ru_stime - usage0.ru_stime,
                      "faults": usage1.ru_minflt - usage0.ru_minflt + usage1.ru_majflt - usage0.ru_majflt,
                      "spares_reused": sharded._spares.reused,"fwd_s": fwd_s, "bwd_s": bwd_s, "disk_read": dev1[0] - dev0[0], "disk_written": dev1[1] - dev0[1],
            "time_s": time.perf_counter() - start, "peak_anon": mem.peak, "peak_file": mem.file_peak, "read": read1 - read0,
            "step_file_before": before_step_file, "step_peak_file": step_mem.file_peak, "opt_s": opt_s,
            "written": written1 - written0, "loss": loss.item(),
        })
        if rank == 0:
            s = steps[-1]
            print(f"{label} step {step}: {s['time_s']:.1f} s (forward {s['fwd_s']:.1f}, backward {s['bwd_s']:.1f}, "
                  f"opt.step {s['opt_s']:.1f}; cpu user {s['user_s']:.1f} sys {s['sys_s']:.1f} (user/sys forward {s['user_fwd']:.1f}/{s['sys_fwd']:.1f}, "
                  f"backward {s['user_bwd']:.1f}/{s['sys_bwd']:.1f}, opt.step and zero_grad {s['user_rest']:.1f}/{s['sys_rest']:.1f}), {s['faults'] / 1e6:.2f} M page faults, "
                  f"{s['spares_reused']} spares reused; disk read {s['disk_read'] / GiB:.2f} GiB, written {s['disk_written'] / GiB:.2f}), peak RssAnon {s['peak_anon'] / GiB:.2f} GiB, "
                  f"read {s['read'] / GiB:.2f} GiB, written {s['written'] / GiB:.2f} GiB, loss {s['loss']:.4f}", flush=True)
    final = {n: p.detach().to_local().clone() for n, p in sharded.named_parameters()} if args.compare else {}
    del sharded, opt
    if watch:
        timeline = dict(watch[0].marks)
        watch.clear()
    return {"psi": psi, "units": units, "wrap_s": wrap_time, "wrap_peak_anon": wrap_mem.peak, "steps": steps, "final": final,
            "timeline": timeline}


PRECISION = MixedPrecision(param_dtype=torch.bfloat16) if args.bf16 else None
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
box = [args.path or (tempfile.mkdtemp(prefix="shardwrap-offload-", dir="/var/tmp") if rank == 0 else None)]
dist.broadcast_object_list(box)
root: str = box[0]
os.makedirs(root, exist_ok=True)
DEVICE = disk_of(root)

os.sync()  # the writeback of whatever ran before must not slow the probe
dd_before = dd_bandwidth(root, args.dd_mib) if rank == 0 and args.dd_mib else (0.0, 0.0)
baseline_anon = rss_anon()  # torch and gloo, before any model
runs = {"disk": train(Offload("disk", path=root), "disk")}
if args.compare:
    runs["memory"] = train(None, "memory")
    same = all(torch.equal(runs["disk"]["final"][n], v) for n, v in runs["memory"]["final"].items())
    agreed = [False] * world
    dist.all_gather_object(agreed, same)

dist.barrier()
os.sync()
# This virtual disk's rates move by 2x between probes minutes apart. The bound takes the faster
# of the probes before and after the run, which is the stricter bound.
dd_after = dd_bandwidth(root, args.dd_mib) if rank == 0 and args.dd_mib else (0.0, 0.0)
dd = (max(dd_before[0], dd_after[0]), max(dd_before[1], dd_after[1]))
gathered: list = [None] * world
dist.all_gather_object(gathered, {k: {**v, "final": None} for k, v in runs.items()} | {"baseline_anon": baseline_anon})
if rank == 0:
    from shardwrap import estimate

    psi = runs["disk"]["psi"]
    n_layer, d, _ = SIZES[args.size]
    units = runs["disk"]["units"]
    offloaded = estimate.offload_formula(psi, units, world, "bf16" if args.bf16 else "none", "disk")[3]
    plain = estimate.formula(psi, max(units), world, "none")[3]
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peaks = [max(s["peak_anon"] for s in g["disk"]["steps"]) for g in gathered]
    baselines = [g["baseline_anon"] for g in gathered]
    lines = [
        f"# Disk offload (ZeRO-Infinity): GPT {args.size}, {psi / 1e9:.2f} B parameters, W={world}, AdamW, stage 3",
        "",
        f"Model states in full: 16 x {psi / 1e9:.2f} B = {16 * psi / GiB:.1f} GiB, this machine's memory: "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.1f} GiB. dd on the offload disk (O_DIRECT, "
        f"{args.dd_mib} MiB), before the run: write {dd_before[0] / 2**20:.0f} MiB/s, read {dd_before[1] / 2**20:.0f} MiB/s; "
        f"after it: write {dd_after[0] / 2**20:.0f} MiB/s, read {dd_after[1] / 2**20:.0f} MiB/s. "
        f"Precision: {'bf16 (MixedPrecision(param_dtype=torch.bfloat16))' if args.bf16 else 'fp32'}; AdamW "
        f"{'fused=True' if args.fused else 'as torch defaults it (a loop over the parameters on a CPU)'}; "
        f"the step's file pages {'faulted in a tensor at a time (MADV_POPULATE_WRITE)' if shardwrap.offload.POPULATE and shardwrap.offload.PAGE_BY_UNIT else 'faulted in page by page'}.",
        f"Each rank's RssAnon before any model (torch, gloo): "
        + ", ".join(f"rank {r} {g['baseline_anon'] / GiB:.2f} GiB" for r, g in enumerate(gathered)),
        f"Wrap (materialize unit by unit into the files): {runs['disk']['wrap_s']:.1f} s, peak RssAnon "
        + ", ".join(f"rank {r} {g['disk']['wrap_peak_anon'] / GiB:.2f} GiB" for r, g in enumerate(gathered)),
        "",
        "| run | step | time s | opt.step() s | peak RssAnon per rank GiB | peak RssFile per rank GiB | RssFile before opt.step() GiB | peak RssFile in opt.step() GiB | read per rank GiB | written per rank GiB | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in runs:
        for i in range(args.steps):
            per = [g[label]["steps"][i] for g in gathered]
            lines.append(
                f"| {label} | {i} | {per[0]['time_s']:.1f} | {per[0]['opt_s']:.1f} | " + " / ".join(f"{s['peak_anon'] / GiB:.2f}" for s in per)
                + " | " + " / ".join(f"{s['peak_file'] / GiB:.2f}" for s in per)
                + " | " + " / ".join(f"{s['step_file_before'] / GiB:.2f}" for s in per)
                + " | " + " / ".join(f"{s['step_peak_file'] / GiB:.2f}" for s in per)
                + " | " + " / ".join(f"{s['read'] / GiB:.2f}" for s in per) + " | "
                + " / ".join(f"{s['written'] / GiB:.2f}" for s in per) + f" | {per[0]['loss']:.4f} |"
            )
    if dd[0] and dd[1]:
        lines += [
            "",
            f"Where each step's time goes, and the disk ({DEVICE}) as a whole: bytes it read and wrote for both ranks and the "
            "kernel's writeback during the step, and the least time those take at dd's rates (the bound).",
            "",
            "| run | step | time s | forward s | backward s | opt.step() s | rank 0 CPU user / kernel s | disk read GiB | disk written GiB | bound s | time / bound |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label in runs:
            for i in range(args.steps):
                s = runs[label]["steps"][i]
                bound = s["disk_read"] / dd[1] + s["disk_written"] / dd[0]
                lines.append(
                    f"| {label} | {i} | {s['time_s']:.1f} | {s['fwd_s']:.1f} | {s['bwd_s']:.1f} | {s['opt_s']:.1f} | {s['user_s']:.1f} / {s['sys_s']:.1f} | "
                    f"{s['disk_read'] / GiB:.2f} | {s['disk_written'] / GiB:.2f} | {bound:.1f} | "
                    + (f"{s['time_s'] / bound:.2f} |" if bound > 0 else "- |")
                )
    if args.compare:
        lines += ["", f"Disk offload and in-memory training end bit-identical on every rank: {all(agreed)}"]
    if runs["disk"]["timeline"]:
        marks = list(runs["disk"]["timeline"].items())
        top = max(range(len(marks)), key=lambda i: marks[i][1][0])
        lines += ["", f"Rank 0's RssAnon through the last step: the peak from the start of each part to the start of the "
                  f"next (a unit's part begins at its forward or backward pre-hook; the forward's units in one row; of the "
                  f"backward, every 8th unit, the first and last two and those around the step's peak, at "
                  f"'{marks[top][0]}'), beside the gradient shards alive when the part began. The hooks that mark the "
                  f"parts run inside the step: take times from a run without --timeline.", "",
                  "| part | peak RssAnon GiB | gradient shards alive GiB |", "|---|---|---|"]
        forward = [v[0] for k, v in marks if k.startswith("forward ")]
        backward = [i for i, (k, _) in enumerate(marks) if k.startswith("backward ")]
        for i, (k, (peak, alive)) in enumerate(marks):
            if k.startswith("forward "):
                if i == next(j for j, (n, _) in enumerate(marks) if n.startswith("forward ")):
                    lines.append(f"| forward ({len(forward)} units) | {max(forward) / GiB:.2f} | - |")
            elif i in backward:
                at = backward.index(i)
                if at % 8 == 0 or at < 2 or at >= len(backward) - 2 or abs(i - top) <= 1:
                    lines.append(f"| {k} | {peak / GiB:.2f} | {alive / GiB:.2f} |")
            else:
                lines.append(f"| {k} | {peak / GiB:.2f} | {alive / GiB:.2f} |" if k == "opt.step()" else f"| {k} | {peak / GiB:.2f} | - |")
    lines += [
        "",
        f"Estimator (`shardwrap.estimate.offload_formula`, this model's units, stage 3, disk): model-state RAM per rank "
        f"{offloaded['cpu_only_ram'] / GiB:.2f} GiB at the backward's peak (the gradient shards then alive beside the "
        f"running unit's working set; all the gradient shards: {offloaded['host'] / GiB:.2f}) and "
        f"{offloaded['disk'] / GiB:.2f} GiB of files; with each rank's RssAnon before "
        f"the model added: " + ", ".join(f"rank {r} {(offloaded['cpu_only_ram'] + b) / GiB:.2f} GiB" for r, b in enumerate(baselines))
        + ". Measured peak RssAnon over the steps: " + ", ".join(
            f"rank {r} {pk / GiB:.2f} GiB ({pk / (offloaded['cpu_only_ram'] + b) - 1:+.1%})" for r, (pk, b) in enumerate(zip(peaks, baselines))),
        f"Without offload the estimator counts {plain['total'] / GiB:.2f} GiB per rank, {world * plain['total'] / GiB:.2f} GiB "
        f"for the {world} ranks against this machine's {machine / GiB:.1f} GiB: "
        + ("it does not fit." if world * plain["total"] > machine else "it fits."),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    name = f"offload_{args.size}_W{world}{args.tag}{'_release' if args.release_pages else ''}{'_nopager' if args.no_page_by_unit else ''}"
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"dd_write": dd[0], "dd_read": dd[1], "dd_before": dd_before, "dd_after": dd_after, "bf16": args.bf16, "fused": args.fused, "ranks": gathered}, f, indent=1)
dist.barrier()
if rank == 0 and not args.path:
    shutil.rmtree(root, ignore_errors=True)
dist.destroy_process_group()
