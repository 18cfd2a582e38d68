"""Checkpoints on disk: sharded (``torch.distributed.checkpoint``) and single-file (``torch.save``).

Saves are atomic: everything is written under a temporary name beside the target and renamed into
place only after every rank finished, so a save that dies halfway leaves the previous checkpoint
loadable. Loads read into scratch copies, validate, and only then write into the model and
optimizer, so a bad checkpoint changes nothing. Nothing is unpickled: DCP, or
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardwrap import collectives
from shardwrap.state_dict import check_full, init_optim_state

if TYPE_CHECKING:
    from shardwrap.sharded_module import ShardedModule


def _agree(value: Any, model: "ShardedModule") -> Any:
    """The mesh's first rank's ``value`` on every rank."""
    return collectives.broadcast_object(value, model.mesh.get_group())


def _write(state: dict[str, Any], tmp: str) -> None:
    dcp.save(state, checkpoint_id=tmp)


def _commit(tmp: str, path: str) -> None:
    """Swap ``tmp`` into ``path``: the old checkpoint stays complete until the new one is."""
    old = f"{path}.old-{uuid.uuid4().hex[:8]}"
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(path: str, model: "ShardedModule", optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save the sharded model (and optimizer) state to the directory ``path`` with DCP; every rank
    writes its own shards. Load it at any world size with ``load_checkpoint``."""
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = model.sharded_optim_state_dict(optimizer)
    tmp = _agree(f"{path}.tmp-{uuid.uuid4().hex[:8]}", model)
    try:
        _write(state, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    collectives.barrier(model.mesh.get_group())
    if model.mesh.get_local_rank() == 0:
        _commit(tmp, path)
    collectives.barrier(model.mesh.get_group())


def load_checkpoint(path: str, model: "ShardedModule", optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint written by ``save_checkpoint`` at any world size. On any problem the
    error names the checkpoint and the key, and the model and optimizer are unchanged."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"checkpoint '{path}': no DCP checkpoint there (no .metadata file)")
    scratch: dict[str, Any] = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    if optimizer is not None:
        init_optim_state(optimizer)
        osd = model.sharded_optim_state_dict(optimizer)
        scratch["optim"] = {
            "state": {n: {k: _clone(v) for k, v in entry.items()} for n, entry in osd["state"].items()},
            "param_groups": osd["param_groups"],
        }
    try:
        dcp.load(scratch, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise RuntimeError(
            f"checkpoint '{path}' could not be loaded into this model ({type(exc).__name__}: {exc}); "
            f"the model and optimizer are unchanged"
        ) from exc
    try:
        model.load_state_dict(scratch["model"])
        if optimizer is not None:
            model.load_sharded_optim_state_dict(optimizer, scratch["optim"])
    except ValueError as exc:
        raise ValueError(f"checkpoint '{path}': {exc}") from exc


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def export_to_torch_save(checkpoint_dir: str, out_file: str) -> None:
    """Convert a DCP checkpoint into one ``torch.save`` file of full tensors, atomically.
    Run it in one process; ``torch.load(out_file, weights_only=True)["model"]`` loads into the
    unwrapped model."""
    tmp = f"{out_file}.tmp-{uuid.uuid4().hex[:8]}"
    dcp_to_torch_save(checkpoint_dir, tmp)
    os.replace(tmp, out_file)


def save_full(path: str, model: "ShardedModule", optimizer: torch.optim.Optimizer | None = None) -> None:
    """Gather full model (and optimizer) state on the first rank and ``torch.save`` it atomically:
    a plain PyTorch checkpoint that loads into the unwrapped model."""
    state: dict[str, Any] = {"model": model.full_state_dict()}
    if optimizer is not None:
        state["optim"] = model.full_optim_state_dict(optimizer)
    if model.mesh.get_local_rank() == 0:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        torch.save(state, tmp)
        os.replace(tmp, path)
    collectives.barrier(model.mesh.get_group())


def load_full(path: str, model: "ShardedModule", optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a ``save_full`` file (or any ``{"model": state_dict}`` file) at any world size."""
    state: dict[str, Any] = {}
    problem = None
    if model.mesh.get_local_rank() == 0:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            problem = f"checkpoint '{path}' could not be read ({type(exc).__name__}: {exc}); the model is unchanged"
        else:
            problems = check_full(model, optimizer, state)
            if problems:
                problem = f"checkpoint '{path}': {len(problems)} problem(s), nothing was loaded: " + "; ".join(problems)
    problem = _agree(problem, model)
    if problem:
        raise RuntimeError(problem)
    try:
        model.load_full_state_dict(state.get("model", {}))
        if optimizer is not None:
            model.load_full_optim_state_dict(optimizer, state.get("optim", {}))
    except ValueError as exc:
        raise ValueError(f"checkpoint '{path}': {exc}") from exc
