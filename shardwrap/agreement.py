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
from typing import Mapping, Sequence

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
