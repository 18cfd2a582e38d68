"""State dicts: how the flat shards map to ``{original name: tensor}`` and back, for the model and
for the optimizer (design/notes/state-dicts.md).

Every function here takes the ``ShardedModule`` and works unit by unit. Loads validate
everything first, agree on the verdict across ranks, and raise one error that lists the problems
(the first offending keys, with both shapes) on every rank before any tensor is written.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, cast

import torch
from torch.distributed.tensor import DTensor

from shardwrap import agreement, collectives, local_step
from shardwrap.flat_param import ParamSlot
from shardwrap.unit import local_of

if TYPE_CHECKING:
    from shardwrap.unit import Unit
    from shardwrap.sharded_module import ShardedModule


def _is_param_state(key: str, value: Any, slot: ParamSlot) -> bool:
    """Whether an optimizer state entry is laid out like its parameter (momentum, Adam's moments),
    and so sharded like it. ``step`` is the one scalar torch's optimizers keep per parameter;
    torch's own ``Optimizer.load_state_dict`` singles it out the same way."""
    return isinstance(value, torch.Tensor) and key != "step" and tuple(value.shape) == tuple(slot.full_shape)


def as_dtensor(local: torch.Tensor, slot: ParamSlot, model: "ShardedModule") -> DTensor:
    """``local`` (this rank's chunk of something shaped like the parameter of ``slot``) as a
    DTensor placed like that parameter."""
    return model.units[0].as_dtensor(local, slot)  # every unit places alike: the mesh's placements


def _local_chunk(value: torch.Tensor, slot: ParamSlot, model: "ShardedModule") -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of a full tensor or of a DTensor saved at any W or mesh
    (with tensor parallelism: the piece of this rank's TP shard)."""
    unit = model.units[0]  # every unit places alike
    if isinstance(value, DTensor):
        local = value.to_local()
        same_split = value.device_mesh.shape == unit.dtensor_mesh.shape and value.placements == unit.placements_of(slot)
        if same_split and tuple(local.shape) == slot.sharded_shape(model.shard_rank):
            return local
        if local.device.type != value.device_mesh.device_type:  # an offloaded model's host shard
            value = cast(DTensor, value.to(value.device_mesh.device_type))  # its group may carry no host tensor (NCCL)
        value = value.full_tensor()
    if slot.tp is not None:
        value = slot.tp.local_of(value)
    if slot.replicated:
        return value.reshape(())
    rank = model.shard_rank
    full = value.reshape(slot.dim0, slot.inner)
    return full.narrow(0, slot.first_row(rank), slot.local_rows(rank)).reshape(slot.sharded_shape(rank))


_SHOWN = 5  # keys named in one error; the count gives the rest


def listed(keys: Sequence[Any]) -> str:
    """``['a', 'b']``, or the first ``_SHOWN`` keys and how many there are in all."""
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return f"[{shown}]" if len(keys) <= _SHOWN else f"[{shown}, ...] ({len(keys)} in all)"


def shapes_of(sd: Mapping[str, Any]) -> dict[str, tuple[int, ...] | str]:
    """Each value's shape (a DTensor's global shape), or its type's name when it is no tensor."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for k, v in sd.items()}


def key_problems(
    found: Mapping[str, tuple[int, ...] | str], expected: Mapping[str, tuple[int, ...]], strict: bool, source: str = "checkpoint"
) -> list[str]:
    """What keeps ``found`` (key -> shape, or the type name of a non-tensor) from loading into a
    model whose state dict has ``expected`` shapes: missing and unexpected keys (when strict) and
    the first shape mismatches, each with both shapes."""
    problems = []
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    mismatched = [k for k in expected if k in found and found[k] != expected[k]]
    if strict and missing:
        problems.append(f"missing keys {listed(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected keys {listed(unexpected)}")
    for k in mismatched[:_SHOWN]:
        got = found[k]
        if isinstance(got, str):
            problems.append(f"'{k}' is a {got}, not a tensor")
        else:
            problems.append(f"shape mismatch for '{k}': {source} {got} vs model {expected[k]}")
    if len(mismatched) > _SHOWN:
        problems.append(f"{len(mismatched) - _SHOWN} more shape mismatches")
    return problems


def _problems(sd: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], strict: bool) -> list[str]:
    return key_problems(shapes_of(sd), expected, strict) + foreign_shard_problems(sd) + meta_problems(sd, expected)


def meta_problems(sd: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """Values on the meta device, which hold no data to load (torch's copy failed with "Cannot copy
    out of meta tensor; no data!", naming no key)."""
    meta = [k for k, v in sd.items() if k in expected and isinstance(v, torch.Tensor) and v.is_meta]
    if not meta:
        return []
    return [f"values {listed(meta)} are on the meta device and hold no data (materialize them first, e.g. load the checkpoint they came from)"]


def saved_on_another_rank(value: DTensor) -> int | None:
    """The rank that saved ``value``, where that is not this process and ``value`` holds a shard.

    A pickled DTensor keeps its mesh's rank and coordinate: ``torch.save(model.state_dict())`` on
    rank 0 alone, then ``torch.load`` on every rank (accelerate's ``save_state``/``load_state`` with
    the model registered), gives every rank a DTensor that says it is rank 0's shard. Loaded as this
    rank's shard it trains silently on another rank's values (``fully_shard`` too). A replicated
    value is whole on every rank, so it is fine wherever it was saved."""
    mesh = value.device_mesh
    split = [d for d, p in enumerate(value.placements) if not p.is_replicate() and mesh.size(d) > 1]
    if not split:  # replicated, or sharded over one rank: the whole value wherever it was saved
        return None
    said = mesh.get_coordinate()
    here = (mesh.mesh == collectives.rank()).nonzero()
    actual = tuple(here[0].tolist()) if len(here) else None
    if said is None or (actual is not None and all(said[d] == actual[d] for d in split)):
        return None  # a hybrid mesh's replicas hold the same shards: only the sharded dimensions count
    return int(mesh.mesh[tuple(said)].item())


def foreign_shard_problems(sd: Mapping[str, Any], what: str = "state dict") -> list[str]:
    foreign = {k: r for k, v in sd.items() if isinstance(v, DTensor) and (r := saved_on_another_rank(v)) is not None}
    if not foreign:
        return []
    saver = next(iter(foreign.values()))
    return [
        f"the {what}'s DTensors {listed(list(foreign))} are rank {saver}'s shards, loaded on rank {collectives.rank()} "
        f"(torch.save(model.state_dict()) on one rank, then torch.load on every rank, as accelerate's save_state "
        f"does with the model registered): every rank would train on rank {saver}'s values. Save with "
        f"shardwrap.save_checkpoint or torch.distributed.checkpoint (each rank writes its own shards), or save "
        f"model.full_state_dict() (full tensors load on every rank)"
    ]


def agreed_problems(model: "ShardedModule", problems: list[str]) -> list[str]:
    """Every rank's problems, the same list on every rank (one object all-gather), so that all
    ranks raise together or none does. Problems only some ranks found name those ranks."""
    per_rank = collectives.all_gather_object(problems, model.world_group)
    if all(p == per_rank[0] for p in per_rank):
        return list(per_rank[0])
    return [f"rank {r}: {p}" for r, rank_problems in enumerate(per_rank) for p in rank_problems]


def _raise_problems(what: str, problems: list[str], hint: str = "") -> None:
    if problems:
        message = f"{what}: {len(problems)} problem(s), nothing was loaded: " + "; ".join(problems)
        raise ValueError(message + (f". {hint}" if hint else ""))


# ---- model: sharded ---------------------------------------------------------------------------


def sharded_state_dict(model: "ShardedModule", prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
    for unit in model.units:
        unit.mark_written()
    out: dict[str, Any] = {}
    for key, value in model.module.state_dict(prefix=prefix, keep_vars=True).items():
        found = model.unit_of(value)
        if found is None:
            out[key] = value if keep_vars else value.detach()
        else:
            out[key] = value if keep_vars else value.detach()  # a DTensor over a view of the shard
    return out


def expected_shapes(model: "ShardedModule") -> dict[str, tuple[int, ...]]:
    shapes = {}
    for key, value in model.module.state_dict(keep_vars=True).items():
        found = model.unit_of(value)
        shapes[key] = tuple(found[0].layout.slots[found[1]].full_shape) if found else tuple(value.shape)
    return shapes


def load_sharded_or_full(model: "ShardedModule", sd: Mapping[str, Any], strict: bool) -> tuple[list[str], list[str]]:
    """Load DTensor (any world size) or full values; every rank passes its own dict. Every rank's
    verdict is agreed on first, so all ranks raise together and nothing is written on any."""
    expected = expected_shapes(model)
    _raise_problems("load_state_dict", agreed_problems(model, _problems(sd, expected, strict)))
    commit_writes(model, model_writes(model, sd))
    return [k for k in expected if k not in sd], [k for k in sd if k not in expected]


def model_writes(model: "ShardedModule", sd: Mapping[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(destination, value)`` for every key of ``sd`` that the model has, each value converted to
    this rank's chunk (a collective when it was saved at another world size). Writes nothing:
    validate ``sd`` first, then ``commit_writes``."""
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []  # parameters: into their local views
    for key, target in model.module.state_dict(keep_vars=True).items():
        if key not in sd:
            continue
        found = model.unit_of(target)
        if found is None:
            value = sd[key].full_tensor() if isinstance(sd[key], DTensor) else sd[key]
            writes.append((target, value))
        else:
            unit, i = found
            writes.append((unit.local_param(i), _local_chunk(sd[key], unit.layout.slots[i], model)))
    return writes


def commit_writes(model: "ShardedModule", writes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    model.finish_host_copies()  # offload on a GPU: no shard copy to the device still reads what this overwrites
    with torch.no_grad():
        for target, value in writes:
            target.copy_(value)
    for unit in model.units:
        unit.mark_written()  # the local views bump no version counter: an unsharded copy is stale


# ---- model: full ------------------------------------------------------------------------------


def full_state_dict(model: "ShardedModule", rank0_only: bool, cpu_offload: bool) -> dict[str, torch.Tensor]:
    keep = not rank0_only or model.world_rank == 0
    full_by_id: dict[int, torch.Tensor] = {}
    for handle in model.units:
        fulls = handle.gather_full()
        if keep:
            for param, full in zip(handle.sharded_params, fulls):
                full_by_id[id(param)] = full.cpu() if cpu_offload else full
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, value in model.module.state_dict(keep_vars=True).items():
        gathered = full_by_id.get(id(value))
        if gathered is None:  # a buffer
            gathered = value.detach().cpu().clone() if cpu_offload else value.detach().clone()
        out[key] = gathered
    return out


def load_full_state_dict(model: "ShardedModule", sd: Mapping[str, Any], strict: bool) -> tuple[list[str], list[str]]:
    """The mesh's first rank reads ``sd`` (the others pass ``{}``); shards are scattered unit by
    unit and buffers broadcast. Every rank returns the first rank's missing and unexpected keys.
    Hybrid: the first replica's shard group scatters, then each shard is broadcast to the other
    replicas over the replicate axis."""
    group = model.world_group
    is_src = model.world_rank == 0
    verdict = None
    if is_src:
        expected = expected_shapes(model)
        verdict = (_problems(sd, expected, strict), [k for k in expected if k not in sd], [k for k in sd if k not in expected])
    problems, missing, unexpected = collectives.broadcast_object(verdict, group)
    _raise_problems("load_full_state_dict", problems, "Load it into the model it was saved from, or pass strict=False to leave out missing and unexpected keys")
    names = _names_by_id(model)
    for unit in model.units:
        if unit.tensor_parallel:
            _broadcast_unit(unit, sd, names, is_src, model)
        else:
            _scatter_unit(unit, sd, names, is_src, model)
    present = collectives.broadcast_object([k for k, _ in model.module.named_buffers() if k in sd] if is_src else None, group)
    targets = [(k, b) for k, b in model.module.named_buffers() if k in present]
    if is_src:
        with torch.no_grad():
            for key, buf in targets:
                buf.copy_(sd[key])
    collectives.broadcast_tensors([b for _, b in targets], group)
    return missing, unexpected


def _names_by_id(model: "ShardedModule") -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for key, value in model.module.state_dict(keep_vars=True).items():
        names.setdefault(id(value), []).append(key)
    return names


def _scatter_unit(handle: "Unit", sd: Mapping[str, Any], names: dict[int, list[str]], is_src: bool, model: "ShardedModule") -> None:
    layout, W, S = handle.layout, handle.world_size, handle.layout.shard_numel
    if not layout.slots:
        return
    # Parameters the dict leaves out (strict=False) keep their current values.
    keys = [next((k for k in names[id(p)] if k in sd), None) if is_src else None for p in handle.sharded_params]
    flags = collectives.broadcast_object([k is not None for k in keys] if is_src else None, model.world_group)
    current = handle.gather_full() if not all(flags) else None
    incoming = torch.empty(S + 1, dtype=handle.dtype, device=handle.device)
    pieces = None
    if is_src:
        fulls = [
            sd[k].to(handle.device, handle.dtype) if k is not None else current[i]  # type: ignore[index]
            for i, k in enumerate(keys)
        ]
        pieces = []
        for r in range(W):
            piece = torch.zeros(S + 1, dtype=handle.dtype, device=handle.device)
            layout.fill_shard_from_full(fulls, piece.narrow(0, 0, S), r)
            pieces.append(piece)
    if model.replicate_rank == 0:  # the first replica: its shard group holds the source
        collectives.scatter(incoming, pieces, handle.group)
    if model.replicate_group is not None:
        collectives.broadcast(incoming, model.replicate_group)
    handle.write_shard(incoming.narrow(0, 0, S))


def _broadcast_unit(handle: "Unit", sd: Mapping[str, Any], names: dict[int, list[str]], is_src: bool, model: "ShardedModule") -> None:
    """With tensor parallelism the ranks' shards differ along two axes, so the first rank
    broadcasts the unit's full tensors (one unit's worth at a time) and every rank cuts its own
    piece: its TP shard, then its row-chunk of that."""
    layout = handle.layout
    if not layout.slots:
        return
    keys = [next((k for k in names[id(p)] if k in sd), None) if is_src else None for p in handle.sharded_params]
    flags = collectives.broadcast_object([k is not None for k in keys] if is_src else None, model.world_group)
    current = handle.gather_full() if not all(flags) else None
    fulls = []
    for i, (slot, given) in enumerate(zip(layout.slots, flags)):
        if not given:  # left out (strict=False): keeps its current value
            fulls.append(current[i])  # type: ignore[index]
            continue
        full = torch.empty(slot.full_shape, dtype=handle.dtype, device=handle.device)
        if is_src:
            full.copy_(sd[keys[i]])  # type: ignore[index]
        fulls.append(full)
    collectives.broadcast_tensors([f for f, given in zip(fulls, flags) if given], model.world_group)
    shard = torch.empty(layout.shard_numel, dtype=handle.dtype, device=handle.device)
    local = [s.tp.local_of(f) if s.tp is not None else f for s, f in zip(layout.slots, fulls)]
    layout.fill_shard_from_full(local, shard, handle.rank)
    handle.write_shard(shard)


# ---- optimizer --------------------------------------------------------------------------------


def _opt_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    local_step.settle(opt)  # a step that raised left its stand-ins in the groups
    return [p for group in opt.param_groups for p in group["params"]]


def _slot_of(model: "ShardedModule", param: torch.Tensor) -> tuple["Unit", int]:
    found = model.unit_of(param)
    if found is None:
        raise ValueError(
            "the optimizer holds a tensor that is not a parameter of this ShardedModule; build it "
            "from model.parameters() after wrapping"
        )
    return found


def _is_sharded_state(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def full_optim_state_dict(model: "ShardedModule", opt: torch.optim.Optimizer, rank0_only: bool) -> dict[str, Any]:
    keep = not rank0_only or model.world_rank == 0
    params = _opt_params(opt)
    osd = opt.state_dict()
    index_of = {id(p): i for i, p in enumerate(params)}
    fulls: dict[tuple[int, str], torch.Tensor] = {}
    for handle in model.units:  # one all-gather per unit and state key
        members = [(i, p) for i, p in enumerate(handle.sharded_params) if id(p) in index_of]
        keys = sorted({k for _, p in members for k, v in opt.state.get(p, {}).items() if _is_sharded_state(v, p)})
        for key in keys:
            flat = torch.zeros(handle.layout.shard_numel + 1, dtype=torch.float32, device=handle.device)
            owners = []
            for i, p in members:
                value = opt.state.get(p, {}).get(key)
                if _is_sharded_state(value, p):
                    slot = handle.layout.slots[i]
                    local = local_of(value)
                    flat.narrow(0, slot.shard_offset, local.numel()).copy_(local.reshape(-1))
                    owners.append((i, p, value.dtype))
            gathered = handle.gather_full(flat)
            for i, p, dtype in owners:
                fulls[(index_of[id(p)], key)] = gathered[i].to(dtype).cpu()
    if not keep:
        return {}
    state = {  # what is left besides the gathered states is replicated: its local value is the full one
        idx: {k: fulls.get((idx, k), local_of(v).cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
        for idx, entry in osd["state"].items()
    }
    return {"state": state, "param_groups": osd["param_groups"]}


def load_full_optim_state_dict(model: "ShardedModule", opt: torch.optim.Optimizer, osd: Mapping[str, Any]) -> None:
    osd = collectives.broadcast_object(osd if model.world_rank == 0 else None, model.world_group)  # the whole dict at once
    # Every rank holds the same dict now, so every rank reaches the same verdict.
    _raise_problems("load_full_optim_state_dict", full_optim_problems(model, opt, osd), _OPTIM_HINT)
    params = _opt_params(opt)
    state = {}
    for idx, entry in osd["state"].items():
        handle, i = _slot_of(model, params[int(idx)])
        slot = handle.layout.slots[i]
        state[int(idx)] = {
            k: handle.as_dtensor(_local_chunk(v, slot, model).clone(), slot) if _is_param_state(k, v, slot) else v
            for k, v in entry.items()
        }
    opt.load_state_dict({"state": state, "param_groups": osd["param_groups"]})


_OPTIM_HINT = "Build the optimizer with the parameter groups it was saved with"


def _well_formed(osd: Any) -> str | None:
    if not isinstance(osd, Mapping) or not isinstance(osd.get("state"), Mapping) or not isinstance(osd.get("param_groups"), list):
        return "no optimizer state (a dict with 'state' and 'param_groups'); pass optimizer=None to load the model alone"
    if not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in osd["param_groups"]):
        return "param_groups that are not dicts with a 'params' list"
    return None


def group_problems(saved: list[list[str]], live: list[list[str]]) -> list[str]:
    """How the saved parameter groups (by name) differ from the optimizer's: the group count, then
    for each group the parameters only one side has."""
    if len(saved) != len(live):
        return [
            f"the checkpoint's optimizer has {len(saved)} param group(s) of {[len(g) for g in saved]} parameters, "
            f"this optimizer {len(live)} of {[len(g) for g in live]}"
        ]
    problems = []
    for i, (s, mine) in enumerate(zip(saved, live)):
        if len(s) == len(mine) and set(s) == set(mine):
            continue
        message = f"param group {i} holds {len(s)} parameters in the checkpoint, {len(mine)} in this optimizer"
        only_saved, only_live = [p for p in s if p not in mine], [p for p in mine if p not in s]
        if only_saved:
            message += f"; only in the checkpoint's: {listed(only_saved)}"
        if only_live:
            message += f"; only in this optimizer's: {listed(only_live)}"
        problems.append(message)
    return problems


def _state_shape_problems(state: Mapping[Any, Any], shape_of: Callable[[Any], tuple[int, ...]], name: Callable[[Any], str]) -> list[str]:
    problems = []
    for key, entry in state.items():
        shape = shape_of(key)
        for k, v in (entry.items() if isinstance(entry, Mapping) else []):
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != shape:
                problems.append(f"shape mismatch for optimizer state {name(key)}.{k}: checkpoint {tuple(v.shape)} vs parameter {shape}")
    return problems


def coverage_problems(
    opt: torch.optim.Optimizer, saved_groups: Sequence[Mapping[str, Any]], saved: Mapping[Any, Any], key_of: Callable[[int], Any], name: Callable[[Any], str]
) -> list[str]:
    """Saved optimizer state the next ``step()`` could not use, which torch's ``load_state_dict``
    takes as it is (the step then raises ``KeyError``): an entry that lacks a key the first step
    of this optimizer makes under the saved group's options (found on a one-element copy, so a
    checkpoint saved without ``amsgrad`` loads into an optimizer built with it, as torch loads
    it). ``saved`` maps each entry's key (``key_of(position)``: a parameter's name or index) to its
    state keys; call it once the groups pair up. A missing entry is no problem: the load restores
    the saved state, in which that parameter (one that had no gradient yet) has none. An entry
    that shares no key with what is needed was saved by another kind of optimizer, which
    ``kind_problems`` names. Only torch's own optimizers are probed."""
    if not type(opt).__module__.startswith("torch.optim"):
        return []
    problems: list[str] = []
    cache: dict[tuple[int, int], set[str] | None] = {}
    position = 0
    for g, (group, saved_group) in enumerate(zip(opt.param_groups, saved_groups)):
        for p in group["params"]:
            key, position = key_of(position), position + 1
            keys = saved.get(key)
            if keys is None:
                continue
            need = _first_step_keys(opt, saved_group, g, p.dim(), cache)
            if need is not None and need - set(keys) and need & set(keys):
                problems.append(f"optimizer state for {name(key)} lacks {sorted(need - set(keys))}, which {type(opt).__name__}'s step needs")
    return problems


def _first_step_keys(opt: torch.optim.Optimizer, options: Mapping[str, Any], g: int, dim: int, cache: dict[tuple[int, int], set[str] | None]) -> set[str] | None:
    """The state keys one step of ``opt``'s kind makes for a parameter of ``dim`` dimensions under
    the param group ``options`` (a zero gradient on a one-element copy, with torch's global
    optimizer hooks held back; ``opt`` is not touched), or None where it cannot be built so."""
    if (g, dim) not in cache:
        state = _probe_step(opt, options, dim)
        cache[(g, dim)] = None if state is None else set(state)
    return cache[(g, dim)]


class _StateMade(Exception):
    """Raised by a probe's ``_init_group`` once it has made the state, before the step's update."""


def _probe_step(opt: torch.optim.Optimizer, options: Mapping[str, Any], dim: int, *, stop_at_init: bool = False) -> dict[str, Any] | None:
    """The state one step of ``opt``'s kind leaves for a one-element parameter of ``dim``
    dimensions with a zero gradient under the param group ``options`` (``stop_at_init``: the state
    its ``_init_group`` creates, the step stopped before its update), with torch's global optimizer
    hooks held back and ``opt`` not touched; None where the copy cannot run (a closure, capturable)
    or, with ``stop_at_init``, has no ``_init_group`` that makes state."""
    from torch.optim import optimizer as torch_optimizer

    hooks: tuple[Any, ...] = (torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks)
    held = [dict(h) for h in hooks]
    try:
        for h in hooks:
            h.clear()
        dummy = torch.zeros((1,) * dim, requires_grad=True)
        try:
            probe = type(opt)([dummy], **opt.defaults)
        except TypeError:  # defaults that are no constructor argument (AdamW's decoupled_weight_decay)
            probe = type(opt)([dummy])  # type: ignore[call-arg]
        probe.param_groups[0].update({k: v for k, v in options.items() if k != "params"})
        dummy.grad = torch.zeros_like(dummy)
        if stop_at_init:
            init_group = probe._init_group  # type: ignore[attr-defined]

            def stop_after(*args: Any, **kwargs: Any) -> Any:
                init_group(*args, **kwargs)
                raise _StateMade

            probe._init_group = stop_after  # type: ignore[attr-defined]
        try:
            probe.step()
        except _StateMade:
            pass
        else:
            if stop_at_init:
                return None  # a step that never made state in _init_group
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in probe.state[dummy].items()}
    except Exception:
        return None
    finally:
        for h, kept in zip(hooks, held):
            h.update(kept)


def _state_keys(state: Mapping[Any, Any]) -> dict[Any, list[str]]:
    return {k: list(v) if isinstance(v, Mapping) else [] for k, v in state.items()}


def full_optim_problems(model: "ShardedModule", opt: torch.optim.Optimizer, osd: Any) -> list[str]:
    """Every problem a full optimizer state dict (integer keys, as a plain optimizer's) has for
    ``opt``: groups of other sizes (then its indices mean other parameters, so nothing more is
    checked), state for indices the optimizer lacks, state of other shapes."""
    bad = _well_formed(osd)
    if bad:
        return [bad]
    params = _opt_params(opt)
    saved_sizes = [len(g["params"]) for g in osd["param_groups"]]
    live_sizes = [len(g["params"]) for g in opt.param_groups]
    if saved_sizes != live_sizes:
        return [
            f"the checkpoint's optimizer has {len(saved_sizes)} param group(s) of {saved_sizes} parameters, "
            f"this optimizer {len(live_sizes)} of {live_sizes} (a full optimizer state dict pairs parameters by position)"
        ]
    slots = [_slot_of(model, p) for p in params]
    fqn = [h.layout.slots[i].fqn for h, i in slots]
    outside = [k for k in osd["state"] if not (isinstance(k, int) and 0 <= k < len(params))]
    problems = [f"state for parameter indices this optimizer does not have: {listed(outside)}"] if outside else []
    problems += kind_problems(opt, osd["param_groups"])
    inside = {k: v for k, v in osd["state"].items() if k not in outside}
    shape = lambda i: tuple(slots[i][0].layout.slots[slots[i][1]].full_shape)  # noqa: E731
    problems += coverage_problems(opt, osd["param_groups"], _state_keys(inside), lambda i: i, lambda i: f"{i} ('{fqn[i]}')")
    return problems + _state_shape_problems(inside, shape, lambda i: f"{i} ('{fqn[i]}')")


def sharded_optim_state_dict(model: "ShardedModule", opt: torch.optim.Optimizer, *, template: bool = True) -> dict[str, Any]:
    """``{"state": {fqn: {key: DTensor(Shard(0)) | value}}, "param_groups": [... "params": [fqns]]}``.

    A fresh optimizer has no state yet. With ``template`` its state is created for the dict
    (``fresh_optim_state``: the values its first step starts from), so the result is a complete
    template for ``torch.distributed.checkpoint.load``, never an empty one; the optimizer itself
    stays fresh, so taking the dict changes nothing in the run. Without ``template`` (what
    ``save_checkpoint`` writes) a fresh optimizer's dict has no state, and loading it gives a fresh
    optimizer, whatever its kind."""
    params = _opt_params(opt)
    fqns = []
    for p in params:
        handle, i = _slot_of(model, p)
        fqns.append(handle.layout.slots[i].fqn)
    fresh = template and not opt.state
    osd = fresh_optim_state(opt) if fresh else opt.state_dict()
    state = {fqns[idx]: dict(entry) for idx, entry in osd["state"].items()}  # DTensor states, as the optimizer keeps them
    groups = [{**g, "params": [fqns[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def optimizer_slots(model: "ShardedModule", opt: torch.optim.Optimizer) -> dict[str, tuple[int, ParamSlot]]:
    """Each of the optimizer's parameters by original name: its position in the optimizer's
    parameter order and its slot in the unit layout."""
    index = {}
    for i, p in enumerate(_opt_params(opt)):
        handle, j = _slot_of(model, p)
        index[handle.layout.slots[j].fqn] = (i, handle.layout.slots[j])
    return index


def _group_names(model: "ShardedModule", opt: torch.optim.Optimizer) -> list[list[str]]:
    """The original names of each param group's parameters, in the group's order."""
    local_step.settle(opt)
    names = []
    for group in opt.param_groups:
        slots = [_slot_of(model, p) for p in group["params"]]
        names.append([handle.layout.slots[i].fqn for handle, i in slots])
    return names


def optimizer_description(model: "ShardedModule", opt: torch.optim.Optimizer) -> "agreement.OptimizerDescription | str":
    """What ``agreement.check_same_optimizer`` compares between ranks: the class, whether it has
    state, and each param group's parameters (original names) and options (``repr``; a tensor's
    values). A string where this rank's optimizer holds a tensor that is no parameter of ``model``."""
    try:
        names = _group_names(model, opt)
    except ValueError as exc:
        return str(exc)

    def plain(value: Any) -> Any:  # a tensor by its values: its repr names its device (cuda:0, cuda:1)
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, (tuple, list)):
            return type(value)(plain(v) for v in value)
        return value

    def shown(value: Any) -> str:
        text = repr(plain(value))
        return f"<{type(value).__qualname__}>" if " at 0x" in text else text  # an address differs per process

    groups = [(n, {k: shown(v) for k, v in g.items() if k != "params"}) for n, g in zip(names, opt.param_groups)]
    return type(opt).__qualname__, bool(opt.state), groups


def agree_on_optimizer(model: "ShardedModule", opt: torch.optim.Optimizer, what: str) -> None:
    """Every rank's ``opt`` is the same optimizer (``agreement.check_same_optimizer``), checked
    on every rank before ``what`` writes anything; one object gather, on any backend."""
    if model.world_group.size() > 1:
        agreement.check_same_optimizer(optimizer_description(model, opt), model.world_group, what)


def sharded_optim_problems(model: "ShardedModule", opt: torch.optim.Optimizer, osd: Any) -> list[str]:
    """Every problem a sharded optimizer state dict (keyed by parameter name) has for ``opt``:
    parameters it does not hold, groups that differ, state of other shapes."""
    bad = _well_formed(osd)
    if bad:
        return [bad]
    index = optimizer_slots(model, opt)
    saved = [list(g["params"]) for g in osd["param_groups"]]
    named = list(dict.fromkeys([*osd["state"], *(n for g in saved for n in g)]))
    unknown = [n for n in named if n not in index]
    problems = []
    if unknown:
        problems.append(f"optimizer state for parameters this optimizer does not hold: {listed(unknown)}")
    problems += group_problems(saved, _group_names(model, opt))
    if not problems:  # the groups pair up with the optimizer's
        problems += kind_problems(opt, osd["param_groups"])
    known = {n: e for n, e in osd["state"].items() if n in index}
    if not problems:  # the groups pair up: each parameter's name is its entry's key
        names = [n for group in _group_names(model, opt) for n in group]
        problems += coverage_problems(opt, osd["param_groups"], _state_keys(known), lambda i: names[i], lambda n: f"'{n}'")
    flat = {f"{n}.{k}": v for n, entry in known.items() if isinstance(entry, Mapping) for k, v in entry.items()}
    problems += foreign_shard_problems(flat, "optimizer state dict")
    return problems + _state_shape_problems(known, lambda n: tuple(index[n][1].full_shape), lambda n: f"'{n}'")


def kind_problems(opt: torch.optim.Optimizer, saved_groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """Options this optimizer's step reads that the saved param groups lack: a checkpoint of another
    optimizer class (SGD's groups have no ``betas``, AdamW's no ``momentum``), which torch's
    ``load_state_dict`` takes as it is (the next ``step()`` raises ``KeyError``) or fails halfway
    through, the optimizer's groups already replaced. The groups alone, with no state, are loaded
    into a shallow copy of the optimizer, so torch's defaults for options newer than the checkpoint
    apply as in a real load, and the optimizer itself is not touched. Call it once the groups are
    known to pair up (their number and sizes)."""
    groups, start = [], 0
    for saved, live in zip(saved_groups, opt.param_groups):
        groups.append({**saved, "params": list(range(start, start + len(live["params"])))})
        start += len(live["params"])
    try:
        probe = copy.copy(opt)
        probe.load_state_dict({"state": {}, "param_groups": groups})
    except Exception:  # an optimizer that cannot be probed so (its own load_state_dict): the real load decides
        return []
    name = type(opt).__name__
    problems = []
    for i, group in enumerate(probe.param_groups):
        missing = sorted(k for k in opt.defaults if k not in group)
        if missing:
            problems.append(
                f"param group {i} has no {', '.join(repr(k) for k in missing)}, which {name} needs: the checkpoint was "
                f"saved by another kind of optimizer; build the one it was saved with"
            )
    return problems


def sharded_optim_load(model: "ShardedModule", opt: torch.optim.Optimizer, osd: Mapping[str, Any], *, copy: bool = True) -> dict[str, Any]:
    """The dict for ``opt.load_state_dict``: this rank's chunk of every state tensor (a collective
    when the world size changed), each saved group's options over the optimizer's own parameters
    of that group. Call it after ``sharded_optim_problems`` found nothing; it writes nothing.
    ``copy=False`` lets the optimizer keep the given tensors (scratch copies nobody else holds)."""
    index = optimizer_slots(model, opt)
    state: dict[int, dict[str, Any]] = {}
    for name, entry in osd["state"].items():
        i, slot = index[name]
        state[i] = {}
        for k, v in entry.items():
            if _is_param_state(k, v, slot):  # sharded like its parameter: a DTensor again
                local = _local_chunk(v, slot, model)
                v = as_dtensor(local.clone() if copy else local, slot, model)
            state[i][k] = v
    # Same names in each group (checked), listed in the optimizer's own order: torch pairs the
    # saved parameters with its own by position.
    groups = [{**g, "params": [index[n][0] for n in names]} for g, names in zip(osd["param_groups"], _group_names(model, opt))]
    return {"state": state, "param_groups": groups}


def load_sharded_optim_state_dict(model: "ShardedModule", opt: torch.optim.Optimizer, osd: Mapping[str, Any]) -> None:
    problems = agreed_problems(model, sharded_optim_problems(model, opt, osd))
    _raise_problems("load_sharded_optim_state_dict", problems, _OPTIM_HINT)
    opt.load_state_dict(sharded_optim_load(model, opt, osd))


def fresh_optim_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The state dict of ``opt`` (which has no state yet) with every parameter's state as its
    first step would start from, while ``opt`` itself keeps no state and every gradient it had.

    One step at learning rate 0 on zero gradients (the real ones set aside) makes every entry
    the step would make; then the step counters go back to 0 and, for torch's optimizers, each
    value that the optimizer sets when it creates a parameter's state (NAdam's ``mu_product``,
    Rprop's ``step_size``, ASGD's ``eta`` and ``mu``) is reset to the value it is created with,
    read from a one-element copy whose ``_init_group`` stops the step before its update. An
    entry the first step makes only in its update (SGD's ``momentum_buffer``) keeps the value
    the zero-gradient step left: zero, which SGD's first step matches while ``dampening`` is 0
    (design/notes/state-dicts.md)."""
    saved_lr, saved_grads = [], {}
    for group in opt.param_groups:
        saved_lr.append(group["lr"])
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad:
                saved_grads[p] = p.grad
                p.grad = torch.zeros_like(p)
    try:
        opt.step()
    finally:
        for group, lr in zip(opt.param_groups, saved_lr):
            group["lr"] = lr
        for p, grad in saved_grads.items():
            p.grad = grad
    try:
        for g, group in enumerate(opt.param_groups):
            made = _made_with_state(opt, g)
            for p in group["params"]:
                entry = opt.state.get(p)
                if entry is not None:
                    _reset_to_made(entry, made)
        return opt.state_dict()
    finally:
        opt.state.clear()  # the optimizer stays fresh; the dict holds the tensors


def _reset_to_made(entry: dict[str, Any], made: Mapping[str, Any] | None) -> None:
    """``entry`` back to what its optimizer creates: the counters at 0, and each value ``made``
    (one element's state as created, or None where unknown) names filled with it."""
    for key, value in entry.items():
        start = (made or {}).get(key)
        if isinstance(start, torch.Tensor) and start.numel() == 1 and isinstance(value, torch.Tensor):
            value.fill_(start.reshape(()).item())
        elif start is not None and not isinstance(start, torch.Tensor):
            entry[key] = start
        elif key == "step":
            if torch.is_tensor(value):
                value.zero_()
            else:
                entry[key] = 0


def _made_with_state(opt: torch.optim.Optimizer, g: int) -> dict[str, Any] | None:
    """The state one of torch's optimizers creates for an element of param group ``g`` before its
    first update (``_probe_step`` stopped after ``_init_group``), or None for another optimizer or
    one whose copy cannot run. Every torch optimizer creates each entry with one value throughout."""
    if not type(opt).__module__.startswith("torch.optim") or not hasattr(type(opt), "_init_group"):
        return None
    return _probe_step(opt, opt.param_groups[g], 1, stop_at_init=True)


def check_full(model: "ShardedModule", opt: torch.optim.Optimizer | None, state: Mapping[str, Any]) -> list[str]:
    """Every problem a full checkpoint ``{"model": ..., "optim": ...}`` has for this model and
    optimizer, so that loading can refuse before changing either."""
    if not isinstance(state, Mapping) or not isinstance(state.get("model"), Mapping):
        return ["expected a dict with a 'model' state dict"]
    problems = _problems(state["model"], expected_shapes(model), True)
    if opt is not None:
        problems += full_optim_problems(model, opt, state.get("optim"))
    return problems
