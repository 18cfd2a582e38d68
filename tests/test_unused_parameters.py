"""Parameters that a step's forward leaves out, inside units that are otherwise used.

In plain PyTorch such a parameter keeps ``p.grad is None`` and the optimizer leaves it alone: no
momentum, no weight decay. A unit's flat gradient covers all its parameters, so without care the
reduction hands it zeros, and SGD's momentum or AdamW's weight decay then moves it every step: a
silent wrong number (``fully_shard``, one parameter at a time, gets it right). Each check trains
the wrapped model against the unwrapped one on the whole global batch, with SGD + momentum +
weight decay and AdamW, and compares every parameter and every ``p.grad is None`` after each step.
"""

from __future__ import annotations

import contextlib
from typing import Any

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


def train_both(stage: int, optim: str, accumulate: bool, frozen: str = "") -> list[dict]:
    """Per step: the largest parameter difference from the unwrapped model and, per parameter,
    whether ``p.grad is None`` in each. ``accumulate``: each step is two micro-batches, the first
    under ``no_sync`` (on the unwrapped model: two backwards). ``frozen``: "before" or "after"
    wrapping, each block's ``a`` is frozen, so a block's outputs need a gradient only on the ranks
    whose rows take its ``b``."""
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref, net = Net(), Net()
    for m in {"before": [ref, net], "after": [ref], "": []}[frozen]:
        for block in m.blocks:
            block.a.requires_grad_(False)
    model = ShardedModule(net, auto_wrap_policy={Branchy}, stage=stage)
    if frozen == "after":
        for block in model.module.blocks:
            block.a.requires_grad_(False)
    model.load_state_dict(ref.state_dict())
    opts = [optimizer(optim, ref.parameters()), optimizer(optim, model.parameters())]
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
        out.append(step_and_compare(ref, model, opts))
    return out


def step_and_compare(ref: nn.Module, model: nn.Module, opts: list, after_step: Any = None) -> dict:
    """Record each ``p.grad is None``, step both optimizers, run ``after_step``, and compare every
    parameter with the unwrapped model's."""
    names = [n for n, _ in ref.named_parameters()]
    none_ref = {n: p.grad is None for n, p in ref.named_parameters()}
    none_got = {n: p.grad is None for n, p in model.named_parameters()}
    for opt in opts:
        opt.step()
        opt.zero_grad()
    if after_step is not None:
        after_step()
    full = model.full_state_dict(rank0_only=False)  # type: ignore[operator]
    gap = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return {"gap": gap, "none_ref": [none_ref[n] for n in names], "none_got": [none_got[n] for n in names], "names": names}


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


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("frozen", ["before", "after"])
def test_a_unit_whose_outputs_need_a_gradient_on_some_ranks_only_trains_like_one_process(stage, frozen):
    """Each block's ``a`` frozen, its ``b`` taken by some ranks' rows only: on the other ranks
    the block's outputs need no gradient and its backward never runs. The backward schedule must
    still hold the block on every rank, or the ranks' collectives differ (stage 3 hung in the
    reduce-scatter; with no_sync the next forward named the difference)."""
    for accumulate in (False, True):
        for rank_steps in run_on_ranks(2, train_both, stage, "sgd", accumulate, frozen):
            for step, s in enumerate(rank_steps):
                assert s["none_got"] == s["none_ref"], (accumulate, step, list(zip(s["names"], s["none_ref"], s["none_got"])))
                assert s["gap"] < 1e-5, (accumulate, step, s["gap"])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_parameter_used_in_one_micro_batch_of_no_sync_gets_its_gradient(stage):
    for rank_steps in run_on_ranks(2, train_both, stage, "sgd", True):
        for step, s in enumerate(rank_steps):
            assert s["none_got"] == s["none_ref"], (step, list(zip(s["names"], s["none_ref"], s["none_got"])))
            assert s["gap"] < 1e-5, (step, s["gap"])


def train_freezing_in_windows(stage: int, optim: str, variant: str = "plain") -> list[dict]:
    """Each step a window of two micro-batches, the first under ``no_sync``, with parameters
    frozen between them (after the step, every parameter is trainable again). One process keeps
    in ``p.grad`` what the first micro-batch accumulated and steps it; a parameter frozen between
    a forward and its backward gets nothing from that backward. Per step: the largest parameter
    difference from the unwrapped model and each ``p.grad is None``. ``variant``: "partial"
    freezes ``blocks.0.a`` throughout and sends the first micro-batch's rows to ``b`` on rank 0
    only, so that micro-batch reaches ``blocks.0`` on rank 0 alone; "hybrid" wraps over a
    (2 replicas x 1 shard) mesh."""
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref, net = Net(), Net()
    kept = ("blocks.0.a.",) if variant == "partial" else ()

    def trainable_but(frozen: tuple[str, ...], *models: nn.Module) -> None:
        for m in models or (ref, model):
            for n, p in m.named_parameters():
                p.requires_grad_(not (frozen and n.startswith(frozen)))

    trainable_but(kept, ref, net)
    mesh = None
    if variant == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = ShardedModule(net, auto_wrap_policy={Branchy}, stage=stage, mesh=mesh)
    model.load_state_dict(ref.state_dict())
    opts = [optimizer(optim, ref.parameters()), optimizer(optim, model.parameters())]

    def freeze(m: nn.Module, prefixes: tuple[str, ...], on: bool = False) -> None:
        for n, p in m.named_parameters():
            if n.startswith(prefixes):
                p.requires_grad_(on)

    # (what to freeze after micro-batch 0, what to freeze after micro-batch 1's forward)
    plans: list[tuple[tuple[str, ...], tuple[str, ...]]] = [
        ((), ()),
        (("blocks.0.a.", "extra"), ()),  # a parameter of an inner unit and one of the root
        (("blocks.1.",), ()),  # a whole unit
        (("blocks.",), ()),  # every inner unit: only the root's parameters train on
        ((), ("blocks.0.a.weight", "head.bias")),  # frozen between a forward and its backward
    ]
    out = []
    for step, (after_first, before_backward) in enumerate(plans):
        micro = [torch.randn(2 * world, DIM, generator=torch.Generator().manual_seed(10 * step + i)) for i in range(2)]
        if variant == "partial":
            for i, xb in enumerate(micro):
                xb[:, 0] = -1.0
                xb[0, 0] = 1.0 if i == 0 else -1.0
        for i, xb in enumerate(micro):
            y_ref = ref(xb).pow(2).mean()
            with model.no_sync() if i == 0 else contextlib.nullcontext():
                y = model(xb.chunk(world)[rank]).pow(2).mean()
                if i == 1:
                    freeze(ref, before_backward)
                    freeze(model, before_backward)
                y_ref.backward()
                y.backward()
            if i == 0:
                freeze(ref, after_first)
                freeze(model, after_first)
        out.append(step_and_compare(ref, model, opts, after_step=lambda: trainable_but(kept)))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optim, variant", [("sgd", "plain"), ("adamw", "plain"), ("sgd", "partial"), ("sgd", "hybrid")])
def test_a_parameter_frozen_inside_a_no_sync_window_keeps_what_it_accumulated(stage, optim, variant):
    """A loop with two optimizers that toggles requires_grad (Lightning's toggle_optimizer) with
    gradient accumulation freezes parameters between micro-batches. The reduction at the window's
    end must still hand a parameter frozen since its first micro-batch that micro-batch's gradient
    (it used to drop it: 5e-4 to 6e-2 off one process, silently)."""
    for rank_steps in run_on_ranks(2, train_freezing_in_windows, stage, optim, variant):
        for step, s in enumerate(rank_steps):
            assert s["none_got"] == s["none_ref"], (step, list(zip(s["names"], s["none_ref"], s["none_got"])))
            assert s["gap"] < 1e-5, (step, s["gap"])


def on_ranks_reads_in_finish_grad(stage: int) -> list[int]:
    """How many host reads ``Unit.finish_grad`` makes in three steps with a parameter frozen
    after wrapping for the whole run, then in one window that freezes a parameter between its
    micro-batches."""
    from shardwrap import ShardedModule
    from shardwrap.unit import Unit

    inside, reads = [False], [0]
    finish_grad, tolist = Unit.finish_grad, torch.Tensor.tolist

    def spy_finish(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        inside[0] = True
        try:
            return finish_grad(self, *args, **kwargs)
        finally:
            inside[0] = False

    def spy_tolist(self):  # type: ignore[no-untyped-def]
        reads[0] += inside[0]
        return tolist(self)

    Unit.finish_grad, torch.Tensor.tolist = spy_finish, spy_tolist  # type: ignore[method-assign]
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = ShardedModule(Net(), auto_wrap_policy={Branchy}, stage=stage)
        model.module.blocks[0].a.bias.requires_grad_(False)
        model.module.head.bias.requires_grad_(False)
        counts = []
        for step in range(3):
            model(global_batch(step, world).chunk(world)[rank]).pow(2).mean().backward()
        counts.append(reads[0])
        with model.no_sync():
            model(global_batch(0, world).chunk(world)[rank]).pow(2).mean().backward()
        model.module.blocks[1].a.weight.requires_grad_(False)
        model(global_batch(0, world).chunk(world)[rank]).pow(2).mean().backward()
        counts.append(reads[0] - counts[0])
    finally:
        Unit.finish_grad, torch.Tensor.tolist = finish_grad, tolist  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_frozen_for_the_whole_run_costs_no_read_in_backward(stage):
    """On a GPU a host read of the used-flags inside backward waits for the device: finish_grad
    reads them only for a parameter frozen since a forward that trained it (a no_sync window's),
    not every step for one frozen all along."""
    for all_along, in_window in run_on_ranks(2, on_ranks_reads_in_finish_grad, stage):
        assert all_along == 0 and in_window == 1, (all_along, in_window)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class PickedThenFrozen(nn.Module):
    """``blocks.0`` (trainable) replaces only the rows whose first feature is positive, so on a
    rank with none its output is dropped; ``blocks.1`` behind it is frozen, so its outputs need
    a gradient only on the ranks that took ``blocks.0``; ``blocks.2`` trains."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual() for _ in range(3))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = (x[:, 0] > 0).nonzero().flatten()
        y = self.blocks[0](x)
        h = x.index_copy(0, rows, y[rows]) if rows.numel() else x
        return self.head(self.blocks[2](self.blocks[1](h)))


def train_picked_then_frozen(stage: int, pairwise: bool) -> float:
    """Three steps (rows taking ``blocks.0`` on no rank, on rank 0 only, on no rank), each loss
    all-reduced after the backward as a training loop logs it. Returns the largest parameter
    difference from the unwrapped model. ``pairwise=False``: gloo's own collectives, with a count
    exchange beside every scheduled backward unit (the harness makes every collective pairwise,
    where only the first unit has one)."""
    from shardwrap import ShardedModule, collectives

    threshold = collectives.PAIRWISE_MIN_BYTES
    collectives.PAIRWISE_MIN_BYTES = threshold if pairwise else 1 << 40
    try:
        return _train_picked_then_frozen(stage, ShardedModule)
    finally:
        collectives.PAIRWISE_MIN_BYTES = threshold


def _train_picked_then_frozen(stage: int, ShardedModule: Any) -> float:

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref, net = PickedThenFrozen(), PickedThenFrozen()
    net.load_state_dict(ref.state_dict())
    for m in (ref, net):
        m.blocks[1].requires_grad_(False)
    model = ShardedModule(net, auto_wrap_policy={Residual}, stage=stage)
    opts = [optimizer("sgd", [p for p in m.parameters() if p.requires_grad]) for m in (ref, model)]
    for step in range(3):
        x = torch.randn(2 * world, DIM, generator=torch.Generator().manual_seed(step))
        x[:, 0] = -x[:, 0].abs()
        if step == 1:
            x[:2, 0] = 1.0
        ref(x).pow(2).mean().backward()
        loss = model(x.chunk(world)[rank]).pow(2).mean()
        loss.backward()
        dist.all_reduce(loss.detach())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return step_and_compare(ref, model, [])["gap"]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("pairwise", [True, False])
def test_a_frozen_unit_whose_inputs_need_a_gradient_on_some_ranks_only_trains_like_one_process(stage, pairwise):
    """Stages 1 and 2 used to hang in the end of backward's count exchange while the peer sat in
    the loss's all-reduce; stage 3 named a difference between the ranks' backward gathers. The
    frozen unit is now in the backward schedule on every rank at stage 3 (a unit that trains
    finished before it started) and in none at stages 1 and 2 (it needs nothing in backward)."""
    for gap in run_on_ranks(2, train_picked_then_frozen, stage, pairwise, timeout=60):
        assert gap < 1e-5, gap


class Layer(nn.Module):
    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(fan_in, fan_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def train_gan(stage: int, optim: str) -> float:
    """A GAN's loop with gradient accumulation over two iterations, each wrapped model's first
    backward under its own ``no_sync``: the discriminator is frozen for the generator's backward,
    which runs through it. That backward reduces the discriminator's gradient accumulated so far
    (its next backward syncs), while its parameters are frozen. Returns the largest parameter
    difference from the unwrapped pair."""
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()

    def build() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        return nn.Sequential(Layer(4, DIM), Layer(DIM, 6)), nn.Sequential(Layer(6, DIM), nn.Linear(DIM, 1))

    ref_g, ref_d = build()
    g, d = (ShardedModule(m, auto_wrap_policy={Layer}, stage=stage) for m in build())
    ref_opts = [optimizer(optim, ref_g.parameters()), optimizer(optim, ref_d.parameters())]
    opts = [optimizer(optim, g.parameters()), optimizer(optim, d.parameters())]

    def window(gen: nn.Module, disc: nn.Module, rows: slice, sync: bool, step: int) -> None:
        for it in range(2):
            data = torch.Generator().manual_seed(100 * step + it)
            real, z = torch.randn(2 * world, 6, generator=data)[rows], torch.randn(2 * world, 4, generator=data)[rows]
            disc.requires_grad_(True)
            with disc.no_sync() if sync and it == 0 else contextlib.nullcontext():  # type: ignore[operator]
                (disc(real).mean() - disc(gen(z).detach()).mean()).div(2).backward()
            disc.requires_grad_(False)
            with gen.no_sync() if sync and it == 0 else contextlib.nullcontext():  # type: ignore[operator]
                (-disc(gen(z)).mean()).div(2).backward()
        disc.requires_grad_(True)

    for step in range(3):
        window(ref_g, ref_d, slice(None), False, step)
        window(g, d, slice(2 * rank, 2 * rank + 2), True, step)
        for opt in ref_opts + opts:
            opt.step()
            opt.zero_grad()
    gap = 0.0
    for ref, model in ((ref_g, g), (ref_d, d)):
        full = model.full_state_dict(rank0_only=False)
        gap = max(gap, max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()))
    return gap


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_a_gan_loop_freezing_the_discriminator_accumulates_like_one_process(stage, optim):
    """The discriminator's no_sync gradient, reduced by the generator's backward while the
    discriminator is frozen, used to be dropped: 0.11 off one process after three steps (SGD),
    silently."""
    for gap in run_on_ranks(2, train_gan, stage, optim):
        assert gap < 1e-5, gap


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
