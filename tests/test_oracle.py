"""The parity oracle can fail: with a bug planted in shardwrap's gradient average, the same
comparison ``check_parity`` makes raises.

AdamW is scale-invariant, so it hides gradients that are off by a constant factor (removing the
``/ W`` average passes every AdamW parity test); SGD with momentum does not. The bugs are planted on
the ranks by ``parity.train_sharded(case, mutation=...)``, which patches ``_average_grad`` wherever
shardwrap defines it and restores it afterwards.
"""

import pytest

from harness import run_on_ranks
from parity import MUTATIONS, Case, compare, train_reference, train_sharded

WORLD = 2


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sgd_parity_catches_a_wrong_gradient_average(stage, mutation):
    case = Case("mlp", {"dim": 16, "depth": 3}, policy="Block", optim="sgd", stage=stage)
    reference = train_reference(case)

    # Unmutated, the same run passes: the failure below is the mutation's doing.
    compare(case, WORLD, run_on_ranks(WORLD, train_sharded, case), reference)

    mutated = run_on_ranks(WORLD, train_sharded, case, mutation=mutation)
    calls = [r["mutation_calls"] for r in mutated]
    assert all(calls), f"the planted _average_grad never ran on some rank (calls per rank: {calls}): nothing was tested"
    with pytest.raises(AssertionError, match="full '"):
        compare(case, WORLD, mutated, reference)

    # The patch was undone: the reused worker processes train correctly again.
    compare(case, WORLD, run_on_ranks(WORLD, train_sharded, case), reference)
