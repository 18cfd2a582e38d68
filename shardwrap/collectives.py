"""The collectives shardwrap issues. This is the only module that calls ``torch.distributed``
for data movement, so every byte that crosses ranks is visible here (and countable: see
``CommCounter``).

Each function works on flat 1-D tensors over the process group of a 1-D mesh.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives; older releases (>= 2.6) only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_counter: Counter[str] | None = None


@contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count the elements each kind of collective sends while the context is open.

    The counts are input elements per rank: an all-gather of a 4-element shard counts 4, a
    reduce-scatter of a 12-element buffer counts 12, a broadcast of n elements counts n.
    """
    global _counter
    previous, _counter = _counter, Counter()
    try:
        yield _counter
    finally:
        _counter = previous


def _count(kind: str, numel: int) -> None:
    if _counter is not None:
        _counter[kind] += numel
        _counter[kind + "_calls"] += 1


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False
) -> dist.Work | None:
    """Concatenate every rank's ``shard`` into ``output`` in rank order.

    With 2 ranks, rank 0 passing ``[1, 2]`` and rank 1 passing ``[3, 4]``, every rank's
    ``output`` becomes ``[1, 2, 3, 4]``. ``output.numel()`` must be ``world_size * shard.numel()``.
    """
    _count("all_gather", shard.numel())
    return _all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor, padded_input: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False
) -> dist.Work | None:
    """Sum ``padded_input`` over ranks and keep this rank's slice of the sum.

    With 2 ranks, rank 0 passing ``[1, 2, 3, 4]`` and rank 1 passing ``[10, 20, 30, 40]``,
    rank 0's ``output`` becomes ``[11, 22]`` and rank 1's becomes ``[33, 44]``.
    """
    _count("reduce_scatter", padded_input.numel())
    return _reduce_scatter_single(output, padded_input, group=group, async_op=async_op)


def exchange_counts(count: int, group: dist.ProcessGroup) -> tuple[dist.Work | None, torch.Tensor]:
    """Start gathering one integer from every rank (CPU groups); returns the work and the output.

    Counted apart from the data all-gathers, under ``"counts"``.
    """
    _count("counts", 1)
    out = torch.empty(dist.get_world_size(group), dtype=torch.int64)
    work = _all_gather_single(out, torch.tensor([count], dtype=torch.int64), group=group, async_op=True)
    return work, out


def broadcast(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Overwrite ``tensor`` on every rank with the group's first rank's ``tensor``."""
    _count("broadcast", tensor.numel())
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)


def broadcast_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite every tensor with the group's first rank's, one collective per dtype (the same
    dtype order on every rank)."""
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            broadcast(flat, group)
            for t, piece in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(piece.view_as(t))


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Sum ``tensor`` in place over ranks (used for small scalars such as gradient norms)."""
    _count("all_reduce", tensor.numel())
    dist.all_reduce(tensor, group=group)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Take the elementwise maximum of ``tensor`` in place over ranks."""
    _count("all_reduce", tensor.numel())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def scatter(output: torch.Tensor, pieces: list[torch.Tensor] | None, src: int, group: dist.ProcessGroup) -> None:
    """The source rank's ``pieces[r]`` lands in rank ``r``'s ``output``.

    With 2 ranks and the source passing ``[[1, 2], [3, 4]]``, rank 0 gets ``[1, 2]`` and rank 1
    gets ``[3, 4]``. Other ranks pass ``pieces=None``.
    """
    _count("scatter", output.numel())
    dist.scatter(output, pieces if dist.get_rank() == src else None, src=src, group=group)
