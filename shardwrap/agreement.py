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
from typing import Sequence

import torch

from shardwrap import collectives

# (unit name, parameter name, shape, dtype, requires_grad), in plan order
Entry = tuple[str, str, tuple[int, ...], str, bool]


def describe(units: Sequence[tuple[str, Sequence[tuple[str, torch.Tensor]]]]) -> list[Entry]:
    """One entry per parameter, from ``[(unit name, [(fqn, parameter), ...]), ...]``."""
    out: list[Entry] = []
    for unit_name, params in units:
        for fqn, p in params:
            out.append((unit_name, fqn, tuple(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)))
    return out


def digest(entries: Sequence[Entry]) -> list[int]:
    """Two signed int64s of a SHA-256 of the description."""
    h = hashlib.sha256(repr(list(entries)).encode()).digest()
    return [int.from_bytes(h[i : i + 8], "little", signed=True) for i in (0, 8)]


def _show(entry: Entry | None, fqn: str) -> str:
    if entry is None:
        return f"no parameter '{fqn}'"
    unit, _, shape, dtype, requires_grad = entry
    return f"unit '{unit}', shape {tuple(shape)}, {dtype}, requires_grad={requires_grad}"


def first_difference(by_rank: Sequence[Sequence[Entry]]) -> str:
    """Name the first parameter (by name, in the first rank's order, then any extra ones) whose
    entry differs between ranks, with what every rank has."""
    by_name = [{e[1]: e for e in d} for d in by_rank]
    names = list(dict.fromkeys(e[1] for d in by_rank for e in d))
    for fqn in names:
        here = [m.get(fqn) for m in by_name]
        if any(e != here[0] for e in here):
            lines = "; ".join(f"rank {r}: {_show(e, fqn)}" for r, e in enumerate(here))
            return f"parameter '{fqn}' differs ({lines})"
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
        f"ShardedModule: ranks built different models, so they cannot shard it together: "
        f"{first_difference(by_rank)}. Every rank must build the same model (same code, config, "
        f"dtype and frozen parameters) before wrapping; load rank-specific weights after wrapping "
        f"with load_state_dict"
    )
