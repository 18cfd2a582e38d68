"""DeepSpeed's Lightning sentiment classifier on shardwrap: the same LightningModule under DDP and
ZeRO stages 1-3, with Lightning's own launcher (no torchrun).

    OMP_NUM_THREADS=1 python examples/lightning_classifier.py --strategy shardwrap_stage_2

Lightning's CPU launcher starts the second process by running this script again
(``Trainer(accelerator="cpu", devices=2)``). The one-line change from DDP is the strategy string,
after ``import shardwrap.lightning`` (which registers the strings):

    Trainer(strategy="ddp")  ->  Trainer(strategy="shardwrap_stage_2")

This script builds the strategy object from the string instead, so that each encoder layer is a
unit: ``ShardwrapStrategy(stage=2, auto_wrap_policy={nn.TransformerEncoderLayer})``.

The model and the data are examples/text_classifier.py's: an embedding, a positional parameter,
``nn.TransformerEncoderLayer`` blocks and a linear head, on generated sentences of neutral words
with a few sentiment words mixed in, labelled by which kind is in the majority (no download).
``--strategy all`` (the default) trains each strategy in turn in the same launch, then rank 0
prints one table: held-out accuracy (counts summed over ranks), mean step time (a callback
around the training batches, the first steps left out) and each rank's model-state memory
(parameters + gradients + optimizer state, the peak of the samples taken after forward, after
backward and after the step), with its ratio to DDP's.
"""

import argparse
import os
import random
import time

STRATEGIES = ["ddp", "shardwrap_stage_1", "shardwrap_stage_2", "shardwrap_stage_3"]
OFFLOAD = "shardwrap_stage_3_offload"
WARMUP = 5  # training steps left out of the step time; the memory is sampled during them

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--strategy", default="all", choices=[*STRATEGIES, OFFLOAD, "all"],
               help="one strategy, or all of them in turn (default)")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
p.add_argument("--devices", type=int, default=2, help="CPU processes (Lightning starts them)")
p.add_argument("--batch-size", type=int, default=32, help="sentences per rank per step")
p.add_argument("--d-model", type=int, default=64)
p.add_argument("--layers", type=int, default=2)
args = p.parse_args()
if args.devices < 1:
    p.error("--devices must be at least 1")

# torch and Lightning take seconds to import: the command line is read first, so --help answers
# at once.
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.strategies import StrategyRegistry

import shardwrap.lightning  # noqa: F401  (registers the shardwrap_stage_N strings; needed before Trainer(strategy="shardwrap_..."))
from shardwrap.lightning import ShardwrapStrategy
from shardwrap.memory import model_state_bytes

if args.strategy == OFFLOAD and OFFLOAD not in StrategyRegistry:
    p.error(f"--strategy {OFFLOAD}: offload is not available in this version of shardwrap "
            f"(no '{OFFLOAD}' in Lightning's StrategyRegistry); use shardwrap_stage_3")
if args.strategy == "all":
    chosen = STRATEGIES + ([OFFLOAD] if OFFLOAD in StrategyRegistry else [])
else:
    chosen = [args.strategy]

# ---- data: (N, T) word ids and 0/1 labels (examples/text_classifier.py's generator) ---------------
POSITIVE = "good great lovely fine bright happy warm brilliant kind superb".split()
NEGATIVE = "bad awful dull poor grim sad cold broken rude dreadful".split()
NEUTRAL = "the a film story actor scene plot music today it was and very with of".split()
VOCAB = ["<pad>"] + POSITIVE + NEGATIVE + NEUTRAL
IDS = {w: i for i, w in enumerate(VOCAB)}
T = 24


def sentences(n: int, seed: int) -> TensorDataset:
    rng = random.Random(seed)
    ids, labels = [], []
    for _ in range(n):
        pos, neg = rng.randint(0, 4), rng.randint(0, 4)
        while pos == neg:
            neg = rng.randint(0, 4)
        words = [rng.choice(POSITIVE) for _ in range(pos)] + [rng.choice(NEGATIVE) for _ in range(neg)]
        words += [rng.choice(NEUTRAL) for _ in range(T - len(words))]
        rng.shuffle(words)
        ids.append([IDS[w] for w in words])
        labels.append(int(pos > neg))
    return TensorDataset(torch.tensor(ids), torch.tensor(labels))


class Classifier(nn.Module):
    def __init__(self, d_model: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), d_model)
        self.pos = nn.Parameter(torch.randn(T, d_model) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d_model, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos  # (B, T, D)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))  # (B, 2)


class SentimentModel(pl.LightningModule):
    def __init__(self, d_model: int = 64, layers: int = 2, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: Classifier | None = None
        self.counts = torch.zeros(2)  # correct, seen (this rank, this validation epoch)
        self.accuracy = float("nan")  # the last validation's, over every rank

    def configure_model(self) -> None:  # every rank builds the same model
        if self.net is None:
            torch.manual_seed(0)
            self.net = Classifier(self.hparams.d_model, self.hparams.layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(ids)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        loss = nn.functional.cross_entropy(self(ids).float(), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self.counts = torch.zeros(2)

    def validation_step(self, batch, batch_idx):
        ids, labels = batch
        self.counts += torch.tensor([float((self(ids).argmax(-1) == labels).sum()), float(len(labels))])

    def on_validation_epoch_end(self) -> None:
        total = self.trainer.strategy.reduce(self.counts.clone(), reduce_op="sum")  # every rank's part
        self.accuracy = float(total[0] / total[1])
        self.log("val_acc", self.accuracy, prog_bar=True, sync_dist=True)  # the same value on every rank

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def ddp_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """A plain module's parameters, gradients and optimizer state (tensors, step counters excluded)."""
    params = list(module.parameters())
    tensors = params + [q.grad for q in params if q.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return sum(t.nbytes for t in tensors)


class Meter(pl.Callback):
    """Step time around each training batch (after the first WARMUP steps), and this rank's
    model-state bytes sampled after forward, after backward and after the step (during the
    first WARMUP steps, so that the sampling is not timed)."""

    def __init__(self) -> None:
        self.steps = 0
        self.times: list[float] = []
        self.peak = 0
        self.start = 0.0

    def sample(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.steps >= WARMUP:
            return
        optimizer = trainer.optimizers[0]
        strategy = trainer.strategy
        if isinstance(strategy, ShardwrapStrategy):
            now = sum(model_state_bytes(strategy.sharded_module, optimizer).values())
        else:
            now = ddp_state_bytes(module, optimizer)
        self.peak = max(self.peak, now)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.start = time.perf_counter()

    def on_before_backward(self, trainer, module, loss) -> None:  # unsharded parameters still held
        self.sample(trainer, module)

    def on_after_backward(self, trainer, module) -> None:  # gradients
        self.sample(trainer, module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.steps >= WARMUP:
            self.times.append(time.perf_counter() - self.start)
        self.sample(trainer, module)  # after the step: optimizer state
        self.steps += 1


def make_strategy(name: str):
    if name.startswith("shardwrap_stage_") and name != OFFLOAD:
        # the string alone works too: Trainer(strategy=name); the object takes the options
        return ShardwrapStrategy(stage=int(name[-1]), auto_wrap_policy={nn.TransformerEncoderLayer})
    return name


def run(name: str, train_set: TensorDataset, test_set: TensorDataset) -> dict:
    pl.seed_everything(0, verbose=False)
    meter = Meter()
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=make_strategy(name), precision=args.precision,
        max_epochs=args.epochs, callbacks=[meter], logger=False, enable_checkpointing=False,
        num_sanity_val_steps=0, enable_model_summary=False,
    )
    model = SentimentModel(args.d_model, args.layers)
    train = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    held_out = DataLoader(test_set, batch_size=256)
    trainer.fit(model, train, held_out)  # Lightning puts a DistributedSampler on both
    step_ms = 1000 * sum(meter.times) / max(len(meter.times), 1)
    per_rank = trainer.strategy.all_gather(torch.tensor([float(meter.peak)]))  # (world, 1)
    return {"accuracy": model.accuracy, "step_ms": step_ms, "mib": [float(m) / 2**20 for m in per_rank.reshape(-1)]}


def table(results: dict[str, dict]) -> str:
    ddp = results.get("ddp")
    psi = sum(q.numel() for q in Classifier(args.d_model, args.layers).parameters())
    lines = [
        f"{args.devices} CPU processes, {args.precision}, {args.epochs} epochs, {psi:,} parameters, AdamW; "
        f"model state = parameters + gradients + optimizer state on each rank (peak)",
        "| strategy | held-out accuracy | step ms | model-state MiB per rank | ratio to ddp |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ratio = f"{r['mib'][0] / ddp['mib'][0]:.3f}" if ddp else "-"
        mib = " / ".join(f"{m:.3f}" for m in r["mib"])
        lines.append(f"| {name} | {r['accuracy']:.4f} | {r['step_ms']:.1f} | {mib} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":  # Lightning's launcher runs this script again for the other ranks
    import warnings

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    train_set, test_set = sentences(4096, seed=0), sentences(1024, seed=1)
    results = {name: run(name, train_set, test_set) for name in chosen}
    if dist.is_initialized():
        if dist.get_rank() == 0:
            print(table(results), flush=True)
        dist.barrier()
        dist.destroy_process_group()
    else:
        print(table(results), flush=True)
