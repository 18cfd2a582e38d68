"""Per-rank memory of each ZeRO stage, from a formula or from a simulated wrap.

    python -m shardwrap.estimate --model llama-7b --world-size 1024 --mixed-precision bf16 --simulate
    python -m shardwrap.estimate --params 1.3e9 --world-size 8

The formula counts AdamW (8 bytes of state per parameter) over fp32 master shards. ``--simulate``
builds the model on the meta device and wraps it with ``ShardedModule`` under torch's fake process
group at that world size (collectives do nothing, nothing is initialized), then reports the real
shard sizes and padding of rank 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass

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


def formula(psi: int, unit: int, world: int, precision: str) -> dict[int, dict[str, float]]:
    """Bytes per rank for stages 1-3: fp32 master shards, AdamW, compute copies in param dtype."""
    p = 2 if precision in ("bf16", "fp16") else 4  # unsharded compute copy and its gradient
    shard = psi / world
    out = {}
    for stage in (1, 2, 3):
        params = 4 * shard + (p * psi if stage <= 2 else 0)  # master shard (+ full compute copy)
        grads = 4 * shard + (p * psi if stage == 1 else 0)  # sharded grad (+ stage 1's full buffer)
        if stage == 1 and p == 4:  # fp32 stage 1: the shards are rows of the full buffers
            params, grads = 4 * psi, 4 * psi
        optim = 8 * shard
        in_flight = p * unit * (2 if stage == 3 else 1)  # stage 3: a unit and its prefetched neighbour
        out[stage] = {"params": params, "grads": grads, "optim": optim, "largest_unit": p * unit,
                      "total": params + grads + optim + (in_flight if stage == 3 else p * unit)}
    return out


def simulate(shape: Shape, world: int, precision: str) -> dict[str, float]:
    from shardwrap import ShardedModule, collectives
    from shardwrap.unit import local_of

    collectives.init_fake_world(world)
    t0 = time.perf_counter()
    mp = MixedPrecision(param_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision))
    model = ShardedModule(
        build_on_meta(shape), auto_wrap_policy={Block}, mixed_precision=mp, param_init_fn=lambda m: None
    )
    seconds = time.perf_counter() - t0
    psi = sum(s.dim0 * s.inner for h in model.units for s in h.layout.slots)
    shard_elems = sum(h.layout.shard_numel for h in model.units)
    local_elems = sum(local_of(p).numel() for p in model.parameters())
    return {
        "psi": psi,
        "units": len(model.units),
        "shard_bytes": 4 * shard_elems,
        "local_param_bytes": 4 * local_elems,
        "padding_elements_per_rank": shard_elems - psi / world,
        "largest_unit": max(h.layout.padded_unsharded_numel for h in model.units),
        "wrap_seconds": seconds,
    }


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


def unit_sizes(shape: Shape) -> tuple[int, int]:
    """Total parameters, and the largest unit: a block, or the root (embeddings, norm, head)."""
    model = build_on_meta(shape)
    psi = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in getattr(model, "blocks")]
    return psi, max(max(blocks), psi - sum(blocks))


def _world_size(text: str) -> int:
    """``--world-size``: a whole number of ranks, at least 1 (argparse names the option on error)."""
    try:
        world = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of ranks") from None
    if world < 1:
        raise argparse.ArgumentTypeError(f"{world} ranks is impossible: give 1 or more")
    return world


def _param_count(text: str) -> float:
    """``--params``: a finite count of at least one parameter (``1.3e9`` is accepted)."""
    try:
        count = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (write e.g. 1.3e9)") from None
    if not math.isfinite(count) or count < 1:
        raise argparse.ArgumentTypeError(f"{text} parameters is impossible: give a finite count of 1 or more")
    return count


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m shardwrap.estimate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_param_count, help="parameter count (no unit sizes: largest unit reported as 0)")
    src.add_argument("--model", choices=sorted(SHAPES))
    ap.add_argument("--world-size", type=_world_size, required=True, help="number of ranks, 1 or more")
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=3, help="marked in the table")
    ap.add_argument("--mixed-precision", choices=["bf16", "fp16", "none"], default="none")
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args(argv)

    if args.model:
        psi, unit = unit_sizes(SHAPES[args.model])
    else:
        psi, unit = int(args.params), 0
    est = formula(psi, unit, args.world_size, args.mixed_precision)
    result: dict = {"psi": psi, "largest_unit_params": unit, "world_size": args.world_size, "formula": est}
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
        result["simulated"] = simulate(SHAPES[args.model], args.world_size, args.mixed_precision)
    if args.json:
        print(json.dumps(result))
        return result
    name = args.model or f"{psi / 1e9:.2f}B params"
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


if __name__ == "__main__":
    main()
