"""Pieces bench.py, cuda_check.py and checkpoint_cost.py share."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

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


def apply_ac(model: nn.Module, units: set[type]) -> nn.Module:
    """Activation checkpointing on every module of a unit class, in place, before any wrapping:
    ``apply_activation_checkpointing`` with non-reentrant ``checkpoint_wrapper``. Each block then
    sits inside a ``CheckpointWrapper`` (as its ``_checkpoint_wrapped_module``), so a wrap policy
    or ``fully_shard`` loop that matches the block class still finds every block and makes it the
    unit, and the whole unit's forward is recomputed in backward."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, CheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper,
    )

    blocks = [m for m in model.modules() if isinstance(m, tuple(units))]
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, tuple(units)),
    )
    wrapped = [m._checkpoint_wrapped_module for m in model.modules() if isinstance(m, CheckpointWrapper)]
    found = [m for m in model.modules() if isinstance(m, tuple(units))]
    assert blocks and [id(m) for m in wrapped] == [id(m) for m in blocks] == [id(m) for m in found], (
        "apply_activation_checkpointing must wrap each block once and leave it findable")
    return model


class RecipeMLP(nn.Module):  # PyTorch's ZeroRedundancyOptimizer recipe: 20 x Linear(2000)
    def __init__(self, width: int = 2000, depth: int = 20) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class HeapPeak:
    """The process heap's peak in-use bytes while the context is open, above its level at entry.

    A thread polls glibc's ``mallinfo2`` (small blocks in use plus mmapped blocks: every tensor
    storage on CPU) every 0.2 ms. It is what the benchmark measures where its dispatch-mode
    tracker (shardwrap/memory.py) cannot run: torch.compile refuses to run under a Python
    dispatch mode. It sees every allocation the compiled kernels make, but also the interpreter's
    own, so it compares like with like only when eager and compiled runs are both measured with it.
    """

    def __init__(self) -> None:
        import ctypes

        class _Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = _Info
        self.peak = 0

    def _used(self) -> int:
        info = self._libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    def _poll(self) -> None:
        import time

        while not self._stop:
            self._max = max(self._max, self._used())
            time.sleep(0.0002)

    def __enter__(self) -> "HeapPeak":
        import threading

        self._stop, self._base = False, self._used()
        self._max = self._base
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()
        self.peak = max(self._max, self._used()) - self._base


def finish_gpu_report(out: str, name: str, lines: list[str], report: dict[str, Any], failures: list[str], on_gpu: bool) -> None:
    """Print a GPU check's report with its result, write ``name``.md and .json under ``out`` (not
    for a CPU plumbing run), and exit 1 if a check failed."""
    lines = lines + ["\n## Result\n", "all checks passed" if not failures else "FAILED:\n" + "\n".join(f"- {f}" for f in failures)]
    text = "\n".join(lines) + "\n"
    print(text)
    if on_gpu:  # the CPU plumbing run writes nothing into the results
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write(text)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
    sys.exit(1 if failures else 0)
