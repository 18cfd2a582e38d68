"""Spare buffers on a CPU (design/notes/spare-buffers.md): a unit's freed unsharded buffer, or
offload's send buffer, serves the next gather of the same size. The rule that keeps the peak
where it was: no spare is held while a unit's module computes, in forward or in backward, and
none survives a step. Training with spares equals training without, and both equal the
unwrapped model on the whole global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_on_ranks

DIM = 24


class _Look(torch.autograd.Function):
    """Identity that calls ``look`` in forward and again in backward."""

    @staticmethod
    def forward(ctx, x, look):  # type: ignore[no-untyped-def]
        ctx.look = look
        look()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        ctx.look()
        return grad, None


class Block(nn.Module):
    """Records the root's spare bytes whenever it computes, forward and backward."""

    root = None  # the ShardedModule, set after wrapping
    seen: list[int] = []

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def look(self) -> None:
        if Block.root is not None:
            Block.seen.append(Block.root._spares.kept_bytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _Look.apply(x, self.look)
        return torch.tanh(self.lin(x)) + x


def make() -> nn.Module:
    return nn.Sequential(*(Block() for _ in range(5)), nn.Linear(DIM, 3))


def train(stage: int, offload: str | None, reuse: bool, optim: str) -> dict:
    import shardwrap.spare

    shardwrap.spare.REUSE = reuse
    try:
        return _train(stage, offload, optim)
    finally:
        shardwrap.spare.REUSE = True  # the worker processes run later tests too


def _train(stage: int, offload: str | None, optim: str) -> dict:
    from shardwrap import Offload, ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = make()
    model = ShardedModule(make(), auto_wrap_policy={Block}, stage=stage, offload=Offload(offload))
    model.load_state_dict(ref.state_dict())
    Block.root, Block.seen = model, []
    opts = []
    for params in (ref.parameters(), model.parameters()):
        opts.append(torch.optim.SGD(params, lr=0.1, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(params, lr=0.02))
    after_steps = []
    for step in range(4):
        x = torch.randn(4 * world, DIM, generator=torch.Generator().manual_seed(step))
        Block.root = None
        ref(x).pow(2).mean().backward()
        Block.root = model
        model(x.chunk(world)[rank]).pow(2).mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        after_steps.append(model._spares.kept_bytes)
    full = model.full_state_dict(rank0_only=False)
    gap = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return {
        "seen": Block.seen, "after_steps": after_steps, "reused": model._spares.reused, "gap": gap,
        "params": {n: p.detach().to_local().clone() for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("offload", [None, "cpu"])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_spares_are_reused_never_held_while_a_module_computes_and_change_no_number(offload, optim):
    for world in (2, 3):
        with_spares = run_on_ranks(world, train, 3, offload, True, optim)
        without = run_on_ranks(world, train, 3, offload, False, optim)
        for rank, (got, plain) in enumerate(zip(with_spares, without)):
            # 4 steps of 5 forwards and 4 backwards (the first block's input needs no gradient)
            assert len(got["seen"]) == 4 * (5 + 4), got["seen"]
            assert all(b == 0 for b in got["seen"]), (world, rank, got["seen"])
            assert all(b == 0 for b in got["after_steps"]), got["after_steps"]
            # from the second step on, three of the five blocks gather into a spare (a block's
            # buffer serves the block two after it); offload also reuses each send buffer
            assert got["reused"] >= 3 * 3, got["reused"]
            assert plain["reused"] == 0
            assert got["gap"] < 1e-5 and plain["gap"] < 1e-5, (got["gap"], plain["gap"])
            for name, value in got["params"].items():
                assert torch.equal(value, plain["params"][name]), name


def count_heap_returns(offload: str | None) -> dict:
    """Two steps; how often the units gave glibc's free heap pages back, per backward."""
    import shardwrap.spare
    from shardwrap import Offload, ShardedModule

    calls: list[int] = []
    real = shardwrap.spare._MALLOC_TRIM
    shardwrap.spare._MALLOC_TRIM = lambda pad: calls.append(pad) or 0
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = ShardedModule(make(), auto_wrap_policy={Block}, stage=3, offload=Offload(offload))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        per_step = []
        for step in range(2):
            x = torch.randn(4 * world, DIM, generator=torch.Generator().manual_seed(step)).chunk(world)[rank]
            model(x).pow(2).mean().backward()
            per_step.append(len(calls))
            calls.clear()
            opt.step()
            opt.zero_grad()
        return {"per_step": per_step, "units": len(model.units), "found": real is not None}
    finally:
        shardwrap.spare._MALLOC_TRIM = real


def test_offload_on_a_cpu_returns_free_heap_pages_after_each_unit_backward():
    """With offload on a CPU, host RAM is what the user is saving: each unit's post_backward asks
    glibc to give its free heap pages back (``malloc_trim(0)``), which took the medium disk run's
    peak RssAnon from 1.61 to 1.28 GiB (design/notes/offload.md). Without offload nothing is
    trimmed (the CPU benchmarks' step times stay as they were)."""
    import platform

    for offload, want in (("cpu", True), (None, False)):
        for got in run_on_ranks(2, count_heap_returns, offload):
            assert got["per_step"] == [got["units"] if want else 0] * 2, (offload, got)
            if platform.libc_ver()[0] == "glibc":
                assert got["found"], "glibc's malloc_trim was not found"
