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


@pytest.mark.parametrize("world_size", [2, 3])
def test_structured_outputs(world_size):
    """Dataclass outputs holding dicts and tuples: every tensor in them carries gradient."""
    check_parity(Case("structured", policy={__import__("models").StructuredBlock}), world_size)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_unit_called_three_times_and_unit_never_called(optim):
    # The never-called unit keeps grad None like the unwrapped model, so AdamW leaves it alone.
    check_parity(Case("twice", policy="Block", optim=optim), 3)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_accumulation_across_backward_calls(world_size):
    check_parity(Case("mlp", policy="Block", accumulate=3, batch=24), world_size)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_lora_frozen_and_trainable_in_one_unit(optim, world_size):
    check_parity(Case("lora", policy={__import__("models").LoRALinear}, optim=optim), world_size)


def test_many_steps_adamw_gpt2():
    check_parity(Case("gpt2", {"n_layer": 3}, policy="GPT2Block", optim="adamw", data="lm", seq=8, steps=5), 2)


def test_many_steps_sgd_gpt2():
    # The SGD twin of the AdamW run above: AdamW is scale-invariant and hides a gradient off by a
    # constant factor (e.g. summed instead of averaged over ranks); SGD with momentum does not.
    check_parity(Case("gpt2", {"n_layer": 3}, policy="GPT2Block", optim="sgd", data="lm", seq=8, steps=5), 2)


def test_size_policy():
    from shardwrap import SizePolicy

    check_parity(Case("mlp", {"dim": 16, "depth": 3}, policy=SizePolicy(min_num_params=1000)), 3)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_parameter_tied_across_units_goes_to_their_common_ancestor(optim):
    # Both Sequentials are units; the shared weight is owned by the root and trained once.
    case = Case("tied_across_units", policy={__import__("torch").nn.Sequential}, optim=optim, out=11)
    check_parity(case, 2)


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_zero_dim_parameters_are_replicated(optim, clip):
    # Clipping counts a replicated parameter once; the norm must equal torch's.
    check_parity(Case("scaled", policy="Block", optim=optim, clip=clip), 3)
