"""What the same-model check costs at construction (design/notes/rank-agreement.md).

OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/construction_check.py

For GPT-2 (the benchmark's shape: 4 layers, 256 wide, byte vocabulary) and the recipe MLP
(20 x Linear(2000)), wraps the model ROUNDS times with the check and ROUNDS times with it replaced
by a no-op, interleaved, and prints the median construction time of each, the check alone
(describe + hash + one all-gather) and the collectives it issued.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RecipeMLP  # noqa: E402

from shardwrap import ShardedModule, agreement  # noqa: E402
from shardwrap.collectives import count_collectives  # noqa: E402

ROUNDS = 9


def gpt2() -> tuple[nn.Module, set[type]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=256, n_layer=4, n_head=4, use_cache=False)
    return GPT2LMHeadModel(config), {GPT2Block}


def mlp() -> tuple[nn.Module, set[type]]:
    return RecipeMLP(), {nn.Linear}


def wrap_seconds(build, check: bool) -> float:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model, policy = build()
    real = agreement.check_same_model
    if not check:
        agreement.check_same_model = lambda entries, group: None  # type: ignore[assignment]
    try:
        dist.barrier()
        start = time.perf_counter()
        ShardedModule(model, auto_wrap_policy=policy)
        return time.perf_counter() - start
    finally:
        agreement.check_same_model = real


def check_alone(build) -> tuple[float, float, dict]:  # type: ignore[no-untyped-def]
    """Seconds to describe and hash the model (local), seconds of the all-gather after a barrier."""
    model, _ = build()
    dist.barrier()
    start = time.perf_counter()
    entries = agreement.describe([("<root>", list(model.named_parameters()))])
    agreement.digest(entries)
    local = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    with count_collectives() as counted:
        agreement.check_same_model(entries, dist.group.WORLD)
    return local, time.perf_counter() - start, dict(counted)


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for name, build in [("gpt2", gpt2), ("recipe mlp", mlp)]:
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(ROUNDS):
            for check in (True, False):
                times[check].append(wrap_seconds(build, check))
        alone = [check_alone(build) for _ in range(ROUNDS)]
        if dist.get_rank() == 0:
            with_, without = statistics.median(times[True]), statistics.median(times[False])
            local, collective = statistics.median(a[0] for a in alone), statistics.median(a[1] for a in alone)
            print(
                f"{name}: wrap {with_ * 1e3:.1f} ms with the check, {without * 1e3:.1f} ms without; "
                f"the check alone: describe + hash {local * 1e3:.2f} ms, check {collective * 1e3:.2f} ms, "
                f"collectives {alone[0][2]}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
