"""``fully_shard``'s per-module methods on shardwrap's units [design/notes/fully-shard-methods.md].

Code written for ``fully_shard`` calls methods on the modules it sharded: ``model.unshard()``
before a forward, ``model.set_requires_gradient_sync(is_last)`` around gradient accumulation,
``layer.set_modules_to_forward_prefetch([...])``. ``FullyShardMethods`` gives the same methods,
with ``fully_shard``'s meaning where shardwrap can keep it and an error that says what to do
where it cannot, to two hosts: the ``ShardedModule`` (its own unit is the root unit, and
``recurse`` reaches every unit) and each unit's module (the wrapped model for the root unit),
where ``install`` sets them as instance attributes. Both hosts are instances of torch's ``FSDPModule``, so library code that finds
the sharded modules with ``isinstance(m, FSDPModule)`` finds them: the ``ShardedModule`` class has
it as a base, and a unit's module gets a subclass of its own class that adds it (as
``fully_shard`` does), under the same name.

Each method acts on every rank alike, as under ``fully_shard``: call it on every rank.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import TYPE_CHECKING, Any, ContextManager, Sequence

import torch.nn as nn

try:
    from torch.distributed.fsdp import FSDPModule, UnshardHandle as _TorchUnshardHandle
except ImportError:  # torch < 2.6 kept them here
    from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
    from torch.distributed._composable.fsdp.fully_shard import UnshardHandle as _TorchUnshardHandle  # type: ignore[no-redef]

if TYPE_CHECKING:
    from shardwrap.stage import Stage
    from shardwrap.sharded_module import ShardedModule
    from shardwrap.unit import Unit

# What the methods leave alone on purpose: shardwrap has no such knob, and the numbers are the
# same without it (the design note says why, for each).
_NO_EFFECT = (
    "set_post_optim_event",
    "set_allocate_memory_from_process_group_for_comm",
    "set_symm_mem_for_comm",
    "set_reduce_scatter_max_input_buffers",
    "set_separate_reduce_scatter_group",
    "set_unshard_in_backward",
    "set_force_sum_reduction_for_comms",
    "set_reduce_scatter_unused_params",
)
_REFUSED = ("set_custom_all_gather", "set_custom_reduce_scatter", "set_all_reduce_hook")


class UnshardHandle(_TorchUnshardHandle):
    """What ``unshard(async_op=True)`` returns: ``wait()`` finishes the all-gathers it started
    (the unit's next forward would finish them anyway). A subclass of torch's, for code that
    checks or annotates the type."""

    def __init__(self, units: Sequence[Unit]) -> None:
        self._units = list(units)

    def wait(self) -> None:
        """Finish the gathers; each unit this finishes shows its full parameters in its module's
        slots, as ``fully_shard`` registers them (``Unit.show_unsharded_params``)."""
        from shardwrap.unit import DataState

        for unit in self._units:
            if unit.data_state is DataState.GATHERING:  # a forward may have finished (and freed) it since
                unit.unshard()
                unit.show_unsharded_params()
        self._units = []


def _check_bool(method: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{method}: {name} should be a bool, got {type(value).__name__} ({value!r})")


class FullyShardMethods:
    """``FSDPModule``'s public methods. A host gives ``_fs_root`` (the ``ShardedModule``),
    ``_fs_own`` (the units whose parameters are the host module's own) and ``_fs_reach`` (the
    units ``recurse=True`` reaches: those whose modules lie inside the host module)."""

    def _fs_root(self) -> ShardedModule:
        raise NotImplementedError

    def _fs_own(self) -> list[Unit]:
        raise NotImplementedError

    def _fs_reach(self, recurse: bool) -> list[Unit]:
        raise NotImplementedError

    def _fs_name(self) -> str:
        raise NotImplementedError

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: the root's cleanup (``ShardedModule.
        reset_iter_state``), from whichever module it is called on."""
        self._fs_root().reset_iter_state()

    def _get_fsdp_state(self) -> Any:
        """``fully_shard``'s internal state, which torch's own FSDP code reads after an
        ``isinstance(m, FSDPModule)`` check. shardwrap has none: say so, naming the module."""
        raise NotImplementedError(
            f"'{self._fs_name()}' is sharded by shardwrap, not by torch's fully_shard: it is an FSDPModule so that "
            f"code finding sharded modules with isinstance() reaches its public methods (unshard, reshard, "
            f"set_requires_gradient_sync, set_gradient_divide_factor, ...), but it has no fully_shard state for "
            f"torch's FSDP internals (fully_shard.state(), _get_fsdp_state()) to read. Call the public methods instead"
        )

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """``fully_shard``'s private switch for how its hooks wait for their all-gathers: a
        stream setting with no counterpart here, the numbers are the same."""
        _check_bool("_set_unshard_async_op", "async_op", async_op)

    def _fs_between_steps(self, what: str) -> None:
        root = self._fs_root()
        root.check_between_steps(what)
        if root.backward_owed:
            raise RuntimeError(
                f"{what} on '{self._fs_name()}' between a forward and its backward: the backward reads the "
                f"gathered parameters as that forward left them. Call it after the backward (or before the forward)"
            )

    # ---- gathering --------------------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's own unit now (not recursive, as in ``fully_shard``); its next
        forward then gathers nothing. ``async_op``: return a handle whose ``wait()`` finishes
        the gather (the forward waits for it otherwise). Once gathered, the module's parameters
        are full-shape plain tensors in its slots (``module.weight``), for reading, as under
        ``fully_shard``, until its next forward, ``reshard()`` or the end of a backward. The unit
        is freed again as its stage says (after its forward at stage 3) or by ``reshard()``."""
        _check_bool("unshard", "async_op", async_op)
        root = self._fs_root()
        root.refuse_out_of_step("unshard()")
        if root.in_backward():
            raise RuntimeError(f"unshard() on '{self._fs_name()}' during a backward: the backward gathers each unit itself")
        units = [u for u in self._fs_own() if u.needs_gather]
        for unit in units:
            unit.unshard(async_op=True)
        for unit in self._fs_own():  # gathered already (stage 1, or kept): full at once
            if unit not in units:
                unit.show_unsharded_params()
        handle = UnshardHandle(units)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's own unit's gathered parameters (not recursive). Stage 1 keeps its
        shard in the gathered buffer, so there nothing is freed."""
        self._fs_between_steps("reshard()")
        for unit in self._fs_own():
            unit.reshard()

    def summon_full_params(self, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                           offload_to_cpu: bool = False, with_grads: bool = False,
                           modifier_rank: int | None = None) -> ContextManager[None]:
        """A context in which the parameters of the units this module reaches (``recurse=False``:
        its own unit's) are plain ``nn.Parameter``s with their full fp32 values in their module
        slots, between steps: FSDP1's ``summon_full_params``, DeepSpeed's ``GatheredParameters``.
        Call it on every rank.

        ``writeback``: on leaving, the full values go back into the shards. Every rank writes its
        own rows, so the ranks must hold the same bits (checked: an edit made on some ranks only
        raises on every rank and writes nothing), or ``modifier_rank=r`` (a rank of the model's
        mesh, the global rank when the mesh spans every process) writes back rank ``r``'s values.
        A copy frozen or unfrozen (``requires_grad_``) is kept too. ``writeback=False``: nothing
        done inside is kept. ``rank0_only``: only rank 0 gets the copies (read-only). ``offload_to_cpu``: the copies live in host memory. ``with_grads``:
        each copy's ``.grad`` is the full gradient (read-only: a change is refused). A forward, a
        backward, an optimizer step, ``model.zero_grad()`` or a state dict inside the context are
        refused [design/notes/summon-full-params.md].

        FSDP1's static call ``FSDP.summon_full_params(module, ...)`` ports as
        ``ShardedModule.summon_full_params(module, ...)``, for the ``ShardedModule`` or a module
        ``auto_wrap_policy`` made a unit.
        """
        from shardwrap import summon

        if not isinstance(self, FullyShardMethods):  # the class's function called on a module (FSDP1's static form)
            bound = self.__dict__.get("summon_full_params") if isinstance(self, nn.Module) else None
            if bound is None:
                raise TypeError(
                    f"summon_full_params: {type(self).__name__} is not a ShardedModule nor a module that "
                    f"auto_wrap_policy made a unit; pass the ShardedModule (every unit), or a unit's module"
                )
            return bound(recurse, writeback, rank0_only, offload_to_cpu, with_grads, modifier_rank)
        return summon.summon_full_params(self._fs_root(), self._fs_reach(recurse) if isinstance(recurse, bool) else [],
                                         recurse, writeback, rank0_only, offload_to_cpu, with_grads, modifier_rank)

    # ---- gradient reduction -----------------------------------------------------------------------

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backwards keep their gradients unsharded on this rank, with no
        communication, until a backward after ``set_requires_gradient_sync(True)`` reduces them
        all (``no_sync()``, held until changed). shardwrap turns this on and off for the whole
        model, whichever module it is called on and whatever ``recurse`` says: a unit left
        syncing under ``fully_shard`` reduces earlier, to the same sum."""
        _check_bool("set_requires_gradient_sync", "requires_gradient_sync", requires_gradient_sync)
        _check_bool("set_requires_gradient_sync", "recurse", recurse)
        root = self._fs_root()
        if root.backward_running:
            raise RuntimeError(
                f"set_requires_gradient_sync on '{self._fs_name()}' during a backward (a hook?): the backward "
                f"decided at its start whether to reduce. Call it before the backward"
            )
        root._sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid sharding under ``fully_shard``: ``False`` keeps reduce-scattering each
        micro-batch but defers the all-reduce over replicas. shardwrap all-reduces at every
        backward that reduces: the same gradients, with more communication. Without replicas it
        has no effect, as in ``fully_shard``."""
        _check_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of a step. shardwrap finishes every backward's
        reductions anyway (gradient accumulation uses ``set_requires_gradient_sync``), so the
        value changes nothing."""
        _check_bool("set_is_last_backward", "is_last_backward", is_last_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's own unit's summed gradient by ``factor`` instead of averaging it
        over the ranks (not recursive, as in ``fully_shard``): ``1.0`` gives the sum, for a loss
        already normalized by the global number of tokens."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor on '{self._fs_name()}': factor must be a finite number > 0, got {factor!r}")
        self._fs_between_steps("set_gradient_divide_factor")
        for unit in self._fs_own():
            unit.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """``fully_shard``'s older name for ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    # ---- when units are freed ---------------------------------------------------------------------

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the units free their gathered parameters after forward (stage 3) or keep them
        for backward (stage 2). Between steps; stage 1 keeps every unit gathered for good."""
        _check_bool("set_reshard_after_forward", "reshard_after_forward", reshard_after_forward)
        self._fs_set_stage("set_reshard_after_forward", recurse, reshard_after_forward=reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether the units free their gathered parameters after backward (stages 2 and 3) or
        keep them (the next forward gathers again only what an optimizer step wrote). Between
        steps; stage 1 keeps every unit gathered for good, and a unit that frees after forward
        must free after backward too (``set_reshard_after_forward(False)`` first)."""
        _check_bool("set_reshard_after_backward", "reshard_after_backward", reshard_after_backward)
        self._fs_set_stage("set_reshard_after_backward", recurse, reshard_after_backward=reshard_after_backward)

    def _fs_set_stage(self, method: str, recurse: bool, **change: bool) -> None:
        units = self._fs_reach(recurse)
        new: list[Stage] = []
        for unit in units:  # every unit checked before any changes
            if all(getattr(unit.stage, k) == v for k, v in change.items()):
                new.append(unit.stage)
                continue
            if unit.stage.keep_unsharded_grad:
                raise ValueError(
                    f"{method}: unit '{unit.name}' is at stage 1, which keeps every unit gathered for good and "
                    f"its gradient unsharded; use stage=2 or 3 for a model whose units are freed"
                )
            try:
                new.append(dataclasses.replace(unit.stage, **change))  # Stage checks the pair
            except ValueError as exc:
                raise ValueError(f"{method}: unit '{unit.name}': {exc}") from None
        if any(s is not u.stage for s, u in zip(new, units)):
            self._fs_between_steps(method)
        for unit, stage in zip(units, new):
            unit.stage = stage

    # ---- prefetching ------------------------------------------------------------------------------

    def set_modules_to_forward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """Once this module's unit is gathered in forward, start the all-gathers of these
        modules' units (instead of the next unit of the last step's order)."""
        self._fs_own()[0].forward_prefetch_units = self._fs_units_of("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """Checked like ``set_modules_to_forward_prefetch``; shardwrap's backward gathers the units
        in the reverse order of the forward, ``max_unsharded - 1`` ahead, which is what such a
        list names in the known uses (the previous blocks), so the list itself is not used."""
        self._fs_units_of("set_modules_to_backward_prefetch", modules)

    def _fs_units_of(self, method: str, modules: Sequence[nn.Module]) -> list[Unit]:
        root = self._fs_root()
        units = []
        for module in modules:
            unit = root.unit_of_module(module)
            if unit is None:
                raise ValueError(
                    f"{method} on '{self._fs_name()}': {type(module).__name__} is not a unit of this model "
                    f"(the modules auto_wrap_policy picked, or the ShardedModule itself); pass those"
                )
            units.append(unit)
        return units


def _no_effect(name: str) -> Any:
    def method(self: FullyShardMethods, *args: Any, **kwargs: Any) -> None:
        """A ``fully_shard`` tuning knob with no counterpart here; the numbers are the same
        without it (design/notes/fully-shard-methods.md)."""

    method.__name__ = method.__qualname__ = name
    return method


def _refused(name: str) -> Any:
    def method(self: FullyShardMethods, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{name} on '{self._fs_name()}': shardwrap runs its own collectives and has no hook to replace "
            f"them; a replaced collective could change the gradients, so it is refused rather than ignored"
        )

    method.__name__ = method.__qualname__ = name
    return method


for _name in _NO_EFFECT:
    setattr(FullyShardMethods, _name, _no_effect(_name))
for _name in _REFUSED:
    setattr(FullyShardMethods, _name, _refused(_name))

METHOD_NAMES = tuple(
    n for n in vars(FullyShardMethods) if not n.startswith("_") and callable(getattr(FullyShardMethods, n))
)


class _UnitModuleMethods(FullyShardMethods):
    """The host for a unit's module (the wrapped model, for the root unit)."""

    def __init__(self, root: ShardedModule, unit: Unit, module: nn.Module) -> None:
        self._root, self._unit, self._module = root, unit, module

    def _fs_root(self) -> ShardedModule:
        return self._root

    def _fs_own(self) -> list[Unit]:
        return [self._unit]

    def _fs_reach(self, recurse: bool) -> list[Unit]:
        if not recurse:
            return [self._unit]
        inside = {id(m) for m in self._module.modules()}
        return [u for u in self._root.units if id(self._root.module_of_unit(u)) in inside]

    def _fs_name(self) -> str:
        return self._unit.name


# What ``install`` sets on a unit's module: the public methods, and the two private ones of
# ``FSDPModule`` that code outside torch's FSDP calls (torchtitan sets ``_set_unshard_async_op``).
_INSTALLED = (*METHOD_NAMES, "_get_fsdp_state", "_set_unshard_async_op")


class _ShardedUnitModule(FSDPModule):
    """The base a unit's module class gains, after its own class in the MRO: the module's own
    methods and ``nn.Module``'s (``_apply``) come first, ``FSDPModule``'s last, and every one of
    those is shadowed by what ``install`` set on the instance."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # ``type(m)(...)`` (``nn.Sequential`` slicing) builds the user's class, as under
        # ``fully_shard``: a new module is not a unit. No arguments: ``copy``/``pickle`` making
        # an empty object to fill, so no ``__init__``.
        orig = cls.__mro__[1]
        made = object.__new__(orig) if orig.__new__ is object.__new__ else orig.__new__(orig, *args, **kwargs)
        if args or kwargs:
            made.__init__(*args, **kwargs)
        return made


_UNIT_CLASSES: dict[type, type] = {}


def torchs_forward_method(value: Any) -> bool:
    """Whether ``value`` is what torch's ``register_fsdp_forward_method(module, name)`` sets on
    the module: its ``wrapped_method`` bound to it, which reads ``fully_shard``'s state at each call."""
    code = getattr(getattr(value, "__func__", None), "__code__", None)
    return code is not None and code.co_name == "wrapped_method" and "distributed/fsdp/" in code.co_filename.replace("\\", "/")


def _unit_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with ``FSDPModule`` added as its last base, made once per class and named like
    it (code that reads ``type(m).__name__``, as Hugging Face's does, sees the user's name)."""
    if issubclass(cls, FSDPModule):
        return cls
    made = _UNIT_CLASSES.get(cls)
    if made is None:
        try:
            def __setattr__(self: nn.Module, name: str, value: Any) -> None:
                # torch's register_fsdp_forward_method(unit_module, name): shardwrap's registration
                host = getattr(self.__dict__.get("set_gradient_divide_factor"), "__self__", None)
                if isinstance(host, _UnitModuleMethods) and torchs_forward_method(value):
                    host._fs_root().register_forward_method(name, module=self)
                    return
                cls.__setattr__(self, name, value)  # the class's own, as before the swap

            made = type(cls.__name__, (cls, _ShardedUnitModule), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                "__setattr__": __setattr__,
            })
        except TypeError as exc:  # a metaclass or __init_subclass__ that refuses: the class stays
            warnings.warn(
                f"ShardedModule: cannot add FSDPModule to {cls.__qualname__} ({exc}); its modules keep fully_shard's "
                f"methods but isinstance(m, FSDPModule) is False for them: find them with "
                f"hasattr(m, 'set_gradient_divide_factor')",
                stacklevel=4,
            )
            made = cls
        _UNIT_CLASSES[cls] = made
    return made


def install(root: ShardedModule, unit: Unit, module: nn.Module) -> None:
    """Give ``module`` (a unit's; the wrapped model for the root unit) the methods, as instance attributes, except
    names it already has (its own ``reshard``, say, stays its own), and make it an instance of
    ``FSDPModule``."""
    host = _UnitModuleMethods(root, unit, module)
    for name in _INSTALLED:
        if not hasattr(module, name):
            module.__dict__[name] = getattr(host, name)
    module.__class__ = _unit_class(type(module))
