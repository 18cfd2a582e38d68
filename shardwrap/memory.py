"""A CPU-friendly tracker of live tensor storages (used by the examples and the benchmark).

A ``TorchDispatchMode`` keeps a weak reference to every tensor an op returns; every ``every`` ops
(and whenever ``sample()`` is called) it sums the current ``nbytes`` of the distinct live storages
and keeps the peak. Reading ``nbytes`` at sample time means storages that were resized (FSDP2 and
shardwrap free unsharded parameters with ``resize_(0)``) count at their real size.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor -> its shard


def storage_bytes(tensors: Iterable[Any], exclude: set[int] | None = None) -> tuple[int, set[int]]:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = _local(t).untyped_storage()
        ptr = s.data_ptr()
        if s.nbytes() == 0 or ptr in seen or (exclude and ptr in exclude):
            continue
        seen.add(ptr)
        total += s.nbytes()
    return total, seen


class LiveStorages(TorchDispatchMode):
    def __init__(self, roots: Iterable[torch.Tensor] = (), every: int = 25) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = [weakref.ref(_local(t)) for t in roots]
        self.every = every
        self.count = 0
        self.peak = 0

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        self.refs += [weakref.ref(_local(t)) for t in tensors if isinstance(t, torch.Tensor)]

    def live(self) -> list[torch.Tensor]:
        alive = [r() for r in self.refs]
        self.refs = [r for r, t in zip(self.refs, alive) if t is not None]
        return [t for t in alive if t is not None]

    def sample(self) -> int:
        total, _ = storage_bytes(self.live())
        self.peak = max(self.peak, total)
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (list, tuple)) else [out]
        self.track(t for t in flat if isinstance(t, torch.Tensor))
        self.count += 1
        if self.count % self.every == 0:
            self.sample()
        return out


def unsharded_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """A ShardedModule's unsharded parameter buffers and gradients (empty for other models)."""
    units = getattr(model, "units", None) or []
    internal = [h._padded_unsharded for h in units] + [h.unsharded_trainable.grad for h in units]
    return [t for t in internal if t is not None]


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, as the optimizer sees them
    (distinct storages; DTensors count their local shard)."""
    params = list(model.parameters())
    p_bytes, p_seen = storage_bytes(params)
    g_bytes, g_seen = storage_bytes([p.grad for p in params if p.grad is not None], p_seen)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps a local optimizer
    states = [v for s in getattr(inner, "state", {}).values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    o_bytes, _ = storage_bytes(states, p_seen | g_seen)
    out = {"params": p_bytes, "grads": g_bytes, "optim": o_bytes}
    # stages 1 and 2 keep them; stage 1's shard and gradient may be rows of them (counted above)
    out["unsharded"], _ = storage_bytes(unsharded_tensors(model), p_seen | g_seen)
    return out
