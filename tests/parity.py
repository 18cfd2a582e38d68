"""The parity oracle: train the unwrapped model in one process on the whole global batch, train
the wrapped model on W ranks (each on ``x.chunk(W)[rank]``), and compare.

``Case`` describes a run; ``check_parity(case, W)`` is the one helper every parity test calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import models
from harness import run_on_ranks

LR = {"sgd": 0.05, "adamw": 1e-2}


@dataclass(frozen=True)
class Case:
    build: str  # a builder in models.py
    build_kwargs: dict = field(default_factory=dict)
    policy: Any = None  # anything ShardedModule accepts; strings name a class: "Block", "GPT2Block"
    optim: str = "sgd"
    steps: int = 3
    stage: int = 3
    data: str = "regression"  # or "lm"
    dim: int = 16
    seq: int = 0  # > 0: inputs are (B, seq, dim)
    out: int = 5
    batch: int = 12  # divisible by every W tested
    accumulate: int = 1  # backward() calls per optimizer step
    no_sync: bool = False  # run all but the last micro-batch under model.no_sync()
    mixed_precision: str | None = None  # "bf16" | "fp16": param and reduce dtype
    clip: float | None = None  # clip_grad_norm_ max_norm
    # or "torch": torch.nn.utils.clip_grad_norm_(model.parameters(), ...); "torch_foreach": the
    # same with foreach=True; "torch_split": get_total_norm then clip_grads_with_norm_; "torch_value":
    # clip_grad_value_(model.parameters(), clip) (the reference does the same)
    clip_api: str = "shardwrap"
    norm_type: float = 2.0
    max_unsharded: int = 2
    set_to_none: bool = True  # optimizer.zero_grad(set_to_none=...)
    offload: str | None = None  # Offload(optimizer=...): "cpu" | "disk" (files in a new temporary directory)
    mesh: tuple[int, int] | None = None  # hybrid: (replicas, shards), a ("replicate", "shard") mesh over R * S ranks
    tp: int = 0  # tensor parallelism over this many ranks: a ("dp", "tp") mesh; each Block's up colwise, down rowwise
    seed: int = 0


def build_model(case: Case) -> nn.Module:
    torch.manual_seed(case.seed)
    return getattr(models, case.build)(**case.build_kwargs)


def resolve_policy(case: Case) -> Any:
    if case.policy == "Block":
        return {models.Block}
    if case.policy == "GPT2Block":
        return {models.gpt2_block_class()}
    if case.policy == "marked":
        return models.marked_unit
    return case.policy


def build_optimizer(case: Case, model: nn.Module) -> torch.optim.Optimizer:
    if case.optim == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR["sgd"], momentum=0.9)
    # nanoGPT's configure_optimizers: decay on 2-D+ weights, none on biases and norms.
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR["adamw"], betas=(0.9, 0.95))


def global_batch(case: Case, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * case.seed + step)
    if case.data == "lm":
        vocab = case.build_kwargs.get("vocab_size", 96)
        ids = torch.randint(0, vocab, (case.batch, case.seq or 8), generator=g)
        return {"input_ids": ids}
    shape = (case.batch, case.seq, case.dim) if case.seq else (case.batch, case.dim)
    out = (case.batch, case.seq, case.out) if case.seq else (case.batch, case.out)
    return {"x": torch.randn(shape, generator=g), "y": torch.randn(out, generator=g)}


def loss_fn(case: Case, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if case.data == "lm":
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
    y = batch["y"]
    # Every tensor in the output joins the loss, whatever structure holds it.
    return sum(((t - y) ** 2).mean() if t.shape == y.shape else (t**2).mean() for t in tensors_in(model(batch["x"])))


def tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    return []


def micro_batches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    return [{k: v.chunk(n)[i] for k, v in batch.items()} for i in range(n)]


DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def set_step(model: nn.Module, step: int) -> None:
    if hasattr(model, "set_step"):
        model.set_step(step)


def train_reference(case: Case, *, mixed_precision: str | None = "case") -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """The oracle: unwrapped model, one process, whole global batch.

    With mixed precision it applies the same casts as ShardedModule: an fp32 master model that the
    optimizer updates, and a low-precision copy that computes forward and backward.
    Returns (state dict, per-step losses, per-step gradient norms when clipping).
    """
    dtype = DTYPES[case.mixed_precision if mixed_precision == "case" else mixed_precision]
    model = build_model(case)
    compute = build_model(case).to(dtype) if dtype else model
    opt = build_optimizer(case, model)
    losses, norms = [], []
    for step in range(case.steps):
        set_step(compute, step)
        if dtype:
            with torch.no_grad():
                for p, q in zip(compute.parameters(), model.parameters()):
                    p.copy_(q)
        step_loss = 0.0
        for micro in micro_batches(global_batch(case, step), case.accumulate):
            if dtype:
                micro = {k: v.to(dtype) if v.is_floating_point() else v for k, v in micro.items()}
            loss = loss_fn(case, compute, micro) / case.accumulate
            loss.backward()
            step_loss += loss.item()
        if dtype:
            for p, q in zip(compute.parameters(), model.parameters()):
                q.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        losses.append(step_loss)
        if case.clip is not None and case.clip_api == "torch_value":
            torch.nn.utils.clip_grad_value_(model.parameters(), case.clip)
        elif case.clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip, case.norm_type).item())
        opt.step()
        opt.zero_grad(set_to_none=case.set_to_none)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


# ---- mutations: deliberate bugs the oracle must catch (tests/test_oracle.py) ---------------------

# Modules that may define the gradient average: shardwrap.unit after the core rewrite, shardwrap.handle
# before it.
AVERAGE_GRAD_MODULES = ("shardwrap.unit", "shardwrap.handle")


def _sum_instead_of_average(summed: torch.Tensor, world_size: int) -> None:
    """The bug AdamW cannot see: gradients W times too large."""


def _average_twice(summed: torch.Tensor, world_size: int) -> None:
    """Gradients W times too small."""
    summed.div_(world_size * world_size)


MUTATIONS = {"sum": _sum_instead_of_average, "average_twice": _average_twice}


def modules_with_average_grad() -> list[Any]:
    """Every module in ``AVERAGE_GRAD_MODULES`` that exists and has a global ``_average_grad``
    (the one defining it, and any that imported it by name: each call site looks it up in its own
    module's globals)."""
    found = []
    for name in AVERAGE_GRAD_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            module = importlib.import_module(name)
            if callable(getattr(module, "_average_grad", None)):
                found.append(module)
    if not found:
        raise LookupError(f"no module among {AVERAGE_GRAD_MODULES} defines _average_grad; update parity.AVERAGE_GRAD_MODULES")
    return found


@contextlib.contextmanager
def mutated(mutation: str | None) -> Iterator[list[int]]:
    """Within the block, shardwrap's ``_average_grad`` is replaced by ``MUTATIONS[mutation]``;
    restored afterwards, whatever happens (worker processes are reused by later tests). Yields a
    one-element list counting the calls, so a caller can tell that the mutation was reached."""
    calls = [0]
    if mutation is None:
        yield calls
        return
    bug = MUTATIONS[mutation]

    def counted(summed: torch.Tensor, world_size: int) -> None:
        calls[0] += 1
        bug(summed, world_size)

    modules = modules_with_average_grad()
    originals = [(m, m._average_grad) for m in modules]
    try:
        for m in modules:
            m._average_grad = counted
        yield calls
    finally:
        for m, original in originals:
            m._average_grad = original


def train_sharded(case: Case, mutation: str | None = None) -> dict[str, Any]:
    """Runs on every rank: the wrapped model on this rank's chunk of each global batch.

    ``mutation`` (a key of ``MUTATIONS``) trains with that bug planted in shardwrap; the result then
    also holds ``"mutation_calls"``, how often the planted function ran on this rank."""
    with mutated(mutation) as calls:
        result = _train_sharded(case)
    if mutation is not None:
        result["mutation_calls"] = calls[0]
    return result


def _train_sharded(case: Case) -> dict[str, Any]:
    import tempfile

    from shardwrap import MixedPrecision, Offload

    dtype = DTYPES[case.mixed_precision]
    offload = None
    if case.offload is not None:
        offload = Offload(case.offload, path=tempfile.mkdtemp(prefix="shardwrap-offload-test-") if case.offload == "disk" else None)
    model = wrap(
        case,
        mixed_precision=MixedPrecision(param_dtype=dtype) if dtype else None,
        max_unsharded=case.max_unsharded,
        offload=offload,
    )
    opt = build_optimizer(case, model)
    losses, norms = [], []
    chunks, mine = data_place(case)
    for step in range(case.steps):
        set_step(model.module, step)
        local = {k: v.chunk(chunks)[mine] for k, v in global_batch(case, step).items()}
        step_loss = 0.0
        micros = micro_batches(local, case.accumulate)
        for i, micro in enumerate(micros):
            context = model.no_sync() if case.no_sync and i < len(micros) - 1 else contextlib.nullcontext()
            with context:
                loss = loss_fn(case, model, micro) / case.accumulate
                loss.backward()
            step_loss += loss.item()
        losses.append(step_loss)
        norm = clip(case, model) if case.clip is not None else None
        if norm is not None:
            norms.append(norm)
        opt.step()
        opt.zero_grad(set_to_none=case.set_to_none)
    store = model._offload_store
    on_disk = None
    if store is not None and store.kind == "disk":  # what lives in the files: every shard, every state like a parameter
        on_disk = {
            "params": all(store.holds(p) for p in model.parameters() if p.numel()),
            "state": [store.holds(v) for p in model.parameters() for v in opt.state.get(p, {}).values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0 and v.to_local().numel()],
        }
    return {
        "on_disk": on_disk,
        "full": model.full_state_dict(),
        **placed_params(case, model),
        "losses": losses,
        "norms": norms,
    }


def placed_params(case: Case, model: Any) -> dict[str, Any]:
    """``"local"``: each parameter's local tensor (checked against ``torch.chunk`` of the
    reference); with tensor parallelism ``"placed"`` instead: each DTensor parameter's
    ``full_tensor()``, which holds only if its 2-D placements say where its local rows belong."""
    if case.tp:
        return {"local": {}, "placed": {n: p.detach().full_tensor() for n, p in model.named_parameters()}}
    return {"local": {n: p.detach().to_local().clone() for n, p in model.named_parameters()}}


def wrap(case: Case, **kwargs: Any) -> Any:
    """The case's model wrapped by ShardedModule on the case's mesh (tensor-parallel first when
    ``case.tp``: each Block's ``up`` column-wise and ``down`` row-wise on the "tp" axis)."""
    from shardwrap import ShardedModule

    module = build_model(case)
    mesh = hybrid_mesh(case.mesh) if case.mesh else None
    if case.tp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        world = dist.get_world_size()
        full = init_device_mesh("cpu", (world // case.tp, case.tp), mesh_dim_names=("dp", "tp"))
        for block in [m for m in module.modules() if isinstance(m, models.Block)]:
            parallelize_module(block, full["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        mesh = full["dp"]
    return ShardedModule(module, auto_wrap_policy=resolve_policy(case), stage=case.stage, mesh=mesh, **kwargs)


def data_place(case: Case) -> tuple[int, int]:
    """(how many chunks each global batch splits into, which one this rank trains on): one per
    rank, or with tensor parallelism one per data-parallel rank (the mesh is row-major)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if case.tp:
        return world // case.tp, rank // case.tp
    return world, rank


def hybrid_mesh(shape: tuple[int, int]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def shard_place(case: Case, world_size: int, rank: int) -> tuple[int, int]:
    """(S, this rank's place on the shard axis): a hybrid mesh is row-major, rank = r * S + s."""
    shards = case.mesh[1] if case.mesh else world_size
    return shards, rank % shards


def clip(case: Case, model: Any) -> float | None:
    """Clip as the case says and return the total norm. With torch's own clip_grad_norm_ on
    ``model.parameters()`` (DTensors), the norm must agree with shardwrap's method on every rank."""
    if case.clip_api == "shardwrap":
        return model.clip_grad_norm_(case.clip, case.norm_type).item()
    ours = model.clip_grad_norm_(float("inf"), case.norm_type).item()  # the norm; scales by 1
    params = list(model.parameters())
    if case.clip_api == "torch_value":
        torch.nn.utils.clip_grad_value_(params, case.clip)
        return None
    if case.clip_api == "torch_split":
        total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], case.norm_type)
        torch.nn.utils.clip_grads_with_norm_(params, case.clip, total)
    else:
        total = torch.nn.utils.clip_grad_norm_(params, case.clip, case.norm_type, foreach=True if case.clip_api == "torch_foreach" else None)
    total = total.full_tensor() if isinstance(total, DTensor) else total
    assert abs(total.item() - ours) <= 1e-5 * max(1.0, ours), f"torch's norm {total.item()} vs model.clip_grad_norm_ {ours}"
    return total.item()


def expected_chunk(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """``torch.chunk(full, world)[rank]``, or its empty tail when chunk returns fewer pieces."""
    if full.dim() == 0:
        return full  # 0-dim parameters are replicated
    chunks = torch.chunk(full, world)
    return chunks[rank] if rank < len(chunks) else full[full.shape[0] :]


TOLERANCE = {None: (1e-5, 1e-6), "fp16": (2e-3, 2e-4), "bf16": (1e-2, 2e-3)}  # (rtol, atol) for SGD


def assert_close_params(
    actual: torch.Tensor, expected: torch.Tensor, optim: str, steps: int, what: str, precision: str | None = None
) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    if optim == "sgd":
        rtol, atol = TOLERANCE[precision]
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
        return
    # Adam normalizes each coordinate by its own gradient scale, so on coordinates whose true
    # gradient is ~0 (float noise, e.g. attention key biases) it turns noise into full +-lr steps.
    # Bound those steps, and bound the share of coordinates that may show them.
    if actual.numel() == 0:
        return
    diff = (actual - expected).abs()
    assert diff.max().item() <= 3 * LR["adamw"] * steps, f"{what}: max diff {diff.max().item():.3g}"
    # Low precision perturbs each gradient by ~eps, which Adam passes on to the step direction.
    threshold = {None: 1e-4, "fp16": 5e-4, "bf16": 3e-3}[precision]
    share = (diff > threshold + 1e-4 * expected.abs()).float().mean().item()
    allowed = 0.06 if precision == "bf16" else 0.02  # bf16 keeps 8 mantissa bits: noisier directions
    assert share <= allowed or diff.numel() < 50 and share <= 0.5, f"{what}: {share:.1%} of elements differ"


Reference = tuple[dict[str, torch.Tensor], list[float], list[float]]  # what train_reference returns


def check_parity(case: Case, world_size: int) -> list[dict[str, Any]]:
    reference = train_reference(case)
    results = run_on_ranks(world_size, train_sharded, case)
    compare(case, world_size, results, reference)
    return results


def compare(case: Case, world_size: int, results: list[dict[str, Any]], reference: Reference | None = None) -> None:
    """The assertions of ``check_parity`` on ``train_sharded``'s per-rank ``results``, against
    ``reference`` (``train_reference(case)``, trained here when not given)."""
    expected, ref_losses, ref_norms = train_reference(case) if reference is None else reference
    full = results[0]["full"]
    mp = case.mixed_precision
    assert list(full) == list(expected), "full_state_dict keys differ from the unwrapped model's"
    for name, value in expected.items():
        assert full[name].dtype == value.dtype, f"'{name}': master dtype {full[name].dtype} != {value.dtype}"
        assert_close_params(full[name], value, case.optim, case.steps, f"full '{name}'", mp)
    for rank, result in enumerate(results):
        for name, placed in result.get("placed", {}).items():
            assert_close_params(placed, expected[name], case.optim, case.steps, f"rank {rank} DTensor '{name}'.full_tensor()", mp)
    for rank, result in enumerate(results):
        assert result["full"] == {} or rank == 0, "rank0_only: other ranks must get {}"
        shards, place = shard_place(case, world_size, rank)
        for name, local in result["local"].items():
            assert_close_params(
                local, expected_chunk(expected[name], shards, place), case.optim, case.steps, f"rank {rank} shard '{name}'", mp
            )
    # Per-rank losses average to the global loss (every chunk has the same size).
    loss_tol = {None: 1e-4, "fp16": 5e-3, "bf16": 3e-2}[mp]
    for i, ref_loss in enumerate(ref_losses):
        mean = sum(r["losses"][i] for r in results) / world_size
        assert abs(mean - ref_loss) <= loss_tol * max(1.0, abs(ref_loss)), f"loss {i}: {mean} vs {ref_loss}"
    for rank, result in enumerate(results):  # every rank returns the same, global norm
        for ours, ref in zip(result["norms"], ref_norms, strict=True):
            assert abs(ours - ref) <= (1e-5 if mp is None else loss_tol) * max(1.0, abs(ref)), (rank, ours, ref)
    if mp is not None:
        # The fp32 masters drift from an all-fp32 run no further than the reference's do.
        fp32, _, _ = train_reference(case, mixed_precision=None)
        ours = max((full[k] - v).abs().max().item() for k, v in fp32.items() if v.is_floating_point())
        ref = max((expected[k] - v).abs().max().item() for k, v in fp32.items() if v.is_floating_point())
        noise = LR[case.optim] * torch.finfo(DTYPES[mp]).eps * case.steps  # one rounding per step
        assert ours <= 2 * ref + noise, f"{mp} drift from fp32: ours {ours:.3g} vs reference {ref:.3g}"
