"""The unit handle: the lifecycle of one unit's flat parameter.

A handle owns the sharded flat parameter (a ``Shard(0)`` DTensor), the per-parameter views the
optimizer sees, and the unsharded buffer that exists only between ``unshard`` and ``reshard``.
It knows how to all-gather, reshard and reduce-scatter its own data; *when* to do so is decided
by the hooks in ``sharded_module.py`` and the order by ``schedule.py``.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum, auto
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardwrap import collectives
from shardwrap.flat_param import FlatLayout


class DataState(Enum):
    """Where a unit's parameters live right now."""

    SHARDED = auto()  # only the flat shard is allocated
    UNSHARDED = auto()  # the padded unsharded buffer holds the full parameters


class TrainingState(Enum):
    """Which phase a unit (or the whole wrapped model) is in."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


_WAITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwrap-reduce-waiter")


class _WaiterProbe:
    """Completion of a CPU (gloo) collective, polled without blocking.

    gloo's ``Work.is_completed()`` turns true only once somebody has called ``wait()``, so the
    waiter thread calls it and this probe reads the thread's future.
    """

    def __init__(self, work: dist.Work) -> None:
        self._done: Future[None] = _WAITER.submit(work.wait)

    def __call__(self) -> bool:
        return self._done.done()

    def join(self) -> None:
        self._done.result()


def completion_probe(work: dist.Work | None, device: torch.device) -> Callable[[], bool] | None:
    """A non-blocking "has this collective finished?" for ``work`` (None: nothing in flight).

    On an accelerator the probe must not call ``wait()`` from another thread: NCCL's ``wait()``
    makes the *calling thread's current stream* wait for the collective, which is the compute
    stream, so the next unit's backward would queue behind the reduce-scatter and nothing would
    overlap. There ``is_completed()`` queries the collective's end event directly.
    """
    if work is None:
        return None
    if device.type == "cpu":
        return _WaiterProbe(work)
    return work.is_completed


def _weak(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` without a strong reference to its object.

    A hook registered with ``register_post_accumulate_grad_hook`` is kept where Python's garbage
    collector does not look, so a hook that references the handle owning the tensor makes a cycle
    that is never collected: every deleted ShardedModule would keep its shards, unsharded buffers
    and gradients alive for the life of the process (tests/test_behaviour.py checks it is freed).
    """
    ref = weakref.WeakMethod(method)

    def call(*args: object) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _average_grad(summed: torch.Tensor, world_size: int) -> None:
    """Turn the reduce-scatter's sum over ranks into DDP's average, in place."""
    summed.div_(world_size)


Slot = tuple[nn.Module, str]  # a module and the attribute name under which it holds a parameter


def _alias(storage_owner: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """A tensor over ``storage_owner``'s storage with its *own* version counter.

    Refilling the unsharded buffer after autograd saved views of it must not bump the version
    counter those views carry (design/notes/freeing-unsharded-storage.md).
    """
    alias = torch.empty(0, dtype=storage_owner.dtype, device=storage_owner.device)
    return alias.set_(storage_owner.untyped_storage(), offset, (numel,), (1,))


class UnitHandle:
    """One unit: its flat shard, its unsharded buffer, and the transitions between them."""

    def __init__(
        self,
        *,
        name: str,
        index: int,
        unit_names: Sequence[str],
        params: Sequence[torch.Tensor],
        fqns: Sequence[str],
        slots: Sequence[Sequence[Slot]],
        mesh: DeviceMesh,
        reduce_group: dist.ProcessGroup,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        keep_unsharded_grad: bool = False,
    ) -> None:
        """Shard ``params`` (full and already identical on every rank) over ``mesh``.

        Postcondition: every slot holds the sharded parameter; the unsharded buffer is freed.
        """
        self.name = name
        self.index = index
        self._unit_names = unit_names
        self.mesh = mesh
        self.group: dist.ProcessGroup = mesh.get_group()
        self.reduce_group = reduce_group  # its own sequence: design/notes/collective-schedule.md
        self.rank = mesh.get_local_rank()
        self.world_size = mesh.size()
        self.slots = [list(s) for s in slots]
        self.layout = FlatLayout(fqns, params, self.world_size)
        self.device = params[0].device if params else torch.device("cpu")
        self.dtype = params[0].dtype if params else torch.float32  # the master (sharded) dtype
        self.param_dtype = param_dtype or self.dtype  # all-gather and compute
        self.reduce_dtype = reduce_dtype or self.param_dtype  # gradient reduce-scatter
        self.keep_unsharded_grad = keep_unsharded_grad  # stage 1: a persistent gradient buffer
        self.data_state = DataState.SHARDED
        self.training_state = TrainingState.IDLE
        self.stale = False  # stage 1: the unsharded copy predates an optimizer step
        self.on_grad_ready: Callable[[UnitHandle], None] = lambda handle: None

        layout, S = self.layout, self.layout.shard_numel
        # Stage 1 without mixed precision keeps the unsharded buffer for good, so the rank's rows of
        # it serve as the master shard and the rows of the unsharded gradient as the sharded
        # gradient: no second copy of either (design/notes/stages.md).
        self.shard_in_unsharded = keep_unsharded_grad and self.param_dtype == self.dtype
        self._padded_unsharded = torch.empty(layout.padded_unsharded_numel, dtype=self.param_dtype, device=self.device)
        if self.shard_in_unsharded:
            self._sharded_storage = None
            with torch.no_grad():
                layout.fill_unsharded_from_full([p.detach() for p in params], self._padded_unsharded)
            shard_views = layout.rank_views_of_unsharded(self._padded_unsharded, self.rank)
            self.data_state = DataState.UNSHARDED
        else:
            # Sharded storage: S elements of shard plus the tag (design/notes/padding.md).
            self._sharded_storage = torch.empty(S + 1, dtype=self.dtype, device=self.device)
            with torch.no_grad():
                layout.fill_shard_from_full([p.detach() for p in params], self._sharded_storage.narrow(0, 0, S), self.rank)
                self._sharded_storage[S] = float(index)
            shard_views = layout.sharded_views(self._sharded_storage.narrow(0, 0, S), self.rank)
        self.sharded_params = [
            nn.Parameter(view, requires_grad=slot.requires_grad) for view, slot in zip(shard_views, layout.slots)
        ]
        for param, slot in zip(self.sharded_params, layout.slots):
            if slot.requires_grad:  # only shardwrap assigns these grads; autograd never should
                param.register_post_accumulate_grad_hook(self._make_used_outside(slot.fqn))
        # grads that are views of the unsharded gradient's rows (shard_in_unsharded only)
        self._row_grads: list[torch.Tensor | None] = [None] * layout.num_trainable

        # The unsharded buffer (param_dtype) needs storage now to create the aliases; the sharded
        # configurations free it until the first unshard.
        n_trainable = layout.padded_trainable_numel
        self.unsharded_trainable = _alias(self._padded_unsharded, 0, n_trainable)
        self.unsharded_frozen = _alias(self._padded_unsharded, n_trainable, layout.padded_unsharded_numel - n_trainable)
        if layout.num_trainable:
            self.unsharded_trainable.requires_grad_(True)
            self.unsharded_trainable.register_hook(self._before_accumulate)
            self.unsharded_trainable.register_post_accumulate_grad_hook(_weak(self._post_accumulate_grad))
        if not self.shard_in_unsharded:
            self._free_unsharded()
        self._pending_gather: tuple[dist.Work | None, torch.Tensor, torch.Tensor] | None = None
        self.grad_pending = False  # autograd produced an unsharded gradient not yet packed
        self._packed_grad: torch.Tensor | None = None
        self._reduced: torch.Tensor | None = None
        self._reduce_input: torch.Tensor | None = None
        self._reduce_work: dist.Work | None = None
        self._reduce_done: Callable[[], bool] | None = None
        self._used_here = False
        self.install_sharded_params()

    @property
    def has_trainable(self) -> bool:
        return self.layout.num_trainable > 0

    @property
    def gathering(self) -> bool:
        return self._pending_gather is not None

    # ---- the flat shard -------------------------------------------------------------------------

    def read_shard(self) -> torch.Tensor:
        """This rank's flat shard, ``S`` elements and the tag, contiguous (the master dtype).

        The storage itself for the sharded configurations; a fresh copy of the rank's rows of the
        unsharded buffer when the shard lives there.
        """
        if self._sharded_storage is not None:
            return self._sharded_storage
        S = self.layout.shard_numel
        out = torch.empty(S + 1, dtype=self.dtype, device=self.device)
        self.layout.pack_rank_rows(self._padded_unsharded, out.narrow(0, 0, S), self.rank)
        out[S] = float(self.index)
        return out

    def write_shard(self, flat: torch.Tensor) -> None:
        """Overwrite this rank's shard with ``flat`` (``S`` elements, shard layout); the unsharded
        copy, if any, is stale afterwards."""
        with torch.no_grad():
            for dst, src in zip(self.sharded_params, self.layout.sharded_views(flat, self.rank)):
                dst.copy_(src)
        self.stale = True

    @property
    def sharded_local(self) -> torch.Tensor:
        """The flat shard without the tag (a copy when the shard lives in the unsharded buffer)."""
        return self.read_shard().narrow(0, 0, self.layout.shard_numel)

    @property
    def sharded_flat(self) -> DTensor:
        """The flat shard as a ``Shard(0)`` DTensor over the mesh."""
        W, S = self.world_size, self.layout.shard_numel
        return DTensor.from_local(self.sharded_local, self.mesh, [Shard(0)], run_check=False, shape=(W * S,), stride=(1,))

    def _make_used_outside(self, fqn: str) -> Callable[[torch.Tensor], None]:
        unit = self.name  # not self: a post-accumulate hook must not reference its handle (_weak)

        def used_outside(param: torch.Tensor) -> None:
            raise RuntimeError(
                f"rank {dist.get_rank()}: parameter '{fqn}' of unit '{unit}' was used outside that "
                f"unit's forward (autograd reached its local shard). Read a unit's parameters only inside "
                f"its own forward, or let auto_wrap_policy put the code that reads it in the same unit"
            )

        return used_outside

    # ---- data-state transitions ---------------------------------------------------------------

    def unshard(self, *, async_op: bool = False) -> None:
        """All-gather the flat shard into the unsharded buffer (ONE collective).

        Precondition: SHARDED, or UNSHARDED but stale. Postcondition: UNSHARDED, every
        parameter's full value readable through ``unsharded_views``. With ``async_op`` the
        collective is only started (prefetch); the next plain ``unshard`` finishes it.
        """
        if self._pending_gather is not None:
            if not async_op:
                self._finish_gather()
            return
        if self.data_state is DataState.UNSHARDED and not self.stale:
            return
        layout, W, S = self.layout, self.world_size, self.layout.shard_numel
        if not layout.slots:
            self.data_state, self.stale = DataState.UNSHARDED, False
            return
        send = self.read_shard().to(self.param_dtype)  # no copy without mixed precision
        gathered = torch.empty(W * (S + 1), dtype=self.param_dtype, device=self.device)
        work = collectives.all_gather(gathered, send, self.group, async_op=True)
        self._pending_gather = (work, gathered, send)
        if not async_op:
            self._finish_gather()

    def _finish_gather(self) -> None:
        work, gathered, send = self._pending_gather  # type: ignore[misc]
        self._pending_gather = None
        if work is not None:
            work.wait()
        self._check_tags(gathered, send)
        storage = self._padded_unsharded.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.layout.padded_unsharded_numel * self._padded_unsharded.element_size())
        with torch.no_grad():
            self.layout.copy_gathered_to_unsharded(gathered, self._padded_unsharded)
        self.data_state, self.stale = DataState.UNSHARDED, False

    def reshard(self) -> None:
        """Free the unsharded buffer. Postcondition: SHARDED, unless the shard lives in the
        unsharded buffer (stage 1), which then stays."""
        if self._pending_gather is not None:
            self._finish_gather()  # a prefetch nobody used: complete it so the sequence stays paired
        if self.data_state is DataState.SHARDED or self.shard_in_unsharded:
            return
        self._free_unsharded()
        self.data_state = DataState.SHARDED

    def _free_unsharded(self) -> None:
        # Autograd may still hold views of this storage; shrinking the storage (not dropping the
        # tensor) frees the memory and keeps those views valid for the next unshard.
        self._padded_unsharded.untyped_storage().resize_(0)

    def _check_tags(self, gathered: torch.Tensor, send: torch.Tensor) -> None:
        """Raise if ranks gathered different units (their forwards ran different units)."""
        if self.device.type != "cpu":
            return  # reading the tags would synchronize the GPU stream on every unshard
        S = self.layout.shard_numel
        tags = gathered.view(self.world_size, S + 1)[:, S].tolist()
        mine = send[S].item()
        if any(t != mine for t in tags):
            names = [self._unit_names[int(t)] if 0 <= int(t) < len(self._unit_names) else f"#{t}" for t in tags]
            by_rank = ", ".join(f"rank {r}: '{n}'" for r, n in enumerate(names))
            raise RuntimeError(
                f"shardwrap: ranks disagree on which unit to all-gather ({by_rank}). Every rank must "
                f"run the same wrapped units in the same order in forward; move data-dependent "
                f"branches inside one unit, or run every branch on every rank."
            )

    # ---- module slots -------------------------------------------------------------------------

    def install_unsharded_views(self) -> None:
        """Point every slot at a fresh full-shape view of the unsharded buffer."""
        views = self.layout.unsharded_views(self.unsharded_trainable, self.unsharded_frozen)
        for view, slots in zip(views, self.slots):
            for module, attr in slots:
                module._parameters[attr] = view  # a plain tensor here: see design/architecture.md

    def install_sharded_params(self) -> None:
        """Point every slot back at its sharded parameter (what the optimizer and users see)."""
        for param, slots in zip(self.sharded_params, self.slots):
            for module, attr in slots:
                module._parameters[attr] = param

    # ---- gradients ----------------------------------------------------------------------------

    def _before_accumulate(self, grad: torch.Tensor) -> None:
        """Autograd is about to add a new gradient into the unsharded gradient buffer.

        When the rows of that buffer still hold the reduced gradient of an earlier backward (the
        shard-in-unsharded configuration), move the ``p.grad`` that are still views of them into
        tensors of their own, so they keep accumulating like plain PyTorch, and zero the buffer.
        """
        if not any(g is not None for g in self._row_grads):
            return
        for param, row in zip(self.sharded_params, self._row_grads):
            if row is not None and param.grad is row:
                param.grad = row.clone()
        self._row_grads = [None] * self.layout.num_trainable
        leaf_grad = self.unsharded_trainable.grad
        if leaf_grad is not None:
            leaf_grad.zero_()

    def _post_accumulate_grad(self, leaf: torch.Tensor) -> None:
        """post_backward: autograd finished this unit's flat gradient for this backward."""
        self.grad_pending = True
        self.on_grad_ready(self)

    def pack_grad(self) -> None:
        """Move the unsharded gradient, rank-major and in ``reduce_dtype``, into the reduce-scatter
        input, with the used-flag set; then free it (or zero it, for stage 1)."""
        if not self.grad_pending:
            return
        self.grad_pending = False
        leaf = self.unsharded_trainable
        grad = leaf.grad
        if grad is None:
            return
        layout, W = self.layout, self.world_size
        packed = torch.empty(W * (layout.grad_shard_numel + 1), dtype=self.reduce_dtype, device=self.device)
        layout.pack_for_reduce_scatter(grad.to(self.reduce_dtype), packed)
        packed.view(W, -1)[:, -1] = 1.0  # used-flag: this rank's backward reached the unit
        if self._packed_grad is not None:
            packed += self._packed_grad
        self._packed_grad = packed
        if self.keep_unsharded_grad:
            grad.zero_()  # stage 1 keeps one unsharded gradient buffer for the whole run
        else:
            leaf.grad = None

    @property
    def grad_ready(self) -> bool:
        return self._packed_grad is not None

    def start_reduce(self) -> None:
        """Start the reduce-scatter of the packed gradient (asynchronous, on the reduce group).

        A rank whose backward did not reach this unit contributes zeros with a zero used-flag.
        """
        W, S = self.world_size, self.layout.grad_shard_numel
        packed = self._packed_grad
        self._packed_grad = None
        self._used_here = packed is not None
        if packed is None:
            packed = torch.zeros(W * (S + 1), dtype=self.reduce_dtype, device=self.device)
        self._reduced = torch.empty(S + 1, dtype=self.reduce_dtype, device=self.device)
        self._reduce_input = packed  # must live until the collective completes
        self._reduce_work = collectives.reduce_scatter(self._reduced, packed, self.reduce_group, async_op=True)
        self._reduce_done = completion_probe(self._reduce_work, self.device)

    def reduce_completed(self) -> bool:
        """Whether the reduce-scatter in flight has finished (never blocks)."""
        return self._reduce_done is None or self._reduce_done()

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter and add this rank's average into the sharded grads.

        If no rank reached the unit, its gradients are left untouched (``None`` stays ``None``),
        as in plain PyTorch.
        """
        if self._reduced is None:
            return
        if isinstance(self._reduce_done, _WaiterProbe):
            self._reduce_done.join()  # never wait on one Work from two threads at once
        if self._reduce_work is not None:
            self._reduce_work.wait()  # on NCCL this orders the current stream after the collective
        reduced, S = self._reduced, self.layout.grad_shard_numel
        self._reduced = self._reduce_input = self._reduce_work = self._reduce_done = None
        if not self._used_here and reduced[S].item() == 0:
            return
        sharded_grad = reduced.narrow(0, 0, S).to(self.dtype)  # no copy without mixed precision
        _average_grad(sharded_grad, self.world_size)
        n = self.layout.num_trainable
        views = self.layout.sharded_views(sharded_grad, self.rank, n)
        leaf_grad = self.unsharded_trainable.grad
        rows = self.layout.rank_views_of_unsharded(leaf_grad, self.rank, n) if self.shard_in_unsharded and leaf_grad is not None else None
        for i, (param, view) in enumerate(zip(self.sharded_params[:n], views)):
            if param.grad is not None:
                param.grad += view
            elif rows is not None:  # the rank's rows of the unsharded gradient, zeroed by pack_grad
                rows[i].copy_(view)
                param.grad = self._row_grads[i] = rows[i]
            else:
                param.grad = view

    # ---- full tensors (state dicts) -----------------------------------------------------------

    def gather_full(self, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every parameter's full value, as new tensors (one all-gather; the unit's state is
        untouched). ``flat`` gathers another tensor laid out like the shard (``S + 1`` elements),
        such as an optimizer state."""
        layout, W, S = self.layout, self.world_size, self.layout.shard_numel
        if not layout.slots:
            return []
        source = self.read_shard() if flat is None else flat
        gathered = torch.empty(W * (S + 1), dtype=source.dtype, device=self.device)
        collectives.all_gather(gathered, source, self.group)
        rows = gathered.view(W, S + 1)
        fulls = []
        for s in layout.slots:
            block = rows.narrow(1, s.shard_offset, s.chunk_numel).reshape(W * s.rows_per_rank, s.inner)
            fulls.append(block.narrow(0, 0, s.dim0).reshape(s.shape).clone())
        return fulls
