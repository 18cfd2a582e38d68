"""Methods other than ``forward`` that read a unit's own parameters (CLIP's ``encode_text``, a
VAE's ``encode``), registered with ``ShardedModule.register_forward_method`` (``fully_shard``'s
``register_fsdp_forward_method``). Each check trains the wrapped model against the unwrapped one
on the whole global batch, with SGD + momentum and AdamW, and compares every parameter after
each step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_on_ranks

DIM = 12


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.gain = nn.Parameter(torch.ones(DIM))

    def embed(self, x: torch.Tensor) -> torch.Tensor:  # reads the tower's own parameters
        return torch.tanh(self.lin(x)) * self.gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x)


class Clip(nn.Module):
    """Root-owned projections; ``encode_text`` calls the tower's ``embed`` directly (no hooks
    of its own), ``encode_image`` calls the image tower as a module."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.image = Tower(), Tower()
        self.text_proj = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.image_proj = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def encode_text(self, t: torch.Tensor) -> torch.Tensor:
        return self.text.embed(t) @ self.text_proj

    def encode_image(self, i: torch.Tensor) -> torch.Tensor:
        return self.image(i) @ self.image_proj

    def forward(self, t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return (self.encode_text(t) * self.encode_image(i)).sum(-1) * self.scale


def loss_of(model: nn.Module, t: torch.Tensor, i: torch.Tensor, step: int) -> torch.Tensor:
    """Even steps through ``forward``; odd steps through the two methods, called from outside."""
    if step % 2 == 0:
        return model(t, i).pow(2).mean()
    return model.encode_text(t).pow(2).mean() + model.encode_image(i).pow(2).mean()


def train(stage: int, optim: str, register: str | None) -> float:
    """``register``: "shardwrap" (``model.register_forward_method``), "torch" (torch's
    ``register_fsdp_forward_method`` on the same modules, as code written for ``fully_shard``
    calls it), or None."""
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Clip()
    model = ShardedModule(Clip(), auto_wrap_policy={Tower}, stage=stage)
    model.load_state_dict(ref.state_dict())
    if register == "shardwrap":
        model.register_forward_method("encode_text")
        model.register_forward_method("encode_image")
        model.register_forward_method("embed", module=model.module.text)
    elif register == "torch":
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "encode_text")
        register_fsdp_forward_method(model.module, "encode_image")  # the wrapped model: the root unit's module
        register_fsdp_forward_method(model.module.text, "embed")
    opts = []
    for params in (ref.parameters(), model.parameters()):
        opts.append(torch.optim.SGD(params, lr=0.1, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(params, lr=0.02))
    worst = 0.0
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        t, i = torch.randn(2 * world, DIM, generator=g), torch.randn(2 * world, DIM, generator=g)
        loss_of(ref, t, i, step).backward()
        loss_of(model, t.chunk(world)[rank], i.chunk(world)[rank], step).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        full = model.full_state_dict(rank0_only=False)
        worst = max(worst, max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()))
    return worst


@pytest.mark.parametrize("register", ["shardwrap", "torch"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_registered_methods_train_like_the_unwrapped_model(stage, optim, register):
    # torch's register_fsdp_forward_method reached fully_shard's state (_get_fsdp_state) at the call
    for gap in run_on_ranks(2, train, stage, optim, register):
        assert gap < 1e-5, gap


def unregistered(stage: int) -> str:
    try:
        train(stage, "sgd", None)
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_an_unregistered_method_that_reads_a_units_parameters_raises_and_names_the_fix():
    for message in run_on_ranks(2, unregistered, 3):
        assert "register_forward_method" in message, message


def bad_registrations() -> list[str]:
    from shardwrap import ShardedModule

    model = ShardedModule(Clip(), auto_wrap_policy={Tower}, stage=3)
    messages = []
    for name, module in (("encode_txt", None), ("lin", model.module.text), ("embed", model.module.text.lin)):
        try:
            model.register_forward_method(name, module=module)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_registering_a_missing_method_or_a_module_that_is_no_unit_raises():
    for messages in run_on_ranks(2, bad_registrations):
        assert len(messages) == 3, messages
        assert "no method 'encode_txt'" in messages[0]
        assert "no method 'lin'" in messages[1]
        assert "Linear is not a unit" in messages[2] and "text" in messages[2]
