"""Generated training loops: the features a loop combines, in random orders, against one process.

Each feature has tests of its own; what a bug hides in is their combination (stop 53 found a
parameter frozen between two ``no_sync`` micro-batches losing what it had accumulated, a combination
no single-feature test held). Hypothesis writes programs of a few steps. Each step runs one to
three micro-batches (all but the last under ``no_sync``); before each micro-batch some parameters
are frozen or unfrozen by name, as fine-tuning code does, and the global batch decides which
ranks' rows take each block's data-dependent branch. After them the step clips or not, steps or
skips the step, and zeroes the gradients to None, to zeros, or not at all; between steps a forward
may run under ``no_grad`` or with its output dropped, and the run may restart from a checkpoint
(``save_checkpoint``, then a new model and optimizer that ``load_checkpoint``). The unwrapped model runs the same program in
one process on the whole global batch, in float64; after every step each parameter, each gradient
and each ``p.grad is None`` must match.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import run_on_ranks
from parity import expected_chunk, hybrid_mesh

DIM = 6
BLOCKS = 3


class Branchy(nn.Module):
    """``a`` on every row; ``b`` only on the rows whose first feature is positive (not called at
    all when there are none); ``dead`` never. ``checkpointed``: ``a``'s part under torch's
    activation checkpointing (recomputed in backward)."""

    checkpointed = False

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.dead = nn.Linear(DIM, DIM)

    def _a(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.a(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            y = torch.utils.checkpoint.checkpoint(self._a, x, use_reentrant=False)
        else:
            y = self._a(x)
        rows = x[:, 0] > 0
        if bool(rows.any()):
            y = y.index_add(0, rows.nonzero().flatten(), torch.tanh(self.b(x[rows])))
        return y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Branchy() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# Parameters a program may freeze: every block's (the head always trains, so every loss has a
# gradient to take).
FREEZABLE = [f"blocks.{i}.{layer}.{kind}" for i in range(BLOCKS) for layer in ("a", "b") for kind in ("weight", "bias")]
ROWS = ["all", "none", "first rank", "last rank"]  # whose rows take the b branches (the first feature's sign)

micro_batch = st.fixed_dictionaries({
    "frozen": st.sets(st.sampled_from(FREEZABLE), max_size=4),
    "late": st.sets(st.sampled_from(FREEZABLE), max_size=2),  # frozen after the forward, before its backward
    "rows": st.sampled_from(ROWS),
    "peek": st.sampled_from([False, False, True]),  # a no_grad forward first (logging inside an accumulation window)
    "halves": st.sampled_from([False, False, True]),  # two forwards (each half of the rows), one backward of their sum
})
step = st.fixed_dictionaries({
    "micro": st.lists(micro_batch, min_size=1, max_size=3),
    "window": st.sampled_from(["no_sync", "fully_shard"]),  # model.no_sync() or set_requires_gradient_sync(False), as FSDP2 code does
    "unfreeze": st.booleans(),  # every parameter trains again before the clip and the step (else the last freezes stay)
    "clip": st.sampled_from([None, "torch", "model"]),  # torch.nn.utils.clip_grad_norm_ or model.clip_grad_norm_, to 0.05
    "step": st.sampled_from([True, True, False]),
    "zero": st.sampled_from(["none", "zeros", "keep", "module"]),  # opt.zero_grad(set_to_none=...), none, model.zero_grad()
    "between": st.sampled_from([None, None, "no_grad", "dropped"]),
    "restart": st.sampled_from([False, False, False, True]),  # saved, then a new model and optimizer load it (after zeroing to None)
})


def batch(seed: int, world: int, rows: str) -> torch.Tensor:
    x = torch.randn(2 * world, DIM, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = -x[:, 0].abs() - 0.5
    picked = {"all": slice(None), "none": slice(0, 0), "first rank": slice(0, 2), "last rank": slice(-2, None)}[rows]
    x[picked, 0] = x[picked, 0].abs()
    return x


def run_program(stage: "int | str", optim: str, program: list[dict[str, Any]], perturb: bool = False, *, checkpointed: bool = False,
                offload: str | None = None, hybrid: bool = False, max_unsharded: int = 2) -> list[dict[str, Any]]:
    """In float64: in float32 AdamW turns the last-bit differences between one process's batched
    sums and the ranks' split ones into 1e-5 over a few steps, where a wrong factor or a lost
    gradient moves a parameter by far more than float64's 1e-15."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        Branchy.checkpointed = checkpointed
        return _run_program(stage, optim, program, perturb, offload, hybrid, max_unsharded)
    finally:
        torch.set_default_dtype(default)
        Branchy.checkpointed = False


def _run_program(stage: "int | str", optim: str, program: list[dict[str, Any]], perturb: bool, offload: str | None, hybrid: bool,
                 max_unsharded: int) -> list[dict[str, Any]]:
    """Run ``program`` on the wrapped model (this rank's rows) and on the unwrapped one (every
    row); after each step, the largest parameter and gradient differences and which gradients are
    None on each side. ``perturb``: the wrapped model skips its first unfreeze (the oracle's own
    check)."""
    from shardwrap import Offload, ShardedModule, Stage, load_checkpoint, save_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref, net = Net(), Net()
    net.load_state_dict(ref.state_dict())
    shards, place = (2, rank % 2) if hybrid else (world, rank)  # a (2, 2) mesh: rank = replica * 2 + shard
    scratch = tempfile.mkdtemp(prefix="shardwrap-programs-")  # disk offload's files (each model its own folder)
    checkpoints = os.path.join(tempfile.gettempdir(), f"shardwrap-programs-{os.getppid()}")  # the same on every rank

    def wrap(net: nn.Module) -> Any:
        where = None if offload is None else Offload(offload, path=tempfile.mkdtemp(dir=scratch) if offload == "disk" else None)
        return ShardedModule(net, auto_wrap_policy={Branchy}, stage=Stage(False, False) if stage == "keep" else stage, offload=where, max_unsharded=max_unsharded,
                             mesh=hybrid_mesh((2, 2)) if hybrid else None)

    model = wrap(net)
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.05)) if optim == "sgd" else (
        lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1))
    ref_opt, opt = make(ref.parameters()), make(model.parameters())
    ref_params, params = dict(ref.named_parameters()), dict(model.named_parameters())
    skip_unfreeze = [perturb]
    seed = 0
    out = []
    for spec in program:
        for i, mb in enumerate(spec["micro"]):
            for name in FREEZABLE:
                want = name not in mb["frozen"]
                if want and not params[name].requires_grad and skip_unfreeze[0]:
                    skip_unfreeze[0] = False
                else:
                    params[name].requires_grad_(want)
                ref_params[name].requires_grad_(want)
            seed += 1
            x = batch(seed, world, mb["rows"])
            if mb["peek"]:
                with torch.no_grad():
                    ref(x)
                    model(x.chunk(world)[rank])
            last = i == len(spec["micro"]) - 1
            if spec["window"] == "fully_shard":
                model.set_requires_gradient_sync(last)
            with contextlib.nullcontext() if last or spec["window"] == "fully_shard" else model.no_sync():
                local = x.chunk(world)[rank]
                if mb["halves"]:  # (the mean of each half's squares, averaged: the mean of all)
                    losses = [sum(m(part).pow(2).mean() for part in xs.chunk(2)) / 2 for m, xs in ((ref, x), (model, local))]
                else:
                    losses = [ref(x).pow(2).mean(), model(local).pow(2).mean()]
                for name in mb["late"]:
                    ref_params[name].requires_grad_(False)
                    params[name].requires_grad_(False)
                for loss in losses:
                    loss.backward()
        if spec["unfreeze"]:
            for p in ref_params.values():
                p.requires_grad_(True)
            for p in params.values():
                p.requires_grad_(True)
        if spec["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            if spec["clip"] == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            else:
                model.clip_grad_norm_(0.05)
        none_ref = [ref_params[n].grad is None for n in ref_params]
        none_got = [params[n].grad is None for n in ref_params]
        diffs = [params[n].grad.to_local() - expected_chunk(p.grad, shards, place)  # type: ignore[union-attr]
                 for n, p in ref_params.items() if p.grad is not None and params[n].grad is not None]
        grad_gap = max((d.abs().max().item() for d in diffs if d.numel()), default=0.0)  # (a rank may hold no rows)
        if spec["step"]:
            ref_opt.step()
            opt.step()
        if spec["zero"] == "module":
            ref.zero_grad()
            model.zero_grad()
        elif spec["zero"] != "keep":
            ref_opt.zero_grad(set_to_none=spec["zero"] == "none")
            opt.zero_grad(set_to_none=spec["zero"] == "none")
        if spec["between"] is not None:
            seed += 1
            x = batch(seed, world, "first rank")
            with torch.no_grad() if spec["between"] == "no_grad" else contextlib.nullcontext():
                ref(x)
                model(x.chunk(world)[rank])
        if spec["restart"] and spec["zero"] in ("none", "module"):  # (a checkpoint holds no gradients)
            seed += 1
            save_checkpoint(f"{checkpoints}/{seed}", model, opt)
            del model, opt, params
            torch.manual_seed(seed)  # other initial values, which the load must overwrite
            model = wrap(Net())
            opt = make(model.parameters())
            load_checkpoint(f"{checkpoints}/{seed}", model, opt)
            params = dict(model.named_parameters())
        full = model.full_state_dict(rank0_only=False)
        gap = max((full[n] - p.detach()).abs().max().item() for n, p in ref_params.items())
        out.append({"gap": gap, "grad_gap": grad_gap, "none_ref": none_ref, "none_got": none_got})
    del model, opt, params
    dist.barrier()
    shutil.rmtree(scratch, ignore_errors=True)
    if rank == 0:
        shutil.rmtree(checkpoints, ignore_errors=True)
    return out


def check(world: int, stage: "int | str", optim: str, program: list[dict[str, Any]], **options: Any) -> None:
    for rank, steps in enumerate(run_on_ranks(world, run_program, stage, optim, program, timeout=90, **options)):
        for i, s in enumerate(steps):
            where = f"rank {rank}, after step {i} of {program}"
            assert s["none_got"] == s["none_ref"], f"p.grad is None differs ({s}), {where}"
            assert s["grad_gap"] < 1e-10, f"gradients differ by {s['grad_gap']:.2e}, {where}"
            assert s["gap"] < 1e-10, f"parameters differ by {s['gap']:.2e}, {where}"


# SHARDWRAP_PROGRAMS=N runs N random programs instead of the suite's fixed 24 (a deeper search)
@settings(max_examples=int(os.environ.get("SHARDWRAP_PROGRAMS", 24)), deadline=None, derandomize="SHARDWRAP_PROGRAMS" not in os.environ, suppress_health_check=list(HealthCheck))
@given(program=st.lists(step, min_size=1, max_size=4), world=st.sampled_from([2, 2, 3, 4]),
       stage=st.sampled_from([1, 2, 3, "keep"]),  # "keep": Stage(False, False), stage 2 that keeps its parameters between steps
       optim=st.sampled_from(["sgd", "adamw"]), checkpointed=st.booleans(), offload=st.sampled_from([None, None, "cpu", "disk"]),
       hybrid=st.booleans(), max_unsharded=st.sampled_from([1, 2, 3]))
def test_generated_training_loops_match_one_process(program, world, stage, optim, checkpointed, offload, hybrid, max_unsharded):
    hybrid = hybrid and world == 4  # W = 4 runs as a (2, 2) mesh or a flat one
    if checkpointed:  # a freeze between a checkpointed forward and its recomputation fails in one process too
        program = [{**spec, "micro": [{**mb, "late": set()} for mb in spec["micro"]]} for spec in program]
    check(world, stage, optim, program, checkpointed=checkpointed, offload=offload, hybrid=hybrid, max_unsharded=max_unsharded)


def test_the_oracle_sees_an_unfreeze_the_wrapped_model_missed():
    """A parameter left frozen on the wrapped model for one micro-batch, where the unwrapped one
    trains it: the comparison must report it."""
    program = [{"micro": [{"frozen": {"blocks.0.a.weight"}, "late": set(), "rows": "all", "peek": False, "halves": False},
                          {"frozen": set(), "late": set(), "rows": "all", "peek": False, "halves": False}],
                "window": "no_sync", "unfreeze": True, "clip": None, "step": True, "zero": "none", "between": None, "restart": False}]
    for rank_steps in run_on_ranks(2, run_program, 3, "sgd", program, True):
        assert rank_steps[0]["gap"] > 1e-4 or rank_steps[0]["grad_gap"] > 1e-4, rank_steps


def test_a_unit_called_twice_whose_second_call_reads_only_frozen_parameters_on_some_ranks():
    """Found by the generated loops: two forwards before one backward (each half of the rows), a
    block whose ``a`` is frozen, and whose ``b`` the rows take on some ranks and halves only. A
    call that read only frozen views has no split in the backward, so the unit was freed after the
    other call's split and gathered again for it, on the ranks whose rows took that path only: the
    others never joined the gather (stages 2 and 3 hung). Now such a call keeps the unit gathered
    to the end of the backward."""
    late = {"blocks.0.a.weight", "blocks.2.b.bias"}
    program = [{"window": "no_sync", "unfreeze": True, "clip": None, "step": True, "zero": "none", "between": None,
                "restart": False, "micro": [
                    {"frozen": {"blocks.0.a.weight", "blocks.0.a.bias", "blocks.0.b.weight"}, "late": late, "rows": "none",
                     "peek": False, "halves": False},
                    {"frozen": {"blocks.2.a.weight", "blocks.2.a.bias", "blocks.0.b.weight"}, "late": late, "rows": "all",
                     "peek": False, "halves": True}]}]
    for stage in (2, 3):
        check(2, stage, "sgd", program, max_unsharded=1)


class Skipping(nn.Module):
    """Returns ``2 x`` without reading its parameters while ``skip`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if self.skip else x + torch.tanh(self.lin(x))


def train_with_a_call_reading_no_parameter(stage: int) -> float:
    """Two forwards (each half of the rows) before one backward; on rank 0 the first call of the
    block reads no parameter. Returns the largest parameter difference from one process."""
    from shardwrap import ShardedModule

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref, net = (nn.Sequential(nn.Linear(DIM, DIM), Skipping(), nn.Linear(DIM, 3)) for _ in range(2))
    net.load_state_dict(ref.state_dict())
    model = ShardedModule(net, auto_wrap_policy={Skipping}, stage=stage)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    for step in range(2):
        x = torch.randn(4 * world, DIM, generator=torch.Generator().manual_seed(step))
        ref_losses, losses = [], []
        for r in range(world):  # one process: each rank's halves, in the same order, with the same skips
            for i, part in enumerate(x.chunk(world)[r].chunk(2)):
                ref[1].skip = r == 0 and i == 0
                ref_losses.append(ref(part).pow(2).mean())
        for i, part in enumerate(x.chunk(world)[rank].chunk(2)):
            model.module[1].skip = rank == 0 and i == 0
            losses.append(model(part).pow(2).mean())
        (sum(ref_losses) / len(ref_losses)).backward()
        (sum(losses) / len(losses)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = model.full_state_dict(rank0_only=False)
    return max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


def test_a_unit_called_twice_whose_first_call_reads_no_parameter_on_some_ranks():
    """The same hang with a call that reads no parameter at all (no frozen view marks it): on the
    rank that skipped, the unit was gathered again for that call after the other call's split."""
    for stage in (2, 3):
        for gap in run_on_ranks(2, train_with_a_call_reading_no_parameter, stage, timeout=60):
            assert gap < 1e-5, (stage, gap)
