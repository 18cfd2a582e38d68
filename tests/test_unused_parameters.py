"""Parameters that a step's forward leaves out, inside units that are otherwise used.

In plain PyTorch such a parameter keeps ``p.grad is None`` and the optimizer leaves it alone: no
momentum, no weight decay. A unit's flat gradient covers all its parameters, so without care the
reduction hands it zeros, and SGD's momentum or AdamW's weight decay then moves it every step: a
silent wrong number (``fully_shard``, one parameter at a time, gets it right). Each check trains
the wrapped model against the unwrapped one on the whole global batch, with SGD + momentum +
weight decay and AdamW, and compares every parameter and every ``p.grad is None`` after each step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_on_ranks

DIM = 8


class Branchy(nn.Module):
    """``a`` always; ``b`` only on the rows whose first feature is positive, and skipped (no op at
    all) when there are none; ``dead`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.dead = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.a(x))
        rows = x[:, 0] > 0
        if bool(rows.any()):
            y = y.index_add(0, rows.nonzero().flatten(), self.b(x[rows]))
        return y


class Net(nn.Module):
    """Two Branchy units under a root whose ``extra`` is used only while ``use_extra`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Branchy() for _ in range(2))
        self.head = nn.Linear(DIM, 3)
        self.extra = nn.Parameter(torch.randn(DIM))
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if self.use_extra:
            x = x * self.extra
        return self.head(x)


def global_batch(step: int, world: int) -> torch.Tensor:
    """Which ranks' rows take the ``b`` branches: every rank (step 0), none (1), only rank 0's
    (2), only the last rank's (3), then none again."""
    x = torch.randn(2 * world, DIM, generator=torch.Generator().manual_seed(step))
    x[:, 0] = -1.0
    if step == 0:
        x[:, 0] = 1.0
    elif step == 2:
        x[0, 0] = 1.0
    elif step == 3:
        x[-1, 0] = 1.0
    return x


def optimizer(name: str, params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.05)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def train_both(stage: int, optim: str, accumulate: bool) -> list[dict]:
    """Per step: the largest parameter difference from the unwrapped model and, per parameter,
    whether ``p.grad is None`` in each. ``accumulate``: each step is two micro-batches, the first
    under ``no_sync`` (on the unwrapped model: two backwards)."""
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Net()
    model = ShardedModule(Net(), auto_wrap_policy={Branchy}, stage=stage)
    model.load_state_dict(ref.state_dict())
    opts = [optimizer(optim, ref.parameters()), optimizer(optim, model.parameters())]
    names = [n for n, _ in ref.named_parameters()]
    out = []
    for step in range(5):
        for m in (ref, model.module):
            m.use_extra = step == 0
        x = global_batch(step, world)
        if accumulate:  # micro-batch 0 takes the rows of step `step`, micro-batch 1 those of step 1 (no b)
            micro = [x, global_batch(1, world)]
            for i, xb in enumerate(micro):
                ref(xb).pow(2).mean().backward()
                local = xb.chunk(world)[rank]
                if i == 0:
                    with model.no_sync():
                        model(local).pow(2).mean().backward()
                else:
                    model(local).pow(2).mean().backward()
        else:
            ref(x).pow(2).mean().backward()
            model(x.chunk(world)[rank]).pow(2).mean().backward()
        none_ref = {n: p.grad is None for n, p in ref.named_parameters()}
        none_got = {n: p.grad is None for n, p in model.named_parameters()}
        for opt in opts:
            opt.step()
            opt.zero_grad()
        full = model.full_state_dict(rank0_only=False)
        gap = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
        out.append({"gap": gap, "none_ref": [none_ref[n] for n in names], "none_got": [none_got[n] for n in names], "names": names})
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_a_parameter_no_rank_used_keeps_grad_none_and_is_not_stepped(stage, optim):
    for world in (2, 3):
        for rank_steps in run_on_ranks(world, train_both, stage, optim, False):
            for step, s in enumerate(rank_steps):
                # the oracle sees both kinds: some parameter without a gradient, some with
                assert any(s["none_ref"]) and not all(s["none_ref"]), s
                assert s["none_got"] == s["none_ref"], (world, step, list(zip(s["names"], s["none_ref"], s["none_got"])))
                assert s["gap"] < 1e-5, (world, step, s["gap"])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_parameter_used_in_one_micro_batch_of_no_sync_gets_its_gradient(stage):
    for rank_steps in run_on_ranks(2, train_both, stage, "sgd", True):
        for step, s in enumerate(rank_steps):
            assert s["none_got"] == s["none_ref"], (step, list(zip(s["names"], s["none_ref"], s["none_got"])))
            assert s["gap"] < 1e-5, (step, s["gap"])


def on_ranks_usage_reads(stage: int) -> dict:
    """What each unit's ``take_usage`` answers at the end of backward: ``True`` (no read of the
    summed flags) for units whose every trainable parameter this rank used or that were frozen
    after wrapping, a tensor (a read) for a unit with a parameter this rank left out."""
    import models
    from shardwrap import ShardedModule
    from shardwrap.unit import Unit

    seen: list = []
    original = Unit.take_usage

    def spy(self):  # type: ignore[no-untyped-def]
        answer = original(self)
        seen.append((self.name, answer if isinstance(answer, bool) else "read"))
        return answer

    Unit.take_usage = spy  # type: ignore[method-assign]
    try:
        torch.manual_seed(0)
        out: dict = {}
        mlp = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=stage)
        mlp(torch.randn(4, 16)).sum().backward()
        out["all used"] = list(seen)
        seen.clear()
        mlp.module.blocks[0].up.weight.requires_grad_(False)
        mlp(torch.randn(4, 16)).sum().backward()
        out["one frozen"] = list(seen)
        seen.clear()
        net = ShardedModule(Net(), auto_wrap_policy={Branchy}, stage=stage)
        net(global_batch(0, dist.get_world_size()).chunk(dist.get_world_size())[dist.get_rank()]).sum().backward()
        out["dead"] = list(seen)
    finally:
        Unit.take_usage = original  # type: ignore[method-assign]
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_rank_that_used_every_parameter_reads_no_flags_back(stage):
    """On a GPU the read of the summed used-flags waits for the whole backward: a rank that used
    every parameter (or left out only frozen ones) answers without it; a unit with a parameter
    this rank left out still reads (the checks above hold its answer to the unwrapped model)."""
    for r in run_on_ranks(2, on_ranks_usage_reads, stage):
        assert r["all used"] and all(answer is True for _, answer in r["all used"]), r
        assert r["one frozen"] and all(answer is True for _, answer in r["one frozen"]), r
        answers = dict(r["dead"])
        assert answers["blocks.0"] == answers["blocks.1"] == "read" and answers["<root>"] is True, r
