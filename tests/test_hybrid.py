"""Hybrid sharding on a 2-D (replicate, shard) mesh (design/notes/hybrid-sharding.md).

4 CPU ranks as 2x2, 1x4 and 4x1, and hypothesis over meshes up to 4 ranks: parity with the unwrapped
model on the whole global batch (SGD with momentum and AdamW), torch's and shardwrap's clipping,
per-rank model state, the collectives counted per axis against the formula, full state dicts, and
checkpoints resharded 2x2 -> 1x2 -> 4 through DCP.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard

from harness import run_on_ranks
from parity import Case, build_model, check_parity, compare, global_batch, hybrid_mesh, loss_fn, placed_params, resolve_policy, train_reference
from test_checkpoint import make, train
from test_torch_apis import on_ranks_resume, on_ranks_save

MLP = Case("mlp", {"dim": 16, "depth": 3}, policy="Block")
GPT2 = Case("gpt2", {"n_layer": 2}, policy="GPT2Block", data="lm", seq=8)


def case(base: Case = MLP, **changes) -> Case:
    return Case(**{**base.__dict__, **changes})


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_on_a_2x2_mesh(stage, optim):
    check_parity(case(stage=stage, optim=optim, mesh=(2, 2)), 4)


@pytest.mark.parametrize("mesh", [(1, 4), (4, 1)])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_parity_on_degenerate_meshes(mesh, optim):
    check_parity(case(stage=3, optim=optim, mesh=mesh), 4)


@pytest.mark.parametrize("clip_api", ["shardwrap", "torch"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clipping_gives_the_single_process_norm(clip_api, norm_type):
    check_parity(case(stage=3, clip=0.05, clip_api=clip_api, norm_type=norm_type, mesh=(2, 2)), 4)


def test_gpt2_with_a_replicated_parameter_and_torch_clipping():
    check_parity(case(GPT2, stage=3, optim="adamw", clip=0.3, clip_api="torch", mesh=(2, 2)), 4)
    check_parity(Case("scaled", policy="Block", clip=0.05, clip_api="torch", mesh=(2, 2)), 4)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    mesh=st.sampled_from([(1, 2), (2, 1), (1, 3), (3, 1), (2, 2)]),
    stage=st.sampled_from([2, 3]),
    depth=st.integers(1, 3),
    dim=st.sampled_from([5, 8, 13]),
)
def test_parity_on_generated_small_meshes(mesh, stage, depth, dim):
    check_parity(case(build_kwargs={"dim": dim, "depth": depth}, dim=dim, stage=stage, mesh=mesh), mesh[0] * mesh[1])


# ---- placements, memory and communication -------------------------------------------------------


def on_ranks_step_counts(c: Case) -> dict:
    from shardwrap.collectives import count_collectives
    from shardwrap.memory import model_state_bytes

    model, opt = make(c)
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = {k: v.chunk(world)[rank] for k, v in global_batch(c, 0).items()}
    with count_collectives() as counted:
        loss_fn(c, model, batch).backward()
    opt.step()
    params = list(model.parameters())
    psi = sum(p.numel() for p in params)
    return {
        "counts": dict(counted),
        "placements": sorted({str(p.placements) for p in params}),
        "meshes": {tuple(p.device_mesh.shape) for p in params},
        "state_bytes": model_state_bytes(model, opt),
        "psi": psi,
        "units": [(u.layout.shard_numel, u.layout.grad_shard_numel, u.layout.num_trainable) for u in model.units],
        "shard_size": model.shard_size,
        "replicate_size": model.replicate_size,
    }


def test_placements_memory_and_collectives_per_axis():
    """On 2x2: parameters are (Replicate(), Shard(0)) DTensors on the 2-D mesh; every rank holds
    the model state of a 1-D run at S (16 bytes per parameter / S, plus padding); the all-gathers
    and reduce-scatters are exactly a 1-D run's at S, and each unit's reduced shard (and its
    used-flags, one per trainable parameter) is all-reduced over the replicate axis once."""
    c = case(stage=3, optim="adamw", mesh=(2, 2))
    hybrid = run_on_ranks(4, on_ranks_step_counts, c)
    flat = run_on_ranks(2, on_ranks_step_counts, case(stage=3, optim="adamw"))
    for r in hybrid:
        assert r["placements"] == [str((Replicate(), Shard(0)))], r["placements"]
        assert r["meshes"] == {(2, 2)}
        assert (r["shard_size"], r["replicate_size"]) == (2, 2)
        assert r["units"] == flat[0]["units"], "a unit on 2x2 is the unit of a 1-D run at S=2"
        assert r["state_bytes"] == flat[r_place(r, hybrid)]["state_bytes"]
        total = sum(r["state_bytes"][k] for k in ("params", "grads", "optim"))
        formula = 16 * r["psi"] / r["shard_size"]  # fp32 AdamW: 4 + 4 + 8 bytes per parameter, / S
        assert abs(total - formula) <= 0.05 * formula, (total, formula)  # uneven chunks and padding only
        counts = r["counts"]
        for kind in ("all_gather", "reduce_scatter", "all_gather_calls", "reduce_scatter_calls"):
            assert counts.get(kind, 0) == flat[0]["counts"].get(kind, 0), kind
        assert counts["replicate_all_reduce"] == sum(g + k for _, g, k in r["units"] if g > 0)
        assert counts["replicate_all_reduce_calls"] == sum(1 for _, g, _ in r["units"] if g > 0)
        assert "replicate_all_reduce" not in flat[0]["counts"]


def r_place(r: dict, results: list[dict]) -> int:
    return results.index(r) % 2  # rank = replica * S + shard place


# ---- state dicts and checkpoints ----------------------------------------------------------------


def on_ranks_full(c: Case, sd: dict) -> dict:
    model, opt = make(c)
    model.load_full_state_dict(sd if dist.get_rank() == 0 else {})
    return {"full": model.full_state_dict(rank0_only=False), "local": {n: p.detach().to_local().clone() for n, p in model.named_parameters()}}


def test_full_state_dict_round_trip_reaches_every_replica():
    c = case(stage=3, mesh=(2, 2))
    torch.manual_seed(1)
    sd = {k: torch.randn_like(v) for k, v in build_model(c).state_dict().items()}
    results = run_on_ranks(4, on_ranks_full, c, sd)
    for rank, r in enumerate(results):
        for k, v in sd.items():
            torch.testing.assert_close(r["full"][k], v, rtol=0, atol=0)
            chunk = v.chunk(2)[rank % 2] if v.dim() else v
            torch.testing.assert_close(r["local"][k], chunk, rtol=0, atol=0)


def on_ranks_replica_files(c: Case, path: str) -> dict:
    """The first replica writes its ranks' sharded state dicts (the second holds the same shards);
    every rank loads the file of its own shard place, then the other place's."""
    model, opt = make(c)
    rank = dist.get_rank()
    replica, place = divmod(rank, 2)
    if replica == 0:
        torch.save(model.state_dict(), f"{path}.{place}")
    dist.barrier()
    before = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    model.load_state_dict(torch.load(f"{path}.{place}", weights_only=True))
    same = all(torch.equal(p.detach().to_local(), before[n]) for n, p in model.named_parameters())
    try:
        model.load_state_dict(torch.load(f"{path}.{1 - place}", weights_only=True))
        other = "no error"
    except ValueError as exc:
        other = str(exc)
    return {"same": same, "other": other}


def test_one_replicas_sharded_files_load_on_every_replica(tmp_path):
    # the check that refuses another rank's shards compares the sharded mesh dimension only: the
    # replicas of a hybrid mesh hold the same shards (it refused them on ranks 2 and 3, a review)
    for r in run_on_ranks(4, on_ranks_replica_files, case(stage=3, mesh=(2, 2)), str(tmp_path / "sd")):
        assert r["same"], r
        assert "shards, loaded on rank" in r["other"], r


def on_ranks_shardwrap_save(c: Case, path: str, steps: range) -> None:
    from shardwrap import save_checkpoint

    model, opt = make(c)
    train(c, model, opt, steps)
    save_checkpoint(path, model, opt)


def on_ranks_shardwrap_resume(c: Case, path: str, steps: range, save_to: str | None) -> dict:
    from shardwrap import load_checkpoint, save_checkpoint

    model, opt = make(c)
    load_checkpoint(path, model, opt)
    train(c, model, opt, steps)
    if save_to:
        save_checkpoint(save_to, model, opt)
    return {
        "full": model.full_state_dict(),
        **placed_params(c, model),
        "losses": [0.0] * c.steps,
        "norms": [],
    }


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_checkpoint_reshards_2x2_to_1x2_to_4(optim, tmp_path):
    """shardwrap's save_checkpoint at 2x2 after 2 steps, resumed at 1x2 for one step and saved
    again, resumed 1-D at W=4 to the end: the uninterrupted single-process trajectory."""
    run = case(stage=3, optim=optim, steps=4)
    expected, _, _ = train_reference(run)
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    run_on_ranks(4, on_ranks_shardwrap_save, case(run, mesh=(2, 2)), first, range(0, 2))
    mid = case(run, mesh=(1, 2))
    run_on_ranks(2, on_ranks_shardwrap_resume, mid, first, range(2, 3), second)
    results = run_on_ranks(4, on_ranks_shardwrap_resume, run, second, range(3, 4), None)
    compare(run, 4, results, reference=(expected, [], []))


def test_checkpoint_resumes_on_a_2x2_mesh(tmp_path):
    """Saved 1-D at W=4, resumed at 2x2: the second replica's ranks read the same rows as the first
    replica's (its optimizer-state templates once took their rows from the world rank)."""
    run = case(stage=3, optim="adamw", steps=3)
    expected, _, _ = train_reference(run)
    path = str(tmp_path / "a")
    run_on_ranks(4, on_ranks_shardwrap_save, run, path, range(0, 2))
    hybrid = case(run, mesh=(2, 2))
    compare(hybrid, 4, run_on_ranks(4, on_ranks_shardwrap_resume, hybrid, path, range(2, 3), None), reference=(expected, [], []))


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_torch_get_state_dict_from_2x2_resumes_1d(optim, tmp_path):
    """torch's get_state_dict + dcp.save on 2x2, dcp.load + set_state_dict on 1-D W=2 and on 1x2."""
    run = case(stage=2, optim=optim, steps=4)
    expected, _, _ = train_reference(run)
    path = str(tmp_path / "ckpt")
    keys = run_on_ranks(4, on_ranks_save, case(run, mesh=(2, 2)), path, 2, False)[0]
    assert keys == list(build_model(run).state_dict())
    compare(run, 2, run_on_ranks(2, on_ranks_resume, run, path, 2, False), reference=(expected, [], []))
    hybrid = case(run, mesh=(1, 2))
    compare(hybrid, 2, run_on_ranks(2, on_ranks_resume, hybrid, path, 2, False), reference=(expected, [], []))


# ---- bad meshes ---------------------------------------------------------------------------------


def on_ranks_bad_mesh(kind: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from shardwrap import ShardedModule

    from torch.distributed.device_mesh import DeviceMesh

    if kind == "3d":
        mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    elif kind == "names":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    elif kind == "part":
        mesh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh("cpu", (2, 2))
    try:
        ShardedModule(build_model(MLP), auto_wrap_policy=resolve_policy(MLP), mesh=mesh)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "kind,words",
    [
        ("3d", ["2-D (replicate, shard)", "mesh['replicate', 'shard']"]),
        ("unnamed", ["mesh_dim_names"]),
        ("names", ["axis 0 of the 2-D mesh is named 'dp'", "mesh=mesh['dp']"]),
        ("part", ["mesh has 2 ranks but the default process group has 4", "over every rank"]),
    ],
)
def test_bad_meshes_are_refused_with_the_call_to_make(kind, words):
    for message in run_on_ranks(4, on_ranks_bad_mesh, kind):
        assert all(w in message for w in words), message


def on_ranks_one_shard_warning(shape: tuple[int, int], stage: int) -> list[str]:
    import warnings

    from shardwrap import ShardedModule

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ShardedModule(build_model(MLP), auto_wrap_policy=resolve_policy(MLP), mesh=hybrid_mesh(shape), stage=stage)
    return [str(w.message) for w in caught if "shard axis" in str(w.message)]


def test_a_shard_axis_of_one_rank_at_stage_3_warns_that_it_is_ddp():
    for messages in run_on_ranks(4, on_ranks_one_shard_warning, (4, 1), 3):
        assert len(messages) == 1 and "'shard'" in messages[0] and "this is DDP" in messages[0], messages
    for messages in run_on_ranks(4, on_ranks_one_shard_warning, (4, 1), 1):
        assert messages == [], messages  # stage 1 keeps the model unsharded: nothing to warn about
    for messages in run_on_ranks(4, on_ranks_one_shard_warning, (2, 2), 3):
        assert messages == [], messages


def on_ranks_overlap(c: Case) -> dict:
    from shardwrap.collectives import count_collectives

    model, _ = make(c)
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = {k: v.chunk(world)[rank] for k, v in global_batch(c, 0).items()}
    seen: list[int] = []
    finish = model._finish_backward

    held: list[int] = []

    def at_end_of_backward() -> None:
        seen.append(counted["replicate_all_reduce_calls"])
        # a unit whose reduce-scatter finished waits for its all-reduce holding only its shard
        held.append(sum(1 for u in model.units if u._reduction is not None and u._reduction.shard_done and u._reduction.input is not None))
        finish()

    model._finish_backward = at_end_of_backward
    with count_collectives() as counted:
        loss_fn(c, model, batch).backward()
    return {"before_end": seen, "held": held, "total": counted["replicate_all_reduce_calls"], "units": len(model.units)}


def test_replica_all_reduces_start_while_backward_runs():
    """The all-reduces over replicas are not all left to the end of backward: with one
    reduce-scatter in flight at most, each older unit's is started as soon as its turn comes."""
    for r in run_on_ranks(4, on_ranks_overlap, case(build_kwargs={"dim": 16, "depth": 5}, stage=3, mesh=(2, 2))):
        assert r["total"] == r["units"], r
        assert r["before_end"] and r["before_end"][0] >= 1, r
        assert r["held"] == [0], "a full unit gradient is kept while its all-reduce over replicas waits"
