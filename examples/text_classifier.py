"""DeepSpeed's ZeRO tutorial workload on shardwrap: a transformer-encoder sentiment classifier.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/text_classifier.py --stage all

The labelled data is generated: sentences of neutral words with a few sentiment words mixed in,
labelled by which kind is in the majority, so it needs no download and is learnable. Each
encoder layer is a unit. Prints held-out accuracy and each rank's model-state memory per stage.
"""

import argparse
import os
import random

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--stage", default="all", choices=["1", "2", "3", "all"])
p.add_argument("--mixed-precision", choices=["none", "bf16", "fp16"], default="none")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--batch-size", type=int, default=32, help="sentences per rank per step")
p.add_argument("--d-model", type=int, default=64)
p.add_argument("--layers", type=int, default=2)
args = p.parse_args()
if "RANK" not in os.environ:  # init_process_group reads the rank and the rendezvous from torchrun
    p.error("start it with torchrun: OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/text_classifier.py")

# torch takes seconds to import: the command line is read first, so --help and a start without
# torchrun answer at once.
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from shardwrap import MixedPrecision, ShardedModule
from shardwrap.memory import model_state_bytes

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

# ---- data: (N, T) word ids and 0/1 labels ---------------------------------------------------------
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


train_set, test_set = sentences(4096, seed=0), sentences(1024, seed=1)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), args.d_model)
        self.pos = nn.Parameter(torch.randn(T, args.d_model) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(args.d_model, nhead=4, dim_feedforward=4 * args.d_model, dropout=0.0, batch_first=True)
            for _ in range(args.layers)
        )
        self.head = nn.Linear(args.d_model, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos  # (B, T, D)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))  # (B, 2)


def run(stage: int) -> None:
    torch.manual_seed(0)
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.mixed_precision]
    model = ShardedModule(Classifier(), auto_wrap_policy={nn.TransformerEncoderLayer}, stage=stage,
                          mixed_precision=MixedPrecision(param_dtype=dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    peak = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, labels in loader:
            loss = nn.functional.cross_entropy(model(ids).float(), labels)
            loss.backward()
            peak = max(peak, sum(model_state_bytes(model, opt).values()))
            opt.step()
            opt.zero_grad(set_to_none=True)
    model.eval()
    correct = torch.zeros(2)
    with torch.no_grad():  # each rank scores its part of the held-out set
        for ids, labels in DataLoader(test_set, batch_size=256, sampler=DistributedSampler(test_set, world, rank, shuffle=False)):
            correct += torch.tensor([(model(ids).argmax(-1) == labels).sum().item(), len(labels)])
    dist.all_reduce(correct)
    mem = torch.tensor([float(peak)])
    mems = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(mems, mem)
    if rank == 0:
        per_rank = ", ".join(f"rank {r} {m.item() / 2**20:.2f} MiB" for r, m in enumerate(mems))
        print(f"stage {stage}: loss {loss.item():.3f}, held-out accuracy {correct[0] / correct[1]:.1%}, "
              f"peak model state {per_rank}", flush=True)


for stage in ([1, 2, 3] if args.stage == "all" else [int(args.stage)]):
    run(stage)
dist.barrier()
dist.destroy_process_group()
