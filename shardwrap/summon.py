"""Every parameter as a full tensor between steps: FSDP1's ``summon_full_params`` and
DeepSpeed's ``GatheredParameters`` [design/notes/summon-full-params.md].

Inside the context each summoned parameter's module slot holds a plain ``nn.Parameter`` with the
full fp32 value (the master weights, not a ``param_dtype`` copy), so ``model.named_parameters()``,
``model.lm_head.weight`` and code that edits weights in place see what the unwrapped model would.
On leaving, the full values are written back into the shards (``writeback``): each rank writes its
own rows from its own copy, after checking that every rank's copy holds the same bits, or, with
``modifier_rank``, from that rank's copy. Then the slots get the sharded parameters back.

No forward, backward or optimizer step runs inside: the units would gather their shards over the
full values, and a step would be overwritten by the writeback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn as nn
import xxhash
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from shardwrap import collectives
from shardwrap import state_dict as _sd

if TYPE_CHECKING:
    from shardwrap.sharded_module import ShardedModule
    from shardwrap.unit import Unit

_SHOWN = 5  # parameters named in one error; the count gives the rest

# The full copies that closed contexts put in the slots -> their names: an optimizer built from
# model.parameters() inside the context holds them, and its step is refused (sharded_module.py).
COPIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclasses.dataclass
class Summoned:
    """An open ``summon_full_params``: which parameters are in the slots, and what leaving does."""

    fulls: list[tuple[Unit, int, nn.Parameter]]  # (unit, parameter index, the full parameter in its slots)
    grads: list[int | None]  # each copy's gradient as shown: a digest, or None
    writeback: bool
    modifier_rank: int | None


def refusal(what: str) -> RuntimeError:
    return RuntimeError(
        f"rank {collectives.rank()}: shardwrap: {what} inside summon_full_params(): the module slots hold "
        f"full copies of the parameters until the context ends (a forward would gather the shards over "
        f"them, and a step would be overwritten by the write-back). Leave the context first; the wrapped "
        f"model's own forward and generate() gather what they need"
    )


def _check_args(model: ShardedModule, recurse: object, writeback: object, rank0_only: object,
                offload_to_cpu: object, with_grads: object, modifier_rank: object) -> int | None:
    """Refuse a bad option before anything happens; returns ``modifier_rank`` as an int."""
    flags = {"recurse": recurse, "writeback": writeback, "rank0_only": rank0_only,
             "offload_to_cpu": offload_to_cpu, "with_grads": with_grads}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"summon_full_params: {name} should be a bool, got {type(value).__name__} ({value!r})")
    world = collectives.group_size(model.world_group)
    if modifier_rank is not None:
        try:
            index = None if isinstance(modifier_rank, bool) else operator.index(modifier_rank)  # type: ignore[arg-type]
        except TypeError:
            index = None
        if index is None or not 0 <= index < world:
            raise ValueError(f"summon_full_params: modifier_rank should be None or a rank in 0..{world - 1}, got {modifier_rank!r}")
        modifier_rank = index
    if rank0_only and writeback:
        raise ValueError(
            "summon_full_params: rank0_only=True with writeback=True: only rank 0 would hold the full "
            "parameters, so no other rank has its rows to write back (FSDP1 refuses it too). Pass "
            "writeback=False to read on rank 0, or rank0_only=False to edit (every rank alike, or on one "
            "rank with modifier_rank=r)"
        )
    if modifier_rank is not None and not writeback:
        raise ValueError(
            f"summon_full_params: modifier_rank={modifier_rank} with writeback=False: nothing is written "
            f"back, so no rank's edits are kept. Drop modifier_rank, or pass writeback=True"
        )
    if modifier_rank is not None and rank0_only:
        raise ValueError("summon_full_params: modifier_rank with rank0_only=True: drop one of them")
    return modifier_rank  # type: ignore[return-value]


def _check_state(model: ShardedModule, units: list[Unit], with_grads: bool) -> None:
    if model._summoned is not None:
        raise RuntimeError(
            f"rank {collectives.rank()}: summon_full_params() inside another summon_full_params() of "
            f"the same model: leave the first context, then open one with the options you need"
        )
    model.check_between_steps("summon_full_params()")
    if model.backward_owed:
        raise RuntimeError(
            f"rank {collectives.rank()}: summon_full_params() between a forward and its backward: the "
            f"backward reads the parameters as that forward gathered them. Call it after the backward "
            f"(or before the forward)"
        )
    if with_grads:
        waiting = [u.name for u in units if not u.grad_settled]
        if waiting:
            raise RuntimeError(
                f"rank {collectives.rank()}: summon_full_params(with_grads=True) while unit(s) "
                f"{', '.join(repr(n) for n in waiting[:_SHOWN])} hold gradients not reduced yet (accumulated "
                f"under no_sync / set_requires_gradient_sync(False)): their full gradient does not exist "
                f"until a backward with gradient sync on reduces them. Summon after that backward"
            )


def _agree_on_grads(model: ShardedModule, units: list[Unit]) -> None:
    """Every rank must show gradients for the same parameters (one small all-gather)."""
    have = [int(p.grad is not None) for unit in units for p in unit.sharded_params]
    rows = collectives.all_gather_ints([len(have), *have], model.world_group, what="summon_full_params gradients")
    if any(row != rows[0] for row in rows):
        raise RuntimeError(
            f"rank {collectives.rank()}: summon_full_params(with_grads=True): the ranks hold gradients for "
            f"different parameters (counts by rank: {[sum(row[1:]) for row in rows]}). A gradient set by hand "
            f"on one rank only, or zero_grad() on some ranks: make them alike on every rank first"
        )


def _full_grads(unit: Unit) -> list[torch.Tensor | None]:
    """Each parameter's full gradient (None where it has none): this rank's gradient chunks laid
    out like the shard, then one all-gather for the unit (``Unit.gather_full``)."""
    params = unit.sharded_params
    if all(p.grad is None for p in params):
        return [None] * len(params)
    flat = torch.zeros(unit.layout.shard_numel + 1, dtype=unit.dtype, device=unit.device)
    with torch.no_grad():
        for p, view in zip(params, unit.layout.sharded_views(flat, unit.rank)):
            if p.grad is not None:
                view.copy_(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    return [full if p.grad is not None else None for p, full in zip(params, unit.gather_full(flat))]


@collectives.holds_interrupt
def enter(model: ShardedModule, units: list[Unit], recurse: bool, writeback: bool, rank0_only: bool,
          offload_to_cpu: bool, with_grads: bool, modifier_rank: int | None) -> Summoned:
    """Gather the parameters of ``units`` and put full copies in their slots; nothing else changes."""
    modifier_rank = _check_args(model, recurse, writeback, rank0_only, offload_to_cpu, with_grads, modifier_rank)
    _check_state(model, units, with_grads)
    model.agree_on_call("summon_full_params")
    if with_grads:
        _agree_on_grads(model, units)
    keep = not rank0_only or model.world_rank == 0
    fulls: list[tuple[Unit, int, nn.Parameter]] = []
    for unit in units:
        values = unit.gather_full()  # every rank takes part, in the same order
        grads = _full_grads(unit) if with_grads else [None] * len(values)
        if not keep:
            continue
        for i, (param, value, grad) in enumerate(zip(unit.sharded_params, values, grads)):
            full = nn.Parameter(value.cpu() if offload_to_cpu else value, requires_grad=param.requires_grad)
            if grad is not None:
                full.grad = grad.cpu() if offload_to_cpu else grad
            fulls.append((unit, i, full))
    shown = [_digest(full.grad) if full.grad is not None else None for _, _, full in fulls]
    summoned = Summoned(fulls, shown, writeback, modifier_rank)
    for unit, i, full in fulls:
        for module, attr in unit.slots[i]:
            module._parameters[attr] = full
    model._summoned = summoned
    return summoned


def _digest(t: torch.Tensor) -> int:
    """63 bits of a hash of ``t``'s bytes: equal tensors give equal digests on every rank."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(data.data) >> 1


def _local_problems(summoned: Summoned) -> list[str]:
    """What makes a full parameter impossible to write back: it left its slot, or its shape or
    dtype changed (``p.data = t``); and a gradient changed, which nothing would write back."""
    problems = []
    for (unit, i, full), shown in zip(summoned.fulls, summoned.grads):
        if (None if full.grad is None else _digest(full.grad)) != shown:
            problems.append(
                f"the gradient of '{unit.layout.slots[i].fqn}' was changed inside the context (zero_grad, "
                f"clipping or a write on the copies): the copies' gradients are read-only; change the "
                f"gradients of model.parameters() outside the context (torch.nn.utils.clip_grad_norm_, "
                f"opt.zero_grad())"
            )
        slot = unit.layout.slots[i]
        for module, attr in unit.slots[i]:
            if module._parameters.get(attr) is not full:
                problems.append(
                    f"'{slot.fqn}' was replaced ({type(module).__name__}.{attr} = ...): edit the full "
                    f"parameter in place instead (p.copy_(...) under torch.no_grad())"
                )
                break
        else:
            param = unit.sharded_params[i]  # global shape (with tensor parallelism: over both axes)
            if full.shape != param.shape or full.dtype != param.dtype:
                problems.append(
                    f"'{slot.fqn}' is now {full.dtype} {tuple(full.shape)}, not {param.dtype} {tuple(param.shape)} "
                    f"(p.data = t): a sharded parameter keeps its shape and dtype; write values of that shape in place"
                )
    return problems


def _agree_to_write(model: ShardedModule, summoned: Summoned, raised: bool) -> None:
    """Every rank's verdict on leaving with write-back, the same on every rank: one small
    all-gather of (raised, problems found, digests), then the problems' text only if some has any.
    Raises (on every rank) unless all may write."""
    problems = [] if raised else _local_problems(summoned)
    digests = [0] * len(summoned.fulls)
    if summoned.modifier_rank is None and not raised and not problems:
        digests = [(_digest(full) & ~1) | int(full.requires_grad) for _, _, full in summoned.fulls]
    rows = collectives.all_gather_ints([int(raised), len(problems), *digests], model.world_group, what="summon_full_params write-back")
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        if raised:
            return  # this rank's own exception goes on
        raise RuntimeError(
            f"rank {collectives.rank()}: summon_full_params(): rank(s) {failed} raised inside the context, "
            f"so nothing was written back on any rank; the model holds the values it had before"
        )
    if any(row[1] for row in rows):
        _sd._raise_problems("summon_full_params write-back", _sd.agreed_problems(model, problems),
                            "The model holds the values it had before the context")
    if summoned.modifier_rank is None:
        differ = [summoned.fulls[k][0].layout.slots[summoned.fulls[k][1]].fqn
                  for k in range(len(summoned.fulls)) if any(row[2 + k] != rows[0][2 + k] for row in rows)]
        if differ:
            shown = ", ".join(repr(n) for n in differ[:_SHOWN]) + (f" and {len(differ) - _SHOWN} more" if len(differ) > _SHOWN else "")
            raise ValueError(
                f"summon_full_params write-back: {len(differ)} parameter(s) differ between ranks (values or "
                f"requires_grad): {shown}. Each rank writes its own rows back, so an edit made on some ranks only "
                f"would be kept in part. "
                f"Make the same edit on every rank, or pass modifier_rank=r to keep rank r's values. Nothing "
                f"was written back; the model holds the values it had before the context"
            )


def _keep_requires_grad(summoned: Summoned) -> None:
    """A copy frozen or unfrozen inside the context: its parameter follows, as the original
    parameter object under FSDP1 would (shardwrap honours freezing after wrapping)."""
    for unit, i, full in summoned.fulls:
        param = unit.sharded_params[i]
        if full.requires_grad != param.requires_grad:
            param.requires_grad_(full.requires_grad)


def leave(model: ShardedModule, summoned: Summoned, raised: bool) -> None:
    """Write back (every rank agreeing first), then give the slots their sharded parameters back,
    whatever happened."""
    try:
        if not summoned.writeback:  # nothing done inside is kept
            problems = [] if raised else _local_problems(summoned)  # local: no collective follows
            if problems:
                _sd._raise_problems("summon_full_params", problems, "The model holds the values it had before the context")
            return
        _agree_to_write(model, summoned, raised)
        if raised:
            return
        fulls = [full for _, _, full in summoned.fulls]
        if summoned.modifier_rank is not None:
            flags = torch.tensor([int(full.requires_grad) for full in fulls], dtype=torch.int64)
            with torch.no_grad():
                collectives.broadcast_tensors([*fulls, flags], model.world_group, group_src=summoned.modifier_rank)
            for full, flag in zip(fulls, flags.tolist()):
                full.requires_grad_(bool(flag))
        _keep_requires_grad(summoned)
        writes = [(unit.local_param(i), _sd._local_chunk(full.detach(), unit.layout.slots[i], model))
                  for unit, i, full in summoned.fulls]
        _sd.commit_writes(model, writes)
    finally:
        for unit, i, full in summoned.fulls:
            COPIES[full] = unit.layout.slots[i].fqn
        for unit in {id(u): u for u, _, _ in summoned.fulls}.values():
            unit._install_sharded_params()
        model._summoned = None


@contextlib.contextmanager
def summon_full_params(model: ShardedModule, units: list[Unit], recurse: bool, writeback: bool, rank0_only: bool,
                       offload_to_cpu: bool, with_grads: bool, modifier_rank: int | None) -> Iterator[None]:
    """The context behind ``FullyShardMethods.summon_full_params``, over ``units``."""
    summoned = enter(model, units, recurse, writeback, rank0_only, offload_to_cpu, with_grads, modifier_rank)
    raised = True
    try:
        yield
        raised = False
    finally:
        leave(model, summoned, raised)
