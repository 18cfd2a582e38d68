"""Pieces bench.py, cuda_check.py and checkpoint_cost.py share."""

from __future__ import annotations

import torch
import torch.nn as nn


def apply_fully_shard(model: nn.Module, units: set[type], reshard_after_forward: bool) -> nn.Module:
    """torch's ``fully_shard`` on every module of a unit class, then on the root (FSDP2's usual
    bottom-up wrapping), so it shards the same units shardwrap does."""
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():
        if isinstance(m, tuple(units)):
            fully_shard(m, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


class RecipeMLP(nn.Module):  # PyTorch's ZeroRedundancyOptimizer recipe: 20 x Linear(2000)
    def __init__(self, width: int = 2000, depth: int = 20) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x
