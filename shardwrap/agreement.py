"""Every rank wraps the same model: checked at construction with one small collective.

Collectives pair by position and size, so two ranks that built different models (another config,
a transposed weight, another dtype, a parameter frozen on one rank only) would either die in the
first all-gather (gloo aborts the process on a size mismatch) or, when the sizes happen to agree,
silently train two different models. Before anything is broadcast, each rank hashes a description
of its plan (units, and per parameter its name, shape, dtype and requires_grad) and the ranks
all-gather the 16-byte digests. Only when they differ do the ranks exchange the descriptions
themselves (one more collective) to name the first differing parameter on every rank
(design/notes/rank-agreement.md).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Mapping, Sequence, cast

import torch

from shardwrap import collectives

# (unit name, parameter name, shape, dtype, requires_grad), in plan order
Entry = tuple[str, str, tuple[int, ...], str, bool]


SETTING, BUFFER = "<setting>", "<buffer>"  # the unit field of the entries that are no parameter


def describe(
    units: Sequence[tuple[str, Sequence[tuple[str, torch.Tensor]]]],
    settings: Mapping[str, object] = {},
    buffers: Sequence[tuple[str, torch.Tensor]] = (),
) -> list[Entry]:
    """One entry per parameter, from ``[(unit name, [(fqn, parameter), ...]), ...]``; then one per
    wrapping argument in ``settings`` (name -> value, compared by ``repr``: ranks that shard with
    another stage or cast to another dtype issue collectives of other sizes, and gloo aborts the
    process on the first) and one per buffer (broadcast from the first rank at construction)."""
    out: list[Entry] = []
    for unit_name, params in units:
        for fqn, p in params:
            out.append((unit_name, fqn, tuple(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)))
    out += [(SETTING, name, (), repr(value), False) for name, value in settings.items()]
    out += [(BUFFER, fqn, tuple(b.shape), str(b.dtype).removeprefix("torch."), False) for fqn, b in buffers]
    return out


def digest(entries: Sequence[Entry]) -> list[int]:
    """Two signed int64s of a SHA-256 of the description."""
    h = hashlib.sha256(repr(list(entries)).encode()).digest()
    return [int.from_bytes(h[i : i + 8], "little", signed=True) for i in (0, 8)]


_KIND = {SETTING: "argument", BUFFER: "buffer"}


def _show(entry: Entry | None, kind: str, fqn: str) -> str:
    if entry is None:
        return f"no {kind} '{fqn}'"
    unit, _, shape, dtype, requires_grad = entry
    if unit == SETTING:
        return dtype  # the value's repr
    if unit == BUFFER:
        return f"shape {tuple(shape)}, {dtype}"
    return f"unit '{unit}', shape {tuple(shape)}, {dtype}, requires_grad={requires_grad}"


def first_difference(by_rank: Sequence[Sequence[Entry]]) -> str:
    """Name the first parameter, wrapping argument or buffer (by name, in the first rank's order,
    then any extra ones) whose entry differs between ranks, with what every rank has."""
    key = lambda e: (_KIND.get(e[0], "parameter"), e[1])  # noqa: E731
    by_name = [{key(e): e for e in d} for d in by_rank]
    names = list(dict.fromkeys(key(e) for d in by_rank for e in d))
    for kind, fqn in names:
        here = [m.get((kind, fqn)) for m in by_name]
        if any(e != here[0] for e in here):
            lines = "; ".join(f"rank {r}: {_show(e, kind, fqn)}" for r, e in enumerate(here))
            return f"{kind} '{fqn}' differs ({lines})"
    return "the same parameters are in another order (the units or the module tree differ)"


def check_same_model(entries: Sequence[Entry], group: collectives.Group) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank passed equal ``entries``.

    One all-gather of 16 bytes when they agree; one more (the descriptions) when they do not.
    """
    digests = collectives.all_gather_ints(digest(entries), group)
    if all(d == digests[0] for d in digests):
        return
    by_rank = collectives.all_gather_object(list(entries), group)
    raise ValueError(
        f"ShardedModule: ranks built different models or wrap them differently, so they cannot shard "
        f"it together: {first_difference(by_rank)}. Every rank must build the same model (same code, "
        f"config, dtype, buffers and frozen parameters) and wrap it with the same arguments; load "
        f"rank-specific weights after wrapping with load_state_dict"
    )


# ---- the optimizer a between-steps call saves -------------------------------------------------------

# (class name, has state, [(parameter names, {option: repr}) per param group]), or a string: why this
# rank could not describe its optimizer
OptimizerDescription = tuple[str, bool, list[tuple[list[str], dict[str, str]]]]


def _optimizer_difference(by_rank: Sequence[OptimizerDescription]) -> str:
    """The first thing that differs between the ranks' optimizers, with every rank's value."""
    def each(value_of: "Callable[[OptimizerDescription], object]") -> str:
        return "; ".join(f"rank {r}: {value_of(d)}" for r, d in enumerate(by_rank))

    if len({d[0] for d in by_rank}) > 1:
        return f"the class ({each(lambda d: d[0])})"
    if len({len(d[2]) for d in by_rank}) > 1:
        return f"the number of param groups ({each(lambda d: len(d[2]))})"
    for i in range(len(by_rank[0][2])):
        names = [d[2][i][0] for d in by_rank]
        if any(n != names[0] for n in names):
            return f"the parameters of param group {i} ({each(lambda d: _few(d[2][i][0]))})"
        keys = list(dict.fromkeys(k for d in by_rank for k in d[2][i][1]))
        for key in keys:
            values = [d[2][i][1].get(key, "absent") for d in by_rank]
            if any(v != values[0] for v in values):
                return f"param group {i}'s '{key}' ({each(lambda d: d[2][i][1].get(key, 'absent'))})"
    if len({d[1] for d in by_rank}) > 1:
        return f"whether it has stepped ({each(lambda d: 'has state' if d[1] else 'fresh')}; one built again on some ranks?)"
    return "nothing found"


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:3])
    return f"{len(names)} parameter(s): {shown}{', ...' if len(names) > 3 else ''}"


def check_same_optimizer(mine: "OptimizerDescription | str", group: collectives.Group, what: str) -> None:
    """Raise on every rank, before ``what`` writes anything, unless every rank's optimizer has the
    same class, param groups (parameters by name, options) and has stepped alike. A checkpoint
    records one rank's param groups, and the state DCP writes must cover the same parameters on
    every rank: ranks that differ wrote a checkpoint that loads nowhere, failed in DCP's planner
    with its own words, or saved the first rank's learning rate for all (one object gather)."""
    by_rank = collectives.all_gather_object(mine, group)
    failed = [(r, d) for r, d in enumerate(by_rank) if isinstance(d, str)]
    if failed:
        rank, why = failed[0]
        raise ValueError(f"{what}: rank {rank}: {why}; nothing was written")
    described = cast("list[OptimizerDescription]", by_rank)
    if any(d != described[0] for d in described):
        raise ValueError(
            f"{what}: the optimizer differs between ranks in {_optimizer_difference(described)}. Build the same "
            f"optimizer on every rank (class, param groups and their options) from model.parameters(); nothing was written"
        )
