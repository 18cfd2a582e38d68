"""Offload: parity with the unwrapped model for every stage, optimizer, world size and offload kind;
where the tensors live; composition with mixed precision, no_sync and checkpoints; bad input;
and the disk files' life (design/notes/offload.md)."""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hypothesis_trees import trees

import models
from harness import RankError, run_on_ranks
from parity import Case, check_parity

from shardwrap import Offload, ShardedModule, load_checkpoint, save_checkpoint


@pytest.mark.parametrize("offload", ["cpu", "disk"])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_every_stage(stage, optim, offload):
    results = check_parity(Case("mlp", policy="Block", optim=optim, stage=stage, offload=offload), 2)
    if offload == "disk":  # the master shards and every state shaped like a parameter are in the files
        for r in results:
            assert r["on_disk"]["params"] and r["on_disk"]["state"] and all(r["on_disk"]["state"])


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_parity_other_world_sizes(world, offload):
    check_parity(Case("mlp", policy="Block", optim="adamw", stage=3, offload=offload), world)
    check_parity(Case("mlp", policy="Block", optim="sgd", stage=2, offload=offload), world)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_composes_with_mixed_precision_and_no_sync(offload):
    for stage in (1, 3):
        case = Case("mlp", policy="Block", optim="sgd", stage=stage, offload=offload, mixed_precision="bf16", accumulate=2, no_sync=True)
        check_parity(case, 2)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_torch_clip_grad_norm_on_offloaded_parameters(offload):
    """torch.nn.utils.clip_grad_norm_(model.parameters()) (Lightning's gradient_clip_val) on
    offloaded DTensor gradients: the global norm, as on the unwrapped model."""
    for optim in ("sgd", "adamw"):
        check_parity(Case("mlp", policy="Block", optim=optim, stage=3, offload=offload, clip=0.05, clip_api="torch"), 2)


def _host_shard_under_a_cuda_mesh() -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    from shardwrap.unit import dtensor_over

    mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)  # no GPU is touched
    shard, grad = torch.zeros(3, 2), torch.ones(3, 2)  # the offload side's tensors
    param = nn.Parameter(dtensor_over(shard, mesh, (Shard(0),), torch.Size((3, 2)), (2, 1)))
    param.grad = dtensor_over(grad, mesh, (Shard(0),), torch.Size((3, 2)), (2, 1))
    torch.optim.AdamW([param], lr=0.5).step()
    return {"device": str(param.device), "same storage": param.to_local().data_ptr() == shard.data_ptr(), "shard": shard.tolist()}


def test_an_offloaded_shard_is_the_parameter_even_under_an_accelerator_mesh():
    """On a GPU the mesh is CUDA's while an offloaded shard is a host tensor. The parameter the
    optimizer updates must be that host tensor itself. ``DTensor.from_local``, which built the
    parameters before, moves such a tensor to the mesh's device: on an H200 the optimizer then
    stepped GPU copies and the gathered shards never changed (the offloaded model did not train;
    benchmarks/cuda_check.py now checks parity with offload). Here a CUDA mesh is built without a
    GPU; with ``from_local`` this test raises "Torch not compiled with CUDA enabled"."""
    [found] = run_on_ranks(1, _host_shard_under_a_cuda_mesh)
    assert found["device"] == "cpu" and found["same storage"], found
    # AdamW's first step moves each element by lr against its gradient's sign, in the shard itself
    assert all(abs(v + 0.5) < 1e-5 for row in found["shard"] for v in row), found



def _where_host_copies_are_finished() -> dict:
    """Count ``finish_host_copies`` calls around each thing a training loop does to an offloaded
    model. On a CPU-only run they wait for nothing; on a GPU each is where the host must not go
    on while a copy between host and device is in flight."""
    torch.manual_seed(0)
    plain = models.mlp()
    failing = {"on": False}

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a hook that fails inside the model's backward")

    plain.blocks[1].register_forward_hook(lambda m, a, out: out.register_hook(fail) and None if failing["on"] else None)
    model = ShardedModule(plain, auto_wrap_policy={models.Block}, stage=3, offload=Offload("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = []
    model.finish_host_copies = lambda: calls.append(1)  # type: ignore[method-assign]
    x = torch.randn(4, 16)
    seen = {}

    def after(what: str, fn) -> None:
        before = len(calls)
        fn()
        seen[what] = len(calls) - before

    losses = []
    after("forward for training", lambda: losses.append(model(x).pow(2).mean()))
    after("backward", losses[0].backward)
    after("optimizer step", opt.step)
    with torch.no_grad():
        after("evaluation forward", lambda: model(x))
    full = model.full_state_dict(rank0_only=False)
    after("load_state_dict", lambda: model.load_state_dict(full))

    failing["on"] = True
    out = model(x).pow(2).mean()
    failing["on"] = False
    with pytest.raises(RuntimeError, match="a hook that fails"):
        out.backward()
    with pytest.warns(RuntimeWarning, match="raised before it finished"):
        after("forward after a failed backward", lambda: model(x))
    return seen


def test_host_copies_are_finished_wherever_the_host_reads_or_writes_offloaded_tensors():
    """With ``Offload("cpu")`` on a GPU the shard copies to the device and the gradient copies to
    the host run on copy streams; the host must wait for them before it reads gradients (end of
    backward), rewrites shards (the step, a load) or drops a failed step, and after an evaluation
    forward (design/notes/offload.md, "Copies on a GPU"). The waits themselves need a GPU
    (benchmarks/offload_cuda.py); here each place is shown to call it, and a training forward,
    which a backward follows, not to."""
    [seen] = run_on_ranks(1, _where_host_copies_are_finished)
    assert seen["forward for training"] == 0, seen
    assert all(seen[k] >= 1 for k in ("backward", "optimizer step", "evaluation forward", "load_state_dict",
                                       "forward after a failed backward")), seen

@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(spec=trees, world=st.integers(1, 3), stage=st.sampled_from([1, 2, 3]), optim=st.sampled_from(["sgd", "adamw"]),
       offload=st.sampled_from(["cpu", "disk"]))
def test_parity_generated_trees(spec, world, stage, optim, offload):
    """The generated trees of test_hypothesis_trees.py (frozen, tied, tiny and zero-size
    parameters) with offload."""
    case = Case("tree", {"spec": spec, "dim": 6}, policy="marked", optim=optim, stage=stage, offload=offload, dim=6, seq=5, out=6)
    check_parity(case, world)


def _checkpoint_roundtrip(directory: str, stage: int) -> dict:
    """Train 2 steps with disk offload, save, train 2 more; a second disk-offload model loads the
    checkpoint and trains the same 2 steps: both end equal, and the loaded state went to the files."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def build() -> tuple[ShardedModule, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, stage=stage,
                              offload=Offload("disk", path=tempfile.mkdtemp(prefix="shardwrap-offload-test-")))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model: ShardedModule, opt: torch.optim.Optimizer, i: int) -> None:
        x = torch.randn(12, 16, generator=torch.Generator().manual_seed(i)).chunk(world)[rank]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    model, opt = build()
    for i in range(2):
        step(model, opt, i)
    save_checkpoint(os.path.join(directory, "ck"), model, opt)
    for i in range(2, 4):
        step(model, opt, i)
    other, other_opt = build()
    load_checkpoint(os.path.join(directory, "ck"), other, other_opt)
    for i in range(2, 4):
        step(other, other_opt, i)
    store = other._offload_store
    assert store is not None
    states = [v for p in other.parameters() for v in other_opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.to_local().numel()]
    return {
        "a": model.full_state_dict(rank0_only=False), "b": other.full_state_dict(rank0_only=False),
        "on_disk": bool(states) and all(store.holds(v) for v in states),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoints_with_disk_offload(tmp_path, stage):
    for result in run_on_ranks(2, _checkpoint_roundtrip, str(tmp_path), stage):
        assert result["on_disk"]
        for name, value in result["a"].items():
            torch.testing.assert_close(result["b"][name], value, rtol=0, atol=0)


def test_bad_offload_values_are_refused():
    with pytest.raises(ValueError, match="'gpu'.*None, 'cpu' or 'disk'"):
        Offload("gpu")
    with pytest.raises(ValueError, match="needs path="):
        Offload("disk")
    with pytest.raises(ValueError, match="only used with optimizer='disk'"):
        Offload("cpu", path="/tmp")


def _wrap_with(offload: Offload | None, *, full_disk: bool = False, bad_rank: int | None = None) -> str:
    """Runs on every rank: wrap with ``offload`` (rank ``bad_rank`` gets a path that is a file; with
    ``full_disk`` the disk reports 1 MiB free); returns the error's message."""
    import shutil

    import shardwrap.offload as off

    if bad_rank == dist.get_rank():
        offload = Offload("disk", path=__file__)
    real = off.shutil.disk_usage
    if full_disk:
        off.shutil.disk_usage = lambda p: shutil._ntuple_diskusage(2**30, 2**30 - 100, 100)  # type: ignore[attr-defined]
    try:
        torch.manual_seed(0)
        model = models.mlp()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            ShardedModule(model, auto_wrap_policy={models.Block}, offload=offload)
        except (ValueError, TypeError) as exc:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the model changed"
            return f"{type(exc).__name__}: {exc}"
        return "no error"
    finally:
        off.shutil.disk_usage = real


def test_disk_problems_are_refused_on_every_rank(tmp_path):
    errors = run_on_ranks(2, _wrap_with, Offload("disk", path=str(tmp_path)), full_disk=True)
    for e in errors:
        assert e.startswith("ValueError") and "needs" in e and "bytes" in e and "GiB free" in e
    errors = run_on_ranks(2, _wrap_with, Offload("disk", path=str(tmp_path)), bad_rank=1)
    assert all("not a directory" in e and "rank 1" in e for e in errors)  # rank 0's path was fine
    errors = run_on_ranks(2, _wrap_with, "disk")
    assert all(e.startswith("TypeError") and "shardwrap.Offload" in e for e in errors)


def _files_life(directory: str) -> dict:
    """Runs on every rank: the rank's directory exists with its marker while the model lives, is
    refused as a checkpoint, and is gone once the model is deleted."""
    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, offload=Offload("disk", path=directory))
    rank_dir = model._offload_store.directory
    alive = sorted(os.listdir(rank_dir))
    try:
        load_checkpoint(rank_dir, model)
        refused = "loaded"
    except FileNotFoundError as exc:
        refused = str(exc)
    del model
    gc.collect()
    return {"alive": alive, "refused": refused, "gone": not os.path.exists(rank_dir)}


def test_disk_files_are_not_a_checkpoint_and_go_with_the_model(tmp_path):
    results = run_on_ranks(2, _files_life, str(tmp_path))
    for r in results:
        assert "SHARDWRAP-OFFLOAD-SCRATCH.txt" in r["alive"] and any(n.endswith("-params.bin") for n in r["alive"])
        assert "no DCP checkpoint there" in r["refused"]
        assert r["gone"]


def _the_state_created_by_a_step_is_file_backed_from_the_start(directory: str) -> list[bool]:
    """Runs on every rank: AdamW's state is created in the files (``StateOnDisk``), never as
    anonymous tensors: the step's allocations shaped like a parameter all land in the store."""
    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, offload=Offload("disk", path=directory))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()
    seen: list[torch.Tensor] = []
    real = torch.zeros_like

    def spy(t: torch.Tensor, *args, **kwargs):  # what AdamW's _init_group returns for each state
        out = real(t, *args, **kwargs)
        seen.append(out)
        return out

    torch.zeros_like = spy  # type: ignore[assignment]
    try:
        opt.step()
    finally:
        torch.zeros_like = real  # type: ignore[assignment]
    return [model._offload_store.holds(t) for t in seen if t.dim() > 0 and t.to_local().numel()]


def test_adamw_state_is_born_on_disk(tmp_path):
    for placed in run_on_ranks(2, _the_state_created_by_a_step_is_file_backed_from_the_start, str(tmp_path)):
        assert placed and all(placed)


def _units_paged_out_during_steps(directory: str, optim: str) -> dict:
    """Runs on every rank: two disk-offload steps; each ``release_unit`` call is recorded with the
    unit the step is on. The step visits the parameters in the optimizer's order."""
    from shardwrap.offload import OffloadStore

    model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, offload=Offload("disk", path=directory))
    if optim == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=optim == "adamw_fused")
    order = []  # each parameter's unit, in the optimizer's order, consecutive repeats merged
    for p in opt.param_groups[0]["params"]:
        index = model.unit_of(p)[0].index
        if not order or order[-1] != index:
            order.append(index)
    released: list[int] = []
    real = OffloadStore.release_unit

    def spy(self, unit: int) -> None:
        released.append(unit)
        real(self, unit)

    OffloadStore.release_unit = spy  # type: ignore[method-assign]
    try:
        per_step = []
        for _ in range(2):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            per_step.append(list(released))
            released.clear()
    finally:
        OffloadStore.release_unit = real  # type: ignore[method-assign]
    return {"order": order, "per_step": per_step}


@pytest.mark.parametrize("optim", ["adamw", "adamw_fused", "sgd"])
def test_a_disk_step_pages_out_each_unit_when_it_moves_on(tmp_path, optim):
    """The step's file pages are released unit by unit as torch's per-parameter loop leaves each
    unit (``UnitPager``), the last when the step ends. AdamW's first step passes over the units
    twice: once creating the state in the files, once updating. A fused AdamW updates every
    parameter in one kernel; the pager runs it one unit's parameters at a time."""
    for r in run_on_ranks(2, _units_paged_out_during_steps, str(tmp_path), optim):
        order = r["order"]
        assert len(set(order)) == 4, r  # three blocks and the root (its parameters come first and last)
        twice = order + order[1:] if order[-1] == order[0] else order * 2  # a unit left and met again is one visit
        assert r["per_step"] == [order if optim == "sgd" else twice, order], r


FUSED = {  # torch's fused kernels (the pager splits each) with their per-parameter lists and scalars
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True),
    "adamw_amsgrad": lambda groups: torch.optim.AdamW(groups, lr=1e-2, amsgrad=True, fused=True),
    "adam_tensor_lr": lambda groups: torch.optim.Adam(groups, lr=torch.tensor(1e-2), fused=True),
}  # not fused SGD or Adagrad: torch's DTensor has no sharding rule for them (fully_shard neither)


def _fused_on_disk_and_in_memory(directory: str, optim: str) -> list[bool]:
    """Runs on every rank: the same stage-3 model trained three steps by a fused optimizer,
    once with its state in the files (the pager splits the kernel unit by unit) and once in
    memory (one kernel over every parameter); whether each local shard came out the same."""
    finals = []
    for offload in (Offload("disk", path=directory), None):
        torch.manual_seed(0)
        model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, offload=offload)
        named = [(n, p) for n, p in model.named_parameters()]
        groups = [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
        opt = FUSED[optim](groups)
        for step in range(3):
            g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
            model(torch.randn(4, 16, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        finals.append([p.to_local().clone() for p in model.parameters()])
        del model, opt
        gc.collect()
    return [torch.equal(a, b) for a, b in zip(*finals)]


@pytest.mark.parametrize("optim", sorted(FUSED))
def test_a_fused_step_on_disk_equals_the_fused_step_in_memory(tmp_path, optim):
    """Splitting a fused kernel by unit gives the bits of one call over every parameter
    (test_a_disk_step_pages_out_each_unit_when_it_moves_on checks that it is split)."""
    for same in run_on_ranks(2, _fused_on_disk_and_in_memory, str(tmp_path), optim):
        assert same and all(same), same


def _kernel_populates() -> bool:
    """Whether this kernel takes MADV_POPULATE_WRITE (Linux 5.14+) on a shared file mapping."""
    import mmap

    with tempfile.TemporaryFile() as f:
        f.truncate(mmap.PAGESIZE)
        mapped = mmap.mmap(f.fileno(), mmap.PAGESIZE, flags=mmap.MAP_SHARED)
        try:
            mapped.madvise(23)
            return True
        except OSError:
            return False
        finally:
            mapped.close()


@contextlib.contextmanager
def _recorded_populates(refuse: bool = False) -> Iterator[tuple[list[list[tuple[int, int, int]]], list[int]]]:
    """The disk store's mappings made through a ``mmap.mmap`` subclass (its methods cannot be
    patched) that records every ``madvise(MADV_POPULATE_WRITE)`` as (mapping, start, length) into
    the last list of ``steps`` (append one per step; none: not recorded), or, with ``refuse``,
    refuses it as a kernel before Linux 5.14 does and counts it in ``refused``."""
    import mmap

    steps: list[list[tuple[int, int, int]]] = []
    refused: list[int] = []
    real_madvise, saved = mmap.mmap.madvise, mmap.mmap

    class Recording(mmap.mmap):
        def madvise(self, option: int, *args: int) -> None:  # type: ignore[override]
            if option == 23:  # MADV_POPULATE_WRITE
                if refuse:
                    refused.append(option)
                    raise OSError(22, "Invalid argument")
                if steps:
                    steps[-1].append((id(self), *args))
            real_madvise(self, option, *args)

    mmap.mmap = Recording  # type: ignore[misc]
    try:
        yield steps, refused
    finally:
        mmap.mmap = saved  # type: ignore[misc]


def _faulted_in_by_steps(directory: str, optim: str, refuse: bool) -> dict:
    """Runs on every rank: three disk-offload steps with every ``madvise(MADV_POPULATE_WRITE)``
    recorded (mapping, start, length), beside what each step must write: every master shard and
    every state tensor in the files, as (mapping, first byte, end) ranges. ``refuse``: the kernel
    refuses the call (as before Linux 5.14). Also the final shards, and the same training with
    populating turned off."""
    import mmap

    import shardwrap.offload as offload_module

    calls: list[list[tuple[int, int, int]]] = []

    def train(record: bool) -> tuple[list[torch.Tensor], list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        torch.manual_seed(0)
        model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, offload=Offload("disk", path=directory))
        if optim == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=optim == "adamw_fused")
        for step in range(3):
            g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
            model(torch.randn(4, 16, generator=g)).square().mean().backward()
            if record:
                calls.append([])
            opt.step()
            opt.zero_grad()
        store = model._offload_store

        def where(t: torch.Tensor) -> tuple[int, int, int]:
            local = t.to_local()
            storage = local.untyped_storage()
            first = local.data_ptr() - storage.data_ptr()
            return id(store._files[storage.data_ptr()][1]), first, first + local.numel() * local.element_size()

        assert all(store.holds(v) for p in model.parameters() for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        shards = [where(p) for p in model.parameters() if p.to_local().numel() and store.holds(p)]
        states = [where(v) for p in model.parameters() if p.to_local().numel() and store.holds(p)
                  for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        final = [p.to_local().clone() for p in model.parameters()]
        del model, opt
        gc.collect()
        return final, shards, states

    saved_populate = offload_module.POPULATE
    try:
        with _recorded_populates(refuse) as (calls, refused):
            populated, shards, states = train(True)
        still_on = offload_module.POPULATE
    finally:
        offload_module.POPULATE = saved_populate
    offload_module.POPULATE = False
    try:
        plain, _, _ = train(False)
    finally:
        offload_module.POPULATE = saved_populate

    def covered(ranges: list[tuple[int, int, int]], step: list[tuple[int, int, int]]) -> list[bool]:
        return [any(m == mm and s <= first and s + n >= end for mm, s, n in step) for m, first, end in ranges]

    return {
        "same": [torch.equal(a, b) for a, b in zip(populated, plain)], "still_on": still_on, "refused": len(refused),
        "supported": _kernel_populates(), "aligned": all(s % mmap.PAGESIZE == 0 for step in calls for _, s, _ in step),
        "repeated": [len(step) - len(set(step)) for step in calls],
        "shards_covered": [covered(shards, step) for step in calls], "states_covered": [covered(states, step) for step in calls],
        "calls": [len(step) for step in calls], "tensors": len(shards) + len(states),
    }


@pytest.mark.parametrize("optim,refuse", [("sgd", False), ("adamw", False), ("adamw_fused", False), ("adamw", True)])
def test_a_disk_step_faults_in_each_tensor_it_writes_once(tmp_path, optim, refuse):
    """Each step maps every file-backed tensor it updates (master shards and their state) writable
    with one page-aligned madvise each, once, and nothing else (not the gradients, which are in
    RAM); the bits are those of a step that faults page by page. SGD's first step makes its
    momentum in RAM (a clone of the gradient) and the next step moves it to the files, so from then
    on it is faulted in too. A kernel that refuses the call is asked once and never again; on a
    kernel without the call (before Linux 5.14) only the bits are checked."""
    for r in run_on_ranks(2, _faulted_in_by_steps, str(tmp_path), optim, refuse):
        assert r["same"] and all(r["same"]), r["same"]
        assert r["refused"] == int(refuse), r
        assert r["still_on"] is (r["supported"] and not refuse), r
        if refuse or not r["supported"]:
            continue
        assert r["aligned"] and r["repeated"] == [0, 0, 0], r
        for step in range(3):
            assert all(r["shards_covered"][step]), (step, r)
            if step > 0 or optim != "sgd":
                assert all(r["states_covered"][step]) and r["calls"][step] == r["tensors"], (step, r)


def _fused_step_with_found_inf(directory: str) -> dict:
    """Runs on every rank: fused AdamW steps on disk with ``found_inf`` set as a ``GradScaler``
    sets it (an overflow: the kernel skips the update), then cleared; the MADV_POPULATE_WRITE
    calls of each step and whether the shards changed."""
    with _recorded_populates() as (calls, _):
        torch.manual_seed(0)
        model = ShardedModule(models.mlp(), auto_wrap_policy={models.Block}, offload=Offload("disk", path=directory))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        out = {"calls": [], "changed": []}
        for step, inf in enumerate((0.0, 1.0, 0.0)):
            model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.grad_scale, opt.found_inf = torch.ones(()), torch.tensor(inf)  # what GradScaler.step hands a fused step
            before = [p.to_local().clone() for p in model.parameters()]
            calls.append([])
            opt.step()
            opt.zero_grad()
            out["calls"].append(len(calls[-1]))
            out["changed"].append(any(not torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters())))
        return out


def test_an_overflowed_fused_step_faults_nothing_in(tmp_path):
    """A fused step told by a GradScaler that a gradient overflowed leaves every shard as it was;
    the pager then maps none of their pages writable (they would be written back for nothing)."""
    for r in run_on_ranks(2, _fused_step_with_found_inf, str(tmp_path)):
        if not _kernel_populates():
            assert r["changed"] == [True, False, True], r
            continue
        assert r["changed"] == [True, False, True] and r["calls"][0] > 0 and r["calls"][1] == 0 and r["calls"][2] > 0, r


def _several_optimizers(directory: str | None, stage: int) -> dict:
    """Two optimizers over the same parameters, stepped in turn (one per task over a shared
    backbone); then one's state cleared; then the other replaced by a new optimizer. On W ranks
    (each on its chunk of the batch), or in one process on the unwrapped model (``directory``
    None) as the reference."""
    torch.manual_seed(0)
    model: nn.Module = models.mlp()
    if dist.is_initialized():
        model = ShardedModule(model, auto_wrap_policy={models.Block}, stage=stage, offload=Offload("disk", path=directory))
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    first = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    second = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    files = []
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 16, generator=g), torch.randn(12, 5, generator=g)
        ((model(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).mean().backward()
        (first if step % 2 == 0 else second).step()
        model.zero_grad()
        if step == 2:
            second.state.clear()
        if step == 3:  # the next phase's optimizer; the old one goes
            first = torch.optim.AdamW(model.parameters(), lr=2e-2)
            gc.collect()
            if directory is not None:
                files = sorted(os.listdir(model._offload_store.directory))
    full = model.full_state_dict() if isinstance(model, ShardedModule) else model.state_dict()
    return {"full": full, "files": files}


@pytest.mark.parametrize("stage", [1, 3])
def test_several_optimizers_over_disk_offloaded_parameters_keep_states_of_their_own(tmp_path, stage):
    """Each optimizer's state has files of its own, and a cleared or new state starts from zeros
    (they shared one set of files, and the second's state started from the first's values:
    an audit found parameters 0.96 off, silently)."""
    reference = _several_optimizers(None, stage)["full"]
    results = run_on_ranks(2, _several_optimizers, str(tmp_path), stage)
    for k, v in reference.items():
        torch.testing.assert_close(results[0]["full"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"'{k}': {m}")
    for r in results:  # the replaced SGD's momentum files went with it
        assert not any("-opt0-" in n for n in r["files"]) and any("-opt1-" in n for n in r["files"]), r["files"]
