"""Parity with single-process training on the whole global batch."""

import pytest

from parity import Case, check_parity


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_mlp_blocks(world_size, optim):
    check_parity(Case("mlp", {"dim": 16, "depth": 3}, policy="Block", optim=optim), world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_root_unit_only(world_size):
    check_parity(Case("mlp", {"dim": 12, "depth": 2}, policy=None, dim=12), world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_gpt2_tied_embeddings(world_size, optim):
    case = Case("gpt2", {"n_layer": 2}, policy="GPT2Block", optim=optim, data="lm", seq=8)
    check_parity(case, world_size)
