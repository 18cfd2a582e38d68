"""Per-rank memory of each ZeRO stage, from a formula or from a simulated wrap.

    python -m shardwrap.estimate --model llama-7b --world-size 1024 --mixed-precision bf16 --simulate
    python -m shardwrap.estimate --params 1.3e9 --world-size 8
    python -m shardwrap.estimate --model gpt2-xl --world-size 2 --offload disk
    python -m shardwrap.estimate --model llama-7b --mesh 8x512 --mixed-precision bf16 --simulate
    python -m shardwrap.estimate --model llama-7b --mesh 64x8 --mixed-precision bf16 --inter-gbps 12.5

The formula counts AdamW (8 bytes of state per parameter) over fp32 master shards. ``--simulate``
builds the model on the meta device and wraps it with ``ShardedModule`` under torch's fake process
group at that world size (collectives do nothing, nothing is initialized), then reports the real
shard sizes and padding of rank 0.

``--mesh RxS`` is a hybrid mesh (``init_device_mesh(..., (R, S), mesh_dim_names=("replicate",
"shard"))``, R * S ranks; ``--world-size``, if given too, must equal R * S). Each rank holds the
1-D model state at S (16 Psi / S for fp32 AdamW), padded as the layout at S pads it. It adds the
collectives of one training step per mesh axis (``collectives_formula``): the all-gathers and
reduce-scatters over "shard", the gradient all-reduce over "replicate", each as
``count_collectives()`` counts it (input elements per rank) and as bytes on the wire. With
``--simulate`` the wrap gets that 2-D mesh on a fake world of R * S ranks, and rank 0 then runs
``--steps`` real training steps (default 1; AdamW on an empty sequence: every unit's forward,
backward and reduction runs, the arithmetic does not) under ``count_collectives()``; the last step's
counts are printed beside the formula's and must equal them (``train_steps``). The collectives are
counted from the real code, not computed: the formula is checked against them.

With ``--mesh`` it also times those collectives (``step_time_model``): each one's ring wire bytes
per rank over the per-rank bandwidth of the link its axis crosses, ``--intra-gbps`` within a node
(default 200 GB/s, an NVLink-class round figure; ``calibrated``: this machine's gloo all-gather bus
bandwidth from ``benchmarks/results/gloo_bandwidth.json``, written by
``benchmarks/calibrate_bandwidth.py``) or ``--inter-gbps`` across nodes (default 25 GB/s, one
200 Gb/s NIC a rank), with ``--ranks-per-node`` consecutive ranks a node (default S when R > 1,
min(W, 8) for ``--mesh 1xW``). An axis is intra-node when each of its groups lies in one node
(``axis_links``). No latency, no overlap. The table puts the mesh beside the 1-D mesh 1xW of the
same W and says above which intra/inter ratio the hybrid mesh communicates for less time.

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

A CPU-only run computes in host RAM (the column "CPU-only run: RAM"). At stages 1 and 2 device
and host add up there. At stage 3 the two peak at different moments (the working set of the unit
that runs, the gradient shards of the units done), so the column walks the backward unit by unit
and keeps the largest sum (``_stage3_backward_peak``; the units in forward order, root first).
With ``--simulate`` the wrap is given ``Offload("cpu")`` whatever the kind: the disk store would
write every master shard to files (GiBs for a large model) and its shards have the same layout,
so the disk bytes come from the simulated shard sizes. With ``disk`` the estimator also
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
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from shardwrap.mixed_precision import MixedPrecision

if TYPE_CHECKING:
    from shardwrap.flat_param import FlatLayout

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


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
        self.head_dim = 128 if s.llama else 64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (tokens, d_model), one causal sequence. Grouped-query attention, then the MLP."""
        T, hd = x.shape[0], self.head_dim
        h = self.norm1(x)
        q, k, v = (lin(h).view(T, lin.out_features // hd, hd).transpose(0, 1) for lin in (self.q, self.k, self.v))
        k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], dim=0) for t in (k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(0, 1).reshape(T, self.o.in_features))
        h = self.norm2(x)
        m = nn.functional.silu(self.gate(h)) * self.up(h) if self.gate is not None else nn.functional.gelu(self.up(h))
        return x + self.down(m)


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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: (T,) token ids of one sequence -> (T, vocab) logits."""
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[0], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


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
    kind: str, p: int, max_unsharded: int, units: list[tuple[float, float, float, float]], *,
    unsharded: float, trainable: float, master: float, grad_shards: float, optim: float,
) -> dict[int, dict[str, float]]:
    """Bytes per rank for stages 1-3 with offload ``kind`` ("cpu" or "disk"), split by where they
    live (the module docstring says what each place holds). ``units``: per unit, root first and
    then in forward order, its unsharded parameter elements, unsharded trainable (gradient)
    elements, the elements of the master shard one all-gather sends and the bytes of its fp32
    gradient shard; ``unsharded``/``trainable``: the sums of the first two over every unit;
    ``master``, ``grad_shards``, ``optim``: bytes of fp32 master shards, fp32 gradient shards and
    AdamW state."""
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
        cpu_only = device + host_total
        if stage == 3 and units:  # the working set and the gradient shards peak at different times
            cpu_only = host_total - grad_shards + _stage3_backward_peak(p, max_unsharded, units)
        out[stage] = {"device_params": dev_params, "device_grads": dev_grads, "device_staging": staging,
                      "device": device, **host, "host": host_total, "disk": disk, "cpu_only_ram": cpu_only}
    return out


def _stage3_backward_peak(p: int, max_unsharded: int, units: list[tuple[float, float, float, float]]) -> float:
    """The most bytes a stage-3 backward on a CPU holds at once of unsharded parameters, their
    gradients, staged shards and fp32 gradient shards, walking the units in backward order
    (``units`` as for ``_offload_rows``, root first). When unit k runs, alive are:

    - the gradient shards of the units whose backward is done (every unit after k in forward);
    - the flat gradient of the unit before it in backward, still in its reduce-scatter (one in flight);
    - its own parameters and gradient: p (n + t) (it reshards before autograd allocates its flat
      gradient, so the parameters and the flat gradient never coexist; the gradients per
      parameter and the flat one do, for the length of a copy);
    - the ``max_unsharded - 1`` units gathered ahead in backward order, with their staged shards;
    - the root's parameters and gradients (gathered from its forward to the end of its backward).

    The root's own backward comes last, beside every other unit's gradient shard; after it, all
    the gradient shards. It assumes each step starts with no gradient (``zero_grad()`` with
    ``set_to_none``, torch's default); accumulating over several backwards keeps every shard from
    the start. design/notes/offload.md ("Anonymous memory against the estimator")."""
    (n0, t0, _, _), order = units[0], units[:0:-1]
    root = p * (n0 + t0)
    done = in_flight = peak = 0.0
    for i, (n, t, _, g) in enumerate(order):
        ahead = sum(p * (a[0] + a[2]) for a in order[i + 1 : i + max_unsharded])
        peak = max(peak, done + in_flight + p * (n + t) + ahead + root)
        done, in_flight = done + g, p * t
    return max(peak, done + in_flight + root, done + units[0][3])


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
    - cpu_only_ram: a CPU-only run computes in host RAM: device + host RAM at stages 1-2; at stage 3
      the backward's peak walked unit by unit (``_stage3_backward_peak``, ``units`` root first, then
      in forward order; empty: device + host).
    """
    shard = psi / world
    return _offload_rows(
        kind, _compute_bytes(precision), max_unsharded, [(n, n, n / world, 4 * n / world) for n in units],
        unsharded=psi, trainable=psi, master=4 * shard, grad_shards=4 * shard, optim=8 * shard,
    )


# ---- hybrid meshes: R replicas x S shards, and the collectives of one step ------------------------


@dataclass(frozen=True)
class Mesh:
    """``--mesh RxS``: R replicas (axis "replicate") of S shards (axis "shard"), R * S ranks."""

    replicas: int
    shards: int

    @property
    def world(self) -> int:
        return self.replicas * self.shards

    def __str__(self) -> str:
        return f"{self.replicas}x{self.shards}"


def _mesh(text: str) -> Mesh:
    """``--mesh``: ``RxS`` with whole numbers R, S >= 1 (``8x512``; ``X`` and ``*`` work too)."""
    parts = text.lower().replace("*", "x").split("x")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not RxS (R replicas times S shards, whole numbers, e.g. 8x512)")
    replicas, shards = (int(part) for part in parts)
    if replicas < 1 or shards < 1:
        raise argparse.ArgumentTypeError(f"{text!r} has {replicas} replicas and {shards} shards: give 1 or more of each")
    return Mesh(replicas, shards)


# What each collective of one step counts and where it runs: (counter key, mesh axis).
COLLECTIVES = {
    "all_gather": "shard", "reduce_scatter": "shard", "headers": "shard", "counts": "shard",
    "replicate_all_reduce": "replicate",
}


def collectives_formula(
    shards_per_unit: list[tuple[int, int, int]] | None, psi: int, mesh: Mesh, precision: str, stage: int = 3,
    *, first_step: bool = False,
) -> dict:
    """The collectives of one training step (forward, backward, optimizer step) on one rank of an
    R x S mesh, per mesh axis, as ``shardwrap.collectives.count_collectives()`` counts them and as
    bytes on the wire.

    ``shards_per_unit``: per unit, root first and the unit that ends the forward last, ``(n, g, k)``:
    its padded shard elements per rank at S shards (``FlatLayout.shard_numel``), the trainable
    prefix of it (``grad_shard_numel``) and its trainable parameters (``num_trainable``). ``None`` (only Psi known): one ideal unit of Psi / S
    elements, no padding, no tag, nothing kept between forward and backward. p: bytes per element
    of the compute dtype (the all-gathers and, as ``MixedPrecision(param_dtype=...)`` sets it, the
    reduce dtype too).

    - all-gather over "shard": every unit in forward (stages 1-2: the optimizer step changed its
      shard), and at stage 3 again in backward, except the root (kept from its forward to its
      backward: it encloses the whole forward) and the unit that ended the previous step's forward
      (``first_step``: the schedule has no previous step and gathers it again). Each call sends
      the shard and its tag: n + 1 elements (the counter), and each rank receives the other
      S - 1 ranks' (ring): (S - 1)(n + 1) p bytes. Summed: Psi (S - 1) / S elements per pass
      without padding and tags.
    - reduce-scatter over "shard": each unit with trainable parameters once, input S (g + k)
      (the gradient, rank-major, and each rank's used-flags, one per trainable parameter: the
      counter; design/notes/unused-parameters.md), on the wire (S - 1)(g + k) p bytes sent per
      rank (ring).
    - gradient all-reduce over "replicate" (R > 1; one replica issues none): each trainable unit's
      reduce-scatter output, its padded gradient shard and the used-flags, g + k elements (the
      counter), ring 2 (R - 1) / R (g + k) p bytes sent per rank; Psi / S and
      2 Psi (R - 1) / (R S) summed, without padding and flags (design/notes/hybrid-sharding.md).
    - the small exchanges on CPU groups (int64, over "shard"): "headers", 2 elements before every
      data all-gather (S > 1; stage 2 after its first step, with the default ``max_unsharded`` and
      no offload: before the root's and once before all the others, which start together), and
      "counts", 2 elements beside every unit of a synced backward
      (R S > 1; a real gloo run whose reduce-scatters all take the pairwise path, S > 1 and each
      at least ``collectives.PAIRWISE_MIN_BYTES`` a rank, counts only the first: these figures
      are the simulation's, whose fake group is not gloo) (design/notes/rank-agreement.md,
      collective-schedule.md).
    """
    R, S = mesh.replicas, mesh.shards
    p = _compute_bytes(precision)
    ideal = shards_per_unit is None
    units = [(psi / S, psi / S, 0)] if shards_per_unit is None else shards_per_unit
    tag = 0 if ideal else 1
    U = len(units)
    kept = set() if ideal else {0} | (set() if first_step else {U - 1})  # the root, the unit that ended the forward
    backward = [u for i, u in enumerate(units) if stage == 3 and i not in kept]
    trainable = [g + k for _, g, k in units if g > 0]  # each unit's gradient shard and its used-flags
    gathers = list(units) + backward

    def row(calls: int, elements: float, element_bytes: int, wire_elements: float) -> dict:
        return {"calls": calls, "elements": elements, "bytes": elements * element_bytes,
                "wire_bytes": wire_elements * element_bytes}

    shard_axis = {
        "all_gather": {**row(len(gathers), sum(n + tag for n, _, _ in gathers), p, (S - 1) * sum(n + tag for n, _, _ in gathers)),
                       "forward_calls": U, "backward_calls": len(backward)},
        "reduce_scatter": row(len(trainable), S * sum(trainable), p, (S - 1) * sum(trainable)),
    }
    if not ideal and S > 1:  # CPU process groups only (the simulation's)
        # Stage 2 after its first step: the root's header, then one for every other unit's gather,
        # started together (design/notes/prefetch.md, "Stage 2 on a CPU")
        n = min(len(gathers), 2) if stage == 2 and not first_step else len(gathers)
        shard_axis["headers"] = row(n, 2 * n, 8, 2 * (S - 1) * n)
    if not ideal and R * S > 1:
        shard_axis["counts"] = row(U, 2 * U, 8, 2 * (S - 1) * U)
    reduced = sum(trainable)
    # one replica (R = 1): no all-reduce over the replicate axis (the core skips it)
    replicate_axis = {"replicate_all_reduce": row(len(trainable), reduced, p, 2 * (R - 1) / R * reduced)} if R > 1 else {}
    counter: dict[str, float] = {}
    for axis in (shard_axis, replicate_axis):
        for kind, r in axis.items():
            counter[kind], counter[kind + "_calls"] = r["elements"], r["calls"]
    counter["bytes"] = sum(r["bytes"] for axis in (shard_axis, replicate_axis) for r in axis.values())
    return {"shard": shard_axis, "replicate": replicate_axis, "counter": counter,
            "wire_bytes": {"shard": sum(r["wire_bytes"] for r in shard_axis.values()),
                           "replicate": sum(r["wire_bytes"] for r in replicate_axis.values())},
            "stage": stage, "first_step": first_step, "ideal": ideal}


# ---- step time: the collectives' wire bytes over a bandwidth table -------------------------------

CALIBRATION = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "gloo_bandwidth.json"
DEFAULT_INTRA_GBPS = 200.0  # NVLink-class round figure (an A100's NVLink is 300 GB/s each way); not a measurement
DEFAULT_INTER_GBPS = 25.0  # 200 Gb/s: one HDR InfiniBand NIC per rank
# (collective, the mesh axis it runs on): what the model times; the int64 headers and counts are left out
TIMED = (("all_gather", "shard"), ("reduce_scatter", "shard"), ("replicate_all_reduce", "replicate"))


def axis_links(mesh: Mesh, ranks_per_node: int) -> dict[str, str | None]:
    """Which link each mesh axis's collectives cross: "intra" when every group of the axis lies in
    one node, else "inter" (a ring runs at its slowest link); None for an axis of one rank.

    Ranks follow ``init_device_mesh``: rank r * S + s at (r, s), so the shard groups are runs of S
    consecutive ranks and the replicate groups take every S-th rank; node = rank // N. A group
    stays in one node exactly when its first and last rank do. Hence, with N dividing W: "shard" is
    intra iff S divides N, "replicate" is intra iff W <= N; at N = S, the default, shard is intra
    and replicate inter."""
    R, S, N = mesh.replicas, mesh.shards, ranks_per_node

    def link(firsts: range, span: int) -> str:
        return "intra" if all(f // N == (f + span) // N for f in firsts) else "inter"

    return {"shard": link(range(0, R * S, S), S - 1) if S > 1 else None,
            "replicate": link(range(S), (R - 1) * S) if R > 1 else None}


def step_time_model(collectives: dict, mesh: Mesh, intra_gbps: float, inter_gbps: float, ranks_per_node: int) -> dict:
    """Seconds each collective of one training step takes on one rank of ``mesh``, from
    ``collectives`` (``collectives_formula`` at that mesh) and per-rank link bandwidths in GB/s
    (1e9 bytes/s): a collective's ring wire bytes per rank (all-gather (S - 1)/S of the gathered
    data, reduce-scatter the same of its input, all-reduce 2 (R - 1)/R) over the bandwidth of the
    link its axis crosses (``axis_links``). No latency term, no overlap with compute or between
    collectives: the sum is the step's communication if nothing hid it. The int64 headers and
    counts (a few bytes a unit, on CPU groups) are left out."""
    links = axis_links(mesh, ranks_per_node)
    gbps = {"intra": intra_gbps, "inter": inter_gbps}
    seconds: dict[str, float] = {}
    wire = {"intra": 0.0, "inter": 0.0}
    for kind, axis in TIMED:
        row, link = collectives[axis].get(kind), links[axis]
        if row is None or link is None:  # R = 1 issues no all-reduce; S = 1 moves nothing over "shard"
            seconds[kind] = 0.0
            continue
        seconds[kind] = row["wire_bytes"] / (gbps[link] * 1e9)
        wire[link] += row["wire_bytes"]
    return {"mesh": str(mesh), "links": links, "seconds": seconds, "comm_seconds": sum(seconds.values()),
            "wire_bytes": wire}


def hybrid_breakeven(hybrid: dict, flat: dict) -> tuple[str, float | None]:
    """When ``hybrid`` (a ``step_time_model`` row) communicates for less time than ``flat`` (the
    1-D row of the same W): each row's time is intra bytes / intra + inter bytes / inter, so the
    answer is a ratio intra / inter. ("above", x): hybrid wins when intra / inter > x (the usual
    case: it moves bytes off the network onto the node's links); ("below", x): when it is below x;
    ("always", None) / ("never", None): at every ratio / at none."""
    extra_intra = hybrid["wire_bytes"]["intra"] - flat["wire_bytes"]["intra"]
    saved_inter = flat["wire_bytes"]["inter"] - hybrid["wire_bytes"]["inter"]
    if saved_inter > 0:
        return ("above", extra_intra / saved_inter) if extra_intra > 0 else ("always", None)
    if saved_inter < 0 and extra_intra < 0:
        return "below", extra_intra / saved_inter
    return ("always", None) if extra_intra < 0 else ("never", None)


def calibrated_intra_gbps(path: Path | None = None) -> tuple[float, str]:
    """The all-gather bus bandwidth ``benchmarks/calibrate_bandwidth.py`` measured on this machine
    (gloo), and a line saying where it came from. ``ValueError`` (its message says what to run)
    when the file is missing or holds no usable figure."""
    path = CALIBRATION if path is None else path
    try:
        data = json.loads(path.read_text())
        gbps = float(data["allgather_busbw_gbps"])
    except FileNotFoundError:
        raise ValueError(f"calibrated, but {path} does not exist: run OMP_NUM_THREADS=1 torchrun --standalone "
                         f"--nproc_per_node=2 benchmarks/calibrate_bandwidth.py, or give GB/s") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"calibrated, but {path} has no allgather_busbw_gbps ({exc}): rerun "
                         f"benchmarks/calibrate_bandwidth.py, or give GB/s") from None
    if not math.isfinite(gbps) or gbps <= 0:
        raise ValueError(f"calibrated, but {path} says {gbps} GB/s: rerun benchmarks/calibrate_bandwidth.py")
    return gbps, (f"calibrated: gloo {data.get('function', 'all-gather')} bus bandwidth, "
                  f"{data.get('world_size', '?')} ranks, {data.get('date', 'undated')} ({path})")


def simulate(shape: Shape, world: int, precision: str, offload: str = "none", max_unsharded: int = 2,
             mesh: Mesh | None = None, steps: int = 1, tokens: int = 0) -> dict:
    """Wrap ``shape`` on the meta device under a fake process group of ``world`` ranks; rank 0's
    real shard sizes. With ``offload`` "cpu" or "disk" the wrap gets ``Offload("cpu")`` (the disk
    store would write every master shard to files; the layout is the same) and ``offload`` holds
    ``_offload_rows`` from the units' padded layouts (disk: the master shard files with their tags
    and AdamW's two state files, one shard each).

    With ``mesh`` (R x S, ``world`` = R * S) the wrap gets ``init_device_mesh("cpu", (R, S),
    mesh_dim_names=("replicate", "shard"))`` and the shard sizes are those at S; then rank 0 runs
    ``steps`` real training steps (``train_steps``) and ``out["step"]`` holds what they counted."""
    from shardwrap import Offload, ShardedModule, collectives
    from shardwrap.unit import local_of

    collectives.init_fake_world(world)
    t0 = time.perf_counter()
    device_mesh = None
    if mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        assert mesh.world == world
        device_mesh = init_device_mesh("cpu", (mesh.replicas, mesh.shards), mesh_dim_names=("replicate", "shard"))
    mp = MixedPrecision(param_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision))
    model = ShardedModule(
        build_on_meta(shape), auto_wrap_policy={Block}, mixed_precision=mp, param_init_fn=lambda m: None,
        max_unsharded=max_unsharded, offload=Offload("cpu") if offload != "none" else None, mesh=device_mesh,
    )
    seconds = time.perf_counter() - t0
    shards = mesh.shards if mesh is not None else world
    psi = sum(s.dim0 * s.inner for h in model.units for s in h.layout.slots)
    shard_elems = sum(h.layout.shard_numel for h in model.units)
    local_elems = sum(local_of(p).numel() for p in model.parameters())
    out: dict = {
        "psi": psi,
        "units": len(model.units),
        "shard_bytes": 4 * shard_elems,
        "local_param_bytes": 4 * local_elems,
        "padding_elements_per_rank": shard_elems - psi / shards,
        "largest_unit": max(h.layout.padded_unsharded_numel for h in model.units),
        "wrap_seconds": seconds,
    }
    if offload != "none":
        layouts = [h.layout for h in model.units]
        stored = [h.read_shard() for h in model.units]  # the store's tensors: the shard and its tag
        assert all(t.device.type == "cpu" for t in stored) and model._offload_store is not None
        out["offload"] = _offload_rows(
            offload, _compute_bytes(precision), max_unsharded,
            [(la.padded_unsharded_numel, la.padded_trainable_numel, la.shard_numel + 1, 4 * la.grad_shard_numel)
             for la in layouts],
            unsharded=sum(la.padded_unsharded_numel for la in layouts),
            trainable=sum(la.padded_trainable_numel for la in layouts),
            master=sum(t.numel() * t.element_size() for t in stored),
            grad_shards=4 * sum(la.grad_shard_numel for la in layouts),
            optim=8 * shard_elems,
        )
    if mesh is not None:
        out["shards_per_unit"] = [(h.layout.shard_numel, h.layout.grad_shard_numel, h.layout.num_trainable) for h in model.units]
        out["padding_per_unit"] = [h.layout.shard_numel - sum(s.dim0 * s.inner for s in h.layout.slots) / shards
                                   for h in model.units]
        out["step"] = train_steps(model, steps, tokens)
    return out


def train_steps(model: nn.Module, steps: int = 1, tokens: int = 0) -> dict:
    """``steps`` real training steps of the wrapped ``model`` on this rank (AdamW, a sequence of
    ``tokens`` tokens): forward, cross-entropy, backward, ``opt.step()``, ``opt.zero_grad()``, each
    under ``count_collectives()``.

    Under the fake process group every collective is issued and counted as on a real run and moves
    nothing (its all-gather hands every rank this rank's shard), so the numbers are garbage and the
    schedule, the collectives, the buffers and the shards are the real ones. By default the
    sequence is empty (0 tokens): forward and backward still run through every unit, every hook
    fires and autograd gives every parameter a (zero) gradient, so the collectives are those of a
    step on any batch (they do not depend on the data), without the arithmetic: a bf16 weight
    gradient of one token takes this CPU ~20 ms per million parameters (two minutes for Llama-7B).
    What remains is shardwrap's own data path on rank 0's buffers (copying each gathered unit into
    place, packing each gradient for its reduce-scatter) and the fake all-gather's copies: several
    passes over each padded unit, a few seconds per billion parameters a step here.

    The first step differs from the later ones by one all-gather: the schedule learns from it which
    unit ends the forward and keeps that unit gathered for backward from the second step on
    (``collectives_formula(first_step=True)``). The model state (``memory.model_state_bytes``) is
    read after the last step's ``opt.step()``, before ``zero_grad``."""
    import resource

    from shardwrap import collectives
    from shardwrap.memory import model_state_bytes

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.zeros(tokens, dtype=torch.long)
    counted, seconds = [], []
    state: dict[str, int] = {}
    for i in range(steps):
        t0 = time.perf_counter()
        with collectives.count_collectives() as counts:
            logits = model(ids)
            nn.functional.cross_entropy(logits.float(), ids, reduction="sum").backward()
            opt.step()
        if i == steps - 1:
            state = model_state_bytes(model, opt)
        opt.zero_grad()
        seconds.append(time.perf_counter() - t0)
        counted.append(dict(counts))
    return {"counters": counted, "counter": counted[-1], "first_step": steps == 1, "seconds": seconds,
            "tokens": tokens, "model_state": state,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def simulated_memory(shape: Shape, world: int, precision: str) -> tuple[int, int]:
    """What ``simulate`` needs in memory, from the unit layouts alone: the bytes of rank 0's fp32
    shards (written, so resident), and of the largest padded unsharded buffer (allocated per unit
    in the compute dtype and never written, but each one allocation the OS must grant). Padding
    rounds each parameter's dim 0 up to a multiple of the world size, so beyond the rows of a
    parameter the buffers grow with W."""
    layouts = unit_layouts(shape, world)
    compute_bytes = 2 if precision in ("bf16", "fp16") else 4
    return 4 * sum(la.shard_numel for la in layouts), compute_bytes * max(la.padded_unsharded_numel for la in layouts)


def unit_layouts(shape: Shape, shards: int) -> list[FlatLayout]:
    """The flat layout of each unit the simulation wraps, sharded over ``shards`` ranks: the root
    (embeddings, final norm, head) first, then every block, as ``ShardedModule`` orders them."""
    from shardwrap.flat_param import FlatLayout

    model = build_on_meta(shape)
    blocks = list(getattr(model, "blocks"))
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    groups = [[(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks]]  # the root
    groups += [list(b.named_parameters()) for b in blocks]
    return [FlatLayout([n for n, _ in g], [p for _, p in g], shards) for g in groups]


def step_memory(shape: Shape, shards: int, precision: str, max_unsharded: int = 2) -> int:
    """About what ``simulate``'s training step needs at S = ``shards``: rank 0's fp32 shards,
    gradient shards and AdamW state (16 bytes a shard element), and, in the compute dtype, the
    ``max_unsharded + 1`` largest padded units gathered at once (the root stays gathered through
    the forward) with their unsharded gradients, and the buffers of one gather and one
    reduce-scatter (the rank-major copies) and of autograd's per-parameter gradients. Llama-7B at
    8x512 in bf16: 4.2 GiB (2.6 GiB peak RSS measured); Llama-70B at 16x256: 18.4 (11.4 measured)."""
    layouts = unit_layouts(shape, shards)
    p = _compute_bytes(precision)
    by_size = sorted((la.padded_unsharded_numel for la in layouts), reverse=True)
    return 16 * sum(la.shard_numel for la in layouts) + p * (2 * sum(by_size[: max_unsharded + 1]) + 3 * by_size[0])


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
_steps = _at_least_one("steps", "{} steps: give 1 or more")  # --steps
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


def _gbps(text: str) -> float:
    """``--inter-gbps`` (and ``--intra-gbps``): a finite bandwidth above 0, in GB/s per rank."""
    try:
        gbps = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB/s (write e.g. 25)") from None
    if not math.isfinite(gbps) or gbps <= 0:
        raise argparse.ArgumentTypeError(f"{text} GB/s is impossible: give a finite bandwidth above 0")
    return gbps


def _intra_gbps(text: str) -> float | str:
    """``--intra-gbps``: GB/s, or ``calibrated`` (read from ``CALIBRATION`` once parsing is done)."""
    return "calibrated" if text.strip().lower() == "calibrated" else _gbps(text)


_ranks_per_node = _at_least_one("ranks", "{} ranks per node is impossible: give 1 or more")  # --ranks-per-node


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
    ap.add_argument("--world-size", type=_world_size, help="number of ranks, 1 or more (or give --mesh)")
    ap.add_argument("--mesh", type=_mesh, metavar="RxS",
                    help="a hybrid mesh: R replicas of S shards (e.g. 8x512; R * S ranks, as "
                         "init_device_mesh(..., (R, S), mesh_dim_names=('replicate', 'shard'))). Per-rank memory "
                         "is the formula at S; adds the collectives of one step per mesh axis, and with --simulate "
                         "runs two training steps on the fake process group and counts them")
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=3, help="marked in the table")
    ap.add_argument("--mixed-precision", choices=["bf16", "fp16", "none"], default="none")
    ap.add_argument("--offload", choices=OFFLOAD_KINDS, default="none",
                    help="where the fp32 master shards and AdamW state live (ShardedModule(offload=Offload(...))): "
                         "adds device / host RAM / disk columns")
    ap.add_argument("--max-unsharded", type=_max_unsharded, default=2,
                    help="ShardedModule's max_unsharded: the running unit plus units gathered ahead (default 2)")
    ap.add_argument("--simulate", action="store_true",
                    help="wrap the model on the meta device under torch's fake process group and report rank 0's "
                         "shards; with --mesh also run real training steps there and count their collectives")
    ap.add_argument("--steps", type=_steps, default=None,
                    help="with --simulate --mesh: training steps to run (default 1); the last is counted and "
                         "checked against the formula (from the second on, the steady state)")
    ap.add_argument("--intra-gbps", type=_intra_gbps, metavar="GBPS|calibrated",
                    help=f"with --mesh: per-rank bandwidth of a link within a node, GB/s (1e9 bytes/s) for the "
                         f"step-time model (default {DEFAULT_INTRA_GBPS:g}, an NVLink-class round figure); "
                         f"'calibrated': this machine's gloo all-gather bus bandwidth, measured by "
                         f"benchmarks/calibrate_bandwidth.py into benchmarks/results/gloo_bandwidth.json")
    ap.add_argument("--inter-gbps", type=_gbps, metavar="GBPS",
                    help=f"with --mesh: per-rank bandwidth across nodes, GB/s (default {DEFAULT_INTER_GBPS:g}: "
                         f"200 Gb/s, one HDR InfiniBand NIC per rank)")
    ap.add_argument("--ranks-per-node", type=_ranks_per_node, metavar="N",
                    help="with --mesh: ranks in a node, consecutive ranks sharing one (default: S for R > 1, the "
                         "shard axis fills a node; min(W, 8) for a 1-D mesh 1xW)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args(argv)
    mesh: Mesh | None = args.mesh
    if mesh is None and args.world_size is None:
        ap.error("give --world-size N (a 1-D mesh of N ranks) or --mesh RxS (R replicas of S shards)")
    if mesh is not None and args.world_size is not None and args.world_size != mesh.world:
        ap.error(f"argument --mesh: {mesh} is {mesh.world} ranks but --world-size is {args.world_size}: "
                 f"give --mesh alone, or a --world-size equal to R * S")
    if mesh is not None:
        args.world_size = mesh.world
    if args.steps is not None and not (args.simulate and mesh is not None):
        ap.error("argument --steps: the simulated steps need --simulate and --mesh")
    step_options = [o for o, v in (("--intra-gbps", args.intra_gbps), ("--inter-gbps", args.inter_gbps),
                                   ("--ranks-per-node", args.ranks_per_node)) if v is not None]
    if step_options and mesh is None:
        ap.error(f"argument {step_options[0]}: the step-time model needs --mesh RxS (--mesh 1x{args.world_size} "
                 f"for the 1-D world)")
    shards = args.shards = mesh.shards if mesh is not None else args.world_size  # what each parameter is split over

    if args.model:
        counts = unit_param_counts(SHAPES[args.model])
        psi, unit = sum(counts), max(counts)
    else:
        psi, unit, counts = int(args.params), 0, []
    est = formula(psi, unit, shards, args.mixed_precision, args.max_unsharded)
    result: dict = {"psi": psi, "largest_unit_params": unit, "world_size": args.world_size, "formula": est,
                    "offload": args.offload, "max_unsharded": args.max_unsharded}
    if mesh is not None:
        result["mesh"] = {"replicas": mesh.replicas, "shards": mesh.shards}
        per_unit = None
        if args.model:
            layouts = unit_layouts(SHAPES[args.model], mesh.shards)
            per_unit = [(la.shard_numel, la.grad_shard_numel, la.num_trainable) for la in layouts]
            result["padding_elements_per_rank"] = sum(la.shard_numel for la in layouts) - psi / mesh.shards
        result["collectives_formula"] = {
            stage: collectives_formula(per_unit, psi, mesh, args.mixed_precision, stage)
            for stage in (1, 2, 3)}
        result["collectives_formula_first_step"] = collectives_formula(
            per_unit, psi, mesh, args.mixed_precision, 3, first_step=True)
        try:
            result["step_time"] = _step_time(args, mesh, psi, unit, per_unit)
        except ValueError as exc:  # --intra-gbps calibrated without a usable file
            ap.error(f"argument --intra-gbps: {exc}")
    offloaded: dict = {}
    if args.offload != "none":
        offloaded = offload_formula(psi, counts, shards, args.mixed_precision, args.offload,
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
        shard_bytes, largest = simulated_memory(SHAPES[args.model], shards, args.mixed_precision)
        have = _memory_bytes()
        size = f"--mesh {mesh}" if mesh is not None else f"--world-size {args.world_size}"
        if have is not None and max(shard_bytes, largest) > have:
            what = (f"{shard_bytes / GiB:.1f} GiB of fp32 shards on rank 0" if shard_bytes > have else
                    f"a padded unsharded unit of {largest / GiB:.1f} GiB (padding grows with the world size)")
            ap.error(f"--model {args.model} {size} with --simulate: the simulated wrap would "
                     f"allocate {what}, more than this machine's {have / GiB:.1f} GiB; simulate another world size, "
                     f"or drop --simulate (the formula needs no memory)")
        if mesh is not None and have is not None and (need := step_memory(SHAPES[args.model], shards, args.mixed_precision,
                                                                          args.max_unsharded)) > have:
            ap.error(f"--model {args.model} {size} with --simulate: the simulated training step needs about "
                     f"{need / GiB:.1f} GiB (rank 0's shards, gradients and AdamW state, the units gathered at "
                     f"once), more than this machine's {have / GiB:.1f} GiB; simulate a larger S, or drop "
                     f"--simulate (the formula needs no memory)")
        result["simulated"] = simulate(SHAPES[args.model], args.world_size, args.mixed_precision, args.offload,
                                       args.max_unsharded, mesh=mesh, steps=args.steps or 1)
    if args.json:
        print(json.dumps(result))
        return result
    name = args.model or f"{psi / 1e9:.2f}B params"
    if args.offload != "none":
        _print_offload(args, name, psi, unit, est, offloaded, result.get("simulated"), fits_line)
        if mesh is not None:
            _print_collectives(args, mesh, result)
            _print_step_time(result["step_time"])
        return result
    ranks = f"W = {args.world_size}" if mesh is None else (
        f"mesh {mesh} (R = {mesh.replicas} replicas of S = {mesh.shards} shards, W = {mesh.world}; per rank: the "
        f"formula at S)")
    print(f"{name}: Psi = {psi / 1e9:.3f}B, largest unit {unit / 1e6:.1f}M params, {ranks}, "
          f"mixed precision {args.mixed_precision}, AdamW, GiB per rank\n")
    print("| stage | parameters | gradients | optimizer state | largest unsharded unit | total at peak |")
    print("|---|---|---|---|---|---|")
    for stage, row in est.items():
        mark = " (chosen)" if stage == args.stage else ""
        print(f"| {stage}{mark} | {row['params'] / GiB:.3f} | {row['grads'] / GiB:.3f} | {row['optim'] / GiB:.3f} | "
              f"{row['largest_unit'] / GiB:.3f} | {row['total'] / GiB:.3f} |")
    if args.simulate:
        sim = result["simulated"]
        on = f"a {mesh} mesh of" if mesh is not None else "a fake process group of"
        print(f"\nsimulated with ShardedModule on {on} {args.world_size} ranks (torch's fake process group) in "
              f"{sim['wrap_seconds']:.1f}s: {sim['units']} units, fp32 shard {sim['shard_bytes'] / GiB:.4f} GiB "
              f"per rank (formula {4 * psi / shards / GiB:.4f}), padding "
              f"{sim['padding_elements_per_rank']:,.0f} elements per rank, largest unit "
              f"{sim['largest_unit'] / 1e6:.1f}M elements padded")
    if mesh is not None:
        _print_collectives(args, mesh, result)
        _print_step_time(result["step_time"])
    return result


_NAMES = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "headers": "headers (int64)",
          "counts": "counts (int64)", "replicate_all_reduce": "gradient all-reduce"}


def _print_collectives(args: argparse.Namespace, mesh: Mesh, result: dict) -> None:
    """The collectives of one step per mesh axis: the formula, and with --simulate the counter."""
    stage = args.stage
    f = result["collectives_formula"][stage]
    sim = result.get("simulated")
    st = sim["step"] if sim is not None else None
    # the simulated wrap is stage 3 (ShardedModule's default); one step: the first step's schedule
    sim_f = result["collectives_formula_first_step" if st and st["first_step"] else "collectives_formula"]
    sim_f = sim_f if st and st["first_step"] else sim_f[3]
    ideal = " (ideal: --params has no units, so no padding, no tags, no unit kept for backward)" if f["ideal"] else ""
    print(f"\ncollectives of one stage-{stage} training step after the first, per rank{ideal}: counter = input "
          f"elements per rank as shardwrap.collectives.count_collectives() counts them (an all-gather its shard and "
          f"tag, a reduce-scatter its whole input, the all-reduce over replicas the reduced shard and its used-flags); "
          f"wire = GiB each rank receives (all-gather) or sends (reduce-scatter, all-reduce) with ring algorithms")
    cols = ["axis", "collective", "calls", "counter elements", "counter GiB", "wire GiB"]
    if st is not None:
        which = "first step" if st["first_step"] else f"step {len(st['counters'])}"
        cols.append(f"simulated counter (stage 3, {which})")
        formula = "the first step's formula" if st["first_step"] else "formula"
    print("| " + " | ".join(cols) + " |")
    print("|---" * len(cols) + "|")
    for axis, size in (("shard", mesh.shards), ("replicate", mesh.replicas)):
        for kind, r in f[axis].items():
            what = _NAMES[kind]
            if kind == "all_gather":
                what += f" ({r['forward_calls']} forward + {r['backward_calls']} backward)"
            cells = [f"{axis} ({size} ranks)", what, f"{r['calls']:,}", f"{r['elements']:,.0f}",
                     f"{r['bytes'] / GiB:.3f}", f"{r['wire_bytes'] / GiB:.3f}"]
            if st is not None:
                got, calls = st["counter"].get(kind, 0), st["counter"].get(kind + "_calls", 0)
                want, want_calls = sim_f["counter"].get(kind, 0), sim_f["counter"].get(kind + "_calls", 0)
                cells.append(f"{got:,.0f} in {calls:,} calls " + (
                    f"= {formula}" if (got, calls) == (want, want_calls) else f"!= {formula} {want:,.0f} in {want_calls:,}"))
            print("| " + " | ".join(cells) + " |")
    print(f"wire per rank: {f['wire_bytes']['shard'] / GiB:.3f} GiB over 'shard', "
          f"{f['wire_bytes']['replicate'] / GiB:.3f} GiB over 'replicate'")
    first = result.get("collectives_formula_first_step")
    if first is not None and stage == 3:
        extra = first["shard"]["all_gather"]["calls"] - f["shard"]["all_gather"]["calls"]
        print(f"the first step gathers {extra} unit more in backward: the schedule learns from it which unit ends "
              f"the forward, and keeps that one gathered for backward from the second step on")
    if st is not None:
        ms, f3 = st["model_state"], result["formula"][3]
        rest = {k: v for k, v in st["counter"].items() if k.removesuffix("_calls") not in COLLECTIVES and k != "bytes"}
        seconds = " and ".join(f"{t:.1f}s" for t in st["seconds"])
        print(f"simulated: {len(st['counters'])} real training step(s) (AdamW, a sequence of {st['tokens']} tokens: "
              f"every unit runs forward and backward, every parameter gets a gradient) on rank 0 of the fake {mesh} "
              f"mesh in {seconds}; counter bytes of the last {st['counter'].get('bytes', 0) / GiB:.3f} GiB "
              f"(formula {sim_f['counter']['bytes'] / GiB:.3f})" + (f"; other collectives counted: {rest}" if rest else ""))
        print(f"simulated model state after the step, rank 0: params {ms['params'] / GiB:.3f} + grads "
              f"{ms['grads'] / GiB:.3f} + AdamW {ms['optim'] / GiB:.3f} GiB (formula at S, stage 3, without padding: "
              f"{f3['params'] / GiB:.3f} + {f3['grads'] / GiB:.3f} + {f3['optim'] / GiB:.3f}); peak RSS of the "
              f"simulation {st['peak_rss_bytes'] / GiB:.1f} GiB")


def _step_time(args: argparse.Namespace, mesh: Mesh, psi: int, unit: int, per_unit: list[tuple[int, int, int]] | None) -> dict:
    """``step_time_model`` at ``mesh`` and, for R > 1, at the 1-D mesh 1xW of the same W (steady
    state, stage ``--stage``), each with its peak bytes per rank (``formula`` at its S), and the
    bandwidths and ranks per node used and where each came from."""
    if args.intra_gbps == "calibrated":
        intra, intra_source = calibrated_intra_gbps()
    elif args.intra_gbps is None:
        intra, intra_source = DEFAULT_INTRA_GBPS, "default: an NVLink-class round figure, not a measurement"
    else:
        intra, intra_source = args.intra_gbps, "--intra-gbps"
    inter = DEFAULT_INTER_GBPS if args.inter_gbps is None else args.inter_gbps
    inter_source = "--inter-gbps" if args.inter_gbps is not None else "default: 200 Gb/s, one HDR InfiniBand NIC a rank"
    nodes = args.ranks_per_node
    nodes_source = "--ranks-per-node" if nodes is not None else (
        "default: S, the shard axis fills a node" if mesh.replicas > 1 else "default: min(W, 8)")
    if nodes is None:
        nodes = mesh.shards if mesh.replicas > 1 else min(mesh.world, 8)
    rows = []
    for m in [mesh, *([Mesh(1, mesh.world)] if mesh.replicas > 1 else [])]:
        units = per_unit
        if m is not mesh and args.model:
            units = [(la.shard_numel, la.grad_shard_numel, la.num_trainable) for la in unit_layouts(SHAPES[args.model], m.shards)]
        row = step_time_model(collectives_formula(units, psi, m, args.mixed_precision, args.stage), m, intra, inter, nodes)
        # what the hybrid mesh pays instead: the model state at S, not at W
        row["peak_bytes"] = formula(psi, unit, m.shards, args.mixed_precision, args.max_unsharded)[args.stage]["total"]
        rows.append(row)
    out = {"stage": args.stage, "intra_gbps": intra, "intra_source": intra_source, "inter_gbps": inter,
           "inter_source": inter_source, "ranks_per_node": nodes, "ranks_per_node_source": nodes_source, "meshes": rows}
    if len(rows) == 2:
        verdict, ratio = hybrid_breakeven(*rows)
        out["hybrid_wins"] = {"when": verdict, "intra_over_inter": ratio,
                              "here": rows[0]["comm_seconds"] < rows[1]["comm_seconds"]}
    return out


def _print_step_time(st: dict) -> None:
    """The step-time table: the given mesh and, for R > 1, the 1-D mesh of the same W."""
    rows = st["meshes"]
    gbps = {"intra": st["intra_gbps"], "inter": st["inter_gbps"]}
    print(f"\nstep time of those collectives, stage {st['stage']}, per rank: ring wire bytes over the link each axis "
          f"crosses (no latency, nothing overlapped with compute); intra-node {st['intra_gbps']:.3g} GB/s "
          f"({st['intra_source']}), inter-node {st['inter_gbps']:.3g} GB/s ({st['inter_source']}), "
          f"{st['ranks_per_node']} ranks per node ({st['ranks_per_node_source']})")
    print("| mesh | shard axis | replicate axis | all-gather s | reduce-scatter s | all-reduce s | comm s/step | "
          "peak GiB per rank |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        links = [f"{link} ({gbps[link]:.3g} GB/s)" if link else "-" for link in row["links"].values()]
        sec = row["seconds"]
        print(f"| {row['mesh']} | {links[0]} | {links[1]} | {sec['all_gather']:.4g} | {sec['reduce_scatter']:.4g} | "
              f"{sec['replicate_all_reduce']:.4g} | {row['comm_seconds']:.4g} | {row['peak_bytes'] / GiB:.3f} |")
    if "hybrid_wins" in st:
        (hybrid, flat), wins = rows, st["hybrid_wins"]
        ratio = wins["intra_over_inter"]
        when = {"always": "at every bandwidth ratio", "never": "at no bandwidth ratio"}.get(wins["when"]) or (
            f"when intra/inter {'>' if wins['when'] == 'above' else '<'} {ratio:.3g}")
        here = f"{hybrid['mesh']} is faster" if wins["here"] else (
            "they tie" if hybrid["comm_seconds"] == flat["comm_seconds"] else f"{flat['mesh']} is faster")
        print(f"{hybrid['mesh']} communicates for less time than {flat['mesh']} {when}; here intra/inter = "
              f"{st['intra_gbps'] / st['inter_gbps']:.3g}, so {here}. {hybrid['mesh']} pays in memory: {hybrid['peak_bytes'] / GiB:.3f} GiB per rank at peak "
              f"against {flat['peak_bytes'] / GiB:.3f} (the model state sharded over S, not W)")


def _print_offload(args: argparse.Namespace, name: str, psi: int, unit: int, est: dict, offloaded: dict,
                   sim: dict | None, fits_line: str) -> None:
    """The tables for ``--offload cpu|disk``."""
    kind, world = args.offload, args.world_size
    ranks = f"W = {world}" if args.mesh is None else f"mesh {args.mesh} (W = {world}; per rank: the formula at S)"
    print(f"{name}: Psi = {psi / 1e9:.3f}B, largest unit {unit / 1e6:.1f}M params, {ranks}, "
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
    print("CPU-only run: the device is host RAM too; stages 1-2 need device + host RAM, stage 3 the most its "
          "backward holds at once (the gradient shards of the units done beside the running unit's working set, "
          "walked unit by unit)" + ("" if unit else "; --params has no units, so device + host"))
    print("without offload = the total of --offload none (its stage 3 counts max_unsharded units in flight and no "
          "unsharded gradients)\n")

    def table(rows: dict, reference: dict | None) -> None:
        cols = ["device: unsharded params", "device: unsharded grads", "device: staged shards", "device total",
                "host RAM", *(["disk"] if kind == "disk" else []), "CPU-only run: RAM"]
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
              f"per rank (formula {4 * psi / args.shards / GiB:.4f}), padding {sim['padding_elements_per_rank']:,.0f} "
              f"elements per rank; rank 0's padded units and shards"
              + (" (disk from the simulated shard sizes; no files written):" if kind == "disk" else ":") + "\n")
        table(sim["offload"], None)
    if fits_line:
        print(f"\n{fits_line}")


if __name__ == "__main__":
    main()
