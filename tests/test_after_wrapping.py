"""What users do to a model after wrapping it: honoured with the single-process answer, or refused
at the call with an error that says what to do (issue: hardening, part 7)."""

from __future__ import annotations

import copy
import inspect
import io
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import models
from harness import run_on_ranks

WORLD = 2
STEPS = 4
FREEZE_AT = 2  # steps before the freeze
FROZEN = "blocks.1.up.weight"


def batch(step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
    return (x, y) if rank is None else (x.chunk(WORLD)[rank], y.chunk(WORLD)[rank])


def train_freezing(model: nn.Module, rank: int | None) -> None:
    """SGD with momentum; ``FROZEN`` gets requires_grad_(False) after ``FREEZE_AT`` steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        if step == FREEZE_AT:
            dict(model.named_parameters())[FROZEN].requires_grad_(False)
        x, y = batch(step, rank)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def on_ranks_freeze(stage: int) -> dict[str, torch.Tensor]:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=stage)
    train_freezing(model, dist.get_rank())
    return model.full_state_dict(rank0_only=False)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_freezing_after_wrapping_matches_the_model_frozen_the_same_way(stage):
    torch.manual_seed(0)
    reference = models.mlp()
    before = reference.state_dict()[FROZEN].clone()
    train_freezing(reference, None)
    expected = reference.state_dict()
    assert not torch.equal(expected[FROZEN], before)  # it trained before the freeze (momentum then stops with grad=None)
    for got in run_on_ranks(WORLD, on_ranks_freeze, stage):
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def freeze_all_then_unfreeze(model: nn.Module, rank: int | None, counted, optim: str = "sgd") -> dict:  # type: ignore[no-untyped-def]
    """Two SGD steps; then every parameter frozen: a forward (a teacher's, without no_grad) and
    its backward; then ``inp`` and ``blocks.0`` frozen for a step (nothing before ``blocks.1``
    needs a gradient) and a forward with no backward (so a backward looks owed); then everything
    unfrozen for a step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(model.parameters(), lr=0.01)
    out: dict = {}

    def step(i: int) -> None:
        x, y = batch(i, rank)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()

    step(0)
    step(1)
    model.requires_grad_(False)
    x, y = batch(2, rank)
    loss = ((model(x) - y) ** 2).mean()
    out["frozen_requires_grad"] = loss.requires_grad
    try:
        loss.backward()
        out["frozen_backward"] = "no error"
    except RuntimeError as exc:
        out["frozen_backward"] = str(exc)
    model.requires_grad_(True)
    inner = model.module if hasattr(model, "module") else model
    for p in [*inner.inp.parameters(), *inner.blocks[0].parameters()]:
        p.requires_grad_(False)
    with counted() as c:
        step(3)
    out["counts"] = dict(c)
    x, y = batch(4, rank)
    ((model(x) - y) ** 2).mean()  # an evaluation loss computed with grad on, never backpropagated
    model.requires_grad_(True)
    step(4)
    out["params"] = {k: v.clone() for k, v in (model.full_state_dict(rank0_only=False) if hasattr(model, "full_state_dict") else model.state_dict()).items()}
    return out


def on_ranks_freeze_all(stage: int, hybrid: bool = False, optim: str = "sgd") -> dict:
    from parity import hybrid_mesh
    from shardwrap import ShardedModule
    from shardwrap.collectives import count_collectives

    torch.manual_seed(0)
    mesh = hybrid_mesh((2, 2)) if hybrid else None  # the batch still splits in WORLD parts: ranks r and r + 2 share one
    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=stage, mesh=mesh)
    return freeze_all_then_unfreeze(model, dist.get_rank() % WORLD, count_collectives, optim)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_model_frozen_after_wrapping_computes_like_a_frozen_model(stage, optim):
    """As under fully_shard: with every parameter frozen after wrapping, the output needs no
    gradient and backward raises as the unwrapped model's does; a unit frozen whole is left out of
    the backward (no reduce-scatter, and at stage 3 no gather for it); unfreezing trains again, with
    the unwrapped model's numbers throughout."""
    import contextlib
    from collections import Counter

    torch.manual_seed(0)
    reference = freeze_all_then_unfreeze(models.mlp(), None, lambda: contextlib.nullcontext(Counter()), optim)
    assert not reference["frozen_requires_grad"] and "does not require grad" in reference["frozen_backward"]
    for r in run_on_ranks(WORLD, on_ranks_freeze_all, stage, False, optim):
        assert not r["frozen_requires_grad"] and "does not require grad" in r["frozen_backward"], r
        c = r["counts"]
        assert c["reduce_scatter_calls"] == 3, c  # the root (its head), blocks.1 and blocks.2; not the frozen blocks.0
        if stage == 3:  # backward gathered blocks.1 and blocks.0 (the root and blocks.2 stay gathered): now blocks.1 only
            assert c["all_gather_calls"] == 4 + 1, c
        for name, value in reference["params"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_unit_frozen_whole_on_a_hybrid_mesh_has_no_all_reduce_over_replicas():
    """2 x 2 (ranks r and r + 2 hold one micro-batch): the unit frozen whole gets neither a
    reduce-scatter nor an all-reduce over replicas, the others get both, and the numbers are the
    unwrapped model's. (Its turn in the all-reduce order is skipped rather than waited for until
    the end of backward; that changes only when the others start, which no count shows.)"""
    import contextlib
    from collections import Counter

    torch.manual_seed(0)
    reference = freeze_all_then_unfreeze(models.mlp(), None, lambda: contextlib.nullcontext(Counter()))
    for r in run_on_ranks(4, on_ranks_freeze_all, 3, True):
        assert r["counts"]["replicate_all_reduce_calls"] == 3 and r["counts"]["reduce_scatter_calls"] == 3, r["counts"]
        for name, value in reference["params"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def on_ranks_refusals() -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    inner = models.mlp()
    frozen = inner.head.weight
    frozen.requires_grad_(False)
    inner.blocks[0].register_buffer("scale", torch.ones(3))  # torch's _apply converts buffers first
    model = ShardedModule(inner, auto_wrap_policy={models.Block}, stage=3)
    before = {k: v.clone() for k, v in model.full_state_dict(rank0_only=False).items()}
    out: dict = {}

    def refused(call) -> str:
        try:
            call()
        except Exception as exc:  # noqa: BLE001  (the test reads the type and the message)
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    out["double"] = refused(lambda: model.double())
    out["half"] = refused(lambda: model.half())
    out["to_dtype"] = refused(lambda: model.to(torch.bfloat16))
    out["deepcopy"] = refused(lambda: copy.deepcopy(model))
    out["torch_save"] = refused(lambda: torch.save(model, io.BytesIO()))
    out["ddp"] = refused(lambda: nn.parallel.DistributedDataParallel(model))
    # the same through the wrapped module and the modules inside it (model.module is the original)
    out["inner_double"] = refused(lambda: model.module.double())
    out["inner_to_dtype"] = refused(lambda: model.module.to(torch.float64))
    out["block_double"] = refused(lambda: model.module.blocks[0].double())
    out["inner_deepcopy"] = refused(lambda: copy.deepcopy(model.module))
    out["block_deepcopy"] = refused(lambda: copy.deepcopy(model.module.blocks[1].up))
    out["averaged"] = refused(lambda: torch.optim.swa_utils.AveragedModel(model.module))
    out["buffer_dtype"] = str(model.module.blocks[0].scale.dtype)
    model.module.to("cpu")
    model.module.blocks[0].float()
    # device-only moves and no-op conversions keep working, and training goes on
    model.to("cpu")
    model.cpu()
    model.float()
    model.to(torch.device("cpu"), torch.float32)
    x, y = batch(0, dist.get_rank())
    ((model(x) - y) ** 2).mean().backward()
    out["trains"] = all(p.grad is not None for p in model.parameters() if p.requires_grad)
    after = model.full_state_dict(rank0_only=False)
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    return out


def test_changes_after_wrapping_are_refused_with_what_to_do():
    for r in run_on_ranks(WORLD, on_ranks_refusals):
        for call in ("double", "half", "to_dtype"):
            assert r[call].startswith("TypeError") and "MixedPrecision" in r[call] and "before wrapping" in r[call], r[call]
        for call in ("deepcopy", "torch_save"):
            assert r[call].startswith("TypeError") and "full_state_dict" in r[call] and "save_checkpoint" in r[call], r[call]
        assert r["ddp"].startswith("TypeError") and "stage=1" in r["ddp"], r["ddp"]
        for call in ("inner_double", "inner_to_dtype", "block_double"):
            assert r[call].startswith("TypeError") and "MixedPrecision" in r[call] and "before wrapping" in r[call], r[call]
        for call, name in (("inner_deepcopy", "(model.module)"), ("block_deepcopy", "'blocks.1.up'"), ("averaged", "(model.module)")):
            assert r[call].startswith("TypeError") and name in r[call] and "full_state_dict" in r[call], r[call]
        assert r["buffer_dtype"] == "torch.float32", r  # refused before anything changed
        assert r["trains"] and r["unchanged"] and r["dtypes"] == ["torch.float32"], r


def on_ranks_policy_instance_and_signature() -> dict:
    from shardwrap import ShardedModule

    out = {}
    try:
        ShardedModule(models.mlp(), auto_wrap_policy=nn.Linear(4, 4))
        out["policy"] = "no error"
    except TypeError as exc:
        out["policy"] = str(exc)
    gpt2 = models.gpt2()
    expected = str(inspect.signature(gpt2.forward))
    model = ShardedModule(gpt2, auto_wrap_policy={models.gpt2_block_class()})
    out["signature"] = (str(inspect.signature(model.forward)), expected)
    ids = torch.randint(0, 96, (2, 8))
    out["loss"] = model(input_ids=ids, labels=ids).loss.item()
    return out


def test_policy_instance_is_refused_and_forward_shows_the_model_signature():
    for r in run_on_ranks(WORLD, on_ranks_policy_instance_and_signature):
        assert "auto_wrap_policy" in r["policy"] and "{Linear}" in r["policy"], r["policy"]
        got, expected = r["signature"]
        assert got == expected and "input_ids" in got and "labels" in got, r["signature"]
        assert r["loss"] > 0


def on_ranks_no_sync_accumulation(impl: str) -> dict[str, torch.Tensor]:
    """Four micro-batches, the first three under no_sync (or fully_shard's
    set_requires_gradient_sync(False)), bf16 compute and fp32 reduce; returns the full gradients,
    and this rank's oracle: each micro-batch's bf16 gradient summed in fp32, averaged over ranks."""
    from shardwrap import MixedPrecision, ShardedModule

    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = models.mlp()
    oracle_model = copy.deepcopy(plain).to(torch.bfloat16)
    if impl == "shardwrap":
        model = ShardedModule(plain, auto_wrap_policy={models.Block},
                              mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in plain.blocks:
            fully_shard(block, mp_policy=policy)
        model = fully_shard(plain, mp_policy=policy)
    oracle = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in oracle_model.named_parameters()}
    for micro in range(4):
        x, y = batch(100 + micro, rank)
        last = micro == 3
        if impl == "shardwrap":
            with (model.no_sync() if not last else torch.enable_grad()):
                ((model(x) - y) ** 2).mean().backward()
        else:
            model.set_requires_gradient_sync(last)
            ((model(x) - y) ** 2).mean().backward()
        ((oracle_model(x.bfloat16()) - y) ** 2).mean().backward()  # y stays fp32, as in the wrapped models
        for n, p in oracle_model.named_parameters():
            oracle[n] += p.grad.float()
            p.grad = None
    for value in oracle.values():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"grads": grads, "oracle": oracle}


def test_no_sync_accumulates_in_reduce_dtype_like_fully_shard():
    ours = run_on_ranks(WORLD, on_ranks_no_sync_accumulation, "shardwrap")
    theirs = run_on_ranks(WORLD, on_ranks_no_sync_accumulation, "fully_shard")
    for mine, fs in zip(ours, theirs):
        for name, oracle in mine["oracle"].items():
            # fp32 sums of the same bf16 gradients: equal up to the order of the additions
            torch.testing.assert_close(mine["grads"][name], oracle, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(mine["grads"][name], fs["grads"][name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} vs fully_shard: {m}")


def on_ranks_containers() -> dict:
    """A wrapped nn.Sequential indexes, iterates and has a length like the unwrapped one; a
    wrapped model that is no container raises TypeError for each, as it does unwrapped, and is
    still true in a condition."""
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    kinds = [type(m).__name__ for m in seq]
    model = ShardedModule(seq, auto_wrap_policy={nn.Linear}, stage=3)
    out = {
        "len": (len(model), len(seq)), "kinds": ([type(m).__name__ for m in model], kinds),
        "first_is_same": model[0] is seq[0], "slice": type(model[1:]).__name__, "bool": bool(model),
    }
    x = torch.randn(2, 4)
    out["through_index"] = model[1](x).shape == (2, 4)  # the ReLU: no parameters of its own
    plain = ShardedModule(nn.Linear(4, 4), auto_wrap_policy=set())
    errors = []
    for probe in (lambda: plain[0], lambda: iter(plain), lambda: len(plain)):
        try:
            probe()
        except TypeError as exc:
            errors.append(str(exc))
    out["errors"], out["plain_bool"] = errors, bool(plain)
    return out


def test_a_wrapped_container_indexes_iterates_and_has_a_length():
    for r in run_on_ranks(WORLD, on_ranks_containers):
        assert r["len"] == (3, 3) and r["kinds"][0] == r["kinds"][1], r
        assert r["first_is_same"] and r["slice"] == "Sequential" and r["bool"] and r["through_index"], r
        assert len(r["errors"]) == 3 and all("Linear" in e for e in r["errors"]), r["errors"]
        assert r["plain_bool"]


def on_ranks_replaced_parameters(stage: int) -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=stage)
    x, _ = batch(0, dist.get_rank())
    out = {"before": model(x).detach()}

    def refused(fn) -> str:
        try:
            fn()
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    up = model.module.blocks[0].up
    wrapped = up.weight
    up.weight = nn.Parameter(torch.zeros_like(wrapped.full_tensor()))  # e.g. a resized or re-tied weight
    out["assigned"] = refused(lambda: model(x))
    up.weight = wrapped  # put back: the model goes on
    params = dict(model.named_parameters())
    out["own_params"] = torch.equal(torch.func.functional_call(model, params, (x,)).detach(), out["before"])
    zeros = {n: torch.zeros_like(p.full_tensor()) for n, p in params.items()}
    out["functional_call"] = refused(lambda: torch.func.functional_call(model, zeros, (x,)))
    out["after"] = torch.equal(model(x).detach(), out["before"])
    down = model.module.blocks[1].down.weight
    down.data = torch.zeros_like(down.full_tensor())  # what torch.nn.utils.vector_to_parameters does
    out["data_swapped"] = refused(lambda: model(x))
    out["after_data"] = torch.equal(model(x).detach(), out["before"])  # undone: the model goes on
    with torch.no_grad():
        down.data = down.data.clamp(-0.01, 0.01)  # a DTensor on the right: DTensor drops it on the spot
    out["dtensor_data"] = refused(lambda: model(x))
    out["after_dtensor_data"] = torch.equal(model(x).detach(), out["before"])
    down.data = down.data * 0.5  # caught between steps too, before a state dict reads the old values
    out["between_steps"] = refused(lambda: model.full_state_dict())
    out["after_between_steps"] = torch.equal(model(x).detach(), out["before"])
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_replaced_after_wrapping_is_refused_at_the_next_forward(stage):
    # The unit would gather its own shard and silently compute without the new tensor (also
    # under fully_shard); now the next forward names it. functional_call with the model's own
    # parameters is no replacement and works. So for p.data = t (vector_to_parameters), which
    # the error undoes so that the model goes on.
    for r in run_on_ranks(WORLD, on_ranks_replaced_parameters, stage):
        for call, name in (
            ("assigned", "blocks.0.up.weight"), ("functional_call", "inp.weight"), ("data_swapped", "blocks.1.down.weight"),
            ("dtensor_data", "blocks.1.down.weight"), ("between_steps", "blocks.1.down.weight"),
        ):
            assert f"'{name}'" in r[call] and "replaced after wrapping" in r[call], r[call]
        for call in ("data_swapped", "dtensor_data", "between_steps"):
            assert "p.data = t" in r[call], r[call]
        assert r["own_params"] and r["after"] and r["after_data"] and r["after_dtensor_data"] and r["after_between_steps"], r


# ---- parameters that join the model after wrapping -----------------------------------------------


def train_plain(model: nn.Module, rank: int | None, after_step: Callable[[nn.Module], None] | None = None) -> None:
    """Three steps of SGD with momentum (the whole batch, or ``rank``'s chunk of it), calling
    ``after_step(model)`` after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = batch(step, rank)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model)


def on_ranks_joined_after_wrapping(stage: int) -> dict:
    """A LoRA-style layer put into a wrapped block (what PEFT's get_peft_model does to a model
    given after wrapping), then taken out again; a parameterless module added meanwhile stays."""
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=stage)
    block = model.module.blocks[0]
    torch.manual_seed(1)  # every rank adds the same layer
    block.lora = nn.Linear(16, 16)
    block.frozen = nn.Linear(16, 16).requires_grad_(False)  # unfrozen later, it would train unsynchronized
    block.extra = nn.Identity()  # no parameter: nothing to refuse
    x, _ = batch(0, dist.get_rank())
    out = {}
    try:
        model(x)
        out["refused"] = "no error"
    except RuntimeError as exc:
        out["refused"] = str(exc)
    del block.lora, block.frozen
    train_plain(model, dist.get_rank())
    out["full"] = model.full_state_dict()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_that_joins_the_model_after_wrapping_is_refused_at_the_next_forward(stage):
    """No unit shards a parameter added after wrapping, so each rank trained its own copy and
    never averaged it with the others' (1.5e-2 apart between two ranks after 3 steps; fully_shard
    the same). torch's global registration hooks now mark the model, and its next forward names
    every such parameter on every rank; with the layer removed, training goes on like one process."""
    torch.manual_seed(0)
    reference = models.mlp()
    train_plain(reference, None)
    for r in run_on_ranks(WORLD, on_ranks_joined_after_wrapping, stage):
        assert "'blocks.0.lora.weight', 'blocks.0.lora.bias', 'blocks.0.frozen.weight', 'blocks.0.frozen.bias' joined the model after ShardedModule wrapped it" in r["refused"], r["refused"]
        if r["full"]:
            for name, value in reference.state_dict().items():
                torch.testing.assert_close(r["full"][name], value, rtol=1e-5, atol=1e-6, msg=name)


# ---- parameters written inside a forward --------------------------------------------------------


class ClampsInForward(models.Block):
    """A weight constraint written inside the forward (WGAN-style clipping): ``"data"`` swaps
    the weight (``w.data = w.data.clamp(...)``), ``"in_place"`` clamps it under no_grad."""

    how = "data"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "data":
            self.up.weight.data = self.up.weight.data.clamp(-0.1, 0.1)
        else:
            with torch.no_grad():
                self.up.weight.clamp_(-0.1, 0.1)
        return super().forward(x)


def clamp_up_weights(model: nn.Module) -> None:
    """The constraint where it works: in place on model.parameters(), after every step."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("up.weight"):
                p.clamp_(-0.1, 0.1)


def on_ranks_written_inside_a_forward(stage: int) -> dict:
    from shardwrap import ShardedModule

    out = {}
    for how in ("data", "in_place"):
        torch.manual_seed(0)
        net = models.mlp()
        for block in net.blocks:
            block.__class__, block.how = ClampsInForward, how
        model = ShardedModule(net, auto_wrap_policy={ClampsInForward}, stage=stage)
        try:
            model(batch(0, dist.get_rank())[0])
            out[how] = "no error"
        except RuntimeError as exc:
            out[how] = str(exc)
    torch.manual_seed(0)
    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=stage)
    train_plain(model, dist.get_rank(), clamp_up_weights)
    out["full"] = model.full_state_dict()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_written_inside_a_forward_is_refused_naming_it(stage):
    """Inside a forward a unit's parameters are views of the gathered buffer. ``w.data = t``
    there swapped the view and trained on silently (the new values reached no shard, and the
    next forward undid them: 0.26 off one process after 3 steps, as under fully_shard); it is
    refused now, naming the parameter. An in-place clamp under no_grad met autograd's "returns
    multiple views" error, which named nothing; it now says which unit and what to do. What the
    messages advise (the clamp in place on model.parameters() after each step) trains like one
    process."""
    torch.manual_seed(0)
    reference = models.mlp()
    train_plain(reference, None, clamp_up_weights)
    for r in run_on_ranks(WORLD, on_ranks_written_inside_a_forward, stage):
        assert "'blocks.0.up.weight'" in r["data"] and "replaced parameter(s)" in r["data"] and "p.clamp_(-c, c)" in r["data"], r["data"]
        assert "in-place write to a view in the forward of unit 'blocks.0'" in r["in_place"] and "p.clamp_(-c, c)" in r["in_place"], r["in_place"]
        if r["full"]:
            for name, value in reference.state_dict().items():
                torch.testing.assert_close(r["full"][name], value, rtol=1e-5, atol=1e-6, msg=name)


# ---- gradients written through .data ----------------------------------------------------------


def grad_batch(step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 6, generator=g)  # 6 outputs: every dim 0 splits in 2
    return (x, y) if rank is None else (x.chunk(WORLD)[rank], y.chunk(WORLD)[rank])


def train_halving_grads(model: nn.Module, rank: int | None, optim: str) -> dict[str, str]:
    """Gradient surgery after each backward: every gradient halved. The wrapped model first tries
    torch.nn.utils.vector_to_parameters on the gradients (PCGrad's pattern) and a plain full
    gradient; each must be refused with nothing stepped. Then it halves them in place."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(params, lr=0.01)
    refusals: dict[str, str] = {}
    for step in range(STEPS):
        x, y = grad_batch(step, rank)
        ((model(x) - y) ** 2).mean().backward()
        if rank is not None and step == 1:
            grads = [p.grad for p in params]
            vector_to_parameters(parameters_to_vector(grads) * 0.5, grads)  # the .data of each gradient
            try:
                opt.step()
            except RuntimeError as exc:
                refusals["vector_to_parameters"] = str(exc)
            for p in params:  # what the user does next: a fresh gradient in its place
                p.grad = p.grad * 1.0
            kept = params[0].grad
            params[0].grad = kept.full_tensor()
            try:
                opt.step()
            except RuntimeError as exc:
                refusals["plain"] = str(exc)
            params[0].grad = kept
        with torch.no_grad():
            for p in params:
                p.grad.mul_(0.5)
        opt.step()
        opt.zero_grad()
    return refusals


def on_ranks_halving_grads(stage: int, optim: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(16, 2, 6), auto_wrap_policy={models.Block}, stage=stage)
    refusals = train_halving_grads(model, dist.get_rank(), optim)
    return refusals, model.full_state_dict()


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_gradient_written_through_data_is_refused_before_the_step(stage, optim):
    # p.grad.data = t leaves the DTensor gradient's local values as they were: the step used the
    # old gradients, silently (fully_shard too). Both that and a plain full gradient are refused
    # before anything steps, so the run still ends where one process ends.
    torch.manual_seed(0)
    reference = models.mlp(16, 2, 6)
    train_halving_grads(reference, None, optim)
    results = run_on_ranks(WORLD, on_ranks_halving_grads, stage, optim)
    for refusals, _ in results:
        assert "'inp.weight'" in refusals["vector_to_parameters"] and "had its .data replaced" in refusals["vector_to_parameters"], refusals
        assert "'inp.weight'" in refusals["plain"] and "is a plain Tensor of shape [16, 16]" in refusals["plain"], refusals
    full = results[0][1]
    assert sorted(full) == sorted(reference.state_dict())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)


# ---- weight clipping in place (a WGAN critic) -------------------------------------------------


def clip_weights(model: nn.Module, how: str) -> None:
    if how == "data":
        for p in model.parameters():
            p.data.clamp_(-0.05, 0.05)
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.05, 0.05)


def train_clipping(model: nn.Module, rank: int | None, how: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, rank)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        clip_weights(model, how)


def on_ranks_clip_weights(stage: int, how: str) -> dict[str, torch.Tensor]:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(16, 2), auto_wrap_policy={models.Block}, stage=stage)
    train_clipping(model, dist.get_rank(), how)
    return model.full_state_dict()


@pytest.mark.parametrize("how", ["data", "no_grad"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_weights_clipped_in_place_after_each_step_train_like_one_process(stage, how):
    # README: p.data = p.data.clamp(...) is dropped by DTensor itself (fully_shard too); the
    # in-place forms reach the shards, and stage 1 gathers them at the next forward
    torch.manual_seed(0)
    reference = models.mlp(16, 2)
    train_clipping(reference, None, how)
    full = run_on_ranks(WORLD, on_ranks_clip_weights, stage, how)[0]
    clipped = 0
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)
        clipped += int((value.abs() == 0.05).sum())
    assert clipped > 0  # the clipping bit


# Frozen before wrapping, as Lightning's BaseFinetuning freezes a backbone in its setup hook, which
# runs before the strategy wraps the model: the root unit's inp whole and head.bias, blocks.0
# whole, and two of blocks.1's parameters (which sit after its trainable ones in the flat layout).
FROZEN_AT_WRAP = ("inp.weight", "inp.bias", "head.bias", "blocks.0.", "blocks.1.norm.weight", "blocks.1.up.weight")
# Unfrozen after two steps; blocks.1.norm.weight stays frozen, inside the grown trainable prefix.
UNFROZEN = ("head.bias", "blocks.0.", "blocks.1.up.weight")


def gradual_unfreezing(model: nn.Module, wrap, rank: int | None, optim: str) -> dict:  # type: ignore[no-untyped-def]
    """BaseFinetuning's pattern: freeze before wrapping, an optimizer over what trains, two steps
    in Lightning's order (zero_grad after the forward, so the last step's gradients are still
    there at the unfreeze); then unfreeze and ``add_param_group`` the unfrozen parameters with
    a tenth of the learning rate, and three more steps."""
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN_AT_WRAP))
    model = wrap(model)
    lr = 0.1 if optim == "sgd" else 0.01
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=lr, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(trainable, lr=lr)
    for step in range(5):
        if step == 2:
            unfrozen = [p for name, p in model.named_parameters() if name.startswith(UNFROZEN)]
            for p in unfrozen:
                p.requires_grad_(True)
            opt.add_param_group({"params": unfrozen, "lr": lr / 10})
        x, y = batch(step, rank)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    sd = model.full_state_dict(rank0_only=False) if hasattr(model, "full_state_dict") else model.state_dict()
    return {k: v.clone() for k, v in sd.items()}


def on_ranks_unfreezing(stage: int, optim: str, where: str) -> dict:
    import tempfile

    from parity import hybrid_mesh
    from shardwrap import Offload, ShardedModule

    torch.manual_seed(0)
    mesh = hybrid_mesh((2, 2)) if where == "hybrid" else None  # the batch still splits in WORLD parts: ranks r and r + 2 share one
    offload = Offload("disk", path=tempfile.mkdtemp(prefix="shardwrap-unfreeze-")) if where == "disk" else None
    wrap = lambda m: ShardedModule(m, auto_wrap_policy={models.Block}, stage=stage, mesh=mesh, offload=offload)  # noqa: E731
    return gradual_unfreezing(models.mlp(), wrap, dist.get_rank() % WORLD, optim)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage,where", [(1, "flat"), (2, "flat"), (3, "flat"), (3, "hybrid"), (3, "disk")])
def test_parameters_frozen_at_wrapping_can_be_unfrozen_later(stage, where, optim):
    """Gradual unfreezing (BaseFinetuning) trains like the unwrapped model: a unit frozen whole at
    wrapping, a frozen parameter of a unit that trains, one left frozen between them; with a
    gradient of the last step still present at the unfreeze; on a hybrid mesh, the unit frozen
    whole joins the all-reduces over replicas; with disk offload, the new parameters' optimizer
    state goes to the files (fully_shard supports unfreezing too)."""
    torch.manual_seed(0)
    reference = gradual_unfreezing(models.mlp(), lambda m: m, None, optim)
    torch.manual_seed(0)
    initial = models.mlp().state_dict()
    for name in ("blocks.0.up.weight", "blocks.1.up.weight", "head.bias"):
        assert not torch.equal(reference[name], initial[name]), name  # trained after the unfreeze
    assert torch.equal(reference["blocks.1.norm.weight"], initial["blocks.1.norm.weight"])
    for got in run_on_ranks(4 if where == "hybrid" else WORLD, on_ranks_unfreezing, stage, optim, where):
        for name, value in reference.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def on_ranks_unfreezing_refused(stage: int) -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    inner = models.mlp()
    up = inner.blocks[1].up.weight
    up.requires_grad_(False)
    model = ShardedModule(inner, auto_wrap_policy={models.Block}, stage=stage)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    rank = dist.get_rank()
    param = dict(model.named_parameters())["blocks.1.up.weight"]
    out: dict = {}

    def loss(step: int) -> torch.Tensor:
        x, y = batch(step, rank)
        return ((model(x) - y) ** 2).mean()

    # between the micro-batches of a no_sync accumulation: refused at the forward, nothing changed
    with model.no_sync():
        loss(0).backward()
    param.requires_grad_(True)
    try:
        loss(1)
        out["no_sync"] = "no error"
    except RuntimeError as exc:
        out["no_sync"] = str(exc)
    param.requires_grad_(False)
    loss(1).backward()
    opt.step()
    opt.zero_grad()
    # a backward through a graph recorded before the unfreeze, after a forward that took it in
    first = loss(2)
    param.requires_grad_(True)
    second = loss(3)
    try:
        (first + second).backward()
        out["old_graph"] = "no error"
    except RuntimeError as exc:
        out["old_graph"] = str(exc)
    opt.zero_grad()
    # and the model goes on (the next forward cleans up after the backward that raised): the next
    # step trains the unfrozen parameter
    before = param.to_local().clone()
    opt.add_param_group({"params": [param]})
    loss(4).backward()
    opt.step()
    out["trains"] = not torch.equal(param.to_local(), before)
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_unfreezing_where_the_gradient_layout_cannot_grow_is_refused_with_what_to_do(stage):
    for r in run_on_ranks(WORLD, on_ranks_unfreezing_refused, stage):
        assert "'blocks.1.up.weight'" in r["no_sync"] and "between optimizer steps" in r["no_sync"], r["no_sync"]
        assert "recorded before" in r["old_graph"] and "between optimizer steps" in r["old_graph"], r["old_graph"]
        assert r["trains"], r


def swap_and_distil(student: nn.Module, teacher: nn.Module, rank: int | None, optim: str) -> dict:
    """Writes no version counter sees, between forwards with no step in between: an EMA of the
    student swapped in for an evaluation through ``p.data.copy_`` and swapped back the same way,
    and a teacher updated by ``torch._foreach_lerp_`` (never stepped) that the loss distils from."""
    params, teacher_params = list(student.parameters()), list(teacher.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(params, lr=0.01)
    ema = [p.detach().clone() for p in params]
    out: dict = {"eval": [], "teacher": []}
    for step in range(4):
        x, y = batch(step, rank)
        with torch.no_grad():
            target = teacher(x)
        out["teacher"].append(target.clone())
        loss = ((student(x) - y) ** 2).mean() + ((student(x) - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            torch._foreach_lerp_(ema, params, 0.5)
            torch._foreach_lerp_(teacher_params, params, 0.3)
            backup = [p.detach().clone() for p in params]
            for p, e in zip(params, ema):
                p.data.copy_(e)
            out["eval"].append(student(batch(10 + step, rank)[0]).clone())
            for p, b in zip(params, backup):
                p.data.copy_(b)
    for name, model in (("student", student), ("teacher_params", teacher)):
        sd = model.full_state_dict(rank0_only=False) if hasattr(model, "full_state_dict") else model.state_dict()
        out[name] = {k: v.clone() for k, v in sd.items()}
    return out


def on_ranks_swap_and_distil(stage: int, optim: str) -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    student = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=stage)
    torch.manual_seed(1)
    teacher = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=stage)
    return swap_and_distil(student, teacher, dist.get_rank(), optim)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_writes_no_version_counter_sees_reach_the_next_forward(stage, optim):
    """Stage 1 keeps units gathered between forwards; a write through ``p.data`` or by a foreach
    op reached this rank's rows only, and the next forward read the other ranks' stale rows (the
    EMA left in the model it trained after the swap back: 7.5e-2 off here, silently; an audit). A
    digest of each rank's shard at every forward catches them; stages 2 and 3 gather anyway."""
    torch.manual_seed(0)
    student = models.mlp()
    torch.manual_seed(1)
    reference = swap_and_distil(student, models.mlp(), None, optim)
    for rank, got in enumerate(run_on_ranks(WORLD, on_ranks_swap_and_distil, stage, optim)):
        for what in ("eval", "teacher"):
            for i, (a, b) in enumerate(zip(got[what], reference[what])):
                torch.testing.assert_close(a, b.chunk(WORLD)[rank], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {i}: {m}")
        for what in ("student", "teacher_params"):
            for name, value in reference[what].items():
                torch.testing.assert_close(got[what][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


def shrink_between_forwards(model: nn.Module, rank: int | None, optim: str) -> dict:
    """Two forwards that share one backward, with a write through ``p.data`` between them (the
    weights shrunk by hand); plain PyTorch computes the second forward with the new values, and
    the first forward's backward reads them too (the saved weights are the parameters)."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(params, lr=0.01)
    losses = []
    for step in range(3):
        x, y = batch(step, rank)
        first = ((model(x) - y) ** 2).mean()
        with torch.no_grad():
            for p in params:
                p.data.mul_(0.9)
        second = ((model(x) - y) ** 2).mean()
        (first + second).backward()
        losses.append(second.detach().clone())
        opt.step()
        opt.zero_grad()
    sd = model.full_state_dict(rank0_only=False) if hasattr(model, "full_state_dict") else model.state_dict()
    return {"losses": losses, "params": {k: v.clone() for k, v in sd.items()}}


def on_ranks_shrink(stage: int, optim: str, offload: bool) -> dict:
    from shardwrap import Offload, ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=stage, offload=Offload("cpu") if offload else None)
    out = shrink_between_forwards(model, dist.get_rank() if dist.get_world_size() > 1 else None, optim)
    out["losses"] = [collectives_mean(loss) for loss in out["losses"]]
    return out


def collectives_mean(loss: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


@pytest.mark.parametrize("world", [1, WORLD])
@pytest.mark.parametrize("offload", [False, True], ids=["shard", "offload"])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_write_between_two_forwards_that_share_one_backward_reaches_the_second(stage, optim, offload, world):
    """A unit still gathered from the first forward (every unit at stage 2, the root unit at
    stage 3; stage 1 with its shard in a buffer of its own under offload) was computed with again
    without a gather: a ``p.data`` write between the forwards reached this rank's rows only (a
    review: 9.0e-2 off at stage 2, 2.8e-2 at stage 3, silently). Each forward compares the shard
    with its rows of the gathered buffer and gathers again where they differ; with one rank too
    (a hybrid mesh's shard axis of one: the gathered copy went stale alike, a review)."""
    torch.manual_seed(0)
    reference = shrink_between_forwards(models.mlp(), None, optim)
    for got in run_on_ranks(world, on_ranks_shrink, stage, optim, offload):
        for i, (a, b) in enumerate(zip(got["losses"], reference["losses"])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"loss {i}: {m}")
        for name, value in reference["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ---- an average of the weights (EMA, SWA) ---------------------------------------------------------


def train_with_average(model: nn.Module, average: nn.Module, rank: int | None, optim: str) -> list[torch.Tensor]:
    """Train, update the average after each step, and evaluate the average on a held-out batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(model.parameters(), lr=0.01)
    held_out = batch(99)[0]
    outputs = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        average.update_parameters(model)
        with torch.no_grad():
            outputs.append(average(held_out))
    return outputs


def averaged(kind: str) -> nn.Module:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    return AveragedModel(models.mlp(16, 2), multi_avg_fn=get_ema_multi_avg_fn(0.9) if kind == "ema" else None)


def on_ranks_average(stage: int, kind: str, optim: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(16, 2), auto_wrap_policy={models.Block}, stage=stage)
    average = ShardedModule(averaged(kind), auto_wrap_policy={models.Block}, stage=stage)  # wrapped the same way
    outputs = train_with_average(model, average, dist.get_rank(), optim)
    return outputs, average.full_state_dict()


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("kind", ["ema", "swa"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_averaged_model_wrapped_like_the_model_averages_like_one_process(stage, kind, optim):
    # README: AveragedModel(model.module) is refused (a deep copy of sharded modules); an
    # AveragedModel of a fresh copy, wrapped with the same policy and stage, pairs its shards with
    # the model's, and its update_parameters (torch._foreach ops on the DTensors) and forward
    # give one process's average
    torch.manual_seed(0)
    reference = models.mlp(16, 2)
    ref_average = averaged(kind)
    expected = train_with_average(reference, ref_average, None, optim)
    results = run_on_ranks(WORLD, on_ranks_average, stage, kind, optim)
    for outputs, _ in results:
        for got, want in zip(outputs, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    full = results[0][1]
    assert sorted(full) == sorted(ref_average.state_dict())
    for name, value in ref_average.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)
