"""A CPU-friendly tracker of live tensor storages (used by the examples and the benchmark).

A ``TorchDispatchMode`` keeps a weak reference to every tensor an op returns; every ``every`` ops
(and whenever ``sample()`` is called) it sums the current ``nbytes`` of the distinct live storages
and keeps the peak. Reading ``nbytes`` at sample time means storages that were resized (FSDP2 and
shardwrap free unsharded parameters with ``resize_(0)``) count at their real size.

With a ``classify`` callback, every new peak is also split into categories: the callback names
the tensors that are parameters, gradients and optimizer state at that moment (first claim wins),
tensors autograd saved for backward count as activations, and the rest (communication buffers,
temporaries, gradients of activations in flight) as "other".
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

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


CATEGORIES = ("params", "grads", "optim", "activations", "other")


class LiveStorages(TorchDispatchMode):
    def __init__(
        self,
        roots: Iterable[torch.Tensor] = (),
        every: int = 25,
        classify: Callable[[], dict[str, Iterable[Any]]] | None = None,
    ) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = [weakref.ref(_local(t)) for t in roots]
        self.every = every
        self.count = 0
        self.peak = 0
        self.classify = classify
        self.peak_split: dict[str, int] = {}
        self._saved: list[weakref.ref] = []  # tensors autograd saved for backward
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._saved.append(weakref.ref(t))
        return t

    def __enter__(self):  # type: ignore[no-untyped-def]
        self._saving.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._saving.__exit__(*exc)

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        self.refs += [weakref.ref(_local(t)) for t in tensors if isinstance(t, torch.Tensor)]

    def live(self) -> list[torch.Tensor]:
        alive = [r() for r in self.refs]
        self.refs = [r for r, t in zip(self.refs, alive) if t is not None]
        self._saved = [r for r in self._saved if r() is not None]
        return [t for t in alive if t is not None]

    def sample(self) -> int:
        live = self.live()
        total, _ = storage_bytes(live)
        if total > self.peak:
            self.peak = total
            if self.classify is not None:
                self.peak_split = self._split(live)
        return total

    def _split(self, live: list[torch.Tensor]) -> dict[str, int]:
        owner: dict[int, str] = {}
        claims = {**self.classify(), "activations": [r() for r in self._saved]}  # type: ignore[misc]
        for category, tensors in claims.items():
            for t in tensors:
                if isinstance(t, torch.Tensor) and _local(t).untyped_storage().nbytes():
                    owner.setdefault(_local(t).untyped_storage().data_ptr(), category)
        out = dict.fromkeys(CATEGORIES, 0)
        seen: set[int] = set()
        for t in live:
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if s.nbytes() and ptr not in seen:
                seen.add(ptr)
                out[owner.get(ptr, "other")] += s.nbytes()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (list, tuple)) else [out]
        self.track(t for t in flat if isinstance(t, torch.Tensor))
        self.count += 1
        if self.count % self.every == 0:
            self.sample()
        return out


def _unsharded_buffers(model: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """The unsharded parameter and gradient buffers an implementation keeps between steps (so a
    tracker started later still sees them when their storage is re-grown): shardwrap's, FSDP1's
    flat parameters and FSDP2's per-parameter all-gather outputs."""
    params: list[Any] = []
    grads: list[Any] = []
    units = getattr(model, "units", None)
    if units:  # shardwrap (its modules are FSDPModules too, without fully_shard's state)
        params = [h.unsharded_buffer for h in units]
        grads = [h.unsharded_trainable.grad for h in units]
        return [t for t in params if t is not None], [t for t in grads if t is not None]
    for m in model.modules():
        flat = getattr(getattr(m, "_handle", None), "flat_param", None)  # FSDP1
        if flat is not None:
            params += [flat, getattr(flat, "_full_param_padded", None), getattr(flat, "_local_shard", None)]
            grads += [flat.grad, getattr(flat, "_saved_grad_shard", None)]
        state = getattr(m, "_get_fsdp_state")() if hasattr(m, "_get_fsdp_state") else None  # FSDP2
        group = getattr(state, "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", None) or []:
            params += list(getattr(fp, "all_gather_outputs", None) or [])
            unsharded = getattr(fp, "_unsharded_param", None)
            params.append(unsharded)
            grads.append(getattr(unsharded, "grad", None))
    return [t for t in params if t is not None], [t for t in grads if t is not None]


def unsharded_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Unsharded parameter buffers and gradients of a ShardedModule, FSDP1 or FSDP2 model (empty
    for other models): roots for ``LiveStorages``."""
    params, grads = _unsharded_buffers(model)
    return params + grads


def optimizer_states(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The optimizer's per-parameter state tensors (``step`` counters excluded); a
    ZeroRedundancyOptimizer's local optimizer is looked into."""
    inner = getattr(optimizer, "optim", optimizer)
    return [v for s in getattr(inner, "state", {}).values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, as the optimizer sees them
    (distinct storages; DTensors count their local shard)."""
    params = list(model.parameters())
    p_bytes, p_seen = storage_bytes(params)
    g_bytes, g_seen = storage_bytes([p.grad for p in params if p.grad is not None], p_seen)
    o_bytes, _ = storage_bytes(optimizer_states(optimizer), p_seen | g_seen)
    out = {"params": p_bytes, "grads": g_bytes, "optim": o_bytes}
    # stages 1 and 2 keep them; stage 1's shard and gradient may be rows of them (counted above)
    out["unsharded"], _ = storage_bytes(unsharded_tensors(model), p_seen | g_seen)
    return out


def state_classifier(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Callable[[], dict[str, list[Any]]]:
    """A ``classify`` callback for ``LiveStorages``: the parameters (the optimizer's shards and
    whatever unsharded copies exist at that moment), gradients and optimizer state of ``model``.

    Knows shardwrap's unsharded buffers, FSDP1's flat parameters, and FSDP2's unsharded
    parameters; DDP and plain models hold full parameters anyway."""

    def classify() -> dict[str, list[Any]]:
        params = list(model.parameters())
        params += [p for m in model.modules() for p in m._parameters.values() if p is not None]
        # FSDP2 registers unsharded parameters on the modules while unsharded; the optimizer still
        # holds the sharded ones
        params += [p for g in getattr(optimizer, "param_groups", []) for p in g["params"]]
        grads: list[Any] = [p.grad for p in params if p.is_leaf]
        unsharded, unsharded_grads = _unsharded_buffers(model)
        params += unsharded
        grads += unsharded_grads
        return {"params": params, "grads": grads, "optim": optimizer_states(optimizer)}

    return classify
