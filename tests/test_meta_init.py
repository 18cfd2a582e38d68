"""A model built on the meta device is materialized unit by unit, initialized like the CPU build."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import models
from harness import run_on_ranks


def on_ranks_meta(policy_name: str) -> dict:
    from shardwrap import ShardedModule

    policy = {models.Block, models.CausalMix} if policy_name == "units" else None
    with torch.device("meta"):
        on_meta = models.meta_net()
    torch.manual_seed(0 if dist.get_rank() == 0 else 123)  # ranks disagree: rank 0's numbers win
    meta = ShardedModule(on_meta, auto_wrap_policy=policy)
    torch.manual_seed(0)
    cpu = ShardedModule(models.meta_net(), auto_wrap_policy=policy)
    a, b = meta.full_state_dict(rank0_only=False), cpu.full_state_dict(rank0_only=False)
    buffers_equal = all(torch.equal(x, y) for (_, x), (_, y) in zip(meta.named_buffers(), cpu.named_buffers()))
    x = torch.randn(4, 6, 16)
    out_equal = torch.equal(meta(x), cpu(x))
    no_meta_left = not any(t.is_meta for t in list(meta.parameters()) + list(meta.buffers()))
    return {"params_equal": all(torch.equal(a[k], b[k]) for k in a), "buffers_equal": buffers_equal,
            "out_equal": out_equal, "no_meta_left": no_meta_left}


def test_meta_init_equals_cpu_init_from_the_same_seed():
    for policy in ("units", "root"):
        for r in run_on_ranks(2, on_ranks_meta, policy):
            assert all(r.values()), r


def on_ranks_meta_custom_init() -> dict:
    from shardwrap import ShardedModule

    def init(module: nn.Module) -> None:  # a user init that differs from reset_parameters
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    with torch.device("meta"):
        model = models.meta_net(dim=64)
    wrapped = ShardedModule(model, auto_wrap_policy={models.Block}, param_init_fn=init)
    full = wrapped.full_state_dict(rank0_only=False)
    mask = dict(wrapped.named_buffers())["mixes.0.mask"]
    return {
        "std": full["blocks.0.up.weight"].std().item(),
        "bias_zero": bool((full["blocks.0.up.bias"] == 0).all()),
        "mask_exact": torch.equal(mask, models.CausalMix(64).mask),
    }


def test_param_init_fn_same_distribution_and_exact_buffers():
    for r in run_on_ranks(2, on_ranks_meta_custom_init):
        assert abs(r["std"] - 0.02) < 0.002 and r["bias_zero"] and r["mask_exact"], r


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))


def on_ranks_meta_error() -> str:
    from shardwrap import ShardedModule

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), NoReset())
    try:
        ShardedModule(model)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_meta_module_without_init_is_refused():
    for message in run_on_ranks(2, on_ranks_meta_error):
        assert "'1'" in message and "NoReset" in message and "param_init_fn" in message, message
