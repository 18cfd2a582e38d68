"""torch.compile on a ShardedModule, the two ways FSDP2 users compile (design/notes/torch-compile.md).

- ``block.compile(fullgraph=True)`` on every GPT-2 block, before or after wrapping, in every
  stage (torchtitan's recipe), also with activation checkpointing applied first;
- ``torch.compile(model)`` on the whole wrapped model: it may break the graph no more often than
  the same model under ``fully_shard``, counted in the same test with Dynamo's counters.

Each run trains on W = 2 ranks and must match the unwrapped model trained eagerly in one process
on the global batch, and Dynamo must really have compiled something (a test that compiled nothing
would pass trivially).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import models
from harness import run_on_ranks
from parity import Case, assert_close_params, build_model, build_optimizer, global_batch, loss_fn, resolve_policy

WORLD = 2
TIMEOUT = 600  # the first compile in a fresh process builds C++ kernels
GPT2 = Case("gpt2", {"n_layer": 2, "n_embd": 32, "use_cache": False}, policy="GPT2Block", data="lm", seq=8)


def apply_ac(model: torch.nn.Module) -> None:
    """Non-reentrant ``checkpoint_wrapper`` around every GPT-2 block (torchtitan's full AC)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, models.gpt2_block_class()))


def blocks_to_compile(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules torchtitan compiles: each block, or its checkpoint wrapper when there is one."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrappers = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    return wrappers or [m for m in model.modules() if isinstance(m, models.gpt2_block_class())]


def reference(case: Case, ac: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The unwrapped model (with the same checkpointing), eager, one process, global batch."""
    model = build_model(case)
    if ac:
        apply_ac(model)
    opt = build_optimizer(case, model)
    losses = []
    for step in range(case.steps):
        loss = loss_fn(case, model, global_batch(case, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def train_compiled(case: Case, how: str, ac: bool, impl: str = "shardwrap") -> dict:
    """Runs on every rank: wrap (shardwrap or fully_shard), compile ``how``, train, read back."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from shardwrap import ShardedModule

    torch._dynamo.reset()  # a fresh count in a reused worker process
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(case)
    if ac:
        apply_ac(model)
    if how == "blocks_before":
        for block in blocks_to_compile(model):
            block.compile(fullgraph=True)
    if impl == "shardwrap":
        model = ShardedModule(model, auto_wrap_policy=resolve_policy(case), stage=case.stage)
    else:
        from torch.distributed.fsdp import fully_shard

        for m in blocks_to_compile(model):
            fully_shard(m)
        fully_shard(model)
    if how == "blocks_after":
        for block in blocks_to_compile(model):
            block.compile(fullgraph=True)
    run = torch.compile(model) if how == "whole" else model
    opt = build_optimizer(case, model)
    step_fn = torch.compile(opt.step) if how == "step" else opt.step
    losses, compiled = [], []
    for step in range(case.steps):
        batch = {k: v.chunk(world)[rank] for k, v in global_batch(case, step).items()}
        loss = loss_fn(case, run, batch)
        loss.backward()
        step_fn()
        opt.zero_grad()
        losses.append(loss.item())
        compiled.append(counters["frames"]["ok"])
    if impl == "shardwrap":
        full = model.full_state_dict(rank0_only=False)
    else:
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return {
        "full": {k: v.detach().clone() for k, v in full.items()},
        "losses": losses,
        "breaks": sum(counters["graph_break"].values()),
        "break_reasons": sorted(k[:400].replace("\n", " ") for k in counters["graph_break"]),
        "frames": counters["stats"]["unique_graphs"],
        "compiled_by_step": compiled,  # frames compiled so far, after each step
    }


def check_parity(case: Case, results: list[dict], ac: bool) -> None:
    expected, ref_losses = reference(case, ac)
    for rank, r in enumerate(results):
        full = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in r["full"].items()}
        assert sorted(full) == sorted(expected), f"rank {rank}: keys {sorted(full)} != {sorted(expected)}"
        for name, value in expected.items():
            assert_close_params(full[name], value, case.optim, case.steps, f"rank {rank} '{name}'")
        # each rank's loss is its half of the batch; their mean is the global loss
    losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("when", ["blocks_before", "blocks_after"])
def test_per_block_fullgraph_compile_matches_the_unwrapped_model(stage, when):
    case = dataclasses.replace(GPT2, stage=stage)
    results = run_on_ranks(WORLD, train_compiled, case, when, False, timeout=TIMEOUT)
    for r in results:
        assert r["frames"] >= 1, r  # something was compiled
        assert r["breaks"] == 0, r["break_reasons"]  # fullgraph=True would have raised anyway
    check_parity(case, results, ac=False)


def test_per_block_compile_with_adamw():
    case = dataclasses.replace(GPT2, optim="adamw")
    results = run_on_ranks(WORLD, train_compiled, case, "blocks_after", False, timeout=TIMEOUT)
    assert all(r["frames"] >= 1 and r["breaks"] == 0 for r in results), results[0]["break_reasons"]
    check_parity(case, results, ac=False)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_activation_checkpointing_with_per_block_compile(stage):
    case = dataclasses.replace(GPT2, stage=stage)
    results = run_on_ranks(WORLD, train_compiled, case, "blocks_before", True, timeout=TIMEOUT)
    assert all(r["frames"] >= 1 and r["breaks"] == 0 for r in results), results[0]["break_reasons"]
    check_parity(case, results, ac=True)


def test_whole_model_compile_breaks_no_more_than_fully_shard():
    case = GPT2
    ours = run_on_ranks(WORLD, train_compiled, case, "whole", False, timeout=TIMEOUT)
    theirs = run_on_ranks(WORLD, train_compiled, case, "whole", False, "fully_shard", timeout=TIMEOUT)
    for mine, fs in zip(ours, theirs):
        assert mine["frames"] >= 1, mine
        assert mine["breaks"] <= fs["breaks"], (mine["break_reasons"], fs["break_reasons"])
    check_parity(case, ours, ac=False)
    check_parity(case, theirs, ac=False)  # the bound is only worth something if fully_shard is right too


@pytest.mark.parametrize("stage,optim", [(1, "sgd"), (3, "adamw")])
def test_a_compiled_optimizer_step_compiles_once_and_matches_the_unwrapped_model(stage, optim):
    """``torch.compile(opt.step)`` (PyTorch's recipe for a compiled optimizer): the step on local
    tensors hands the optimizer the same tensors at every step, so nothing compiles again after the
    first two steps (it did at every step, until dynamo's recompile limit left it uncompiled)."""
    case = Case("mlp", {"dim": 16, "depth": 2}, policy="Block", stage=stage, optim=optim, steps=5)
    results = run_on_ranks(WORLD, train_compiled, case, "step", False, timeout=TIMEOUT)
    for r in results:
        assert r["frames"] >= 1, r
        assert r["compiled_by_step"][1] == r["compiled_by_step"][-1], r["compiled_by_step"]
    check_parity(case, results, ac=False)
