"""Bad input gets a clear error, raised before any state changes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import models
from harness import run_on_ranks


def test_no_process_group():
    from shardwrap import ShardedModule

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        ShardedModule(nn.Linear(2, 2))


def snapshot(model: nn.Module) -> list:
    return [(n, p, p.detach().clone()) for n, p in model.named_parameters()]


def unchanged(model: nn.Module, before: list) -> bool:
    after = list(model.named_parameters())
    return len(after) == len(before) and all(
        n == n2 and p is p2 and (p2.is_meta or torch.equal(p2.detach(), v)) for (n, p, v), (n2, p2) in zip(before, after)
    )


def attempt(build, **kwargs) -> tuple[str, str, bool]:
    """Wrap ``build()`` with ``kwargs``; return (error type, message, model unchanged)."""
    from shardwrap import ShardedModule

    model = build()
    before = snapshot(model)
    try:
        ShardedModule(model, **kwargs)
    except Exception as exc:  # the test inspects type and text
        return type(exc).__name__, str(exc), unchanged(model, before)
    return "", "no error", unchanged(model, before)


class MixedDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = models.Block(4)
        self.block.up.bias = nn.Parameter(torch.zeros(8, dtype=torch.float64))


class MixedDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = models.Block(4)
        self.block.down.weight = nn.Parameter(torch.empty(4, 8, device="meta"))


def on_ranks_bad_arguments() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from shardwrap import ShardedModule, SizePolicy

    def mlp():
        return models.mlp(4, 2)

    results = {
        "stage4": attempt(mlp, stage=4),
        "stage_str": attempt(mlp, stage="3"),
        "policy_int": attempt(mlp, auto_wrap_policy=42),
        "policy_class": attempt(mlp, auto_wrap_policy=models.Block),
        "policy_set_of_junk": attempt(mlp, auto_wrap_policy={int}),
        "policy_container": attempt(mlp, auto_wrap_policy={nn.ModuleList}),
        "dtype": attempt(MixedDtype, auto_wrap_policy={models.Block}),
        "device": attempt(MixedDevice, auto_wrap_policy={models.Block}),
        "mesh_2d": attempt(mlp, mesh=init_device_mesh("cpu", (dist.get_world_size(), 1))),
        "mesh_not_a_mesh": attempt(mlp, mesh=dist.group.WORLD),
        "sparse_embedding": attempt(lambda: nn.Sequential(nn.Embedding(10, 4, sparse=True), models.Block(4)), auto_wrap_policy={models.Block}),
    }
    try:
        SizePolicy(0)
        results["size_policy"] = ("", "no error", True)
    except ValueError as exc:
        results["size_policy"] = ("ValueError", str(exc), True)

    def fully_sharded(inner_only: bool):
        from torch.distributed.fsdp import fully_shard

        model = mlp()
        for block in model.blocks:
            fully_shard(block)
        return model if inner_only else fully_shard(model)

    results["wrap_fully_shard"] = attempt(lambda: fully_sharded(False), auto_wrap_policy={models.Block})
    results["wrap_fully_shard_inner"] = attempt(lambda: fully_sharded(True), auto_wrap_policy={models.Block})
    wrapped = ShardedModule(mlp(), auto_wrap_policy={models.Block})
    results["wrap_twice"] = attempt(lambda: wrapped.module)
    results["wrap_wrapper"] = attempt(lambda: wrapped)
    results["wrap_inner"] = attempt(lambda: wrapped.module.blocks[0])
    return results


EXPECTED = {
    "stage4": ("ValueError", ["stage=4", "1, 2 or 3"]),
    "stage_str": ("ValueError", ["stage='3'"]),
    "policy_int": ("TypeError", ["auto_wrap_policy=42", "SizePolicy"]),
    "policy_class": ("TypeError", ["auto_wrap_policy=Block", "{Block}"]),
    "policy_set_of_junk": ("TypeError", ["int", "nn.Module subclass"]),
    "policy_container": ("ValueError", ["'blocks' (ModuleList)", "no forward", "auto_wrap_policy={Block}"]),
    "dtype": ("TypeError", ["'block'", "'block.up.bias'", "torch.float64", "MixedPrecision"]),
    "device": ("ValueError", ["'block.down.weight'", "meta", "one device"]),
    "mesh_2d": ("ValueError", ["2-D mesh for hybrid sharding", "mesh_dim_names"]),
    "mesh_not_a_mesh": ("TypeError", ["DeviceMesh"]),
    "sparse_embedding": ("ValueError", ["'0' (Embedding)", "sparse=True", "sparse=False"]),
    "size_policy": ("ValueError", ["min_num_params=0"]),
    "wrap_twice": ("ValueError", ["already wrapped", "auto_wrap_policy"]),
    "wrap_fully_shard": ("ValueError", ["the module (FSDPMLP)", "already sharded by torch's fully_shard", "Wrap the plain model"]),
    "wrap_fully_shard_inner": ("ValueError", ["submodule 'blocks.0' (FSDPBlock)", "already sharded by torch's fully_shard"]),
    "wrap_wrapper": ("ValueError", ["already wrapped"]),
    "wrap_inner": ("ValueError", ["already wrapped"]),
}


def test_bad_arguments_raise_clear_errors_before_any_change():
    for result in run_on_ranks(2, on_ranks_bad_arguments):
        assert set(result) == set(EXPECTED)
        for case, (kind, fragments) in EXPECTED.items():
            got_kind, message, untouched = result[case]
            assert got_kind == kind, (case, got_kind, message)
            for fragment in fragments:
                assert fragment in message, (case, fragment, message)
            assert untouched, f"{case}: the model changed before the error"


def on_ranks_stale_optimizer() -> tuple[str, bool]:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    plain = models.mlp(4, 2)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)  # built before wrapping: the mistake
    model = ShardedModule(plain, auto_wrap_policy={models.Block})
    model(torch.randn(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc), all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    return "no error", False


def test_optimizer_built_before_wrapping_is_refused_at_step():
    for message, untouched in run_on_ranks(2, on_ranks_stale_optimizer):
        assert "SGD" in message and "'inp.weight'" in message and "after" in message and "model.parameters()" in message
        assert untouched


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left = models.Block(4)
        self.right = models.Block(4)

    def forward(self, x, go_left: bool):
        return self.left(x) if go_left else self.right(x)


def runtime_error_of(build, step) -> str:  # type: ignore[no-untyped-def]
    """Wrap ``build()`` with Block units, run ``step(model)``; the RuntimeError's text."""
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(build(), auto_wrap_policy={models.Block})
    try:
        step(model)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def on_ranks_diverging_forward() -> str:
    return runtime_error_of(Branchy, lambda model: model(torch.randn(2, 4), go_left=dist.get_rank() == 0))


def test_ranks_running_different_units_get_an_error_not_a_hang():
    for message in run_on_ranks(2, on_ranks_diverging_forward, timeout=60):
        assert "ranks disagree" in message and "'left'" in message and "'right'" in message, message


class ManyUnits(nn.Module):
    """More units than bf16 counts exactly (integers up to 256): rank 0 runs unit 300 and rank 1
    unit 301, whose indices round to the same bf16 number."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(302))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[300 + dist.get_rank()](x)


def on_ranks_diverging_past_256_units_in_bf16(dtype: torch.dtype) -> str:
    from shardwrap import MixedPrecision, ShardedModule

    model = ShardedModule(ManyUnits(), auto_wrap_policy={nn.Linear}, mixed_precision=MixedPrecision(param_dtype=dtype))
    try:
        model(torch.randn(2, 2))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ranks_running_different_units_are_told_apart_past_what_a_16_bit_float_counts(dtype: torch.dtype):
    # the gather's own tag travels in the parameter dtype, where units 300 and 301 are the same
    # bf16 number; the header exchange before it carries the index as an int64 and tells them apart
    for message in run_on_ranks(2, on_ranks_diverging_past_256_units_in_bf16, dtype, timeout=120):
        assert "ranks disagree" in message and "'blocks.300'" in message and "'blocks.301'" in message, message


def on_ranks_l2_penalty_outside_forward(stage: int) -> str:
    from torch.distributed.tensor import DTensor

    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=stage)
    penalty = sum(p.pow(2).sum() for p in model.parameters())  # a DTensor: its sum over every rank
    assert isinstance(penalty, DTensor)
    try:
        (model(torch.randn(4, 16)).pow(2).mean() + 1e-2 * penalty.full_tensor()).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("stage", [1, 3])
def test_an_l2_penalty_over_the_sharded_parameters_is_refused_with_what_to_do(stage):
    # autograd reaches the local shards directly, outside every unit's reduction (fully_shard
    # fails on the same code with "mixed torch.Tensor and DTensor")
    for message in run_on_ranks(2, on_ranks_l2_penalty_outside_forward, stage):
        assert "used outside that unit's forward" in message and "weight_decay" in message, message


def on_ranks_reach_into_unit() -> str:
    return runtime_error_of(models.ReachesIntoUnit, lambda model: model(torch.randn(4, 16)).sum().backward())


def test_parameter_read_outside_its_unit_is_refused():
    for message in run_on_ranks(2, on_ranks_reach_into_unit, timeout=60):
        assert "used outside its unit's forward" in message and "unit '<root>' ran" in message, message


def on_ranks_weight_shared_between_two_wrapped_models() -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    out = {}
    g, d = models.mlp(16, 2, out=16), models.mlp(16, 2, out=1)
    d.inp.weight = g.inp.weight  # tied before wrapping (a GAN or a student and its head sharing a layer)
    g = ShardedModule(g, auto_wrap_policy={models.Block})
    before = {n: p.detach().clone() for n, p in d.named_parameters()}
    try:
        ShardedModule(d, auto_wrap_policy={models.Block})
        out["tied"] = "no error"
    except ValueError as exc:
        out["tied"] = str(exc)
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in d.named_parameters()) and not any(
        isinstance(m, ShardedModule) for m in d.modules())
    # a sharded parameter of a wrapped model put into another model after wrapping
    e = models.mlp(16, 2, out=1)
    e.inp.weight = dict(g.named_parameters())["inp.weight"]
    try:
        ShardedModule(e, auto_wrap_policy={models.Block})
        out["sharded"] = "no error"
    except ValueError as exc:
        out["sharded"] = str(exc)
    # the same architecture with its own weights wraps fine beside g
    ShardedModule(models.mlp(16, 2, out=1), auto_wrap_policy={models.Block})
    return out


def test_a_weight_shared_between_two_wrapped_models_is_refused():
    # Sharded twice, it trained as two separate weights (the tie dropped, 2e-2 off a tied
    # one-process run after 3 SGD steps, silently; fully_shard does the same).
    for r in run_on_ranks(2, on_ranks_weight_shared_between_two_wrapped_models):
        for key in ("tied", "sharded"):
            assert "parameter 'inp.weight'" in r[key] and "another ShardedModule" in r[key] and "parent module" in r[key], r[key]
        assert r["unchanged"], r


def on_ranks_wrapped_differently(what: str) -> str:
    """Rank 0 and rank 1 wrap with another argument, or a model with other buffers."""
    from shardwrap import MixedPrecision, ShardedModule

    rank = dist.get_rank()
    model = models.mlp(16, 2)
    kwargs: dict = {"auto_wrap_policy": {models.Block}}
    if what == "stage":
        kwargs["stage"] = 1 if rank == 0 else 3
    elif what == "mixed_precision":
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16) if rank == 0 else None
    elif what == "max_unsharded":
        kwargs["max_unsharded"] = 2 + rank
    elif what == "buffer_shape":
        model.register_buffer("scale", torch.ones(5 if rank == 0 else 3))
    elif what == "buffer_on_one_rank" and rank == 0:
        model.register_buffer("scale", torch.ones(3))
    try:
        ShardedModule(model, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "what,fragments",
    [
        ("stage", ["argument 'stage' differs (rank 0: 1; rank 1: 3)"]),
        ("mixed_precision", ["argument 'mixed_precision' differs", "param_dtype=torch.bfloat16", "rank 1: None"]),
        ("max_unsharded", ["argument 'max_unsharded' differs (rank 0: 2; rank 1: 3)"]),
        ("buffer_shape", ["buffer 'scale' differs (rank 0: shape (5,), float32; rank 1: shape (3,), float32)"]),
        ("buffer_on_one_rank", ["buffer 'scale' differs (rank 0: shape (3,), float32; rank 1: no buffer 'scale')"]),
    ],
)
def test_ranks_that_wrap_with_other_arguments_or_buffers_are_told_at_construction(what, fragments):
    """Each made the ranks issue collectives of other sizes (gloo aborted the process with SIGABRT)
    or wait out the timeout; now every rank raises at construction, naming it."""
    for message in run_on_ranks(2, on_ranks_wrapped_differently, what, timeout=60):
        assert "wrap them differently" in message, message
        for fragment in fragments:
            assert fragment in message, message


def on_ranks_load_a_meta_value() -> tuple[str, bool]:
    from shardwrap import ShardedModule

    model = ShardedModule(models.mlp(16, 2), auto_wrap_policy={models.Block})
    before = model.full_state_dict(rank0_only=False)
    try:
        model.load_state_dict({"blocks.0.up.weight": torch.empty(32, 16, device="meta")}, strict=False)
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    after = model.full_state_dict(rank0_only=False)
    return message, all(torch.equal(before[k], after[k]) for k in before)


def test_a_meta_value_in_load_state_dict_is_named_and_changes_nothing():
    """torch's copy failed with "Cannot copy out of meta tensor; no data!", naming no key."""
    for message, unchanged_ in run_on_ranks(2, on_ranks_load_a_meta_value):
        assert "'blocks.0.up.weight'" in message and "meta device" in message, message
        assert unchanged_


def on_ranks_a_call_on_one_rank(stage: int, call: str, path: str) -> list[str]:
    """Rank 0 alone calls ``call`` between steps while rank 1 goes on to the next step. Its first
    data collective met rank 1's gather header, and gloo aborted the process (SIGABRT)."""
    from shardwrap import ShardedModule, save_checkpoint

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(16, 2), auto_wrap_policy={models.Block}, stage=stage)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    errors = []
    for step in range(2):
        if step == 1 and dist.get_rank() == 0:
            try:
                if call == "full_state_dict":
                    model.full_state_dict()
                elif call == "summon_full_params":
                    with model.summon_full_params():
                        pass
                else:
                    save_checkpoint(path, model, opt)
            except RuntimeError as exc:
                errors.append(str(exc))
        try:
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.parametrize("stage,call", [
    (1, "save_checkpoint"), (3, "full_state_dict"), (2, "summon_full_params"),
])
def test_a_call_between_steps_on_one_rank_only_is_named_on_every_rank(tmp_path, stage, call):
    caller, other = run_on_ranks(2, on_ranks_a_call_on_one_rank, stage, call, str(tmp_path / "ckpt"), timeout=60)
    assert f"ranks disagree on the next collective at the start of {call}" in caller[0], caller
    assert "all-gather of unit '<root>' in forward" in caller[0], caller
    assert f"rank 0: {call}, between steps" in other[0], other
    assert all("fell out of step" in e for e in caller[1:] + other[1:]), (caller, other)


def on_ranks_another_optimizer_on_one_rank(variant: str, call: str, path: str) -> dict:
    """Rank 1 builds its optimizer differently (``variant``), both train two steps, then every
    rank makes ``call``. A checkpoint holds one rank's param groups, and DCP's plan needs the same
    state on every rank: these saved the first rank's learning rate for all, or died in DCP's
    planner with its own words. Then both ranks train on and save, to show they are in step."""
    import os

    from shardwrap import ShardedModule, save_checkpoint, save_full

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(16, 2), auto_wrap_policy={models.Block}, stage=3)
    params = list(model.parameters())
    other = dist.get_rank() == 1
    if variant == "lr" and other:
        opt = torch.optim.SGD(params, lr=0.2, momentum=0.9)
    elif variant == "groups" and other:
        opt = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=0.1, momentum=0.9)
    elif variant == "class" and other:
        opt = torch.optim.AdamW(params, lr=0.1)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def step() -> None:
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()

    step(), step()
    if variant == "fresh" and other:  # built again after training: no state
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if variant == "foreign" and other:
        opt = torch.optim.SGD([*params, nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    calls = {
        "save_checkpoint": lambda: save_checkpoint(path, model, opt),
        "save_full": lambda: save_full(path, model, opt),
        "full_optim_state_dict": lambda: model.full_optim_state_dict(opt),
    }
    try:
        calls[call]()
        error = "nothing raised"
    except ValueError as exc:
        error = str(exc)
    written = os.path.exists(path)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    step()
    save_checkpoint(path + "-after", model, opt)
    return {"error": error, "written": written}


@pytest.mark.parametrize("variant,call,fragments", [
    ("lr", "save_checkpoint", ["param group 0's 'lr' (rank 0: 0.1; rank 1: 0.2)"]),
    ("groups", "save_full", ["the number of param groups (rank 0: 1; rank 1: 2)"]),
    ("class", "full_optim_state_dict", ["the class (rank 0: SGD; rank 1: AdamW)"]),
    ("fresh", "save_checkpoint", ["whether it has stepped (rank 0: has state; rank 1: fresh"]),
    ("foreign", "save_checkpoint", ["rank 1: the optimizer holds a tensor that is not a parameter of this ShardedModule"]),
])
def test_an_optimizer_built_otherwise_on_one_rank_is_named_before_anything_is_saved(tmp_path, variant, call, fragments):
    for r, got in enumerate(run_on_ranks(2, on_ranks_another_optimizer_on_one_rank, variant, call, str(tmp_path / "ckpt"), timeout=90)):
        assert all(f in got["error"] for f in fragments) and call in got["error"], (r, got)
        assert not got["written"], (r, got)


def run_with_eye_after_step_one(case, model, opt, rank: int, world: int, sharded: bool) -> dict:
    """One step, ``nn.init.eye_`` on the square first weight, then a second step. Sharded: the
    forward after ``eye_`` must refuse, and the model goes on once the full value is loaded."""
    from parity import global_batch, loss_fn

    def step(i: int) -> None:
        batch = global_batch(case, i)
        if sharded:
            batch = {k: v.chunk(world)[rank] for k, v in batch.items()}
        loss_fn(case, model, batch).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    inner = model.module if sharded else model
    with torch.no_grad():
        torch.nn.init.eye_(inner.inp.weight)
    out: dict = {}
    if sharded:
        for what, call in {"forward": lambda: step(1), "full_state_dict": lambda: model.full_state_dict()}.items():
            with torch.no_grad():
                torch.nn.init.eye_(inner.inp.weight)  # again: the refusal put the shard's shape back
            try:
                call()
                out[what] = "nothing raised"
            except RuntimeError as exc:
                out[what] = str(exc)
    return out


def on_ranks_eye_after_wrapping(stage: int, plain_state: dict) -> dict:
    """``nn.init.eye_(p)`` is ``torch.eye(*p.shape, out=p)``: on a sharded parameter it resized the
    local shard to the global shape in place, over the unit's flat shard, and wrote into the
    parameters after it (silently: the forward and the full state dict were 1.0-2.3 off)."""
    from parity import Case, build_model, build_optimizer, resolve_policy

    from shardwrap import ShardedModule

    case = Case("mlp", {"dim": 16, "depth": 2}, policy="Block", stage=stage)
    model = ShardedModule(build_model(case), auto_wrap_policy=resolve_policy(case), stage=stage)
    opt = build_optimizer(case, model)
    out = run_with_eye_after_step_one(case, model, opt, dist.get_rank(), dist.get_world_size(), sharded=True)
    model.load_state_dict(plain_state)  # the full values, written into the shards: training goes on
    from parity import global_batch, loss_fn

    batch = {k: v.chunk(dist.get_world_size())[dist.get_rank()] for k, v in global_batch(case, 1).items()}
    loss_fn(case, model, batch).backward()
    opt.step()
    out["after"] = model.full_state_dict(rank0_only=False)
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_an_out_write_that_resizes_a_shard_is_named_and_a_load_repairs_it(stage):
    from parity import Case, assert_close_params, build_model, build_optimizer, global_batch, loss_fn

    case = Case("mlp", {"dim": 16, "depth": 2}, policy="Block", stage=stage)
    plain = build_model(case)
    opt = build_optimizer(case, plain)
    run_with_eye_after_step_one(case, plain, opt, 0, 1, sharded=False)
    plain_state = {k: v.clone() for k, v in plain.state_dict().items()}
    loss_fn(case, plain, global_batch(case, 1)).backward()
    opt.step()
    for got in run_on_ranks(2, on_ranks_eye_after_wrapping, stage, plain_state):
        for what in ("forward", "full_state_dict"):
            message = got[what]
            assert "parameter 'inp.weight'" in message and "resized from (8, 16) to (16, 16)" in message, (what, message)
            assert "load_state_dict" in message, (what, message)  # which neighbours it reached depends on the layout
        for name, value in plain.state_dict().items():
            assert_close_params(got["after"][name], value, case.optim, 1, name)


def on_ranks_func_grad(stage: int) -> dict:
    """``torch.func.grad`` through ``functional_call`` on the wrapped model: named (it failed with
    "Cannot access storage of TensorWrapper"; ``fully_shard`` returns zero gradients), and the
    model trains on."""
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(16, 2), auto_wrap_policy={models.Block}, stage=stage)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 16)
    params = {k: v.detach() for k, v in model.named_parameters()}
    try:
        torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(params)
        error = "nothing raised"
    except RuntimeError as exc:
        error = str(exc)
    model(x).sum().backward()
    opt.step()
    return {"error": error, "finite": all(torch.isfinite(v).all() for v in model.full_state_dict(rank0_only=False).values())}


@pytest.mark.parametrize("stage", [1, 3])
def test_torch_func_transforms_on_the_wrapped_model_are_named(stage):
    for got in run_on_ranks(2, on_ranks_func_grad, stage):
        assert "torch.func.grad, vmap or jacrev through functional_call on a ShardedModule is not supported" in got["error"], got
        assert got["finite"]
