"""Generated training loops: the features a loop combines, in random orders, against one process.

Each feature has tests of its own; what a bug hides in is their combination (stop 53 found a
parameter frozen between two ``no_sync`` micro-batches losing what it had accumulated, a combination
no single-feature test held). Hypothesis writes programs of a few steps. Each step runs one to
three micro-batches (all but the last under ``no_sync``); before each micro-batch some parameters
are frozen or unfrozen by name, as fine-tuning code does, and the global batch decides which
ranks' rows take each block's data-dependent branch. After them the step clips or not, steps or
skips the step, and zeroes the gradients to None, to zeros, or not at all; between steps a forward
may run under ``no_grad`` or with its output dropped, some parameters may be scaled (as an EMA or
a hand-made decay writes them), and the run may restart from a checkpoint into a new model and
optimizer (shardwrap's, torch's ``get_state_dict`` with DCP, or full state dicts). A step may first
switch stage through ``fully_shard``'s ``set_reshard_after_*`` or call its ``unshard()``. The unwrapped model runs the same program in
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
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

from harness import run_on_ranks
from parity import expected_chunk, hybrid_mesh

DIM = 6
BLOCKS = 3


class Branchy(nn.Module):
    """``a`` on every row; ``b`` only on the rows whose first feature is positive (not called at
    all when there are none); ``dead`` never. ``checkpointed``: ``a``'s part under torch's
    activation checkpointing (recomputed in backward), ``"reentrant"`` as HF's
    ``gradient_checkpointing_enable()`` runs it by default (whose region passes no gradient to
    its parameters where its input needs none, in one process too); ``"hf"``: the whole block
    under a reentrant checkpoint instead (``Net.forward``)."""

    checkpointed: "bool | str" = False
    residual = False  # the residual add after the checkpointed region instead of inside it

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.dead = nn.Linear(DIM, DIM)

    def _a(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.a(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed in (True, "reentrant") and self.residual:
            y = x + torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=self.checkpointed == "reentrant")
        elif self.checkpointed in (True, "reentrant"):
            y = torch.utils.checkpoint.checkpoint(self._a, x, use_reentrant=self.checkpointed == "reentrant")
        else:
            y = self._a(x)
        rows = x[:, 0] > 0
        if bool(rows.any()):
            y = y.index_add(0, rows.nonzero().flatten(), torch.tanh(self.b(x[rows])))
        return y


class Net(nn.Module):
    """Under a reentrant checkpoint a region's parameters get a gradient only where its input
    needs one, so one process on the global batch and a rank on its rows would differ wherever
    the first feature's sign picks which rows' ``b`` makes the next block's input need one (a
    difference of data parallelism itself: DDP's too). With a reentrant mode the input is
    therefore first scaled by a trainable ``gain`` (positive: the signs stay)."""

    def __init__(self) -> None:
        super().__init__()
        if Branchy.checkpointed in ("reentrant", "hf"):
            self.gain = nn.Parameter(torch.ones(DIM))
        self.blocks = nn.ModuleList(Branchy() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gain"):
            x = x * self.gain
        for block in self.blocks:  # "hf": each block whole under a reentrant checkpoint, as HF's models call them
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True) if Branchy.checkpointed == "hf" else block(x)
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
    # two forwards (each half of the rows), one backward of their sum, or a backward each ("separate")
    "halves": st.sampled_from([False, False, True, "separate"]),
})
step = st.fixed_dictionaries({
    "micro": st.lists(micro_batch, min_size=1, max_size=3),
    "window": st.sampled_from(["no_sync", "fully_shard"]),  # model.no_sync() or set_requires_gradient_sync(False), as FSDP2 code does
    "unfreeze": st.booleans(),  # every parameter trains again before the clip and the step (else the last freezes stay)
    # torch.nn.utils.clip_grad_norm_ or model.clip_grad_norm_ (to 0.05), or torch's clip_grad_value_ (to 0.01)
    "clip": st.sampled_from([None, "torch", "model", "value"]),
    "step": st.sampled_from([True, True, False]),
    "zero": st.sampled_from(["none", "zeros", "keep", "module"]),  # opt.zero_grad(set_to_none=...), none, model.zero_grad()
    "between": st.sampled_from([None, None, "no_grad", "dropped"]),
    # saved, then a new model and optimizer load it (after zeroing to None): shardwrap's save_checkpoint/load_checkpoint;
    # torch's get_state_dict, dcp.save, dcp.load, set_state_dict; full state dicts on every rank; on rank 0, broadcast
    "restart": st.sampled_from([False, False, False, False, "shardwrap", "dcp", "full", "rank0"]),
    # between steps (after the zeroing), the named parameters scaled by 0.9, as an EMA or a hand-made decay does:
    # in place under no_grad, through .data (no version counter sees it), or on the full copies of summon_full_params
    "write": st.sampled_from([None, None, None, "no_grad", "data", "summon"]),
    "written": st.sets(st.sampled_from(FREEZABLE), min_size=1, max_size=3),
    # before the step's first micro-batch (stages 2 and 3 only): fully_shard's set_reshard_after_forward and
    # set_reshard_after_backward, to stage 2, stage 3 or Stage(False, False)
    "restage": st.sampled_from([None, None, None, 2, 3, "keep"]),
    # before the step's first micro-batch: fully_shard's unshard() on the root, or async on a block (not waited for)
    "unshard": st.sampled_from([None, None, None, "root", "block"]),
})


def batch(seed: int, world: int, rows: str) -> torch.Tensor:
    x = torch.randn(2 * world, DIM, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = -x[:, 0].abs() - 0.5
    picked = {"all": slice(None), "none": slice(0, 0), "first rank": slice(0, 2), "last rank": slice(-2, None)}[rows]
    x[picked, 0] = x[picked, 0].abs()
    return x


def run_program(stage: "int | str", optim: str, program: list[dict[str, Any]], perturb: bool = False, *, checkpointed: "bool | str" = False,
                offload: str | None = None, hybrid: bool = False, max_unsharded: int = 2, residual: bool = False) -> list[dict[str, Any]]:
    """In float64: in float32 AdamW turns the last-bit differences between one process's batched
    sums and the ranks' split ones into 1e-5 over a few steps, where a wrong factor or a lost
    gradient moves a parameter by far more than float64's 1e-15."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        Branchy.checkpointed, Branchy.residual = checkpointed, residual
        return _run_program(stage, optim, program, perturb, offload, hybrid, max_unsharded)
    finally:
        torch.set_default_dtype(default)
        Branchy.checkpointed, Branchy.residual = False, False


def _run_program(stage: "int | str", optim: str, program: list[dict[str, Any]], perturb: bool, offload: str | None, hybrid: bool,
                 max_unsharded: int) -> list[dict[str, Any]]:
    """Run ``program`` on the wrapped model (this rank's rows) and on the unwrapped one (every
    row); after each step, the largest parameter and gradient differences and which gradients are
    None on each side. ``perturb``: the wrapped model skips its first unfreeze (the oracle's own
    check)."""
    from shardwrap import Offload, ShardedModule, Stage

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
        if spec.get("restage") is not None and stage in (2, 3, "keep"):
            to = spec["restage"]
            if to == "keep":
                model.set_reshard_after_forward(False)
                model.set_reshard_after_backward(False)
            else:
                model.set_reshard_after_backward(True)
                model.set_reshard_after_forward(to == 3)
        if spec.get("unshard") == "root":
            model.unshard()
        elif spec.get("unshard") == "block":
            model.module.blocks[1].unshard(async_op=True)
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
                if mb["halves"] == "separate":  # both forwards first, then each half's backward
                    losses = [m(part).pow(2).mean() / 2 for m, xs in ((ref, x), (model, local)) for part in xs.chunk(2)]
                elif mb["halves"]:  # (the mean of each half's squares, averaged: the mean of all)
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
        if spec["clip"] == "value":
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        elif spec["clip"] is not None:
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
        if spec.get("write") is not None:
            for name in sorted(spec["written"]):
                ref_params[name].data.mul_(0.9)
            if spec["write"] == "summon":
                with model.summon_full_params():
                    full_params = dict(model.named_parameters())
                    with torch.no_grad():
                        for name in sorted(spec["written"]):
                            full_params[name].mul_(0.9)
            else:
                with torch.no_grad():
                    for name in sorted(spec["written"]):
                        (params[name].data if spec["write"] == "data" else params[name]).mul_(0.9)
                if spec["write"] == "data" and (offload == "disk" or shards == 4):
                    # where the forward's check of unseen writes does not look (a shard on disk; a
                    # rank with no rows of a 6-row weight), the documented remedy; it runs elsewhere
                    model.mark_written()
        if spec["restart"] and spec["zero"] in ("none", "module"):  # (a checkpoint holds no gradients)
            seed += 1
            model, opt = restart(spec["restart"], f"{checkpoints}/{seed}", seed, model, opt, wrap, make)
            params = dict(model.named_parameters())
            if spec["restart"] in ("full", "rank0"):  # one process runs the same code (see restart)
                ref, ref_opt = restart(spec["restart"], "", seed, ref, ref_opt, lambda net: net, make)
                ref_params = dict(ref.named_parameters())
            elif spec["restart"] == "dcp":
                get_state_dict(ref, ref_opt)  # (its initialising step, where ref_opt has no state yet)
        full = model.full_state_dict(rank0_only=False)
        gap = max((full[n] - p.detach()).abs().max().item() for n, p in ref_params.items())
        out.append({"gap": gap, "grad_gap": grad_gap, "none_ref": none_ref, "none_got": none_got})
    del model, opt, params
    dist.barrier()
    shutil.rmtree(scratch, ignore_errors=True)
    if rank == 0:
        shutil.rmtree(checkpoints, ignore_errors=True)
    return out


def restart(how: str, path: str, seed: int, model: Any, opt: torch.optim.Optimizer, wrap: Any, make: Any) -> tuple[Any, torch.optim.Optimizer]:
    """Save ``model`` and ``opt`` one of four ways, then build a new model (other initial values)
    and optimizer and load them into it.

    torch's ``get_state_dict`` and ``set_optimizer_state_dict`` first run a step with zero
    gradients and lr 0 on an optimizer that has no state yet (no step taken): SGD's weight decay
    leaves a momentum of ``0.05 p``, AdamW a step count of 1. ``get_state_dict`` does it to the
    optimizer being saved; a full state dict's load keeps it for a parameter the saved state lacks
    (one frozen, or never used, so far). One process running the same code gets the same (checked
    by hand: 2.1e-3 apart from a run without the restart), so the unwrapped model goes through the
    same ``get_state_dict`` (and for full state dicts the same load)."""
    from shardwrap import load_checkpoint, save_checkpoint

    if how == "shardwrap":
        save_checkpoint(path, model, opt)
    elif how == "dcp":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    else:  # full state dicts: on every rank, or on rank 0 alone (cpu_offload), broadcast from it on loading
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=how == "rank0"))
    del model, opt
    torch.manual_seed(seed)  # other initial values, which the load must overwrite
    model = wrap(Net())
    opt = make(model.parameters())
    if how == "shardwrap":
        load_checkpoint(path, model, opt)
    elif how == "dcp":
        new_msd, new_osd = get_state_dict(model, opt)
        # torch's template has a state for every parameter (get_state_dict runs a step with zero
        # gradients on a fresh optimizer); the saved one none for a parameter that never had a
        # gradient (``dead``), and dcp.load refuses a template key the checkpoint lacks: keep the saved ones
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        new_osd["state"] = {fqn: kept for fqn, values in new_osd["state"].items()
                            if (kept := {k: v for k, v in values.items() if f"optim.state.{fqn}.{k}" in saved})}
        state = {"model": new_msd, "optim": new_osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))  # (the same missing states: torch's own check)
    else:  # (model and optimizer apart: set_state_dict takes a rank's empty model state dict for "optimizer only")
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=how == "rank0", strict=False)
        set_model_state_dict(model, msd, options=options)
        set_optimizer_state_dict(model, opt, osd, options=options)
    return model, opt


def check(world: int, stage: "int | str", optim: str, program: list[dict[str, Any]], **options: Any) -> None:
    for rank, steps in enumerate(run_on_ranks(world, run_program, stage, optim, program, timeout=int(os.environ.get("SHARDWRAP_PROGRAMS_TIMEOUT", 90)), **options)):
        for i, s in enumerate(steps):
            where = f"rank {rank}, after step {i} of {program}"
            assert s["none_got"] == s["none_ref"], f"p.grad is None differs ({s}), {where}"
            assert s["grad_gap"] < 1e-10, f"gradients differ by {s['grad_gap']:.2e}, {where}"
            assert s["gap"] < 1e-10, f"parameters differ by {s['gap']:.2e}, {where}"


# SHARDWRAP_PROGRAMS=N runs N random programs instead of the suite's fixed 24 (a deeper search),
# reporting the first failing one as it was drawn (shrinking a hang costs a timeout per attempt;
# SHARDWRAP_PROGRAMS_TIMEOUT shortens the 90 s a program may take)
DEEP = "SHARDWRAP_PROGRAMS" in os.environ


@settings(max_examples=int(os.environ.get("SHARDWRAP_PROGRAMS", 24)), deadline=None, derandomize=not DEEP, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.generate) if DEEP else tuple(Phase), report_multiple_bugs=False)
@given(program=st.lists(step, min_size=1, max_size=4), world=st.sampled_from([2, 2, 3, 4]),
       stage=st.sampled_from([1, 2, 3, "keep"]),  # "keep": Stage(False, False), stage 2 that keeps its parameters between steps
       optim=st.sampled_from(["sgd", "adamw"]), checkpointed=st.sampled_from([False, True, "reentrant", "hf"]), offload=st.sampled_from([None, None, "cpu", "disk"]),
       hybrid=st.booleans(), max_unsharded=st.sampled_from([1, 2, 3]), residual=st.booleans())
def test_generated_training_loops_match_one_process(program, world, stage, optim, checkpointed, offload, hybrid, max_unsharded, residual):
    hybrid = hybrid and world == 4  # W = 4 runs as a (2, 2) mesh or a flat one
    if checkpointed:  # a freeze between a checkpointed forward and its recomputation fails in one process too
        program = [{**spec, "micro": [{**mb, "late": set()} for mb in spec["micro"]]} for spec in program]
    check(world, stage, optim, program, checkpointed=checkpointed, offload=offload, hybrid=hybrid, max_unsharded=max_unsharded,
          residual=residual and checkpointed in (True, "reentrant"))


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


def test_a_reentrant_region_inside_a_unit_whose_trainable_branch_some_ranks_take():
    """Found by the generated loops: a block whose ``a`` runs under a reentrant checkpoint and
    whose ``b`` only the last rank's rows take. The region's recomputation (a nested backward)
    brings ``a``'s gradient on every rank; the outer backward brings ``b``'s on the last rank
    only. That rank reduced the first part, then the second, where its peer reduced once: both
    hung. The one reduce-scatter now waits for the outer part where the outer backward will bring one."""
    def micro(rows: str) -> dict[str, Any]:
        return {"frozen": set(), "late": set(), "rows": rows, "peek": False, "halves": False}
    program = [{"micro": [micro("last rank")], "window": "no_sync", "unfreeze": True, "clip": None, "step": True,
                "zero": "none", "between": None, "restart": False},
               {"micro": [micro("first rank"), micro("none")], "window": "no_sync", "unfreeze": True, "clip": None,
                "step": True, "zero": "none", "between": None, "restart": False}]
    for stage in (1, 2, 3):
        check(2, stage, "sgd", program, checkpointed="reentrant")
    check(3, 3, "adamw", program, checkpointed="reentrant")


def test_two_calls_before_one_backward_under_a_reentrant_checkpoint_with_a_branch_some_ranks_take():
    """Found by the generated loops: two forwards (each half of the rows) before one backward,
    each block's ``a`` under a reentrant checkpoint (or the whole block, as HF's layers are), and
    its ``b`` on some ranks' rows only. A rank whose outputs came straight out of the region reduced
    at the first call's nested backward and freed the unit, then gathered and reduced again for
    the second call, where a peer whose ``b`` part kept the unit waited for its outer part: stages
    1-3 hung. With the whole block in the region and ``a`` frozen, the rank whose recomputation
    reached no trainable parameter kept the unit gathered where its peer freed it: stage 2 hung and
    stage 3 raised "ranks disagree". With ``b`` frozen, the rank whose rows took it held the unit
    until a nested backward freed it (stage 3 hung). Now the unit stays gathered, and its gradient
    unreduced, until every call's backward has begun, and every recomputed unit is freed after its
    nested backward on every rank. With the residual add after the region (``residual``), the
    rows without ``b`` give a call whose outputs are not the region's: held, then freed by its
    first nested backward (a hang until a held call waited too, once a nested backward ran)."""
    def micro(rows: str, frozen: set[str]) -> dict[str, Any]:
        return {"frozen": frozen, "late": set(), "rows": rows, "peek": False, "halves": True}
    a0, b1 = {"blocks.0.a.weight", "blocks.0.a.bias"}, {"blocks.1.b.weight", "blocks.1.b.bias"}
    program = [{"micro": [micro("first rank", set())], "window": "no_sync", "unfreeze": True, "clip": None, "step": True,
                "zero": "none", "between": None, "restart": False},
               {"micro": [micro("last rank", a0)], "window": "no_sync", "unfreeze": True, "clip": None,
                "step": True, "zero": "none", "between": None, "restart": False},
               {"micro": [micro("last rank", b1)], "window": "no_sync", "unfreeze": True, "clip": None,
                "step": True, "zero": "none", "between": None, "restart": False}]
    for checkpointed in ("reentrant", "hf"):
        for stage in (1, 2, 3):
            check(2, stage, "sgd", program, checkpointed=checkpointed)
    check(3, 3, "adamw", program, checkpointed="reentrant")
    # the residual add after the region: the rows without b give a held call, not a checkpointed one
    free_b = [{**spec, "micro": [{**mb, "frozen": set()} for mb in spec["micro"]]} for spec in program]
    for stage in (1, 2, 3):
        check(2, stage, "sgd", free_b, checkpointed="reentrant", residual=True)


def test_two_forwards_then_a_backward_each_with_a_branch_some_ranks_take():
    """Found by the generated loops: two forwards, then one backward for each, block 0's ``a``
    frozen and its ``b`` on the first rank's rows only, so block 0 gets a gradient on that rank
    alone. The first backward's end forgot the forwards' record, so the second backward had no
    schedule: only the rank with a gradient reduced block 0 (and at stage 3 gathered it). Every
    stage hung, with or without checkpointing. With whole blocks under a reentrant checkpoint
    (HF's layout) it also cleared the marks that make every rank reduce a unit a reentrant
    checkpoint may recompute on some ranks only. Now the record and the marks stay while another
    forward's graph is still to be reached by a backward."""
    micro = {"frozen": {"blocks.0.a.weight", "blocks.0.a.bias"}, "late": set(), "rows": "first rank", "peek": False,
             "halves": "separate"}
    program = [{"micro": [micro], "window": "no_sync", "unfreeze": False, "clip": None, "step": True, "zero": "none",
                "between": None, "restart": False}] * 2
    for checkpointed in (False, "hf"):
        for stage in (1, 2, 3):
            check(2, stage, "sgd", program, checkpointed=checkpointed)
    check(3, 3, "adamw", program, checkpointed="reentrant")
