"""Per-rank memory of each ZeRO stage, from a formula or from a simulated wrap.

    python -m shardwrap.estimate --model llama-7b --world-size 1024 --mixed-precision bf16 --simulate
    python -m shardwrap.estimate --params 1.3e9 --world-size 8
    python -m shardwrap.estimate --model gpt2-xl --world-size 2 --offload disk

The formula counts AdamW (8 bytes of state per parameter) over fp32 master shards. ``--simulate``
builds the model on the meta device and wraps it with ``ShardedModule`` under torch's fake process
group at that world size (collectives do nothing, nothing is initialized), then reports the real
shard sizes and padding of rank 0.

``--offload cpu|disk`` (``ShardedModule(offload=Offload(...))``) splits each stage's model state
by where it lives, per rank (``offload_formula``):

- device: the compute device (a GPU), in the compute dtype: unsharded parameters, stage 3 of the
  ``max_unsharded + 1`` largest units (``max_unsharded`` counts the running unit and the units
  gathered ahead; the enclosing root is unsharded beside them), stages 1-2 of every unit (stage 1
  keeps them for good, stage 2 from forward through backward); unsharded gradients, stage 1 every
  unit's buffer (kept for good), stages 2-3 those same largest units'; and one staging copy of a
  master shard per all-gather in flight (at most ``max_unsharded``: the largest units').
- host RAM (anonymous memory): ``cpu``: the fp32 master shards, gradient shards and AdamW state
  (4 + 4 + 8 bytes per parameter / W); ``disk``: only the gradient shards (4 / W).
- disk: ``disk`` only, the master shard and AdamW's two states in files (4 + 8 bytes per
  parameter / W), mapped into memory as file-backed pages that the kernel writes back and drops.

A CPU-only run computes in host RAM, so there device and host add up (the column "CPU-only run:
RAM"). With ``--simulate`` the wrap is given ``Offload("cpu")`` whatever the kind: the disk store
would write every master shard to files (GiBs for a large model) and its shards have the same
layout, so the disk bytes come from the simulated shard sizes. With ``disk`` the estimator also
says whether the same run without offload fits in this machine's memory, all ranks on it
computing on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from shardwrap.mixed_precision import MixedPrecision

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    n_layer: int
    d_model: int
    d_ff: int
    vocab: int
    n_kv: int  # key/value width (grouped-query attention)
    llama: bool  # gated MLP, RMSNorm, untied head, no biases; else GPT-2 style


SHAPES = {
    "gpt2": Shape(12, 768, 3072, 50257, 768, llama=False),
    "gpt2-xl": Shape(48, 1600, 6400, 50257, 1600, llama=False),
    "llama-7b": Shape(32, 4096, 11008, 32000, 4096, llama=True),
    "llama-70b": Shape(80, 8192, 28672, 32000, 1024, llama=True),
}


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Block(nn.Module):
    """One decoder block: the unit the simulation wraps."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        d, bias = s.d_model, not s.llama
        self.norm1 = RMSNorm(d) if s.llama else nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d, bias), nn.Linear(d, s.n_kv, bias), nn.Linear(d, s.n_kv, bias)
        self.o = nn.Linear(d, d, bias)
        self.norm2 = RMSNorm(d) if s.llama else nn.LayerNorm(d)
        self.up = nn.Linear(d, s.d_ff, bias)
        self.gate = nn.Linear(d, s.d_ff, bias) if s.llama else None
        self.down = nn.Linear(s.d_ff, d, bias)


class Decoder(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.pos = None if s.llama else nn.Embedding(1024, s.d_model)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.n_layer))
        self.norm = RMSNorm(s.d_model) if s.llama else nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab, bias=False)
        if not s.llama:
            self.head.weight = self.embed.weight  # GPT-2 ties its embeddings


def build_on_meta(shape: Shape) -> nn.Module:
    with torch.device("meta"):
        return Decoder(shape)


def _compute_bytes(precision: str) -> int:
    return 2 if precision in ("bf16", "fp16") else 4  # the unsharded compute copy and its gradient


def formula(psi: int, unit: int, world: int, precision: str, max_unsharded: int = 2) -> dict[int, dict[str, float]]:
    """Bytes per rank for stages 1-3 without offload: fp32 master shards, AdamW, compute copies in
    param dtype (stage 3: ``max_unsharded`` units of the largest size in flight)."""
    p = _compute_bytes(precision)
    shard = psi / world
    out = {}
    for stage in (1, 2, 3):
        params = 4 * shard + (p * psi if stage <= 2 else 0)  # master shard (+ full compute copy)
        grads = 4 * shard + (p * psi if stage == 1 else 0)  # sharded grad (+ stage 1's full buffer)
        if stage == 1 and p == 4:  # fp32 stage 1: the shards are rows of the full buffers
            params, grads = 4 * psi, 4 * psi
        optim = 8 * shard
        in_flight = p * unit * (max_unsharded if stage == 3 else 1)  # stage 3: a unit and its prefetched neighbours
        out[stage] = {"params": params, "grads": grads, "optim": optim, "largest_unit": p * unit,
                      "total": params + grads + optim + (in_flight if stage == 3 else p * unit)}
    return out


OFFLOAD_KINDS = ("none", "cpu", "disk")


def _offload_rows(
    kind: str, p: int, max_unsharded: int, units: list[tuple[float, float, float]], *,
    unsharded: float, trainable: float, master: float, grad_shards: float, optim: float,
) -> dict[int, dict[str, float]]:
    """Bytes per rank for stages 1-3 with offload ``kind`` ("cpu" or "disk"), split by where they
    live (the module docstring says what each place holds). ``units``: per unit, its unsharded
    parameter elements, unsharded trainable (gradient) elements and the elements of the master shard
    one all-gather sends; ``unsharded``/``trainable``: the sums of those over every unit; ``master``,
    ``grad_shards``, ``optim``: bytes of fp32 master shards, fp32 gradient shards and AdamW state."""
    by_size = sorted(units, reverse=True)
    held = by_size[: max_unsharded + 1]  # the running unit, those gathered ahead, the enclosing root
    held_params, held_grads = p * sum(u[0] for u in held), p * sum(u[1] for u in held)
    staging = p * sum(u[2] for u in by_size[:max_unsharded])  # one send buffer per all-gather in flight
    host = {"host_master": master if kind == "cpu" else 0.0, "host_grads": grad_shards,
            "host_optim": optim if kind == "cpu" else 0.0}
    host_total = sum(host.values())
    disk = master + optim if kind == "disk" else 0.0
    out = {}
    for stage in (1, 2, 3):
        dev_params = p * unsharded if stage <= 2 else held_params  # stages 1-2 keep every unit unsharded
        dev_grads = p * trainable if stage == 1 else held_grads  # stage 1 keeps every unsharded grad buffer
        device = dev_params + dev_grads + staging
        out[stage] = {"device_params": dev_params, "device_grads": dev_grads, "device_staging": staging,
                      "device": device, **host, "host": host_total, "disk": disk, "cpu_only_ram": device + host_total}
    return out


def offload_formula(
    psi: int, units: list[int], world: int, precision: str, kind: str, max_unsharded: int = 2
) -> dict[int, dict[str, float]]:
    """Bytes per rank for stages 1-3 with offload ``kind``, Psi parameters, ``units`` the parameter
    count of each unit (empty: unknown, no working set), W ranks, p bytes per compute element,
    M = ``max_unsharded``, H = the M + 1 largest units' parameters, G = the M largest units':

    - device: parameters p*Psi (stages 1-2) or p*H (stage 3); gradients p*Psi (stage 1) or p*H
      (stages 2-3); staging p*G/W; their sum.
    - host RAM: cpu: 4 Psi/W master + 4 Psi/W gradient shards + 8 Psi/W AdamW; disk: 4 Psi/W.
    - disk: disk: 4 Psi/W + 8 Psi/W; cpu: 0.
    - cpu_only_ram: device + host RAM (a CPU-only run computes in host RAM).
    """
    shard = psi / world
    return _offload_rows(
        kind, _compute_bytes(precision), max_unsharded, [(n, n, n / world) for n in units],
        unsharded=psi, trainable=psi, master=4 * shard, grad_shards=4 * shard, optim=8 * shard,
    )


def simulate(shape: Shape, world: int, precision: str, offload: str = "none", max_unsharded: int = 2) -> dict:
    """Wrap ``shape`` on the meta device under a fake process group of ``world`` ranks; rank 0's
    real shard sizes. With ``offload`` "cpu" or "disk" the wrap gets ``Offload("cpu")`` (the disk
    store would write every master shard to files; the layout is the same) and ``offload`` holds
    ``_offload_rows`` from the units' padded layouts (disk: the master shard files with their tags
    and AdamW's two state files, one shard each)."""
    from shardwrap import Offload, ShardedModule, collectives
    from shardwrap.unit import local_of

    collectives.init_fake_world(world)
    t0 = time.perf_counter()
    mp = MixedPrecision(param_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision))
    model = ShardedModule(
        build_on_meta(shape), auto_wrap_policy={Block}, mixed_precision=mp, param_init_fn=lambda m: None,
        max_unsharded=max_unsharded, offload=Offload("cpu") if offload != "none" else None,
    )
    seconds = time.perf_counter() - t0
    psi = sum(s.dim0 * s.inner for h in model.units for s in h.layout.slots)
    shard_elems = sum(h.layout.shard_numel for h in model.units)
    local_elems = sum(local_of(p).numel() for p in model.parameters())
    out: dict = {
        "psi": psi,
        "units": len(model.units),
        "shard_bytes": 4 * shard_elems,
        "local_param_bytes": 4 * local_elems,
        "padding_elements_per_rank": shard_elems - psi / world,
        "largest_unit": max(h.layout.padded_unsharded_numel for h in model.units),
        "wrap_seconds": seconds,
    }
    if offload != "none":
        layouts = [h.layout for h in model.units]
        stored = [h.read_shard() for h in model.units]  # the store's tensors: the shard and its tag
        assert all(t.device.type == "cpu" for t in stored) and model.offload_store is not None
        out["offload"] = _offload_rows(
            offload, _compute_bytes(precision), max_unsharded,
            [(la.padded_unsharded_numel, la.padded_trainable_numel, la.shard_numel + 1) for la in layouts],
            unsharded=sum(la.padded_unsharded_numel for la in layouts),
            trainable=sum(la.padded_trainable_numel for la in layouts),
            master=sum(t.numel() * t.element_size() for t in stored),
            grad_shards=4 * sum(la.grad_shard_numel for la in layouts),
            optim=8 * shard_elems,
        )
    return out


def simulated_memory(shape: Shape, world: int, precision: str) -> tuple[int, int]:
    """What ``simulate`` needs in memory, from the unit layouts alone: the bytes of rank 0's fp32
    shards (written, so resident), and of the largest padded unsharded buffer (allocated per unit
    in the compute dtype and never written, but each one allocation the OS must grant). Padding
    rounds each parameter's dim 0 up to a multiple of the world size, so beyond the rows of a
    parameter the buffers grow with W."""
    from shardwrap.flat_param import FlatLayout

    model = build_on_meta(shape)
    blocks = list(getattr(model, "blocks"))
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    groups = [list(b.named_parameters()) for b in blocks]
    groups.append([(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks])  # the root
    layouts = [FlatLayout([n for n, _ in g], [p for _, p in g], world) for g in groups]
    compute_bytes = 2 if precision in ("bf16", "fp16") else 4
    return 4 * sum(la.shard_numel for la in layouts), compute_bytes * max(la.padded_unsharded_numel for la in layouts)


def _memory_bytes() -> int | None:
    """This machine's physical memory, where the OS tells."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def unit_param_counts(shape: Shape) -> list[int]:
    """The parameters of each unit the simulation wraps: the root (embeddings, norm, head), then
    every block."""
    model = build_on_meta(shape)
    psi = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in getattr(model, "blocks")]
    return [psi - sum(blocks), *blocks]


def unit_sizes(shape: Shape) -> tuple[int, int]:
    """Total parameters, and the largest unit: a block, or the root (embeddings, norm, head)."""
    counts = unit_param_counts(shape)
    return sum(counts), max(counts)


def _at_least_one(noun: str, too_small: str) -> Callable[[str], int]:
    """An argparse type: a whole number of ``noun``, at least 1 (argparse names the option on error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of {noun}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(too_small.format(value))
        return value

    return parse


_world_size = _at_least_one("ranks", "{} ranks is impossible: give 1 or more")  # --world-size
_max_unsharded = _at_least_one("units", "{} is impossible: it counts the running unit, so give 1 or more")  # ShardedModule's limit


def _param_count(text: str) -> float:
    """``--params``: a finite count of at least one parameter (``1.3e9`` is accepted)."""
    try:
        count = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (write e.g. 1.3e9)") from None
    if not math.isfinite(count) or count < 1:
        raise argparse.ArgumentTypeError(f"{text} parameters is impossible: give a finite count of 1 or more")
    return count


def _fits_line(est: dict, offloaded: dict, stage: int, world: int, have: int | None) -> tuple[str, bool | None]:
    """Whether the ``stage`` run without offload fits in ``have`` bytes with every rank on this
    machine computing on the CPU, beside what the disk-offloaded run needs there."""
    without, with_disk = world * est[stage]["total"], world * offloaded[stage]["cpu_only_ram"]
    files = world * offloaded[stage]["disk"]
    ranks = f"the {world} ranks" if world > 1 else "the one rank"
    if have is None:
        return (f"stage {stage} without offload needs {without / GiB:.2f} GiB of RAM for {ranks} on one CPU-only "
                f"machine; this machine's memory is unknown, so whether it fits here is unknown"), None
    fits = without <= have
    verdict = "fits" if fits else "does not fit"
    disk_verdict = "fits" if with_disk <= have else "does not fit either"
    return (f"this machine has {have / GiB:.1f} GiB of memory: stage {stage} without offload needs "
            f"{without / GiB:.2f} GiB "
            f"for {ranks} computing on its CPU ({est[stage]['total'] / GiB:.2f} per rank), so the run without offload "
            f"{verdict} in this machine's memory; with --offload disk it needs {with_disk / GiB:.2f} GiB of RAM "
            f"({disk_verdict}) and {files / GiB:.2f} GiB of files"), fits


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m shardwrap.estimate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_param_count, help="parameter count (no unit sizes: largest unit reported as 0)")
    src.add_argument("--model", choices=sorted(SHAPES))
    ap.add_argument("--world-size", type=_world_size, required=True, help="number of ranks, 1 or more")
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=3, help="marked in the table")
    ap.add_argument("--mixed-precision", choices=["bf16", "fp16", "none"], default="none")
    ap.add_argument("--offload", choices=OFFLOAD_KINDS, default="none",
                    help="where the fp32 master shards and AdamW state live (ShardedModule(offload=Offload(...))): "
                         "adds device / host RAM / disk columns")
    ap.add_argument("--max-unsharded", type=_max_unsharded, default=2,
                    help="ShardedModule's max_unsharded: the running unit plus units gathered ahead (default 2)")
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args(argv)

    if args.model:
        counts = unit_param_counts(SHAPES[args.model])
        psi, unit = sum(counts), max(counts)
    else:
        psi, unit, counts = int(args.params), 0, []
    est = formula(psi, unit, args.world_size, args.mixed_precision, args.max_unsharded)
    result: dict = {"psi": psi, "largest_unit_params": unit, "world_size": args.world_size, "formula": est,
                    "offload": args.offload, "max_unsharded": args.max_unsharded}
    offloaded: dict = {}
    if args.offload != "none":
        offloaded = offload_formula(psi, counts, args.world_size, args.mixed_precision, args.offload,
                                    args.max_unsharded)
        result["offload_formula"] = offloaded
    fits_line = ""
    if args.offload == "disk":
        have = _memory_bytes()
        fits_line, fits = _fits_line(est, offloaded, args.stage, args.world_size, have)
        result.update(machine_memory_bytes=have, without_offload_bytes=args.world_size * est[args.stage]["total"],
                      fits_without_offload=fits)
    if args.simulate:
        if not args.model:
            ap.error("--simulate needs --model (a shape to build)")
        shards, largest = simulated_memory(SHAPES[args.model], args.world_size, args.mixed_precision)
        have = _memory_bytes()
        if have is not None and max(shards, largest) > have:
            what = (f"{shards / GiB:.1f} GiB of fp32 shards on rank 0" if shards > have else
                    f"a padded unsharded unit of {largest / GiB:.1f} GiB (padding grows with the world size)")
            ap.error(f"--model {args.model} --world-size {args.world_size} with --simulate: the simulated wrap would "
                     f"allocate {what}, more than this machine's {have / GiB:.1f} GiB; simulate another world size, "
                     f"or drop --simulate (the formula needs no memory)")
        result["simulated"] = simulate(SHAPES[args.model], args.world_size, args.mixed_precision, args.offload,
                                       args.max_unsharded)
    if args.json:
        print(json.dumps(result))
        return result
    name = args.model or f"{psi / 1e9:.2f}B params"
    if args.offload != "none":
        _print_offload(args, name, psi, unit, est, offloaded, result.get("simulated"), fits_line)
        return result
    print(f"{name}: Psi = {psi / 1e9:.3f}B, largest unit {unit / 1e6:.1f}M params, W = {args.world_size}, "
          f"mixed precision {args.mixed_precision}, AdamW, GiB per rank\n")
    print("| stage | parameters | gradients | optimizer state | largest unsharded unit | total at peak |")
    print("|---|---|---|---|---|---|")
    for stage, row in est.items():
        mark = " (chosen)" if stage == args.stage else ""
        print(f"| {stage}{mark} | {row['params'] / GiB:.3f} | {row['grads'] / GiB:.3f} | {row['optim'] / GiB:.3f} | "
              f"{row['largest_unit'] / GiB:.3f} | {row['total'] / GiB:.3f} |")
    if args.simulate:
        sim = result["simulated"]
        print(f"\nsimulated with ShardedModule on a fake process group of {args.world_size} ranks in "
              f"{sim['wrap_seconds']:.1f}s: {sim['units']} units, fp32 shard {sim['shard_bytes'] / GiB:.4f} GiB "
              f"per rank (formula {4 * psi / args.world_size / GiB:.4f}), padding "
              f"{sim['padding_elements_per_rank']:,.0f} elements per rank, largest unit "
              f"{sim['largest_unit'] / 1e6:.1f}M elements padded")
    return result


def _print_offload(args: argparse.Namespace, name: str, psi: int, unit: int, est: dict, offloaded: dict,
                   sim: dict | None, fits_line: str) -> None:
    """The tables for ``--offload cpu|disk``."""
    kind, world = args.offload, args.world_size
    print(f"{name}: Psi = {psi / 1e9:.3f}B, largest unit {unit / 1e6:.1f}M params, W = {world}, "
          f"mixed precision {args.mixed_precision}, AdamW, offload {kind}, max_unsharded {args.max_unsharded}, "
          f"GiB per rank\n")
    held = "every unit's unsharded params at stages 1-2 and unsharded grads at stage 1" + (
        "" if unit else " only (--params has no unit sizes: no units gathered or staged)")
    host = ("fp32 master shards + gradient shards + AdamW state" if kind == "cpu" else
            "gradient shards only (master shards and AdamW state are the disk files, mapped into memory as "
            "file-backed pages the kernel writes back and drops)")
    print(f"device = the compute device (the GPU): {held}"
          + (f", the {args.max_unsharded + 1} largest units gathered (max_unsharded + the root) with their gradients"
             if unit else "") + ", and the master shards staged for each all-gather in flight")
    print(f"host RAM = anonymous memory: {host}")
    if kind == "disk":
        print("disk = this rank's files: its fp32 master shard and AdamW's two states")
    print("CPU-only run: the device is host RAM too, so it needs device + host RAM")
    print("without offload = the total of --offload none (its stage 3 counts max_unsharded units in flight and no "
          "unsharded gradients)\n")

    def table(rows: dict, reference: dict | None) -> None:
        cols = ["device: unsharded params", "device: unsharded grads", "device: staged shards", "device total",
                "host RAM", *(["disk"] if kind == "disk" else []), "CPU-only run: RAM (device + host)"]
        keys = ["device_params", "device_grads", "device_staging", "device", "host",
                *(["disk"] if kind == "disk" else []), "cpu_only_ram"]
        if reference is not None:
            cols.append("without offload: total at peak")
        print("| stage | " + " | ".join(cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        for stage, row in rows.items():
            mark = " (chosen)" if int(stage) == args.stage else ""
            cells = [f"{row[k] / GiB:.3f}" for k in keys]
            if reference is not None:
                cells.append(f"{reference[stage]['total'] / GiB:.3f}")
            print(f"| {stage}{mark} | " + " | ".join(cells) + " |")

    table(offloaded, est)
    if sim is not None:
        print(f"\nsimulated with ShardedModule(offload=Offload('cpu')) on a fake process group of {world} ranks in "
              f"{sim['wrap_seconds']:.1f}s: {sim['units']} units, fp32 shard {sim['shard_bytes'] / GiB:.4f} GiB "
              f"per rank (formula {4 * psi / world / GiB:.4f}), padding {sim['padding_elements_per_rank']:,.0f} "
              f"elements per rank; rank 0's padded units and shards"
              + (" (disk from the simulated shard sizes; no files written):" if kind == "disk" else ":") + "\n")
        table(sim["offload"], None)
    if fits_line:
        print(f"\n{fits_line}")


if __name__ == "__main__":
    main()
