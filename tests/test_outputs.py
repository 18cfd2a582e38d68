"""Units whose forward returns an object other than a tensor or a container of them: a
``torch.distributions.Normal`` (an RL actor), a plain class, a class with ``__slots__``, a class
registered with torch's pytree. Each tensor inside must get the pre-backward hook: at stage 3 a
unit whose outputs looked tensor-free was resharded after forward, and the backward then read
freed storage (SIGSEGV, or torch's "setStorage ... out of bounds"; ``fully_shard`` fails the same
way). Each check trains the wrapped model against the unwrapped one on the whole global batch,
with SGD + momentum and AdamW, and compares every parameter after each step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributions import Normal

from harness import run_on_ranks


class Holder:
    def __init__(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        self.parts = {"mean": mean}
        self.scale = scale


class Slotted:
    __slots__ = ("mean", "scale")

    def __init__(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        self.mean, self.scale = mean, scale


class Registered:
    def __init__(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        self.mean, self.scale = mean, scale


pytree.register_pytree_node(Registered, lambda r: ([r.mean, r.scale], None), lambda xs, _: Registered(*xs))


def as_parts(out) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    if isinstance(out, Normal):
        return out.loc, out.scale
    if isinstance(out, Holder):
        return out.parts["mean"], out.scale
    return out.mean, out.scale


class Actor(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.mu = nn.Linear(8, 3)
        self.log_std = nn.Parameter(torch.zeros(3))

    def forward(self, h: torch.Tensor):  # type: ignore[no-untyped-def]
        mean, scale = self.mu(h), self.log_std.exp()
        return {"normal": Normal, "holder": Holder, "slots": Slotted, "pytree": Registered}[self.kind](mean, scale)


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Linear(8, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.v(h)


class ActorCritic(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.actor = Actor(kind)
        self.critic = Critic()

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        h = torch.tanh(self.body(x))
        return self.actor(h), self.critic(h)


def loss_of(out, y: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    actor, value = out
    mean, scale = as_parts(actor)
    log_prob = Normal(mean, scale).log_prob(y).sum(-1)  # only through the object's tensors
    return -(log_prob * 0.5).mean() + value.pow(2).mean()


def on_ranks_train(kind: str, stage: int, optim: str) -> float:
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = ActorCritic(kind)
    model = ShardedModule(ActorCritic(kind), auto_wrap_policy={Actor, Critic}, stage=stage)
    model.load_state_dict(ref.state_dict())

    def make(params):  # type: ignore[no-untyped-def]
        if optim == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)

    opts = [make(ref.parameters()), make(model.parameters())]
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * world, 4, generator=g), torch.randn(2 * world, 3, generator=g)
        loss_of(ref(x), y).backward()
        loss_of(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        full = model.full_state_dict(rank0_only=False)
        worst = max(worst, max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()))
    return worst


@pytest.mark.parametrize("kind", ["normal", "holder", "slots", "pytree"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_a_unit_returning_an_object_that_holds_tensors_trains_like_the_unwrapped_model(kind, stage, optim):
    for worst in run_on_ranks(2, on_ranks_train, kind, stage, optim):
        assert worst < 1e-5, (kind, stage, optim, worst)


class FreshPairs:
    """A pytree node whose flatten builds new containers each time: their ids may be reused once freed."""

    def __init__(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        self.mean, self.scale = mean, scale


pytree.register_pytree_node(FreshPairs, lambda r: ([(r.mean,), [r.scale]], None), lambda xs, _: FreshPairs(xs[0][0], xs[1][0]))


def test_outputs_that_refer_to_themselves_are_walked_once_and_every_tensor_is_found():
    from shardwrap.unit import tensors_in

    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    cyclic_list: list = [a]
    cyclic_list.append(cyclic_list)  # a RecursionError before the guard covered containers
    cyclic_dict: dict = {"b": b}
    cyclic_dict["self"] = cyclic_dict
    found = tensors_in((cyclic_list, cyclic_dict, [FreshPairs(c, a) for _ in range(50)]))
    assert {id(t) for t in found} == {id(a), id(b), id(c)}
    assert sum(t is c for t in found) == 50  # each fresh node's tensors: none skipped for a recycled id
