"""The unit's views and their gradient: ``UnitViews`` hands the leaf the gradient rank-major, as
the reduce-scatter sends it (design/notes/dim0-layout.md, "The gradient, rank-major")."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwrap.flat_param import FlatLayout

shapes = st.lists(
    st.one_of(st.just(()), st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple)),
    min_size=1, max_size=5,
)


def expected_row(shapes_: list[tuple[int, ...]], grads: list[torch.Tensor | None], world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of every parameter's gradient, from ``torch.chunk`` semantics alone:
    rows ``[r*c, (r+1)*c)`` padded with zero rows to ``c``; a 0-dim parameter's value on every rank."""
    parts = []
    for shape, g in zip(shapes_, grads):
        if len(shape) == 0:
            parts.append(torch.zeros(1) if g is None else g.reshape(1))
            continue
        dim0, inner = shape[0], math.prod(shape[1:])
        c = -(-dim0 // world)
        padded = torch.zeros(world * c, inner)
        if g is not None:
            padded[:dim0] = g.reshape(dim0, inner)
        parts.append(padded[rank * c : (rank + 1) * c].reshape(-1))
    return torch.cat(parts)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, world=st.integers(1, 5), data=st.data())
def test_the_leaf_gets_the_views_gradients_rank_major(shapes, world, data):
    params = [torch.randn(s).requires_grad_() for s in shapes]
    layout = FlatLayout([f"p{i}" for i in range(len(shapes))], params, world)
    used = data.draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    leaf = torch.zeros(layout.padded_trainable_numel, requires_grad=True)
    views = layout.unsharded_views(leaf, torch.zeros(0))
    assert [tuple(v.shape) for v in views] == [tuple(s) for s in shapes]
    grads = [torch.randn(s) if u else None for s, u in zip(shapes, used)]
    terms = [(v * g).sum() for v, g in zip(views, grads) if g is not None]
    if not terms:  # nothing used: the leaf still gets a gradient, all zeros (its hooks run)
        terms = [views[0].sum() * 0]
    torch.stack(terms).sum().backward()
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape
    rows = leaf.grad.view(world, layout.grad_shard_numel)
    for r in range(world):
        want = expected_row(shapes, [g if u else None for g, u in zip(grads, used)], world, r)
        if not terms or not any(used):
            want = torch.zeros_like(want)
        assert torch.equal(rows[r], want), (r, rows[r], want)
        # what stage 1 hands p.grad: rank r's row, cut like its shard
        for view, s, g in zip(layout.rank_rows_of_grad(leaf.grad, r), layout.slots, grads):
            assert view.shape == s.sharded_shape(r)


def test_a_perturbed_writer_is_caught():
    """The oracle above can fail: rows written parameter-major (what a ``split`` gave) differ
    from rank-major whenever a unit has two parameters and two ranks."""
    params = [torch.randn(4, 3).requires_grad_(), torch.randn(2).requires_grad_()]
    layout = FlatLayout(["a", "b"], params, 2)
    grads = [torch.randn(4, 3), torch.randn(2)]
    parameter_major = torch.cat([g.reshape(-1) for g in grads])
    rows = parameter_major.view(2, layout.grad_shard_numel)
    assert not torch.equal(rows[0], expected_row([(4, 3), (2,)], grads, 2, 0))
    out = torch.empty(2 * layout.grad_shard_numel)
    layout.grads_to_rank_major(grads, out)
    assert torch.equal(out.view(2, -1)[0], expected_row([(4, 3), (2,)], grads, 2, 0))
