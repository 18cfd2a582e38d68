"""Lightning runs for tests/test_lightning.py, launched as a user launches them:
``python tests/lightning_worker.py OUT DEVICES SCENARIO...`` with ``Trainer(devices=DEVICES)`` and
Lightning's own CPU launcher, which starts the other ranks by running this script again. Each
scenario trains a tiny model and writes what the test compares (full parameters, logged values,
skipped steps) to ``OUT/<scenario>.pt`` from the first rank.

A scenario is ``name:strategy:optimizer[:option=value...]``: strategy ``ddp`` or a shardwrap
string; options ``clip``, ``accumulate``, ``precision``, ``epochs``, ``save`` (a checkpoint path
written at every epoch end), ``resume`` (a checkpoint to resume from), ``full`` (single-file
checkpoints), ``inf_at`` (a step at which the last rank's first gradient gets an inf), ``finetune``
(the model built in ``__init__`` and Lightning's ``BaseFinetuning`` freezing ``FROZEN`` before
the strategy wraps it, then unfreezing ``UNFROZEN`` into a new param group at epoch 1)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning, Callback, ModelCheckpoint

import shardwrap.lightning  # noqa: F401  (registers the shardwrap_stage_N strings)
from shardwrap.lightning import ShardwrapStrategy

BATCH = 4  # per rank
SAMPLES = 32
DIM = 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


# finetune: frozen before wrapping, the root unit's embed, blocks.0 whole and blocks.1's norm (its
# unit keeps training its fc); unfrozen at epoch 1: blocks.0 and blocks.1.norm
FROZEN = ("net.embed", "net.blocks.0", "net.blocks.1.norm")
UNFROZEN = ("net.blocks.0", "net.blocks.1.norm")


class Finetune(BaseFinetuning):
    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze([pl_module.get_submodule(name) for name in FROZEN], train_bn=False)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:  # a tenth of the first group's learning rate (initial_denom_lr)
            self.unfreeze_and_add_param_group([pl_module.get_submodule(name) for name in UNFROZEN], optimizer)


class Unresettable(nn.Module):
    """A module that cannot initialize itself (no reset_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, DIM, generator=g)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long())


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)


class Classifier(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd", inf_at: int = -1, build: str = "plain") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: nn.Module | None = None
        if build == "eager":  # built here, as a pretrained backbone is: BaseFinetuning's setup freezes it before configure_model
            torch.manual_seed(1)
            self.net = Net()
        self.logged: list[float] = []
        self.skipped: list[bool] = []

    def configure_model(self) -> None:
        if self.net is not None:
            return
        torch.manual_seed(1)
        if self.hparams.build == "meta":  # left on the meta device, one module unable to initialize
            with torch.device("meta"):
                self.net = nn.Sequential(Net(), Unresettable())
        elif self.hparams.build == "prewrapped":  # the user wraps it, then runs Lightning's DDP
            from shardwrap import ShardedModule

            self.net = ShardedModule(Net(), auto_wrap_policy={Block})
        else:
            self.net = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self.log("train_loss", loss, sync_dist=True)
        self.log("rank_value", float(self.global_rank), sync_dist=True, reduce_fx="mean")
        return loss

    def on_after_backward(self) -> None:
        if self.global_step == self.hparams.inf_at and self.global_rank == self.trainer.world_size - 1:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            local = grads[0].to_local() if hasattr(grads[0], "to_local") else grads[0]
            if local.numel():
                local.view(-1)[0] = float("inf")

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).float(), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        opt = make_optimizer(self.hparams.optimizer, [p for p in self.parameters() if p.requires_grad])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Record(Callback):
    """Which optimizer steps were skipped (fp16 overflow), by the parameters not moving."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.before = [p.detach().clone() for p in module.parameters()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        module.skipped.append(all(torch.equal(a, b.detach()) for a, b in zip(self.before, module.parameters())))
        module.logged.append(float(trainer.callback_metrics["rank_value"]))


def full_params(trainer: pl.Trainer, module: Classifier) -> dict[str, torch.Tensor]:
    strategy = trainer.strategy
    if isinstance(strategy, ShardwrapStrategy):
        return strategy.sharded_module.full_state_dict(rank0_only=False)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def run(out: str, devices: int, spec: str) -> None:
    name, strategy, optimizer, *rest = spec.split(":")
    options = dict(o.split("=", 1) for o in rest)
    callbacks: list[Callback] = [Record()]
    if "swa" in options:
        from lightning.pytorch.callbacks import StochasticWeightAveraging

        callbacks.append(StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1))
    if "save" in options:
        callbacks.append(ModelCheckpoint(dirpath=options["save"], filename="{epoch}", save_top_k=-1, every_n_epochs=1,
                                         save_weights_only="weights" in options))
    if "finetune" in options:
        callbacks.append(Finetune())
    chosen: object = strategy
    if "full" in options:
        chosen = ShardwrapStrategy(stage=int(strategy[-1]), save_distributed_checkpoint=False)
    plugins = []
    precision = options.get("precision", "32-true")
    if precision == "16-mixed":
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu"))
        precision = None
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=chosen, max_epochs=int(options.get("epochs", 1)),
        gradient_clip_val=float(options["clip"]) if "clip" in options else None,
        accumulate_grad_batches=int(options.get("accumulate", 1)), precision=precision, plugins=plugins,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing="save" in options, num_sanity_val_steps=0, use_distributed_sampler=True,
    )
    build = "meta" if "meta" in options else "prewrapped" if "prewrapped" in options else "eager" if "finetune" in options else "plain"
    module = Classifier(optimizer, inf_at=int(options.get("inf_at", -1)), build=build)
    batch = BATCH * (2 // devices)  # one device sees the global batch of two
    train = DataLoader(data(), batch_size=batch, shuffle=False)
    try:
        trainer.fit(module, train, ckpt_path=options.get("resume"))
    except Exception as exc:  # the error scenarios: every rank raises it
        if trainer.global_rank == 0:
            torch.save({"error": f"{type(exc).__name__}: {exc}"}, os.path.join(out, f"{name}.pt"))
        return
    result = {
        "params": full_params(trainer, module), "logged": module.logged, "skipped": module.skipped,
        "lr": trainer.optimizers[0].param_groups[0]["lr"], "world": trainer.world_size,
    }
    if options.get("evaluate"):
        validated = trainer.validate(module, DataLoader(data(), batch_size=batch), verbose=False)
        predictions = trainer.predict(module, DataLoader(data(), batch_size=batch))
        result["predictions"] = torch.cat(predictions)  # type: ignore[arg-type]
        result["val_loss"] = float(validated[0]["val_loss"])
        if isinstance(trainer.strategy, ShardwrapStrategy):
            units = trainer.strategy.sharded_module.units
            result["idle"] = all(u.training_state.name == "IDLE" for u in units)
            result["grads"] = sum(p.grad is not None for p in module.parameters())
        result["reduced"] = float(trainer.strategy.reduce(torch.tensor(float(trainer.global_rank)), reduce_op="sum"))
        result["broadcast"] = trainer.strategy.broadcast(f"from rank {trainer.global_rank}")
        trainer.strategy.barrier()
    if trainer.global_rank == 0:
        torch.save(result, os.path.join(out, f"{name}.pt"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir, n = sys.argv[1], int(sys.argv[2])
    try:
        for scenario in sys.argv[3:]:
            run(out_dir, n, scenario)
    finally:
        # Lightning leaves its process group up; take down its threads and connections, as the
        # README asks of a script (an abort at exit is another matter: design/notes/failure-modes.md)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
