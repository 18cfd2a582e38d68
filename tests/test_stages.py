"""Stages 1-3, accumulation with and without no_sync, mixed precision, clipping, prefetch: parity
with single-process training, per-stage memory and communication."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import models
from harness import run_on_ranks
from parity import Case, build_model, check_parity, global_batch, resolve_policy

MLP = Case("mlp", {"dim": 16, "depth": 3}, policy="Block")


def case(**changes) -> Case:
    return Case(**{**MLP.__dict__, **changes})


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_parity_fp32(stage, optim, world_size):
    check_parity(case(stage=stage, optim=optim), world_size)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    stage=st.sampled_from([1, 2, 3]),
    optim=st.sampled_from(["sgd", "adamw"]),
    world_size=st.integers(1, 4),
    precision=st.sampled_from(["bf16", "fp16"]),
)
def test_stage_parity_mixed_precision(stage, optim, world_size, precision):
    check_parity(case(stage=stage, optim=optim, mixed_precision=precision), world_size)


def test_gpt2_bf16_stage2():
    check_parity(Case("gpt2", {"n_layer": 2}, policy="GPT2Block", data="lm", seq=8, stage=2, mixed_precision="bf16"), 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("no_sync", [False, True])
def test_accumulation_with_and_without_no_sync(stage, no_sync):
    # 4 micro-batches per step; both variants are checked against the same reference, so all
    # three agree.
    check_parity(case(stage=stage, accumulate=4, batch=24, no_sync=no_sync), 3)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_stage1_gradients_in_the_unsharded_buffer_accumulate_like_torch(set_to_none, optim):
    # Stage 1's p.grad are views of the unsharded gradient buffer's rows: two syncing backward
    # calls per step (the second must add to, not overwrite, the first reduced gradient), and
    # zero_grad both ways. AdamW alone would not see a gradient off by a constant factor (a wrong
    # average over ranks or micro-batches); SGD with momentum does.
    check_parity(case(stage=1, optim=optim, accumulate=2, set_to_none=set_to_none, steps=4), 3)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("stage", [1, 3])
def test_clip_grad_norm_matches_torch(norm_type, stage):
    check_parity(case(stage=stage, clip=0.05, norm_type=norm_type), 3)


def test_clip_with_frozen_parameters_and_mixed_precision():
    check_parity(Case("lora", policy={models.LoRALinear}, clip=0.01), 2)
    check_parity(case(clip=0.05, mixed_precision="bf16"), 2)


def on_ranks_nonfinite_clip(poison: float) -> float:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(8, 2), auto_wrap_policy={models.Block})
    model(torch.randn(4, 8)).sum().backward()
    if dist.get_rank() == 1:
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = poison
    return model.clip_grad_norm_(1.0, 2.0).item(), model.clip_grad_norm_(1.0, math.inf).item()


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_nonfinite_gradient_gives_nonfinite_norm_on_every_rank(poison):
    for two, inf in run_on_ranks(2, on_ranks_nonfinite_clip, poison, timeout=60):
        assert not math.isfinite(two) and not math.isfinite(inf)
        if math.isnan(poison):
            assert math.isnan(two) and math.isnan(inf)


@pytest.mark.parametrize("max_unsharded", [1, 2, 3])
def test_execution_order_change_between_steps_stays_correct(max_unsharded):
    check_parity(Case("flip_mlp", {"dim": 16, "depth": 3}, policy="Block", steps=4, max_unsharded=max_unsharded), 2)


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_2_gathers_every_unit_at_once_and_both_stay_correct_when_the_order_changes(stage):
    """Stage 2 on a CPU gathers every unit when a training forward starts (its units stay gathered
    until backward anyway); stage 1, whose gathers land in a buffer beside the unsharded one it
    keeps, and ``max_unsharded=1`` keep the old schedule (design/notes/prefetch.md)."""
    check_parity(Case("flip_mlp", {"dim": 16, "depth": 3}, policy="Block", steps=4, stage=stage), 2)
    every, one = [["blocks.1", "blocks.2"], ["blocks.2"], []], [["blocks.1"], ["blocks.2"], []]
    for seen in run_on_ranks(2, on_ranks_prefetch, 2, stage):
        # stage 2: the first block's pre_forward started every later block's gather; each block
        # then finds the rest gathered ahead. The first step has no trace, so nothing is gathered
        # ahead (stage 1's units too: each starts stale, so its first forward gathers it)
        assert [ahead for step, ahead in seen if step > 0] == (every if stage == 2 else one) * 2, seen
        assert [ahead for step, ahead in seen if step == 0] == [[]] * 3, seen
    for seen in run_on_ranks(2, on_ranks_prefetch, 1, stage):  # max_unsharded=1: no prefetch at all
        assert all(ahead == [] for step, ahead in seen if step > 0), seen
    for seen in run_on_ranks(2, on_ranks_prefetch, 2, stage, False):  # the old schedule: one ahead
        assert [ahead for step, ahead in seen if step > 0] == one * 2, seen


def on_ranks_prefetch(max_unsharded: int, stage: int = 3, all_ahead: bool = True) -> list:
    from shardwrap import ShardedModule
    from shardwrap.unit import DataState, TrainingState

    model = ShardedModule(build_model(MLP), auto_wrap_policy={models.Block}, max_unsharded=max_unsharded, stage=stage)
    model.schedule.gather_all_ahead = all_ahead
    seen = []
    started: set[str] = set()  # this step's blocks so far (stages 1-2 keep them gathered after use)

    def probe(module, args):
        if stage != 3:  # stage 3 must have resharded them: they count
            started.add(next(h.name for h in model.units if h.training_state is TrainingState.FORWARD and h.index > 0))
        ahead = [
            h.name
            for h in model.units
            if h.training_state is TrainingState.IDLE and h.data_state in (DataState.GATHERING, DataState.UNSHARDED)
            and h.name not in started
        ]
        seen.append((step, ahead))

    for block in model.module.blocks:
        block.register_forward_pre_hook(probe)  # runs after shardwrap's pre_forward
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # stage 1 gathers again after a step
    for step in range(3):
        started.clear()
        x = global_batch(MLP, step)["x"].chunk(dist.get_world_size())[dist.get_rank()]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return seen


def test_forward_prefetches_the_next_unit_within_the_limit():
    for seen in run_on_ranks(2, on_ranks_prefetch, 2):
        later = [ahead for step, ahead in seen if step > 0]
        # blocks 0 and 1 see the next block already gathering; the last block has none ahead
        assert later[0] == ["blocks.1"] and later[1] == ["blocks.2"] and later[2] == [], seen
        assert all(len(ahead) <= 1 for _, ahead in seen)
    for seen in run_on_ranks(2, on_ranks_prefetch, 1):
        assert all(ahead == [] for _, ahead in seen), seen


def on_ranks_backward_prefetch() -> list:
    from shardwrap import ShardedModule
    from shardwrap.unit import DataState

    model = ShardedModule(build_model(MLP), auto_wrap_policy={models.Block}, max_unsharded=2)
    seen = []

    def probe(name):
        def hook(grad):  # runs inside block ``name``'s backward, after its pre_backward
            ahead = [h.name for h in model.units[1:] if h.name != name and h.data_state in (DataState.GATHERING, DataState.UNSHARDED)]
            seen.append((name, ahead))

        return hook

    def watch(name):
        def forward_hook(module, args, out):
            out.register_hook(probe(name))

        return forward_hook

    for i, block in enumerate(model.module.blocks):
        block.up.register_forward_hook(watch(f"blocks.{i}"))
    x = global_batch(MLP, 0)["x"].chunk(dist.get_world_size())[dist.get_rank()]
    for _ in range(2):
        seen.clear()
        model(x).pow(2).mean().backward()
    return seen


def test_backward_prefetches_only_after_the_first_unit_finished_its_backward():
    # While the first unit runs its backward every activation is still alive, so nothing is
    # gathered ahead (it would raise the step's peak); after that, one unit ahead.
    for seen in run_on_ranks(2, on_ranks_backward_prefetch):
        assert seen == [("blocks.2", []), ("blocks.1", ["blocks.0"]), ("blocks.0", [])], seen


def on_ranks_reshard_before_flat_grad(stage: int) -> list:
    from shardwrap import ShardedModule

    model = ShardedModule(build_model(MLP), auto_wrap_policy={models.Block}, stage=stage)
    seen = []
    for unit in model.units[1:]:
        def arrived(grad, unit=unit):  # the flat gradient exists: autograd's split node has run
            seen.append((unit.name, unit.data_state.name, unit.unsharded_buffer.untyped_storage().nbytes()))

        unit.unsharded_trainable.register_hook(arrived)
    x = global_batch(MLP, 0)["x"].chunk(dist.get_world_size())[dist.get_rank()]
    model(x).pow(2).mean().backward()
    return seen


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_unit_frees_its_parameters_before_its_flat_gradient_is_allocated(stage):
    # The stages that reshard after backward (2 and 3) never hold a unit's full parameters and
    # its full flat gradient at once (the end of backward's peak, design/notes/prefetch.md);
    # stage 1 keeps the parameters.
    for seen in run_on_ranks(2, on_ranks_reshard_before_flat_grad, stage):
        assert [name for name, _, _ in seen] == ["blocks.2", "blocks.1", "blocks.0"], seen
        if stage > 1:
            assert all(state == "SHARDED" and nbytes == 0 for _, state, nbytes in seen), seen
        else:
            assert all(state == "UNSHARDED" and nbytes > 0 for _, state, nbytes in seen), seen


def on_ranks_backward_gathers_of_a_unit_called_three_times() -> int:
    from shardwrap import ShardedModule
    from shardwrap.unit import DataState, Unit

    model = ShardedModule(models.twice(), auto_wrap_policy={models.Block}, stage=3)
    gathers = []
    original = Unit.unshard

    def counted(unit, *args, **kwargs):
        if unit.name == "shared" and unit.data_state is DataState.SHARDED and model.in_backward():
            gathers.append(unit.name)
        return original(unit, *args, **kwargs)

    Unit.unshard = counted  # type: ignore[method-assign]
    try:
        x = torch.randn(4, 16)
        model(x).pow(2).mean().backward()
    finally:
        Unit.unshard = original  # type: ignore[method-assign]
    return len(gathers)


def test_a_unit_called_three_times_is_gathered_once_in_backward():
    # The early reshard waits for the backward of the unit's last forward call: resharding after
    # each call's views were done would gather it again for the next (three all-gathers, not one).
    assert run_on_ranks(2, on_ranks_backward_gathers_of_a_unit_called_three_times) == [1, 1]


# ---- memory and communication per stage ----------------------------------------------------------


def model_state_bytes(model, opt) -> int:
    tensors = list(model.parameters()) + [h.unsharded_buffer for h in model.units]
    tensors += [h.unsharded_trainable.grad for h in model.units]
    tensors += [p.grad for p in model.parameters()]
    tensors += [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    seen, total = set(), 0
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def on_ranks_stage_memory_and_bytes(stage: int) -> dict:
    from shardwrap import ShardedModule
    from shardwrap.collectives import count_collectives

    big = Case("mlp", {"dim": 48, "depth": 4}, policy="Block", dim=48)
    model = ShardedModule(build_model(big), auto_wrap_policy=resolve_policy(big), stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    peak, counts = 0, None
    for step in range(3):
        batch = {k: v.chunk(world)[rank] for k, v in global_batch(big, step).items()}
        with count_collectives() as counted:
            loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
            peak = max(peak, model_state_bytes(model, opt))
            loss.backward()
            peak = max(peak, model_state_bytes(model, opt))
        opt.step()
        peak = max(peak, model_state_bytes(model, opt))
        opt.zero_grad()
        counts = dict(counted)
    return {
        "peak": peak,
        "counts": counts,
        "psi": sum(p.numel() for p in build_model(big).parameters()),
        "padded": sum(h.layout.shard_numel + 1 for h in model.units) * world,  # padded Psi, tags included
        "largest_unit": max(h.layout.padded_unsharded_numel for h in model.units),
        "layouts": [(h.layout.shard_numel, h.layout.grad_shard_numel, h.layout.num_trainable) for h in model.units],
        "unit_psi": [sum(p.numel() for p in h.sharded_params) for h in model.units],
        "order": [h.name for h in model.units],
        "trainable_params": sum(h.layout.num_trainable for h in model.units),
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_and_communication_match_the_zero_formulas(stage):
    world = 3
    for r in run_on_ranks(world, on_ranks_stage_memory_and_bytes, stage):
        psi, padded, W = r["psi"], r["padded"], world
        pad = padded - psi  # padding and tags, in elements over all ranks
        # fp32 AdamW: 4 bytes parameter, 4 gradient, 8 optimizer state.
        formula = {
            1: 4 * psi + 4 * psi + 8 * psi / W,
            2: 4 * psi + 12 * psi / W,
            3: 16 * psi / W,
        }[stage]
        slack = 16 * pad + (4 * r["largest_unit"] if stage == 2 else 0)  # + the unit in flight
        assert formula - 16 * pad <= r["peak"] <= formula + slack, (stage, r["peak"], formula, slack)
        # Communication: elements each rank sends in ring collectives = Psi (W - 1) / W per pass.
        c = r["counts"]
        sent_ag = c["all_gather"] * (W - 1)
        sent_rs = c["reduce_scatter"] * (W - 1) / W
        # Stage 3 gathers every unit again for backward, except the root and the unit that ended
        # the last forward (blocks.3 here), which backward needs first and forward left unsharded.
        assert r["order"] == ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"], r["order"]
        gathers = [1 + (stage == 3 and i not in (0, len(r["order"]) - 1)) for i in range(len(r["order"]))]
        passes_psi = sum(n * g for n, g in zip(r["unit_psi"], gathers))
        one_pass = psi * (W - 1) / W
        assert passes_psi * (W - 1) / W <= sent_ag <= (passes_psi + pad * max(gathers)) * (W - 1) / W, (stage, sent_ag, one_pass)
        # the reduce-scatters also carry a used-flag per trainable parameter and rank
        assert one_pass <= sent_rs <= (psi + pad + W * r["trainable_params"]) * (W - 1) / W, (stage, sent_rs, one_pass)
        # Every byte of a step, from the layouts: each unit's all-gathers (its shard and the tag, in
        # fp32) after 2 x int64 headers (design/notes/rank-agreement.md), its reduce-scatter
        # (W rows of its gradient shard and a used-flag per trainable parameter:
        # design/notes/unused-parameters.md), and one 2 x int64 count exchange at the first unit
        # backward schedules (every reduce-scatter here is pairwise, and its receives say when the
        # peers started it: design/notes/collective-schedule.md). Nothing else: which parameters
        # got a gradient rides in the reduce-scatters.
        # Stage 2 gathers every unit after the first when the first one's forward starts, all under
        # one header (design/notes/prefetch.md, "Stage 2 on a CPU").
        headers = 2 if stage == 2 else sum(gathers)
        expected = sum(4 * (S + 1) * g + 4 * W * (G + k) * (k > 0) for (S, G, k), g in zip(r["layouts"], gathers))
        expected += 16 * headers + 16
        assert c["counts_calls"] == 1 and c["headers_calls"] == headers, c
        assert c["bytes"] == expected, (stage, c, expected)
        assert set(k for k in c if not k.endswith("_calls")) == {"all_gather", "reduce_scatter", "counts", "headers", "bytes"}, c


# ---- bad input -----------------------------------------------------------------------------------


def test_mixed_precision_rejects_non_floating_dtypes():
    from shardwrap import MixedPrecision

    with pytest.raises(ValueError, match=r"MixedPrecision\(param_dtype=torch.int8\).*floating"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"reduce_dtype='bf16'"):
        MixedPrecision(reduce_dtype="bf16")


def on_ranks_clip_inside_no_sync() -> str:
    from shardwrap import ShardedModule

    model = ShardedModule(models.mlp(8, 2), auto_wrap_policy={models.Block})
    with model.no_sync():
        model(torch.randn(4, 8)).sum().backward()
    try:
        model.clip_grad_norm_(1.0)
    except RuntimeError as exc:
        message = str(exc)
    model(torch.randn(4, 8)).sum().backward()  # the syncing backward still works afterwards
    return message


def test_clip_inside_no_sync_accumulation_is_refused():
    for message in run_on_ranks(2, on_ranks_clip_inside_no_sync):
        assert "no_sync()" in message and "not reduced" in message


def on_ranks_bad_max_unsharded() -> str:
    from shardwrap import ShardedModule

    try:
        ShardedModule(models.mlp(8, 2), max_unsharded=0)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_max_unsharded_must_be_positive():
    for message in run_on_ranks(2, on_ranks_bad_max_unsharded):
        assert "max_unsharded=0" in message


# ---- fp16 with dynamic loss scaling ------------------------------------------------------------


def on_ranks_loss_scaling(stage: int, scaled: bool, overflow_step: int | None) -> dict:
    """fp16 training of one Linear unit, optionally through torch's ShardedGradScaler. At
    ``overflow_step`` the loss weighs output ``d - 1`` so heavily that only its weight row and bias
    overflow: parameters are split along dim 0, so only the last rank's shard holds an inf."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from shardwrap import MixedPrecision, ShardedModule

    d = 8
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(d, d))
    model = ShardedModule(net, auto_wrap_policy={torch.nn.Linear}, stage=stage,
                          mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8) if scaled else None
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"skipped": [], "scales": [], "finite_local_grads": []}
    for step in range(4):
        x = global_batch(Case("mlp"), step)["x"][:, :d].chunk(world)[rank]
        weight = torch.ones(d)
        if step == overflow_step:
            weight[-1] = 1e4  # with the scale, the gradient of output d-1 passes fp16's 65504
        loss = (model(x).float() * weight).pow(2).mean()
        before = [p.detach().clone() for p in model.parameters()]
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            out["finite_local_grads"].append(all(torch.isfinite(p.grad).all().item() for p in model.parameters()))
            scaler.step(opt)
            out["scales"].append(scaler.get_scale())
            scaler.update()
        out["skipped"].append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        opt.zero_grad()
    out["state"] = model.full_state_dict()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_loss_scaling_with_sharded_grad_scaler(stage):
    """torch's ShardedGradScaler works on shardwrap's shards: scaled fp16 training equals unscaled
    fp16 training while nothing overflows (the scale is a power of two), and an overflow in one
    rank's shard skips the step on every rank, so the ranks never diverge. (So does a plain
    torch.amp.GradScaler on torch 2.13: on DTensor gradients DTensor all-reduces its inf check
    over the mesh, which the Lightning tests rely on.)"""
    plain = run_on_ranks(2, on_ranks_loss_scaling, stage, False, None)[0]
    scaled = run_on_ranks(2, on_ranks_loss_scaling, stage, True, None)[0]
    assert scaled["skipped"] == [False] * 4
    for k, v in plain["state"].items():
        torch.testing.assert_close(scaled["state"][k], v, rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")
    ranks = run_on_ranks(2, on_ranks_loss_scaling, stage, True, 2)
    assert [r["finite_local_grads"][2] for r in ranks] == [True, False]  # the inf is in rank 1's shard only
    for r in ranks:
        assert r["skipped"] == [False, False, True, False], r["skipped"]
        assert r["scales"] == [256.0, 256.0, 256.0, 128.0], r["scales"]
    for k, v in ranks[0]["state"].items():
        assert torch.isfinite(v).all(), k


def on_ranks_headers_of_gathers_started_together(lists: list[list[int]]) -> str | None:
    """Rank r checks in for the gathers of ``lists[r]`` started together (stage 2's forward on a
    CPU), as the first of those units does; returns the error, if any."""
    from shardwrap import ShardedModule

    model = ShardedModule(models.mlp(8, 3), auto_wrap_policy={models.Block}, stage=2)
    mine = lists[dist.get_rank()]
    try:
        model.units[mine[0]].check_in(following=[model.units[i] for i in mine])
    except RuntimeError as exc:
        return str(exc)
    return None


def test_one_header_covers_the_gathers_started_together():
    """One header for all the gathers a stage-2 forward starts at once: ranks that start the same
    units pass; another number of units (a rank whose list is a prefix of its peer's) or other units
    after the same first one raise on every rank, before any data moves."""
    assert run_on_ranks(2, on_ranks_headers_of_gathers_started_together, [[1, 2, 3], [1, 2, 3]]) == [None, None]
    for lists, says in [([[1, 2, 3], [1, 2]], "the first of 3 gathers"), ([[1, 2, 3], [1, 3, 2]], "other units after it")]:
        errors = run_on_ranks(2, on_ranks_headers_of_gathers_started_together, lists)
        assert all(e and "ranks disagree on the next collective" in e and says in e for e in errors), (lists, errors)


def test_a_gather_header_says_how_many_gathers_its_rank_started_together():
    from shardwrap import collectives
    from shardwrap.schedule import header_text

    names = ["<root>", "blocks.0", "blocks.1"]
    assert header_text(collectives.HEADER_FORWARD, 1, names) == "all-gather of unit 'blocks.0' in forward"
    assert header_text(collectives.HEADER_FORWARD + (0xABCDEF << 8), 1 + (2 << 32), names) == (
        "all-gather of unit 'blocks.0' in forward (the first of 2 gathers started together)")
    assert header_text(collectives.HEADER_BACKWARD, 7, names) == "all-gather of unit '#7' in backward"
    # the history in bits 48 up is not part of what the header says it is (history_hint reads it)
    past = collectives.history(1030, 33) << collectives.HISTORY_SHIFT
    assert header_text(collectives.HEADER_FORWARD + (0xABCDEF << 8), 1 + (2 << 32) | past, names) == (
        "all-gather of unit 'blocks.0' in forward (the first of 2 gathers started together)")
    assert collectives.split_history(5 | past) == (5, 1030 % 1024, 33 % 32)


class CastInputs(torch.nn.Module):
    """A root whose forward takes a namedtuple, a dataclass or a tensor, and hands its Blocks an
    fp32 activation (its output plus an fp32 buffer): ``fully_shard`` casts each wrapped module's
    floating inputs to ``param_dtype``; shardwrap cast only the root's, so the Blocks met fp32
    inputs (a dtype error) and a namedtuple became a plain tuple."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(models.Block(16) for _ in range(2))
        self.register_buffer("pos", torch.randn(16))

    def forward(self, a):  # type: ignore[no-untyped-def]
        x = self.inp(a if self.kind == "tensor" else a.x)
        x = x + self.pos if self.kind == "tensor" else x  # bf16 + fp32: fp32 into the Blocks
        for block in self.blocks:
            x = block(x)
        return x


def on_ranks_input_casts(kind: str, stage: int, optim: str, output_dtype: torch.dtype | None = None) -> dict:
    """shardwrap and fully_shard, both bf16 compute with fp32 reduction, on the same data:
    the parameters after three steps, and each one's distance from the unwrapped fp32 run.
    ``output_dtype``: both get torch's ``MixedPrecisionPolicy`` with it (shardwrap takes the
    policy as it is)."""
    import collections
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from shardwrap import MixedPrecision, ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    Pair = collections.namedtuple("Pair", "x")

    @dataclasses.dataclass
    class Box:
        x: torch.Tensor

    def pack(x):  # type: ignore[no-untyped-def]
        return Pair(x) if kind == "namedtuple" else Box(x) if kind == "dataclass" else x

    bf16 = torch.bfloat16
    models_ = {}
    for impl in ("single", "fully_shard", "shardwrap"):
        torch.manual_seed(0)
        m = CastInputs(kind)
        torch_policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32, output_dtype=output_dtype)
        if impl == "shardwrap":
            ours = torch_policy if output_dtype is not None else MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32)
            m = ShardedModule(m, auto_wrap_policy={models.Block}, stage=stage, mixed_precision=ours)
        elif impl == "fully_shard":
            mesh, policy = init_device_mesh("cpu", (world,)), torch_policy
            for block in m.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=stage == 3)
            fully_shard(m, mesh=mesh, mp_policy=policy, reshard_after_forward=stage == 3)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(m.parameters(), lr=0.01)
        for step in range(3):
            x = torch.randn(4 * world, 16, generator=torch.Generator().manual_seed(step))
            x = x if impl == "single" else x.chunk(world)[rank]
            out = m(pack(x))
            assert out.dtype == (torch.float32 if impl == "single" else output_dtype or bf16), (impl, out.dtype)
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        models_[impl] = m
    full = models_["shardwrap"].full_state_dict(rank0_only=False)
    reference = {k: v.detach().full_tensor() if isinstance(v, DTensor) else v.detach() for k, v in models_["fully_shard"].state_dict().items()}
    single = dict(models_["single"].state_dict())
    return {
        "to fully_shard": max((full[k].float() - v.float()).abs().max().item() for k, v in reference.items()),
        "to single": max((full[k].float() - v.float()).abs().max().item() for k, v in single.items()),
        "fully_shard to single": max((reference[k].float() - v.float()).abs().max().item() for k, v in single.items()),
    }


@pytest.mark.parametrize("kind", ["tensor", "namedtuple", "dataclass"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_mixed_precision_casts_each_units_inputs_like_fully_shard(kind, stage, optim):
    for r in run_on_ranks(2, on_ranks_input_casts, kind, stage, optim):
        assert r["to fully_shard"] < 1e-6, r
        assert r["to single"] <= r["fully_shard to single"] + 1e-6, r  # no further from fp32 than fully_shard


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_torchs_mixed_precision_policy_with_an_output_dtype_trains_like_fully_shard(stage, optim):
    """``fully_shard``'s ``MixedPrecisionPolicy`` passed as it is, with ``output_dtype=float32``:
    each unit's output is cast, as there (the root's output is fp32)."""
    for r in run_on_ranks(2, on_ranks_input_casts, "tensor", stage, optim, torch.float32):
        assert r["to fully_shard"] < 1e-6, r
        assert r["to single"] <= r["fully_shard to single"] + 1e-6, r


class CastsItself(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.to(self.lin.weight.dtype))


def on_ranks_input_dtype_seen(cast: bool) -> list[torch.dtype]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from shardwrap import MixedPrecision, ShardedModule

    seen = []
    for impl in ("fully_shard", "shardwrap"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(CastsItself())
        if impl == "shardwrap":
            policy = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=cast)
            model = ShardedModule(model, auto_wrap_policy={CastsItself}, mixed_precision=policy)
        else:
            fully_shard(model[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=cast))
        model[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))  # after the unit's own
        model(torch.randn(2, 4)).sum().backward()
    return seen


@pytest.mark.parametrize("cast", [True, False])
def test_cast_forward_inputs_false_leaves_a_units_inputs_as_they_come(cast):
    for seen in run_on_ranks(2, on_ranks_input_dtype_seen, cast):
        expected = torch.bfloat16 if cast else torch.float32
        assert seen == [expected, expected], seen  # fully_shard's, then shardwrap's


def on_ranks_fp16_sum(stage: int, pure: bool, per_rank: float) -> tuple[torch.Tensor, bool]:
    import torch.nn as nn

    from shardwrap import MixedPrecision, ShardedModule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    if pure:
        model.half()
    model = ShardedModule(model, auto_wrap_policy={nn.Linear}, stage=stage,
                          mixed_precision=None if pure else MixedPrecision(param_dtype=torch.float16))
    x = torch.full((2, 4), per_rank / 2, dtype=torch.float16 if pure else torch.float32)
    model[0](x).float().sum().backward()  # each rank's weight gradient: per_rank everywhere
    grad = dict(model.named_parameters())["0.weight"].grad.full_tensor().float()
    torch.optim.SGD(model.parameters(), lr=1e-6).step()
    return grad, bool(dict(model.named_parameters())["0.weight"].full_tensor().isfinite().all())


@pytest.mark.parametrize("pure", [False, True], ids=["mixed-fp16", "model-half"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size, per_rank", [(2, 40000.0), (4, 20000.0)])
def test_an_fp16_reduce_keeps_a_gradient_whose_mean_fits(world_size, per_rank, stage, pure):
    """An fp16 reduce summed the ranks' gradients and divided after: a mean that fits fp16
    (65504) whose sum does not came out inf, silently (an audit; ``fully_shard`` divides part
    before the sum). Now a power of two near the square root of the rank count goes before it,
    as there: at W=2 the whole average, at W=4 half of it."""
    for grad, finite in run_on_ranks(world_size, on_ranks_fp16_sum, stage, pure, per_rank):
        assert torch.equal(grad, torch.full((4, 4), per_rank)) and finite, grad
