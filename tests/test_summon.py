"""``summon_full_params``: FSDP1's context, and DeepSpeed's ``GatheredParameters(modifier_rank=)``.

Code that reads or edits full weights between steps (an EMA copied in, a re-initialised head, a
norm logged by name) runs inside the context on every rank. Each test trains the unwrapped model
in one process on the global batch beside it, with the same reads and edits, and compares what
the context showed, the losses and the final parameters."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import models
from harness import RankError, run_on_ranks
from parity import Case, build_model, build_optimizer, global_batch, loss_fn, wrap

WORLD = 2
TOL = {"rtol": 1e-5, "atol": 1e-6}


def edit(named: dict[str, torch.Tensor], how: str) -> None:
    """What user code does to full weights: in place on the parameter, or through ``.data``
    (which bumps no version counter)."""
    if how == "freeze":  # a copy frozen inside: its parameter stays frozen after
        named["head.weight"].requires_grad_(False)
        return
    with torch.no_grad():
        for p in named.values():
            if how == "data":
                p.data.mul_(0.9)
            elif p.dim() >= 2:
                p.mul_(0.5)
            else:
                p.add_(0.1)


def train(case: Case, model: nn.Module, summon: Callable[[nn.Module], Any], edits: bool, how: str,
          place: tuple[int, int] = (1, 0)) -> dict[str, Any]:
    """``case.steps`` steps, each followed by a look at the full parameters inside ``summon``
    (and, where ``edits``, an edit of them there)."""
    opt = build_optimizer(case, model)
    chunks, index = place
    out: dict[str, Any] = {"seen": [], "losses": []}
    for step in range(case.steps):
        batch = {k: v.chunk(chunks)[index] for k, v in global_batch(case, step).items()}
        loss = loss_fn(case, model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach().clone())
        with summon(model):
            named = dict(model.named_parameters())
            out["seen"].append({n: p.detach().clone() for n, p in named.items()})
            out["kinds"] = sorted({type(p).__name__ for p in named.values()})
            if edits:
                edit(named, how)
    return out


def reference(case: Case, how: str) -> dict[str, Any]:
    model = build_model(case)
    out = train(case, model, lambda m: contextlib.nullcontext(), how != "read", how)
    out["final"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def on_ranks_summon(case: Case, how: str, offload: str | None = None) -> dict[str, Any]:
    import tempfile

    from shardwrap import Offload

    rank, world = dist.get_rank(), dist.get_world_size()
    path = tempfile.mkdtemp(prefix="shardwrap-offload-test-") if offload == "disk" else None
    kwargs = {"offload": Offload(offload, path=path)} if offload else {}
    model = wrap(case, **kwargs)
    last = world - 1
    if how == "modifier":  # DeepSpeed's modifier_rank: one rank edits, its values are kept
        out = train(case, model, lambda m: m.summon_full_params(modifier_rank=last), rank == last, how, (world, rank))
    elif how == "read":  # writeback=False: edits are dropped
        out = train(case, model, lambda m: m.summon_full_params(writeback=False), True, how, (world, rank))
    else:
        out = train(case, model, lambda m: m.summon_full_params(), True, how, (world, rank))
    for loss in out["losses"]:
        dist.all_reduce(loss)
        loss /= world
    out["final"] = model.full_state_dict(rank0_only=False)
    out["after"] = sorted({type(p).__name__ for p in model.parameters()})
    return out


def check(case: Case, world: int, how: str, offload: str | None = None) -> None:
    want = reference(case, how)
    for got in run_on_ranks(world, on_ranks_summon, case, how, offload):
        assert got["kinds"] == ["Parameter"], got["kinds"]  # plain full tensors inside
        assert got["after"] == ["DTensor"], got["after"]  # the sharded parameters again after
        for step, (seen, expected) in enumerate(zip(got["seen"], want["seen"])):
            assert seen.keys() == expected.keys()
            for name, value in expected.items():
                torch.testing.assert_close(seen[name], value, **TOL, msg=lambda m: f"step {step} {name}: {m}")
        for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"loss {i}: {m}")
        for name, value in want["final"].items():
            torch.testing.assert_close(got["final"][name], value, **TOL, msg=lambda m: f"final {name}: {m}")


MLP = Case("mlp", policy="Block")


@pytest.mark.parametrize("how", ["all", "data", "modifier", "read", "freeze"])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_parameters_are_shown_and_edits_are_written_back(stage, optim, how):
    """Inside the context every parameter is a plain tensor with the one-process value; edits
    made alike on every rank (in place, or through ``.data``), or on one rank with
    ``modifier_rank``, train on as they do in one process; ``writeback=False`` drops them. A copy
    frozen inside leaves its parameter frozen."""
    check(Case("mlp", policy="Block", stage=stage, optim=optim), WORLD, how)


@pytest.mark.parametrize("how", ["all", "modifier"])
@pytest.mark.parametrize("case", [
    Case("mlp", policy="Block", stage=1, batch=12),
    Case("mlp", policy="Block", stage=3, optim="adamw"),
    Case("tied_across_units", policy={nn.Sequential}, stage=3, out=11),  # one full copy in both tied slots
], ids=["stage1", "stage3", "tied"])
def test_uneven_shards_at_three_ranks(case, how):
    check(case, 3, how)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_edits_reach_offloaded_shards(offload):
    check(Case("mlp", policy="Block", stage=3, optim="adamw"), WORLD, "all", offload)


@pytest.mark.parametrize("case", [
    Case("mlp", policy="Block", stage=3, mesh=(2, 2)),
    Case("mlp", policy="Block", stage=2, optim="adamw", mesh=(2, 2)),
], ids=["hybrid-s3", "hybrid-s2"])
@pytest.mark.parametrize("how", ["all", "modifier"])
def test_a_hybrid_mesh(case, how):
    check(case, 4, how)


def test_tensor_parallel_blocks():
    """With tensor parallelism the full copy is the whole weight (both mesh axes gathered), and
    the write-back puts this rank's TP rows of its shard back."""
    from parity import data_place  # noqa: F401  (the TP case trains one chunk per data-parallel rank)

    case = Case("mlp", policy="Block", stage=3, tp=2, batch=12)
    want = reference(case, "all")
    for got in run_on_ranks(WORLD, on_ranks_tp, case):
        for name, value in want["seen"][-1].items():
            torch.testing.assert_close(got["seen"][-1][name], value, **TOL, msg=lambda m: f"{name}: {m}")
        for name, value in want["final"].items():
            torch.testing.assert_close(got["final"][name], value, **TOL, msg=lambda m: f"final {name}: {m}")


def on_ranks_tp(case: Case) -> dict[str, Any]:
    from parity import data_place

    model = wrap(case)
    out = train(case, model, lambda m: m.summon_full_params(), True, "all", data_place(case))
    out["final"] = model.full_state_dict(rank0_only=False)
    return out


def on_ranks_one_block(form: str) -> dict[str, Any]:
    from shardwrap import ShardedModule

    rank = dist.get_rank()
    case = Case("mlp", policy="Block", stage=3)
    model = wrap(case)
    block = model.module.blocks[1]
    out: dict[str, Any] = {}
    with (block.summon_full_params() if form == "method" else ShardedModule.summon_full_params(block)):
        out["full"] = sorted(n for n, p in model.named_parameters() if type(p).__name__ == "Parameter")
        edit(dict(block.named_parameters()), "all")
    try:
        ShardedModule.summon_full_params(block.up)
    except TypeError as exc:
        out["not_a_unit"] = str(exc)
    opt = build_optimizer(case, model)
    for step in range(2):
        batch = {k: v.chunk(WORLD)[rank] for k, v in global_batch(case, step).items()}
        loss_fn(case, model, batch).backward()
        opt.step()
        opt.zero_grad()
    out["final"] = model.full_state_dict(rank0_only=False)
    return out


@pytest.mark.parametrize("form", ["method", "static"])
def test_a_units_module_summons_its_own_parameters(form):
    """FSDP1 summons an inner FSDP module: ``block.summon_full_params()`` (or the static form
    ``ShardedModule.summon_full_params(block)``) shows and writes back that unit's parameters only."""
    case = Case("mlp", policy="Block", stage=3)
    model = build_model(case)
    edit(dict(model.blocks[1].named_parameters()), "all")
    opt = build_optimizer(case, model)
    for step in range(2):
        loss_fn(case, model, global_batch(case, step)).backward()
        opt.step()
        opt.zero_grad()
    for got in run_on_ranks(WORLD, on_ranks_one_block, form):
        assert got["full"] == sorted(f"blocks.1.{n}" for n, _ in model.blocks[1].named_parameters())
        assert "Linear is not a ShardedModule nor a module that auto_wrap_policy made a unit" in got["not_a_unit"]
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got["final"][name], value, **TOL, msg=lambda m: f"final {name}: {m}")


# ---- perturbed: the oracle catches a write-back that is off -------------------------------------


def on_ranks_perturbed(case: Case) -> dict[str, Any]:
    import shardwrap.summon as summon

    original = summon._sd.commit_writes
    summon._sd.commit_writes = lambda model, writes: None  # type: ignore[assignment]  # edits dropped
    try:
        return on_ranks_summon(case, "all")
    finally:
        summon._sd.commit_writes = original  # type: ignore[assignment]


def test_the_oracle_fails_when_the_write_back_is_dropped():
    case = Case("mlp", policy="Block", stage=1)
    want = reference(case, "all")
    got = run_on_ranks(WORLD, on_ranks_perturbed, case)[0]
    with pytest.raises(AssertionError):
        for name, value in want["final"].items():
            torch.testing.assert_close(got["final"][name], value, **TOL)


# ---- options ------------------------------------------------------------------------------------


def on_ranks_options(stage: int) -> dict[str, Any]:
    rank = dist.get_rank()
    case = Case("mlp", policy="Block", stage=stage)
    model = wrap(case)
    opt = build_optimizer(case, model)
    batch = {k: v.chunk(WORLD)[rank] for k, v in global_batch(case, 0).items()}
    loss_fn(case, model, batch).backward()
    out: dict[str, Any] = {}
    with model.summon_full_params(with_grads=True, writeback=False):
        out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["grad_kinds"] = sorted({type(p.grad).__name__ for p in model.parameters()})
    opt.step()
    opt.zero_grad()
    with model.summon_full_params(rank0_only=True, writeback=False, offload_to_cpu=True):
        out["rank0_only"] = sorted({type(p).__name__ for p in model.parameters()})
    with model.summon_full_params(recurse=False, writeback=False):
        out["own"] = sorted(n for n, p in model.named_parameters() if type(p).__name__ == "Parameter")
    out["final"] = model.full_state_dict(rank0_only=False)
    return out


def on_ranks_many_grads(stage: int) -> dict[str, Any]:
    rank = dist.get_rank()
    model = wrap(Case("many_linears", {"count": 70}, stage=stage, dim=4, out=4))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    model(x.chunk(WORLD)[rank]).pow(2).mean().backward()
    with model.summon_full_params(with_grads=True, writeback=False):
        return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 3])
def test_gradients_of_a_unit_with_many_parameters(stage):
    """140 parameters in one unit (a review: the ranks' agreement on which have a gradient
    overflowed at 126)."""
    torch.manual_seed(0)
    model = models.many_linears(70)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    model(x).pow(2).mean().backward()
    for got in run_on_ranks(WORLD, on_ranks_many_grads, stage):
        assert len(got) == 140
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name], p.grad, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_rank0_only_and_the_root_alone(stage):
    """``with_grads``: each full copy's ``.grad`` is the one-process gradient. ``rank0_only``:
    only rank 0 gets full copies. ``recurse=False``: the root unit's own parameters only."""
    case = Case("mlp", policy="Block", stage=stage)
    model = build_model(case)
    opt = build_optimizer(case, model)
    loss_fn(case, model, global_batch(case, 0)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    root_own = sorted(n for n, _ in model.named_parameters() if not n.startswith("blocks."))
    for rank, got in enumerate(run_on_ranks(WORLD, on_ranks_options, stage)):
        assert got["grad_kinds"] == ["Tensor"]
        for name, value in grads.items():
            torch.testing.assert_close(got["grads"][name], value, **TOL, msg=lambda m: f"grad {name}: {m}")
        assert got["rank0_only"] == (["Parameter"] if rank == 0 else ["DTensor"])
        assert got["own"] == root_own and root_own
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got["final"][name], value, **TOL, msg=lambda m: f"final {name}: {m}")


# ---- refusals: each names what to do, and the model trains on as one process ---------------------


def attempt(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as exc:
        return str(exc)
    return ""


def on_ranks_refusals(stage: int) -> dict[str, Any]:
    rank = dist.get_rank()
    case = Case("mlp", policy="Block", stage=stage, optim="sgd")
    model = wrap(case)
    opt = build_optimizer(case, model)
    x = {k: v.chunk(WORLD)[rank] for k, v in global_batch(case, 0).items()}
    out: dict[str, str] = {}
    out["both"] = attempt(lambda: model.summon_full_params(rank0_only=True).__enter__())
    out["flag"] = attempt(lambda: model.summon_full_params(writeback=1).__enter__())
    out["modifier"] = attempt(lambda: model.summon_full_params(modifier_rank=WORLD).__enter__())
    with model.summon_full_params():
        out["forward"] = attempt(lambda: model(x["x"]))
        out["block"] = attempt(lambda: model.module.blocks[0](x["x"]))
        out["step"] = attempt(opt.step)
        out["state_dict"] = attempt(model.state_dict)
        out["nested"] = attempt(lambda: model.summon_full_params().__enter__())
        out["zero_grad"] = attempt(model.zero_grad)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
    out["inner_optimizer"] = attempt(inner.step)
    loss = loss_fn(case, model, x)
    out["owed"] = attempt(lambda: model.summon_full_params().__enter__())
    loss.backward()
    with model.no_sync():
        loss_fn(case, model, x).backward()
    out["unsynced"] = attempt(lambda: model.summon_full_params(with_grads=True).__enter__())
    loss_fn(case, model, x).backward()  # the synced one: the three micro-batches reduce now
    def clip_the_copies() -> None:  # torch's clipping on the copies: refused, the gradients stay
        with model.summon_full_params(with_grads=True):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    out["clip_copies"] = attempt(clip_the_copies)
    opt.step()
    opt.zero_grad()
    # One rank edits without modifier_rank: refused on every rank, nothing written
    def one_rank_edits() -> None:
        with model.summon_full_params():
            if rank == 0:
                edit(dict(model.named_parameters()), "all")
    out["one_rank"] = attempt(one_rank_edits)
    # A parameter replaced, or given another shape, inside: refused, nothing written
    def replaced() -> None:
        with model.summon_full_params():
            edit(dict(model.named_parameters()), "all")
            model.module.head.weight = nn.Parameter(torch.zeros_like(model.module.head.weight))
    out["replaced"] = attempt(replaced)
    def reshaped() -> None:
        with model.summon_full_params():
            edit(dict(model.named_parameters()), "all")
            model.module.head.weight.data = torch.zeros(2, 2)
    out["reshaped"] = attempt(reshaped)
    # One rank raises inside: it sees its own error, the others are told, nothing written
    def raises_on_rank_0() -> None:
        with model.summon_full_params():
            edit(dict(model.named_parameters()), "all")
            if rank == 0:
                raise KeyError("user code failed")
    try:
        raises_on_rank_0()
        out["raised"] = ""
    except KeyError as exc:
        out["raised"] = f"KeyError {exc}"
    except RuntimeError as exc:
        out["raised"] = str(exc)
    for step in (1, 2):
        batch = {k: v.chunk(WORLD)[rank] for k, v in global_batch(case, step).items()}
        loss_fn(case, model, batch).backward()
        opt.step()
        opt.zero_grad()
    out_final = model.full_state_dict(rank0_only=False)
    return {"errors": out, "final": out_final, "kinds": sorted({type(p).__name__ for p in model.parameters()})}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_refusals_name_the_fault_and_change_nothing(stage):
    case = Case("mlp", policy="Block", stage=stage, optim="sgd")
    model = build_model(case)
    opt = build_optimizer(case, model)
    batch = global_batch(case, 0)
    for _ in range(3):  # the two micro-batches and the synced one, each on the whole batch
        loss_fn(case, model, batch).backward()
    opt.step()
    opt.zero_grad()
    for step in (1, 2):
        loss_fn(case, model, global_batch(case, step)).backward()
        opt.step()
        opt.zero_grad()
    for rank, got in enumerate(run_on_ranks(WORLD, on_ranks_refusals, stage)):
        e = got["errors"]
        assert "rank0_only=True with writeback=True" in e["both"], e["both"]
        assert "writeback should be a bool" in e["flag"], e["flag"]
        assert "modifier_rank should be None or a rank in 0..1" in e["modifier"], e["modifier"]
        for what in ("forward", "block", "step", "state_dict"):
            assert "inside summon_full_params()" in e[what] and "Leave the context" in e[what], (what, e[what])
        assert "inside another summon_full_params()" in e["nested"], e["nested"]
        assert "model.zero_grad() inside summon_full_params()" in e["zero_grad"], e["zero_grad"]
        assert "gradient of 'inp.weight' was changed inside the context" in e["clip_copies"], e["clip_copies"]
        assert "full copy of parameter" in e["inner_optimizer"], e["inner_optimizer"]
        assert "between a forward and its backward" in e["owed"], e["owed"]
        assert "not reduced yet" in e["unsynced"] and "unit(s)" in e["unsynced"], e["unsynced"]
        assert "differ between ranks" in e["one_rank"] and "'inp.weight'" in e["one_rank"] and "modifier_rank" in e["one_rank"], e["one_rank"]
        assert "'head.weight' was replaced" in e["replaced"], e["replaced"]
        assert "'head.weight' is now torch.float32 (2, 2)" in e["reshaped"], e["reshaped"]
        if rank == 0:
            assert e["raised"] == "KeyError 'user code failed'", e["raised"]
        else:
            assert "rank(s) [0] raised inside the context" in e["raised"], e["raised"]
        assert got["kinds"] == ["DTensor"]
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got["final"][name], value, **TOL, msg=lambda m: f"final {name}: {m}")


# ---- generated trees ----------------------------------------------------------------------------

unit = st.booleans()
leaf = st.one_of(
    st.tuples(st.just("linear"), st.booleans(), st.booleans(), unit),
    st.tuples(st.just("norm"), st.booleans(), unit),
    st.tuples(st.just("embed"), st.integers(1, 5), st.booleans(), unit),  # rows may be < W
    st.tuples(st.just("zero"), unit),
    st.tuples(st.just("tie"), st.integers(0, 7), unit),
)
trees = st.recursive(leaf, lambda c: st.tuples(st.sampled_from(["seq", "list"]), st.lists(c, min_size=1, max_size=3), unit), max_leaves=6)


def on_ranks_tree(case: Case) -> dict[str, Any]:
    model = wrap(case)
    with model.summon_full_params():
        seen = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.5).add_(0.25)
    return {"seen": seen, "final": model.full_state_dict(rank0_only=False)}


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(spec=trees, world_size=st.integers(1, 4), stage=st.sampled_from([1, 2, 3]))
def test_generated_trees_show_and_write_back_every_parameter(spec, world_size, stage):
    """Tiny, zero-size, shared and frozen parameters, rows fewer than ranks, random units: the
    context shows every parameter as the unwrapped model has it, and an edit of each lands."""
    case = Case("tree", {"spec": spec, "dim": 6}, policy="marked", stage=stage, dim=6)
    model = build_model(case)
    want_seen = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.5).add_(0.25)
    for got in run_on_ranks(world_size, on_ranks_tree, case):
        assert got["seen"].keys() == want_seen.keys()
        for name, value in want_seen.items():
            torch.testing.assert_close(got["seen"][name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got["final"][name], value, rtol=0, atol=0, msg=lambda m: f"final {name}: {m}")


def on_ranks_mixed_precision() -> dict[str, Any]:
    from shardwrap import MixedPrecision

    model = wrap(Case("mlp", policy="Block", stage=3), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    full = model.full_state_dict(rank0_only=False)
    with model.summon_full_params(writeback=False):
        seen = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"full": full, "seen": seen}


def test_mixed_precision_shows_the_fp32_master_weights():
    """Under ``MixedPrecision(param_dtype=bf16)`` the copies are the fp32 values the optimizer
    steps (FSDP1's context shows full precision too), not the bf16 copies a forward computes with."""
    for got in run_on_ranks(WORLD, on_ranks_mixed_precision):
        assert got["seen"].keys() == got["full"].keys()
        for name, value in got["full"].items():
            assert got["seen"][name].dtype == torch.float32
            torch.testing.assert_close(got["seen"][name], value, rtol=0, atol=0)
