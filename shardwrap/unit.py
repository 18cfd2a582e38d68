"""The unit: one wrapped submodule's flat parameter and its whole life in a training step.

A ``Unit`` owns the sharded flat parameter, the per-parameter views the optimizer sees, the
unsharded buffer that exists only between ``unshard`` and ``reshard``, and its gradient on the way
from autograd to ``p.grad``. Its four hooks (``pre_forward``, ``post_forward``, ``pre_backward``,
``post_backward``) drive two state machines whose every transition is checked:

* ``DataState``: SHARDED -> GATHERING -> UNSHARDED (-> UNSHARDED_STALE once the shard is written)
  -> SHARDED;
* ``GradState``: NONE -> ACCUMULATING -> PACKED -> IN_FLIGHT -> REDUCED.

The order in which units communicate comes from ``schedule.py``; the root's part of a step (the
first pre-forward, the end of backward) from ``sharded_module.py``. design/architecture.md has the
tables of both enums.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import dataclasses
import functools
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils.weak import WeakTensorKeyDictionary

from shardwrap import collectives
from shardwrap.offload import OffloadStore
from shardwrap.spare import return_free_heap
from shardwrap.flat_param import FlatLayout, ParamSlot, TensorParallel
from shardwrap.mixed_precision import cast_floating
from shardwrap.stage import Stage
from shardwrap.summon import refusal as summon_refusal

if TYPE_CHECKING:
    from shardwrap.sharded_module import ShardedModule

# An integer dtype per element size: a tensor viewed as one compares bit for bit
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DataState(Enum):
    """Where a unit's parameters live right now."""

    SHARDED = auto()  # only the flat shard is allocated
    GATHERING = auto()  # an all-gather into the unsharded buffer is in flight (prefetch)
    UNSHARDED = auto()  # the unsharded buffer holds the full parameters
    UNSHARDED_STALE = auto()  # ... but the shard was written since (an optimizer step, a load)


class GradState(Enum):
    """Where a unit's gradient is on its way from autograd to ``p.grad``."""

    NONE = auto()  # nothing pending
    ACCUMULATING = auto()  # autograd's unsharded flat gradient holds a gradient not yet packed
    PACKED = auto()  # packed rank-major for the reduce-scatter, waiting for its turn
    IN_FLIGHT = auto()  # the reduce-scatter is running
    REDUCED = auto()  # the last reduce-scatter landed: its average is in ``p.grad`` (if any rank used the unit)


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

    def __init__(self, work: collectives.Work) -> None:
        self._done: Future[object] = _WAITER.submit(work.wait)

    def __call__(self) -> bool:
        return self._done.done()

    def join(self) -> None:
        self._done.result()

    wait = join  # what ``collectives.wait`` calls (a timeout re-raised with context)


def completion_probe(work: collectives.Work | None, device: torch.device) -> Callable[[], bool] | None:
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


@dataclasses.dataclass(eq=False)
class _Views:
    """One installed set of full-shape views: its number, the split node behind them, and the
    shard's data version they were gathered from (``Unit.data_version``). ``checkpointed``: the
    call's outputs came out of a reentrant checkpoint (its ops ran under no_grad, and a nested
    backward's recomputation reads the parameters)."""

    number: int
    split: torch.autograd.graph.Node
    version: int
    checkpointed: bool = False


def _keep_alive(views: "_Views", *grads: object) -> None:
    """A no-op node pre-hook whose only job is to hold ``views`` for as long as the node lives."""


def _weak(method: Callable[..., Any], *first: Any) -> Callable[..., Any]:
    """``method`` without a strong reference to its object (called with ``first`` before the
    hook's own arguments).

    A hook registered with ``register_post_accumulate_grad_hook`` is kept where Python's garbage
    collector does not look, so a hook that references the unit owning the tensor makes a cycle
    that is never collected: every deleted ShardedModule would keep its shards, unsharded buffers
    and gradients alive for the life of the process (tests/test_behaviour.py checks it is freed).
    """
    ref = weakref.WeakMethod(method)

    def call(*args: object) -> Any:
        bound = ref()
        return None if bound is None else bound(*first, *args)

    return call


def outside_compile(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as something ``torch.compile`` never traces: a module hook that runs eagerly
    between the compiled regions, so collectives, state transitions and slot swaps stay out of
    every graph (design/notes/torch-compile.md)."""
    return torch._dynamo.disable(hook, recursive=True, reason="shardwrap unit hooks run eagerly")


_SAC_MODES = tuple(
    getattr(torch.utils.checkpoint, name)
    for name in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
    if hasattr(torch.utils.checkpoint, name)
)


def outside_checkpoint_modes(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run with selective activation checkpointing's dispatch modes out of the way, when
    a unit's forward hooks fire inside a checkpointed region (``checkpoint(unit, ...,
    context_fn=create_selective_checkpoint_contexts(...))``). Those modes log every op of the
    region's forward and expect the same ops, in the same order, when backward recomputes it;
    the hooks' own ops (gathers, views, finishing gradients) differ between the two runs
    (design/notes/activation-checkpointing.md, "Selective checkpointing")."""

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _SAC_MODES and any(isinstance(mode, _SAC_MODES) for mode in _get_current_dispatch_mode_stack()):
            with _disable_current_modes():
                return hook(*args, **kwargs)
        return hook(*args, **kwargs)

    return run


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (a view of the same storage); a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def dtensor_over(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: torch.Size, stride: tuple[int, ...]
) -> DTensor:
    """``local`` itself as the local tensor of a DTensor with global ``shape`` and ``stride``.

    Not ``DTensor.from_local``: that moves a local tensor whose device type is not the mesh's onto
    the mesh's device. An offloaded shard is a host tensor on a CUDA mesh (torch's ``fully_shard``
    places its ``CPUOffloadPolicy`` shards the same way), and a copy of it on the GPU would be the
    parameter the optimizer updates while the shard that gets gathered never changes. Not
    differentiable, and cheaper on the host than ``from_local`` (no autograd node, no checks):
    parameters, gradients and optimizer state need neither (design/notes/offload.md)."""
    return DTensor(local, spec_of(mesh, placements, shape, stride, local.dtype), requires_grad=False)  # type: ignore[call-arg]


def spec_of(mesh: DeviceMesh, placements: Sequence[Placement], shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> DTensorSpec:
    """The DTensor spec of a tensor with global ``shape`` and ``stride`` placed on ``mesh``. A spec
    is immutable once made, so one may be shared by every DTensor laid out the same way."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))


def _reduce_dtensor_at_any_offset(reduce_ex_internal: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.save`` of a DTensor whose local tensor starts past the beginning of its storage.

    A DTensor is a wrapper with no storage of its own, and ``Tensor._reduce_ex_internal``
    recognises one by ``data_ptr() == 0``; but a wrapper's ``data_ptr()`` is its storage offset
    times the item size, and DTensor copies the offset from its local tensor. Every local shard
    here but the first of a unit is a view into the unit's flat shard, so ``torch.save`` of
    ``model.state_dict()``, or of ``p.detach()``, raised "Attempted to access the data pointer on
    an invalid python storage" where ``fully_shard``'s (each shard its own storage) saves. For
    exactly that case this takes the path an offset-0 DTensor takes: the wrapper's metadata, and
    its local tensor and spec as state (design/notes/dtensor-parameters.md, "Saving with
    torch.save"). Every other tensor goes to torch's own reduction unchanged."""

    def reduce(self: torch.Tensor, proto: int) -> Any:
        if type(self) is DTensor and self.storage_offset() != 0:
            from torch.utils.hooks import warn_if_has_hooks

            warn_if_has_hooks(self)
            meta = (type(self), self.dtype, tuple(self.size()), self.stride(), self.storage_offset(), self.layout,
                    self.device, self.requires_grad)
            return (torch._utils._rebuild_wrapper_subclass, meta)
        return reduce_ex_internal(self, proto)

    reduce.__wrapped__ = reduce_ex_internal  # type: ignore[attr-defined]
    return reduce


def _deepcopy_dtensor_at_any_offset(deepcopy_: Callable[..., Any]) -> Callable[..., Any]:
    """``copy.deepcopy`` of such a DTensor: ``Tensor.__deepcopy__`` makes the same ``data_ptr() ==
    0`` test and copied the wrapper's (absent) storage ("invalid python storage"). For exactly
    that case this runs torch's own branch for wrapper subclasses (a clone, then the grad, the
    slots and ``__dict__`` deep-copied), which an offset-0 DTensor takes."""

    def deepcopy(self: torch.Tensor, memo: dict[int, Any]) -> Any:
        if type(self) is not DTensor or self.storage_offset() == 0 or not self.is_leaf:
            return deepcopy_(self, memo)
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
            if self.requires_grad:
                new.requires_grad_()
            if self.grad is not None:
                new.grad = self.grad.__deepcopy__(memo)
            for slot in copyreg._slotnames(type(self)):  # type: ignore[attr-defined]
                if hasattr(self, slot):
                    setattr(new, slot, copy.deepcopy(getattr(self, slot), memo))
            self._clear_non_serializable_cached_data()
            new.__dict__ = copy.deepcopy(self.__dict__, memo)
        memo[id(self)] = new
        return new

    deepcopy.__wrapped__ = deepcopy_  # type: ignore[attr-defined]
    return deepcopy


def _stage_dtensor_at_any_offset(offload_tensor: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.distributed.checkpoint.async_save`` of such a DTensor: the stager that copies a
    state dict to the host before the background write (``StateDictStager._offload_tensor``)
    makes the same ``data_ptr() == 0`` test and copied the wrapper's absent storage ("Attempted to
    call copy_() on an invalid python storage"). For exactly that case this stages the local
    tensor (through the stager, so the views of one flat shard share one staged copy) and wraps
    it in a DTensor of the same spec, as staging an offset-0 DTensor gives."""

    def offload(self: Any, x: torch.Tensor, memo: dict[int, Any], non_blocking: bool = False) -> Any:
        if type(x) is not DTensor or x.storage_offset() == 0:
            return offload_tensor(self, x, memo, non_blocking=non_blocking)
        local = self.deepcopy_with_tensor_offload(x._local_tensor, memo, non_blocking=non_blocking)
        staged = DTensor(local, x._spec, requires_grad=False)  # type: ignore[call-arg]
        memo[id(x)] = staged
        return staged

    offload.__wrapped__ = offload_tensor  # type: ignore[attr-defined]
    return offload


if not hasattr(DTensor._reduce_ex_internal, "__wrapped__"):  # once, also if this module is reloaded
    DTensor._reduce_ex_internal = _reduce_dtensor_at_any_offset(DTensor._reduce_ex_internal)  # type: ignore[method-assign]
    DTensor.__deepcopy__ = _deepcopy_dtensor_at_any_offset(DTensor.__deepcopy__)  # type: ignore[method-assign]
try:  # where async saves are staged on torch 2.13; a torch without this stager is left alone
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager as _Stager
except ImportError:  # pragma: no cover
    _Stager = None  # type: ignore[assignment,misc]
if _Stager is not None and hasattr(_Stager, "_offload_tensor") and not hasattr(_Stager._offload_tensor, "__wrapped__"):
    _Stager._offload_tensor = _stage_dtensor_at_any_offset(_Stager._offload_tensor)  # type: ignore[method-assign]


def _split_divisor(divisor: float, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """(before, after): what a gradient is divided by before the reduction's sum and after it.
    fp16 holds sums only up to 65504, so a sum over ranks of gradients whose mean fits could
    overflow: there the smallest power of two at least the divisor's square root, dividing it
    exactly, goes before (the other factor after, so small gradients keep their bits). Every
    other reduce dtype divides after the sum, once."""
    if reduce_dtype is not torch.float16:
        return 1.0, divisor
    before = 1.0
    while divisor % (before * 2) == 0 and before * before < divisor:
        before *= 2
    return before, divisor / before


def _average_grad(summed: torch.Tensor, divisor: float) -> None:
    """Turn the reduce-scatter's sum over ranks into DDP's average (``divisor``: the number of
    ranks, or the unit's ``divide_factor``), in place."""
    summed.div_(divisor)


def _to_device(values: list[bool], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``, without making the host wait for the device: on a GPU
    a copy from pageable memory waits for every kernel queued before it, which would stop the host
    from running ahead of backward once per unit. From pinned memory it is queued like a kernel."""
    if device.type != "cuda":  # pinned memory is CUDA's
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _alias(storage_owner: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """A tensor over ``storage_owner``'s storage with its *own* version counter.

    Refilling the unsharded buffer after autograd saved views of it must not bump the version
    counter those views carry (design/notes/freeing-unsharded-storage.md).
    """
    alias = torch.empty(0, dtype=storage_owner.dtype, device=storage_owner.device)
    return alias.set_(storage_owner.untyped_storage(), offset, (numel,), (1,))


def tensors_in(obj: Any, _seen: dict[int, Any] | None = None) -> list[torch.Tensor]:
    """The tensors inside a forward output: tensors, sequences, mappings, dataclasses, classes
    registered with torch's pytree, and the attributes of any other object (a
    ``torch.distributions.Normal`` holds ``loc`` and ``scale``). A tensor missed here gets no
    pre-backward hook, and a stage-3 unit that returned it would be resharded before a backward
    that reads its parameters."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, _LEAVES) or isinstance(obj, (nn.Module, type)) or callable(obj):
        return []
    _seen = {} if _seen is None else _seen
    if id(obj) in _seen:  # containers and objects may refer to themselves or to each other
        return []
    _seen[id(obj)] = obj  # held, so that no temporary a pytree flatten made passes its id on
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item, _seen)]
    if isinstance(obj, dict):  # includes HF ModelOutput, an OrderedDict
        return [t for item in obj.values() for t in tensors_in(item, _seen)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name, None), _seen)]
    node = pytree.SUPPORTED_NODES.get(type(obj))
    if node is not None:
        return [t for item in node.flatten_fn(obj)[0] for t in tensors_in(item, _seen)]
    fields = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        slots = getattr(cls, "__slots__", ())
        slots = (slots,) if isinstance(slots, str) else slots
        fields += [getattr(obj, name) for name in slots if not name.startswith("__") and hasattr(obj, name)]
    return [t for item in fields for t in tensors_in(item, _seen)]


_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, Enum)


Slot = tuple[nn.Module, str]  # a module and the attribute name under which it holds a parameter


@dataclass
class _Gather:
    """An all-gather in flight into the unsharded buffer."""

    work: collectives.Work | None
    output: torch.Tensor  # rank-major (W, S + 1); with ``direct``, only the (W,) tags
    send: torch.Tensor  # must live until the collective completes
    direct: bool = False  # the data goes straight into the unsharded buffer (pairwise, CPU)
    version_before: int = 0  # the unsharded buffer's version counter when it started
    shard_version: int = 0  # the shard's (_shard_version) when it started: a write since makes the result stale


@dataclass
class _Reduction:
    """A reduce-scatter in flight."""

    work: collectives.Work | None
    output: torch.Tensor
    input: torch.Tensor | None  # must live until the collective completes (then dropped: it is the unit's full gradient)
    done: Callable[[], bool] | None
    used_here: bool  # this rank's backward reached the unit (its flags are this rank's _grad_used)
    trained: list[bool]  # the unit's _trained_since_reduce when the reduce-scatter started
    shard_done: bool = False  # the reduce-scatter over the shard axis finished (hybrid: the all-reduce follows)
    replica_work: collectives.Work | None = None  # hybrid: the all-reduce over the replicate axis


def _storage_id(t: torch.Tensor) -> int:
    """The storage a tensor's own TensorImpl points at (a DTensor's is empty): ``t.data = x``
    swaps it, the only trace that assignment leaves on a DTensor (whose values live in its
    ``_local_tensor``, which the setter does not touch)."""
    return t.untyped_storage()._cdata


# The gradients shardwrap gives the parameters, with their wrappers' storages: ``p.grad.data = t``
# (torch.nn.utils.vector_to_parameters on the gradients) leaves the DTensor's local values as they
# were and only swaps that storage (refused before the step: ``grad_data_replaced``).
_GIVEN_GRADS = WeakTensorKeyDictionary()


def own_grad(grad: torch.Tensor) -> torch.Tensor:
    """Record ``grad`` as one shardwrap gives a parameter, and return it."""
    _GIVEN_GRADS[grad] = _storage_id(grad)
    return grad


def grad_data_replaced(grad: torch.Tensor) -> bool:
    """Whether ``grad``, a gradient shardwrap gave, had its ``.data`` replaced since."""
    known = _GIVEN_GRADS.get(grad)
    return known is not None and _storage_id(grad) != known


class Unit:
    """One unit: its flat shard, its unsharded buffer, its gradient, and its four hooks."""

    def __init__(
        self,
        *,
        root: ShardedModule,
        name: str,
        index: int,
        unit_names: Sequence[str],
        params: Sequence[torch.Tensor],
        fqns: Sequence[str],
        slots: Sequence[Sequence[Slot]],
        mesh: DeviceMesh,
        reduce_group: collectives.Group,
        stage: Stage,
        dtensor_mesh: DeviceMesh | None = None,
        replicate_group: collectives.Group | None = None,
        tensor_parallel: Sequence[TensorParallel | None] | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
        cast_inputs: bool = True,
        store: OffloadStore | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Shard ``params`` (full and already identical on every rank) over the 1-D ``mesh``; with a
        ``store``, the master shard lives there (design/notes/offload.md). Hybrid sharding
        (design/notes/hybrid-sharding.md): ``dtensor_mesh`` is the 2-D (replicate, shard) mesh the
        DTensor parameters live on, ``replicate_group`` the replicate axis the reduced gradient
        shard is all-reduced over. Tensor parallelism (design/notes/tensor-parallel.md): a
        parameter whose ``tensor_parallel`` entry is set arrives as its local TP shard, and
        ``dtensor_mesh`` is the 2-D (data-parallel, tensor-parallel) mesh.

        Postcondition: every slot holds the sharded parameter; the unsharded buffer is freed
        (unless the shard lives in it).
        """
        self._root = root
        self.name = name
        self.index = index
        self.unit_names = unit_names  # every unit's name, by index (error messages)
        self.mesh = mesh
        self.dtensor_mesh = dtensor_mesh if dtensor_mesh is not None else mesh
        self._specs: dict[tuple[int, torch.dtype], DTensorSpec] = {}  # as_dtensor's, by (id(slot), dtype)
        tp = list(tensor_parallel) if tensor_parallel is not None else []
        # Axes of dtensor_mesh besides the shard axis: hybrid's replicate axis comes before it, the
        # tensor-parallel axis after it; a parameter without TP is replicated over either. Whether
        # the model uses TP is given, not read off this unit's parameters: a unit with none (or none
        # that TP splits) places alike (the loaders build DTensors through the first unit).
        self.tensor_parallel = tensor_parallel is not None
        before = 0 if self.tensor_parallel else self.dtensor_mesh.ndim - 1
        self._replicated_axes = (Replicate(),) * before
        self._replicated_after = (Replicate(),) * (self.dtensor_mesh.ndim - 1 - before)
        self.replicate_group = replicate_group
        self.replicas = collectives.group_size(replicate_group) if replicate_group is not None else 1
        self.group = mesh.get_group()
        self.reduce_group = reduce_group  # its own sequence: design/notes/collective-schedule.md
        self.rank = mesh.get_local_rank()
        self.world_size = mesh.size()
        self.stage = stage
        self.slots = [list(s) for s in slots]
        self.layout = FlatLayout(fqns, params, self.world_size, tp or None)
        # Where gathers and compute run: the model's device, also for a unit without parameters of
        # its own (a root over blocks), which clip_grad_norm_ and the copy streams consult.
        self.device = device if device is not None else params[0].device if params else torch.device("cpu")
        self.store = store
        self.shard_device = torch.device("cpu") if store is not None else self.device  # the master shard's
        self.dtype = params[0].dtype if params else torch.float32  # the master (sharded) dtype
        self.param_dtype = param_dtype or self.dtype  # all-gather and compute
        self.input_dtype = param_dtype if cast_inputs else None  # floating inputs are cast to it (None: no cast)
        self.output_dtype = output_dtype  # floating outputs are cast to it (None: no cast)
        self.reduce_dtype = reduce_dtype or self.param_dtype  # gradient reduce-scatter
        # Stage 1 without mixed precision keeps the unsharded buffer for good, so the rank's rows of
        # it serve as the master shard and the rows of the unsharded gradient as the sharded
        # gradient: no second copy of either (design/notes/stages.md).
        self.shard_in_unsharded = stage.keep_unsharded_grad and self.param_dtype == self.dtype and store is None
        self.training_state = TrainingState.IDLE
        self._reentered = 0  # calls of this unit's module inside its own running forward
        # When a backward is done with the gathered parameters (design/notes/activation-checkpointing.md,
        # "When backward is done with a unit"): each installed set of views gets a number; the views
        # a running forward installed (held from pre_forward to post_forward only: the split node
        # leads, out of the garbage collector's sight, to the leaf whose hook holds this unit); the
        # (views, graph task) pairs whose split a running backward will still execute; and whether a
        # release waits for the outermost backward (it came up inside a nested one); the views of
        # the forward calls whose outputs need a gradient, since the last backward (weakly: the
        # grad_fn of every view a call installed holds them, and so does the hook on its outputs,
        # so a call whose graph was dropped without a backward goes with it), and the graph task
        # for which pre_backward has looked at them
        self._view_sets = 0
        # the slots hold full views outside the unit's forward and backward, after unshard()
        # (ShardedModule.named_parameters puts the shards back)
        self.showing_full = False
        self._forward_views: _Views | None = None
        self._awaited: list[tuple[int, int]] = []
        self._held = False  # a forward call this backward's splits do not cover: keep gathered to its end
        # the forward calls whose outputs no gradient has reached yet in this backward (another
        # call's did), by number, with how this backward reads each (``_waits_for_a_call``); and
        # whether a nested backward (a reentrant checkpoint's) has reached the unit in this backward
        self._unstarted: dict[int, str] = {}
        self._nested_seen = False
        self.release_due = False
        self._calls: list[weakref.ref[_Views]] = []
        self._calls_task = -1
        # Such a call since the last backward that reduced: a reentrant checkpoint may recompute the
        # unit in backward on the ranks whose loss reached its output only, so every rank reduces it
        # at the end of that backward (design/notes/activation-checkpointing.md, "Recomputed on some ranks")
        self.recomputable = False
        self._data = DataState.SHARDED  # the stored state; ``data_state`` adds staleness
        self._grad = GradState.NONE
        self._gather: _Gather | None = None  # while GATHERING
        self._packed: torch.Tensor | None = None  # while PACKED
        self._accumulated: torch.Tensor | None = None  # no_sync sums in reduce_dtype (while ACCUMULATING)
        self._reduction: _Reduction | None = None  # while IN_FLIGHT
        self._gathered_version = -1  # the shard's version when it was last gathered
        self._writes = 0  # writes into the shard that bypass the parameters (loads)
        # For data_version: writes no version counter sees that surely changed the shard (a step of
        # a multi-tensor kernel on the DTensors), and the bumps of the flat buffer's counter by this
        # unit's own all-gathers (stage 1 keeps its shard in the unsharded buffer)
        self._steps_written = 0
        self._own_bumps = 0
        # fully_shard's per-module settings (shardwrap/fully_shard_api.py): what the summed gradient
        # is divided by instead of the number of ranks, and the units to gather once this one is
        # gathered in forward instead of the next in the last step's order
        self.divide_factor: float | None = None
        self.forward_prefetch_units: list[Unit] | None = None
        self.last_digest: int | None = None  # shard_digest at the root's last forward (shard_in_unsharded, on a CPU)
        # The parameters whose shards the root's digest covers (ShardedModule._catch_unseen_writes):
        # only those every rank holds rows of, so that a write to them changes every rank's digest,
        # and the same list on every rank; none on a GPU or for a shard on disk, nor with one rank
        # where the shard lives in the unsharded buffer (no other ranks' rows there to go stale; a
        # separate gathered copy, even of one rank's shard, can)
        checked = (self.world_size > 1 or not self.shard_in_unsharded) and self.device.type == "cpu" and (store is None or store.kind != "disk")
        self.digest_params = [
            i for i, s in enumerate(self.layout.slots)
            if checked and s.dim0 * s.inner > 0 and all(s.local_rows(r) > 0 for r in range(self.world_size))
        ]
        # Every forward call whose graph may still be backwarded, for the check of writes since
        # (changed_since_forward); unlike _calls, not cleared when a backward ends (retain_graph)
        self._forward_calls: list[weakref.ref[_Views]] = []
        # Per trainable parameter: whether a gradient reached its view on this rank since the last
        # reduce-scatter started (which carries these bits as its used-flags); whether one did in
        # any of this backward's reductions (host bits: where all are set, nothing is read back
        # from the device); the flags summed over every rank by this backward's reductions; and the
        # parameters whose p.grad those reductions created (see settle_unused_grads).
        self._grad_used = [False] * self.layout.num_trainable
        self._used_here = [False] * self.layout.num_trainable
        # Per trainable parameter: whether a grad-enabled forward since the last reduce-scatter
        # started gave it a view that needs a gradient. The same on every rank (the same forwards,
        # the same requires_grad): a parameter frozen now, without this bit, can have no gradient
        # in the reduction, so finish_grad skips it without reading the flags.
        self._trained_since_reduce = [False] * self.layout.num_trainable
        self._usage: list[torch.Tensor] = []
        self._fresh_grads: list[int] = []
        # Parameters frozen since a no_sync backward gave them a gradient, which a reduction
        # delivered to their p.grad (finish_grad): their hooks are due too.
        self._frozen_reduced: list[int] = []
        # Trainable parameters some rank's forward used in the backward that last reduced: their
        # post-accumulate-grad hooks are due (run_grad_hooks).
        self._hooks_due: list[int] = []

        layout, S = self.layout, self.layout.shard_numel
        self._padded_unsharded = torch.empty(layout.padded_unsharded_numel, dtype=self.param_dtype, device=self.device)
        self._sharded_storage: torch.Tensor | None = None
        if self.shard_in_unsharded:
            with torch.no_grad():
                layout.fill_unsharded_from_full([p.detach() for p in params], self._padded_unsharded)
            shard_views = layout.rank_views_of_unsharded(self._padded_unsharded, self.rank)
            self._data = DataState.UNSHARDED
        else:
            # Sharded storage: S elements of shard plus the tag (design/notes/padding.md).
            self._sharded_storage = (
                store.tensor(f"unit{index}-params", S + 1, self.dtype, index) if store is not None
                else torch.empty(S + 1, dtype=self.dtype, device=self.device)
            )
            with torch.no_grad():
                layout.fill_shard_from_full([p.detach() for p in params], self._sharded_storage.narrow(0, 0, S), self.rank)
                self._sharded_storage[S] = float(index)
            shard_views = layout.sharded_views(self._sharded_storage.narrow(0, 0, S), self.rank)
        # What the optimizer and torch's APIs see: DTensors whose local tensors are the views of the
        # flat shard (design/notes/dtensor-parameters.md).
        self._local_params = shard_views
        self.sharded_params = [
            nn.Parameter(self.as_dtensor(view, slot), requires_grad=slot.requires_grad)
            for view, slot in zip(shard_views, layout.slots)
        ]
        # Each wrapper's (storage-less) storage: ``p.data = d`` swaps it, whatever ``d`` is (_check_slots)
        self._wrapper_storages = [_storage_id(p) for p in self.sharded_params]
        # The keys of shardwrap's own post-accumulate-grad hooks on them: run_grad_hooks runs the others.
        self._own_grad_hooks: set[int] = set()
        for param, slot in zip(self.sharded_params, layout.slots):
            if slot.requires_grad:  # only shardwrap assigns these grads; autograd never should
                self._own_grad_hooks.add(param.register_post_accumulate_grad_hook(self._make_used_outside(slot.fqn)).id)

        # The aliases of the unsharded buffer (param_dtype); the sharded configurations free its
        # storage until the first unshard.
        self._aliases_made = 0  # how many times: a parameter frozen at wrapping and unfrozen remakes them
        self._make_aliases()
        if self.shard_in_unsharded:
            # Stale until the first forward gathers: a write after wrapping that no version counter
            # sees (HF's ``module.weight.data.normal_()`` in an init applied to the wrapped model)
            # reached this rank's rows only, and the other rows must come from their owners
            self._gathered_version = -1
        else:
            self._free_unsharded()
        self._install_sharded_params()

    # ---- reading the state ----------------------------------------------------------------------

    @property
    def has_trainable(self) -> bool:
        return self.layout.num_trainable > 0

    @property
    def trains(self) -> bool:
        """Whether this step's backward may give the unit a gradient: it has trainable parameters
        and not all of them were frozen after wrapping (``follow_requires_grad``)."""
        return self.layout.num_trainable > 0 and self.unsharded_trainable.requires_grad

    def follow_requires_grad(self, allow_off: bool) -> None:
        """At a step's first forward: the unsharded gradient leaf requires grad only while one of
        the unit's trainable parameters does. A unit whose parameters were all frozen after
        wrapping then computes like a frozen module (as under ``fully_shard``): its outputs need no
        gradient unless its inputs do, nothing is saved for a backward, and no backward reaches it;
        an all-frozen model's ``loss.backward()`` raises as the unwrapped model's does
        (design/notes/after-wrapping.md). ``allow_off`` False (an earlier forward's graph may still
        be owed a backward, and autograd drops what reaches a leaf that stopped requiring grad):
        only turned on."""
        n = self.layout.num_trainable
        if n:
            live = any(p.requires_grad for p in self.sharded_params[:n])
            if self.unsharded_trainable.requires_grad != live and (live or allow_off):
                self.unsharded_trainable.requires_grad_(live)

    def _make_aliases(self) -> None:
        """The autograd leaf over the trainable prefix of the unsharded buffer and the alias over
        the rest, each with its own version counter (``_alias``), and the leaf's hooks. Made again
        when the prefix grows; a graph recorded over the old leaf can no longer be backwarded."""
        self._aliases_made += 1
        n_trainable = self.layout.padded_trainable_numel
        self.unsharded_trainable = _alias(self._padded_unsharded, 0, n_trainable)
        self.unsharded_frozen = _alias(self._padded_unsharded, n_trainable, self.layout.padded_unsharded_numel - n_trainable)
        if self.layout.num_trainable:
            self.unsharded_trainable.requires_grad_(True)
            self.unsharded_trainable.register_hook(_weak(self._before_accumulate, self._aliases_made))  # _calls' split nodes lead here
            self.unsharded_trainable.register_post_accumulate_grad_hook(_weak(self._post_accumulate_grad))

    def follow_unfreezing(self) -> bool:
        """Take in a parameter frozen at wrapping that requires grad now (gradual unfreezing:
        Lightning's ``BaseFinetuning`` freezes the backbone before the strategy wraps the model
        and unfreezes it at a later epoch). The layout put it after the unit's trainable
        parameters, with no gradient storage; the trainable prefix now grows to take it in with
        every parameter before it, and those still frozen act as parameters frozen after wrapping
        (a gradient slot, no ``p.grad``). No value moves: the offsets stay, the gradient layout and
        the autograd leaf over the unsharded buffer grow (design/notes/after-wrapping.md,
        "Unfreezing"). The root calls it before each forward, on every rank. Returns whether the
        prefix grew.

        Refused while a gradient of the unit waits to be reduced (between the micro-batches of a
        ``no_sync`` accumulation: the prefix would change under it)."""
        n = self.layout.num_trainable
        unfrozen = [i for i in range(n, len(self.sharded_params)) if self.sharded_params[i].requires_grad]
        if not unfrozen:
            return False
        if self.training_state is not TrainingState.IDLE or not self.grad_settled or self._packed is not None or self._accumulated is not None:
            raise RuntimeError(
                f"rank {self.rank}: parameter '{self.layout.slots[unfrozen[0]].fqn}' of unit '{self.name}' had "
                f"requires_grad=False when the model was wrapped and requires grad now, while the unit's "
                f"gradients of earlier micro-batches wait to be reduced (no_sync). shardwrap gives it gradient "
                f"storage when it is unfrozen: unfreeze between optimizer steps, after the backward that "
                f"reduces (or set requires_grad before wrapping)"
            )
        if self.shard_in_unsharded and self._grad is GradState.REDUCED:
            for i in self._row_grads():  # they view the rows of the old leaf's gradient: own them
                param = self.sharded_params[i]
                param.grad = own_grad(param.grad.clone())  # type: ignore[union-attr]
        end = unfrozen[-1] + 1
        self.layout.extend_trainable(end)
        self._specs.clear()  # keyed by id(slot): the slots are new objects
        for param, slot in zip(self.sharded_params[n:end], self.layout.slots[n:end]):
            live = param.requires_grad
            param.requires_grad_(True)  # torch hooks only a leaf that requires grad; one still frozen gets it too
            self._own_grad_hooks.add(param.register_post_accumulate_grad_hook(self._make_used_outside(slot.fqn)).id)
            param.requires_grad_(live)
        self._grad_used += [False] * (end - n)
        self._used_here += [False] * (end - n)
        self._trained_since_reduce += [False] * (end - n)
        self._make_aliases()
        return True

    def as_dtensor(self, local: torch.Tensor, slot: ParamSlot) -> DTensor:
        """``local`` (this rank's ``torch.chunk`` of a parameter, or of a tensor shaped like it) as
        a DTensor with the parameter's global shape, placed as ``placements_of(slot)``."""
        key = (id(slot), local.dtype)
        spec = self._specs.get(key)
        if spec is None:  # once per parameter and dtype: making a spec costs more than the DTensor
            shape, stride = (slot.tp.shape, slot.tp.stride) if slot.tp is not None else (slot.shape, slot.stride)
            spec = self._specs[key] = spec_of(self.dtensor_mesh, self.placements_of(slot), shape, stride, local.dtype)
        return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]

    def placements(self, replicated: bool = False) -> tuple[Placement, ...]:
        """``(Shard(0),)`` (``Replicate()`` for a 0-dim parameter); hybrid: ``Replicate()`` first;
        with tensor parallelism, ``Replicate()`` on the TP axis after it."""
        return self._replicated_axes + (Replicate() if replicated else Shard(0),) + self._replicated_after

    def placements_of(self, slot: ParamSlot) -> tuple[Placement, ...]:
        """A parameter's placements on ``dtensor_mesh``. A TP parameter's data-parallel rows are
        row-chunks of its TP shard: when TP splits dim 0 too, the global rows a rank holds are
        strided (``_StridedShard``, as torch's ``fully_shard`` places them); then its TP placement."""
        if slot.tp is None:
            return self.placements(slot.replicated)
        strided = any(p.is_shard(0) for p in slot.tp.placements)
        rows = _StridedShard(0, split_factor=self.dtensor_mesh.size(1)) if strided else Shard(0)
        return (rows, *slot.tp.placements)

    def _shard_version(self) -> int:
        """A count that every write into the shard raises: the parameters' version counters (the
        optimizer's in-place update, any in-place write through a parameter) plus the writes
        that go to the local views directly (``write_shard``, ``write_param``). It cannot be
        consumed by the wrong event, so staleness is derived from it instead of being a flag
        somebody must remember to set."""
        return sum(p._version for p in self.sharded_params) + self._writes

    def data_version(self) -> int:
        """A count that writes into the shard's data raise and nothing else does (unlike
        ``_shard_version``, it counts no "may have been written" marks): the parameters' own
        version counters (in-place ops on them), their local tensors' (the optimizer's step on
        the locals, ``to_local()`` writes) and the flat shard's views' (loads). Each has a counter
        of its own: a DTensor and its local tensor share none."""
        params = sum(p._version + p._local_tensor._version for p in self.sharded_params)  # type: ignore[attr-defined]
        return params + sum(t._version for t in self._local_params) - self._own_bumps + self._steps_written

    def changed_since_forward(self) -> bool:
        """Inside a backward: whether a forward call of this unit that the running backward will go
        through read parameters that were written since (design/notes/rank-agreement.md,
        "Parameters written between a forward and its backward")."""
        if not self._forward_calls:
            return False
        now = self.data_version()
        for call in self._forward_calls:
            views = call()
            if views is not None and views.version != now and torch._C._will_engine_execute_node(views.split):
                return True
        return False

    @property
    def data_state(self) -> DataState:
        if self._data is DataState.UNSHARDED and self._shard_version() != self._gathered_version:
            return DataState.UNSHARDED_STALE
        return self._data

    @property
    def grad_divisors(self) -> tuple[float, float]:
        """(before the sum, after it): what the summed gradient is divided by, the number of
        ranks that summed it (DDP's average) unless ``set_gradient_divide_factor`` set another,
        split as the reduce dtype needs (``_split_divisor``)."""
        total = self.divide_factor if self.divide_factor is not None else self.world_size * self.replicas
        return _split_divisor(total, self.reduce_dtype)

    @property
    def unsharded_buffer(self) -> torch.Tensor:
        """The padded parameter-major unsharded buffer (its storage has 0 bytes while SHARDED)."""
        return self._padded_unsharded

    @property
    def grad_state(self) -> GradState:
        return self._grad

    @property
    def unsharded_nbytes(self) -> int:
        return self.layout.padded_unsharded_numel * self._padded_unsharded.element_size()

    @property
    def needs_gather(self) -> bool:
        """Whether ``unshard`` would start an all-gather."""
        return self.data_state in (DataState.SHARDED, DataState.UNSHARDED_STALE)

    @property
    def grad_packed(self) -> bool:
        return self._grad is GradState.PACKED

    @property
    def grad_settled(self) -> bool:
        """No gradient of this unit is on its way: nothing accumulated under ``no_sync`` waits
        to be reduced, and nothing is in flight."""
        return self._grad in (GradState.NONE, GradState.REDUCED)

    def _fail(self, what: str, found: Enum, expected: Sequence[Enum]) -> RuntimeError:
        names = " or ".join(e.name for e in expected)
        return RuntimeError(
            f"rank {collectives.rank()}: unit '{self.name}' cannot {what}: its {type(found).__name__} is "
            f"{found.name}, expected {names}. This is a shardwrap bug or a hook fired out of order; "
            f"please report it with the code that ran"
        )

    def _expect_grad(self, what: str, *expected: GradState) -> None:
        if self._grad not in expected:
            raise self._fail(what, self._grad, expected)

    def _expect_data(self, what: str, *expected: DataState) -> None:
        state = self.data_state
        if state not in expected:
            raise self._fail(what, state, expected)

    # ---- offloaded optimizer state (design/notes/offload.md) -------------------------------------

    def state_view(self, optimizer: object, i: int, number: int, dtype: torch.dtype, *, zeros: bool = False) -> DTensor:
        """Parameter ``i``'s part of the unit's ``number``-th optimizer-state file of ``optimizer``
        (one file per state a parameter has: Adam's ``exp_avg`` is number 0 for every parameter),
        a DTensor laid out like the parameter. The file is made on first use, holding zeros;
        ``zeros``: a file made before (a state the optimizer cleared) is zeroed too."""
        assert self.store is not None
        arena, made = self.store.state_arena(optimizer, self.index, number, self.layout.shard_numel, dtype)
        view = self.layout.sharded_views(arena, self.rank)[i]
        if zeros and not made:
            view.zero_()
        return self.as_dtensor(view, self.layout.slots[i])

    # ---- the flat shard (the surface state_dict.py and checkpoint.py read) ----------------------

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
        out.narrow(0, S, 1).fill_(float(self.index))  # a kernel: an item write from the host would wait for the device
        return out

    def write_shard(self, flat: torch.Tensor) -> None:
        """Overwrite this rank's shard with ``flat`` (``S`` elements, shard layout). The write bumps
        the shard's version counter, so an unsharded copy is stale afterwards."""
        self._root.finish_host_copies()  # offload on a GPU: no copy to the device still reads the shard
        with torch.no_grad():
            for dst, src in zip(self._local_params, self.layout.sharded_views(flat, self.rank)):
                dst.copy_(src)
        self._writes += 1

    def write_param(self, i: int, local: torch.Tensor) -> None:
        """Overwrite parameter ``i``'s local chunk with ``local``; an unsharded copy is stale
        afterwards."""
        self._root.finish_host_copies()  # offload on a GPU: no copy to the device still reads the shard
        with torch.no_grad():
            self._local_params[i].copy_(local)
        self._writes += 1

    def shard_digest(self) -> int:
        """Where the shard lives in the unsharded buffer (stage 1): a digest of this rank's rows of
        the parameters in ``digest_params``, their bytes summed as int64 words, which a write that
        no version counter saw still changes (``ShardedModule._catch_unseen_writes``)."""
        assert self.shard_in_unsharded
        views = self.layout.rank_views_of_unsharded(self._padded_unsharded, self.rank)
        flat = torch.cat([views[i].reshape(-1) for i in self.digest_params])  # a new tensor: starts at a word boundary
        raw = flat.view(torch.uint8)
        whole = raw.numel() // 8 * 8
        # Summed as int64 words (vectorized): the narrower integer views sum 20-40x slower
        return int(raw.narrow(0, 0, whole).view(torch.int64).sum()) + int(raw.narrow(0, whole, raw.numel() - whole).sum(dtype=torch.int64))

    def gathered_rows_hold_shard(self) -> bool:
        """A unit gathered from a shard of its own (not stage 1's shard in the unsharded buffer):
        whether this rank's rows of the unsharded buffer still hold its shard of the parameters in
        ``digest_params``, cast to ``param_dtype``, bit for bit. A write that no version counter
        saw (``ShardedModule._catch_unseen_writes``) makes them differ; comparing the bits, not
        the values, keeps a NaN from reading as a write."""
        assert self._sharded_storage is not None and self._data is DataState.UNSHARDED
        shard = self.layout.sharded_views(self._sharded_storage.narrow(0, 0, self.layout.shard_numel), self.rank)
        rows = self.layout.rank_views_of_unsharded(self._padded_unsharded, self.rank)
        bits = _SAME_SIZE_INT[self.param_dtype.itemsize]
        return all(torch.equal(shard[i].to(self.param_dtype).view(bits), rows[i].view(bits)) for i in self.digest_params)

    def mark_written(self) -> None:
        """The shard was (or may be) written through its local views, which bump no version
        counter: a load, or views handed out by ``state_dict()`` that
        ``torch.distributed.checkpoint.load`` fills in place. The next forward gathers again."""
        self._writes += 1

    def mark_stepped(self) -> None:
        """An optimizer stepped parameters of this unit that had a gradient, maybe with a kernel
        that bumps no version counter (foreach or fused on the DTensors): ``data_version`` moves."""
        self._writes += 1
        self._steps_written += 1

    def local_param(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s local chunk: a plain view of the flat shard."""
        return self._local_params[i]

    @property
    def sharded_local(self) -> torch.Tensor:
        """The flat shard without the tag (a copy when the shard lives in the unsharded buffer)."""
        return self.read_shard().narrow(0, 0, self.layout.shard_numel)

    @property
    def sharded_flat(self) -> DTensor:
        """The flat shard as a ``Shard(0)`` DTensor over the mesh (hybrid: replicated first)."""
        W, S = self.world_size, self.layout.shard_numel
        return dtensor_over(self.sharded_local, self.dtensor_mesh, self.placements(), torch.Size((W * S,)), (1,))

    def gather_full(self, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every parameter's full value, as new tensors (one all-gather, then for a TP parameter
        one gather over the TP mesh; the unit's state is untouched). ``flat`` gathers another tensor laid out like the shard (``S + 1`` elements),
        such as an optimizer state."""
        layout, W, S = self.layout, self.world_size, self.layout.shard_numel
        if not layout.slots:
            return []
        source = (self.read_shard() if flat is None else flat).to(self.device)
        gathered = torch.empty(W * (S + 1), dtype=source.dtype, device=self.device)
        collectives.all_gather(gathered, source, self.group)
        rows = gathered.view(W, S + 1)
        fulls = []
        for s in layout.slots:
            block = rows.narrow(1, s.shard_offset, s.chunk_numel).reshape(W * s.rows_per_rank, s.inner)
            full = block.narrow(0, 0, s.dim0).reshape(s.shape).clone()
            fulls.append(s.tp.full_of(full) if s.tp is not None else full)  # TP: then over the TP mesh
        return fulls

    def _make_used_outside(self, fqn: str) -> Callable[[torch.Tensor], None]:
        unit = self.name  # not self: a post-accumulate hook must not reference its unit (_weak)

        def used_outside(param: torch.Tensor) -> None:
            raise RuntimeError(
                f"rank {collectives.rank()}: parameter '{fqn}' of unit '{unit}' was used outside that "
                f"unit's forward (autograd reached its local shard). Read a unit's parameters only inside "
                f"its own forward, or let auto_wrap_policy put the code that reads it in the same unit. "
                f"For a penalty over model.parameters() added to the loss (an L2 term), use the "
                f"optimizer's weight_decay (SGD's and Adam's add that term's gradient), or compute the "
                f"term inside the units' forwards"
            )

        return used_outside

    # ---- the four hooks -----------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        """Forward pre-hook: gather the parameters and point the module's slots at them; under
        mixed precision, cast the floating inputs to ``param_dtype`` (``fully_shard``'s
        ``cast_forward_inputs``: an fp32 activation the root makes, from an fp32 buffer say,
        reaches the unit in the compute dtype).

        During backward this is activation checkpointing recomputing the unit: its pre_backward
        (or an earlier unit's recomputation) already owns the gather, and its post_backward the
        reshard, so the recomputation only makes sure the data is there and installs fresh views
        (design/notes/activation-checkpointing.md).
        """
        self._gather_before_forward(module)
        if self.input_dtype is None:
            return None
        return cast_floating(args, self.input_dtype), cast_floating(kwargs, self.input_dtype)

    def _gather_before_forward(self, module: nn.Module) -> None:
        root = self._root
        if root.in_backward():
            if torch._C._current_graph_task_id() == root.outer_task:
                root.release_due_units()  # the nested backwards that ran before this are over
            self._gather_for_backward()
            self._install_unsharded_views()
            return
        if self.training_state is TrainingState.FORWARD and root._in_call:
            # The module called again inside its own forward (Lightning's training_step runs in
            # the root's forward and calls self(x)): the parameters are in place already.
            self._reentered += 1
            return
        if root._summoned is not None:
            raise summon_refusal("a forward")
        if self.index == 0:
            root.root_pre_forward()
        self._check_slots()
        schedule = root.schedule
        schedule.record_pre_forward(self, torch.is_grad_enabled())
        self.training_state = TrainingState.FORWARD
        schedule.arrived(self)
        self.unshard()
        if (self.index == 0 and schedule.gather_all_ahead and schedule.max_unsharded > 1 and self.device.type == "cpu"
                and self.store is None and all(not u.stage.reshard_after_forward and u.stage.reshard_after_backward for u in root.units)
                and torch.is_grad_enabled()):  # (not module.training: ranks may differ in it, and must not in this)
            # Stage 2 on a CPU: every unit at once (design/notes/prefetch.md, "Stage 2 on a CPU")
            rest = schedule.forward_prefetch_rest(self)
            with collectives.interrupt_held():  # every gather the header announced is posted
                if rest:  # one header for them all, before any data: one behind a gather's data would wait for it
                    rest[0].check_in(following=rest)
                for unit in rest:
                    unit.unshard(async_op=True, checked_in=True)
        if self.forward_prefetch_units is not None:  # set_modules_to_forward_prefetch
            for listed in self.forward_prefetch_units:
                if listed.needs_gather and listed not in schedule.prefetched:
                    schedule.prefetched.add(listed)
                    listed.unshard(async_op=True)
        elif (ahead := schedule.forward_prefetch(self)) is not None:
            ahead.unshard(async_op=True)
        root._spares.drop()  # the allocations that could reuse them are made: none waits through compute
        self._forward_views = self._install_unsharded_views()

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Forward hook: the slots get the shards back; outputs that need a gradient get the
        pre_backward hook; stage 3 reshards; under ``MixedPrecision(output_dtype=...)`` the
        floating outputs are cast (after the hook is on them: their gradient reaches it through
        the cast), in every forward, recomputations included, as ``fully_shard`` casts them."""
        output = self._post_forward(module, output)
        return output if self.output_dtype is None else cast_floating(output, self.output_dtype)

    def _post_forward(self, module: nn.Module, output: Any) -> Any:
        root = self._root
        if root.in_backward():  # a recomputation ran to the end: keep data and views for backward
            recomputed = [t for t in tensors_in(output) if t.requires_grad] if torch.is_grad_enabled() else []
            if recomputed and torch._C._current_graph_task_id() == root.outer_task:
                # A reentrant region's nested backward will start from these outputs' gradient: from
                # then on the outer backward's next hook may free the unit (the nested one is over
                # by then), on every rank, whether or not it reaches the unit's split
                # (design/notes/activation-checkpointing.md, "Two calls before one backward")
                register_multi_grad_hook(recomputed, _weak(self._recomputation_read), mode="any")
            return output
        if self._reentered:  # an inner call ended; the outer one still runs
            self._reentered -= 1
            return output
        # (fully_shard leaves the root's unsharded parameters registered from here to its
        # backward; shardwrap puts the shards back: design/notes/fully-shard-methods.md, "Full
        # parameters")
        replaced = self._replaced_in_forward()
        self._install_sharded_params()
        if replaced:
            raise RuntimeError(
                f"rank {collectives.rank()}: shardwrap: the forward of unit '{self.name}' replaced parameter(s) "
                f"{', '.join(repr(n) for n in replaced)} (p.data = t, or a new tensor in the slot). Inside its forward a "
                f"unit's parameters are views of the gathered buffer: new values put there reach neither this rank's "
                f"shard nor the other ranks', and the next forward would undo them (fully_shard drops them the same "
                f"way, silently). Change parameters outside the forward, in place on model.parameters() under "
                f"torch.no_grad() (after optimizer.step(): p.clamp_(-c, c)), or with load_state_dict"
            )
        self.training_state = TrainingState.IDLE
        views, self._forward_views = self._forward_views, None
        found = tensors_in(output) if torch.is_grad_enabled() else []
        wants_grad = list({id(t): t for t in found if t.requires_grad}.values())  # once each
        # The backward schedule is the same on every rank: a unit that trains is in it even where
        # its outputs need no gradient on this rank (its trainable parameters were left out here,
        # data-dependently, and the rest are frozen or constant), and then gets its gather and a
        # reduce-scatter of zeros at the end of this rank's backward, paired with its peers' real
        # ones (design/notes/collective-schedule.md, "The same schedule on every rank").
        # A unit that does not train and stays gathered until its backward (stages 1 and 2) needs
        # nothing in backward: it is left out on every rank, since whether its outputs need a
        # gradient can differ between ranks (a frozen unit behind a data-dependent one), and its
        # place in the list would pace a count exchange on some ranks only. One that reshards
        # after forward (stage 3) is in the list on every rank where a unit that trains finished
        # before it started, since its inputs may need a gradient on some ranks only.
        trains, grad_mode = self.trains, torch.is_grad_enabled()
        regathers = self.stage.reshard_after_forward
        scheduled = (bool(wants_grad) and (trains or regathers)) or (grad_mode and (
            trains or (regathers and root.schedule.behind_training(self))))
        if grad_mode:
            root.schedule.finished_forward(trains)
        if wants_grad:
            graph = root.graph_made() if self.index == 0 else None
            register_multi_grad_hook(wants_grad, lambda grads: self._outputs_reached(views, graph), mode="any")
            if views is not None:
                views.checkpointed = any(type(t.grad_fn).__name__ == "CheckpointFunctionBackward" for t in wants_grad)
                self._calls = [call for call in self._calls if call() is not None]
                self._calls.append(weakref.ref(views))
                self._forward_calls = [call for call in self._forward_calls if call() is not None]
                self._forward_calls.append(self._calls[-1])
            root._expect_backward = True
        elif not torch.is_grad_enabled():  # (not module.training: ranks may differ in it)
            self.recomputable = True
        if scheduled:
            root.schedule.record_post_forward(self)
        # Backward gathers the root first and then the unit that ended the forward: resharding
        # them here would only gather them again at once (design/notes/prefetch.md). Decided from
        # what every rank shares, not from ``module.training``: a rank left in eval mode for a
        # training step would gather other units than its peers in backward.
        backward_next = scheduled and (self.index == 0 or root.schedule.ended_last_forward(self))
        if self.stage.reshard_after_forward and not backward_next:
            # The buffer may wait for the unit the next pre_forward gathers ahead, if it is as big
            # (design/notes/spare-buffers.md).
            after = root.schedule.gathers_after(self)
            self.reshard(spare=after is not None and after.unsharded_nbytes == self.unsharded_nbytes)
        if self.index == 0:
            root.root_post_forward()
        return output

    def _outputs_reached(self, views: "_Views | None", graph: Any) -> None:
        """A gradient reached the outputs of one of the unit's forward calls (``graph``: the root
        forward's ``PendingGraph``, for the root unit)."""
        if graph is not None:
            self._root.graph_reached(graph)
        self.pre_backward(views)

    def _recomputation_read(self, grads: object) -> None:
        """The nested backward of a reentrant region that recomputed this unit has begun."""
        self.release_due = True

    def pre_backward(self, views: "_Views | None" = None) -> None:
        """The first gradient reached the outputs of one of the unit's forward calls (``views``:
        what that call installed): gather it (in schedule order) and point the slots at it until
        backward is done with it. A recomputation that runs ``forward`` without the module's hooks
        (HF checkpoints ``forward``, not ``__call__``) then reads full parameters, as it read them
        in the first forward."""
        if torch.is_grad_enabled() and self.stage.reshard_after_backward and self.layout.slots:
            # autograd runs a backward in grad mode only with create_graph=True
            raise RuntimeError(
                f"rank {collectives.rank()}: shardwrap: a backward with create_graph=True (a double "
                f"backward: a gradient penalty, MAML, Hessian-vector products) reached unit "
                f"'{self.name}', which frees its gathered parameters when a backward ends (stages 2 and 3). "
                f"The graph that backward builds keeps them, so the second backward "
                f"would read freed storage. Use stage=1 (the parameters stay gathered; second derivatives "
                f"with respect to inputs, as a gradient penalty takes them), or leave this unit out of the "
                f"double-backward part of the model."
            )
        root = self._root
        root.begin_backward()
        task = torch._C._current_graph_task_id()
        # This backward reads each call's views until their split runs (not so where the call used
        # them under no_grad only: HF checkpoints the layer's forward). Every call's, at the unit's
        # first pre_backward in this backward, not only this one's: the calls whose gradient comes
        # later must not find the unit freed. A call a finished backward cleared is this one's own.
        calls = [view_set for call in self._calls if (view_set := call()) is not None]
        new = calls if task != self._calls_task else []
        self._calls_task = task
        if views is not None and not any(call is views for call in calls):
            new.append(views)
        for call in new:
            reached = torch._C._will_engine_execute_node(call.split)
            if reached:
                self._awaited.append((call.number, task))
            elif not call.checkpointed:
                # A call whose views this backward does not reach (it read only frozen parameters,
                # constants to autograd, or none) may still get a gradient at its outputs, and
                # then reads the gathered parameters for its inputs' gradient, with no split to say
                # when it is done. Freed after the other calls' splits, the unit would be gathered
                # again for it: on the ranks whose rows took that path only, a gather the others
                # never join (a hang, found by tests/test_programs.py). It stays gathered to the end
                # of the backward, as a frozen unit does, unless a nested backward recomputes it
                # (_views_done). A call under HF's reentrant checkpoint is left to its nested
                # backward from the start (design/notes/activation-checkpointing.md).
                self._held = True
            if call is not views:  # its backward is still to begin (_waits_for_a_call)
                self._unstarted[call.number] = "awaited" if reached else "checkpointed" if call.checkpointed else "held"
        if views is not None:
            self._unstarted.pop(views.number, None)
        if task == root.outer_task:
            root.release_due_units()  # the nested backwards that ran before this are over
        self._gather_for_backward()
        with torch.enable_grad():  # backward runs without grad mode; the recomputation needs views autograd can follow to the leaf
            self._install_unsharded_views()
        self.training_state = TrainingState.BACKWARD

    def _gather_for_backward(self) -> None:
        """Gather this unit for backward after every unit the schedule puts before it, then
        gather the next one ahead if the limit allows."""
        schedule = self._root.schedule
        for unit in schedule.gathers_through(self):
            unit.unshard(async_op=unit is not self)
            unit.training_state = TrainingState.BACKWARD
        schedule.arrived(self)
        self._root.apply_completed_reductions()  # before this unit's buffers are allocated
        self.unshard()  # finishes a prefetch, or gathers a unit outside the schedule
        self._root.prefetch_backward()
        self._root._spares.drop()

    def post_backward(self) -> None:
        """Autograd finished this unit's flat gradient for this backward (post-accumulate-grad
        hook): pack it for the reduce-scatter, reshard, start the reduce-scatters now due."""
        root = self._root
        root.begin_backward()
        if torch._C._current_graph_task_id() != root.outer_task:
            self._nested_seen = True
        self._grad_arrived()
        # A reentrant checkpoint inside the unit's forward: its recomputation's nested backward
        # brought this part of the gradient, and the outer backward will still run a split of
        # this unit's views (the forward read trainable parameters outside the region), bringing
        # the rest into the same gradient. Whether it does can differ between ranks (a branch some
        # ranks' rows take), so the one reduce-scatter waits for that arrival; a rank without it
        # reduces now. Reducing twice where a peer reduced once hung (design/notes/activation-checkpointing.md,
        # "Reentrant checkpointing inside a unit's forward").
        reduce_now = root._sync and not self._waits_for_a_call() and not (torch._C._current_graph_task_id() != root.outer_task and any(
            task == root.outer_task for _, task in self._awaited))
        if reduce_now:
            self.pack_grad()
        elif not root._sync:
            self._accumulate_in_reduce_dtype()
        self.release_if_done()
        self.training_state = TrainingState.IDLE
        if reduce_now:
            root.start_due_reductions()
        root.schedule.unit_backward_done()
        root.prefetch_backward()
        if self.store is not None and self.device.type == "cpu":
            return_free_heap()  # host RAM is what offload saves: free heap pages go back now

    def _post_accumulate_grad(self, leaf: torch.Tensor) -> None:
        if leaf.grad is not None and leaf.grad.requires_grad:
            # Drop it, with whatever no_sync had accumulated (as after any failed backward): stage 1
            # keeps this buffer between steps, and autograd's create_graph sum is a new tensor
            # anyway, which the next step's gradient would have been added to
            leaf.grad = None
            raise RuntimeError(
                f"rank {collectives.rank()}: shardwrap: unit '{self.name}' got a gradient that itself requires "
                f"grad: a backward with create_graph=True computed the parameters' gradients "
                f"(loss.backward(create_graph=True), a Hessian-vector product over the parameters). The "
                f"gradients are reduced across ranks as plain tensors, so their graph would be lost. Take "
                f"second derivatives with respect to inputs only (torch.autograd.grad(out, x, "
                f"create_graph=True), as a gradient penalty does), which stage 1 supports."
            )
        self.post_backward()

    def _check_leaf(self, made: int) -> None:
        """Refuse a backward through a graph recorded over a leaf the unit has replaced since
        (``follow_unfreezing``): its gradient is laid out for the old trainable prefix and has
        nowhere to go."""
        if made != self._aliases_made:
            raise RuntimeError(
                f"rank {collectives.rank()}: shardwrap: unit '{self.name}': this backward runs through a graph "
                f"recorded before a parameter frozen at wrapping was unfrozen, and the unit's gradient layout "
                f"has grown since. Unfreeze between optimizer steps: after the backward of every forward "
                f"before it (or set requires_grad before wrapping)"
            )

    def _note_used_grads(self, made: int, grad_outputs: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...] | None:
        """Autograd node pre-hook on the views' split: record which trainable views received a
        gradient (the split's outputs alternate a parameter's piece and its padding; autograd
        passes None for an output nothing used). ``made``: the leaf the views are of.

        A parameter frozen since the forward made its view gets nothing: its gradient is dropped
        here, as autograd's accumulation skips a leaf that no longer requires grad, so it adds
        nothing to the flat gradient (design/notes/unused-parameters.md, "Frozen inside a window")."""
        self._check_leaf(made)
        used, params = self._grad_used, self.sharded_params
        kept: list[torch.Tensor | None] | None = None
        for i in range(len(used)):
            if grad_outputs[2 * i] is None:
                continue
            if params[i].requires_grad:
                used[i] = True
            else:
                kept = list(grad_outputs) if kept is None else kept
                kept[2 * i] = None
        return None if kept is None else tuple(kept)

    def take_usage(self) -> torch.Tensor | bool:
        """Per trainable parameter, how many ranks' backwards reached it in this backward's
        reductions; cleared. ``True`` where this rank's backward reached every one (each was then
        used somewhere, and the flags need no read: on a GPU that read waits for the whole
        backward), ``False`` where no reduction finished with a gradient, else the used-flags
        summed (in ``reduce_dtype``). Each reduction's flags are a copy of their own, summed only
        here (after the copy streams are done: offload on a GPU finishes a reduction on one)."""
        usage, self._usage = self._usage, []
        used, self._used_here = self._used_here, [False] * len(self._used_here)
        if not usage:
            return False
        # a parameter frozen since wrapping gets no p.grad from a reduction: it needs no answer
        answered = all(u or not p.requires_grad for u, p in zip(used, self.sharded_params))
        return True if answered else torch.stack(usage).sum(0)

    def settle_unused_grads(self, used_anywhere: Sequence[bool]) -> None:
        """At the end of a backward that reduced: a parameter whose ``p.grad`` a reduction
        created, but that no rank's forward used, gets ``p.grad = None`` back, as in plain
        PyTorch, where an optimizer then leaves it alone (no momentum, no weight decay). The
        reduction gave it zeros: the flat gradient covers the whole unit."""
        for i in self._fresh_grads:
            if not used_anywhere[i]:
                self.sharded_params[i].grad = None
        # A parameter some rank used was reduced and got its p.grad here, unless frozen since wrapping
        self._hooks_due = [i for i, used in enumerate(used_anywhere)
                           if used and (self.sharded_params[i].requires_grad or i in self._frozen_reduced)]
        self._fresh_grads, self._frozen_reduced = [], []

    def run_grad_hooks(self) -> None:
        """The end of a backward that reduced: each parameter whose gradient it delivered (and
        that some rank's forward used, as autograd would only then accumulate one) runs the
        hooks users registered with ``p.register_post_accumulate_grad_hook``, as autograd runs
        them once ``p.grad`` is final: the optimizer-in-backward pattern steps there
        (design/notes/dtensor-parameters.md, "Post-accumulate-grad hooks")."""
        due, self._hooks_due = self._hooks_due, []
        for i in due:
            param = self.sharded_params[i]
            if param.grad is None:
                continue
            hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
            for key, hook in list(hooks.items()):
                if key not in self._own_grad_hooks:
                    hook(param)

    def _views_done(self, number: int, grad_outputs: object) -> None:
        """Autograd node pre-hook on a set of views' split: every op that used those views in the
        running backward (graph task) is done; after the last awaited set, free the parameters
        before the flat gradient is allocated (design/notes/prefetch.md, "Resharding before the
        flat gradient"). A unit called several times in one forward stays gathered until its
        last call's views are done."""
        task = torch._C._current_graph_task_id()
        if (number, task) in self._awaited:
            self._awaited.remove((number, task))
        if task != self._root.outer_task:
            self._nested_seen = True
            # a reentrant checkpoint's recomputation reads the views: the calls whose splits the
            # outer backward does not reach were read inside such a region, and the nested
            # backwards release the unit as before
            self._held = False
        self.release_if_done()

    def _waits_for_a_call(self) -> bool:
        """Whether the unit must stay gathered, and its gradient unreduced, until another forward
        call's backward has begun (``pre_backward`` lists them in ``_unstarted``).

        Where a reentrant checkpoint is involved, how a call reads the unit in backward depends on
        the rows: its split awaited by the outer backward (a branch outside the region), its
        outputs straight out of the region (``checkpointed``: the nested backward reads it), or
        held (a branch of frozen parameters after the region). Each kind freed the unit and
        reduced its gradient at another point, so two calls before one backward gathered and
        reduced once on some ranks and twice on others (a hang). So every rank waits for every
        call: in a nested backward; in the outer one while a checkpointed call is still to come,
        or a held one after a nested backward reached the unit (its own nested backward will
        bring a part). Without a reentrant region nothing frees the unit early (awaited calls keep
        it, held ones hold it) and a call still to come brings no later part, so the gradient
        reduces at once: a forward whose loss has its own later backward keeps its overlap
        (design/notes/activation-checkpointing.md, "Two calls before one backward")."""
        if not self._unstarted:
            return False
        if torch._C._current_graph_task_id() != self._root.outer_task:
            return True
        kinds = self._unstarted.values()
        return "checkpointed" in kinds or (self._nested_seen and "held" in kinds)

    def release_if_done(self) -> None:
        """A backward may be done with the gathered parameters (a split or the flat gradient's
        hook ran): unless a running backward still awaits a set of views, put the shards back in
        the slots and free the parameters (stages 2 and 3). Inside a nested backward (a reentrant
        checkpoint's) that waits for the outermost backward: the backward that started it may
        still read the views, and a later recomputation may read the slots
        (design/notes/activation-checkpointing.md, "When backward is done with a unit")."""
        if self._awaited or self._held or self._waits_for_a_call():
            return
        root = self._root
        if torch._C._current_graph_task_id() != root.outer_task:
            self.release_due = True
            return
        self.release()

    def release(self) -> None:
        """Backward is done with the gathered parameters: the slots get the shards back (a
        recomputation left views there) and stages 2 and 3 free them."""
        self.release_due = False
        if self.stage.reshard_after_backward:
            self.reshard()  # the slots first
        else:
            self._install_sharded_params()

    def end_backward(self) -> None:
        """The end of backward: views of forward calls whose outputs got no gradient are not
        waited for."""
        self._awaited, self.release_due, self._calls, self._calls_task = [], False, [], -1
        self._held, self._unstarted, self._nested_seen = False, {}, False

    # ---- data-state transitions ---------------------------------------------------------------

    def unshard(self, *, async_op: bool = False, checked_in: bool = False) -> None:
        """All-gather the flat shard into the unsharded buffer (ONE collective).

        SHARDED or UNSHARDED_STALE -> GATHERING -> UNSHARDED. With ``async_op`` the collective
        is only started (prefetch); the next plain ``unshard`` finishes it. UNSHARDED: nothing.
        ``checked_in``: the caller ran ``check_in`` for this gather already.
        """
        state = self.data_state
        if state is DataState.GATHERING:
            if not async_op:
                self._finish_gather()
                if self.data_state is DataState.UNSHARDED_STALE:  # written while in flight: gather it as it is now
                    self.unshard()
            return
        if state is DataState.UNSHARDED:
            return
        if not self.layout.slots:
            self._data, self._gathered_version = DataState.UNSHARDED, self._shard_version()
            return
        # Where this call exchanges a header before the gather (a caller that did, holds it itself)
        held = not checked_in and self.device.type == "cpu" and self.world_size > 1
        with collectives.interrupt_held() if held else contextlib.nullcontext():  # a Ctrl-C in the header's wait: the gather it announced is posted first
            self._start_gather(checked_in)
        if not async_op:
            self._finish_gather()

    def _start_gather(self, checked_in: bool) -> None:
        """The header exchange (unless ``checked_in``), then the data all-gather posted:
        SHARDED or UNSHARDED_STALE -> GATHERING."""
        layout, W, S = self.layout, self.world_size, self.layout.shard_numel
        if not checked_in:
            self.check_in()
        if self.store is not None and self.store.kind == "disk":
            # The next units' master shards start coming from disk while this rank computes
            # (design/notes/offload.md, "Reading ahead"); wrap order is the usual forward order.
            step = -1 if self._root.in_backward() else 1
            for ahead in (self.index + step, self.index + 2 * step):
                self.store.read_ahead(ahead)
        if self.store is not None:  # the master shard is on the offload side: stage it here
            if self.device.type == "cuda":
                # On a copy stream of its own, into a buffer from that stream's pool: the copy waits
                # for nothing on the compute stream, so it runs beside the kernels already queued
                # there; only the gather (and what follows it) waits for the copy
                # (design/notes/offload.md, "Copies on a GPU").
                stream, compute = self._root.copy_stream(self.device, "to device"), torch.cuda.current_stream(self.device)
                with torch.cuda.stream(stream):
                    send = torch.empty(S + 1, dtype=self.param_dtype, device=self.device)
                    send.copy_(self.read_shard(), non_blocking=True)
                compute.wait_stream(stream)
                send.record_stream(compute)  # freed only after the compute stream has used it
            else:  # a CPU-only run: the same path, a host-to-host copy (into the last unit's send buffer)
                send = torch.empty(0, dtype=self.param_dtype, device=self.device)
                self._root._spares.allocate("send", send.untyped_storage(), (S + 1) * send.element_size())
                send.set_(send.untyped_storage(), 0, (S + 1,), (1,))
                send.copy_(self.read_shard())
        else:
            send = self.read_shard().to(self.param_dtype)  # no copy without mixed precision
        version_before = self._padded_unsharded._version  # stage 1: the gather rewrites the shard's own rows
        shard_version = self._shard_version()
        if collectives.sends_pieces(self.group, send.device, send.numel() * send.element_size(), len(layout.slots) + 1):
            # Each peer's chunk of each parameter goes straight to its rows of the unsharded
            # buffer, the tags to a (W,) tensor: no rank-major buffer, no copy-out
            # (design/notes/cpu-collectives.md).
            self._allocate_unsharded()
            tags = torch.empty(W, dtype=self.param_dtype, device=self.device)
            pieces = [send.narrow(0, s.shard_offset, s.chunk_numel) for s in layout.slots] + [send.narrow(0, S, 1)]
            params = [piece.view(W, c) for piece, c in zip(self._padded_unsharded.split(layout.padded_sizes), layout.chunk_sizes)]
            rows = [[piece[r] for piece in params] + [tags.narrow(0, r, 1)] for r in range(W)]
            work = collectives.all_gather_pieces(rows, pieces, self.group, async_op=True)
            self._gather = _Gather(work, tags, send, direct=True, version_before=version_before, shard_version=shard_version)
        else:
            gathered = torch.empty(W * (S + 1), dtype=self.param_dtype, device=self.device)
            work = collectives.all_gather(gathered, send, self.group, async_op=True)
            self._gather = _Gather(work, gathered, send, version_before=version_before, shard_version=shard_version)
        self._data = DataState.GATHERING

    def _grad_to_host(self, reduced: torch.Tensor) -> torch.Tensor:
        """Offload: the averaged gradient shard in host memory, from the reduced one.

        On a GPU the average is taken there, in the master dtype, as without offload (CUDA divides
        by a scalar as a multiplication by its reciprocal, which may differ from the host's
        division in the last bit), and the copy to pinned memory is left in flight on the
        "to host" copy stream, beside the rest of the backward; the end of backward, and any
        gradient that must be added to now, wait for it (design/notes/offload.md, "Copies on a
        GPU"). A CPU-only run averages the reduced shard where it is when it has the master dtype
        (it is already host memory, and this unit's own buffer), and otherwise copies host to host."""
        if self.device.type != "cuda" and reduced.dtype == self.dtype and reduced.device == self.shard_device:
            _average_grad(reduced, self.grad_divisors[1])
            return reduced
        host = torch.empty(reduced.numel(), dtype=self.dtype, device=self.shard_device, pin_memory=self.device.type == "cuda")
        if self.device.type != "cuda":
            host.copy_(reduced)
            _average_grad(host, self.grad_divisors[1])
            return host
        averaged = reduced.to(self.dtype)  # reduced is this unit's own buffer: averaging in place is safe
        _average_grad(averaged, self.grad_divisors[1])
        stream, compute = self._root.copy_stream(self.device, "to host"), torch.cuda.current_stream(self.device)
        if compute != stream:  # (finish_grad_beside_compute runs all of this on the copy stream)
            stream.wait_stream(compute)  # after the average (and the reduction it reads)
        with torch.cuda.stream(stream):
            host.copy_(averaged, non_blocking=True)
        averaged.record_stream(stream)
        if any(p.grad is not None for p in self.sharded_params[: self.layout.num_trainable]):
            self._root.finish_host_copies()  # accumulating into an existing gradient reads it now
        return host

    def _where(self, collective: str) -> str:
        """``collective`` of this unit, the phase and the step, for error messages."""
        root = self._root
        phase = "backward" if root.in_backward() else "forward"
        return f"the {collective} of unit '{self.name}' in {phase} of step {root._steps_done + 1}"

    def check_in(self, following: Sequence[Unit] = ()) -> None:
        """The header exchange that precedes this unit's next data all-gather, where it has one
        (a CPU group of more than one rank, a unit with parameters). ``following``: the units
        whose gathers start together, this one first (stage 2's forward on a CPU); the one header
        covers them all."""
        units = following or [self]
        if self.device.type == "cpu" and self.world_size > 1 and any(u.needs_gather and u.layout.slots for u in units):
            self._check_in_step([u.index for u in following])

    def _check_in_step(self, listed: Sequence[int] = ()) -> None:
        """Before the data all-gather, one 16-byte all-gather of (phase, unit index), and for
        gathers started together their number and a 48-bit digest of their units' indices: if a
        peer is at another unit, another phase, a count exchange, or starts other gathers at
        once, every rank raises here instead of gloo aborting on a size mismatch
        (design/notes/rank-agreement.md). CPU only."""
        if self._root.in_backward():  # a peer that left this backward out may have said so already
            self._root.schedule.check_landed_exchanges()
        kind = collectives.HEADER_BACKWARD if self._root.in_backward() else collectives.HEADER_FORWARD
        past = self._root.schedule.history << collectives.HISTORY_SHIFT
        mine = [kind + (collectives.digest48(listed) << 8 if listed else 0), self.index + (len(listed) << 32) | past]
        rows = collectives.all_gather_ints(mine, self.group, what=self._where("all-gather"), kind="headers")
        if any(row != mine for row in rows):
            from shardwrap.schedule import OUT_OF_STEP_HINT, header_text, history_hint

            texts = [header_text(k, v, list(self.unit_names)) for k, v in rows]
            seen = ", ".join(f"rank {r}: {text}" for r, text in enumerate(texts))
            if len(set(texts)) == 1 and len({k for k, _ in rows}) > 1:
                seen += "; the same first unit and number on every rank, but other units after it"
            seen += ")." + history_hint(rows)  # a step apart: the same unit, another past
            if self._root.in_backward() and (self.recomputable or any(k & 0xFF == collectives.HEADER_END for k, _ in rows)):
                from shardwrap.sharded_module import RECOMPUTED_ON_SOME_RANKS

                seen += f" {RECOMPUTED_ON_SOME_RANKS}"
            raise self._root.schedule.out_of_step(
                f"rank {collectives.rank()}: shardwrap: ranks disagree on the next collective at {self._where('all-gather')} "
                f"({seen} {OUT_OF_STEP_HINT}"
            )

    def _finish_gather(self) -> None:
        self._expect_data("finish an all-gather", DataState.GATHERING)
        gather = self._gather
        assert gather is not None
        self._gather = None
        collectives.wait(gather.work, self._where("all-gather"))
        if gather.direct:  # the data is in place; ``output`` holds the tags
            self._check_tags(gather.output, gather.send, rows=gather.output)
        else:
            self._check_tags(gather.output, gather.send)
            self._allocate_unsharded()
            with torch.no_grad():
                self.layout.copy_gathered_to_unsharded(gather.output, self._padded_unsharded)
        if self.shard_in_unsharded:  # its own rows were rewritten with what they held: no write of the data
            self._own_bumps += (self._padded_unsharded._version - gather.version_before) * len(self._local_params)
        if self.store is not None and self.device.type == "cpu":
            self._root._spares.release("send", gather.send.untyped_storage())  # the next unit copies into it
        # What was sent is the shard as it was when the gather started: a write while it was in
        # flight (an optimizer step after unshard(async_op=True)) leaves the result stale
        self._data, self._gathered_version = DataState.UNSHARDED, gather.shard_version

    def _allocate_unsharded(self) -> None:
        storage = self._padded_unsharded.untyped_storage()
        if storage.nbytes() == 0:
            self._root._spares.allocate("unsharded", storage, self.unsharded_nbytes)  # a freed unit's memory, on a CPU

    def reshard(self, spare: bool = False) -> None:
        """Free the unsharded buffer: -> SHARDED, unless the shard lives in the unsharded buffer
        (stage 1), which then stays. The slots get the sharded parameters first, so no module
        ever holds a view of freed storage. ``spare``: on a CPU the memory waits for the next
        unit's gather instead of going back to the system."""
        self._install_sharded_params()
        if self.data_state is DataState.GATHERING:
            self._finish_gather()  # a prefetch nobody used: complete it so the sequence stays paired
        if self.shard_in_unsharded or self._data is DataState.SHARDED:
            return
        self._free_unsharded(spare)
        self._data = DataState.SHARDED

    def abandon(self, wait: bool = True) -> None:
        """Drop what a forward or backward that raised left behind: -> SHARDED (stage 1: the
        buffer stays), no gradient pending (GradState NONE unless it was settled), IDLE.

        Collectives in flight are waited for, not dropped, so this rank's sequence stays paired
        with its peers'; their results are thrown away. A gradient accumulated under ``no_sync``
        is dropped with the failed step's.

        A wait that fails here does not stop the cleanup: the unit still ends resharded and
        idle, and the first failure is raised at the end. After a lost peer the other waits
        still run (they fail at once); after any other failure (a timeout: a peer that is alive
        but stuck) they are skipped, since each could take the process group's whole timeout
        again. ``wait=False`` skips them all (the caller met such a failure in another unit).
        A skipped collective keeps its tensors alive in its own ``Work``."""
        failure: BaseException | None = None

        def finish(work: Any) -> None:
            nonlocal failure
            if not wait or (failure is not None and not collectives.lost_a_peer(failure)):
                return
            try:
                collectives.wait(work, self._where("collectives left in flight by the failed step"))
            except Exception as exc:
                failure = failure or exc

        gather, self._gather = self._gather, None
        if gather is not None:
            finish(gather.work)
        if self.shard_in_unsharded and (gather is not None or self._data is DataState.GATHERING):
            # the buffer's other rows are old (or a failed wait left it half gathered): gather again next time
            self._data, self._gathered_version = DataState.UNSHARDED, -1
        reduction, self._reduction = self._reduction, None
        if reduction is not None:
            if isinstance(reduction.done, _WaiterProbe):
                finish(reduction.done)  # never wait on one Work from two threads at once
            finish(reduction.work)
            finish(reduction.replica_work)
        self._packed = None
        self._reentered = 0
        self._forward_views = None
        self.end_backward()
        self._accumulated = None  # no_sync's reduce_dtype sum goes with the rest
        self._fresh_grads, self._grad_used, self._usage = [], [False] * len(self._grad_used), []
        self._used_here, self._frozen_reduced = [False] * len(self._grad_used), []
        self._trained_since_reduce = [False] * len(self._grad_used)
        self._hooks_due = []
        leaf = self.unsharded_trainable
        if self._grad in (GradState.ACCUMULATING, GradState.PACKED, GradState.IN_FLIGHT):
            if self.stage.keep_unsharded_grad and leaf.grad is not None:
                leaf.grad.zero_()
            self._grad = GradState.NONE
        if not self.stage.keep_unsharded_grad:
            leaf.grad = None
        self._install_sharded_params()
        if not self.shard_in_unsharded:
            self._free_unsharded()
            self._data = DataState.SHARDED
        self.training_state = TrainingState.IDLE
        if failure is not None:
            raise failure

    def _free_unsharded(self, spare: bool = False) -> None:
        # Autograd may still hold views of this storage; emptying the storage (not dropping the
        # tensor) frees the memory and keeps those views valid for the next unshard. A spare's
        # memory waits for the next unit's unshard (design/notes/spare-buffers.md).
        storage = self._padded_unsharded.untyped_storage()
        if spare:
            self._root._spares.release("unsharded", storage)
        else:
            storage.resize_(0)

    def _check_tags(self, gathered: torch.Tensor, send: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Raise if ranks gathered different units (their forwards ran different units).
        CPU only: reading the tags would synchronize the GPU stream on every unshard. ``rows``:
        the tags alone, one per rank (the pairwise gather)."""
        if self.device.type != "cpu":
            return
        S = self.layout.shard_numel
        tags = rows.tolist() if rows is not None else gathered.view(self.world_size, S + 1)[:, S].tolist()
        mine = send[S].item()
        if any(t != mine for t in tags):
            names = [self.unit_names[int(t)] if 0 <= int(t) < len(self.unit_names) else f"#{t}" for t in tags]
            by_rank = ", ".join(f"rank {r}: '{n}'" for r, n in enumerate(names))
            raise self._root.schedule.out_of_step(
                f"shardwrap: ranks disagree on which unit to all-gather ({by_rank}). Every rank must "
                f"run the same wrapped units in the same order in forward; move data-dependent "
                f"branches inside one unit, or run every branch on every rank."
            )

    # ---- module slots -------------------------------------------------------------------------

    def _install_unsharded_views(self) -> "_Views | None":
        """Point every slot at a fresh full-shape view of the unsharded buffer (a plain tensor in
        ``_parameters``: see design/notes/freeing-unsharded-storage.md). Returns their number and
        the split node behind them (None without trainable parameters)."""
        self._expect_data("install unsharded views", DataState.UNSHARDED)
        views = self.layout.unsharded_views(self.unsharded_trainable, self.unsharded_frozen)
        view_node = views[0].grad_fn if views and self.layout.num_trainable else None
        split = view_node.next_functions[0][0] if view_node is not None else None
        installed: _Views | None = None
        if split is not None:
            # The split node that turns the views' gradients into the flat gradient sees which
            # views got one: a parameter no rank's forward used keeps p.grad None
            # (design/notes/unused-parameters.md).
            split.register_prehook(_weak(self._note_used_grads, self._aliases_made))
            # It runs once every op that used the views in a backward is done: reshard before it
            # allocates the flat gradient (design/notes/prefetch.md, "Resharding before the flat
            # gradient"), or give the slots back (stage 1)
            self._view_sets += 1
            split.register_prehook(_weak(self._views_done, self._view_sets))
            installed = _Views(self._view_sets, split, self.data_version())
            keep = functools.partial(_keep_alive, installed)
            grad_mode = torch.is_grad_enabled()
            for i, param in enumerate(self.sharded_params[: self.layout.num_trainable]):
                if not param.requires_grad:  # frozen after wrapping: a constant, as autograd treats a frozen leaf
                    views[i] = views[i].detach()
                else:
                    self._trained_since_reduce[i] |= grad_mode
                    # Every node that consumed this view leads to its grad_fn: while one lives, a backward
                    # may still run through the split, and the forward call's record (held weakly in
                    # _calls) must stay; once none does, the record goes with the graph
                    node = views[i].grad_fn
                    assert node is not None  # a view of the flat leaf, made in grad mode
                    node.register_prehook(keep)
        self._put_in_slots(views)
        return installed

    def _put_in_slots(self, views: list[torch.Tensor]) -> None:
        for i, slot in enumerate(self.layout.slots):
            if slot.tp is not None:  # the module's forward and its TP hooks expect the TP DTensor
                views[i] = slot.tp.view(views[i])
        for view, slots in zip(views, self.slots):
            for module, attr in slots:
                module._parameters[attr] = view  # type: ignore[assignment]  # a plain tensor, on purpose

    def _check_slots(self) -> None:
        """Between forwards every slot holds its sharded parameter. One that holds something else
        was reassigned after wrapping (``module.weight = nn.Parameter(...)``, HF's
        ``resize_token_embeddings``, ``torch.func.functional_call`` with other tensors): the unit
        would gather and compute with its own shard and silently ignore it, so refuse instead.
        The same for a parameter whose ``.data`` was replaced (``p.data = t``): a DTensor holds
        no storage of its own, and that assignment gives it one that nothing reads."""
        self.check_wrappers()
        for param, slots, slot in zip(self.sharded_params, self.slots, self.layout.slots):
            for module, attr in slots:
                held = module._parameters.get(attr)
                if held is param:
                    continue
                # a view of this unit's unsharded buffer is this unit's own (torch.func.functional_call
                # puts back what it found mid-forward); a TP view is a DTensor over one
                ours = self._padded_unsharded.untyped_storage()._cdata
                try:
                    if held is not None and local_of(held).untyped_storage()._cdata == ours:
                        continue
                except NotImplementedError:  # functorch's wrapper has no storage to compare
                    raise RuntimeError(
                        f"rank {collectives.rank()}: shardwrap: parameter '{slot.fqn}' of unit '{self.name}' is a "
                        f"torch.func transform's tensor: torch.func.grad, vmap or jacrev "
                        f"through functional_call on a ShardedModule is not supported (the unit computes with "
                        f"the parameters it gathers, which the transform cannot see; fully_shard returns zero "
                        f"gradients). Run the transform on an unwrapped copy (built from full_state_dict()), or "
                        f"compute per-sample gradients without torch.func."
                    ) from None
                raise RuntimeError(
                    f"rank {collectives.rank()}: shardwrap: parameter '{slot.fqn}' of unit '{self.name}' is no "
                    f"longer the wrapped parameter: '{attr}' of {type(module).__name__} was replaced after "
                    f"wrapping (an assignment, a parametrization, or torch.func.functional_call with other "
                    f"tensors). The unit computes with its own shard and would ignore the new value. Change "
                    f"the model before wrapping, or write new values into the wrapped parameter "
                    f"(load_state_dict, or p.copy_ under torch.no_grad())."
                )

    def check_wrappers(self) -> None:
        """Every forward (``_check_slots``) and between steps (before a state dict or a save): refuse
        a parameter whose local shard an ``out=`` write resized (``_refuse_resized``), or whose
        ``.data`` was replaced (``_refuse_replaced_data``)."""
        for i, param in enumerate(self.sharded_params):
            if cast(Any, param)._local_tensor.shape != self._local_params[i].shape:
                self._refuse_resized(i)
            if _storage_id(param) != self._wrapper_storages[i]:
                self._refuse_replaced_data(i)

    def _refuse_replaced_data(self, i: int) -> None:
        """Parameter ``i``'s ``.data`` was replaced (``p.data = t``: torch.nn.utils.vector_to_parameters,
        ``p.data = p.data.clamp(...)``). The setter swaps the wrapper's storage and leaves the DTensor's
        local shard as it was, so the new values never reached the shard, and with a DTensor on the
        right nothing else shows it (design/notes/after-wrapping.md). Undo it first (the wrapper gets
        a storage-less DTensor's metadata back), so the error leaves a model that can go on."""
        param, slot = self.sharded_params[i], self.layout.slots[i]
        param.data = self.as_dtensor(self._local_params[i], slot)
        self._wrapper_storages[i] = _storage_id(param)
        raise RuntimeError(
            f"rank {collectives.rank()}: shardwrap: parameter '{slot.fqn}' of unit '{self.name}' had its "
            f".data replaced after wrapping (p.data = t; torch.nn.utils.vector_to_parameters does it). A "
            f"sharded parameter's values live in its unit's shard, which that assignment does not reach, so "
            f"the new values were dropped (fully_shard drops them silently); the parameter holds its old "
            f"values again. Write into the parameter instead, on every rank: under torch.no_grad() "
            f"p.copy_(d) for a DTensor d of p's shape and placements, p.copy_(distribute_tensor(full_tensor, "
            f"p.device_mesh, p.placements)), or model.load_state_dict({{'{slot.fqn}': full_tensor}}, strict=False)."
        )

    def _refuse_resized(self, i: int) -> None:
        """Parameter ``i``'s local tensor no longer has its shard's shape: an op with ``out=`` on
        the DTensor (``nn.init.eye_`` is ``torch.eye(*p.shape, out=p)``) ran on the local tensor
        with the global sizes and resized it in place, over the unit's flat shard, so its write
        went on past its rows into the parameters after it. The view gets its shape back (the
        model can be loaded again); the values written stay, so name every parameter they reached."""
        param, view, slot = self.sharded_params[i], self._local_params[i], self.layout.slots[i]
        local = cast(Any, param)._local_tensor  # the DTensor's own (to_local() gives an alias)
        start, end, resized = local.storage_offset(), local.storage_offset() + local.numel(), tuple(local.shape)
        with torch.no_grad():
            local.as_strided_(view.shape, view.stride(), view.storage_offset())
        reached = [
            s.fqn for s, v in zip(self.layout.slots, self._local_params)
            if s is not slot and v.numel() and v.storage_offset() < end and start < v.storage_offset() + v.numel()
        ]
        also = f"; the write also reached {', '.join(repr(n) for n in reached)} on this rank" if reached else ""
        raise RuntimeError(
            f"rank {collectives.rank()}: shardwrap: parameter '{slot.fqn}' of unit '{self.name}' had its local "
            f"shard resized from {tuple(view.shape)} to {resized} by a write with out= (nn.init.eye_, "
            f"or torch.<op>(..., out=p) on the DTensor parameter){also}. Those values are wrong now. Initialize "
            f"before wrapping, or write full values into the wrapped model on every rank: "
            f"model.load_state_dict({{'{slot.fqn}': full_tensor}}, strict=False) (or load a checkpoint)."
        )

    def restore_params(self) -> None:
        """The slots hold the sharded parameters again (after a recomputation that stopped early)."""
        self._install_sharded_params()

    def show_unsharded_params(self) -> None:
        """The slots get full-shape views of the gathered parameters, with no autograd history
        (for reading), as ``fully_shard``'s ``unshard()`` registers its unsharded parameters.
        They stay until the unit's next forward installs its own, ``reshard()``, or the end of a
        backward. Nothing happens unless the unit is gathered and outside a forward or backward."""
        if self.data_state is not DataState.UNSHARDED or self.training_state is not TrainingState.IDLE:
            return
        with torch.no_grad():
            self._put_in_slots(self.layout.unsharded_views(self.unsharded_trainable, self.unsharded_frozen))
        self.showing_full = True

    def show_sharded_params(self) -> None:
        """The slots get the sharded parameters back, and nothing else changes: after a forward or
        backward that raised, until the next forward cleans up (``ShardedModule.named_parameters``)."""
        self._install_sharded_params()

    def _replaced_in_forward(self) -> list[str]:
        """The parameters whose slot no longer holds memory of the gathered buffer at the end of
        the unit's forward: the forward swapped them (``self.w.data = self.w.data.clamp(...)``).
        A pointer range check per slot, no copy (design/notes/after-wrapping.md)."""
        storage = self._padded_unsharded.untyped_storage()
        low = storage.data_ptr()
        high = low + storage.nbytes()
        replaced = []
        for slot, places in zip(self.layout.slots, self.slots):
            if slot.tp is not None or slot.shape.numel() == 0:  # (an empty tensor's pointer may be anything)
                continue
            for module, attr in places:
                now = module._parameters.get(attr)
                if now is None or not low <= now.data_ptr() < high:
                    replaced.append(slot.fqn)
                    break
        return replaced

    def _install_sharded_params(self) -> None:
        """Point every slot back at its sharded parameter (what the optimizer and users see)."""
        self.showing_full = False
        for param, slots in zip(self.sharded_params, self.slots):
            for module, attr in slots:
                module._parameters[attr] = param

    # ---- gradient transitions -----------------------------------------------------------------

    def _row_grads(self) -> list[int]:
        """Indices of parameters whose ``p.grad`` is a view of the unsharded gradient's rows
        (stage 1 without mixed precision; see ``finish_grad``)."""
        leaf_grad = self.unsharded_trainable.grad
        if leaf_grad is None:
            return []
        base = leaf_grad.untyped_storage().data_ptr()
        return [
            i for i, p in enumerate(self.sharded_params)
            if p.grad is not None and local_of(p.grad).untyped_storage().data_ptr() == base
        ]

    def _before_accumulate(self, made: int, grad: torch.Tensor) -> None:
        """Tensor hook: autograd is about to add a new gradient into the unsharded gradient.

        REDUCED with the shard in the unsharded buffer means the rows of that buffer still hold
        the last reduced gradient, which ``p.grad`` may view: give those ``p.grad`` tensors of
        their own, so they keep accumulating like plain PyTorch, and zero the buffer (-> NONE).

        ``made``: which leaf the hook sits on. One the unit has replaced (``follow_unfreezing``)
        belongs to a graph recorded before the unfreezing, whose gradient has nowhere to go.
        """
        self._check_leaf(made)
        if not (self.shard_in_unsharded and self._grad is GradState.REDUCED):
            return
        for i in self._row_grads():
            param = self.sharded_params[i]
            param.grad = own_grad(param.grad.clone())  # type: ignore[union-attr]
        leaf_grad = self.unsharded_trainable.grad
        if leaf_grad is not None:
            leaf_grad.zero_()
        self._grad = GradState.NONE

    def _grad_arrived(self) -> None:
        """-> ACCUMULATING. A second gradient in one backward while the first is still in flight
        (a unit reached by two reentrant recomputations, or by a reentrant checkpoint inside its
        own forward) first lands the first one. Stage 1 lands it beside the unsharded gradient,
        not in its rows: autograd has just added the second gradient there."""
        if self._grad is GradState.IN_FLIGHT:
            self.finish_grad(into_rows=False)
        self._expect_grad("take a new gradient", GradState.NONE, GradState.ACCUMULATING, GradState.REDUCED, GradState.PACKED)
        if self._grad is not GradState.PACKED:
            self._grad = GradState.ACCUMULATING

    def _accumulate_in_reduce_dtype(self) -> None:
        """Under ``no_sync``, when ``reduce_dtype`` is wider than the compute dtype, move this
        micro-batch's unsharded gradient into a ``reduce_dtype`` sum (fully_shard does the same):
        summing micro-batches in bf16 would round at every addition (design/notes/mixed-precision.md)."""
        leaf = self.unsharded_trainable
        grad = leaf.grad
        if grad is None or grad.dtype == self.reduce_dtype:
            return
        if self._accumulated is None:
            self._accumulated = grad.to(self.reduce_dtype)
        else:
            self._accumulated += grad
        if self.stage.keep_unsharded_grad:
            grad.zero_()
        else:
            leaf.grad = None

    def pack_grad(self) -> None:
        """ACCUMULATING -> PACKED: move the unsharded gradient, rank-major and in
        ``reduce_dtype``, into the reduce-scatter input (its used-flag columns zero until the
        reduce-scatter starts); then free it (or zero it, when the stage keeps it). A PACKED unit
        adds the new gradient to its packed one."""
        accumulated, self._accumulated = self._accumulated, None
        if self._grad is GradState.PACKED and self.unsharded_trainable.grad is None and accumulated is None:
            return
        self._expect_grad("pack its gradient", GradState.ACCUMULATING, GradState.PACKED)
        leaf = self.unsharded_trainable
        grad = leaf.grad
        if grad is None and accumulated is None:  # autograd reached the unit but produced no gradient
            self._grad = GradState.PACKED if self._packed is not None else GradState.NONE
            return
        if accumulated is None:
            total = grad.to(self.reduce_dtype)  # type: ignore[union-attr]
        else:
            total = accumulated if grad is None else accumulated.add_(grad)
        layout, W = self.layout, self.world_size
        if self._reduces_directly():  # kept parameter-major: reduce_scatter_grad sends its pieces
            if self._packed is not None:
                total = total.add_(self._packed)  # ours: the leaf lets go of its gradient below
            self._packed, self._grad = total, GradState.PACKED
            if grad is not None:
                leaf.grad = None
            return
        packed = torch.empty(W * (layout.grad_shard_numel + layout.num_trainable), dtype=self.reduce_dtype, device=self.device)
        layout.pack_for_reduce_scatter(total, packed)
        packed.view(W, -1)[:, layout.grad_shard_numel :] = 0.0  # the used-flags: reduce_scatter_grad writes them
        if self._packed is not None:
            packed += self._packed
        self._packed, self._grad = packed, GradState.PACKED
        if grad is not None and self.stage.keep_unsharded_grad:
            grad.zero_()  # stage 1 keeps one unsharded gradient buffer for the whole run
        elif grad is not None:
            leaf.grad = None

    def reduce_scatter_grad(self) -> None:
        """PACKED or NONE -> IN_FLIGHT: start the reduce-scatter (asynchronous, on the reduce
        group). Every rank's part carries the used-flags, one per trainable parameter: 1 where
        this rank's backward reached it since the last reduce-scatter, so each rank's output
        ends with how many ranks did (design/notes/unused-parameters.md). A rank whose backward
        did not reach the unit (NONE) contributes zeros and zero flags, so the collective still
        pairs up."""
        self._expect_grad("start its reduce-scatter", GradState.PACKED, GradState.NONE, GradState.REDUCED)
        W, S, n = self.world_size, self.layout.grad_shard_numel, self.layout.num_trainable
        packed, used_here = self._packed, self._packed is not None
        self._packed = None
        flags = _to_device(self._grad_used, self.reduce_dtype, self.device)
        self._used_here = [a or b for a, b in zip(self._used_here, self._grad_used)]
        self._grad_used = [False] * n
        output = torch.empty(S + n, dtype=self.reduce_dtype, device=self.device)
        before = self.grad_divisors[0]
        if packed is not None and before != 1:  # fp16: part of the average before the sum (the flags are set after)
            packed.div_(before)
        if self._reduces_directly():
            # Rank r is sent its chunk of each parameter's gradient straight from the
            # parameter-major sum, and the used-flags; the chunks arrive in this rank's shard
            # layout (design/notes/cpu-collectives.md).
            if packed is None:
                packed = torch.zeros(W * S, dtype=self.reduce_dtype, device=self.device)
            slots = self.layout.slots[:n]
            rows = [piece.view(W, c) for piece, c in zip(packed.split(self.layout.padded_sizes[:n]), self.layout.chunk_sizes[:n])]
            # A 0-dim parameter's gradient is in row 0; every rank's copy gets the sum of row 0s.
            sends = [[row[0 if s.replicated else r] for row, s in zip(rows, slots)] + [flags] for r in range(W)]
            outs = [output.narrow(0, s.shard_offset, s.chunk_numel) for s in slots] + [output.narrow(0, S, n)]
            work = collectives.reduce_scatter_pieces(outs, sends, self.reduce_group, async_op=True)
        else:
            if packed is None:
                packed = torch.zeros(W * (S + n), dtype=self.reduce_dtype, device=self.device)
            packed.view(W, S + n)[:, S:] = flags
            work = collectives.reduce_scatter(output, packed, self.reduce_group, async_op=True)
        trained, self._trained_since_reduce = self._trained_since_reduce, [False] * n
        self._reduction = _Reduction(work, output, packed, completion_probe(work, self.device), used_here, trained)
        self._grad = GradState.IN_FLIGHT

    def _reduces_directly(self) -> bool:
        """Whether this unit's reduce-scatter sends per-parameter pieces (the pairwise path) rather
        than a rank-major packed buffer. The same answer on every rank (dtype, device, sizes and
        stage only): a rank whose backward never reached the unit must send the same pieces.
        Stage 1 keeps packing: its persistent gradient buffer is zeroed right after the pack."""
        if self.stage.keep_unsharded_grad or self.layout.grad_shard_numel == 0:
            return False
        shard_bytes = (self.layout.grad_shard_numel + self.layout.num_trainable) * self.reduce_dtype.itemsize
        return collectives.sends_pieces(self.reduce_group, self.device, shard_bytes, self.layout.num_trainable + 1)

    def finish_grad_beside_compute(self) -> bool:
        """Offload on a GPU, right after the reduce-scatter starts: queue the rest of the unit's
        gradient (the wait for the collective, the average and the copy to pinned host memory) on
        the "to host" copy stream, so the shard is copied out as soon as it is reduced and its
        device buffers are freed then. The compute stream never waits for the collective, so no
        all-gather issued later queues behind a reduce-scatter a peer has not issued yet. Returns
        whether it did; otherwise the reduction stays in flight and the end of backward finishes
        it, as without offload.

        Not when a gradient must be added into an existing ``p.grad`` (the host would block
        mid-backward on a collective), nor for hybrid sharding (its all-reduce over replicas
        starts in a fixed order), a rank whose backward did not reach the unit (its used-flags are
        read on the host), or under ``TORCH_NCCL_BLOCKING_WAIT`` (the wait would block the host)
        (design/notes/offload.md, "Copies on a GPU")."""
        r = self._reduction
        if self.store is None or self.device.type != "cuda" or r is None or not r.used_here or self.replicate_group is not None:
            return False
        if os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") not in ("", "0"):
            return False
        if any(p.grad is not None for p in self.sharded_params[: self.layout.num_trainable]):
            return False
        stream = self._root.copy_stream(self.device, "to host")
        for buffer in (r.output, r.input):  # made on the compute stream; reused only once the copy stream is past them
            if buffer is not None:
                buffer.record_stream(stream)
        with torch.cuda.stream(stream):
            self.finish_grad()
        return True

    def reduce_completed(self) -> bool:
        """Whether the reduce-scatter in flight has finished (never blocks)."""
        r = self._reduction
        return r is None or r.done is None or r.done()

    @property
    def reduces_pairwise(self) -> bool:
        """Whether this unit's reduce-scatter is pairwise sends and receives (a CPU group): then
        its own receives tell when every peer has started it. The same answer on every rank."""
        if self._reduces_directly():
            return True
        W, S = self.world_size, self.layout.grad_shard_numel + self.layout.num_trainable
        return collectives.uses_pairwise(self.reduce_group, self.device, W * S * self.reduce_dtype.itemsize)

    def reduce_started_everywhere(self) -> bool:
        """Whether every peer is known to have started the reduce-scatter in flight: its receives
        have landed (pairwise only; never blocks). Waiting for the rest of it is then safe."""
        r = self._reduction
        return r is not None and isinstance(r.work, collectives.PairwiseWork) and r.work.peers_started

    def finish_shard_reduction(self) -> None:
        """Wait for the reduce-scatter over the shard axis (IN_FLIGHT stays; idempotent)."""
        self._expect_grad("finish its reduce-scatter", GradState.IN_FLIGHT)
        r = self._reduction
        assert r is not None
        if r.shard_done:
            return
        what = self._where("reduce-scatter")
        if isinstance(r.done, _WaiterProbe):
            collectives.wait(r.done, what)  # never wait on one Work from two threads at once
        collectives.wait(r.work, what)  # on NCCL this orders the current stream after the collective
        r.shard_done, r.input = True, None  # hybrid waits for the all-reduce: free the full gradient now

    @property
    def shard_reduced(self) -> bool:
        """Hybrid: the reduce-scatter finished and the all-reduce over replicas may start."""
        r = self._reduction
        return r is not None and r.shard_done

    def start_replica_reduction(self) -> None:
        """Hybrid: start the all-reduce of the reduced shard and its used-flags over the replicate
        axis (asynchronous, on the replicate group). The root starts these in one fixed unit
        order, the same on every replica (design/notes/hybrid-sharding.md)."""
        r = self._reduction
        assert r is not None and r.shard_done and r.replica_work is None and self.replicate_group is not None
        r.replica_work = collectives.all_reduce_replicas(r.output, self.replicate_group)

    def finish_grad(self, into_rows: bool = True) -> None:
        """IN_FLIGHT -> REDUCED: wait for the reduce-scatter (hybrid: and the all-reduce over
        replicas, started by the root), average, and add this rank's piece into the sharded
        grads. A parameter no rank reached gets zeros here, added to an existing ``p.grad`` (no
        change) or as a new one that ``settle_unused_grads`` sets back to ``None``, as in plain
        PyTorch: deciding here would read the flags, a wait for the device per unit on a GPU.
        ``into_rows=False``: a new ``p.grad`` never views the rank's rows of
        the unsharded gradient (stage 1), which hold a newer gradient."""
        self.finish_shard_reduction()
        r = self._reduction
        assert r is not None
        if self.replicate_group is not None:
            if r.replica_work is None:
                raise RuntimeError(f"rank {collectives.rank()}: unit '{self.name}': its all-reduce over replicas was never started")
            collectives.wait(r.replica_work, self._where("all-reduce over replicas"))
        self._reduction = None
        reduced, S, n = r.output, self.layout.grad_shard_numel, self.layout.num_trainable
        self._grad = GradState.REDUCED
        self._usage.append(reduced.narrow(0, S, n).clone())  # how many ranks used each parameter (hybrid: every replica's too)
        if self.store is not None:  # the gradient shard goes to the offload side at once
            sharded_grad = self._grad_to_host(reduced.narrow(0, 0, S))
        else:
            sharded_grad = reduced.narrow(0, 0, S).to(self.dtype)  # no copy without mixed precision
            _average_grad(sharded_grad, self.grad_divisors[1])
        n = self.layout.num_trainable
        views = self.layout.sharded_views(sharded_grad, self.rank, n)
        leaf_grad = self.unsharded_trainable.grad
        rows = self.layout.rank_views_of_unsharded(leaf_grad, self.rank, n) if into_rows and self.shard_in_unsharded and leaf_grad is not None else None
        slots = self.layout.slots
        counts: list[float] | None = None
        for i, (param, view) in enumerate(zip(self.sharded_params[:n], views)):
            if not param.requires_grad:
                # Frozen after wrapping. Its p.grad still gets what backwards accumulated while it
                # was trainable (no_sync micro-batches before it was frozen: one process keeps those
                # in p.grad), which is where some rank's used-flag is set; the flags are summed over
                # ranks, so every rank decides alike. Read only for a parameter frozen since a
                # forward that trained it (on a GPU the read waits for the device).
                if not r.trained[i]:
                    continue
                counts = reduced.narrow(0, S, n).tolist() if counts is None else counts
                if not counts[i]:
                    continue
                self._frozen_reduced.append(i)
            if param.grad is not None:
                local_of(param.grad).add_(view)
            elif rows is not None:  # the rank's rows of the unsharded gradient, zeroed by pack_grad
                rows[i].copy_(view)
                param.grad = own_grad(self.as_dtensor(rows[i], slots[i]))
                self._fresh_grads.append(i)
            else:
                param.grad = own_grad(self.as_dtensor(view, slots[i]))
                self._fresh_grads.append(i)
