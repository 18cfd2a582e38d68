"""Behaviour that is not a plain parity run: names, collectives per unshard, forward without
backward, units unused on some ranks, buffers, memory. Functions named ``on_ranks_*`` run on
every rank through the harness."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import models
from harness import run_on_ranks
from parity import Case, build_model, check_parity, global_batch, resolve_policy


def wrap(case: Case, **kwargs):
    from shardwrap import ShardedModule

    return ShardedModule(build_model(case), auto_wrap_policy=resolve_policy(case), **kwargs)


GPT2 = Case("gpt2", {"n_layer": 2}, policy="GPT2Block", data="lm", seq=8)


# ---- the module tree is not rewritten ---------------------------------------------------------


def on_ranks_names(case: Case) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    from shardwrap import ShardedModule

    plain = build_model(case)
    original = build_model(case)
    model = ShardedModule(original, auto_wrap_policy=resolve_policy(case))
    block_cls = models.gpt2_block_class()
    sd = model.state_dict()
    shards_share_storage = []
    for handle in model.units:
        base = handle.sharded_local.untyped_storage().data_ptr()
        shards_share_storage += [p.to_local().untyped_storage().data_ptr() == base for p in handle.sharded_params]
    return {
        "params": [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()],
        "modules": [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()],
        "state_dict": list(sd) == list(plain.state_dict()),
        "module_is_original": model.module is original,
        "walk": isinstance(model.transformer.h[0], block_cls) and model.transformer.h[0] is original.transformer.h[0],
        "shape": all(p.shape == q.shape for p, q in zip(model.parameters(), plain.parameters())),
        "dtensor_params": all(isinstance(p, nn.Parameter) and isinstance(p, DTensor) for p in model.parameters()),
        "dtensor": all(
            isinstance(v, DTensor) and v.placements == (Shard(0),) and v.shape == plain.state_dict()[k].shape
            for k, v in sd.items()
            if k in dict(plain.named_parameters())
        ),
        "tied_once": sum(1 for n, _ in model.named_parameters() if n in ("lm_head.weight", "transformer.wte.weight")) == 1,
        "tied_in_sd": "lm_head.weight" in sd and "transformer.wte.weight" in sd,
        "share_storage": all(shards_share_storage),
        "dtensor_local_is_flat": all(h.sharded_flat.to_local().data_ptr() == h.sharded_local.data_ptr() for h in model.units),
    }


def test_wrapped_model_keeps_original_names_and_tree():
    for result in run_on_ranks(2, on_ranks_names, GPT2):
        failed = [k for k, ok in result.items() if not ok]
        assert not failed, failed


# ---- collectives ------------------------------------------------------------------------------


def on_ranks_collectives(case: Case) -> dict:
    from shardwrap.collectives import count_collectives

    model = wrap(case)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = []
    for step in range(2):
        batch = {k: v.chunk(dist.get_world_size())[dist.get_rank()] for k, v in global_batch(case, step).items()}
        with count_collectives() as fwd:
            loss = model(batch["x"]).pow(2).mean()
        with count_collectives() as bwd:
            loss.backward()
        opt.step()
        counts.append({"fwd": dict(fwd), "bwd": dict(bwd)})
    units = len(model.units)
    shard_numel = sum(h.layout.shard_numel + 1 for h in model.units)
    grad_numel = sum(h.layout.grad_shard_numel + h.layout.num_trainable for h in model.units)  # and the used-flags
    order = [h.name for h in model.units]  # the root first, then the blocks in forward order
    return {"units": units, "steps": counts, "shard": shard_numel, "grad": grad_numel, "order": order}


def test_one_all_gather_per_unshard_and_one_reduce_scatter_per_unit():
    world = 3
    for r in run_on_ranks(world, on_ranks_collectives, Case("mlp", policy="Block")):
        assert r["order"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"], r["order"]
        for step, c in enumerate(r["steps"]):
            # every unit is gathered for forward (the step made the kept ones stale)
            assert c["fwd"]["all_gather_calls"] == r["units"], r
            assert c["fwd"]["all_gather"] == r["shard"], r
            assert "reduce_scatter" not in c["fwd"], r
            # stage 3 gathers every unit again for backward but the root, which stays unsharded
            # from forward, and from the second step on the unit that ended the last forward
            # (blocks.2): backward needs both first (design/notes/prefetch.md)
            kept = 1 if step == 0 else 2
            assert c["bwd"]["all_gather_calls"] == r["units"] - kept, (step, c)
            assert c["bwd"]["reduce_scatter_calls"] == r["units"], r
            assert c["bwd"]["reduce_scatter"] == world * r["grad"], r


# ---- forward without backward -----------------------------------------------------------------


def on_ranks_forward_only(case: Case) -> dict:
    from shardwrap.unit import DataState

    model = wrap(case)
    x = global_batch(case, 0)["x"]
    outs, unsharded = {}, {}

    def unsharded_units() -> list[str]:
        return [h.name for h in model.units if h.data_state is not DataState.SHARDED]

    with torch.no_grad():
        outs["no_grad"] = model(x)
    unsharded["no_grad"] = unsharded_units()
    model.eval()
    outs["eval_grad_enabled"] = model(x).detach()  # graph built, never backpropagated
    unsharded["eval_grad_enabled"] = unsharded_units()
    model.train()
    for i in range(5):
        model(x)  # grad-enabled training forwards with no backward (yet)
        unsharded[f"train_{i}"] = unsharded_units()
    records = max(len(h._calls) for h in model.units)  # the forward calls a backward may still reach
    unsharded_bytes = sum(h.unsharded_buffer.untyped_storage().nbytes() for h in model.units)
    largest = [h.layout.padded_unsharded_numel * 4 for h in model.units]
    # Then a normal step still works.
    model(x).pow(2).mean().backward()
    grads = all(p.grad is not None for p in model.parameters())
    unsharded["after_backward"] = unsharded_units()
    return {"unsharded": unsharded, "unsharded_bytes": unsharded_bytes, "sizes": largest, "grads": grads, "outs": outs,
            "records": records}


def test_forward_without_backward_keeps_at_most_what_backward_needs_first():
    """No-grad forwards leave every unit sharded. A grad-enabled forward keeps the root
    unsharded, and from its second step the unit that ended the last forward: backward gathers
    those two first (design/notes/prefetch.md). In eval mode too: ranks may differ in the mode
    flag, and what they gather must not. Nothing else stays, however many forwards run,
    and no unit keeps a record of a forward whose outputs were dropped (it kept one per forward,
    about 2 KB each, until the next backward: a grad-enabled evaluation loop grew without bound)."""
    case = Case("mlp", policy="Block")
    reference = build_model(case)
    x = global_batch(case, 0)["x"]
    with torch.no_grad():
        expected = reference(x)
    for r in run_on_ranks(2, on_ranks_forward_only, case):
        u = r["unsharded"]
        assert u["no_grad"] == u["after_backward"] == [], u
        # the no-grad forward recorded a trace, so the next forward knows the unit that ends it
        assert all(u[k] == ["<root>", "blocks.2"] for k in ["eval_grad_enabled", *(f"train_{i}" for i in range(5))]), u
        assert r["unsharded_bytes"] == r["sizes"][0] + r["sizes"][-1], r
        assert r["grads"], r
        assert r["records"] <= 1, r  # at most the last forward's, not yet pruned
        for out in r["outs"].values():
            torch.testing.assert_close(out, expected)


class SideLossBlock(nn.Module):
    """Keeps a loss term of its own on the module (an MoE load-balancing loss, a feature captured
    for distillation): its graph outlives the call's output."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        self.side = h.pow(2).mean()
        return self.c(torch.tanh(h))


class SideLossNet(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(dim, dim), SideLossBlock(dim), nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.inp(x)))


def side_loss_training(model: nn.Module, block: nn.Module, rank: int | None, world: int) -> None:
    """Two calls a step: the first call's output is dropped, its side loss is kept."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x1, x2 = torch.randn(2 * world, 8, generator=g), torch.randn(2 * world, 8, generator=g)
        parts = range(world) if rank is None else [rank]
        losses = []
        for r in parts:
            model(x1[2 * r : 2 * r + 2])  # output dropped
            side = block.side
            losses.append(model(x2[2 * r : 2 * r + 2]).pow(2).mean() + side)
        (sum(losses) / len(losses)).backward()
        opt.step()
        opt.zero_grad()


def on_ranks_side_loss(stage: int) -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(SideLossNet(), auto_wrap_policy={SideLossBlock}, stage=stage)
    side_loss_training(model, model.module.block, dist.get_rank(), dist.get_world_size())
    return model.full_state_dict(rank0_only=False)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_dropped_output_whose_side_loss_is_kept_still_reaches_backward(stage):
    # a forward call's record must live as long as any node that consumed its parameters: with the
    # record held by the output's hook alone, stages 2 and 3 freed the unit before the first call's
    # backward ("setStorage ... out of bounds", a review)
    torch.manual_seed(0)
    reference = SideLossNet()
    side_loss_training(reference, reference.block, None, 2)
    for got in run_on_ranks(2, on_ranks_side_loss, stage):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


# ---- units unused on some ranks or on all ------------------------------------------------------


class AuxNet(nn.Module):
    """stem -> trunk -> (head, aux). A rank whose loss skips aux defers aux's reduce-scatter to the
    end of backward, but still needs the stem's all-gather from its peers: a peer that *waited* for
    aux's reduce-scatter inside backward would never issue it (notes/collective-schedule.md)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.stem = models.Block(dim)
        self.trunk = models.Block(dim)
        self.aux = models.Block(dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        h = self.trunk(self.stem(x))
        return self.head(h), self.aux(h)


def aux_loss(model, x, y, chunk_index: int, step: int) -> torch.Tensor:
    """Chunk 0 uses the aux output on even steps; no chunk uses it on odd steps."""
    main, aux = model(x)
    loss = ((main - y) ** 2).mean()
    if chunk_index == 0 and step % 2 == 0:
        loss = loss + aux.pow(2).mean()
    return loss


def aux_reference(world: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = AuxNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        batch = global_batch(Case("mlp"), step)
        xs, ys = batch["x"].chunk(world), batch["y"].chunk(world)
        loss = sum(aux_loss(model, xs[r], ys[r], r, step) for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def on_ranks_aux(steps: int) -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(AuxNet(), auto_wrap_policy={models.Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        batch = global_batch(Case("mlp"), step)
        aux_loss(model, batch["x"].chunk(world)[rank], batch["y"].chunk(world)[rank], rank, step).backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def test_unit_unused_on_some_ranks_or_all_neither_hangs_nor_desyncs():
    world, steps = 3, 4
    expected = aux_reference(world, steps)
    full = run_on_ranks(world, on_ranks_aux, steps, timeout=60)[0]
    for k, v in expected.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


class AuxUnderNoGrad(AuxNet):
    """AuxNet whose aux unit runs under torch.no_grad() where ``aux_grad`` is False."""

    aux_grad = True

    def forward(self, x):
        h = self.trunk(self.stem(x))
        with torch.set_grad_enabled(self.aux_grad):
            aux = self.aux(h)
        return self.head(h), aux


def on_ranks_aux_grad_mode_differs() -> dict:
    """Rank 1 runs the aux unit under no_grad: refused on every rank, naming the grad mode; the
    ranks are out of step from then on, and the next forward says so (no hang)."""
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(AuxUnderNoGrad(), auto_wrap_policy={models.Block})
    rank, world = dist.get_rank(), dist.get_world_size()
    model.module.aux_grad = rank == 0
    batch = global_batch(Case("mlp"), 0)
    errors = []
    for _ in range(2):
        try:
            main, _ = model(batch["x"].chunk(world)[rank])
            ((main - batch["y"].chunk(world)[rank]) ** 2).mean().backward()
            errors.append("no error")
        except RuntimeError as exc:
            errors.append(str(exc))
    return {"errors": errors}


def test_a_unit_under_no_grad_on_one_rank_only_is_named_on_every_rank():
    for r in run_on_ranks(2, on_ranks_aux_grad_mode_differs, timeout=60):
        first, then = r["errors"]
        assert "ranks disagree on which units this backward reduces" in first, first
        assert "torch.no_grad() on some ranks only" in first, first
        assert "refused: the ranks fell out of step earlier" in then, then


# ---- buffers and rank 0's values ---------------------------------------------------------------


def on_ranks_rank0_values() -> dict:
    from shardwrap import ShardedModule

    torch.manual_seed(100 + dist.get_rank())  # every rank starts from different values
    plain = models.with_buffers()
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    model = ShardedModule(plain, auto_wrap_policy={models.Block})
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return {"before": before, "full": model.full_state_dict(rank0_only=False), "buffers": buffers}


def test_every_rank_holds_rank0_parameters_and_buffers():
    results = run_on_ranks(2, on_ranks_rank0_values)
    rank0 = results[0]["before"]
    for r in results:
        assert list(r["full"]) == list(rank0)
        for k, v in rank0.items():
            torch.testing.assert_close(r["full"][k], v, rtol=0, atol=0)
        for k, v in r["buffers"].items():
            torch.testing.assert_close(v, rank0[k], rtol=0, atol=0)


# ---- memory ------------------------------------------------------------------------------------


def storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def on_ranks_memory(case: Case) -> dict:
    model = wrap(case)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {k: v.chunk(dist.get_world_size())[dist.get_rank()] for k, v in global_batch(case, 0).items()}
    ((model(batch["x"]) - batch["y"]) ** 2).mean().backward()
    opt.step()
    params = [h.sharded_local for h in model.units]
    grads = [p.grad for p in model.parameters()]
    states = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(grads),
        "optim": storage_bytes(states),
        "unsharded": sum(h.unsharded_buffer.untyped_storage().nbytes() for h in model.units),
        "padding": sum(h.layout.shard_numel + 1 for h in model.units),
        # the gradients view their unit's reduce-scatter output, which ends with a used-flag per
        # trainable parameter rather than one tag
        "more_flags": sum(h.layout.num_trainable - 1 for h in model.units if h.layout.num_trainable),
        "psi": sum(p.numel() for p in build_model(case).parameters()),
    }


def test_model_state_memory_is_16_psi_over_w():
    world = 3
    case = Case("mlp", {"dim": 64, "depth": 4}, policy="Block", dim=64)
    for r in run_on_ranks(world, on_ranks_memory, case):
        psi = r["psi"]
        total = r["params"] + r["grads"] + r["optim"]
        pad_bytes = 16 * (r["padding"] - psi / world) + 4 * r["more_flags"]  # padding rows, tags and flags, at most
        assert r["unsharded"] == 0, r
        assert abs(total - 16 * psi / world) <= pad_bytes + 1e-9, (total, 16 * psi / world, pad_bytes)
        assert abs(total / (16 * psi / world) - 1) < 0.03, r


def on_ranks_units_and_groups() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from shardwrap import ShardedModule, SizePolicy

    torch.manual_seed(0)
    tied = ShardedModule(models.tied_across_units(), auto_wrap_policy={nn.Sequential})
    owners = {h.name: list(h.layout.slots[i].fqn for i in range(len(h.layout.slots))) for h in tied.units}

    # A user-given 1-D mesh, and param groups chosen by name.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = ShardedModule(models.lora(), auto_wrap_policy={models.LoRALinear}, mesh=mesh)
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named.items() if "lora" in n], "lr": 1e-2},
            {"params": [p for n, p in named.items() if "lora" not in n and p.requires_grad], "lr": 1e-3},
        ]
    )
    x = torch.randn(4, 16)
    model(x).pow(2).mean().backward()
    frozen = [n for n, p in named.items() if not p.requires_grad]
    grad_bytes = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
    trainable_local = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen_before = {n: named[n].detach().clone() for n in frozen}
    opt.step()
    return {
        "owners": owners,
        "mesh_is_given": model.mesh is mesh,
        "frozen_grads_none": all(named[n].grad is None for n in frozen),
        "frozen_unchanged": all(torch.equal(named[n], v) for n, v in frozen_before.items()),
        "reduced_numel": [h.layout.grad_shard_numel for h in model.units],
        "shard_numel": [h.layout.shard_numel for h in model.units],
        "grad_numel": grad_bytes,
        "trainable_local": trainable_local,
        "n_frozen": len(frozen),
        "size_units": [h.name for h in ShardedModule(models.mlp(16, 3), auto_wrap_policy=SizePolicy(1000)).units],
        # Blocks of 1,104 under a threshold of 2,000: the ModuleList (3,312) is no unit, having no forward
        "size_units_list": [h.name for h in ShardedModule(models.mlp(16, 3), auto_wrap_policy=SizePolicy(2000)).units],
    }


def test_tied_owner_user_mesh_name_groups_and_frozen_memory():
    for r in run_on_ranks(2, on_ranks_units_and_groups):
        assert "embed.0.weight" in r["owners"]["<root>"], r["owners"]
        assert all("embed.0.weight" not in v for k, v in r["owners"].items() if k != "<root>")
        assert r["mesh_is_given"] and r["frozen_grads_none"] and r["frozen_unchanged"] and r["n_frozen"] == 6
        # Frozen parameters take no gradient memory: the gradient layout is the trainable prefix.
        assert all(g < s for g, s in zip(r["reduced_numel"], r["shard_numel"]) if s), r
        assert r["grad_numel"] == r["trainable_local"], r
        # A Block has 1,104 parameters (>= 1000) while its layers have 544 at most; inp and head stay in the root.
        assert r["size_units"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"], r["size_units"]
        assert r["size_units_list"] == ["<root>"], r["size_units_list"]  # the policy once picked 'blocks'


# ---- polling a reduce-scatter in flight -------------------------------------------------------


class _EventWork:
    """A stand-in for ``dist.Work``: completes when the test says so, counts ``wait()`` calls."""

    def __init__(self) -> None:
        import threading

        self.finished = threading.Event()
        self.waits = 0

    def is_completed(self) -> bool:
        return self.finished.is_set()

    def wait(self) -> bool:
        self.waits += 1
        self.finished.wait()
        return True


def test_accelerator_probe_never_calls_wait():
    """On CUDA, ``wait()`` from any thread would make the compute stream queue behind the
    reduce-scatter; the probe must read the collective's completion instead."""
    from shardwrap.unit import completion_probe

    work = _EventWork()
    probe = completion_probe(work, torch.device("cuda", 0))
    assert probe() is False
    work.finished.set()
    assert probe() is True
    assert work.waits == 0


def test_cpu_probe_waits_on_the_waiter_thread_and_does_not_block():
    """gloo reports completion only through ``wait()``; the probe hands that to one thread."""
    from shardwrap.unit import completion_probe

    work = _EventWork()
    probe = completion_probe(work, torch.device("cpu"))
    assert probe() is False  # returns at once although the collective has not finished
    work.finished.set()
    probe.join()
    assert probe() is True and work.waits == 1
    assert completion_probe(None, torch.device("cpu")) is None


# ---- a deleted model is freed ------------------------------------------------------------------


def on_ranks_freed(stage: int, mixed: bool) -> dict:
    import gc
    import weakref

    from shardwrap import MixedPrecision, ShardedModule

    policy = MixedPrecision(param_dtype=torch.bfloat16) if mixed else None
    model = ShardedModule(AuxNet(), auto_wrap_policy={models.Block}, stage=stage, mixed_precision=policy)
    opt = torch.optim.AdamW(model.parameters())
    batch = global_batch(Case("mlp"), 0)
    for step in range(2):
        aux_loss(model, batch["x"], batch["y"], 0, step).backward()
        opt.step()
    refs = [weakref.ref(model)] + [weakref.ref(t) for h in model.units for t in (h, h.unsharded_trainable, h.sharded_local)]
    del model, opt
    gc.collect()
    return {"alive": sum(r() is not None for r in refs), "of": len(refs)}


def test_a_deleted_model_frees_its_shards_buffers_and_hooks():
    """Autograd keeps post-accumulate-grad hooks out of the garbage collector's sight; a hook that
    held its handle would keep every deleted model (and its unsharded buffers) alive."""
    for stage, mixed in [(1, False), (2, True), (3, False)]:
        for r in run_on_ranks(2, on_ranks_freed, stage, mixed):
            assert r["of"] > 1 and r["alive"] == 0, (stage, mixed, r)


# ---- slow reduce-scatters: bounded where safe, never a hang ------------------------------------


def on_ranks_slow_reductions(aux_graph: bool, steps: int, max_unsharded: int = 2, pairwise: bool = True, slowed: bool = False) -> dict:
    """Every reduce-scatter looks unfinished whenever the schedule polls it (a slow network), so
    only the bound's waits retire them before the end of backward. Records how many were in
    flight after each one started, and the count exchanges of each step.

    ``pairwise``: every data collective is pairwise sends and receives (the harness's setting),
    whose receives tell when the peers started a reduce-scatter; else torch's gloo collectives,
    where the count exchange beside every scheduled unit tells. ``slowed``: each block's backward
    first waits (up to 2 s) until the peers' parts of every reduce-scatter in flight have landed,
    as on a network slower than compute."""
    from shardwrap import ShardedModule, collectives
    from shardwrap.unit import Unit

    polled, start = Unit.reduce_completed, ShardedModule._start_reduction
    thresholds = collectives.PAIRWISE_MIN_BYTES, collectives.PIECES_MIN_BYTES
    in_flight: list[int] = []
    counts: list[int] = []

    def recording_start(self, unit):
        start(self, unit)
        in_flight.append(len(self.schedule._in_flight))

    Unit.reduce_completed = lambda self: False
    ShardedModule._start_reduction = recording_start
    if not pairwise:
        collectives.PAIRWISE_MIN_BYTES = collectives.PIECES_MIN_BYTES = 1 << 40
    try:
        torch.manual_seed(0)
        net = AuxNet() if aux_graph else models.MLP(dim=16, depth=6)
        if slowed:
            def landed(grad):
                deadline = time.monotonic() + 2
                while time.monotonic() < deadline and not all(u.reduce_started_everywhere() for _, u in model.schedule._in_flight):
                    time.sleep(0.005)

            def slow_backward(module, args, out):
                out.register_hook(landed)

            for block in net.modules():
                if isinstance(block, models.Block):
                    block.register_forward_hook(slow_backward)
        model = ShardedModule(net, auto_wrap_policy={models.Block}, max_unsharded=max_unsharded)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(steps):
            batch = global_batch(Case("mlp"), step)
            x, y = batch["x"].chunk(world)[rank], batch["y"].chunk(world)[rank]
            with collectives.count_collectives() as counted:
                loss = aux_loss(model, x, y, rank, step) if aux_graph else ((model(x) - y) ** 2).mean()
                loss.backward()
            counts.append(counted["counts_calls"])
            opt.step()
            opt.zero_grad()
    finally:
        Unit.reduce_completed, ShardedModule._start_reduction = polled, start
        collectives.PAIRWISE_MIN_BYTES, collectives.PIECES_MIN_BYTES = thresholds
    return {"in_flight": in_flight, "counts": counts, "state": model.full_state_dict()}


@pytest.mark.parametrize("pairwise", [True, False])
def test_slow_reduce_scatters_are_bounded_when_every_rank_started_them(pairwise):
    """Same graphs on every rank: at most one reduce-scatter (one packed unit gradient) stays in
    flight until the last two units of the backward, and training matches the single-process
    reference. Without the bound all seven units' reduce-scatters would be in flight at the end.

    Pairwise, a rank learns that its peers started a reduce-scatter when their parts of it land,
    and nothing else is exchanged beyond the one count exchange at the backward's start; each
    block's backward waits until they have landed, so that the next one starts after that. Otherwise a count
    exchange beside each of the seven scheduled units tells (waited for in order)."""
    steps = 2
    torch.manual_seed(0)
    reference = models.MLP(dim=16, depth=6)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        batch = global_batch(Case("mlp"), step)
        ((reference(batch["x"]) - batch["y"]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    ranks = run_on_ranks(2, on_ranks_slow_reductions, False, steps, 2, pairwise, pairwise, timeout=60)
    for r in ranks:
        per_step = [r["in_flight"][i : i + 7] for i in range(0, 7 * steps, 7)]
        assert len(r["in_flight"]) == 7 * steps, r["in_flight"]
        # the counts each rank learns lag by up to two units, so the last two may pile up
        assert all(max(s[:5]) == 1 and max(s) <= 3 for s in per_step), r["in_flight"]
        assert r["counts"] == [1 if pairwise else 7] * steps, r["counts"]
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("pairwise", [True, False])
@pytest.mark.parametrize("max_unsharded", [1, 2])
def test_slow_reduce_scatters_with_graphs_that_differ_neither_hang_nor_desync(max_unsharded, pairwise):
    """The aux head that one rank's loss skips defers reduce-scatters on the others; the bound must
    not wait for those and the result must still match the reference. Without prefetch, rank 0
    waiting for aux's reduce-scatter would hold back the stem's all-gather the others need to
    reach the end of backward, where they start it: a deadlock. Pairwise, the receives of aux's
    reduce-scatter from the rank that deferred it have not landed, so nothing waits for it."""
    world, steps = 3, 4
    expected = aux_reference(world, steps)
    full = run_on_ranks(world, on_ranks_slow_reductions, True, steps, max_unsharded, pairwise, timeout=60)[0]["state"]
    for k, v in expected.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


# ---- checked transitions -------------------------------------------------------------------------


def on_ranks_wrong_transitions() -> list[str]:
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(models.mlp(8, 2), auto_wrap_policy={models.Block})
    unit = model.units[1]
    messages = []
    for wrong in (unit.finish_grad, unit.pack_grad, unit._install_unsharded_views):
        try:
            wrong()
        except RuntimeError as exc:
            messages.append(str(exc))
    # the unit is still usable: a step trains as usual
    model(torch.randn(4, 8)).sum().backward()
    messages.append(str(all(p.grad is not None for p in model.parameters())))
    return messages


def test_a_wrong_transition_names_rank_unit_and_states():
    for rank, messages in enumerate(run_on_ranks(2, on_ranks_wrong_transitions)):
        finish, pack, views, trained = messages
        assert f"rank {rank}: unit 'blocks.0' cannot finish its reduce-scatter" in finish
        assert "GradState is NONE, expected IN_FLIGHT" in finish
        assert "GradState is NONE, expected ACCUMULATING or PACKED" in pack
        assert "DataState is SHARDED, expected UNSHARDED" in views
        assert trained == "True"


def test_stage_switches_are_checked_and_usable_directly():
    from shardwrap import Stage

    assert Stage.of(1) == Stage(False, False, keep_unsharded_grad=True)
    assert Stage.of(3) == Stage(True, True)
    with pytest.raises(ValueError, match="reshard_after_backward=False"):
        Stage(reshard_after_forward=True, reshard_after_backward=False)
    with pytest.raises(ValueError, match="keep_unsharded_grad=True"):
        Stage(False, True, keep_unsharded_grad=True)
    with pytest.raises(ValueError, match="stage=4"):
        Stage.of(4)
    # Stage 2 that keeps its parameters unsharded between steps: parity with one process.
    check_parity(Case("mlp", {"dim": 16, "depth": 3}, policy="Block", stage=Stage(False, False)), 2)


# ---- a second run in the same process --------------------------------------------------------


def on_ranks_two_runs(case: Case, path: str) -> list[dict]:
    """Each run in a new default group (``destroy_process_group``, then ``init_process_group``, as
    a notebook or a hyperparameter search does): train the case, then save a checkpoint in the
    background (its own gloo group) and load it into a fresh model."""
    from datetime import timedelta

    from parity import _train_sharded
    from shardwrap import load_checkpoint, save_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    runs = []
    for i in range(2):
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{path}-rendezvous-{i}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        result = _train_sharded(case)
        saved = wrap(case)
        save_checkpoint(f"{path}-{i}", saved, blocking=False).result()  # raises what the save raised
        loaded = wrap(case)
        with torch.no_grad():
            for p in loaded.parameters():
                p.zero_()
        load_checkpoint(f"{path}-{i}", loaded)
        result["reloaded"] = [torch.equal(a.to_local(), b.to_local()) for a, b in zip(saved.parameters(), loaded.parameters())]
        runs.append(result)
    return runs


@pytest.mark.parametrize("stage,optim,mesh", [(3, "sgd", None), (2, "adamw", None), (3, "sgd", (2, 2))])
def test_a_second_run_after_a_new_process_group_trains_like_the_first(stage, optim, mesh, tmp_path):
    """shardwrap's own groups (reduce-scatters, hybrid sharding's rows, background saves) are
    remade under a new default group."""
    import harness
    from parity import compare, train_reference

    case = Case("mlp", {"dim": 16, "depth": 3}, policy="Block", stage=stage, optim=optim, mesh=mesh)
    world = 4 if mesh else 2
    reference = train_reference(case)
    timeout = 59.0  # a pool of its own: its process group is replaced
    try:
        results = run_on_ranks(world, on_ranks_two_runs, case, str(tmp_path / "ckpt"), pg_timeout=timeout, timeout=180)
    finally:
        harness._drop((world, timeout), kill=False)
    for run in range(2):
        compare(case, world, [r[run] for r in results], reference)
        assert all(all(r[run]["reloaded"]) and r[run]["reloaded"] for r in results)


# ---- several wrapped models in one program -----------------------------------------------------


def _gan_step_losses(G: nn.Module, D: nn.Module, ref: nn.Module, x: torch.Tensor) -> tuple[Any, Any]:
    """A discriminator loss (on the generator's detached output, against a frozen reference
    model's output under no_grad, as DPO's reference model runs) and a generator loss through D."""
    with torch.no_grad():
        target = ref(x)
    d_loss = (D(G(x).detach()) - target).pow(2).mean()
    return d_loss, lambda: D(G(x)).pow(2).mean() + G(x).mean()


def train_gan(G: nn.Module, D: nn.Module, ref: nn.Module, optim: str, chunk: tuple[int, int] | None) -> None:
    """Three steps, alternating: D's step (G's gradients cleared after it), then G's step through D
    (D's gradients cleared). ``chunk=(W, rank)``: this rank's part of each global batch."""
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[optim]
    opt_g, opt_d = make(G.parameters()), make(D.parameters())
    for step in range(3):
        x = torch.randn(12, 16, generator=torch.Generator().manual_seed(step))
        x = x.chunk(chunk[0])[chunk[1]] if chunk else x
        d_loss, g_loss = _gan_step_losses(G, D, ref, x)
        d_loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        opt_g.zero_grad()
        g_loss().backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()


def gan_models() -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    return models.mlp(16, 3, out=16), models.mlp(16, 2, out=1), models.mlp(16, 2, out=1)


def on_ranks_gan(stage: int, optim: str) -> dict:
    from shardwrap import ShardedModule

    G, D, ref = (ShardedModule(m, auto_wrap_policy={models.Block}, stage=stage) for m in gan_models())
    train_gan(G, D, ref, optim, (dist.get_world_size(), dist.get_rank()))
    return {"G": G.full_state_dict(), "D": D.full_state_dict()}


@pytest.mark.parametrize("stage,optim", [(1, "sgd"), (2, "adamw"), (3, "sgd"), (3, "adamw")])
def test_three_wrapped_models_train_like_one_process(stage, optim):
    """A generator, a discriminator and a frozen reference model, each its own ShardedModule on
    the same ranks, used in alternation (each one's collectives interleave with the others')."""
    from parity import assert_close_params

    G, D, ref = gan_models()
    train_gan(G, D, ref, optim, None)
    full = run_on_ranks(2, on_ranks_gan, stage, optim)[0]
    for label, plain in (("G", G), ("D", D)):
        for name, value in plain.state_dict().items():
            assert_close_params(full[label][name], value, optim, 3, f"{label} '{name}'", None)
