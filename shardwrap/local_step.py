"""The optimizer step on the local shards: torch's elementwise optimizers step plain tensors.

A DTensor parameter costs one DTensor dispatch per operator per parameter in the optimizer's
per-parameter loop (torch's default on the CPU), about 3x the step on plain tensors. For an
optimizer whose update is elementwise, the update of a shard is the shard of the update, so the
step pre-hook hands it each shardwrap parameter's local tensor instead, with the gradient's and the
state's local tensors, and the post-hook puts the DTensors back. Between steps the optimizer holds
what the user gave it, and its state is DTensors (design/notes/dtensor-parameters.md, "The step on
local tensors").
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakTensorKeyDictionary

from shardwrap import collectives
from shardwrap.unit import dtensor_over

# torch's optimizers whose update reads each element of a parameter, its gradient and its state
# alone (and per-parameter scalars). Not Adafactor (row and column statistics), Muon (an
# orthogonalized matrix), LBFGS (a global line search) or SparseAdam; a subclass may override the
# math, so the type must match exactly.
ELEMENTWISE: frozenset[type] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adadelta,
})
ENABLED = True  # False: every optimizer steps the DTensors (benchmarks/optim_step.py compares the two)
# Per-parameter scalars those optimizers keep: never a shard, even for a 0-dim parameter.
SCALAR_STATE = frozenset({"step", "eta", "mu"})


@dataclass
class _Swap:
    """One optimizer's step on local tensors: what to put back."""

    groups: list[tuple[dict[str, Any], list[torch.Tensor], list[torch.Tensor]]]  # (param group, its own params list, the swapped one)
    pairs: list[tuple[DTensor, torch.Tensor, dict[str, Any]]] = field(default_factory=list)  # (param, local, state before)
    owners: list[Any] = field(default_factory=list)  # the distinct owners of the swapped parameters
    closure_running: bool = False


_SWAPS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Swap]" = weakref.WeakKeyDictionary()
_HOOKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def enter(optimizer: torch.optim.Optimizer, owner_of: Callable[[torch.Tensor], Any], kwargs: dict[str, Any], args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Step pre-hook part: swap every shardwrap parameter (one whose ``owner_of`` is not None) of
    an elementwise optimizer for its local tensor. Returns the (args, kwargs) the step should run
    with when a closure had to be wrapped."""
    leave(optimizer)  # a step that raised left its swap behind
    if not ENABLED or type(optimizer) not in ELEMENTWISE:
        return None
    owner = {id(p): owner_of(p) for group in optimizer.param_groups for p in group["params"]}
    if all(o is None for o in owner.values()) or any(
        isinstance(p, DTensor) and owner[id(p)] is None for group in optimizer.param_groups for p in group["params"]
    ):
        return None  # nothing of ours, or DTensors of another kind beside them: the DTensor path
    if optimizer not in _HOOKED:  # whoever reads or loads the state between steps sees the DTensors
        optimizer.register_state_dict_pre_hook(_leave_before_state_dict)
        optimizer.register_load_state_dict_pre_hook(_leave_before_load)
        _HOOKED.add(optimizer)
    swap = _Swap(groups=[])
    state = optimizer.state
    for group in optimizer.param_groups:
        own = group["params"]
        swapped = []
        for p in own:
            if owner[id(p)] is None:
                swapped.append(p)
                continue
            local = _local_leaf(p)
            local.grad = _local_grad(p)
            before = state.pop(p, None) or {}
            if before:
                state[local] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in before.items()}
            swap.pairs.append((p, local, before))
            swapped.append(local)
        swap.groups.append((group, own, swapped))
        group["params"] = swapped
    swap.owners = list({id(o): o for o in owner.values() if o is not None}.values())
    _SWAPS[optimizer] = swap
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        return None

    def local_closure() -> Any:
        """Forward and backward inside the step run with the DTensor parameters in the groups
        (a ``zero_grad`` in the closure, as Lightning's, must reach them); their gradients then go
        to the locals."""
        swap.closure_running = True
        for group, own, _ in swap.groups:
            group["params"] = own
        try:
            loss = closure()
        finally:
            swap.closure_running = False
            for group, _, swapped in swap.groups:
                group["params"] = swapped
        for p, local, _ in swap.pairs:
            local.grad = _local_grad(p)
        return loss

    rest = {k: v for k, v in kwargs.items() if k != "closure"}
    return (args[0],), {**rest, "closure": local_closure}


# Each parameter's stand-in, kept from step to step: a compiled step (``torch.compile(opt.step)``)
# guards on the identity of the tensors in the param groups, and a new stand-in at every step
# made it compile again at every step, until dynamo's recompile limit left it uncompiled.
_LEAVES = WeakTensorKeyDictionary()  # tensors as weak keys (weakref's own compares them with ==)


@torch._dynamo.disable(recursive=True, reason="shardwrap's step hooks run eagerly")
def _local_leaf(p: DTensor) -> torch.Tensor:
    """A leaf over ``p``'s local tensor (the same storage, offset, shape and stride: the update
    lands in the shard); the one of the last step while that still holds."""
    local = p._local_tensor
    leaf = _LEAVES.get(p)
    if (
        leaf is None
        or leaf.untyped_storage()._cdata != local.untyped_storage()._cdata
        or leaf.storage_offset() != local.storage_offset()
        or leaf.shape != local.shape
        or leaf.stride() != local.stride()
        or leaf.dtype != local.dtype
    ):
        leaf = _LEAVES[p] = local.detach()
    return leaf


def leave(optimizer: torch.optim.Optimizer) -> bool:
    """Step post-hook part (and the repair after a step that raised): the DTensor parameters back
    in the groups, the state re-keyed to them with the new state as DTensors, and every owner told
    its shard was written (``mark_written``: writes through the locals bump no DTensor's version
    counter). A ``zero_grad`` that reached the locals (after a failed step) reaches the parameters
    too. Whether there was a swap."""
    swap = _SWAPS.pop(optimizer, None)
    if swap is None:
        return False
    for group, own, _ in swap.groups:
        group["params"] = own
    state = optimizer.state
    for p, local, before in swap.pairs:
        if local.grad is None and p.grad is not None:
            p.grad = None
        local.grad = None
        now = state.pop(local, None)
        if not now:
            if before:
                state[p] = before
            continue
        state[p] = {k: _as_dtensor_like(p, local, k, v, before.get(k)) for k, v in now.items()}
    for owner in swap.owners:
        owner.mark_written()
    return True


def settle(optimizer: torch.optim.Optimizer) -> None:
    """The DTensor parameters back in ``optimizer``'s groups if a step raised (its closure, or the
    update) and left its swap behind; nothing otherwise, or while a closure runs. shardwrap's
    readers of the groups (state dicts, saves) call it: they saw the stand-ins, which are no
    parameter of the model, until the next step or forward put them back."""
    swap = _SWAPS.get(optimizer)
    if swap is not None and not swap.closure_running:
        leave(optimizer)


def _local_grad(p: DTensor) -> torch.Tensor | None:
    grad = p.grad
    return grad._local_tensor if isinstance(grad, DTensor) else grad


def _leave_before_state_dict(optimizer: torch.optim.Optimizer) -> None:
    leave(optimizer)


# Meshes of loaded optimizer state (not the parameters' own objects) that place this process where
# it is, with the placements checked on them: those states need no second look. By identity:
# meshes compare equal by their ranks alone, whatever coordinate they remember. By placements too:
# a 0-dim parameter's replicated state says nothing about the shards on the same mesh (a review).
_CHECKED_MESHES: "weakref.WeakValueDictionary[tuple[int, tuple[Any, ...]], DeviceMesh]" = weakref.WeakValueDictionary()


def refuse_another_ranks_state(optimizer: torch.optim.Optimizer, owner_of: Callable[[torch.Tensor], Any]) -> None:
    """Before the step changes anything: refuse state that is another rank's shard. torch's
    ``Optimizer.load_state_dict`` of a ``state_dict()`` that one rank saved and every rank loaded
    (accelerate's ``save_state``, or ``torch.save(opt.state_dict())`` on rank 0) gives every rank
    rank 0's moments, silently; the pickled mesh still says whose they are
    (design/notes/state-dicts.md, "Another rank's shards"). State the optimizer made itself lives
    on the parameter's own mesh and is not looked at. Raised on the ranks holding such state only:
    torch's load is no collective, so the others cannot be told; they meet the error as a lost peer
    when this rank's process ends."""
    from shardwrap.state_dict import saved_on_another_rank

    elementwise = type(optimizer) in ELEMENTWISE
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, DTensor):
                    # (torch's elementwise optimizers only: another may keep full state of its own)
                    if (elementwise and isinstance(value, torch.Tensor) and value.dim()
                            and value.shape == p.shape != p._local_tensor.shape):
                        _refuse_full_state(optimizer, owner_of, p, key)
                    continue
                mesh = value.device_mesh
                seen = (id(mesh), tuple(value.placements))
                if mesh is p.device_mesh or _CHECKED_MESHES.get(seen) is mesh:
                    continue  # every step of a run that loaded nothing ends here, with no lookup
                unit = owner_of(p)
                if unit is None:  # a DTensor of another kind (tensor parallel alone): not ours to judge
                    continue
                saver = saved_on_another_rank(value)
                if saver is None:
                    _CHECKED_MESHES[seen] = mesh
                    continue
                index = next(i for i, q in enumerate(unit.sharded_params) if q is p)  # not list.index: DTensor ==
                name = unit.layout.slots[index].fqn
                raise RuntimeError(
                    f"rank {collectives.rank()}: {type(optimizer).__name__} state '{key}' of parameter "
                    f"'{name}' is rank {saver}'s shard: the optimizer's state_dict() was saved on one rank and "
                    f"loaded on every rank (torch.save(opt.state_dict()) on rank 0, or accelerate's save_state), "
                    f"so this rank would step with rank {saver}'s moments. Nothing was stepped. Resume from "
                    f"shardwrap.save_checkpoint or torch.distributed.checkpoint, or save "
                    f"model.full_optim_state_dict(opt) and load it with model.load_full_optim_state_dict"
                )


def _refuse_full_state(optimizer: torch.optim.Optimizer, owner_of: Callable[[torch.Tensor], Any], p: DTensor, key: str) -> None:
    """State of the full parameter's shape beside a sharded parameter: the ``state_dict()`` of the
    same optimizer over the unwrapped model, loaded with torch's ``Optimizer.load_state_dict``
    (which keeps its tensors whole). The step would fail in torch's broadcasting, after updating
    the parameters before this one, or broadcast a one-row shard's state silently."""
    unit = owner_of(p)
    if unit is None:  # a DTensor of another kind: not ours to judge
        return
    index = next(i for i, q in enumerate(unit.sharded_params) if q is p)  # not list.index: DTensor ==
    raise RuntimeError(
        f"rank {collectives.rank()}: {type(optimizer).__name__} state '{key}' of parameter "
        f"'{unit.layout.slots[index].fqn}' has the full parameter's shape {tuple(p.shape)}, where this rank "
        f"holds a shard of shape {tuple(p._local_tensor.shape)}: a state_dict() of the optimizer over the "
        f"unwrapped model, loaded with optimizer.load_state_dict. Nothing was stepped. Load it with "
        f"model.load_full_optim_state_dict(optimizer, osd), which shards it (every rank may pass the "
        f"same dict), or resume from shardwrap.save_checkpoint or torch.distributed.checkpoint"
    )


def _leave_before_load(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    leave(optimizer)


def restore_failed_steps() -> None:
    """Put back the swap of every optimizer whose step raised (called from the root's first
    pre-forward, so a new backward never accumulates into gradients the optimizer no longer
    sees); a closure running inside a step is left alone."""
    for optimizer, swap in list(_SWAPS.items()):
        if not swap.closure_running:
            leave(optimizer)


def _as_dtensor_like(p: DTensor, local: torch.Tensor, key: str, value: Any, old: Any) -> Any:
    if isinstance(old, DTensor) and old._local_tensor is value:
        return old  # updated in place: the same DTensor
    if not isinstance(value, torch.Tensor) or key in SCALAR_STATE or value.shape != local.shape:
        return value
    return dtensor_over(value, p.device_mesh, p.placements, p.shape, p.stride())
