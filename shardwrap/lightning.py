"""Lightning: ``Trainer(strategy="shardwrap_stage_2")``.

``import shardwrap.lightning`` registers ``shardwrap_stage_1``, ``shardwrap_stage_2``,
``shardwrap_stage_3`` and ``shardwrap_stage_3_offload`` in Lightning's ``StrategyRegistry`` (Lightning resolves the strategy string
before it loads any plugin entry point, so the import is needed). ``ShardwrapStrategy(...)`` takes
the options directly. See design/notes/lightning.md.

What the strategy does, in Lightning's order:

- ``setup``: after ``configure_model``, the whole LightningModule is wrapped in one
  ``ShardedModule`` (the root unit holds what no policy unit takes), then the optimizers from
  ``configure_optimizers`` are built on the sharded parameters. Steps run through the wrapper's
  forward (Lightning's forward redirection), so every unit's hooks run.
- precision: ``bf16-mixed``/``16-mixed`` gather and compute in the low dtype
  (``MixedPrecision(param_dtype=..., reduce_dtype=float32)``) under Lightning's autocast. fp16
  loss scaling is Lightning's own ``GradScaler``: on DTensor gradients its inf check is
  all-reduced over the mesh (DTensor's handler), so every rank skips the same steps.
- clipping: Lightning's ``clip_grad_norm_`` on the DTensor parameters is the global norm.
- accumulation: ``no_sync`` between micro-batches at stage 1 (no memory cost there); at stages 2
  and 3 only with ``accumulate_unsharded=True``, since it holds full gradients.
- checkpoints: a directory written by ``shardwrap.save_checkpoint`` (atomic, checksummed), with
  Lightning's own state (loops, callbacks, schedulers, hyperparameters) in one more file of the
  same commit; it loads at any number of devices. ``save_distributed_checkpoint=False`` writes one
  plain Lightning file instead (full tensors, from the first rank).
"""

from __future__ import annotations

import itertools

import io
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.optim import Optimizer

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from lightning.fabric.utilities.distributed import (
        _distributed_is_initialized,
        _get_default_process_group_backend_for_device,
        _init_dist_connection,
        _sync_ddp_if_available,
    )
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("shardwrap.lightning needs Lightning: pip install 'shardwrap[lightning]' (lightning>=2.4)") from exc

from shardwrap import checkpoint as _ckpt
from shardwrap.mixed_precision import MixedPrecision
from shardwrap.offload import Offload
from shardwrap.sharded_module import ShardedModule
from shardwrap.stage import Stage
from shardwrap.wrap import PolicyLike

LIGHTNING_STATE = "lightning-state.pt"  # Lightning's own state, inside a sharded checkpoint directory
_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ShardwrapStrategy(ParallelStrategy):
    """Train a LightningModule with shardwrap's ZeRO stage ``stage`` (1, 2 or 3) over every device.

    ``auto_wrap_policy``, ``mixed_precision``, ``max_unsharded``, ``param_init_fn`` and
    ``offload`` are ``ShardedModule``'s. ``mixed_precision`` overrides what Lightning's ``precision`` flag maps to.
    ``accumulate_unsharded``: skip the gradient reduction between accumulated micro-batches
    (``no_sync``); default: at stage 1 only, where gradients are full anyway.
    ``save_distributed_checkpoint=False``: checkpoints are one plain Lightning file of full tensors.
    """

    strategy_name = "shardwrap"

    def __init__(
        self,
        stage: int | Stage = 3,
        *,
        auto_wrap_policy: PolicyLike = None,
        mixed_precision: MixedPrecision | None = None,
        max_unsharded: int = 2,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        offload: Offload | None = None,
        accumulate_unsharded: bool | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        switches = Stage.of(stage)  # an unknown stage fails here, before any process starts
        if mixed_precision is not None:  # torch's MixedPrecisionPolicy is taken too; anything else fails here
            mixed_precision = MixedPrecision.of(mixed_precision)
        super().__init__(**kwargs)
        self.stage = stage
        self._switches = switches
        self._wrap_kwargs: dict[str, Any] = dict(
            auto_wrap_policy=auto_wrap_policy, max_unsharded=max_unsharded, param_init_fn=param_init_fn, offload=offload
        )
        self._mixed_precision = mixed_precision
        self._accumulate_unsharded = accumulate_unsharded
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._sharded: ShardedModule | None = None
        self.num_nodes = 1

    # ---- processes ---------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def is_distributed(self) -> bool:  # Lightning's test for a custom strategy: samplers, sync_dist
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = _get_default_process_group_backend_for_device(self.root_device)
        offload = self._wrap_kwargs["offload"]
        if backend == "nccl" and offload is not None and offload.enabled:
            # offloaded gradients are host tensors: gradient_clip_val (torch's clip_grad_norm_) and
            # 16-mixed (a GradScaler) reduce over them, which needs a CPU backend too
            backend = "cpu:gloo,cuda:nccl"
        self._process_group_backend = self._process_group_backend or backend
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    # ---- wrapping ----------------------------------------------------------------------------

    @property
    def sharded_module(self) -> ShardedModule:
        """The ``ShardedModule`` around the LightningModule (after ``setup``)."""
        if self._sharded is None:
            raise RuntimeError("ShardwrapStrategy: the model is wrapped in setup(); it is not wrapped yet")
        return self._sharded

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        if any(isinstance(c, StochasticWeightAveraging) for c in trainer.callbacks):  # type: ignore[attr-defined]
            # It copied the LightningModule before this wrap and would average the shards into
            # that copy (DTensor: "mixed torch.Tensor and DTensor"); Lightning refuses it up front
            # for its own FSDP and DeepSpeed strategies.
            raise ValueError(
                "StochasticWeightAveraging does not work with ShardwrapStrategy (as with Lightning's FSDP "
                "and DeepSpeed strategies): it keeps a copy of the LightningModule made before wrapping and "
                "averages the sharded parameters into it. Keep the average yourself: an EMA of the local "
                "shards as tensors (torch._foreach_lerp_ over the module's parameters in "
                "on_train_batch_end), or average full weights from trainer.strategy.sharded_module.full_state_dict()"
            )
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if self._sharded is None or self._sharded.module is not module:
            self._sharded = self._wrap(module)
        self.model = self._sharded
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()  # optimizers on the sharded parameters
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _wrap(self, module: nn.Module) -> ShardedModule:
        module = self.precision_plugin.convert_module(module)  # "bf16-true" etc.: before the shards exist
        mixed = self._mixed_precision
        precision = getattr(self.precision_plugin, "precision", "32-true")
        if mixed is None and precision in _MIXED:
            mixed = MixedPrecision(param_dtype=_MIXED[precision], reduce_dtype=torch.float32)
        tensors = itertools.chain(module.parameters(), module.buffers())
        if not any(t.is_meta for t in tensors):  # Lightning's model_to_device, before the shards exist
            module.to(self.root_device)
        try:
            return ShardedModule(module, stage=self.stage, mixed_precision=mixed, **self._wrap_kwargs)
        except ValueError as exc:
            if "meta device" not in str(exc):
                raise
            raise ValueError(f"{exc} (pass it as ShardwrapStrategy(param_init_fn=...)); configure_model() left the model on the meta device") from None

    def model_to_device(self) -> None:
        pass  # _wrap moved the module before sharding; the shards live where ShardedModule put them

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        unsharded = self._accumulate_unsharded
        if unsharded is None:
            unsharded = self._switches.keep_unsharded_grad
        if unsharded and self._sharded is not None:
            with self._sharded.no_sync():
                yield
        else:
            yield

    # ---- collectives -------------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def teardown(self) -> None:
        _ckpt.wait_for_saves()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---- checkpoints -------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model and the optimizers must exist (sharded) before a load

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint below restores them

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._save_distributed_checkpoint:
            return {}  # save_checkpoint reads the shards itself
        return self.sharded_module.full_state_dict(rank0_only=True)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._save_distributed_checkpoint:
            return {}
        return self.sharded_module.full_optim_state_dict(_unwrapped(optimizer), rank0_only=True)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint below loaded it

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("ShardwrapStrategy.save_checkpoint(..., storage_options=...): shardwrap writes the files itself; drop storage_options")
        # before the broadcast, a collective: OnExceptionCheckpoint saves on a rank whose step
        # raised while its peers are still inside theirs (the broadcast met theirs and hung)
        self.sharded_module.check_between_steps("save_checkpoint")
        path = str(self.broadcast(os.fspath(filepath)))
        # ModelCheckpoint(save_weights_only=True) leaves the optimizer out of the checkpoint dict
        optimizer = self._the_optimizer("save a checkpoint") if "optimizer_states" in checkpoint else None
        if not self._save_distributed_checkpoint:
            self._save_full(checkpoint, path)
            return
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if os.path.isfile(path):
            raise FileExistsError(
                f"ShardwrapStrategy: checkpoint path '{path}' is a file; sharded checkpoints are directories. "
                f"Remove it or pick another name"
            )
        body = _torch_bytes(rest) if self.global_rank == 0 else b""
        _ckpt.save_checkpoint_with(path, self.sharded_module, optimizer, extra_files={LIGHTNING_STATE: body})

    def _save_full(self, checkpoint: dict[str, Any], path: str) -> None:
        if os.path.isdir(path):
            raise IsADirectoryError(f"ShardwrapStrategy: checkpoint path '{path}' is a directory; a full checkpoint is one file")
        if self.global_rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            _ckpt.save_atomically(checkpoint, path)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        model = self.sharded_module
        model.check_between_steps("load_checkpoint")  # before the broadcast, as in save_checkpoint
        path = str(self.broadcast(os.fspath(checkpoint_path)))
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizer = self._the_optimizer("load a checkpoint") if fitting else None
        if os.path.isdir(path):
            found = _ckpt.load_checkpoint_with(path, model, optimizer, extra_files=[LIGHTNING_STATE])
            rest: dict[str, Any] = found[LIGHTNING_STATE]
            return rest

        def layout(content: Any) -> dict[str, Any]:  # a plain Lightning checkpoint file
            rest = {k: v for k, v in content.items() if k not in ("state_dict", "optimizer_states")}
            if optimizer is not None and "optimizer_states" not in content:
                raise ValueError(
                    f"it holds the model only (ModelCheckpoint(save_weights_only=True)), and resuming fit needs "
                    f"the optimizer's state: resume from a checkpoint saved with it, or load the weights alone "
                    f"(LightningModule.load_from_checkpoint, or trainer.validate/test with ckpt_path)"
                )
            optim = content["optimizer_states"][0] if optimizer is not None else None
            return {**rest, "model": content["state_dict"], "optim": optim}

        return _ckpt.load_full_with(path, model, optimizer, layout)

    def _the_optimizer(self, what: str) -> Optimizer | None:
        optimizers = [_unwrapped(o) for o in self.optimizers]
        if len(optimizers) > 1:
            raise NotImplementedError(
                f"ShardwrapStrategy cannot {what} with {len(optimizers)} optimizers yet: return one optimizer "
                f"from configure_optimizers (several parameter groups are fine)"
            )
        return optimizers[0] if optimizers else None

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"shardwrap_stage_{stage}", cls, description=f"shardwrap ZeRO stage {stage}", stage=stage
            )
        strategy_registry.register(  # DeepSpeed's deepspeed_stage_3_offload: master shards, gradients, optimizer in host memory
            "shardwrap_stage_3_offload", cls, description="shardwrap ZeRO stage 3, optimizer offloaded to host memory",
            stage=3, offload=Offload("cpu"),
        )


def export_lightning_checkpoint(checkpoint_dir: str, out_file: str) -> None:
    """Turn a sharded checkpoint directory that ``ShardwrapStrategy`` wrote into one plain Lightning
    checkpoint file (full tensors, a plain optimizer's state keyed by parameter index, Lightning's
    own state), atomically. Run it in one process, at any time after training;
    ``LitModel.load_from_checkpoint(out_file)`` loads it, and a plain strategy resumes from it."""
    whole = _ckpt.read_whole(checkpoint_dir, extra_files=[LIGHTNING_STATE])
    checkpoint = dict(whole[LIGHTNING_STATE])
    checkpoint["state_dict"] = whole["model"]
    if "optim" in whole:
        checkpoint["optimizer_states"] = [_keyed_by_index(whole["optim"])]
    _ckpt.save_atomically(checkpoint, out_file)


def _keyed_by_index(osd: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state dict (as sharded checkpoints hold it) keyed as a plain
    optimizer's: parameters numbered in the order of the parameter groups."""
    index: dict[str, int] = {}
    groups = []
    for group in osd["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    state = {index[name]: value for name, value in osd.get("state", {}).items()}
    return {"state": state, "param_groups": groups}


def _unwrapped(optimizer: Any) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _torch_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _register() -> None:
    if "shardwrap_stage_1" not in StrategyRegistry:
        ShardwrapStrategy.register_strategies(StrategyRegistry)


_register()
