"""The flat parameter: where one unit's parameters live, and the views that expose them.

A unit's parameters are laid out twice (see design/notes/dim0-layout.md):

* **Sharded** (always resident). Rank ``r``'s flat shard is the concatenation, over the unit's
  parameters, of row-chunk ``r`` of each parameter (``torch.chunk(p, W)[r]`` semantics), each
  chunk padded to ``ceil(dim0 / W)`` rows so that every rank's shard has the same length ``S``.
  One extra trailing element, the *tag*, travels with the shard in every all-gather so that
  ranks can check they are gathering the same unit (design/notes/padding.md).
* **Unsharded** (only between an unshard and the next reshard). Parameter-major: parameter
  ``i`` occupies ``W * ceil(dim0 / W) * inner`` elements, which is the full tensor followed by
  its padding rows.

Moving between the two layouts is one ``split_with_sizes_copy`` (after an all-gather) or one
``cat`` (before a reduce-scatter).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class TensorParallel:
    """How a parameter that arrived as a DTensor on a tensor-parallel mesh is split there
    (design/notes/tensor-parallel.md). The flat parameter holds its local TP shard, which is then
    sharded over the data-parallel mesh like any parameter."""

    mesh: DeviceMesh  # the 1-D tensor-parallel mesh
    placements: tuple[Placement, ...]  # on ``mesh``: Shard(d) or Replicate()
    shape: torch.Size  # the parameter's global shape
    stride: tuple[int, ...]  # and its global stride

    def view(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's TP shard, or a tensor shaped like it) as the TP DTensor the
        module's own forward (and its TP hooks) expect. Differentiable: the gradient of the DTensor
        reaches ``local`` as a local gradient."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride)

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP shard of the global tensor ``full`` (no communication)."""
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, self.mesh, self.placements, src_data_rank=None).to_local()

    def full_of(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every TP rank's ``local`` (a collective over the TP mesh)."""
        return self.view(local).full_tensor()


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter sits in its unit's flat parameter."""

    fqn: str  # first name under which the unwrapped model lists it
    shape: torch.Size  # original shape; 0-dim parameters are replicated, one element per rank
    rows_per_rank: int  # ceil(dim0 / W): the padded chunk height
    inner: int  # numel of one row (product of the trailing dims)
    shard_offset: int  # offset of this parameter's chunk inside a rank's flat shard
    requires_grad: bool
    tp: TensorParallel | None = None  # a TP DTensor parameter: ``shape`` is its local TP shard's

    @property
    def full_shape(self) -> torch.Size:
        """The parameter's shape in the unwrapped model (its global shape under TP)."""
        return self.tp.shape if self.tp is not None else self.shape

    @property
    def dim0(self) -> int:
        return self.shape[0] if len(self.shape) > 0 else 1

    @property
    def chunk_numel(self) -> int:
        """Elements this parameter contributes to every rank's shard, padding included."""
        return self.rows_per_rank * self.inner

    @property
    def replicated(self) -> bool:
        """0-dim parameters cannot be chunked: every rank holds the value (notes/dim0-layout.md)."""
        return len(self.shape) == 0

    def local_rows(self, rank: int) -> int:
        """Rows of ``torch.chunk(p, W)[rank]``; zero for ranks past the last chunk."""
        if self.replicated:
            return 1
        return max(0, min(self.rows_per_rank, self.dim0 - rank * self.rows_per_rank))

    def first_row(self, rank: int) -> int:
        """Where this rank's rows start in the full parameter."""
        return 0 if self.replicated or not self.local_rows(rank) else rank * self.rows_per_rank

    def sharded_shape(self, rank: int) -> tuple[int, ...]:
        return () if self.replicated else (self.local_rows(rank), *self.shape[1:])

    @property
    def stride(self) -> tuple[int, ...]:
        """The contiguous stride of the full parameter (what its DTensor reports)."""
        stride, running = [], 1
        for size in reversed(self.shape):
            stride.append(running)
            running *= max(size, 1)
        return tuple(reversed(stride))


class FlatLayout:
    """Offsets and sizes of one unit's flat parameter for a given world size.

    Trainable parameters come first, so the gradient layout is a prefix of the parameter layout:
    ``grad_shard_numel`` elements per rank, and frozen parameters take no gradient memory. The
    prefix grows when a parameter frozen at wrapping is unfrozen (``extend_trainable``).
    """

    def __init__(
        self, fqns: Sequence[str], params: Sequence[torch.Tensor], world_size: int,
        tp: Sequence[TensorParallel | None] | None = None,
    ) -> None:
        """``params`` are plain tensors (a TP parameter's local shard, with ``tp`` saying how it
        is split)."""
        self.world_size = world_size
        slots: list[ParamSlot] = []
        offset = 0
        for j, (fqn, p) in enumerate(zip(fqns, params)):
            shape = p.shape
            dim0 = shape[0] if len(shape) > 0 else 1
            inner = math.prod(shape[1:]) if len(shape) > 1 else 1
            rows = -(-dim0 // world_size)  # ceil division
            slots.append(ParamSlot(fqn, shape, rows, inner, offset, p.requires_grad, tp[j] if tp else None))
            offset += rows * inner
        self.slots = slots
        self.shard_numel = offset
        self._derive()

    def extend_trainable(self, count: int) -> None:
        """Grow the trainable prefix to the first ``count`` parameters (a parameter frozen at
        wrapping was unfrozen: design/notes/after-wrapping.md, "Unfreezing"). Offsets do not
        change; only the gradient layout's length does."""
        if count > self.num_trainable:
            self.slots = [dataclasses.replace(s, requires_grad=True) if j < count else s for j, s in enumerate(self.slots)]
            self._derive()

    def _derive(self) -> None:
        slots, world_size = self.slots, self.world_size
        self.num_trainable = sum(s.requires_grad for s in slots)
        self.grad_shard_numel = sum(s.chunk_numel for s in slots[: self.num_trainable])
        self.chunk_sizes = [s.chunk_numel for s in slots]
        self.padded_sizes = [world_size * s.chunk_numel for s in slots]
        self.padded_unsharded_numel = world_size * self.shard_numel
        self.padded_trainable_numel = world_size * self.grad_shard_numel

    # ---- views -------------------------------------------------------------------------------

    def sharded_views(self, shard: torch.Tensor, rank: int, count: int | None = None) -> list[torch.Tensor]:
        """Views of this rank's flat ``shard``, one per parameter (the first ``count`` if given):
        ``torch.chunk(p, W)[rank]`` each, with the original ndim."""
        return [
            shard.narrow(0, s.shard_offset, s.local_rows(rank) * s.inner).view(s.sharded_shape(rank))
            for s in self.slots[:count]
        ]

    def rank_views_of_unsharded(self, padded_unsharded: torch.Tensor, rank: int, count: int | None = None) -> list[torch.Tensor]:
        """Views of rank ``rank``'s rows inside a parameter-major buffer (the unsharded parameters
        or their gradient), shaped like ``sharded_views``: the same values a shard holds."""
        W = self.world_size
        return [
            padded_unsharded.narrow(0, W * s.shard_offset + rank * s.chunk_numel, s.local_rows(rank) * s.inner).view(s.sharded_shape(rank))
            for s in self.slots[:count]
        ]

    def unsharded_views(self, trainable: torch.Tensor, frozen: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter full-shape views of the padded unsharded buffers.

        ``trainable`` is the autograd leaf over the trainable prefix. One ``split`` call per
        buffer makes autograd return the whole flat gradient from a single node, with zeros
        for the padding pieces (design/notes/freeing-unsharded-storage.md).
        """
        views: list[torch.Tensor] = []
        for buffer, slots in ((trainable, self.slots[: self.num_trainable]), (frozen, self.slots[self.num_trainable :])):
            sizes: list[int] = []
            for s in slots:
                numel = s.dim0 * s.inner
                sizes += [numel, self.world_size * s.chunk_numel - numel]
            pieces = buffer.split(sizes) if slots else ()
            views += [pieces[2 * i].view(s.shape) for i, s in enumerate(slots)]
        return views

    # ---- layout conversions ------------------------------------------------------------------

    def copy_gathered_to_unsharded(self, gathered: torch.Tensor, padded_unsharded: torch.Tensor) -> None:
        """Rank-major ``gathered`` (``W`` rows of ``S + 1``, tag last) -> parameter-major buffer."""
        W, S = self.world_size, self.shard_numel
        rows = gathered.view(W, S + 1).narrow(1, 0, S)
        outs = [piece.view(W, n) for piece, n in zip(padded_unsharded.split(self.padded_sizes), self.chunk_sizes)]
        torch.split_with_sizes_copy(rows, self.chunk_sizes, dim=1, out=outs)

    def pack_for_reduce_scatter(self, padded_grad: torch.Tensor, out: torch.Tensor) -> None:
        """Parameter-major padded gradient -> rank-major ``out`` (``W`` rows of ``S_grad + k``).

        The last ``k`` columns (the used-flags, one per trainable parameter) are left to the caller.
        """
        W, n = self.world_size, self.num_trainable
        rows = out.view(W, -1).narrow(1, 0, self.grad_shard_numel)
        pieces = padded_grad.split(self.padded_sizes[:n])
        torch.cat([p.view(W, c) for p, c in zip(pieces, self.chunk_sizes[:n])], dim=1, out=rows)
        for s in self.slots[:n]:
            if s.replicated:  # every rank's copy receives the sum of every rank's gradient
                rows[:, s.shard_offset] = rows[0, s.shard_offset]

    def pack_rank_rows(self, padded_unsharded: torch.Tensor, out: torch.Tensor, rank: int) -> None:
        """Rank ``rank``'s padded chunks of a parameter-major buffer -> its flat shard ``out``."""
        W = self.world_size
        pieces = padded_unsharded.split(self.padded_sizes)
        if not pieces:
            return
        torch.cat([p.view(W, c)[rank] for p, c in zip(pieces, self.chunk_sizes)], out=out)

    def fill_unsharded_from_full(self, full: Sequence[torch.Tensor], padded_unsharded: torch.Tensor) -> None:
        """Write full tensors into a parameter-major buffer; padding rows become zero."""
        for piece, s, tensor in zip(padded_unsharded.split(self.padded_sizes), self.slots, full):
            numel = s.dim0 * s.inner
            piece.narrow(0, 0, numel).copy_(tensor.reshape(-1))
            piece.narrow(0, numel, piece.numel() - numel).zero_()
            if s.replicated:  # every rank's copy of a 0-dim parameter holds the value
                piece.fill_(tensor.item())

    def fill_shard_from_full(self, full: Sequence[torch.Tensor], shard: torch.Tensor, rank: int) -> None:
        """Write row-chunk ``rank`` of each full tensor into ``shard``; padding becomes zero."""
        for s, tensor in zip(self.slots, full):
            dst = shard.narrow(0, s.shard_offset, s.chunk_numel)
            rows = s.local_rows(rank)
            src = tensor.reshape(s.dim0, s.inner).narrow(0, s.first_row(rank), rows)
            dst.narrow(0, 0, rows * s.inner).copy_(src.reshape(-1))
            dst.narrow(0, rows * s.inner, s.chunk_numel - rows * s.inner).zero_()
