"""Ranks that disagree get a named Python error on every rank, never a signal, a hang or a
silent wrong number; an exception inside a step leaves the module usable
(design/notes/rank-agreement.md). Functions named ``on_ranks_*`` run on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import models
from harness import run_on_ranks


# ---- part 4: every rank wraps the same model ------------------------------------------------


def rank_model(case: str) -> nn.Module:
    """A two-block MLP that differs on rank 1 as ``case`` says."""
    torch.manual_seed(0)
    model = models.mlp(16, 2)
    if dist.get_rank() != 1:
        return model
    block = model.blocks[1]
    if case == "shape":
        block.up = nn.Linear(16, 33)
    elif case == "transposed":  # same number of elements: would silently train another model
        block.up.weight = nn.Parameter(torch.randn(block.up.weight.shape[::-1]))
    elif case == "dtype":
        model.head.double()  # the root unit then mixes dtypes on rank 1 only: still the same error everywhere
    elif case == "requires_grad":
        block.up.bias.requires_grad_(False)
    elif case == "extra":
        block.register_parameter("extra", nn.Parameter(torch.zeros(3)))
    return model


def on_ranks_wrap_different_models(case: str) -> str:
    from shardwrap import ShardedModule

    try:
        ShardedModule(rank_model(case), auto_wrap_policy={models.Block})
    except ValueError as exc:
        return str(exc)
    return "no error"


EXPECTED_DIFFERENCE = {
    "shape": ["'blocks.1.up.weight'", "(32, 16)", "(33, 16)"],
    "transposed": ["'blocks.1.up.weight'", "(32, 16)", "(16, 32)"],
    "dtype": ["'head.weight'", "float32", "float64"],
    "requires_grad": ["'blocks.1.up.bias'", "requires_grad=True", "requires_grad=False"],
    "extra": ["'blocks.1.extra'", "rank 0: no parameter 'blocks.1.extra'", "shape (3,)"],
}


@pytest.mark.parametrize("case", list(EXPECTED_DIFFERENCE))
def test_ranks_that_built_different_models_are_refused_on_every_rank(case):
    messages = run_on_ranks(2, on_ranks_wrap_different_models, case, timeout=30)
    assert messages[0] == messages[1], messages
    for fragment in ["ranks built different models", "rank 0:", "rank 1:", *EXPECTED_DIFFERENCE[case]]:
        assert fragment in messages[0], (case, fragment, messages[0])


def on_ranks_same_model_costs_one_collective() -> dict:
    from shardwrap import ShardedModule
    from shardwrap.collectives import count_collectives

    with count_collectives() as counted:
        ShardedModule(models.mlp(16, 2), auto_wrap_policy={models.Block})
    return dict(counted)


def test_the_check_is_one_16_byte_collective():
    for counts in run_on_ranks(2, on_ranks_same_model_costs_one_collective):
        assert counts["ints_calls"] == 1 and counts["ints"] == 2, counts
