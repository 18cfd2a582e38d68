"""Pieces bench.py and cuda_check.py share."""

from __future__ import annotations

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
