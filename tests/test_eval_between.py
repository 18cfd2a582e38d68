"""An evaluation forward between ``backward()`` and ``optimizer.step()`` changes nothing.

A logging callback often runs the model under ``torch.no_grad()`` after the backward and before
the step (or between two accumulated micro-batches). For the unwrapped model that forward changes
nothing; the wrapped model must then train exactly as the unwrapped model on the whole global
batch does (the parity oracle of ``parity.py``), in every stage.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from parity import (
    Case,
    build_model,
    build_optimizer,
    compare,
    global_batch,
    loss_fn,
    micro_batches,
    resolve_policy,
    train_reference,
)

WORLD = 2
EVAL_OFFSET = 10_000  # eval batches come from steps no training batch uses


def gpt2_case(stage: int, optim: str = "sgd", **kwargs) -> Case:
    return Case(
        "gpt2", {"n_layer": 2, "n_embd": 32}, policy="GPT2Block", optim=optim, data="lm", seq=8, steps=4, stage=stage, **kwargs
    )


def eval_loss(case: Case, model: torch.nn.Module, step: int, rank: int = 0, world: int = 1) -> float:
    """The logging callback: a forward on an evaluation batch (this rank's chunk) under no_grad."""
    batch = {k: v.chunk(world)[rank] for k, v in global_batch(case, EVAL_OFFSET + step).items()}
    with torch.no_grad():
        return loss_fn(case, model, batch).item()


def train_reference_with_eval(case: Case, eval_after: int):
    """``parity.train_reference`` (fp32) with the evaluation forward after micro-batch
    ``eval_after``'s backward. Returns (state dict, losses, norms, eval losses)."""
    model = build_model(case)
    opt = build_optimizer(case, model)
    losses, norms, evals = [], [], []
    for step in range(case.steps):
        step_loss = 0.0
        for i, micro in enumerate(micro_batches(global_batch(case, step), case.accumulate)):
            loss = loss_fn(case, model, micro) / case.accumulate
            loss.backward()
            step_loss += loss.item()
            if i == eval_after:
                evals.append(eval_loss(case, model, step))
        losses.append(step_loss)
        if case.clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip, case.norm_type).item())
        opt.step()
        opt.zero_grad(set_to_none=case.set_to_none)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms, evals


def train_sharded_with_eval(case: Case, eval_after: int, eval_inside_no_sync: bool = True) -> dict:
    """Runs on every rank: ``parity.train_sharded`` with the evaluation forward (on this rank's
    chunk of the evaluation batch) after micro-batch ``eval_after``'s backward; with
    ``case.no_sync`` and ``eval_inside_no_sync`` it runs inside the ``no_sync()`` block of that
    micro-batch, else after leaving it."""
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    model = ShardedModule(build_model(case), auto_wrap_policy=resolve_policy(case), stage=case.stage, max_unsharded=case.max_unsharded)
    opt = build_optimizer(case, model)
    losses, norms, evals = [], [], []
    for step in range(case.steps):
        local = {k: v.chunk(world)[rank] for k, v in global_batch(case, step).items()}
        micros = micro_batches(local, case.accumulate)
        step_loss = 0.0
        for i, micro in enumerate(micros):
            quiet = case.no_sync and i < len(micros) - 1
            with model.no_sync() if quiet else contextlib.nullcontext():
                loss = loss_fn(case, model, micro) / case.accumulate
                loss.backward()
                if i == eval_after and (eval_inside_no_sync or not quiet):
                    evals.append(eval_loss(case, model, step, rank, world))
            if i == eval_after and not eval_inside_no_sync and quiet:
                evals.append(eval_loss(case, model, step, rank, world))
            step_loss += loss.item()
        losses.append(step_loss)
        if case.clip is not None:
            norms.append(model.clip_grad_norm_(case.clip, case.norm_type).item())
        opt.step()
        opt.zero_grad(set_to_none=case.set_to_none)
    return {
        "full": model.full_state_dict(),
        "local": {n: p.detach().to_local().clone() for n, p in model.named_parameters()},
        "losses": losses,
        "norms": norms,
        "evals": evals,
    }


def check(case: Case, eval_after: int, **kwargs) -> None:
    state, losses, norms, ref_evals = train_reference_with_eval(case, eval_after)
    results = run_on_ranks(WORLD, train_sharded_with_eval, case, eval_after, timeout=120, **kwargs)
    # Every parameter: full_state_dict on rank 0, each rank's shards vs torch.chunk; the losses.
    compare(case, WORLD, results, (state, losses, norms))
    # The evaluation forwards themselves saw the reference's weights (equal chunks: the mean of
    # the per-rank losses is the global loss).
    for step, ref in enumerate(ref_evals):
        mean = sum(r["evals"][step] for r in results) / WORLD
        assert abs(mean - ref) <= 1e-4 * max(1.0, abs(ref)), f"eval loss at step {step}: {mean} vs reference {ref}"


def test_eval_forward_changes_nothing_for_the_reference():
    """The oracle's premise: for the unwrapped model the evaluation forward is a no-op."""
    case = gpt2_case(stage=3)
    with_eval, losses, _, _ = train_reference_with_eval(case, eval_after=0)
    plain, plain_losses, _ = train_reference(case)
    assert list(with_eval) == list(plain)
    for name, value in plain.items():
        torch.testing.assert_close(with_eval[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert losses == plain_losses


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_eval_forward_between_backward_and_step(stage, optim):
    """backward(); no_grad evaluation forward; step(); zero_grad() -- four steps of GPT-2."""
    check(gpt2_case(stage, optim), eval_after=0)


@pytest.mark.parametrize("eval_inside_no_sync", [True, False], ids=["eval_inside_no_sync", "eval_after_no_sync"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_eval_forward_between_no_sync_micro_batches(stage, eval_inside_no_sync):
    """Micro-batch 1's backward under no_sync(), an evaluation forward, the last micro-batch's
    backward outside no_sync(), step: equal to the reference accumulating both micro-batches."""
    case = dataclasses.replace(gpt2_case(stage), accumulate=2, no_sync=True)
    check(case, eval_after=0, eval_inside_no_sync=eval_inside_no_sync)


def train_with_one_rank_in_eval_mode(case: Case) -> dict:
    """Runs on every rank: ``parity.train_sharded``'s loop, with the model in ``eval()`` mode on
    the last rank for the second step's forward and backward (a callback that left it so on one
    rank). The model has no layer that reads the mode, so the answer is one process's."""
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    model = ShardedModule(build_model(case), auto_wrap_policy=resolve_policy(case), stage=case.stage)
    opt = build_optimizer(case, model)
    losses = []
    for step in range(case.steps):
        model.train(not (step == 1 and rank == world - 1))
        batch = {k: v.chunk(world)[rank] for k, v in global_batch(case, step).items()}
        loss = loss_fn(case, model, batch)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():  # a logging forward, in whatever mode each rank is in
            loss_fn(case, model, batch)
        model.train()
        opt.step()
        opt.zero_grad()
    return {"full": model.full_state_dict(), "local": {n: p.detach().to_local().clone() for n, p in model.named_parameters()},
            "losses": losses, "norms": []}


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_training_step_with_the_model_in_eval_mode_on_one_rank_trains_like_one_process(stage, optim):
    """Whether a unit stays gathered for backward, or gathers every unit at once (stage 2 on a
    CPU), was decided from ``module.training``: a rank in eval mode then issued other gathers than
    its peer, and at stages 2 and 3 the module stopped with "ranks disagree" (``fully_shard``
    trains on). So was whether a ``no_grad`` forward marks its units as recomputed under a
    reentrant checkpoint, which adds a header to the next backward at stage 3: a logging forward
    on a rank in eval mode made that backward stop too (a review). Both now read only what every
    rank shares (grad mode, the outputs that need a gradient), so the step trains like one process."""
    case = Case("mlp", {"dim": 16, "depth": 3}, policy="Block", optim=optim, steps=3, stage=stage)
    compare(case, WORLD, run_on_ranks(WORLD, train_with_one_rank_in_eval_mode, case, timeout=60, pg_timeout=10))
