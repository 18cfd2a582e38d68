"""State dicts: how the flat shards map to ``{original name: tensor}`` and back, for the model and
for the optimizer (design/notes/state-dicts.md).

Every function here takes the ``ShardedModule`` and works unit by unit. Loads validate
everything first and raise one error that lists every problem before any tensor is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardwrap import collectives
from shardwrap.flat_param import ParamSlot
from shardwrap.unit import local_of

if TYPE_CHECKING:
    from shardwrap.unit import Unit
    from shardwrap.sharded_module import ShardedModule


def _is_param_state(key: str, value: Any, slot: ParamSlot) -> bool:
    """Whether an optimizer state entry is laid out like its parameter (momentum, Adam's moments),
    and so sharded like it. ``step`` is the one scalar torch's optimizers keep per parameter;
    torch's own ``Optimizer.load_state_dict`` singles it out the same way."""
    return isinstance(value, torch.Tensor) and key != "step" and tuple(value.shape) == tuple(slot.shape)


def _local_chunk(value: torch.Tensor, slot: ParamSlot, rank: int) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of a full tensor or of a DTensor saved at any W."""
    if slot.replicated:
        return (value.full_tensor() if isinstance(value, DTensor) else value).reshape(())
    if isinstance(value, DTensor):
        local = value.to_local()
        if value.placements == (Shard(0),) and tuple(local.shape) == slot.sharded_shape(rank):
            same_split = value.device_mesh.size() == collectives.world_size()
            if same_split:
                return local
        value = value.full_tensor()
    full = value.reshape(slot.dim0, slot.inner)
    return full.narrow(0, slot.first_row(rank), slot.local_rows(rank)).reshape(slot.sharded_shape(rank))


def _shape_of(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _problems(sd: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], strict: bool) -> list[str]:
    problems = []
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if strict and missing:
        problems.append(f"missing keys {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for key, shape in expected.items():
        if key in sd:
            got = _shape_of(sd[key])
            if not isinstance(sd[key], torch.Tensor):
                problems.append(f"'{key}' is a {type(sd[key]).__name__}, not a tensor")
            elif got != shape:
                problems.append(f"shape mismatch for '{key}': checkpoint {got} vs model {shape}")
    return problems


def _raise_problems(what: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"{what}: {len(problems)} problem(s), nothing was loaded: " + "; ".join(problems))


# ---- model: sharded ---------------------------------------------------------------------------


def sharded_state_dict(model: "ShardedModule", prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
    for unit in model.units:
        unit.lend_views()
    out: dict[str, Any] = {}
    for key, value in model.module.state_dict(prefix=prefix, keep_vars=True).items():
        found = model.unit_of(value)
        if found is None:
            out[key] = value if keep_vars else value.detach()
        else:
            out[key] = value if keep_vars else value.detach()  # a DTensor over a view of the shard
    return out


def _expected_shapes(model: "ShardedModule") -> dict[str, tuple[int, ...]]:
    shapes = {}
    for key, value in model.module.state_dict(keep_vars=True).items():
        found = model.unit_of(value)
        shapes[key] = tuple(found[0].layout.slots[found[1]].shape) if found else tuple(value.shape)
    return shapes


def load_sharded_or_full(model: "ShardedModule", sd: Mapping[str, Any], strict: bool) -> tuple[list[str], list[str]]:
    """Load DTensor (any world size) or full values; every rank passes its own dict."""
    expected = _expected_shapes(model)
    _raise_problems("load_state_dict", _problems(sd, expected, strict))
    rank = model.mesh.get_local_rank()
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
    params: list[tuple["Unit", int, torch.Tensor]] = []
    for key, target in model.module.state_dict(keep_vars=True).items():
        if key not in sd:
            continue
        found = model.unit_of(target)
        if found is None:
            value = sd[key].full_tensor() if isinstance(sd[key], DTensor) else sd[key]
            buffers.append((target, value))
        else:
            unit, i = found
            params.append((unit, i, _local_chunk(sd[key], unit.layout.slots[i], rank)))
    with torch.no_grad():  # everything validated and converted: now write
        for target, value in buffers:
            target.copy_(value)
    for unit, i, value in params:
        unit.write_param(i, value)  # an unsharded copy is stale afterwards (unit.py)
    return [k for k in expected if k not in sd], [k for k in sd if k not in expected]


# ---- model: full ------------------------------------------------------------------------------


def full_state_dict(model: "ShardedModule", rank0_only: bool, cpu_offload: bool) -> dict[str, torch.Tensor]:
    keep = not rank0_only or model.mesh.get_local_rank() == 0
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


def load_full_state_dict(model: "ShardedModule", sd: Mapping[str, Any], strict: bool) -> None:
    """The mesh's first rank reads ``sd`` (the others pass ``{}``); shards are scattered unit by
    unit and buffers broadcast."""
    group = model.mesh.get_group()
    is_src = model.mesh.get_local_rank() == 0
    problems = collectives.broadcast_object(_problems(sd, _expected_shapes(model), strict) if is_src else None, group)
    _raise_problems("load_full_state_dict", problems)
    names = _names_by_id(model)
    for unit in model.units:
        _scatter_unit(unit, sd, names, is_src, group)
    present = collectives.broadcast_object([k for k, _ in model.module.named_buffers() if k in sd] if is_src else None, group)
    targets = [(k, b) for k, b in model.module.named_buffers() if k in present]
    if is_src:
        with torch.no_grad():
            for key, buf in targets:
                buf.copy_(sd[key])
    collectives.broadcast_tensors([b for _, b in targets], group)


def _names_by_id(model: "ShardedModule") -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for key, value in model.module.state_dict(keep_vars=True).items():
        names.setdefault(id(value), []).append(key)
    return names


def _scatter_unit(handle: "Unit", sd: Mapping[str, Any], names: dict[int, list[str]], is_src: bool, group: collectives.Group) -> None:
    layout, W, S = handle.layout, handle.world_size, handle.layout.shard_numel
    if not layout.slots:
        return
    # Parameters the dict leaves out (strict=False) keep their current values.
    keys = [next((k for k in names[id(p)] if k in sd), None) if is_src else None for p in handle.sharded_params]
    flags = collectives.broadcast_object([k is not None for k in keys] if is_src else None, group)
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
    collectives.scatter(incoming, pieces, group)
    handle.write_shard(incoming.narrow(0, 0, S))


# ---- optimizer --------------------------------------------------------------------------------


def _opt_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
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
    keep = not rank0_only or model.mesh.get_local_rank() == 0
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
    osd = collectives.broadcast_object(osd if model.mesh.get_local_rank() == 0 else None, model.mesh.get_group())  # the whole dict at once
    params = _opt_params(opt)
    slots = [_slot_of(model, p) for p in params]
    problems = _optim_problems(params, osd, lambda i: tuple(slots[i][0].layout.slots[slots[i][1]].shape))
    _raise_problems("load_full_optim_state_dict", problems)
    rank = model.mesh.get_local_rank()
    state = {}
    for idx, entry in osd["state"].items():
        handle, i = _slot_of(model, params[int(idx)])
        slot = handle.layout.slots[i]
        state[int(idx)] = {
            k: handle.as_dtensor(_local_chunk(v, slot, rank).clone(), slot) if _is_param_state(k, v, slot) else v
            for k, v in entry.items()
        }
    opt.load_state_dict({"state": state, "param_groups": osd["param_groups"]})


def _optim_problems(params: list[torch.Tensor], osd: Any, full_shape: Callable[[int], tuple[int, ...]]) -> list[str]:
    if not isinstance(osd, Mapping) or "state" not in osd or "param_groups" not in osd:
        return ["expected a dict with 'state' and 'param_groups'"]
    problems = []
    sizes = [len(g["params"]) for g in osd["param_groups"]]
    if sum(sizes) != len(params):
        problems.append(f"the checkpoint's param_groups hold {sum(sizes)} parameters, the optimizer {len(params)}")
        return problems
    for idx, entry in osd["state"].items():
        if not 0 <= int(idx) < len(params):
            problems.append(f"state for parameter index {idx}, which the optimizer does not have")
            continue
        shape = full_shape(int(idx))
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != shape:
                problems.append(f"shape mismatch for state {idx}.{k}: checkpoint {tuple(v.shape)} vs parameter {shape}")
    return problems


def sharded_optim_state_dict(model: "ShardedModule", opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"state": {fqn: {key: DTensor(Shard(0)) | value}}, "param_groups": [... "params": [fqns]]}``.

    A fresh optimizer has no state yet; its state is created first (a zero-learning-rate step on
    zero gradients, as ``torch.distributed.checkpoint.state_dict.get_state_dict`` does), so the
    result is a complete template for ``torch.distributed.checkpoint.load``, never an empty one."""
    init_optim_state(opt)
    osd = opt.state_dict()
    params = _opt_params(opt)
    fqns = []
    for p in params:
        handle, i = _slot_of(model, p)
        fqns.append(handle.layout.slots[i].fqn)
    state = {fqns[idx]: dict(entry) for idx, entry in osd["state"].items()}  # DTensor states, as the optimizer keeps them
    groups = [{**g, "params": [fqns[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_sharded_optim_state_dict(model: "ShardedModule", opt: torch.optim.Optimizer, osd: Mapping[str, Any]) -> None:
    params = _opt_params(opt)
    index = {}
    for i, p in enumerate(params):
        handle, j = _slot_of(model, p)
        index[handle.layout.slots[j].fqn] = (i, handle.layout.slots[j])
    problems = []
    names = [n for g in osd.get("param_groups", []) for n in g["params"]]
    unknown = [n for n in list(osd.get("state", {})) + names if n not in index]
    if unknown:
        problems.append(f"parameters not in this model's optimizer: {sorted(set(unknown))}")
    if sorted(names) != sorted(index) and not unknown:
        problems.append(f"param_groups cover {len(names)} parameters, the optimizer {len(index)}")
    for name, entry in osd.get("state", {}).items():
        if name in index:
            shape = tuple(index[name][1].shape)
            for k, v in entry.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != shape:
                    problems.append(f"shape mismatch for state '{name}'.{k}: checkpoint {tuple(v.shape)} vs parameter {shape}")
    _raise_problems("load_sharded_optim_state_dict", problems)
    rank = model.mesh.get_local_rank()
    state = {}
    for name, entry in osd["state"].items():
        i, slot = index[name]
        unit = _slot_of(model, params[i])[0]
        state[i] = {
            k: unit.as_dtensor(_local_chunk(v, slot, rank).clone(), slot) if _is_param_state(k, v, slot) else v
            for k, v in entry.items()
        }
    groups = [{**g, "params": [index[n][0] for n in g["params"]]} for g in osd["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


def init_optim_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's state without changing any parameter: one step with zero gradients
    and a zero learning rate (a template for ``torch.distributed.checkpoint.load``)."""
    if opt.state:
        return
    saved, zeroed = [], []
    for group in opt.param_groups:
        saved.append(group["lr"])
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                zeroed.append(p)
    opt.step()
    for group, lr in zip(opt.param_groups, saved):
        group["lr"] = lr
    for p in zeroed:  # gradients the caller had stay
        p.grad = None


def check_full(model: "ShardedModule", opt: torch.optim.Optimizer | None, state: Mapping[str, Any]) -> list[str]:
    """Every problem a full checkpoint ``{"model": ..., "optim": ...}`` has for this model and
    optimizer, so that loading can refuse before changing either."""
    if not isinstance(state, Mapping) or not isinstance(state.get("model"), Mapping):
        return ["expected a dict with a 'model' state dict"]
    problems = _problems(state["model"], _expected_shapes(model), True)
    if opt is not None:
        params = _opt_params(opt)
        slots = [_slot_of(model, p) for p in params]
        problems += _optim_problems(params, state.get("optim"), lambda i: tuple(slots[i][0].layout.slots[slots[i][1]].shape))
    return problems
