"""``ShardedModule``: the wrapper. It plans the units and coordinates the root's part of a step.

Reading order: ``__init__`` plans the units (pure, may raise), then builds one ``Unit`` per
unit (``unit.py``), whose hooks run each unit's life. The root coordinates what belongs to the
whole model: the first pre-forward of a step, the start and the end of backward (the queued
``_finish_backward``), the reduce-scatters' completion, ``no_sync`` and the public API.
See design/architecture.md for the whole data path.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NoReturn, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Shard
from torch.nn.modules.module import _IncompatibleKeys, register_module_module_registration_hook, register_module_parameter_registration_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from shardwrap import agreement, collectives, local_step
from shardwrap import summon as _summon
from shardwrap import offload as offload_module
from shardwrap import state_dict as _sd
from shardwrap.flat_param import FlatLayout, TensorParallel
from shardwrap.fully_shard_api import METHOD_NAMES as FULLY_SHARD_METHOD_NAMES
from shardwrap.fully_shard_api import FSDPModule, FullyShardMethods, install as install_fully_shard_methods
from shardwrap.fully_shard_api import torchs_forward_method as _torchs_forward_method
from shardwrap.mixed_precision import MixedPrecision
from shardwrap.offload import DISK_STORES, Offload, OffloadStore, StateOnDisk, UnitPager, check_disk, disk_bytes
from shardwrap.schedule import CollectiveSchedule
from shardwrap.spare import Spares
from shardwrap.stage import Stage
from shardwrap.unit import DataState, GradState, Slot, TrainingState, Unit, grad_data_replaced, local_of, outside_checkpoint_modes, outside_compile
from shardwrap.wrap import PolicyLike, as_policy, has_forward

# Every module that belongs to a wrapped tree, to refuse wrapping twice.
_MANAGED_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
# Every module inside a wrapped model -> its ShardedModule (weakly): torch's global registration
# hooks (_note_registration) look a module up here when something registers a parameter or a
# submodule on it after wrapping.
_MODULE_ROOTS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[ShardedModule]]" = weakref.WeakKeyDictionary()
# Every parameter some ShardedModule took (the original and its sharded DTensor) -> its name there
_TAKEN_PARAMS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
# Parameters that wrapping replaced, mapped to their name, to catch stale optimizers.
_RETIRED_PARAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_SHARDED_PARAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # every sharded parameter a ShardedModule made -> its unit (weakly)
_optimizer_hook_installed = False

# Where a peer's backward gathers a unit this rank's does not (stage 3, after forwards under no_grad)
RECOMPUTED_ON_SOME_RANKS = (
    "A rank whose backward all-gathers a unit its peers' backwards do not is recomputing it under a "
    "reentrant activation checkpoint (torch.utils.checkpoint with use_reentrant=True, Hugging Face's "
    "default gradient checkpointing) because only its loss reached that unit's output. At stage 3 every "
    "rank would have to recompute it: pass use_reentrant=False (gradient_checkpointing_kwargs="
    "{'use_reentrant': False}), or use stage 1 or 2, where such a unit trains as it would in one process."
)

# The dispatch modes a disk-offload step runs under (UnitPager, and StateOnDisk for a step creating state), innermost last.
_STATE_MODES: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[TorchDispatchMode]]" = weakref.WeakKeyDictionary()


# ---- planning (pure: reads the module tree, changes nothing) ----------------------------------


@dataclass
class _UnitPlan:
    module: nn.Module
    name: str  # qualified name of the unit's module, "" for the root
    parent: "_UnitPlan | None"
    depth: int
    params: list[nn.Parameter] = field(default_factory=list)
    fqns: list[str] = field(default_factory=list)
    slots: list[list[Slot]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"'{self.name or '<root>'}' ({type(self.module).__name__})"


def _lowest_common_ancestor(units: list[_UnitPlan]) -> _UnitPlan:
    def chain(u: _UnitPlan | None) -> list[_UnitPlan]:
        out = []
        while u is not None:
            out.append(u)
            u = u.parent
        return out[::-1]

    chains = [chain(u) for u in units]
    lca = chains[0][0]
    for level in zip(*chains):
        if all(u is level[0] for u in level):
            lca = level[0]
        else:
            break
    return lca


def _refuse_sparse_gradients(root: nn.Module) -> None:
    """An embedding built with ``sparse=True`` makes sparse gradients, which no reduce-scatter
    into a flat shard takes (torch failed deep inside backward, "reshape is not implemented for
    sparse tensors"; ``fully_shard`` fails there too)."""
    for name, sub in root.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            raise ValueError(
                f"ShardedModule: submodule '{name}' ({type(sub).__name__}) was built with sparse=True, so its "
                f"gradient is a sparse tensor, which cannot be reduce-scattered into the shards. Build it with "
                f"sparse=False (and a dense optimizer such as Adam in place of SparseAdam)"
            )


def _refuse_uncalled_units(root: nn.Module, unit_modules: list[nn.Module]) -> None:
    """A unit's hooks run around its ``forward``: a container without one (``nn.ModuleList``,
    ``nn.ModuleDict``) is never called, so its parameters would never be gathered, and the first
    forward would fail far from the cause. Refused here, as ``fully_shard`` refuses it."""
    names = {id(m): n for n, m in root.named_modules()}
    uncalled = [m for m in unit_modules if not has_forward(m)]
    if uncalled:
        listed = ", ".join(f"'{names.get(id(m), '?')}' ({type(m).__name__})" for m in uncalled)
        raise ValueError(
            f"ShardedModule: auto_wrap_policy selected {listed}, which has no forward of its own: its "
            f"parameters are used by its parent's forward, outside any call of the container, so no "
            f"unit hook could gather them. Select the modules inside it (for a list of blocks, the "
            f"block class: auto_wrap_policy={{Block}})"
        )


def _plan_units(root: nn.Module, unit_modules: list[nn.Module]) -> list[_UnitPlan]:
    """Assign every parameter to exactly one unit: the lowest unit that encloses all its uses."""
    starts = {id(m) for m in unit_modules}
    units: list[_UnitPlan] = []
    uses: dict[int, tuple[nn.Parameter, str, list[tuple[_UnitPlan, Slot]]]] = {}
    visited: set[tuple[int, int]] = set()

    by_module: dict[int, _UnitPlan] = {}

    def visit(module: nn.Module, prefix: str, unit: _UnitPlan | None) -> None:
        if unit is None or (id(module) in starts and module is not unit.module):
            if id(module) in by_module:  # a unit module registered at two places in the tree
                unit = by_module[id(module)]
            else:
                unit = _UnitPlan(module, prefix, unit, 0 if unit is None else unit.depth + 1)
                by_module[id(module)] = unit
                units.append(unit)
        key = (id(module), id(unit))
        if key in visited:  # the same module reached twice through one unit
            return
        visited.add(key)
        for attr, param in module._parameters.items():
            if param is None:
                continue
            fqn = f"{prefix}.{attr}" if prefix else attr
            entry = uses.setdefault(id(param), (param, fqn, []))
            entry[2].append((unit, (module, attr)))
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}.{child_name}" if prefix else child_name, unit)

    visit(root, "", None)
    for param, fqn, param_uses in uses.values():
        owner = _lowest_common_ancestor([u for u, _ in param_uses])
        slots: list[Slot] = []
        for _, slot in param_uses:
            if not any(slot[0] is m and slot[1] == a for m, a in slots):
                slots.append(slot)
        owner.params.append(param)
        owner.fqns.append(fqn)
        owner.slots.append(slots)
    for unit in units:  # trainable first: the gradient layout is a prefix (flat_param.py)
        order = sorted(range(len(unit.params)), key=lambda i: not unit.params[i].requires_grad)
        unit.params = [unit.params[i] for i in order]
        unit.fqns = [unit.fqns[i] for i in order]
        unit.slots = [unit.slots[i] for i in order]
    return [u for u in units if u.params or u.parent is None]


def _checkpoint_wrappers(root: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> the activation-checkpointing wrapper (torch's ``checkpoint_wrapper``) around it.

    A unit whose module sits in such a wrapper gets its hooks on the wrapper: the unit's forward
    then encloses the checkpointed call instead of running inside it, so ``torch.compile`` of the
    wrapper (torchtitan's AC + compile) sees no hook inside the checkpoint region, where it could
    not leave the graph (design/notes/torch-compile.md)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    return {
        id(m._checkpoint_wrapped_module): m for m in root.modules()
        if isinstance(m, ActivationWrapper) and isinstance(m._checkpoint_wrapped_module, nn.Module)
    }


_NOT_COPYABLE = (
    "ShardedModule: {what} is not supported: every rank holds only its shards, tied to process groups "
    "and hooks. To save the model use model.full_state_dict() (full tensors, loads into the unwrapped "
    "model) or shardwrap's save_checkpoint; to get a second copy, build the unwrapped model again and "
    "load full_state_dict() into it"
)


class _InnerApply:
    """A wrapped module's ``_apply`` (``.to()``, ``.double()``, ``.half()``... called on
    ``model.module`` or any module inside it): the same probe as ``ShardedModule._apply``, over
    that module's own parameters and buffers, so a conversion is refused before anything changes
    (torch's ``_apply`` converted the buffers of the modules it reached first and then failed on
    a DTensor parameter). Weak references: the module holds this object."""

    def __init__(self, root: "ShardedModule", module: nn.Module, name: str) -> None:
        self._root, self._module, self._name = weakref.ref(root), weakref.ref(module), name

    def __call__(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module | None:
        root, module = self._root(), self._module()
        if module is None:
            return None
        if root is None:  # the wrapper is gone: torch's own conversion
            return type(module)._apply(module, fn, recurse)
        root.refuse_conversion(fn, module, self._name)
        return module


class _InnerDeepcopy:
    """``copy.deepcopy`` of a module inside a ShardedModule (``AveragedModel(model.module)``):
    refused, as for the wrapper. The copy would hold this rank's shards and the wrapper's hooks,
    could not run, and running it disturbed the wrapper's state."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(
            _NOT_COPYABLE.format(what=f"copy.deepcopy of its module {self._name or '(model.module)'!r}")
            + ". For an EMA, average full tensors (a copy of the unwrapped model loaded from "
            "full_state_dict()) or keep the average as local tensors: torch._foreach_lerp_ over "
            "model.parameters() works on the shards"
        )


def _warn_hooks_left_behind(plans: Sequence[Any]) -> None:
    """Warn about gradient hooks on the original parameters: wrapping replaces each parameter with
    a sharded one, so ``p.register_hook`` and ``p.register_post_accumulate_grad_hook`` made before
    wrapping would never run, silently (the same under ``fully_shard``)."""
    hooked = [
        fqn for plan in plans for p, fqn in zip(plan.params, plan.fqns)
        if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)
    ]
    if hooked:
        shown = ", ".join(f"'{n}'" for n in hooked[:5]) + (f" and {len(hooked) - 5} more" if len(hooked) > 5 else "")
        warnings.warn(
            f"ShardedModule: parameter(s) {shown} carry gradient hooks registered before wrapping "
            f"(p.register_hook or p.register_post_accumulate_grad_hook). Wrapping replaces each parameter "
            f"with a sharded one, so these hooks will never run. Register post-accumulate-grad hooks on "
            f"model.parameters() after wrapping (they run once p.grad is delivered); p.register_hook does "
            f"not run on wrapped parameters (the gradient reaches the unit's flat buffer), as under fully_shard",
            stacklevel=3,
        )


def _warn_shadowed_names(wrapper: nn.Module, inner: nn.Module) -> None:
    """Warn when the wrapped model has an attribute under a name the wrapper holds itself (its
    settings: ``stage``, ``mesh``, ``schedule``, ``offload``, ...): ``model.<name>`` reads and
    writes the wrapper's, where under ``fully_shard`` it would be the model's. Its mutable state is
    private, so only these can clash."""
    def held_by_inner(name: str) -> bool:
        registries = (inner.__dict__, inner._parameters, inner._buffers, inner._modules)
        return any(name in r for r in registries) or (hasattr(type(inner), name) and not hasattr(nn.Module, name))

    own = [*wrapper.__dict__, *FULLY_SHARD_METHOD_NAMES]  # settings, and fully_shard's methods
    clash = sorted({n for n in own if not n.startswith("_") and n not in ("training", "forward") and held_by_inner(n)})
    if clash:
        names = ", ".join(f"'{n}'" for n in clash)
        warnings.warn(
            f"ShardedModule: the wrapped {type(inner).__name__} has attribute(s) {names}, which the wrapper holds "
            f"too (its own settings, or fully_shard's methods): model.<name> reaches the wrapper's. Use model.module.<name> "
            f"for the model's own",
            stacklevel=3,
        )


def _show_inner_signature(wrapper: nn.Module, inner: nn.Module) -> None:
    """Give ``wrapper.forward`` the wrapped module's signature, so ``inspect.signature(model.forward)``
    (how HF Trainer and Lightning choose the dataset columns to keep) sees the model's arguments.

    The instance's ``forward`` becomes ``functools.partial(ShardedModule.forward, wrapper)`` with
    that signature: Dynamo traces a partial as it traces a bound method (no extra graph break), and
    the reference cycle it makes goes through the instance's ``__dict__``, where the garbage
    collector sees it."""
    try:
        signature = inspect.signature(inner.forward)
    except (TypeError, ValueError):  # a forward inspect cannot read: keep (*args, **kwargs)
        return
    forward = functools.partial(type(wrapper).forward, wrapper)  # a subclass's forward, if it has one
    setattr(forward, "__signature__", signature)
    wrapper.__dict__["forward"] = forward


# One class per (wrapper class, wrapped model class): see _class_showing_signature
_SIGNATURE_CLASSES: dict[tuple[type[nn.Module], type[nn.Module]], type[nn.Module]] = {}


def _class_showing_signature(wrapper: type[nn.Module], inner: type[nn.Module]) -> type[nn.Module]:
    """A subclass of ``wrapper`` whose ``forward`` has ``inner.forward``'s signature, named
    ``wrapper[inner]``. Hugging Face reads the model's *class*: ``Trainer`` takes its
    ``label_names`` from ``find_labels(type(model))`` and decides whether ``forward`` can return
    the loss with ``can_return_loss(type(model))``, both from ``inspect.signature(cls.forward)``
    (and a question-answering model's labels from the class name). With ``(*args, **kwargs)``
    there, ``evaluate()`` returned no loss and ``predict()`` no labels, silently; ``fully_shard``
    gets this right by swapping in a subclass of the model's class. The class's ``forward`` is a
    copy of ``wrapper.forward`` (the same code object, so no extra frame for Dynamo to trace)."""
    key = (wrapper, inner)
    made = _SIGNATURE_CLASSES.get(key)
    if made is not None:
        return made
    base = wrapper.forward
    try:
        signature = inspect.signature(inner.forward)
    except (TypeError, ValueError):  # a forward inspect cannot read: keep (*args, **kwargs)
        return wrapper
    if not isinstance(base, types.FunctionType):  # a subclass's forward that is not a plain function
        return wrapper
    forward = types.FunctionType(base.__code__, base.__globals__, base.__name__, base.__defaults__, base.__closure__)
    forward.__kwdefaults__, forward.__qualname__, forward.__doc__ = base.__kwdefaults__, base.__qualname__, base.__doc__
    forward.__module__ = base.__module__
    setattr(forward, "__signature__", signature)
    name = f"{wrapper.__name__}[{inner.__name__}]"
    made = _SIGNATURE_CLASSES[key] = type(name, (wrapper,), {"forward": forward, "__module__": wrapper.__module__, "__qualname__": name})
    return made


def _check_unit_tensors(units: list[_UnitPlan], *, meta_ok: bool = False) -> torch.device:
    """Every unit's parameters share one device and dtype; all units share one device."""
    device: torch.device | None = None
    first = ""
    for unit in units:
        for fqn, p in zip(unit.fqns, unit.params):
            if device is None:
                device, first = p.device, fqn
            elif p.device != device:
                raise ValueError(
                    f"ShardedModule: parameter '{fqn}' of unit {unit.label} is on {p.device} but "
                    f"'{first}' is on {device}; move the whole model to one device (this rank's "
                    f"cpu or cuda:LOCAL_RANK) before wrapping"
                )
            if p.device.type == "meta" and not meta_ok:
                raise ValueError(
                    f"ShardedModule: parameter '{fqn}' of unit {unit.label} is on the meta device but "
                    f"other tensors of the model are not; build the whole model on meta (ShardedModule "
                    f"then materializes each unit), or none of it"
                )
            if not p.is_floating_point():
                raise TypeError(
                    f"ShardedModule: parameter '{fqn}' of unit {unit.label} has dtype {p.dtype}; "
                    f"only floating-point parameters can be sharded: register it as a buffer instead"
                )
            if p.dtype != unit.params[0].dtype:
                raise TypeError(
                    f"ShardedModule: unit {unit.label} mixes dtypes: '{unit.fqns[0]}' is "
                    f"{unit.params[0].dtype} but '{fqn}' is {p.dtype}. Cast the module to one dtype "
                    f"(use MixedPrecision for low-precision compute), or put '{fqn}' in its own unit"
                )
    return device or torch.device("cpu")


def _meta_init_check(root: nn.Module, param_init_fn: Callable[[nn.Module], None] | None) -> bool:
    """Whether ``root`` is built on the meta device; if so, whether every module holding meta
    tensors can be initialized. Mixed meta and real tensors are refused later as mixed devices."""
    tensors = list(root.parameters()) + list(root.buffers())
    if not tensors or not all(t.is_meta for t in tensors):
        return False
    if param_init_fn is not None:
        return True
    for name, module in root.named_modules():
        holds = any(t is not None for t in list(module._parameters.values()) + list(module._buffers.values()))
        if holds and not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(
                f"ShardedModule: module '{name}' ({type(module).__name__}) is on the meta device and has no "
                f"reset_parameters(); pass param_init_fn=fn, where fn(module) fills the module's own "
                f"parameters and recomputes its buffers (rotary tables, causal masks) after materialization"
            )
    return True


def _init_device() -> torch.device:
    if torch.cuda.is_available() and collectives.backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _materialize(
    root: nn.Module, plans: list[_UnitPlan], device: torch.device, init_fn: Callable[[nn.Module], None] | None
) -> Iterator[int]:
    """Materialize and initialize modules in pre-order (the order their constructors ran), and
    yield each unit's index as soon as every module holding its parameters is done, so the unit
    can be sharded and its full tensors freed before the next one is built
    (design/notes/meta-init.md)."""
    where: dict[int, tuple[int, int]] = {id(p): (u, j) for u, plan in enumerate(plans) for j, p in enumerate(plan.params)}
    waiting = [{id(m) for slots in plan.slots for m, _ in slots} for plan in plans]
    for module in root.modules():
        for attr, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                u, j = where[id(param)]
                real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                for m, a in plans[u].slots[j]:  # every place that shares it (tied weights)
                    m._parameters[a] = real
                plans[u].params[j] = real
        for attr, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[attr] = torch.empty_like(buf, device=device)
        if any(t is not None for t in list(module._parameters.values()) + list(module._buffers.values())):
            with torch.no_grad():
                if init_fn is not None:
                    init_fn(module)
                else:
                    module.reset_parameters()  # type: ignore[operator]
        for u, remaining in enumerate(waiting):
            if id(module) in remaining:
                remaining.discard(id(module))
                if not remaining:
                    yield u
    for u, remaining in enumerate(waiting):
        if remaining:  # a unit whose modules are not in root.modules() (cannot happen) or empty
            yield u


def _share_rng_state(group: collectives.Group, device: torch.device) -> None:
    """Give every rank the first rank's random generator state, so that initializing the same
    modules in the same order draws the same numbers everywhere: no parameter needs a broadcast."""
    mine: list[Any] = [torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None]
    states = collectives.broadcast_object(mine, group)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


_HYBRID_AXES = (("replicate", "dp_replicate"), ("shard", "dp_shard"))  # the names a 2-D mesh's axes may have


def _check_mesh(mesh: DeviceMesh, device: torch.device, tp_size: int = 1) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"ShardedModule: mesh={mesh!r} is not a torch.distributed DeviceMesh")
    if mesh.ndim > 2:
        raise ValueError(
            f"ShardedModule: mesh has {mesh.ndim} axes {mesh.mesh_dim_names}; shardwrap shards over "
            f"a 1-D mesh, or a 2-D (replicate, shard) mesh for hybrid sharding: pass those axes of it, "
            f"such as mesh['replicate', 'shard']"
        )
    if mesh.ndim == 2 and not mesh.mesh_dim_names:
        raise ValueError(
            "ShardedModule: a 2-D mesh for hybrid sharding needs axis names: build it with "
            "init_device_mesh(device, (replicas, shards), mesh_dim_names=('replicate', 'shard'))"
        )
    if mesh.ndim == 2:
        names = tuple(mesh.mesh_dim_names or ())
        wrong = [(i, n, want) for i, (n, want) in enumerate(zip(names, _HYBRID_AXES)) if n not in want]
        if wrong:
            i, name, want = wrong[0]
            raise ValueError(
                f"ShardedModule: axis {i} of the 2-D mesh is named '{name}', but shardwrap reads a 2-D mesh as "
                f"(replicate, shard) and axis {i} must be one of {list(want)}. For hybrid sharding build "
                f"init_device_mesh(device, (replicas, shards), mesh_dim_names=('replicate', 'shard')); for "
                f"tensor parallelism parallelize the model on mesh['tp'] and pass mesh=mesh['dp']"
            )
    if mesh.device_type != device.type:
        raise ValueError(
            f"ShardedModule: mesh is on device type '{mesh.device_type}' but the model's parameters "
            f"are on {device}; build the mesh with init_device_mesh('{device.type}', ...)"
        )
    if mesh.size() * tp_size != collectives.world_size():  # tp_size > 1 was checked in _tensor_parallel_meshes
        raise ValueError(
            f"ShardedModule: mesh has {mesh.size()} ranks but the default process group has "
            f"{collectives.world_size()}; pass a mesh over every rank, or leave mesh=None"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"ShardedModule: rank {collectives.rank()} is not part of the given mesh {mesh}; pass a mesh over every rank")


def _tensor_parallel_meshes(plans: list[_UnitPlan], mesh: DeviceMesh | None, offload: Offload | None) -> tuple[DeviceMesh, DeviceMesh] | None:
    """Parameters that are already DTensors come from tensor parallelism (``parallelize_module``
    on a TP mesh): check they compose with sharding over ``mesh`` and return ``(tp_mesh, the 2-D
    (dp, tp) mesh)``, or None without any (design/notes/tensor-parallel.md). Pure; may raise."""
    found = [(fqn, p) for plan in plans for fqn, p in zip(plan.fqns, plan.params) if isinstance(p, DTensor)]
    if not found:
        return None
    fqn, first = found[0]
    tp_mesh = first.device_mesh
    for other_fqn, p in found:
        if p.device_mesh != tp_mesh:
            raise ValueError(
                f"ShardedModule: parameters '{fqn}' and '{other_fqn}' are DTensors on different meshes "
                f"({tp_mesh} and {p.device_mesh}); parallelize the model on one tensor-parallel mesh"
            )
        if any(not (pl.is_replicate() or type(pl) is Shard) for pl in p.placements):
            raise ValueError(
                f"ShardedModule: parameter '{other_fqn}' is a DTensor placed {p.placements}; shardwrap "
                f"shards tensor-parallel parameters placed Shard(dim) or Replicate() (what "
                f"ColwiseParallel, RowwiseParallel and SequenceParallel make)"
            )
    name = (tp_mesh.mesh_dim_names or ("tp",))[0]
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"ShardedModule: parameter '{fqn}' is a DTensor on a {tp_mesh.ndim}-D mesh; shardwrap composes with "
            f"tensor parallelism on one axis: parallelize the model on mesh['{name}']"
        )
    hint = (
        f"build mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), parallelize the "
        f"model on mesh['tp'] and pass ShardedModule(..., mesh=mesh['dp'])"
    )
    if mesh is None or mesh.ndim != 1:
        what = "no mesh" if mesh is None else f"a {mesh.ndim}-D mesh {mesh.mesh_dim_names}"
        raise ValueError(
            f"ShardedModule: parameter '{fqn}' is a DTensor on the tensor-parallel mesh '{name}' but "
            f"ShardedModule got {what}; with tensor parallelism pass the data-parallel axis of the same "
            f"2-D mesh (hybrid sharding does not compose with it): {hint}"
        )
    try:
        spmd = DeviceMesh._concatenate([mesh, tp_mesh])  # torch's fully_shard builds its 2-D mesh alike
    except (RuntimeError, AttributeError, TypeError, ValueError) as exc:
        raise ValueError(
            f"ShardedModule: the data-parallel mesh {mesh.mesh_dim_names} and the tensor-parallel mesh of "
            f"parameter '{fqn}' are not two axes of one mesh ({exc}); {hint}"
        ) from None
    if spmd.size() != collectives.world_size():
        raise ValueError(
            f"ShardedModule: data-parallel mesh ({mesh.size()} ranks) times tensor-parallel mesh "
            f"({tp_mesh.size()} ranks) is {spmd.size()} ranks, but the default process group has "
            f"{collectives.world_size()}; {hint}"
        )
    if offload is not None and offload.enabled:
        raise ValueError(
            f"ShardedModule: offload with tensor-parallel parameters (such as '{fqn}') is not supported; "
            f"drop offload= or the tensor parallelism"
        )
    if any(p.is_meta for _, p in found):
        raise ValueError(
            f"ShardedModule: tensor-parallel parameter '{fqn}' is on the meta device; materialize the "
            f"model (and parallelize it) before wrapping"
        )
    return tp_mesh, spmd


def _tp_of(p: torch.Tensor) -> TensorParallel | None:
    if not isinstance(p, DTensor):
        return None
    return TensorParallel(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride()))


def _local_of_tp(p: torch.Tensor) -> torch.Tensor:
    """A TP parameter's local shard as a plain tensor that keeps ``requires_grad`` (what the flat
    layout reads); any other parameter as it is."""
    if not isinstance(p, DTensor):
        return p
    return p._local_tensor.detach().requires_grad_(p.requires_grad)


_DDP_CONSTRUCTOR = DistributedDataParallel.__init__.__code__


def _inside_ddp_constructor(depth: int = 12) -> bool:
    """Whether DistributedDataParallel's constructor is among the nearest callers."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is _DDP_CONSTRUCTOR:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _check_optimizer_params(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook (global): refuse to step parameters that wrapping replaced; disk
    offload's state placement (``_offload_pre_step``); then an elementwise optimizer steps the
    local tensors (``local_step``; not with disk offload, whose state placement keys on the
    DTensors), swapped in by a hook of the optimizer's own that runs after its other pre-hooks and
    out by one that runs before its other post-hooks: a user's step hook sees the DTensors
    (design/notes/dtensor-parameters.md, "The step on local tensors")."""
    _exit_step_modes(optimizer)  # the last step raised before its post-hook
    ours = False
    roots: dict[int, ShardedModule] = {}  # offloaded models whose shards this step rewrites on the host
    owed: dict[int, ShardedModule | None] = {}  # models owed a backward: None once one of their parameters has a gradient
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _summon.COPIES.get(p)
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds the full copy of parameter '{name}' that "
                    f"summon_full_params() showed; the context has ended and that copy receives no gradient. "
                    f"Build the optimizer outside the context, from model.parameters()"
                )
            name = _RETIRED_PARAMS.get(p)
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameter '{name}' from before ShardedModule "
                    f"wrapped the model; it never receives a gradient. Build the optimizer after "
                    f"wrapping, from model.parameters()"
                )
            unit = _unit_of_param(p)
            if unit is None:
                continue
            if unit._root._summoned is not None:
                raise _summon.refusal(f"{type(optimizer).__name__}.step()")
            if p.grad is not None:
                _check_grad(optimizer, unit, p)
            ours = True
            if unit.store is not None:
                roots.setdefault(id(unit._root), unit._root)
            if unit._root._expect_backward:
                if p.grad is not None:
                    owed[id(unit._root)] = None
                else:
                    owed.setdefault(id(unit._root), unit._root)
    # (a step with a closure runs its own forward and backward; one where any parameter has a gradient
    # is not a no-op: a model of several whose output was detached is someone's linear probe)
    if not _step_closure(args, kwargs) and all(p.grad is None for g in optimizer.param_groups for p in g["params"]):
        for root in owed.values():
            if root is not None:
                _warn_no_gradient(optimizer, root)
    # Every optimizer, before anything steps: state that torch's load_state_dict took from another
    # rank's file (design/notes/state-dicts.md, "Another rank's shards")
    local_step.refuse_another_ranks_state(optimizer, _unit_of_param)
    for root in roots.values():
        root.finish_host_copies()
    if _offload_pre_step(optimizer) or not ours:
        return
    # The optimizer's own hooks run after the global pre-hooks and before the global post-hooks:
    # the swap goes last among its pre-hooks and its end first among its post-hooks, where a hook
    # registered since would otherwise run inside it
    hooks = _SWAP_HOOKS.get(optimizer)
    if hooks is None:
        hooks = _SWAP_HOOKS[optimizer] = (optimizer.register_step_pre_hook(_swap_in), optimizer.register_step_post_hook(_swap_out))
    pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    pre[hooks[0].id] = pre.pop(hooks[0].id)  # last
    if next(iter(post)) != hooks[1].id:  # first
        rest = [(k, v) for k, v in post.items() if k != hooks[1].id]
        first = post[hooks[1].id]
        post.clear()
        post.update([(hooks[1].id, first), *rest])


def _check_grad(optimizer: torch.optim.Optimizer, unit: Unit, p: torch.Tensor) -> None:
    """Before a step: refuse a gradient the step could not use as the user meant it. A plain
    tensor where the DTensor shard's gradient belongs (``p.grad = full_grad``) fails deep in the
    step with the shard's sizes; a gradient whose ``.data`` was replaced (``p.grad.data = t``,
    ``vector_to_parameters(vec, grads)``) would step the old values, silently (as under
    ``fully_shard``): its local tensor never changed."""
    grad = p.grad
    assert grad is not None
    replaced = isinstance(grad, DTensor) and grad_data_replaced(grad)
    if isinstance(grad, DTensor) and not replaced:
        return
    name = next(s.fqn for q, s in zip(unit.sharded_params, unit.layout.slots) if q is p)
    what = (
        "had its .data replaced (p.grad.data = t; torch.nn.utils.vector_to_parameters(vec, grads) does it), "
        "which leaves the gradient's shard as it was: the step would use the old values"
        if replaced else f"is a plain {type(grad).__name__} of shape {list(grad.shape)} where the DTensor shard's gradient belongs"
    )
    raise RuntimeError(
        f"rank {collectives.rank()}: shardwrap: {type(optimizer).__name__}.step(): the gradient of parameter "
        f"'{name}' (unit '{unit.name}') {what}. Nothing was stepped. Change gradients in place (p.grad.mul_(s), "
        f"p.grad.copy_(d) with d a DTensor placed like p.grad, under torch.no_grad()) or give a new DTensor "
        f"(p.grad = p.grad * s; a full gradient: distribute_tensor(full_grad, p.device_mesh, p.placements))"
    )


# Each optimizer's own pair of step hooks that swap the local tensors in and out (weakly keyed: the
# handles hold the optimizer's hook dicts weakly, so nothing here keeps an optimizer alive).
_SWAP_HOOKS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Any, Any]]" = weakref.WeakKeyDictionary()


def _swap_in(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    """The optimizer's last step pre-hook: an elementwise optimizer steps the local tensors."""
    return local_step.enter(optimizer, _unit_of_param, kwargs, args)


def _swap_out(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The optimizer's first step post-hook: the DTensors back, before the user's post-hooks."""
    if local_step.leave(optimizer):
        _LEFT.add(optimizer)  # the units are marked written: _mark_stepped_units has nothing left to do


_LEFT: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _step_closure(args: Any, kwargs: Any) -> Any:
    """The closure an ``optimizer.step`` call was given, or None (the hooks see ``(self, ...)``)."""
    return kwargs.get("closure", args[1] if len(args) > 1 else None)


def _warn_no_gradient(optimizer: torch.optim.Optimizer, root: ShardedModule) -> None:
    """A step over a model whose last forward (in grad mode) got no backward, and none of whose
    parameters has a gradient. ``loss.backward(inputs=list(model.parameters()))`` ends so: the
    sharded parameters are not leaves of the forward's graph (the units compute with views of the
    gathered buffer), so that backward reaches none of them and runs none of the model's hooks, and
    the step changes nothing, silently (``fully_shard`` alike). A warning, not an error: a loop that
    skips the backward of a non-finite loss and steps anyway does the same on purpose."""
    warnings.warn(
        f"rank {collectives.rank()}: {type(optimizer).__name__}.step(): no parameter of this ShardedModule "
        f"has a gradient, and its last forward got no backward. If the backward was "
        f"loss.backward(inputs=...) with the model's parameters, it reached none of them: shardwrap's "
        f"parameters are not leaves of the forward's graph (as under fully_shard), so that backward computes "
        f"nothing for them. Call loss.backward() without inputs (set requires_grad_(False), or zero the "
        f"gradients you do not want, to keep other parameters out). If the backward was skipped on purpose, "
        f"this step changes nothing, as in plain PyTorch.",
        RuntimeWarning,
        stacklevel=3,
    )


def _note_registration(module: nn.Module, name: str, value: Any) -> None:
    """torch's global parameter and submodule registration hook: a parameter, or a module holding
    parameters, that joins a wrapped model after wrapping (PEFT's adapters injected into the wrapped
    model, ``remove_parametrizations``) is no unit's, so each rank would train its own copy of it
    and never average it, silently (as under ``fully_shard``). Marks the model; its next forward
    looks for such parameters and refuses them (``ShardedModule._refuse_added_parameters``). A
    module registered with none of them (torch's ``CheckpointWrapper`` around a block) joins the
    model's modules, so what is added inside it later is seen too."""
    ref = _MODULE_ROOTS.get(module)
    root = ref() if ref is not None else None
    if root is None or value is None:
        return
    root._registered_after_wrapping = True
    if isinstance(value, nn.Module):
        for sub in value.modules():
            _MODULE_ROOTS.setdefault(sub, ref)  # type: ignore[arg-type]


def _unit_of_param(p: torch.Tensor) -> Unit | None:
    ref = _SHARDED_PARAMS.get(p)
    return ref() if ref is not None else None


def _disk_params(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, Unit, int]]:
    """The optimizer's parameters whose unit keeps its state on disk, with unit and slot index."""
    if not DISK_STORES:
        return []
    found = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _SHARDED_PARAMS.get(p)
            unit = ref() if ref is not None else None
            if unit is not None and unit.store is not None and unit.store.kind == "disk":
                where = unit._root.unit_of(p)
                assert where is not None
                found.append((p, unit, where[1]))
    return found


def _offload_pre_step(optimizer: torch.optim.Optimizer) -> bool:
    """Disk offload, before a step: state loaded or made since the last step goes to the files;
    if some parameter has no state yet, the step creates it in the files (``StateOnDisk``).
    Whether the optimizer holds disk-offloaded parameters."""
    disk = _disk_params(optimizer)
    if not disk:
        return False
    _settle_state(optimizer, disk)
    modes: list[TorchDispatchMode] = [UnitPager()] if offload_module.PAGE_BY_UNIT else []  # pages of each unit done with go back
    fresh = {id(p): (unit, i) for p, unit, i in disk if not optimizer.state.get(p)}
    if fresh:
        counts: dict[int, int] = {}

        def place(p: torch.Tensor, zeros: bool) -> torch.Tensor | None:
            where = fresh.get(id(p))
            if where is None:
                return None
            unit, i = where
            number = counts.get(id(p), 0)
            counts[id(p)] = number + 1
            return unit.state_view(optimizer, i, number, p.dtype, zeros=zeros)

        modes.append(StateOnDisk(place))
    for mode in modes:
        mode.__enter__()
    _STATE_MODES[optimizer] = modes
    return True


def _exit_step_modes(optimizer: torch.optim.Optimizer) -> None:
    """Leave the dispatch modes of ``optimizer``'s disk-offload step, innermost first; the pager
    then releases the last unit's pages."""
    for mode in reversed(_STATE_MODES.pop(optimizer, [])):
        mode.__exit__(None, None, None)


def _settle_state(optimizer: torch.optim.Optimizer, disk: list[tuple[torch.Tensor, Unit, int]]) -> None:
    """Move every state tensor shaped like a disk-offloaded parameter that is not in the files yet
    (SGD's momentum is a clone of the gradient; a loaded state is new tensors) into them: the
    ``n``-th such state of a parameter goes to the unit's ``n``-th state file."""
    for p, unit, i in disk:
        state = optimizer.state.get(p)
        if not state:
            continue
        assert unit.store is not None
        tensors = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0]
        for number, key in enumerate(tensors):
            value = state[key]
            if unit.store.holds(value):
                continue
            placed = unit.state_view(optimizer, i, number, value.dtype)
            with torch.no_grad():
                placed.to_local().copy_(value.to_local() if isinstance(value, DTensor) else value)
            state[key] = placed


def _mark_stepped_units(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step post-hook: every unit whose parameters the optimizer holds counts as written.

    Staleness is read from version counters (``Unit._shard_version``), and an in-place op through a
    DTensor parameter bumps its counter, but torch's multi-tensor (``foreach``) and fused kernels
    write DTensor parameters without bumping any counter (torch 2.13). Without this, a stage-1
    model stepped by ``AdamW(foreach=True)`` (torch's default on CUDA) would skip the next
    all-gather and train on the other ranks' old rows (design/notes/dtensor-parameters.md)."""
    local = optimizer in _LEFT or local_step.leave(optimizer)  # the step ran on the local tensors (never with disk offload)
    if local:  # its owners are marked written already
        _LEFT.discard(optimizer)
    else:
        _exit_step_modes(optimizer)
        disk = _disk_params(optimizer)
        if disk:
            _settle_state(optimizer, disk)
    seen: set[int] = set()
    stepped: dict[int, Unit] = {}
    for group in optimizer.param_groups:  # (the DTensor parameters, after a local step too)
        for p in group["params"]:
            ref = _SHARDED_PARAMS.get(p)
            unit = ref() if ref is not None else None
            if unit is None:
                continue
            if not local and id(unit) not in seen:
                seen.add(id(unit))
                unit.mark_written()
            if p.grad is not None and id(unit) not in stepped:  # a write a backward still owed must see
                stepped[id(unit)] = unit
                if not local:
                    unit.mark_stepped()
    # The step counts once for each model it wrote, in the history every header carries (a step
    # that raised never gets here, and does not count)
    for root in {id(u._root): u._root for u in stepped.values()}.values():
        root._optimizer_steps += 1
        root.note_history()


def _guard_save_pretrained(original: Callable[..., Any]) -> Callable[..., Any]:
    """HF's ``save_pretrained`` on the wrapped module would write this rank's shards (or trip
    over views that share the flat shard's storage): ask for the full state dict instead."""

    def save_pretrained(save_directory: Any, *args: Any, state_dict: Any = None, **kwargs: Any) -> Any:
        if state_dict is None:
            raise RuntimeError(
                f"rank {collectives.rank()}: save_pretrained on a module wrapped by ShardedModule would "
                f"write this rank's shards. Gather the full weights on every rank first, then save them on "
                f"rank 0: sd = model.full_state_dict(); model.module.save_pretrained(dir, state_dict=sd)"
            )
        return original(save_directory, *args, state_dict=state_dict, **kwargs)

    return save_pretrained


def _synced_generate(original: Callable[..., Any], world: int) -> Callable[..., Any]:
    """HF's ``generate`` on a wrapped module: ``synced_gpus`` defaults to True on more than one
    rank, as transformers sets it itself for a module that ``fully_shard`` or DeepSpeed ZeRO-3
    manages. Without it a rank whose sequences all ended (an EOS) stops calling forward while its
    peers go on, and the gathers of the next forward find the ranks out of step."""

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = world > 1
        return original(*args, **kwargs)

    return generate


def _refuse_resize(name: str) -> Callable[..., NoReturn]:
    """HF's ``resize_token_embeddings`` after wrapping: its copy of the old rows into the new
    matrix failed inside transformers with a DTensor error (the model unchanged); say what to do."""

    def resize_token_embeddings(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"rank {collectives.rank()}: resize_token_embeddings on {name or 'the model'}, which ShardedModule "
            f"has wrapped: its embedding is sharded, and each unit's layout was fixed at wrapping. Resize "
            f"before wrapping (model.resize_token_embeddings(n), then ShardedModule(model, ...))"
        )

    return resize_token_embeddings


# ---- the wrapper --------------------------------------------------------------------------------


class PendingGraph:
    """The autograd graph of one root forward, for ``ShardedModule._pending_graphs``."""

    __slots__ = ("number", "__weakref__")

    def __init__(self, number: int) -> None:
        self.number = number


class ShardedModule(FullyShardMethods, nn.Module, FSDPModule):  # type: ignore[misc]  # wider argument types
    """Shard ``module``'s parameters over a 1-D mesh, ZeRO stage ``stage`` (3 by default; a
    ``shardwrap.Stage`` gives the switches directly).

    The module tree is not rewritten: ``named_parameters()``, ``named_modules()`` and
    ``state_dict()`` use the unwrapped model's names, and attribute access falls through to
    ``module``. ``offload=shardwrap.Offload("cpu" | "disk", path=...)`` keeps the master shards,
    their gradients and the optimizer state in host memory or mapped files
    (design/notes/offload.md).

    It is an ``FSDPModule`` (the last base), as is each unit's module, so that code finding the
    sharded modules with ``isinstance`` finds them (design/notes/fully-shard-methods.md).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "ShardedModule":
        return object.__new__(cls)  # not FSDPModule's, which builds the class it was swapped from

    def __init__(
        self,
        module: nn.Module,
        *,
        auto_wrap_policy: PolicyLike = None,
        stage: int | Stage = 3,
        mesh: DeviceMesh | None = None,
        mixed_precision: MixedPrecision | None = None,
        max_unsharded: int = 2,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        offload: Offload | None = None,
    ) -> None:
        # --- validate everything before changing any state ---
        if not collectives.is_initialized():
            raise RuntimeError(
                "ShardedModule needs an initialized process group: call "
                "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun sets the "
                "environment it reads)"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"ShardedModule: expected an nn.Module to wrap, got {type(module).__name__}")
        for name, sub in module.named_modules():
            if isinstance(sub, ShardedModule) or sub in _MANAGED_MODULES:
                where = f"submodule '{name}'" if name else "the module"
                raise ValueError(
                    f"ShardedModule: {where} ({type(sub).__name__}) is already wrapped. Wrap the "
                    f"outermost model once and choose inner units with auto_wrap_policy (two models "
                    f"that share a module: wrap one parent module that holds both)"
                )
            if isinstance(sub, (FSDPModule, FullyShardedDataParallel)):  # torch's, not ours (those are above)
                where = f"submodule '{name}'" if name else "the module"
                raise ValueError(
                    f"ShardedModule: {where} ({type(sub).__name__}) is already sharded by torch's "
                    f"{'fully_shard' if isinstance(sub, FSDPModule) else 'FullyShardedDataParallel'}. Wrap the "
                    f"plain model instead (choose units with auto_wrap_policy, where fully_shard was applied)"
                )
        for name, param in module.named_parameters():
            if param in _TAKEN_PARAMS:
                # sharded again here, it would train as a second, separate weight: the tie lost, silently
                raise ValueError(
                    f"ShardedModule: parameter '{name}' is also parameter '{_TAKEN_PARAMS[param]}' of a model "
                    f"another ShardedModule has wrapped. A weight shared between two wrapped models would be "
                    f"sharded twice and trained as two separate weights. Wrap one parent module that holds "
                    f"both models, so that one ShardedModule sees the tie"
                )
        originals = list(module.named_parameters())
        switches = Stage.of(stage)
        if mixed_precision is not None:
            mixed_precision = MixedPrecision.of(mixed_precision)
        if isinstance(max_unsharded, bool) or not isinstance(max_unsharded, int) or max_unsharded < 1:
            raise ValueError(
                f"ShardedModule: max_unsharded={max_unsharded!r}; it counts the running unit plus "
                f"units gathered ahead of use, so it must be an int >= 1 (1 turns prefetch off)"
            )
        if offload is not None and not isinstance(offload, Offload):
            raise TypeError(f"ShardedModule: offload={offload!r}; pass shardwrap.Offload(optimizer='cpu' | 'disk', path=...) or None")
        policy = as_policy(auto_wrap_policy)
        unit_modules = policy.select(module) if policy is not None else []
        plans = _plan_units(module, unit_modules)
        if collectives.world_size() > 1:  # first, so every rank meets it: design/notes/rank-agreement.md
            settings = {
                "stage": stage,
                "mixed_precision": mixed_precision,
                "max_unsharded": max_unsharded,
                "offload": offload.optimizer if offload is not None else None,
                "mesh": (tuple(mesh.shape), mesh.mesh_dim_names) if isinstance(mesh, DeviceMesh) else type(mesh).__name__,
            }
            described = agreement.describe(
                [(p.name or "<root>", list(zip(p.fqns, p.params))) for p in plans], settings, list(module.named_buffers())
            )
            agreement.check_same_model(described, collectives.default_group())
        _refuse_uncalled_units(module, unit_modules)  # after the agreement: the same verdict on every rank
        _refuse_sparse_gradients(module)
        tensor_parallel = _tensor_parallel_meshes(plans, mesh, offload)
        if offload is not None and offload.optimizer == "disk":  # every rank learns every rank's problem
            elements = sum(FlatLayout(p.fqns, p.params, collectives.world_size()).shard_numel + 1 for p in plans)
            try:
                check_disk(offload, disk_bytes(elements), collectives.rank())
                problem = None
            except ValueError as exc:
                problem = str(exc)
            found = [p for p in collectives.all_gather_object(problem, collectives.default_group()) if p]
            if found:
                raise ValueError(found[0])
        on_meta = _meta_init_check(module, param_init_fn)
        init_device = _init_device() if on_meta else None
        device = _check_unit_tensors(plans, meta_ok=on_meta)
        if init_device is not None:
            device = init_device
        if mesh is not None:
            _check_mesh(mesh, device, tensor_parallel[0].size() if tensor_parallel else 1)

        # --- build ---
        super().__init__()
        self.module = module
        self.stage = stage  # what the user passed; ``switches`` is what the units read
        self._switches = switches
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.mesh = mesh if mesh is not None else collectives.default_mesh(device.type)
        # With tensor parallelism the parameters are DTensors on the 2-D (dp, tp) mesh, sharded over dp.
        self.tp_mesh: DeviceMesh | None = tensor_parallel[0] if tensor_parallel else None
        self.dtensor_mesh = tensor_parallel[1] if tensor_parallel else self.mesh
        self.replicate_group: collectives.Group | None = None  # hybrid with R > 1: the replicate axis
        if tensor_parallel:
            self.shard_mesh = self.mesh
            self.world_group = collectives.default_group()  # dp x tp covers every rank (checked)
            reduce_group = collectives.reduce_group_of_mesh(self.dtensor_mesh, axis=0)
        elif self.mesh.ndim == 2:  # hybrid: shard over the last axis, replicate over the first
            replicate_axis, shard_axis = self.mesh.mesh_dim_names or ("", "")
            self.shard_mesh = self.mesh[shard_axis]
            replicas = self.mesh[replicate_axis]  # one replica (R = 1): nothing to all-reduce
            self.replicate_group = replicas.get_group() if replicas.size() > 1 else None
            self.world_group = collectives.default_group()  # the mesh covers every rank (checked)
            reduce_group = collectives.reduce_group_of_mesh(self.mesh)
        else:
            self.shard_mesh = self.mesh
            self.world_group = self.mesh.get_group()
            reduce_group = collectives.reduce_group_for(self.world_group)
        if self.mesh.ndim == 2 and self.shard_mesh.size() == 1 and switches.reshard_after_forward:
            axis = (self.mesh.mesh_dim_names or ("", "shard"))[1]
            warnings.warn(
                f"ShardedModule: the shard axis '{axis}' of the mesh has 1 rank, so every rank holds the whole "
                f"model: this is DDP, and stage 3 only adds an all-gather per unit. Use stage=1 (or DDP), or "
                f"shard over more ranks",
                stacklevel=2,
            )
        group = self.shard_mesh.get_group()
        names = [p.name or "<root>" for p in plans]
        _warn_hooks_left_behind(plans)
        self._state = TrainingState.IDLE
        count_group = group if device.type == "cpu" else None  # see CollectiveSchedule
        self.schedule = CollectiveSchedule(max_unsharded=max_unsharded, group=count_group)
        self._expect_backward = False  # a unit's outputs require grad: a backward will follow
        # The root forwards whose outputs need a gradient and that no backward has reached yet, nor
        # freed (numbers): while one is left, the end of a backward keeps the forwards' record in
        # the schedule, ``_expect_backward`` and the units' ``recomputable`` marks for the backward
        # that will reach it (design/notes/collective-schedule.md, "A backward each")
        self._pending_graphs: set[int] = set()
        self._graphs_made = 0
        self.outer_task = -1  # the autograd graph task of the running backward (begin_backward)
        self._steps_done = 0  # backward passes finished (error messages name the step)
        # Optimizer steps that wrote this model's parameters, and passes dropped by _recover: every
        # header carries both (collectives.history), so ranks a step apart raise (rank-agreement.md)
        self._optimizer_steps = self._dropped_passes = 0
        self._registered_after_wrapping = False  # a parameter or module joined the model (_note_registration)
        self._fatal_before = len(collectives.fatal_failures())  # collective timeouts and lost peers before this step
        self._sync = True  # False inside no_sync()
        # Units a no_sync backward scheduled to reduce since the last reducing backward: that one
        # reduces each of them on every rank, from zeros where this rank's backward never reached
        # it (a unit frozen whole since then has left the schedule, and only the ranks it reached
        # hold a gradient: design/notes/unused-parameters.md, "Frozen inside a window")
        self._owed: set[int] = set()
        self.offload = offload or Offload()
        if self.offload.enabled and device.type != "cpu" and collectives.carrier_device(self.world_group).type != "cpu":
            warnings.warn(
                f"ShardedModule: offload={self.offload.optimizer!r} keeps the gradients on the host, but this "
                f"process group has no CPU backend. torch.nn.utils.clip_grad_norm_ and a GradScaler (fp16) "
                f"reduce over host tensors and will fail. Use init_process_group('cpu:gloo,cuda:nccl'), or "
                f"model.clip_grad_norm_(), which works on any group",
                stacklevel=2,
            )
        store = OffloadStore(self.offload, collectives.rank(), self, pin=device.type == "cuda") if self.offload.enabled else None
        self._offload_store = store
        self._copy_streams: dict[str, torch.cuda.Stream] = {}  # "to device", "to host"
        self._copies_pending = False  # copies on _copy_streams since the last finish_host_copies
        self._spares = Spares()  # freed CPU buffers for the next unit's unshard (design/notes/spare-buffers.md)
        self._in_call = False  # inside forward(): a unit already in FORWARD is being called again
        self._summoned: _summon.Summoned | None = None  # an open summon_full_params() (shardwrap/summon.py)
        self._unit_of: dict[int, tuple[Unit, int]] = {}  # id(sharded param) -> (unit, slot index)
        self._unit_of_module: dict[int, tuple[nn.Module, Unit]] = {}  # id(unit's module) -> (it, its unit)
        self._method_call: Callable[..., Any] | None = None  # a registered method, for the next forward
        self._reduced_now: set[int] = set()  # units whose reduce-scatter the current backward started
        built: dict[int, Unit] = {}

        checkpoint_wrappers = _checkpoint_wrappers(module)

        def build(i: int) -> None:
            plan = plans[i]
            tp = [_tp_of(p) for p in plan.params] if tensor_parallel else None
            params = [_local_of_tp(p) for p in plan.params]  # TP: the local shards
            if self.mesh.size() > 1 and not on_meta:  # meta init already drew rank 0's numbers
                # Over the data-parallel ranks only: TP ranks hold different shards.
                init_group = self.shard_mesh.get_group() if tensor_parallel else self.world_group
                collectives.broadcast_tensors(params, init_group)  # one dtype per unit: one collective
            unit = Unit(
                root=self, name=names[i], index=i, unit_names=names, params=params, fqns=plan.fqns,
                slots=plan.slots, mesh=self.shard_mesh, reduce_group=reduce_group, stage=switches,
                dtensor_mesh=self.dtensor_mesh, replicate_group=self.replicate_group, tensor_parallel=tp,
                param_dtype=self.mixed_precision.param_dtype, reduce_dtype=self.mixed_precision.reduce_dtype,
                output_dtype=self.mixed_precision.output_dtype, cast_inputs=self.mixed_precision.cast_forward_inputs,
                store=store, device=device,
            )
            for j, (old, new) in enumerate(zip(plan.params, unit.sharded_params)):
                self._unit_of[id(new)] = (unit, j)
                _RETIRED_PARAMS[old] = plan.fqns[j]
                _SHARDED_PARAMS[new] = weakref.ref(unit)
            hooked = checkpoint_wrappers.get(id(plan.module), plan.module)
            hooked.register_forward_pre_hook(outside_compile(outside_checkpoint_modes(unit.pre_forward)), prepend=True, with_kwargs=True)
            hooked.register_forward_hook(outside_compile(outside_checkpoint_modes(unit.post_forward)))
            self._unit_of_module[id(plan.module)] = (plan.module, unit)
            if plan.module is not module:
                install_fully_shard_methods(self, unit, plan.module)
            built[i] = unit
            plan.params = []  # the full tensors: free them now, not when __init__ returns

        if init_device is not None:  # meta: materialize module by module, shard each unit when complete
            if self.mesh.size() > 1:
                _share_rng_state(self.world_group, init_device)
            for i in _materialize(module, plans, init_device, param_init_fn):
                build(i)
        else:
            for i in range(len(plans)):
                build(i)
        self._units = [built[i] for i in range(len(plans))]
        # Hybrid: the all-reduces over replicas start in this order on every rank (design/notes/hybrid-sharding.md).
        self._replica_order = [u for u in reversed(self._units) if u.has_trainable]
        self._replicas_started = 0
        if self.mesh.size() > 1:
            collectives.broadcast_tensors(list(module.buffers()), self.world_group)
        for name, param in originals:
            _TAKEN_PARAMS[param] = name
        for name, param in self.named_parameters():
            _TAKEN_PARAMS[param] = name
        for name, sub in module.named_modules():
            _MANAGED_MODULES.add(sub)
            _MODULE_ROOTS[sub] = weakref.ref(self)
            if next(sub.parameters(), None) is not None:  # what holds shards refuses conversions and copies
                sub.__dict__["_apply"] = _InnerApply(self, sub, name)
                sub.__dict__["__deepcopy__"] = _InnerDeepcopy(name)
            if callable(getattr(sub, "generate", None)) and hasattr(sub, "generation_config"):  # a Hugging Face model
                unit_of_sub = self._unit_of_module.get(id(sub))
                if unit_of_sub is not None and unit_of_sub[0] is sub:
                    # A forward method of its unit: an encoder-decoder's generate runs the encoder
                    # outside forward (T5's get_encoder()(...)), which met the root's parameters
                    # sharded ("mixed torch.Tensor and DTensor"), as under fully_shard unregistered
                    self.register_forward_method("generate", module=sub)
                else:
                    setattr(sub, "generate", _synced_generate(getattr(sub, "generate"), self.world_size))
            if callable(getattr(sub, "resize_token_embeddings", None)):
                setattr(sub, "resize_token_embeddings", _refuse_resize(name))
        if callable(getattr(module, "save_pretrained", None)):  # a Hugging Face model
            setattr(module, "save_pretrained", _guard_save_pretrained(getattr(module, "save_pretrained")))
        global _optimizer_hook_installed
        if not _optimizer_hook_installed:
            register_optimizer_step_pre_hook(_check_optimizer_params)
            register_optimizer_step_post_hook(_mark_stepped_units)
            register_module_parameter_registration_hook(_note_registration)
            register_module_module_registration_hook(_note_registration)
            _optimizer_hook_installed = True
        if self.mixed_precision.buffer_dtype is not None:
            with torch.no_grad():
                for sub in module.modules():
                    for name, buf in sub._buffers.items():
                        if buf is not None and buf.is_floating_point():
                            sub._buffers[name] = buf.to(self.mixed_precision.buffer_dtype)
        object.__setattr__(self, "__class__", _class_showing_signature(type(self), type(module)))
        _show_inner_signature(self, module)
        _warn_shadowed_names(self, module)
        # The wrapped model is what model.modules() shows first (named_modules below): it carries
        # the root unit's methods, as the model itself does under fully_shard.
        install_fully_shard_methods(self, self._units[0], module)
        if type(self).__init__ is ShardedModule.__init__:  # a subclass's __init__ sets it when it returns
            self._wrapped = True  # from here on, attribute writes the wrapper does not own go to the model

    # ---- what wrapping rules out ----------------------------------------------------------------

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "ShardedModule":
        """``.to()``, ``.cpu()``, ``.double()``, ``.half()``... after wrapping: a call that changes no
        tensor (Lightning's ``.to(device)`` on the device the model is on) does nothing; one that
        would change a dtype or a device is refused before anything moves. The parameters are
        DTensor views of each unit's flat shard; converting them one by one would cut them off it."""
        self.refuse_conversion(fn, self, "")
        return self

    def refuse_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor], module: nn.Module, prefix: str) -> None:
        """Raise ``TypeError`` if ``fn`` would change the dtype or device of a parameter or buffer
        of ``module`` (this wrapper, or a module inside it named ``prefix``), trying it on an empty
        tensor of each (dtype, device) found."""
        named: list[tuple[str, torch.dtype, torch.device]] = []
        for n, t in module.named_parameters(prefix):
            found = self.unit_of(t)
            # an offloaded parameter is a host tensor, but the model computes on its unit's device:
            # ``.to(that device)`` moves nothing and must pass
            named.append((f"parameter '{n}'", t.dtype, found[0].device if found is not None else local_of(t).device))
        named += [(f"buffer '{n}'", t.dtype, t.device) for n, t in module.named_buffers(prefix)]
        probes: dict[tuple[torch.dtype, torch.device], tuple[torch.dtype, torch.device]] = {}
        for what, dtype_, device_ in named:
            key = (dtype_, device_)
            if key not in probes:
                out = fn(torch.empty(0, dtype=dtype_, device=device_))
                probes[key] = (out.dtype, out.device)
            if probes[key] != key:
                (dtype, device), (new_dtype, new_device) = key, probes[key]
                raise TypeError(
                    f"ShardedModule: this call would turn {what} from {dtype} on {device} into {new_dtype} on "
                    f"{new_device} after wrapping, which shardwrap does not do. Convert or move the model "
                    f"before wrapping (model.to(...), then ShardedModule(model)); to compute in another dtype "
                    f"keep the fp32 master weights and pass mixed_precision=MixedPrecision(param_dtype=...)"
                )

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(_NOT_COPYABLE.format(what="copy.deepcopy"))

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(_NOT_COPYABLE.format(what="pickling (torch.save(model))"))

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> NoReturn:
        # DistributedDataParallel reads this attribute first thing in its constructor, before any
        # collective: raising here refuses DDP on every rank before it broadcasts rank 0's tensors
        # over every rank's shards.
        raise TypeError(
            "DistributedDataParallel(ShardedModule): the model is already data parallel, and DDP would "
            "overwrite every rank's shards with rank 0's. Train the ShardedModule as it is; for DDP's "
            "memory behaviour with sharded optimizer state use stage=1 (or stage=2 to shard gradients too); "
            "with Lightning use strategy='shardwrap_stage_1' / '_2' / '_3' (import shardwrap.lightning); "
            "with accelerate, pass accelerator.prepare() the optimizer, data loaders and scheduler but not "
            "the model (prepare wraps a model in DDP, and so does Hugging Face's Trainer.train())"
        )

    # ---- the original names -------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    # A wrapped container (nn.Sequential, nn.ModuleList, nn.ModuleDict) still indexes, iterates and
    # has a length, as under fully_shard; any other model raises TypeError as it would unwrapped.
    def __getitem__(self, index: Any) -> Any:
        return self.module[index]  # type: ignore[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.module)  # type: ignore[call-overload]

    def __len__(self) -> int:
        return len(self.module)  # type: ignore[arg-type]

    def __bool__(self) -> bool:
        return True  # ``if model:`` must not ask for a length a model without one lacks

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        if not self._in_call and torch._C._current_graph_task_id() == -1:
            # No forward or backward runs, yet a unit may still have the gathered views in its
            # slots: its forward or backward raised, and the next forward cleans up; or it shows
            # its full parameters after unshard(), as fully_shard does (read through the module:
            # model.blocks[0].up.weight). The sharded parameters go back first, so a new
            # optimizer, clipping or requires_grad_ gets them.
            for unit in self._units:
                if unit.training_state is not TrainingState.IDLE or unit.showing_full:
                    unit.show_sharded_params()
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        """The wrapped model's children, as the other ``named_*`` give its names: code that walks
        the tree child by child (Hugging Face's ``get_parameter_names``, which picks the
        parameters that get weight decay) builds the same names as from ``named_parameters()``,
        with no ``module.`` in front. ``train``, ``apply`` and replacing a top-level child follow."""
        return self.module.named_children()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._summoned is not None:  # it would reach the full copies, and leave the gradients be
            raise _summon.refusal("model.zero_grad()")
        super().zero_grad(set_to_none)

    def train(self, mode: bool = True) -> "ShardedModule":
        self.training = mode
        self.module.train(mode)
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> "ShardedModule":
        """``fn`` on every module of the wrapped model, children first, as under ``fully_shard``
        (where the model is the root). Not on the wrapper too: it reads through to the model, so
        an init function that checks ``hasattr(m, "reset_parameters")`` or ``m.weight`` would run
        on the model's root twice."""
        self.module.apply(fn)
        return self

    def _routes_to_inner(self, name: str) -> nn.Module | None:
        """The wrapped model, where an attribute write or delete of ``name`` belongs to it: once
        wrapping is done (a subclass's ``__init__`` included), every name the wrapper does not hold
        itself (its own state, set while wrapping, what was registered on it, and the class's
        methods and properties). Under ``fully_shard`` the model is the module, so
        ``model.use_cache = False`` or ``model.temperature = 0.5`` from a training loop reaches the
        code its forward runs; written on the wrapper, it would shadow the model's attribute
        (reads fall through to the model, so it would even read back) and the forward would go
        on with the old value."""
        inner = self.__dict__.get("_modules", {}).get("module")
        if inner is None or not self.__dict__.get("_wrapped", False) or name == "module":
            return None
        if name in self.__dict__ or hasattr(type(self), name):
            return None
        if any(name in self.__dict__.get(registry, {}) for registry in ("_parameters", "_buffers", "_modules")):
            return None
        return inner

    def _refuse_unsharded_parameters(self, name: str, value: Any) -> None:
        """A parameter attached after wrapping would be a plain tensor on every rank, outside every
        unit: its gradient never averaged, each rank's copy stepped on its own gradient, the ranks
        drifting apart with no error. Refuse it, before anything changes."""
        if isinstance(value, nn.Parameter):
            found = [name]
        elif isinstance(value, nn.Module):
            found = [f"{name}.{n}" if n else name for n, p in value.named_parameters() if self._unit_of.get(id(p)) is None]
        else:
            return
        if found:
            raise ValueError(
                f"rank {collectives.rank()}: shardwrap: model.{name} = ... would add parameter(s) "
                f"{', '.join(repr(f) for f in found[:5])} after wrapping. No unit shards them, so their "
                f"gradients would not be averaged across ranks and each rank would train its own copy. Add "
                f"them to the model before wrapping it in ShardedModule (a module without parameters, or one "
                f"whose parameters this model already holds, may be attached at any time)"
            )

    def __setattr__(self, name: str, value: Any) -> None:
        if _torchs_forward_method(value) and self.__dict__.get("_wrapped", False):
            self.register_forward_method(name)  # torch's register_fsdp_forward_method(model, name)
            return
        inner = self._routes_to_inner(name)
        if inner is not None:
            self._refuse_unsharded_parameters(name, value)
            setattr(inner, name, value)  # a flag, a value, or a top-level child, as named_children names it
            return
        super().__setattr__(name, value)
        if name == "training" and self.__dict__.get("_wrapped", False):
            self.module.training = value  # the model's own flag, which its forward reads, as under fully_shard

    def __delattr__(self, name: str) -> None:
        inner = self._routes_to_inner(name)
        if inner is not None:
            delattr(inner, name)
            return
        super().__delattr__(name)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass's own ``__init__`` may set attributes of its own after ``super().__init__()``:
        attribute writes start going to the wrapped model only once the outermost ``__init__``
        has returned."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def init_then_route(self: "ShardedModule", *args: Any, **kw: Any) -> None:
            init(self, *args, **kw)
            if type(self).__init__ is init_then_route:
                self.__dict__["_wrapped"] = True

        cls.__init__ = init_then_route  # type: ignore[method-assign]

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        if prefix and _inside_ddp_constructor():
            # DDP around a module that holds this one: the property below is only read on DDP's
            # own root. DDP lists its parameters first thing, before any collective.
            raise TypeError(
                f"DistributedDataParallel around a module that holds a ShardedModule (at '{prefix}'): DDP "
                f"would broadcast rank 0's shards over every rank's. Drop DDP and train the ShardedModule as it "
                f"is; with Lightning use strategy='shardwrap_stage_1' / '_2' / '_3' (import shardwrap.lightning) "
                f"and let the strategy wrap the model, instead of strategy='ddp'"
            )
        return self.module.named_modules(memo, prefix, remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint.state_dict's hook for wrappers: the child ``module`` adds
        nothing to a name, so ``get_state_dict``/``set_state_dict`` use the unwrapped model's keys."""
        return {"module": "module"}

    def register_forward_method(self, name: str, module: nn.Module | None = None) -> None:
        """Let calls of ``module.<name>`` (default: the wrapped model's; else a module that is a
        unit) run as its ``forward`` runs: the unit's parameters gathered around the call, its
        gradient reduced in backward. For methods other than ``forward`` that read the unit's
        own parameters, such as CLIP's ``encode_text`` or a VAE's ``encode``; ``fully_shard``'s
        ``register_fsdp_forward_method``. Units called inside the method need nothing: their
        ``__call__`` runs their hooks."""
        target = self.module if module is None or module is self else module
        found = self._unit_of_module.get(id(target))
        if found is None or found[0] is not target:
            raise ValueError(
                f"register_forward_method({name!r}): {type(target).__name__} is not a unit of this ShardedModule; "
                f"pass the wrapped model or a module that auto_wrap_policy made a unit ({', '.join(u.name for u in self._units)})"
            )
        unit = found[1]
        method = getattr(type(target), name, None)
        if not callable(method):
            raise ValueError(f"register_forward_method({name!r}): {type(target).__name__} has no method {name!r}")
        bound = method.__get__(target)  # the class's method: registering twice does not nest
        pre_forward = outside_compile(outside_checkpoint_modes(unit.pre_forward))
        post_forward = outside_compile(outside_checkpoint_modes(unit.post_forward))

        def run(*args: Any, **kwargs: Any) -> Any:  # the hooks see the arguments, as for forward
            cast = pre_forward(target, args, kwargs)
            if cast is not None:  # mixed precision: the method's floating inputs in param_dtype
                args, kwargs = cast
            return post_forward(target, args, bound(*args, **kwargs))

        def as_forward(*args: Any, **kwargs: Any) -> Any:
            previous, self._method_call = self._method_call, run
            try:
                return self.forward(*args, **kwargs)
            finally:
                self._method_call = previous

        as_forward.__wrapped__ = bound  # type: ignore[attr-defined]
        registered: Callable[..., Any] = as_forward
        if name == "generate" and hasattr(target, "generation_config"):  # Hugging Face's: synced_gpus stays on
            registered = _synced_generate(as_forward, self.world_size)
        object.__setattr__(target, name, registered)  # an instance attribute: the class's method stays

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # A registered method's call runs here too, in place of the wrapped model
        # (register_forward_method); one frame, so torch.compile breaks no more often.
        # Under mixed precision the root unit's pre-forward hook casts the inputs (every unit casts its own).
        fn, self._method_call = self._method_call or self.module, None
        if not self._in_call and self._state is not TrainingState.BACKWARD and any(
            u.training_state is TrainingState.FORWARD for u in self._units
        ):
            self._recover()  # a forward raised: clean up here, so that FORWARD below means re-entry
        previous, self._in_call = self._in_call, True  # a registered method may run inside the forward
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            running = [u.name for u in self._units if u.training_state is TrainingState.FORWARD]
            if "is the output of a function that returns multiple views" in str(exc) and running:
                raise RuntimeError(
                    f"rank {collectives.rank()}: shardwrap: autograd refused an in-place write to a view in the forward "
                    f"of unit '{running[-1]}'. If that forward writes a parameter in place (a clamp_ under torch.no_grad(), "
                    f"nn.Embedding(max_norm=...) renormalizing its weight): inside its forward a unit's parameters are "
                    f"views of the gathered buffer, made by one split, which autograd does not let a forward write "
                    f"(fully_shard lets the write through and loses it). Otherwise the write is to an output of split, "
                    f"chunk or unbind in the model's own code. Constrain parameters outside the forward, in place "
                    f"on model.parameters() under torch.no_grad() (after optimizer.step(): p.clamp_(-c, c); for an "
                    f"embedding's max_norm, w.mul_((c / w.norm(dim=1, keepdim=True)).clamp(max=1)), which renormalizes every "
                    f"row rather than the rows looked up) ({exc})"
                ) from exc
            if "mixed torch.Tensor and DTensor" not in str(exc):
                raise
            raise RuntimeError(
                f"rank {collectives.rank()}: a sharded parameter (a DTensor) was used outside its unit's "
                f"forward, while unit '{running[-1] if running else '<root>'}' ran. A unit's parameters are "
                f"full tensors only inside that unit's forward: read them there, let auto_wrap_policy put "
                f"the code that reads them in the same unit, or, for a method of the unit's module other than "
                f"forward, call model.register_forward_method(name, module=...) once after wrapping. For a penalty "
                f"over the parameters added to the loss (an L2 term), use the optimizer's weight_decay ({exc})"
            ) from exc
        finally:
            self._in_call = previous

    def copy_stream(self, device: torch.device, direction: str) -> "torch.cuda.Stream":
        """The CUDA stream that offloaded units copy on in ``direction``: ``"to device"`` (shards
        before a gather) or ``"to host"`` (reduced gradient shards). One stream each, made once
        on ``device`` whatever the current one is: a gradient copy waits for the compute stream,
        and a shard copy queued behind it on one stream would wait too. Asking for one marks a
        copy pending until ``finish_host_copies``."""
        stream = self._copy_streams.get(direction)
        if stream is None:
            stream = self._copy_streams[direction] = torch.cuda.Stream(device=device)
        self._copies_pending = True
        return stream

    def finish_host_copies(self) -> None:
        """Block the host until every copy on the copy streams is done: the shard copies to the
        device have been read (the optimizer's host step and loads rewrite those pinned shards in
        place), and the gradient copies to the host have landed (the host reads them). Called at
        the end of backward, after a forward that no backward follows (an evaluation), after a
        failed forward or backward, before a load writes shards, and by the optimizer's step
        pre-hook (design/notes/offload.md)."""
        if self._copies_pending:
            for stream in self._copy_streams.values():
                stream.synchronize()
        self._copies_pending = False

    @property
    def units(self) -> list[Unit]:
        """The units in pre-order, root first."""
        return list(self._units)

    # ---- the mesh's axes ----------------------------------------------------------------------

    @property
    def shard_rank(self) -> int:
        """This rank's place on the shard axis: which chunk of each parameter it holds."""
        return self.shard_mesh.get_local_rank()

    @property
    def shard_size(self) -> int:
        """S, the ranks a parameter is sharded over."""
        return self.shard_mesh.size()

    @property
    def replicate_size(self) -> int:
        """R, the replicas (1 unless the mesh is a 2-D hybrid one)."""
        return self.mesh.size() // self.shard_mesh.size()

    @property
    def replicate_rank(self) -> int:
        return 0 if self.replicate_group is None else collectives.group_rank(self.replicate_group)

    @property
    def world_rank(self) -> int:
        """This rank's place among every rank of the mesh (0: the first, which keeps full state dicts)."""
        return collectives.group_rank(self.world_group)

    @property
    def world_size(self) -> int:
        """R * S, every rank of the mesh (with tensor parallelism, dp * tp)."""
        return self.dtensor_mesh.size()

    def unit_of(self, param: torch.Tensor) -> tuple[Unit, int] | None:
        """The unit owning the sharded parameter ``param`` and its index there, or None."""
        return self._unit_of.get(id(param))

    def unit_of_module(self, module: nn.Module) -> Unit | None:
        """The unit whose module is ``module`` (this wrapper or its model: the root unit), or None."""
        if module is self or module is self.module:
            return self._units[0]
        found = self._unit_of_module.get(id(module))
        return found[1] if found is not None and found[0] is module else None

    def module_of_unit(self, unit: Unit) -> nn.Module:
        """The module ``unit`` was made for (the model itself for the root unit)."""
        return next(m for m, u in self._unit_of_module.values() if u is unit)

    # ---- fully_shard's per-module methods (shardwrap/fully_shard_api.py) -------------------------

    def _fs_root(self) -> ShardedModule:
        return self

    def _fs_own(self) -> list[Unit]:
        return [self._units[0]]

    def _fs_reach(self, recurse: bool) -> list[Unit]:
        return list(self._units) if recurse else [self._units[0]]

    def _fs_name(self) -> str:
        return self._units[0].name

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: clean up now what the next forward would
        (wait for the collectives it left in flight, drop its gradients, free every unit), as
        ``fully_shard``'s root method does. Call it on every rank."""
        self.refuse_out_of_step("reset_iter_state()")
        if torch._C._current_graph_task_id() != -1 or self._in_call:
            raise RuntimeError("reset_iter_state() during a forward or backward; call it after the one that raised")
        if self._state is not TrainingState.IDLE or any(u.training_state is not TrainingState.IDLE for u in self._units):
            self._recover()

    # ---- the root's part of a step (the units call these) ---------------------------------------

    @property
    def backward_owed(self) -> bool:
        """Whether the graph of a forward since the last backward is still alive, so a backward
        through it could still come (unlike ``_expect_backward``, false once that graph was
        dropped)."""
        return any(call() is not None for unit in self._units for call in unit._calls)

    @property
    def backward_running(self) -> bool:
        """Whether a backward of this model has started and not ended (no side effects, unlike
        ``in_backward``)."""
        return self._state is TrainingState.BACKWARD and torch._C._current_graph_task_id() != -1

    def in_backward(self) -> bool:
        """Whether a backward of this model is running. A unit's forward then is activation
        checkpointing recomputing it. The engine's graph task id covers a recomputation that
        comes before any of this model's backward hooks ran."""
        running = torch._C._current_graph_task_id() != -1
        if self._state is TrainingState.BACKWARD:
            return running  # BACKWARD with no backward running: it raised (root_pre_forward recovers)
        if running:
            self.begin_backward()
            return True
        return False

    def root_pre_forward(self) -> None:
        """The root unit's forward starts: a new step's forward, unless one is still owed a
        backward (several forwards before one backward). A forward or backward that raised
        before it finished is cleaned up first."""
        self.refuse_out_of_step("this forward")
        if self._registered_after_wrapping:
            self._refuse_added_parameters()
        local_step.restore_failed_steps()
        if self._state is TrainingState.BACKWARD or any(u.training_state is not TrainingState.IDLE for u in self._units):
            self._recover()
        if [unit.follow_unfreezing() for unit in self._units].count(True):  # a unit frozen whole may train now
            self._replica_order = [u for u in reversed(self._units) if u.has_trainable]
        self._catch_unseen_writes()
        self._fatal_before = len(collectives.fatal_failures())
        for unit in self._units:  # (a graph that may still be owed a backward keeps its leaves' requires_grad)
            unit.follow_requires_grad(allow_off=not self._expect_backward)
        if not self._expect_backward:
            self.schedule.clear()
        self.schedule.start_forward()
        self._spares.open()

    def _refuse_added_parameters(self) -> None:
        """After a registration on the wrapped model (``_note_registration``): refuse a parameter
        that no unit shards, naming it (a frozen one too: unfrozen later, it would train
        unsynchronized); every rank makes the same change, so every rank raises. The mark stays
        until none is left (the user removed the new part)."""
        # A new tensor in a unit's own slot (module.weight = nn.Parameter(...)) is a replacement,
        # which the unit's pre-forward names (Unit._check_slots)
        slots = {(id(module), attr) for unit in self._units for places in unit.slots for module, attr in places}
        added = [
            f"{prefix}{'.' if prefix else ''}{attr}"
            for prefix, module in self.module.named_modules()
            for attr, p in module._parameters.items()
            if p is not None and _unit_of_param(p) is None and (id(module), attr) not in slots
        ]
        if not added:
            self._registered_after_wrapping = False
            return
        raise RuntimeError(
            f"rank {collectives.rank()}: shardwrap: parameter(s) {', '.join(repr(n) for n in added[:8])}"
            f"{f' and {len(added) - 8} more' if len(added) > 8 else ''} joined the model after ShardedModule "
            f"wrapped it (a module assigned into it, register_parameter, PEFT's get_peft_model or adapters "
            f"injected into the wrapped model, torch.nn.utils.parametrize.remove_parametrizations). No unit shards "
            f"them, so each rank would train its own copy and never average it with the others' (fully_shard "
            f"does the same, silently). Make the change before wrapping, then wrap; or remove the new part again "
            f"(del module.name) to train on"
        )

    def _catch_unseen_writes(self) -> None:
        """A unit left gathered since the last forward is computed with again without a gather,
        unless a version counter says its shard was written: at stage 1 between any two
        forwards, at stages 2 and 3 between forwards that share one backward. A write that bumps
        none (through ``p.data``, through ``p.to_local()``, or by a ``torch._foreach_*`` op on the
        parameters: an EMA swapped in for an evaluation and back, DINO's teacher update) reaches
        this rank's rows only, and the other ranks' rows of the unit would stay stale. So each
        forward checks this rank's shard of every gathered unit and marks one that changed
        written: it gathers again. Where the shard has storage of its own, it is compared bit for
        bit with the rank's rows of the unsharded buffer; where it lives there (stage 1 without
        mixed precision or offload), a digest of it is compared with the one taken at the last
        forward. No collective: a forward that gathers nothing stays local, as before (one rank
        may run forwards the others do not). Such a write is made on every rank, so every rank
        sees its own rows change where each holds rows of the parameter: the check covers only
        those parameters (``Unit.digest_params``). A write that changes one rank's rows and not
        another's leaves the ranks deciding differently (design/notes/rank-agreement.md, "Writes
        no version counter sees", says what follows). On a CPU, where the check costs one pass
        over the shard and no wait; not for a shard on disk."""
        for unit in self._units:
            if not unit.digest_params:
                continue
            if not unit.shard_in_unsharded:
                if unit.data_state is DataState.UNSHARDED and not unit.gathered_rows_hold_shard():
                    unit.mark_written()
                continue
            digest = unit.shard_digest()
            if unit.last_digest is not None and digest != unit.last_digest:
                unit.mark_written()
            unit.last_digest = digest

    def _recover(self) -> None:
        """The last forward or backward raised before it finished (a user hook, an autograd
        function, the loss): wait for every collective it left in flight (so the ranks stay
        paired), drop every gradient it left pending, reshard every unit, and start afresh
        (design/notes/rank-agreement.md)."""
        phase = "backward" if self._state is TrainingState.BACKWARD else "forward"
        # Gradients this rank drops and its peers may keep: a failed backward's, or a no_sync
        # accumulation's (a failed evaluation forward drops none, and counts for nothing)
        drops = self._state is TrainingState.BACKWARD or not all(u.grad_settled for u in self._units)
        # A collective of the failed step timed out or lost its peer: gloo has closed the connection
        # to that peer (after a timeout it does so itself), and a collective left in flight then
        # may never finish, so none is waited for; and the ranks' sequences can no longer be
        # trusted to pair, so nothing more is issued either (design/notes/rank-agreement.md).
        fatal = collectives.fatal_failures()[self._fatal_before :]
        # Every unit is cleaned up even if a wait in one of them fails; after a failure other than
        # a lost peer (a timeout) nothing more is waited for (Unit.abandon).
        failure: BaseException | None = None
        for unit in self._units:
            try:
                unit.abandon(wait=not fatal and (failure is None or collectives.lost_a_peer(failure)))
            except Exception as exc:
                failure = failure or exc
        self._spares.close()
        self.finish_host_copies()  # offload on a GPU: no copy lands in a gradient or reads a shard later
        self._replicas_started = 0
        try:
            # waits for the count exchanges still in flight
            self.schedule.end_backward(wait=not fatal and (failure is None or collectives.lost_a_peer(failure)))
        except Exception as exc:
            failure = failure or exc
        self._expect_backward = False
        self._state = TrainingState.IDLE
        self._owed = set()
        if drops:
            self._dropped_passes += 1
            self.note_history()
        if fatal:
            self.schedule.out_of_step(f"rank {collectives.rank()}: in the {phase} of step {self._steps_done + 1}, {fatal[0]}")
            self.refuse_out_of_step("this forward")
        if failure is not None:
            raise failure
        warnings.warn(
            f"rank {collectives.rank()}: the previous {phase} of this ShardedModule raised before it "
            f"finished; its pending gradients were dropped and every unit was resharded. Call "
            f"optimizer.zero_grad() before the next backward: p.grad may hold part of the failed step",
            RuntimeWarning,
            stacklevel=2,
        )

    def root_post_forward(self) -> None:
        """The root unit's forward ended: drop units gathered ahead that were not used, and if no
        backward will follow, leave nothing unsharded."""
        for unit in self.schedule.take_prefetched():
            unit.reshard()
        self._spares.close()
        if not self._expect_backward:
            for unit in self._units:
                unit.reshard()
            self.finish_host_copies()  # offload on a GPU: nothing reads the host shards in flight after an evaluation

    def graph_made(self) -> "PendingGraph":
        """A root forward whose outputs need a gradient: pending until ``graph_reached`` or until
        its graph is freed (the returned object lives exactly as long as the hook on its outputs)."""
        self._graphs_made += 1
        graph = PendingGraph(self._graphs_made)
        self._pending_graphs.add(graph.number)
        weakref.finalize(graph, self._pending_graphs.discard, graph.number)
        return graph

    def graph_reached(self, graph: "PendingGraph") -> None:
        self._pending_graphs.discard(graph.number)

    def begin_backward(self) -> None:
        if self._state is TrainingState.BACKWARD:
            return
        changed = [u.name for u in self._units if u.changed_since_forward()]
        if changed:  # before anything changes: the same on every rank that wrote the same
            raise RuntimeError(
                f"rank {collectives.rank()}: shardwrap: the parameters of unit(s) {', '.join(repr(n) for n in changed)} "
                f"were written after the forward that this backward goes back through (an optimizer.step(), "
                f"load_state_dict, load_checkpoint or an in-place write between the forward and its backward). "
                f"The backward would take gradients of the new values against activations of the old ones; "
                f"plain PyTorch refuses it too ('modified by an inplace operation'). Call backward() before "
                f"changing the parameters, or run the forward again after the change"
            )
        self._state = TrainingState.BACKWARD
        # The graph task this backward runs in; a reentrant checkpoint's nested backwards run in
        # tasks of their own, and units they are done with wait for this one (release_due_units)
        self.outer_task = torch._C._current_graph_task_id()
        # No public API runs a function once the whole backward pass is done; FSDP1 and FSDP2 use
        # this engine call too (design/notes/end-of-backward.md).
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        # from no_sync; a unit a reentrant checkpoint may have recomputed on some ranks only is reduced
        # by every rank at the end of the backward anyway
        accumulated = [u.index for u in self._units
                       if (u.grad_state is GradState.ACCUMULATING or u.index in self._owed) and not u.recomputable]
        self.schedule.begin_backward(sync=self._sync, accumulated=accumulated)
        if self._sync:
            self._owed = set()
        else:
            self._owed.update(self.schedule.scheduled_reductions())
        self._reduced_now = set()
        self._spares.open()

    def prefetch_backward(self) -> None:
        ahead = self.schedule.backward_prefetch()
        if ahead is not None:
            ahead.unshard(async_op=True)
            self.schedule.gathered_ahead()

    def start_due_reductions(self) -> None:
        """Start the reduce-scatter of every packed unit whose predecessors have all started."""
        for unit in self.schedule.reductions_due():
            self._start_reduction(unit)

    def _start_reduction(self, unit: Unit) -> None:
        """Start ``unit``'s reduce-scatter after applying every earlier one that completed, then
        bound how many are in flight (waiting only for ones every rank started)."""
        self.apply_completed_reductions()
        self.schedule.check_landed_exchanges()
        self._reduced_now.add(unit.index)
        unit.reduce_scatter_grad()
        self.schedule.started(unit)
        unit.finish_grad_beside_compute()  # offload on a GPU: off to the host as soon as it is reduced
        while (oldest := self.schedule.over_bound()) is not None:
            self._reduced(oldest)

    def release_due_units(self) -> None:
        """A hook of the outermost backward runs: every nested backward before it is over, and
        units a nested backward was done with, and that no running backward still reads, give
        their slots back and free their parameters (design/notes/activation-checkpointing.md,
        "When backward is done with a unit")."""
        for unit in self._units:
            if unit.release_due:
                unit.release_if_done()

    def apply_completed_reductions(self) -> None:
        """Add every completed reduce-scatter into ``p.grad`` and free its buffers (never waits);
        hybrid: start the all-reduces over replicas that are due instead."""
        for unit in self.schedule.completed():
            self._reduced(unit)

    def _reduced(self, unit: Unit) -> None:
        """``unit``'s reduce-scatter is done (or is waited for now): apply it, or (hybrid) start
        every all-reduce over replicas whose turn has come. A unit whose gradient arrived a
        second time in this backward was applied then (``Unit._grad_arrived``: activation
        checkpointing with ``use_reentrant=True`` inside its forward backpropagates into it from a
        nested backward); the schedule still lists that earlier reduce-scatter: nothing is left
        of it to apply."""
        if unit.grad_state is not GradState.IN_FLIGHT:
            return
        if self.replicate_group is None:
            unit.finish_grad()
            return
        unit.finish_shard_reduction()
        self._start_replica_reductions(final=False)

    def _start_replica_reductions(self, final: bool) -> None:
        """Hybrid: start the all-reduces over replicas in ``_replica_order``, the same on every
        rank, as far as the reduce-scatters have finished (``final``: waiting for them). Two
        replicas may see their reduce-scatters complete in different orders; the all-reduces on
        the replicate group must pair up, so they never start out of this order."""
        order = self._replica_order
        while self._replicas_started < len(order):
            unit = order[self._replicas_started]
            if not unit.trains and unit.grad_state is not GradState.IN_FLIGHT and unit.index not in self.schedule.accumulated:
                # frozen whole: no reduction this backward (unless a no_sync one owes it: at the end)
                self._replicas_started += 1
                continue
            if not unit.shard_reduced:
                if not final:
                    return  # not reduce-scattered yet, or still in flight: its turn blocks the rest
                if unit.grad_state is not GradState.IN_FLIGHT:  # no reduction this backward, on any rank
                    self._replicas_started += 1
                    continue
                unit.finish_shard_reduction()
            unit.start_replica_reduction()
            self._replicas_started += 1

    def _settle_unused_grads(self) -> None:
        """After a backward that reduced: which parameters some rank's backward reached, from the
        used-flags that rode in each unit's reduce-scatter (one host read for every unit), so that
        a parameter no rank used keeps ``p.grad`` None rather than the zeros its unit's flat
        gradient gave it (design/notes/unused-parameters.md)."""
        units = [u for u in self._units if u.layout.num_trainable]
        usage = [(u, u.take_usage()) for u in units]
        summed = [t.float() for _, t in usage if isinstance(t, torch.Tensor)]
        counts = iter(torch.cat(summed).tolist() if summed else [])  # none where this rank used everything
        for unit, t in usage:
            n = unit.layout.num_trainable
            unit.settle_unused_grads([next(counts) > 0 for _ in range(n)] if isinstance(t, torch.Tensor) else [t] * n)

    def _finish_backward(self) -> None:
        """End of backward: issue whatever this rank's graph skipped (all-gathers, reduce-scatters
        of zeros for units it did not reach), wait for every reduce-scatter, and reshard every
        unit, whatever the graph did."""
        schedule = self.schedule
        pending = bool(self._pending_graphs)  # once: the collector may free a graph (its finalizer) meanwhile
        for unit in schedule.skipped_gathers():
            unit.unshard()
            schedule.gathered_ahead()
        recomputable = [u for u in self._units if u.recomputable]
        if any(u.stage.reshard_after_forward for u in recomputable):
            self._check_end_of_backward(recomputable[0])
        if self._sync:
            for unit in schedule.skipped_reductions():
                if unit.grad_state is GradState.ACCUMULATING:
                    unit.pack_grad()  # gradient kept from no_sync micro-batches
                self._start_reduction(unit)
            owed = set(schedule.accumulated)
            for unit in self._units:
                if unit.grad_state in (GradState.ACCUMULATING, GradState.PACKED):  # outside the recorded forward
                    unit.pack_grad()
                    self._start_reduction(unit)
                elif unit.index in owed and unit.index not in self._reduced_now:  # zeros, paired with the ranks it reached
                    self._start_reduction(unit)
                elif unit.recomputable and unit.trains and unit.index not in self._reduced_now:
                    # recomputed (and reduced) on other ranks only: this rank's zeros pair with theirs
                    self._start_reduction(unit)
            if not pending:
                for unit in recomputable:
                    unit.recomputable = False
            if self.replicate_group is not None:
                self._start_replica_reductions(final=True)
                self._replicas_started = 0
            for unit in self._units:
                if unit.grad_state is GradState.IN_FLIGHT:
                    unit.finish_grad()
        self.finish_host_copies()  # offload on a GPU: the gradient copies to the host have landed
        schedule.end_backward(keep_forward=pending)
        if self._sync:
            self._settle_unused_grads()
        for unit in self._units:
            unit.end_backward()
            if unit.stage.reshard_after_backward:
                unit.reshard()
            else:
                unit.restore_params()
            unit.training_state = TrainingState.IDLE
        self._spares.close()
        self._expect_backward = pending  # two forwards, then a backward each
        self._state = TrainingState.IDLE
        self._steps_done += 1
        if self._sync:  # last: a hook may step an optimizer, which needs every unit settled
            for unit in reversed(self._units):
                unit.run_grad_hooks()

    def _check_end_of_backward(self, unit: Unit) -> None:
        """At stage 3, after forwards that ran units under ``no_grad`` (a reentrant
        checkpoint's first pass): one header saying this rank's backward is over, before any
        reduce-scatter is waited for. A peer still recomputing such a unit, because only its loss
        reached the unit's output, is then at that unit's all-gather, meets this header instead of
        waiting for a gather this rank will never issue, and every rank raises, naming both
        (design/notes/activation-checkpointing.md, "Recomputed on some ranks"). CPU groups only,
        as every header. ``unit``: any unit, for its group and names."""
        if unit.device.type != "cpu" or unit.world_size == 1:
            return
        mine = [collectives.HEADER_END, self.schedule.history << collectives.HISTORY_SHIFT]
        rows = collectives.all_gather_ints(mine, unit.group, what="the end of a backward", kind="headers")
        if any(row != mine for row in rows):
            from shardwrap.schedule import OUT_OF_STEP_HINT, header_text, history_hint

            seen = ", ".join(f"rank {r}: {header_text(k, v, list(unit.unit_names))}" for r, (k, v) in enumerate(rows))
            hint = history_hint(rows) or f" {RECOMPUTED_ON_SOME_RANKS}"
            raise self.schedule.out_of_step(
                f"rank {collectives.rank()}: shardwrap: ranks disagree on the next collective at the end of backward "
                f"{self._steps_done + 1} ({seen}).{hint} {OUT_OF_STEP_HINT}"
            )

    # ---- gradient accumulation and clipping ---------------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep their gradients unsharded on this rank, with no
        communication; the first backward outside reduces everything accumulated."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the sharded gradients by the norm of the *whole* gradient, as
        ``torch.nn.utils.clip_grad_norm_`` does on the unwrapped model, and return that norm.

        Padding is never part of a gradient view, so it never counts. A NaN or inf gradient on any
        rank gives a NaN or inf norm on every rank.
        """
        self.check_between_steps("clip_grad_norm_")
        if not all(u.grad_settled for u in self._units):
            raise RuntimeError(
                "clip_grad_norm_: gradients accumulated under no_sync() are not reduced yet; run the "
                "last micro-batch's backward outside no_sync(), then clip"
            )
        norm_type = float(norm_type)
        # Hybrid: every replica holds the same gradient, so the shard axis sums it. With tensor
        # parallelism every rank holds a different part: sum over all, counting each part once.
        group = self.world_group if self.tp_mesh is not None else self.shard_mesh.get_group()
        grads, counted = [], []
        coordinate = list(self.dtensor_mesh.get_coordinate() or [])
        # Summed in float32 at least (fp16 and bf16 gradients too), in float64 where the model has
        # float64 parameters (torch's clip sums each gradient in its own dtype; float32 lost digits
        # there). From the parameters, not the gradients: every rank must all-reduce one dtype.
        acc = torch.float32
        for p in self.parameters():
            if p.dtype == torch.float64:
                acc = torch.float64
            if p.grad is None or local_of(p.grad).numel() == 0:
                continue
            grads.append(local_of(p.grad))
            if self._counts_in_norm(p, coordinate):
                counted.append(grads[-1])
        device = self._units[0].device
        if norm_type == float("inf"):
            local_max = (torch.stack([g.abs().max().to(acc) for g in counted]).max() if counted
                         else torch.zeros((), device=device, dtype=acc))
            stats = torch.stack([local_max, torch.isnan(local_max).to(acc)]).to(device)
            nan_count = stats[1:].clone()
            collectives.all_reduce_sum(nan_count, group, "clip_grad_norm_'s all-reduce of the NaN count")
            peak = torch.nan_to_num(stats[:1], nan=0.0)
            collectives.all_reduce_max(peak, group, "clip_grad_norm_'s all-reduce of the largest gradient")
            total = torch.where(nan_count > 0, torch.full_like(peak, float("nan")), peak)[0]
        else:
            local = sum((g.to(acc).abs().pow(norm_type).sum() for g in counted), torch.zeros((), device=device, dtype=acc))
            summed = local.reshape(1).clone()
            collectives.all_reduce_sum(summed, group, "clip_grad_norm_'s all-reduce of the norm")
            total = summed[0].pow(1.0 / norm_type)
        clip = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        factors: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        for g in grads:  # offloaded gradients are host tensors while the norm is on the device: one copy per kind
            key = (g.device, g.dtype)
            if key not in factors:
                factors[key] = clip.to(device=g.device, dtype=g.dtype)
            g.mul_(factors[key])
        return total

    def _counts_in_norm(self, p: torch.Tensor, coordinate: list[int]) -> bool:
        """Whether this rank's local gradient of ``p`` is added into the norm: a part replicated
        over the shard axis (a 0-dim parameter) or over the TP axis (a parameter TP leaves whole,
        or one it does not parallelize) counts on the axis's first rank only."""
        found = self.unit_of(p)
        if found is None:  # not ours (a foreign tensor): count it as it is
            return True
        unit, i = found
        placements = unit.placements_of(unit.layout.slots[i])
        first_axis = 0 if self.tp_mesh is not None else self.dtensor_mesh.ndim - 1  # hybrid: skip the replicate axis
        return all(c == 0 for c, pl in list(zip(coordinate, placements))[first_axis:] if pl.is_replicate())

    # ---- state dicts (shardwrap/state_dict.py) ------------------------------------------------

    def mark_written(self) -> None:
        """Say that the parameters were written in place by something that bumps no version
        counter (``torch._foreach_*`` ops outside an optimizer step, writes through ``p.data`` or
        ``p.to_local()``: an EMA teacher updated so): a unit left gathered (every unit at stage
        1; at stages 2 and 3, between forwards that share one backward) then gathers again at its
        next forward instead of computing with the rows it gathered before. On a CPU the root
        finds such writes itself (``_catch_unseen_writes``), except to a parameter some rank holds
        no rows of; those, a GPU and a shard on disk need this. Local: call it on every rank, as
        the write was made."""
        for unit in self._units:
            unit.mark_written()

    def refuse_out_of_step(self, what: str) -> None:
        """Once the ranks were found out of step (a "ranks disagree" error on this rank, which
        every rank of that collective raised too), refuse ``what`` before it issues a collective:
        the ranks' sequences no longer line up, so later collectives would pair across different
        steps (a silent wrong number) or meet a collective of another size (gloo aborts the
        process) (design/notes/rank-agreement.md, "After ranks disagreed")."""
        first = self.schedule.fell_out
        if first is not None:
            raise RuntimeError(
                f"rank {collectives.rank()}: shardwrap: {what} refused: the ranks fell out of step earlier, "
                f"so the collectives they issue no longer pair up (they would meet a peer's collective of "
                f"another step, or of another size), and this ShardedModule issues none any more. End the "
                f"run on every rank, fix what made one rank run another forward or backward (or stall), and "
                f"restart from the last checkpoint. The first error was: {first}"
            )

    def check_between_steps(self, what: str) -> None:
        """Refuse ``what`` during a forward or backward, and after one that raised until the next
        forward has cleaned up; every entry point that issues collectives calls this before its
        first one (a save in an ``except`` block on one rank would otherwise pair its collectives
        with a peer's that is still inside the step: gloo aborts the process)."""
        self.refuse_out_of_step(what)
        if self._summoned is not None:
            raise _summon.refusal(what)
        if self._state is not TrainingState.IDLE or any(u.training_state is not TrainingState.IDLE for u in self._units):
            if not self._in_call and torch._C._current_graph_task_id() == -1:
                # Nothing runs: the last forward or backward raised. Not cleaned up here: a peer may
                # still be inside that step, and this call's collectives would pair with its own
                raise RuntimeError(
                    f"rank {collectives.rank()}: {what} after a forward or backward that raised before it "
                    f"finished: the next forward cleans up, on every rank, and then {what} works. Called "
                    f"now, its collectives could pair with a peer's that is still inside that step"
                )
            raise RuntimeError(f"rank {collectives.rank()}: {what} called during forward or backward; call it between steps")
        for unit in self._units:  # full views an unshard() left: what follows walks the slots
            if unit.showing_full:
                unit.show_sharded_params()
            unit.check_wrappers()

    def note_history(self) -> None:
        """Hand the schedule this model's history, which its headers carry from now on."""
        self.schedule.history = collectives.history(self._optimizer_steps, self._dropped_passes)

    def agree_on_call(self, what: str) -> None:
        """Before the collectives of a between-steps call that every rank must make (a full state
        dict, a checkpoint), one header exchange on the all-gather group, the size of every other
        header: a peer still training (at a unit's gather, a count exchange) or making another
        call meets it, and every rank raises, naming both sides, where the call's first data
        collective would have met the peer's header and gloo aborted the process (SIGABRT). A
        peer that issues nothing waits for it until the group's timeout (``CollectiveTimeout``).
        CPU groups only, as the other headers (design/notes/rank-agreement.md)."""
        group = self.schedule.group
        if group is None or collectives.group_size(group) == 1:
            return
        from shardwrap.schedule import OUT_OF_STEP_HINT, header_text, history_hint

        assert collectives.call_code(what) in collectives.CALLS, what
        mine = [collectives.HEADER_CALL, collectives.call_code(what) | self.schedule.history << collectives.HISTORY_SHIFT]
        rows = collectives.all_gather_ints(mine, group, what=f"the start of {what}", kind="headers")
        if any(row != mine for row in rows):
            names = list(self._units[0].unit_names) if self._units else None
            seen = ", ".join(f"rank {r}: {header_text(k, v, names)}" for r, (k, v) in enumerate(rows))
            raise self.schedule.out_of_step(
                f"rank {collectives.rank()}: shardwrap: ranks disagree on the next collective at the start of "
                f"{what} ({seen}).{history_hint(rows)} {what} must be called on every rank at the "
                f"same point, between steps. {OUT_OF_STEP_HINT}"
            )

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:  # type: ignore[override]
        """``{original name: DTensor(Shard(0))}`` for parameters, plain tensors for buffers.

        Built from views of the local shards: no communication.
        """
        self.check_between_steps("state_dict")
        return _sd.sharded_state_dict(self, prefix, keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load ``DTensor`` values (saved at any world size) or full tensors, by original name.

        Every key and shape is checked first, on every rank; a bad dict (on any rank) raises one
        error listing the problems on every rank and changes nothing.
        """
        self.check_between_steps("load_state_dict")
        missing, unexpected = _sd.load_sharded_or_full(self, state_dict, strict)
        return _IncompatibleKeys(missing, unexpected)

    @collectives.holds_interrupt
    def full_state_dict(self, *, rank0_only: bool = True, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
        """``{original name: full tensor}``, gathered one unit at a time.

        With ``rank0_only`` the other ranks return ``{}``. The keys are exactly those of the
        unwrapped model's ``state_dict()``, tied names and buffers included.
        """
        self.check_between_steps("full_state_dict")
        self.agree_on_call("full_state_dict")
        return _sd.full_state_dict(self, rank0_only, cpu_offload)

    @collectives.holds_interrupt
    def load_full_state_dict(self, sd: Mapping[str, Any], *, strict: bool = True) -> Any:
        """Load a full state dict that the mesh's first rank holds (the other ranks pass ``{}``),
        scattering it unit by unit. Returns ``(missing_keys, unexpected_keys)`` on every rank, as
        ``nn.Module.load_state_dict`` does; keys and shapes are checked before anything is written."""
        self.check_between_steps("load_full_state_dict")
        self.agree_on_call("load_full_state_dict")
        missing, unexpected = _sd.load_full_state_dict(self, sd, strict)
        return _IncompatibleKeys(missing, unexpected)

    @collectives.holds_interrupt
    def full_optim_state_dict(self, optimizer: torch.optim.Optimizer, *, rank0_only: bool = True) -> dict[str, Any]:
        """``optimizer.state_dict()`` as the same optimizer on the unwrapped model would give it:
        full state tensors, indexed like a plain optimizer, param_groups unchanged."""
        self.check_between_steps("full_optim_state_dict")
        self.agree_on_call("full_optim_state_dict")
        _sd.agree_on_optimizer(self, optimizer, "full_optim_state_dict")
        return _sd.full_optim_state_dict(self, optimizer, rank0_only)

    @collectives.holds_interrupt
    def load_full_optim_state_dict(self, optimizer: torch.optim.Optimizer, osd: Mapping[str, Any]) -> None:
        """Load a full optimizer state dict held by the mesh's first rank, at any world size."""
        self.check_between_steps("load_full_optim_state_dict")
        self.agree_on_call("load_full_optim_state_dict")
        _sd.load_full_optim_state_dict(self, optimizer, osd)

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Optimizer state as ``DTensor(Shard(0))`` keyed by original parameter name, for
        ``torch.distributed.checkpoint``."""
        self.check_between_steps("sharded_optim_state_dict")
        return _sd.sharded_optim_state_dict(self, optimizer)

    def load_sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer, osd: Mapping[str, Any]) -> None:
        """Load what ``sharded_optim_state_dict`` gave, resharding when the world size differs."""
        self.check_between_steps("load_sharded_optim_state_dict")
        _sd.load_sharded_optim_state_dict(self, optimizer, osd)
