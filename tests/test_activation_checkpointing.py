"""Activation checkpointing in every stage, against the unwrapped model trained with the same
checkpointing (design/notes/activation-checkpointing.md).

Variants:
  fn_non_reentrant / fn_reentrant   the model's forward calls torch.utils.checkpoint.checkpoint
                                    on each Block (``models.checkpointed_mlp``)
  twice_reentrant / twice_non_reentrant
                                    the first Block runs twice inside one checkpointed region: the
                                    unit must stay gathered until both calls' backward is done
  span_reentrant / span_non_reentrant
                                    the first two Blocks run inside one checkpointed region: the
                                    recomputation of the second must not free the first, whose
                                    recomputed activations the nested backward still reads
  inside_reentrant / inside_non_reentrant
                                    each Block checkpoints part of its own forward
                                    (``models.inner_checkpointed_mlp``): the unit's gradient
                                    arrives twice in one backward, once from a nested backward
  late_reentrant / late_non_reentrant
                                    each Block checkpoints the last part of its own forward: the
                                    nested backward runs while the outer one still needs the
                                    unit's parameters (the unit must not reshard after it)
  two_reentrant / two_inside_reentrant
                                    two checkpointed regions in each Block (norm outside them, or
                                    every parameter inside): the second recomputation reads the
                                    slots after the first nested backward is done
  nested_reentrant                  the model checkpoints each whole late_reentrant Block: nested
                                    backwards two deep
  wrapper_before / wrapper_after    torch's apply_activation_checkpointing on the Blocks, before or
                                    after wrapping with ShardedModule (``models.mlp_checkpoint_wrapped``)
  fn_selective / wrapper_selective  selective checkpointing (matrix products saved, the rest
                                    recomputed): checkpoint(block, context_fn=...) in the forward,
                                    or checkpoint_wrapper(context_fn=...) before wrapping
  hf_default / hf_reentrant / hf_non_reentrant
                                    HF GPT-2 with gradient_checkpointing_enable() (kwargs None,
                                    use_reentrant True, use_reentrant False)
  none / hf_none                    no checkpointing: sanity for this file's own reading of the
                                    parameters

After the steps every parameter is read on every rank -- its local shards, ``state_dict()``
(each DTensor's ``full_tensor()``), ``full_state_dict(rank0_only=False)`` -- and an evaluation
loss is taken; all must equal the reference's. A rank worker that dies (SIGSEGV) or hangs becomes
a ``RankTimeout`` failure (``harness.run_on_ranks``, ``timeout=TIMEOUT``), and the pool of worker
processes is replaced for the next test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint

import models
from harness import RankError, run_on_ranks
from parity import (
    Case,
    assert_close_params,
    build_model,
    build_optimizer,
    expected_chunk,
    global_batch,
    loss_fn,
    resolve_policy,
    train_reference,
)

WORLD = 2
TIMEOUT = 120  # seconds: a dead or hung rank fails the test instead of freezing the suite
EVAL_STEP = 10_000  # the evaluation batch comes from a step no training batch uses
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."  # what CheckpointWrapper inserts into parameter names

_MLP = {"dim": 16, "depth": 3}
_GPT2 = {"n_layer": 2, "n_embd": 32}

# variant -> (build of the reference (and of the ranks, except wrapper_after: see sharded_build), build_kwargs, policy, data)
VARIANTS = {
    "none": ("checkpointed_mlp", {**_MLP, "checkpoint": None}, "Block", "regression"),
    "fn_non_reentrant": ("checkpointed_mlp", {**_MLP, "checkpoint": "non_reentrant"}, "Block", "regression"),
    "fn_reentrant": ("checkpointed_mlp", {**_MLP, "checkpoint": "reentrant"}, "Block", "regression"),
    "fn_selective": ("checkpointed_mlp", {**_MLP, "checkpoint": "selective"}, "Block", "regression"),
    "twice_reentrant": ("checkpointed_mlp", {**_MLP, "checkpoint": "reentrant", "twice": True}, "Block", "regression"),
    "twice_non_reentrant": ("checkpointed_mlp", {**_MLP, "checkpoint": "non_reentrant", "twice": True}, "Block", "regression"),
    "span_reentrant": ("checkpointed_mlp", {**_MLP, "checkpoint": "reentrant", "span": True}, "Block", "regression"),
    "span_non_reentrant": ("checkpointed_mlp", {**_MLP, "checkpoint": "non_reentrant", "span": True}, "Block", "regression"),
    "inside_reentrant": ("inner_checkpointed_mlp", {**_MLP, "checkpoint": "reentrant"}, "Block", "regression"),
    "inside_non_reentrant": ("inner_checkpointed_mlp", {**_MLP, "checkpoint": "non_reentrant"}, "Block", "regression"),
    "late_reentrant": ("inner_checkpointed_mlp", {**_MLP, "checkpoint": "reentrant", "part": "late"}, "Block", "regression"),
    "late_non_reentrant": ("inner_checkpointed_mlp", {**_MLP, "checkpoint": "non_reentrant", "part": "late"}, "Block", "regression"),
    "two_reentrant": ("inner_checkpointed_mlp", {**_MLP, "checkpoint": "reentrant", "part": "two"}, "Block", "regression"),
    "two_inside_reentrant": ("inner_checkpointed_mlp", {**_MLP, "checkpoint": "reentrant", "part": "two_inside"}, "Block", "regression"),
    "nested_reentrant": ("inner_checkpointed_mlp", {**_MLP, "checkpoint": "reentrant", "part": "late", "outer": True}, "Block", "regression"),
    "wrapper_before": ("mlp_checkpoint_wrapped", _MLP, "Block", "regression"),
    "wrapper_after": ("mlp_checkpoint_wrapped", _MLP, "Block", "regression"),
    "wrapper_selective": ("mlp_checkpoint_wrapped", {**_MLP, "selective": True}, "Block", "regression"),
    "hf_none": ("gpt2", _GPT2, "GPT2Block", "lm"),
    "hf_default": ("gpt2_checkpointed", {**_GPT2, "checkpoint_kwargs": None}, "GPT2Block", "lm"),
    "hf_reentrant": ("gpt2_checkpointed", {**_GPT2, "checkpoint_kwargs": {"use_reentrant": True}}, "GPT2Block", "lm"),
    "hf_non_reentrant": ("gpt2_checkpointed", {**_GPT2, "checkpoint_kwargs": {"use_reentrant": False}}, "GPT2Block", "lm"),
}
CHECKPOINTED = [v for v in VARIANTS if v not in ("none", "hf_none")]


def make_case(variant: str, stage: int, **kwargs) -> Case:
    build, build_kwargs, policy, data = VARIANTS[variant]
    return Case(build, dict(build_kwargs), policy=policy, data=data, seq=8 if data == "lm" else 0, stage=stage, **kwargs)


def sharded_build(variant: str, case: Case) -> Case:
    """What the ranks build: for ``wrapper_after`` the plain MLP, checkpointed after wrapping."""
    return dataclasses.replace(case, build="mlp") if variant == "wrapper_after" else case


def state_dict_name(name: str) -> str:
    """A parameter's name in ``state_dict()``: CheckpointWrapper's state-dict hook drops its prefix."""
    return name.replace(CHECKPOINT_PREFIX, "")


def eval_batch(case: Case, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    return {k: v.chunk(world)[rank] for k, v in global_batch(case, EVAL_STEP).items()}


def evaluate(case: Case, model: torch.nn.Module, rank: int = 0, world: int = 1) -> float:
    model.eval()
    try:
        with torch.no_grad():
            return loss_fn(case, model, eval_batch(case, rank, world)).item()
    finally:
        model.train()


def count_unit_forwards(model: torch.nn.Module, case: Case) -> list[int]:
    """Count calls of each unit module's first child, or its last where the unit checkpoints
    only a later part of its forward (a forward pre-hook: it fires in a recomputation too, even
    one that non-reentrant checkpointing stops early). With checkpointing every unit runs twice
    per step: in forward and recomputed in backward."""
    calls = [0]

    def count(module: torch.nn.Module, args: object) -> None:
        calls[0] += 1

    for module in model.modules():
        if isinstance(module, tuple(resolve_policy(case))):
            children = list(module.children())
            (children[-1] if getattr(module, "part", "early") != "early" else children[0]).register_forward_pre_hook(count)
    return calls


def unit_forwards_per_step(case: Case) -> int:
    """The unwrapped model's unit calls in one forward and backward (on the global batch)."""
    model = build_model(case)
    calls = count_unit_forwards(model, case)
    loss_fn(case, model, global_batch(case, 0)).backward()
    return calls[0]


def train_and_read(case: Case, apply_after: bool) -> dict:
    """Runs on every rank: train ``case.steps`` steps on this rank's chunk, then read every
    parameter three ways and take the evaluation loss."""
    from torch.distributed.tensor import DTensor

    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    model = ShardedModule(build_model(case), auto_wrap_policy=resolve_policy(case), stage=case.stage, max_unsharded=case.max_unsharded)
    policy_classes = tuple(resolve_policy(case))
    unit_names = sorted(u.name for u in model.units[1:])  # pre-order: the root unit first
    policy_modules = sorted(n for n, m in model.named_modules() if isinstance(m, policy_classes))
    if apply_after:
        models.apply_block_checkpointing(model)
    calls = count_unit_forwards(model, case)
    opt = build_optimizer(case, model)
    losses, norms = [], []
    for step in range(case.steps):
        batch = {k: v.chunk(world)[rank] for k, v in global_batch(case, step).items()}
        loss = loss_fn(case, model, batch)
        loss.backward()
        losses.append(loss.item())
        if case.clip is not None:
            norms.append(model.clip_grad_norm_(case.clip, case.norm_type).item())
        opt.step()
        opt.zero_grad(set_to_none=case.set_to_none)
    unit_forwards = calls[0]
    local = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    buffers = {state_dict_name(n) for n, _ in model.named_buffers()}
    sharded, not_dtensor = {}, []
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        elif key not in buffers:
            not_dtensor.append(key)
        sharded[key] = value.detach().clone()
    full = model.full_state_dict(rank0_only=False)
    return {
        "unit_names": unit_names,
        "unit_forwards": unit_forwards,
        "policy_modules": policy_modules,
        "local": local,
        "sharded": sharded,
        "not_dtensor": not_dtensor,
        "full": full,
        "losses": losses,
        "norms": norms,
        "eval": evaluate(case, model, rank, world),
    }


def reference(case: Case) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[float], list[float], float]:
    """The unwrapped model with the same checkpointing, trained in one process on the whole global
    batch: (state dict, named parameters, losses, norms, evaluation loss)."""
    state, losses, norms = train_reference(case)
    model = build_model(case)
    model.load_state_dict(state)
    named = {n: p.detach().clone() for n, p in model.named_parameters()}
    return state, named, losses, norms, evaluate(case, model)


def check(variant: str, case: Case) -> None:
    expected, named, ref_losses, ref_norms, ref_eval = reference(case)
    results = run_on_ranks(WORLD, train_and_read, sharded_build(variant, case), variant == "wrapper_after", timeout=TIMEOUT)
    forwards = case.steps * unit_forwards_per_step(case)
    what = lambda rank, kind, name: f"rank {rank} {kind} '{name}'"  # noqa: E731
    for rank, r in enumerate(results):
        assert r["unit_forwards"] == forwards, f"rank {rank}: units ran {r['unit_forwards']} times in training, reference {forwards}"
        assert r["unit_names"] == r["policy_modules"], f"rank {rank}: units {r['unit_names']} != policy modules {r['policy_modules']}"
        # Local shards: torch.chunk of the reference, under the names named_parameters() gives.
        assert sorted(r["local"]) == sorted(named), f"rank {rank}: named_parameters() names differ from the reference's"
        for name, value in r["local"].items():
            chunk = expected_chunk(named[name], WORLD, rank)
            assert_close_params(value, chunk, case.optim, case.steps, what(rank, "local shard", name))
        assert r["not_dtensor"] == [], f"rank {rank}: state_dict() gave plain tensors for parameters {r['not_dtensor']}"
        for kind in ("sharded", "full"):
            got = r[kind]
            assert list(got) == list(expected), f"rank {rank} {kind} state dict keys {list(got)} != reference {list(expected)}"
            for name, value in expected.items():
                assert got[name].dtype == value.dtype, what(rank, kind, name) + f": dtype {got[name].dtype} != {value.dtype}"
                assert_close_params(got[name], value, case.optim, case.steps, what(rank, kind, name))
    tol = 1e-4
    for step, ref in enumerate(ref_losses):
        mean = sum(r["losses"][step] for r in results) / WORLD
        assert abs(mean - ref) <= tol * max(1.0, abs(ref)), f"loss at step {step}: {mean} vs reference {ref}"
    for rank, r in enumerate(results):
        assert len(r["norms"]) == len(ref_norms)
        for step, (ours, ref) in enumerate(zip(r["norms"], ref_norms)):
            assert abs(ours - ref) <= 1e-5 * max(1.0, ref), f"rank {rank} clip_grad_norm_ at step {step}: {ours} vs reference {ref}"
    mean_eval = sum(r["eval"] for r in results) / WORLD
    assert abs(mean_eval - ref_eval) <= tol * max(1.0, abs(ref_eval)), f"evaluation loss {mean_eval} vs reference {ref_eval}"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpointing_sgd(stage, variant):
    check(variant, make_case(variant, stage, optim="sgd"))


@pytest.mark.parametrize("variant", ["fn_non_reentrant", "hf_default", "inside_reentrant", "late_reentrant", "two_inside_reentrant", "fn_selective", "twice_reentrant"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpointing_adamw(stage, variant):
    check(variant, make_case(variant, stage, optim="adamw"))


@pytest.mark.parametrize("variant", ["fn_non_reentrant", "fn_reentrant", "hf_default"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpointing_with_clip_grad_norm(stage, variant):
    """clip_grad_norm_ each step (max_norm small enough that every step clips): the returned norm
    equals torch.nn.utils.clip_grad_norm_ on the reference."""
    case = make_case(variant, stage, optim="sgd", clip=0.05)
    norms = train_reference(case)[2]
    assert min(norms) > case.clip, f"max_norm {case.clip} clips no step (norms {norms})"
    check(variant, case)


def test_reference_checkpointing_recomputes_and_changes_nothing():
    """The oracle's premise, in one process: every checkpointing variant recomputes each unit once
    in backward, and leaves the unwrapped model's training numbers unchanged (so a failure above
    is shardwrap's, not the reference's)."""
    for variant in VARIANTS:
        case = make_case(variant, 3)
        units = 2 if case.data == "lm" else 3
        units += variant.startswith("twice")  # the first Block runs twice
        # a Block checkpointed whole and in part: its first pass, its recomputation, and the
        # recomputation of its own checkpointed part inside that one's backward
        runs = 1 if variant in ("none", "hf_none") else 3 if variant == "nested_reentrant" else 2
        assert unit_forwards_per_step(case) == runs * units, variant
    plain = train_reference(make_case("none", 3))[0]
    for variant in ("fn_non_reentrant", "fn_reentrant", "wrapper_before"):
        got = train_reference(make_case(variant, 3))[0]
        assert list(got) == list(plain), variant
        for name, value in plain.items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{variant} '{name}': {m}")
    hf_plain = train_reference(make_case("hf_none", 3))[0]
    for variant in ("hf_default", "hf_reentrant"):
        got = train_reference(make_case(variant, 3))[0]
        assert list(got) == list(hf_plain), variant
        for name, value in hf_plain.items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{variant} '{name}': {m}")


def states_at_flat_gradient(case: Case) -> list[tuple[str, list[str]]]:
    """Runs on every rank: one step; at each block's post_backward (its flat gradient is complete,
    in backward order), the block's name and the blocks gathered at that moment."""
    from shardwrap import ShardedModule
    from shardwrap.unit import DataState, Unit

    rank, world = dist.get_rank(), dist.get_world_size()
    model = ShardedModule(build_model(case), auto_wrap_policy=resolve_policy(case), stage=case.stage)
    seen: list[tuple[str, list[str]]] = []
    original = Unit.post_backward

    def recording(unit: Unit) -> None:
        if unit.index > 0:  # the blocks; the root stays gathered for the head by design
            gathered = [u.name for u in model.units[1:] if u.data_state is DataState.UNSHARDED]
            seen.append((unit.name, gathered))
        original(unit)

    Unit.post_backward = recording  # type: ignore[method-assign]
    try:
        batch = {k: v.chunk(world)[rank] for k, v in global_batch(case, 0).items()}
        loss_fn(case, model, batch).backward()
    finally:
        Unit.post_backward = original  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("variant", ["fn_non_reentrant", "twice_non_reentrant", "hf_non_reentrant", "late_reentrant",
                                     "fn_reentrant", "twice_reentrant", "hf_reentrant", "two_inside_reentrant"])
def test_a_unit_reshards_before_its_flat_gradient(variant):
    """Stage 3 frees a unit's parameters once every set of views a backward awaits is done, before
    autograd allocates the flat gradient (``Unit._views_done``): a unit called twice stays
    gathered until both calls' views are done; a non-reentrant recomputation's views, which no
    backward runs through, are not awaited. A reentrant checkpoint's nested backward cannot know
    whether a later recomputation will read the unit's slots, so a unit whose gradient arrives
    there is freed at the next hook of the outermost backward instead: it is still gathered at
    its own flat gradient, and freed before the next block's (never more than the block and the
    one prefetched are gathered). A block that checkpoints its last part (late_reentrant) gets a
    gradient from the nested backward first (still gathered: the outer backward reads it) and
    one from the outer backward last (freed before it)."""
    case = make_case(variant, 3)
    nested = variant in ("fn_reentrant", "twice_reentrant", "hf_reentrant", "two_inside_reentrant")
    seen = run_on_ranks(WORLD, states_at_flat_gradient, case, timeout=TIMEOUT)
    for rank_seen in seen:
        names = list(dict.fromkeys(name for name, _ in rank_seen))  # backward order
        assert len(names) >= (2 if case.data == "lm" else 3), rank_seen
        for i, name in enumerate(names):
            states = [gathered for n, gathered in rank_seen if n == name]
            for gathered in states:
                assert not set(names[:i]) & set(gathered) and len(gathered) <= 2, (name, rank_seen)
            assert (name in states[-1]) == nested, (name, rank_seen)


# ---- several backwards over one step's forwards --------------------------------------------------


def separate_backwards(pattern: str, stage: int, rank: int | None) -> dict[str, torch.Tensor]:
    """Blocks that reentrant-checkpoint their last part, two SGD steps of: two forwards, then one
    backward each (``"two_forwards"``); or one forward and two backwards (``"retain_graph"``).
    Each rank's loss is its sum over the global batch size, times the world size (the ranks'
    average is then the global batch's gradient). ``rank`` None: the unwrapped model, one process."""
    torch.manual_seed(0)
    model = models.inner_checkpointed_mlp(checkpoint="reentrant", part="late")
    if rank is not None:
        from shardwrap import ShardedModule

        model = ShardedModule(model, auto_wrap_policy={models.Block}, stage=stage)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(2):
        batch = global_batch(Case("mlp"), step)
        scale = WORLD / len(batch["x"]) if rank is not None else 1 / len(batch["x"])
        x, y = (batch["x"], batch["y"]) if rank is None else (batch["x"].chunk(WORLD)[rank], batch["y"].chunk(WORLD)[rank])
        if pattern == "two_forwards":
            halves = [((model(a) - b) ** 2).sum() * scale for a, b in zip(x.chunk(2), y.chunk(2))]
            for loss in halves:
                loss.backward()
        else:
            loss = ((model(x) - y) ** 2).sum() * scale
            loss.backward(retain_graph=True)
            loss.backward()
        opt.step()
        opt.zero_grad()
    if rank is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model.full_state_dict(rank0_only=False)


def on_ranks_separate_backwards(pattern: str, stage: int) -> dict[str, torch.Tensor]:
    return separate_backwards(pattern, stage, dist.get_rank())


@pytest.mark.parametrize("pattern", ["two_forwards", "retain_graph"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_separate_backwards_through_a_nested_backward(stage, pattern):
    # Each backward awaits the views its own forward calls' outputs lead to: a count of forward
    # calls, cleared at the end of the first backward, let the second one free the blocks inside
    # its nested backward while the outer backward still read them (stages 2 and 3 crashed:
    # "setStorage ... storage of size 0").
    want = separate_backwards(pattern, stage, None)
    for got in run_on_ranks(WORLD, on_ranks_separate_backwards, pattern, stage, timeout=TIMEOUT):
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage} {pattern} '{name}': {m}")


# ---- a unit recomputed on some ranks only ---------------------------------------------------------


class AuxNet(nn.Module):
    """Two blocks and an auxiliary head under reentrant checkpoints; the head's loss counts on rank 0
    only (a data-dependent auxiliary loss), so only rank 0's backward recomputes it."""

    def __init__(self) -> None:
        super().__init__()
        self.b0, self.b1 = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.aux, self.head = nn.Linear(8, 2), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.b0(x)
        a = torch.utils.checkpoint.checkpoint(self.aux, h, use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(self.b1, h, use_reentrant=True)
        return self.head(h), a


def aux_loss(out: tuple[torch.Tensor, torch.Tensor], with_aux: bool) -> torch.Tensor:
    y, a = out
    return y.pow(2).mean() + (a.pow(2).mean() if with_aux else 0.0)


def aux_optimizer(params, optim: str) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(params, lr=0.05)


def aux_batches(world: int, step: int, micro: int) -> list[torch.Tensor]:
    x = torch.randn(2 * world * micro, 8, generator=torch.Generator().manual_seed(step))
    return list(x.chunk(micro))


def on_ranks_aux_on_one_rank(stage: int, optim: str, micro: int) -> dict:
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ShardedModule(AuxNet(), auto_wrap_policy={nn.Sequential, nn.Linear}, stage=stage)
    opt = aux_optimizer(model.parameters(), optim)
    for step in range(3):
        for i, x in enumerate(aux_batches(world, step, micro)):
            loss = aux_loss(model(x.chunk(world)[rank]), rank == 0 and (i == 0 or micro == 1)) / micro
            if i < micro - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
    return {"full": model.full_state_dict(rank0_only=False)}


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_unit_a_reentrant_checkpoint_recomputes_on_one_rank_only(stage, optim, micro):
    # Only rank 0's loss reaches the auxiliary head, so only rank 0's backward recomputes it and
    # gets its gradient. Stages 1 and 2 reduce it on every rank at the end of the backward (rank 1
    # sends zeros) and train as one process does; before, rank 0's extra reduce-scatter paired with
    # nothing and both ranks hung (with no_sync the order digests differed). Stage 3 would need
    # rank 1 to gather it too: every rank raises, naming the fix, instead of hanging.
    world = 2
    torch.manual_seed(0)
    reference = AuxNet()
    opt = aux_optimizer(reference.parameters(), optim)
    for step in range(3):
        for i, x in enumerate(aux_batches(world, step, micro)):
            xs = x.chunk(world)
            losses = [aux_loss(reference(xs[r]), r == 0 and (i == 0 or micro == 1)) for r in range(world)]
            (sum(losses) / world / micro).backward()
        opt.step()
        opt.zero_grad()
    if stage == 3:
        with pytest.raises(RankError) as info:  # the harness starts a new pool: collectives were left half-done
            run_on_ranks(world, on_ranks_aux_on_one_rank, stage, optim, micro)
        assert sorted(info.value.failures) == [0, 1], info.value.failures
        for message in info.value.messages:
            assert "ranks disagree" in message and "use_reentrant=False" in message and "stage 1 or 2" in message, message
        return
    for r in run_on_ranks(world, on_ranks_aux_on_one_rank, stage, optim, micro):
        for name, value in reference.state_dict().items():
            assert_close_params(r["full"][name], value, optim, 3, name)
