"""Checkpoints: full and sharded state dicts for model and optimizer, DCP round trips across world
sizes, resume exactness, conversion to a plain torch checkpoint, and safety under faults."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import models
from harness import RankError, run_on_ranks
from parity import Case, build_model, build_optimizer, data_place, global_batch, loss_fn, resolve_policy, wrap

GPT2 = Case("gpt2", {"n_layer": 2}, policy="GPT2Block", data="lm", seq=8, optim="adamw")
MLP = Case("mlp", {"dim": 16, "depth": 3}, policy="Block")


def make(case: Case):
    model = wrap(case)
    return model, build_optimizer(case, model)


def train(case: Case, model, opt, steps: range) -> None:
    chunks, mine = data_place(case)
    for step in steps:
        batch = {k: v.chunk(chunks)[mine] for k, v in global_batch(case, step).items()}
        loss_fn(case, model, batch).backward()
        opt.step()
        opt.zero_grad()


# ---- full model state dict -----------------------------------------------------------------------


def on_ranks_full_round_trip(case: Case, sd: dict) -> dict:
    from shardwrap.collectives import count_collectives

    model, _ = make(case)
    model.load_full_state_dict(sd if dist.get_rank() == 0 else {})
    with count_collectives() as counted:
        sharded = model.state_dict()
    views = all(
        v.to_local().untyped_storage().data_ptr() == p.to_local().untyped_storage().data_ptr()
        for (k, v), (n, p) in zip(((k, sharded[k]) for k, _ in model.named_parameters()), model.named_parameters())
    )
    bad = dict(sd) if dist.get_rank() == 0 else {}
    if bad:
        bad.pop("transformer.h.0.attn.c_attn.weight")
        bad["transformer.h.1.mlp.c_fc.bias"] = torch.zeros(3)
        bad["not.a.key"] = torch.zeros(1)
    before = model.full_state_dict(rank0_only=False)
    try:
        model.load_full_state_dict(bad)
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    after = model.full_state_dict(rank0_only=False)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {"full": model.full_state_dict(), "collectives": dict(counted), "views": views, "error": error, "unchanged": unchanged}


def test_full_state_dict_round_trip_and_one_error_for_every_problem():
    torch.manual_seed(5)
    plain = models.gpt2(n_layer=2)  # other values than the ranks' seed-0 build
    sd = plain.state_dict()
    results = run_on_ranks(3, on_ranks_full_round_trip, GPT2, sd)
    full = results[0]["full"]
    assert list(full) == list(sd)
    for k, v in sd.items():
        assert torch.equal(full[k], v), k
    fresh = models.gpt2(n_layer=2)
    fresh.load_state_dict(full, strict=True)  # loads into the unwrapped model
    for r in results:
        assert r["collectives"] == {} and r["views"], r["collectives"]
        for fragment in ["missing keys ['transformer.h.0.attn.c_attn.weight']", "unexpected keys ['not.a.key']",
                         "shape mismatch for 'transformer.h.1.mlp.c_fc.bias': checkpoint (3,) vs model (128,)"]:
            assert fragment in r["error"], r["error"]
        assert r["unchanged"]


def on_ranks_load_sharded_and_full(case: Case, full: dict) -> bool:
    model, _ = make(case)
    source, _ = make(Case(**{**case.__dict__, "seed": 9}))
    model.load_state_dict(source.state_dict())  # DTensors
    a = model.full_state_dict(rank0_only=False)
    b = source.full_state_dict(rank0_only=False)
    model.load_state_dict(full)  # full tensors on every rank
    c = model.full_state_dict(rank0_only=False)
    return all(torch.equal(a[k], b[k]) for k in a) and all(torch.equal(c[k], full[k]) for k in c)


def test_load_state_dict_accepts_dtensors_and_full_tensors():
    torch.manual_seed(3)
    full = build_model(Case(**{**MLP.__dict__, "seed": 3})).state_dict()
    assert all(run_on_ranks(3, on_ranks_load_sharded_and_full, MLP, full))


# ---- DCP across world sizes, export, optimizer state ------------------------------------------------


def on_ranks_save(case: Case, path: str, steps: int) -> dict:
    from shardwrap import save_checkpoint

    model, opt = make(case)
    train(case, model, opt, range(steps))
    save_checkpoint(path, model, opt)
    return {"full": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}


def on_ranks_load_and_continue(case: Case, path: str, start: int, stop: int) -> dict:
    from shardwrap import load_checkpoint

    model, opt = make(case)
    load_checkpoint(path, model, opt)
    loaded = {"full": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}
    train(case, model, opt, range(start, stop))
    return {"loaded": loaded, "full": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}


def on_ranks_uninterrupted(case: Case, steps: int) -> dict:
    model, opt = make(case)
    train(case, model, opt, range(steps))
    return {"full": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}


def assert_states(a: dict, b: dict, tol: float, what: str) -> None:
    for k in a["full"]:
        if tol == 0:
            assert torch.equal(a["full"][k], b["full"][k]), f"{what}: '{k}' differs"
        else:
            torch.testing.assert_close(a["full"][k], b["full"][k], rtol=tol, atol=tol, msg=lambda m: f"{what} '{k}': {m}")
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    for idx, entry in a["optim"]["state"].items():
        for key, value in entry.items():
            other = b["optim"]["state"][idx][key]
            if tol == 0:
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), f"{what}: state {idx}.{key}"
            else:
                torch.testing.assert_close(torch.as_tensor(value), torch.as_tensor(other), rtol=tol, atol=tol)


def test_dcp_saved_at_4_loads_exactly_at_2_and_3_and_exports(tmp_path):
    from shardwrap import export_to_torch_save

    case = Case(**{**GPT2.__dict__, "steps": 2})
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(4, on_ranks_save, case, path, 2)[0]
    for world in (2, 3):
        loaded = run_on_ranks(world, on_ranks_load_and_continue, case, path, 0, 0)[0]["loaded"]
        assert_states(saved, loaded, 0, f"W=4 -> W={world}")
    # The full optimizer state dict has the structure of a plain optimizer's on the unwrapped model.
    plain = build_model(case)
    plain_opt = build_optimizer(case, plain)
    plain.load_state_dict(saved["full"])
    plain_opt.load_state_dict(saved["optim"])
    reference = plain_opt.state_dict()
    assert [g["params"] for g in reference["param_groups"]] == [g["params"] for g in saved["optim"]["param_groups"]]
    ordered = [p for group in plain_opt.param_groups for p in group["params"]]
    for idx, entry in reference["state"].items():
        assert set(entry) == set(saved["optim"]["state"][idx])
        assert entry["exp_avg"].shape == ordered[idx].shape
    # One torch.save file that loads into the unwrapped model.
    out = str(tmp_path / "export.pt")
    export_to_torch_save(path, out)
    exported = torch.load(out, weights_only=True)
    # It carries the checksum load_full verifies, matching what torch.load gives back.
    from shardwrap.checkpoint import CHECKSUM_KEY, content_digest

    assert exported.pop(CHECKSUM_KEY) == content_digest(exported)
    unwrapped = build_model(case)
    unwrapped.load_state_dict(exported["model"], strict=True)
    for k, v in saved["full"].items():
        assert torch.equal(unwrapped.state_dict()[k], v), k


# ---- resume exactness ------------------------------------------------------------------------------


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_in_new_processes_is_bit_exact(tmp_path, stage, optim):
    case = Case(**{**MLP.__dict__, "stage": stage, "optim": optim})
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, on_ranks_save, case, path, 3)
    resumed = run_on_ranks(2, on_ranks_load_and_continue, case, path, 3, 6, fresh=True)[0]
    straight = run_on_ranks(2, on_ranks_uninterrupted, case, 6)[0]
    assert_states(resumed, straight, 0, "resume")


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_after_resharding_4_to_2(tmp_path, stage, optim):
    case = Case(**{**MLP.__dict__, "optim": optim, "stage": stage})
    path = str(tmp_path / "ckpt")
    run_on_ranks(4, on_ranks_save, case, path, 3)
    resumed = run_on_ranks(2, on_ranks_load_and_continue, case, path, 3, 6)[0]
    straight = run_on_ranks(2, on_ranks_uninterrupted, case, 6)[0]
    assert_states(resumed, straight, 1e-6, "W=4 -> W=2")


def on_ranks_save_full(case: Case, path: str, steps: int) -> None:
    from shardwrap import save_full

    model, opt = make(case)
    train(case, model, opt, range(steps))
    save_full(path, model, opt)


def on_ranks_load_full_and_continue(case: Case, path: str, start: int, stop: int) -> dict:
    from shardwrap import load_full

    model, opt = make(case)
    load_full(path, model, opt)
    train(case, model, opt, range(start, stop))
    return {"full": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_through_full_state_dicts_at_another_world_size(tmp_path, stage, optim):
    case = Case(**{**MLP.__dict__, "optim": optim, "stage": stage})
    path = str(tmp_path / "full.pt")
    run_on_ranks(3, on_ranks_save_full, case, path, 3)
    resumed = run_on_ranks(2, on_ranks_load_full_and_continue, case, path, 3, 6)[0]
    straight = run_on_ranks(2, on_ranks_uninterrupted, case, 6)[0]
    assert_states(resumed, straight, 1e-6, "full route")


def on_ranks_param_groups_by_name(path: str) -> bool:
    from shardwrap import ShardedModule, load_checkpoint, save_checkpoint

    def build():
        torch.manual_seed(0)
        model = ShardedModule(models.mlp(16, 2), auto_wrap_policy={models.Block})
        named = list(model.named_parameters())
        opt = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if "bias" not in n and "norm" not in n], "weight_decay": 0.1, "lr": 1e-2},
                {"params": [p for n, p in named if "bias" in n or "norm" in n], "weight_decay": 0.0, "lr": 3e-3},
            ]
        )
        return model, opt

    model, opt = build()
    train(MLP, model, opt, range(2))
    save_checkpoint(path, model, opt)
    other, other_opt = build()
    load_checkpoint(path, other, other_opt)
    a, b = opt.state_dict(), other_opt.state_dict()
    same_groups = a["param_groups"] == b["param_groups"]
    same_state = all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    return same_groups and same_state


def test_param_groups_chosen_by_name_survive_the_round_trip(tmp_path):
    assert all(run_on_ranks(2, on_ranks_param_groups_by_name, str(tmp_path / "ckpt")))


# ---- safety and faults ---------------------------------------------------------------------------


def on_ranks_faults(path: str, other_path: str) -> dict:
    import shardwrap.checkpoint as ckpt
    from shardwrap import load_checkpoint, load_full, save_checkpoint, save_full

    model, opt = make(MLP)
    train(MLP, model, opt, range(2))
    save_checkpoint(path, model, opt)
    good = model.full_state_dict(rank0_only=False)
    train(MLP, model, opt, range(2, 3))

    real_write = ckpt._write

    def dies_halfway(state, tmp, group):
        real_write(state, tmp, group)  # data is written...
        raise KeyboardInterrupt("killed before the rename")  # ...but the save never completes

    ckpt._write = dies_halfway
    try:
        save_checkpoint(path, model, opt)
        killed = False
    except KeyboardInterrupt:
        killed = True
    finally:
        ckpt._write = real_write
    dist.barrier()
    leftovers = [n for n in os.listdir(os.path.dirname(path)) if ".tmp-" in n]
    fresh, fresh_opt = make(MLP)
    load_checkpoint(path, fresh, fresh_opt)  # the previous checkpoint is intact
    previous_ok = all(torch.equal(fresh.full_state_dict(rank0_only=False)[k], v) for k, v in good.items())

    errors = {}
    before = fresh.full_state_dict(rank0_only=False)
    opt_before = {i: {k: v.clone() for k, v in s.items()} for i, s in fresh_opt.state_dict()["state"].items()}

    def unchanged() -> bool:
        after = fresh.full_state_dict(rank0_only=False)
        opt_after = fresh_opt.state_dict()["state"]
        return all(torch.equal(before[k], after[k]) for k in before) and all(
            torch.equal(opt_before[i][k], opt_after[i][k]) for i in opt_before for k in opt_before[i]
        )

    # A checkpoint of a different model.
    from shardwrap import ShardedModule

    different = ShardedModule(models.mlp(8, 1), auto_wrap_policy={models.Block})
    save_checkpoint(other_path, different, torch.optim.SGD(different.parameters(), lr=0.1))
    for name, action in {
        "different_model": lambda: load_checkpoint(other_path, fresh, fresh_opt),
        "missing": lambda: load_checkpoint(path + "-nowhere", fresh, fresh_opt),
    }.items():
        try:
            action()
            errors[name] = ("no error", unchanged())
        except Exception as exc:
            errors[name] = (str(exc), unchanged())
    dist.barrier()
    # Truncate one shard file of the good checkpoint.
    if dist.get_rank() == 0:
        victim = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
        with open(os.path.join(path, victim), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(path, victim)) // 3)
    dist.barrier()
    try:
        load_checkpoint(path, fresh, fresh_opt)
        errors["truncated"] = ("no error", unchanged())
    except Exception as exc:
        errors["truncated"] = (str(exc), unchanged())
    # Full files: corrupted bytes, and a key/shape mismatch.
    full_path = path + ".pt"
    save_full(full_path, fresh, fresh_opt)
    if dist.get_rank() == 0:
        with open(full_path, "r+b") as f:
            f.seek(100)
            f.write(b"\x00garbage\x00" * 8)
    dist.barrier()
    wrong = fresh.full_state_dict()  # a collective: every rank calls it
    for name in ("corrupt_full", "mismatch_full"):
        if name == "mismatch_full" and dist.get_rank() == 0:
            sd = dict(wrong)
            sd["head.weight"] = torch.zeros(2, 2)
            torch.save({"model": sd}, full_path)
        dist.barrier()
        try:
            load_full(full_path, fresh, fresh_opt)
            errors[name] = ("no error", unchanged())
        except Exception as exc:
            errors[name] = (str(exc), unchanged())
    return {"killed": killed, "leftovers": leftovers, "previous_ok": previous_ok, "errors": errors}


def test_saves_are_atomic_and_bad_checkpoints_change_nothing(tmp_path):
    path, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    for r in run_on_ranks(2, on_ranks_faults, path, other, timeout=120):
        assert r["killed"] and r["leftovers"] == [] and r["previous_ok"], r
        expect = {
            "different_model": [other],
            "missing": [path + "-nowhere", ".metadata"],
            "truncated": [path],
            "corrupt_full": [path + ".pt", "could not be read"],
            "mismatch_full": [path + ".pt", "'head.weight'", "(2, 2)"],
        }
        for name, fragments in expect.items():
            message, unchanged = r["errors"][name]
            assert all(f in message for f in fragments), (name, message)
            assert unchanged, f"{name}: the model or optimizer changed"


def on_ranks_one_rank_stopped_in_save(path: str, cases: list[tuple[str, int, str]]) -> list[dict]:
    """For each (point, rank, kind): a save during which ``rank`` alone raises ``kind``
    (KeyboardInterrupt, as a Ctrl-C reaching one process, or RuntimeError) at ``point``. Then
    every rank trains one more step and saves again, and a fresh model loads that save."""
    from shardwrap import checkpoint, load_checkpoint, save_checkpoint

    model, opt = make(MLP)
    train(MLP, model, opt, range(2))
    save_checkpoint(path, model, opt)
    found = []
    for step, (point, rank, kind) in enumerate(cases):
        def stop(reached: str) -> None:
            if reached == point and dist.get_rank() == rank:
                raise {"KeyboardInterrupt": KeyboardInterrupt, "RuntimeError": RuntimeError}[kind]("stopped here")

        checkpoint.fault_point = stop
        try:
            save_checkpoint(path, model, opt)
            raised = "nothing"
        except BaseException as exc:  # what each rank saw
            raised = f"{type(exc).__name__}: {exc}"
        finally:
            checkpoint.fault_point = None
        left = sorted(n for n in os.listdir(os.path.dirname(path)) if ".tmp-" in n)
        train(MLP, model, opt, range(2 + step, 3 + step))  # the ranks are still in step
        save_checkpoint(path, model, opt)
        fresh, fresh_opt = make(MLP)
        load_checkpoint(path, fresh, fresh_opt)
        same = all(torch.equal(v, fresh.full_state_dict(rank0_only=False)[k]) for k, v in model.full_state_dict(rank0_only=False).items())
        found.append({"raised": raised, "tmp_left": left, "resumed": same})
    # A load's steps likewise: an interrupt on rank 1 while it reads the metadata
    real = checkpoint._read_metadata

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        if dist.get_rank() == 1:
            raise KeyboardInterrupt("stopped here")
        return real(*args, **kwargs)

    checkpoint._read_metadata = interrupted
    fresh, fresh_opt = make(MLP)
    try:
        load_checkpoint(path, fresh, fresh_opt)
        raised = "nothing"
    except BaseException as exc:
        raised = f"{type(exc).__name__}: {exc}"
    finally:
        checkpoint._read_metadata = real
    load_checkpoint(path, fresh, fresh_opt)  # the ranks are still in step
    same = all(torch.equal(v, fresh.full_state_dict(rank0_only=False)[k]) for k, v in model.full_state_dict(rank0_only=False).items())
    found.append({"raised": raised, "tmp_left": [], "resumed": same})
    return found


def test_a_save_stopped_on_one_rank_fails_on_every_rank_and_training_goes_on(tmp_path):
    """A failure on one rank between the save's collectives (an interrupt there, the rank's error)
    used to leave the other ranks inside a collective: the interrupted rank removed the temporary
    directory the others were writing into, and its next collective met theirs (SIGABRT)."""
    cases = [
        ("started", 1, "KeyboardInterrupt"), ("writing", 1, "KeyboardInterrupt"), ("written", 0, "KeyboardInterrupt"),
        ("written", 1, "RuntimeError"), ("agreed", 0, "KeyboardInterrupt"), ("moved_old", 0, "RuntimeError"),
    ]
    per_rank = run_on_ranks(2, on_ranks_one_rank_stopped_in_save, str(tmp_path / "ckpt"), cases, timeout=240)
    for r, found in enumerate(per_rank):
        load = found.pop()
        assert load["resumed"], load
        assert load["raised"] == ("KeyboardInterrupt: stopped here" if r == 1 else
                                  "RuntimeError: rank 1 was stopped (KeyboardInterrupt: stopped here); every rank stops here with it"), load
        for (point, rank, kind), got in zip(cases, found):
            assert got["tmp_left"] == [] and got["resumed"], (point, rank, r, got)
            if point == "writing":  # inside DCP's write: DCP gathers the failure itself
                assert got["raised"].startswith("CheckpointException"), (point, r, got)
            elif r == rank and kind == "KeyboardInterrupt":  # the interrupt stays one; errors are agreed
                assert got["raised"] == f"{kind}: stopped here", (point, r, got)
            else:
                assert f"could not be saved (rank {rank}: {kind}: stopped here)" in got["raised"], (point, r, got)


def on_ranks_other_optimizer_kind(path: str, saved_by: str, door: str) -> dict:
    """A checkpoint written with one optimizer class, loaded with another (SGD's groups have no
    betas, AdamW's no momentum): refused, naming the missing option, with the model and the
    optimizer as they were, and the optimizer still able to step."""
    from shardwrap import load_checkpoint, load_full, save_checkpoint, save_full

    def build(kind: str):  # one param group each, so only the kind differs
        model = wrap(MLP)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if kind == "sgd" else torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, opt

    loaded_by = "adamw" if saved_by == "sgd" else "sgd"
    model, opt = build(saved_by)
    train(MLP, model, opt, range(2))
    (save_checkpoint if door == "checkpoint" else save_full)(path, model, opt)
    fresh, fresh_opt = build(loaded_by)
    train(MLP, fresh, fresh_opt, range(1))
    before = fresh.full_state_dict(rank0_only=False)
    opt_before = fresh_opt.state_dict()
    try:
        (load_checkpoint if door == "checkpoint" else load_full)(path, fresh, fresh_opt)
        error = "no error"
    except Exception as exc:
        error = str(exc)
    after, opt_after = fresh.full_state_dict(rank0_only=False), fresh_opt.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before) and opt_after["param_groups"] == opt_before["param_groups"] and all(
        set(opt_after["state"][i]) == set(e) and all(torch.equal(torch.as_tensor(e[k]), torch.as_tensor(opt_after["state"][i][k])) for k in e)
        for i, e in opt_before["state"].items()
    )
    train(MLP, fresh, fresh_opt, range(1, 2))  # it can go on
    return {"error": error, "unchanged": unchanged}


@pytest.mark.parametrize("door", ["checkpoint", "full"])
@pytest.mark.parametrize("saved_by", ["sgd", "adamw"])
def test_a_checkpoint_of_another_optimizer_kind_is_refused_and_changes_nothing(tmp_path, saved_by, door):
    # torch's load_state_dict took an AdamW checkpoint into SGD silently (step() then raised
    # KeyError 'momentum') and failed halfway through with an SGD one into AdamW (KeyError
    # 'step'), the optimizer's groups already SGD's.
    missing = "'betas'" if saved_by == "sgd" else "'momentum'"
    for r in run_on_ranks(2, on_ranks_other_optimizer_kind, str(tmp_path / "ckpt"), saved_by, door):
        assert missing in r["error"] and "another kind of optimizer" in r["error"], r["error"]
        assert r["unchanged"], r


def flip_a_tensor_bit(path: str) -> None:
    """Flip one bit inside the first tensor's bytes of a torch.save file (its zip entries are
    stored uncompressed, and torch.load reads them without checking their CRC)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size >= 8)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = info.header_offset + 30 + name_len + extra_len + 3
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def on_ranks_flipped_full_file(path: str) -> dict:
    from shardwrap import load_full, save_full

    model, opt = make(MLP)
    train(MLP, model, opt, range(2))
    save_full(path, model, opt)
    if dist.get_rank() == 0:
        plain = torch.load(path, weights_only=True)
        flip_a_tensor_bit(path)
        changed = not all(torch.equal(plain["model"][k], v) for k, v in torch.load(path, weights_only=True)["model"].items())
    dist.barrier()
    before = model.full_state_dict(rank0_only=False)
    opt_before = {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}
    try:
        load_full(path, model, opt)
        error = "no error"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    after, opt_after = model.full_state_dict(rank0_only=False), opt.state_dict()["state"]
    unchanged = all(torch.equal(before[k], after[k]) for k in before) and all(
        torch.equal(opt_before[i][k], opt_after[i][k]) for i in opt_before for k in opt_before[i]
    )
    return {"error": error, "unchanged": unchanged, "changed": changed if dist.get_rank() == 0 else True}


def test_a_full_file_with_a_changed_bit_is_refused(tmp_path):
    # save_full records a checksum of its contents; torch.load alone took the flipped file
    # (a weight became 3.6e37) and so did load_full.
    for r in run_on_ranks(2, on_ranks_flipped_full_file, str(tmp_path / "full.pt")):
        assert r["changed"], "the flip did not reach a tensor: the test proves nothing"
        assert r["error"].startswith("DamagedCheckpointError") and "checksum" in r["error"] and "full.pt" in r["error"], r["error"]
        assert r["unchanged"], r


def on_ranks_zero_dim_round_trip(path: str) -> bool:
    from torch.distributed.tensor import DTensor, Replicate

    from shardwrap import load_checkpoint, save_checkpoint

    case = Case("scaled", policy="Block")
    model, opt = make(case)
    train(case, model, opt, range(2))
    sd = model.state_dict()
    replicated = isinstance(sd["temperature"], DTensor) and sd["temperature"].placements == (Replicate(),)
    save_checkpoint(path, model, opt)
    other, other_opt = make(Case(**{**case.__dict__, "seed": 4}))
    load_checkpoint(path, other, other_opt)
    a, b = model.full_state_dict(rank0_only=False), other.full_state_dict(rank0_only=False)
    return replicated and sd["temperature"].shape == () and all(torch.equal(a[k], b[k]) for k in a)


def test_zero_dim_parameters_round_trip(tmp_path):
    assert all(run_on_ranks(3, on_ranks_zero_dim_round_trip, str(tmp_path / "ckpt")))


# ---- a checkpoint saved before the first optimizer step -------------------------------------------


@pytest.mark.parametrize("door", ["checkpoint", "full"])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_step_0_checkpoint_loads_at_the_same_and_another_world_size(tmp_path, optim, door):
    """Saved right after the optimizer was built (no state yet, as torchtitan's step-0 save): it
    loads as a fresh optimizer, and training from it follows the uninterrupted run."""
    case = Case(**{**MLP.__dict__, "optim": optim})
    path = str(tmp_path / "ckpt")
    save, load = (on_ranks_save, on_ranks_load_and_continue) if door == "checkpoint" else (on_ranks_save_full, on_ranks_load_full_and_continue)
    run_on_ranks(2, save, case, path, 0)
    straight = run_on_ranks(2, on_ranks_uninterrupted, case, 4)[0]
    same = run_on_ranks(2, load, case, path, 0, 4, fresh=True)[0]
    assert_states(same, straight, 0, f"{door} step 0, W=2 -> W=2")
    other = run_on_ranks(3, load, case, path, 0, 4)[0]
    assert_states(other, run_on_ranks(3, on_ranks_uninterrupted, case, 4)[0], 0, f"{door} step 0, W=2 -> W=3")


# ---- the state of an optimizer that has not stepped yet -------------------------------------------

# Optimizers whose first step sets state the zero-gradient template step would leave otherwise
# (NAdam's mu_product, Rprop's step_size, ASGD's eta), beside SGD with momentum and AdamW.
FIRST_STEP_KINDS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.05),
}


def on_ranks_state_before_the_first_step(case: Case, kind: str, door: str, path: str, steps: int) -> dict:
    """Four runs of ``steps`` steps: straight; one that takes the optimizer's state through
    ``door`` before training; one that takes it between the first backward and the first step;
    and one that loads the state taken before training into a fresh model and optimizer first."""
    import torch.distributed.checkpoint as dcp

    from shardwrap import load_checkpoint, save_checkpoint

    def fresh(seed: int):
        model = wrap(Case(**{**case.__dict__, "seed": seed}))
        return model, FIRST_STEP_KINDS[kind](model.parameters())

    def take(model, opt, where: str) -> None:
        if door == "checkpoint":
            save_checkpoint(f"{path}/{where}", model, opt)
        else:  # the dict DCP saves, as a user's own save would
            dcp.save({"model": model.state_dict(), "optim": model.sharded_optim_state_dict(opt)}, checkpoint_id=f"{path}/{where}")

    def run(model, opt, *, mid: bool) -> dict:
        chunks, mine = data_place(case)
        for step in range(steps):
            batch = {k: v.chunk(chunks)[mine] for k, v in global_batch(case, step).items()}
            loss_fn(case, model, batch).backward()
            if mid and step == 0:
                take(model, opt, "mid")
            opt.step()
            opt.zero_grad()
        return {"full": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}

    straight = run(*fresh(case.seed), mid=False)
    model, opt = fresh(case.seed)
    take(model, opt, "start")
    at_start = run(model, opt, mid=False)
    in_step = run(*fresh(case.seed), mid=True)
    model, opt = fresh(case.seed + 7)  # other weights, which the load replaces
    if door == "checkpoint":
        load_checkpoint(f"{path}/start", model, opt)
    else:
        state = {"model": model.state_dict(), "optim": model.sharded_optim_state_dict(opt)}  # the template
        dcp.load(state, checkpoint_id=f"{path}/start")
        model.load_state_dict(state["model"])
        model.load_sharded_optim_state_dict(opt, state["optim"])
    resumed = run(model, opt, mid=False)
    return {"straight": straight, "at_start": at_start, "in_step": in_step, "resumed": resumed}


@pytest.mark.parametrize("kind", sorted(FIRST_STEP_KINDS))
@pytest.mark.parametrize("door", ["checkpoint", "sharded_dict"])
def test_the_state_of_an_optimizer_that_has_not_stepped_changes_nothing_and_resumes_exactly(tmp_path, door, kind):
    """Taking it (torchtitan saves at step 0; a save may also fall between a backward and the
    first step) leaves the run as it was, and loading it gives a fresh optimizer's first step."""
    case = Case(**{**MLP.__dict__, "stage": 1 if kind == "sgd" else 3})
    got = run_on_ranks(2, on_ranks_state_before_the_first_step, case, kind, door, str(tmp_path), 3)[0]
    assert_states(got["at_start"], got["straight"], 0, f"{kind} {door}: taken at step 0")
    assert_states(got["in_step"], got["straight"], 0, f"{kind} {door}: taken between the first backward and step")
    assert_states(got["resumed"], got["straight"], 0, f"{kind} {door}: loaded from step 0")


def on_ranks_async_save_and_resume(case: Case, path: str) -> dict:
    """torch's own async save of ``get_state_dict`` (parameters that are views at an offset into
    their unit's shard), loaded with ``set_state_dict`` into a fresh model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = make(case)
    train(case, model, opt, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path).result()
    train(case, model, opt, range(2, 3))
    straight = {"full": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}
    model, opt = make(Case(**{**case.__dict__, "seed": 4}))
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(case, model, opt, range(2, 3))
    return {"straight": straight, "resumed": {"full": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}}


@pytest.mark.parametrize("stage", [1, 3])
def test_torchs_async_save_of_get_state_dict_resumes_on_the_same_trajectory(tmp_path, stage):
    case = Case(**{**MLP.__dict__, "stage": stage, "optim": "adamw"})
    got = run_on_ranks(2, on_ranks_async_save_and_resume, case, str(tmp_path / "ckpt"))[0]
    assert_states(got["resumed"], got["straight"], 0, f"async_save at stage {stage}")


# ---- a save killed at any point leaves a loadable checkpoint ---------------------------------------


def on_ranks_save_killed_at(case: Case, path: str, point: str) -> None:
    """Train on, then save again to ``path``; rank 0 is SIGKILLed when the save reaches ``point``
    (shardwrap.checkpoint.fault_point: a hook, not a timing guess)."""
    import signal

    from shardwrap import checkpoint, save_checkpoint

    model, opt = make(case)
    train(case, model, opt, range(5))

    def die(reached: str) -> None:
        if reached == point and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.fault_point = die
    try:
        save_checkpoint(path, model, opt)
    finally:
        checkpoint.fault_point = None


def on_ranks_load(case: Case, path: str) -> dict:
    import warnings

    from shardwrap import load_checkpoint

    model, opt = make(case)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(path, model, opt)
    return {"full": model.full_state_dict(), "optim": model.full_optim_state_dict(opt), "warnings": [str(w.message) for w in caught]}


@pytest.mark.parametrize("point", ["writing", "written", "agreed", "moved_old"])
def test_a_save_killed_at_any_point_leaves_the_previous_checkpoint_loadable(tmp_path, point):
    from harness import RankTimeout

    path = str(tmp_path / "ckpt")
    first = run_on_ranks(2, on_ranks_save, MLP, path, 3)[0]
    with pytest.raises(RankTimeout, match="died"):
        run_on_ranks(2, on_ranks_save_killed_at, MLP, path, point, timeout=60)
    leftovers = sorted(n.split("-")[0] for n in os.listdir(tmp_path) if n != "ckpt")
    loaded = run_on_ranks(2, on_ranks_load, MLP, path, fresh=True)[0]
    assert_states(loaded, first, 0, f"killed at '{point}'")
    assert ("previous checkpoint" in " ".join(loaded["warnings"])) == (point == "moved_old"), loaded["warnings"]
    # the next successful save removes every leftover and publishes at the path
    run_on_ranks(2, on_ranks_save, MLP, path, 4)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], (leftovers, os.listdir(tmp_path))
    # Killed while every rank writes, the survivor's failed write may remove the temporary
    # directory before the kill is seen here; later points leave it to the next save. Either way
    # the load above got the first checkpoint, so the kill came before anything was published.
    assert leftovers or point in ("writing", "written"), f"killed at '{point}' left nothing beside the checkpoint: the kill came too late"


# ---- background saves ---------------------------------------------------------------------------


def on_ranks_async_save(case: Case, path: str) -> dict:
    """Save in the background, keep training while it writes, save again at once (that save waits
    for the first), then load both checkpoints into fresh models."""
    from shardwrap import load_checkpoint, save_checkpoint
    from shardwrap.checkpoint import wait_for_saves

    import threading

    from shardwrap import checkpoint

    model, opt = make(case)
    train(case, model, opt, range(3))
    at_first = {"full": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}
    trained_on = threading.Event()
    checkpoint.fault_point = lambda point: trained_on.wait(60) if point == "started" else None
    first = save_checkpoint(path + "-a", model, opt, blocking=False)
    train(case, model, opt, range(3, 5))  # the shards change before the first save writes anything
    trained_on.set()
    checkpoint.fault_point = None
    at_second = {"full": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}
    second = save_checkpoint(path + "-b", model, opt, blocking=False)
    train(case, model, opt, range(5, 6))
    wait_for_saves()
    out = {"futures": [type(first).__name__, first.done(), second.done(), first.result(), second.result()]}
    for name, expected in (("-a", at_first), ("-b", at_second)):
        fresh, fresh_opt = make(case)
        load_checkpoint(path + name, fresh, fresh_opt)
        out[name] = ({"full": fresh.full_state_dict(), "optim": fresh.full_optim_state_dict(fresh_opt)}, expected)
    return out


def test_background_save_stages_a_copy_and_commits_atomically(tmp_path):
    for rank, r in enumerate(run_on_ranks(2, on_ranks_async_save, MLP, str(tmp_path / "ckpt"))):
        assert r["futures"] == ["Future", True, True, None, None], r["futures"]
        if rank == 0:
            for name in ("-a", "-b"):
                loaded, expected = r[name]
                assert_states(loaded, expected, 0, f"background save {name}")
    assert sorted(os.listdir(tmp_path)) == ["ckpt-a", "ckpt-b"]


# ---- optimizer state the next step could not use -------------------------------------------------


def on_ranks_incomplete_optimizer_state(path: str, door: str, damage: str, trained: bool) -> dict:
    """An optimizer state dict whose entry for one parameter lacks a key (AdamW's ``exp_avg_sq``),
    loaded into an optimizer that has stepped (``trained``) or a fresh one: refused on every rank,
    naming the parameter and the key, the model and the optimizer unchanged, and training goes on
    (torch's ``load_state_dict`` took it, and the next ``step()`` raised ``KeyError``). What a load
    restores is accepted: a dict with no entry for a parameter (the load leaves it without state, as
    torch's does), a checkpoint saved while a parameter was frozen loaded after it trained (a roll
    back), and one saved without ``amsgrad`` loaded into an optimizer built with it (the saved
    options win, as in torch)."""
    from shardwrap import load_checkpoint, save_checkpoint

    case = Case(**{**MLP.__dict__, "optim": "adamw"})
    model, opt = make(case)
    train(case, model, opt, range(2))
    key: object = None
    if door == "checkpoint":
        source, source_opt = make(case)
        if damage == "frozen":  # the saved optimizer never stepped head.bias: no state for it
            source.module.head.bias.requires_grad_(False)
        train(case, source, source_opt, range(2))
        save_checkpoint(path, source, source_opt)
        if damage == "amsgrad":
            model, opt = make(case)
            for group in opt.param_groups:
                group["amsgrad"] = True
            train(case, model, opt, range(2) if trained else range(0))
    else:
        osd = model.sharded_optim_state_dict(opt) if door == "sharded" else model.full_optim_state_dict(opt, rank0_only=False)
        key = "head.weight" if door == "sharded" else len(osd["state"]) - 2
        if damage == "entry":
            del osd["state"][key]
        else:
            osd["state"][key] = {k: v for k, v in osd["state"][key].items() if k != "exp_avg_sq"}
    target, target_opt = (model, opt) if trained or damage == "amsgrad" else make(case)
    before = target.full_state_dict(rank0_only=False)
    opt_before = {i: {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone() for k, v in e.items()}
                  for i, e in target_opt.state_dict()["state"].items()}
    try:
        if door == "checkpoint":
            load_checkpoint(path, target, target_opt)
        elif door == "sharded":
            target.load_sharded_optim_state_dict(target_opt, osd)
        else:
            target.load_full_optim_state_dict(target_opt, osd)
        error = "no error"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    after = target.full_state_dict(rank0_only=False)
    opt_after = target_opt.state_dict()["state"]
    unchanged = all(torch.equal(before[k], after[k]) for k in before) and set(opt_after) == set(opt_before) and all(
        set(opt_after[i]) == set(e) and all(torch.equal(e[k], opt_after[i][k].full_tensor() if hasattr(opt_after[i][k], "full_tensor") else opt_after[i][k]) for k in e)
        for i, e in opt_before.items()
    )
    train(case, target, target_opt, range(2, 3))  # it can go on
    return {"error": error, "unchanged": unchanged, "named": f"{key} (" if door == "full" else "'head.weight'"}


@pytest.mark.parametrize("door,trained", [("sharded", True), ("sharded", False), ("full", True), ("full", False)])
def test_optimizer_state_the_next_step_could_not_use_is_refused_and_changes_nothing(tmp_path, door, trained):
    for r in run_on_ranks(2, on_ranks_incomplete_optimizer_state, str(tmp_path / "ckpt"), door, "key", trained):
        assert r["named"] in r["error"] and "exp_avg_sq" in r["error"], r["error"]
        assert r["unchanged"], r


@pytest.mark.parametrize("door,damage,trained", [("sharded", "entry", True), ("full", "entry", False), ("checkpoint", "frozen", True),
                                                 ("checkpoint", "amsgrad", True), ("checkpoint", "amsgrad", False)])
def test_optimizer_state_a_load_restores_is_taken(tmp_path, door, damage, trained):
    for r in run_on_ranks(2, on_ranks_incomplete_optimizer_state, str(tmp_path / "ckpt"), door, damage, trained):
        assert r["error"] == "no error", r["error"]


def on_ranks_buffers_differ(path: str) -> dict:
    """BatchNorm's running statistics differ between ranks (each sees its own data, no
    SyncBatchNorm). Every door saves the first rank's, as ``save_full`` does and DDP keeps them; DCP's default planner wrote each replicated tensor from whichever rank balanced
    the writes, so ``load_checkpoint`` restored another rank's statistics than ``load_full``."""
    from shardwrap import ShardedModule, load_checkpoint, load_full, save_checkpoint, save_full

    def build() -> ShardedModule:
        torch.manual_seed(0)
        return ShardedModule(models.WithBuffers(), auto_wrap_policy={models.Block}, stage=3)

    model = build()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(dist.get_rank())) * (1 + dist.get_rank())
    model(x).sum().backward()
    mine = {k: v.clone() for k, v in model.module.norm.state_dict().items() if "running" in k}
    first = {f"norm.{k}": v.clone() for k, v in mine.items()}
    for v in first.values():
        dist.broadcast(v, 0)
    save_checkpoint(path, model)
    save_full(path + ".pt", model)
    out = {"differ": not torch.equal(mine["running_var"], first["norm.running_var"]) or dist.get_rank() == 0}
    for door in ("checkpoint", "full"):
        other = build()
        (load_checkpoint if door == "checkpoint" else load_full)(path if door == "checkpoint" else path + ".pt", other)
        got = other.module.norm.state_dict()
        out[door] = all(torch.equal(got[k.removeprefix("norm.")], v) for k, v in first.items())
    return out


def test_buffers_that_differ_between_ranks_load_as_the_first_ranks_through_every_door(tmp_path):
    for r in run_on_ranks(2, on_ranks_buffers_differ, str(tmp_path / "ckpt")):
        assert r["differ"], "the ranks' statistics are equal: the test proves nothing"
        assert r["checkpoint"] and r["full"], r
