"""Generated module trees: containers, layer kinds, tiny and zero-size parameters, shared and
frozen parameters, random wrap policies and world sizes. Parity must hold for every one."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity import Case, check_parity

unit = st.booleans()
leaf = st.one_of(
    st.tuples(st.just("linear"), st.booleans(), st.booleans(), unit),
    st.tuples(st.just("norm"), st.booleans(), unit),
    st.tuples(st.just("conv"), st.integers(1, 3), st.booleans(), unit),
    st.tuples(st.just("embed"), st.integers(1, 5), st.booleans(), unit),  # rows may be < W
    st.tuples(st.just("zero"), unit),
    st.tuples(st.just("tie"), st.integers(0, 7), unit),
    st.tuples(st.just("reuse"), st.integers(0, 7)),
)
trees = st.recursive(
    leaf,
    lambda children: st.tuples(st.sampled_from(["seq", "list", "dict"]), st.lists(children, min_size=1, max_size=3), unit),
    max_leaves=7,
)


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(spec=trees, world_size=st.integers(1, 4), optim=st.sampled_from(["sgd", "adamw"]))
def test_generated_trees_match_single_process(spec, world_size, optim):
    case = Case("tree", {"spec": spec, "dim": 6}, policy="marked", optim=optim, dim=6, seq=5, out=6)
    check_parity(case, world_size)
