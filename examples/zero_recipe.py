"""PyTorch's ZeroRedundancyOptimizer recipe, on shardwrap.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/zero_recipe.py

20 x Linear(2000, 2000) on 2 ranks. For plain DDP and for shardwrap stages 1, 2 and 3 it prints each
rank's model-state memory (parameters + gradients + optimizer state, as the optimizer sees them)
after wrapping, before the step, after the step, and every live tensor at the step's peak, measured
on CPU by shardwrap.memory. Then the sum of the parameters after one step, which is the same for
every variant and on every rank: the recipe's check that sharding changed nothing.
"""

import argparse
import os

# ---- defaults: the recipe's model ------------------------------------------------------------------
p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--width", type=int, default=2000, help="features of each Linear layer")
p.add_argument("--depth", type=int, default=20, help="number of Linear layers")
p.add_argument("--batch", type=int, default=20, help="rows per rank")
args = p.parse_args()
WIDTH, DEPTH, BATCH = args.width, args.depth, args.batch
if "RANK" not in os.environ:  # init_process_group reads the rank and the rendezvous from torchrun
    p.error("start it with torchrun: OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/zero_recipe.py")

# torch takes seconds to import: the command line is read first, so --help and a start without
# torchrun answer at once.
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardwrap import ShardedModule
from shardwrap.memory import LiveStorages, model_state_bytes, unsharded_tensors

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def mib(n: int) -> str:
    return f"{n / 2**20:7.1f} MiB"


def state(model: nn.Module, opt: torch.optim.Optimizer | None) -> int:
    return sum(model_state_bytes(model, opt).values())


for variant in ["ddp", "stage 1", "stage 2", "stage 3"]:
    dist.barrier()
    model = DDP(build()) if variant == "ddp" else ShardedModule(build(), auto_wrap_policy={nn.Linear}, stage=int(variant[-1]))
    after_wrap = state(model, None)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(BATCH * world, WIDTH, generator=torch.Generator().manual_seed(1)).chunk(world)[rank]  # (B, 2000)
    tracker = LiveStorages(list(model.parameters()) + unsharded_tensors(model))
    with tracker:
        model(x).sum().backward()
        before_step = state(model, opt)
        opt.step()
        tracker.track(v for s in opt.state.values() for v in s.values())
        after_step = state(model, opt)
        tracker.sample()
    # Full parameters, summed in the same order in float64 for every variant.
    full = model.module.state_dict() if variant == "ddp" else model.full_state_dict(rank0_only=False)
    param_sum = sum(v.double().sum().item() for v in full.values())
    line = (f"{variant:8s} rank {rank}: after wrap {mib(after_wrap)} | before step {mib(before_step)} | "
            f"after step {mib(after_step)} | peak live {mib(tracker.peak)} | sum of parameters {param_sum:.6f}")
    for r in range(world):
        dist.barrier()
        if r == rank:
            print(line, flush=True)
    del model, opt, tracker
dist.barrier()
dist.destroy_process_group()
