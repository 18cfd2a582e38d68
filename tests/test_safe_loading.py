"""Safe loading (design/notes/safe-loading.md): nothing read from a checkpoint runs as code, a
damaged checkpoint is refused, and a load that fails changes nothing, on every door.

Crafted files carry a payload that creates a marker file when unpickled without restriction; each
test first shows the payload does create it that way (so "no marker" can fail), then that loading
refuses it, names the file, and leaves the model, the optimizer and the marker's path untouched.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import io
import json
import os
import pickle
import shutil
import tempfile
import warnings
import zlib

import pytest
import torch
import xxhash
from torch.distributed.tensor import DTensor
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import run_on_ranks
from parity import Case, build_model, resolve_policy

MANIFEST = "shardwrap-manifest.json"  # the documented name and format (README, the design note)
LIVE = Case("mlp", {"dim": 16, "depth": 2}, policy="Block", optim="adamw")


# ---- helpers: models, optimizers, snapshots ------------------------------------------------------


def wrap(case: Case):
    from shardwrap import ShardedModule

    return ShardedModule(build_model(case), auto_wrap_policy=resolve_policy(case))


def optimizer_for(model, grouping: str) -> torch.optim.Optimizer:
    """AdamW with the parameters grouped ``by_dim`` (nanoGPT's decay split), all in ``one`` group,
    or with the norm weights moved into the first group (``norms_first``)."""
    named = list(model.named_parameters())
    if grouping == "one":
        return torch.optim.AdamW([p for _, p in named], lr=1e-2)
    first = (lambda n, p: p.dim() >= 2) if grouping == "by_dim" else (lambda n, p: p.dim() >= 2 or "norm.weight" in n)
    groups = [
        {"params": [p for n, p in named if first(n, p)], "weight_decay": 0.1},
        {"params": [p for n, p in named if not first(n, p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))


def plain_group_names(case: Case, grouping: str) -> list[list[str]]:
    """The same grouping on the unwrapped model (same names and dims), by name."""
    model = build_model(case)
    ids = {id(p): n for n, p in model.named_parameters()}
    return [[ids[id(p)] for p in g["params"]] for g in optimizer_for(model, grouping).param_groups]


def fake_step(model, opt, value: float = 1.0) -> None:
    """One optimizer step with every gradient set to ``value``: creates state, moves parameters."""
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    opt.step()
    opt.zero_grad()


def snapshot(model, opt) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "optim": copy.deepcopy(opt.state_dict()) if opt is not None else None,
    }


def same_bits(a, b) -> bool:
    """Equal down to the bits (NaNs included): tensors by their bytes (a DTensor by its local
    tensor), containers recursively."""
    a, b = (t.to_local() if isinstance(t, DTensor) else t for t in (a, b))
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a == b


def attempt(action) -> str:
    try:
        action()
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_same_bits_oracle_can_fail():
    a = {"w": torch.tensor([1.0, float("nan")]), "s": [torch.tensor(2.0)]}
    b = copy.deepcopy(a)
    assert same_bits(a, b)
    b["w"][0] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert not same_bits(a, b)
    c = copy.deepcopy(a)
    c["s"][0] = torch.tensor(2.0, dtype=torch.float64)
    assert not same_bits(a, c)


# ---- helpers: crafted and damaged files -----------------------------------------------------------


class CreatesFile:
    """Unpickling this without restriction calls ``open(path, "w")``: the file appears."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def read_own_metadata(directory: str):
    """The test reads the metadata of checkpoints it wrote itself with plain pickle."""
    with open(os.path.join(directory, ".metadata"), "rb") as f:
        return pickle.load(f)


def replace_entry(directory: str, fqn: str, blob: bytes) -> str:
    """Replace the stored bytes of the first chunk of entry ``fqn`` with ``blob``, moving the
    entries after it in that file and rewriting ``.metadata``. Returns the file's name."""
    md = read_own_metadata(directory)
    index = min((i for i in md.storage_data if i.fqn == fqn), key=lambda i: md.storage_data[i].relative_path)
    info = md.storage_data[index]
    path = os.path.join(directory, info.relative_path)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: info.offset] + blob + data[info.offset + info.length :])
    delta = len(blob) - info.length
    for i, other in list(md.storage_data.items()):
        if other.relative_path == info.relative_path and other.offset > info.offset:
            md.storage_data[i] = dataclasses.replace(other, offset=other.offset + delta)
    md.storage_data[index] = dataclasses.replace(info, length=len(blob))
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return info.relative_path


DIGESTS = {  # the documented digests of a file: xxh3-64 (new saves), CRC-32 (the previous release's)
    "xxh3_64": lambda data: f"{xxhash.xxh3_64_intdigest(data):016x}",
    "crc32": lambda data: f"{zlib.crc32(data):08x}",
}


def write_manifest(directory: str, algorithm: str = "xxh3_64") -> None:
    """A manifest with every file's real size and digest, in the documented format (what a forger
    who rewrote the checkpoint would also write; with "crc32", what the previous release wrote)."""
    files = {}
    for name in sorted(os.listdir(directory)):
        if name != MANIFEST:
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read()
            files[name] = {"size": len(data), algorithm: DIGESTS[algorithm](data)}
    write_manifest_json(directory, {"format": "shardwrap-manifest/1", "algorithm": algorithm, "files": files})


def write_manifest_json(directory: str, content: dict) -> None:
    """The manifest file: one line of JSON, then the line "crc32 <CRC-32 of that JSON>"."""
    body = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    with open(os.path.join(directory, MANIFEST), "wb") as f:
        f.write(body + b"\n" + b"crc32 %08x\n" % zlib.crc32(body))


def read_manifest(directory: str) -> dict:
    with open(os.path.join(directory, MANIFEST), "rb") as f:
        body, trailer, end = f.read().split(b"\n")
    assert trailer == b"crc32 %08x" % zlib.crc32(body) and end == b""
    return json.loads(body)


# ---- on the ranks -------------------------------------------------------------------------------------


def on_ranks_save(case: Case, path: str, grouping: str = "by_dim", steps: int = 1, seed_value: float = 1.0) -> dict:
    from shardwrap import save_checkpoint

    model = wrap(case)
    opt = optimizer_for(model, grouping)
    for _ in range(steps):
        fake_step(model, opt, seed_value)
    save_checkpoint(path, model, opt)
    return {"full": model.full_state_dict(rank0_only=False), "optim": model.full_optim_state_dict(opt, rank0_only=False)}


def on_ranks_try_loads(paths: list[str], door: str = "load_checkpoint") -> list[tuple[str, bool, list[str]]]:
    """For each path: (error, model and optimizer unchanged, warnings), loading into a fresh model
    whose optimizer has taken two steps (``door``: load_checkpoint, load_full, or model_only: a
    load_checkpoint without the optimizer)."""
    from shardwrap import load_checkpoint, load_full

    model = wrap(LIVE)
    opt = optimizer_for(model, "by_dim")
    fake_step(model, opt, 0.5)
    fake_step(model, opt, 0.25)
    out = []
    for path in paths:
        before = snapshot(model, opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if door == "model_only":
                message = attempt(lambda: load_checkpoint(path, model))
            else:
                load = load_checkpoint if door == "load_checkpoint" else load_full
                message = attempt(lambda: load(path, model, opt))
        out.append((message, same_bits(before, snapshot(model, opt)), [str(w.message) for w in caught]))
        dist.barrier()
    return out


# ---- 1. loading runs no code from a file -------------------------------------------------------------


def crafted_checkpoints(root: str, pristine: str, marker: str) -> dict[str, tuple[str, str]]:
    """Copies of ``pristine``, each with one file carrying the payload: name -> (directory, the
    crafted file's name). Each payload is shown to create the marker when unpickled as DCP would."""
    out = {}
    for part in ("metadata", "bytes_entry", "tensor_payload"):
        for manifest in ("forged_manifest", "no_manifest"):
            directory = os.path.join(root, f"{part}-{manifest}")
            shutil.copytree(pristine, directory)
            if part == "metadata":
                with open(os.path.join(directory, ".metadata"), "wb") as f:
                    pickle.dump(CreatesFile(marker), f)
                victim = ".metadata"
            else:
                fqn = "optim.param_groups.0.lr" if part == "bytes_entry" else "model.head.weight"
                victim = replace_entry(directory, fqn, torch_saved(CreatesFile(marker)))
            if os.path.exists(os.path.join(directory, MANIFEST)):
                os.remove(os.path.join(directory, MANIFEST))
            if manifest == "forged_manifest":
                write_manifest(directory)
            out[f"{part}-{manifest}"] = (directory, victim)
    directory = os.path.join(root, "manifest")
    shutil.copytree(pristine, directory)
    with open(os.path.join(directory, MANIFEST), "wb") as f:
        pickle.dump(CreatesFile(marker), f)
    out["manifest"] = (directory, MANIFEST)
    return out


def show_payload_runs(directory: str, victim: str, marker: str) -> None:
    """The oracle "the marker does not exist" can fail: unpickled the way DCP does by default
    (pickle.load for .metadata, torch.load(weights_only=False) for entries), the payload runs."""
    from torch.distributed.checkpoint import FileSystemReader

    if victim == ".metadata":
        try:
            FileSystemReader(directory).read_metadata()
        except Exception:
            pass  # what the payload returned is no metadata: only its side effect matters
    elif victim == MANIFEST:
        with open(os.path.join(directory, victim), "rb") as f:
            pickle.load(f)
    else:
        md = read_own_metadata(directory)
        for info in md.storage_data.values():
            if info.relative_path == victim:
                with open(os.path.join(directory, victim), "rb") as f:
                    f.seek(info.offset)
                    try:
                        torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
                    except Exception:
                        pass  # other entries are tensors or values: only the payload matters
    assert os.path.exists(marker), f"{victim}: the payload did not run when unpickled without restriction"
    os.remove(marker)


def test_crafted_files_run_no_code(tmp_path):
    from shardwrap import export_to_torch_save

    marker = str(tmp_path / "pwned")
    pristine = str(tmp_path / "pristine")
    run_on_ranks(2, on_ranks_save, LIVE, pristine)
    crafted = crafted_checkpoints(str(tmp_path), pristine, marker)
    for name, (directory, victim) in crafted.items():
        show_payload_runs(directory, victim, marker)
    # A crafted single file for load_full.
    full_file = str(tmp_path / "crafted.pt")
    torch.save({"model": CreatesFile(marker)}, full_file)
    with open(full_file, "rb") as f:
        assert torch.load(f, weights_only=False) and os.path.exists(marker)
    os.remove(marker)

    names = list(crafted)
    results = run_on_ranks(2, on_ranks_try_loads, [crafted[n][0] for n in names])
    results_full = run_on_ranks(2, on_ranks_try_loads, [full_file], "load_full")
    for rank in range(2):
        for name, (message, unchanged, _) in zip(names, results[rank]):
            directory, victim = crafted[name]
            assert not os.path.exists(marker), f"{name}: the payload ran"
            assert os.path.join(directory, victim) in message, f"rank {rank} {name}: the error does not name the file: {message}"
            assert message == results[0][names.index(name)][0], f"{name}: ranks raised different errors"
            assert message.startswith(("UnsafeCheckpointError", "DamagedCheckpointError")), message
            assert unchanged, f"rank {rank} {name}: the model or optimizer changed"
        message, unchanged, _ = results_full[rank][0]
        assert full_file in message and message.startswith("UnsafeCheckpointError") and unchanged, message
    assert not os.path.exists(marker)
    # export_to_torch_save opens the same files.
    for name, (directory, victim) in crafted.items():
        out = str(tmp_path / f"{name}.pt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(Exception) as raised:
                export_to_torch_save(directory, out)
        assert os.path.join(directory, victim) in str(raised.value), str(raised.value)
        assert not os.path.exists(marker) and not os.path.exists(out)
        assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


# ---- 2. a damaged checkpoint is refused -----------------------------------------------------------------


def on_ranks_manifest_commit_fails(path: str) -> dict:
    import shardwrap.checkpoint_files as files
    from shardwrap import save_checkpoint

    model = wrap(LIVE)
    opt = optimizer_for(model, "by_dim")
    fake_step(model, opt)
    real = files.write_manifest

    def fails(directory, records):
        raise OSError("disk full")

    files.write_manifest = fails
    try:
        message = attempt(lambda: save_checkpoint(path, model, opt))
    finally:
        files.write_manifest = real
    return {"message": message, "leftovers": [n for n in os.listdir(os.path.dirname(path)) if ".tmp-" in n]}


def test_manifest_records_every_file_and_is_committed_with_them(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, on_ranks_save, LIVE, path)
    manifest = read_manifest(path)
    on_disk = sorted(n for n in os.listdir(path) if n != MANIFEST)
    assert sorted(manifest["files"]) == on_disk and ".metadata" in on_disk and len(on_disk) >= 3
    assert manifest["algorithm"] == "xxh3_64"
    for name in on_disk:
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        assert manifest["files"][name] == {"size": len(data), "xxh3_64": DIGESTS["xxh3_64"](data)}, name
    # A save whose manifest cannot be written fails on every rank and leaves the old checkpoint.
    for r in run_on_ranks(2, on_ranks_manifest_commit_fails, path):
        assert "disk full" in r["message"] and r["leftovers"] == [], r
    assert read_manifest(path) == manifest
    loaded = run_on_ranks(2, on_ranks_try_loads, [path])
    assert loaded[0][0][0] == "no error" and not loaded[0][0][1]  # it loads, and loading changes the model


def damage(path: str, kind: str, where: float, bit: int) -> str:
    """Flip one bit at a fraction ``where`` of the file, or truncate it to that fraction."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    pos = min(int(where * len(data)), len(data) - 1)
    if kind == "flip":
        data[pos] ^= 1 << bit
    else:
        del data[pos:]
    with open(path, "wb") as f:
        f.write(bytes(data))
    return os.path.basename(path)


def flipped_copies(source: str, names: list[str], where: float, bit: int) -> list[tuple[str, str]]:
    """(directory, name) for each of ``names``: a copy of the checkpoint ``source`` beside it with
    one bit of that file flipped."""
    cases = []
    for name in names:
        directory = f"{source}-{name}"
        shutil.copytree(source, directory)
        damage(os.path.join(directory, name), "flip", where, bit)
        cases.append((directory, name))
    return cases


def test_damaged_files_are_refused_and_change_nothing(tmp_path):
    pristine = str(tmp_path / "pristine")
    run_on_ranks(2, on_ranks_save, LIVE, pristine)
    cases = []
    for name in sorted(os.listdir(pristine)):
        for kind in ("flip", "truncate"):
            directory = str(tmp_path / f"{name}-{kind}")
            shutil.copytree(pristine, directory)
            damage(os.path.join(directory, name), kind, 0.5, 3)
            cases.append((directory, name))
    results = run_on_ranks(2, on_ranks_try_loads, [d for d, _ in cases])
    for rank in range(2):
        for (directory, name), (message, unchanged, _) in zip(cases, results[rank]):
            assert message.startswith("DamagedCheckpointError"), message
            assert os.path.join(directory, name) in message, f"the error does not name the file: {message}"
            assert unchanged, f"{name}: the model or optimizer changed"


@pytest.mark.parametrize("door", ["load_checkpoint", "model_only"])
def test_damage_is_refused_after_resharding(tmp_path, door):
    """Saved at W=3, loaded at W=2: each rank verifies its share of the files, those it reads
    while reading them and the others after DCP, before any write (loading the model alone, rank 0
    reads nothing from __2_0.distcp, which is in its share)."""
    pristine = str(tmp_path / "w3")
    run_on_ranks(3, on_ranks_save, LIVE, pristine)
    cases = flipped_copies(pristine, ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"], 0.75, 5)
    results = run_on_ranks(2, on_ranks_try_loads, [pristine] + [d for d, _ in cases], door)
    for rank in range(2):
        message, unchanged, _ = results[rank][0]
        assert message == "no error" and not unchanged, message  # the intact one loads
        for (directory, name), (message, unchanged, _) in zip(cases, results[rank][1:]):
            assert message.startswith("DamagedCheckpointError") and os.path.join(directory, name) in message, message
            assert unchanged, f"{name}: the model or optimizer changed"


def test_crc32_manifests_of_the_previous_release_load_and_are_verified(tmp_path):
    """A checkpoint saved by the previous release (its manifest holds CRC-32s) loads, and a flipped
    bit in it is still refused, by its CRC-32; a manifest naming an algorithm this shardwrap does
    not know is refused, naming the manifest and the algorithm."""
    pristine = str(tmp_path / "pristine")
    run_on_ranks(2, on_ranks_save, LIVE, pristine)
    old = str(tmp_path / "old")
    shutil.copytree(pristine, old)
    write_manifest(old, "crc32")
    cases = flipped_copies(old, [".metadata", "__0_0.distcp", "__1_0.distcp"], 0.5, 2)
    unknown = str(tmp_path / "unknown")
    shutil.copytree(old, unknown)
    write_manifest_json(unknown, {**read_manifest(old), "algorithm": "sha256"})
    results = run_on_ranks(2, on_ranks_try_loads, [old, unknown] + [d for d, _ in cases])
    for rank in range(2):
        (message, unchanged, _), (refused, refused_unchanged, _) = results[rank][:2]
        assert message == "no error" and not unchanged, message
        assert refused.startswith("DamagedCheckpointError") and os.path.join(unknown, MANIFEST) in refused, refused
        assert "'sha256'" in refused and refused_unchanged, refused
        for (directory, name), (message, unchanged, _) in zip(cases, results[rank][2:]):
            assert message.startswith("DamagedCheckpointError") and os.path.join(directory, name) in message, message
            assert "CRC-32 check" in message and unchanged, message


def test_checkpoint_without_manifest_loads_with_a_warning_and_is_not_verified(tmp_path):
    """A checkpoint as saved before manifests (DCP alone) loads, with one warning on the first
    rank. Without a manifest a flipped bit in a tensor loads silently: what the manifest prevents
    (and a proof that the "unchanged" oracle above can fail)."""
    path = str(tmp_path / "old")
    saved = run_on_ranks(2, on_ranks_save, LIVE, path, "by_dim", 1, 0.75)[0]
    if os.path.exists(os.path.join(path, MANIFEST)):
        os.remove(os.path.join(path, MANIFEST))  # exactly the files save_checkpoint wrote before this change
    damaged = str(tmp_path / "old-damaged")
    shutil.copytree(path, damaged)
    md = read_own_metadata(damaged)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.inp.weight")
    with open(os.path.join(damaged, info.relative_path), "r+b") as f:  # a byte inside the tensor's data
        data = f.read()
        start = data.index(b"data/0", info.offset) + 200  # past the zip entry's header
        f.seek(start)
        f.write(bytes([data[start] ^ 0x40]))
    results = run_on_ranks(2, on_ranks_load_and_read, [path, damaged])
    for rank, r in enumerate(results):
        (message, warned), (damaged_message, _) = r["outcomes"]
        assert message == "no error" and damaged_message == "no error", r["outcomes"]
        if rank == 0:
            assert len(warned) == 1 and path in warned[0] and MANIFEST in warned[0] and "\n" not in warned[0], warned
        else:
            assert warned == []
        for k, v in saved["full"].items():
            assert torch.equal(r["loaded"][0][k], v), k
        assert not torch.equal(r["loaded"][1]["inp.weight"], saved["full"]["inp.weight"])


def on_ranks_load_and_read(paths: list[str]) -> dict:
    from shardwrap import load_checkpoint

    outcomes, loaded = [], []
    for path in paths:
        model = wrap(LIVE)
        opt = optimizer_for(model, "by_dim")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            message = attempt(lambda: load_checkpoint(path, model, opt))
        outcomes.append((message, [str(w.message) for w in caught]))
        loaded.append(model.full_state_dict(rank0_only=False))
    return {"outcomes": outcomes, "loaded": loaded}


_PRISTINE: dict[str, str] = {}


def pristine_checkpoint() -> str:
    if "path" not in _PRISTINE:
        root = tempfile.mkdtemp(prefix="shardwrap-hypothesis-")
        atexit.register(shutil.rmtree, root, True)
        run_on_ranks(2, on_ranks_save, LIVE, os.path.join(root, "ckpt"))
        _PRISTINE["path"] = os.path.join(root, "ckpt")
    return _PRISTINE["path"]


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    file_index=st.integers(0, 100),
    kind=st.sampled_from(["flip", "truncate"]),
    where=st.floats(0.0, 1.0, allow_nan=False),
    bit=st.integers(0, 7),
)
def test_any_bit_flip_or_truncation_is_refused(file_index, kind, where, bit):
    pristine = pristine_checkpoint()
    names = sorted(os.listdir(pristine))
    directory = tempfile.mkdtemp(prefix="damaged-", dir=os.path.dirname(pristine))
    shutil.rmtree(directory)
    shutil.copytree(pristine, directory)
    try:
        name = damage(os.path.join(directory, names[file_index % len(names)]), kind, where, bit)
        results = run_on_ranks(2, on_ranks_try_loads, [directory])
        for rank, [(message, unchanged, _)] in enumerate(results):
            assert message.startswith("DamagedCheckpointError"), f"rank {rank}, {kind} of {name}: {message}"
            assert os.path.join(directory, name) in message, message
            assert unchanged, f"rank {rank}, {kind} of {name}: the model or optimizer changed"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---- 2b. the caller's extra state, inside the same atomic checkpoint ------------------------------------

EXTRA = {"step": 6, "epoch": 1, "windows_in_epoch": 48, "scaler": {"scale": 65536.0, "_growth_tracker": 3}}


def on_ranks_extra_state(root: str) -> dict:
    """Saves with extra state (good, differing between ranks, not JSON, None on one rank only) and
    loads that return it; each refused save must raise on every rank and write nothing."""
    from shardwrap import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    model = wrap(LIVE)
    opt = optimizer_for(model, "by_dim")
    fake_step(model, opt)
    with_extra, without = os.path.join(root, "with"), os.path.join(root, "without")
    save_checkpoint(with_extra, model, opt, extra_state=EXTRA)
    save_checkpoint(without, model, opt)
    refused = {
        "differs": attempt(lambda: save_checkpoint(os.path.join(root, "differs"), model, opt, extra_state={"rank": rank})),
        "not json": attempt(lambda: save_checkpoint(os.path.join(root, "tensor"), model, opt,
                                                    extra_state={"loss": torch.tensor(1.0)})),
        "one rank": attempt(lambda: save_checkpoint(os.path.join(root, "one"), model, opt,
                                                    extra_state=EXTRA if rank == 1 else None)),
    }
    fresh = wrap(LIVE)
    fresh_opt = optimizer_for(fresh, "by_dim")
    loaded = load_checkpoint(with_extra, fresh, fresh_opt)
    same = same_bits(snapshot(model, None)["params"], snapshot(fresh, None)["params"])
    return {"loaded": loaded, "same": same, "none": load_checkpoint(without, fresh, fresh_opt), "refused": refused}


def test_extra_state_round_trips_inside_the_atomic_checkpoint_and_is_verified(tmp_path):
    from shardwrap.checkpoint_files import EXTRA_STATE

    root = str(tmp_path)
    results = run_on_ranks(2, on_ranks_extra_state, root)
    for r in results:
        assert r["loaded"] == EXTRA and r["same"] and r["none"] is None, r
        assert r["refused"] == results[0]["refused"], "ranks raised different errors"
        assert r["refused"]["differs"].startswith("ValueError: extra_state differs between rank 0 and rank(s) [1]"), r
        assert r["refused"]["not json"].startswith("ValueError: extra_state cannot be saved as JSON"), r
        assert r["refused"]["one rank"].startswith("ValueError: extra_state differs"), r
    assert sorted(os.listdir(root)) == ["with", "without"]  # the refused saves wrote nothing
    manifest = read_manifest(os.path.join(root, "with"))
    assert EXTRA_STATE in manifest["files"] and EXTRA_STATE not in os.listdir(os.path.join(root, "without"))
    with open(os.path.join(root, "with", EXTRA_STATE)) as f:
        assert json.load(f) == EXTRA
    # The extra state is verified like every other file, before anything is loaded.
    flipped, gone, added = (str(tmp_path / n) for n in ("flipped", "gone", "added"))
    shutil.copytree(os.path.join(root, "with"), flipped)
    damage(os.path.join(flipped, EXTRA_STATE), "flip", 0.5, 1)
    shutil.copytree(os.path.join(root, "with"), gone)
    os.remove(os.path.join(gone, EXTRA_STATE))
    shutil.copytree(os.path.join(root, "without"), added)
    shutil.copy(os.path.join(root, "with", EXTRA_STATE), os.path.join(added, EXTRA_STATE))
    outcomes = run_on_ranks(2, on_ranks_try_loads, [flipped, gone, added])
    for rank in range(2):
        for (message, unchanged, _), path, why in zip(outcomes[rank], [flipped, gone, added],
                                                      ["xxh3-64 check", "is missing", "not in the manifest"]):
            assert message.startswith("DamagedCheckpointError") and os.path.join(path, EXTRA_STATE) in message, message
            assert why in message and unchanged and message == outcomes[0][[flipped, gone, added].index(path)][0], message


# ---- 3. a failed load changes nothing ----------------------------------------------------------------


SOURCES = {  # what the checkpoint was saved from: (model, optimizer grouping, optimizer steps)
    "deeper": (Case("mlp", {"dim": 16, "depth": 3}, policy="Block", seed=1), "by_dim", 1),
    "shallower": (Case("mlp", {"dim": 16, "depth": 1}, policy="Block", seed=1), "by_dim", 1),
    "other_shape": (Case("mlp", {"dim": 16, "depth": 2, "out": 7}, policy="Block", seed=1), "by_dim", 1),
    "architecture": (Case("structured", {"dim": 16}, seed=1), "by_dim", 1),
    "one_param_group": (Case(**{**LIVE.__dict__, "seed": 1}), "one", 1),
    "other_param_groups": (Case(**{**LIVE.__dict__, "seed": 1}), "norms_first", 1),
    # No optimizer state: nothing but the groups tells the optimizers apart.
    "other_param_groups_no_state": (Case(**{**LIVE.__dict__, "seed": 1}), "norms_first", 0),
}
MODEL_ONLY = ("deeper", "shallower", "other_shape", "architecture")


def on_ranks_refused_loads(root: str) -> dict:
    from shardwrap import load_checkpoint, load_full, save_checkpoint, save_full

    fulls = {}
    for name, (case, grouping, steps) in SOURCES.items():
        source = wrap(case)
        source_opt = optimizer_for(source, grouping)
        for _ in range(steps):
            fake_step(source, source_opt, 2.0)
        save_checkpoint(os.path.join(root, name), source, source_opt)
        save_full(os.path.join(root, name + ".pt"), source, source_opt)
        fulls[name] = source.full_state_dict()
    results = {}
    for steps in (0, 2):  # a fresh optimizer (no state), and one that has taken two steps
        for name in SOURCES:
            for door in ("load_checkpoint", "load_full", "load_full_state_dict"):
                if door == "load_full_state_dict" and name not in MODEL_ONLY:
                    continue
                model = wrap(LIVE)  # a new one for each attempt: one failed load must not hide another
                opt = optimizer_for(model, "by_dim")
                for _ in range(steps):
                    fake_step(model, opt, 0.5)
                load = {
                    "load_checkpoint": lambda: load_checkpoint(os.path.join(root, name), model, opt),
                    "load_full": lambda: load_full(os.path.join(root, name + ".pt"), model, opt),
                    "load_full_state_dict": lambda: model.load_full_state_dict(fulls[name]),
                }[door]
                before = snapshot(model, opt)
                message = attempt(load)
                results[(steps, name, door)] = (message, same_bits(before, snapshot(model, opt)))
                dist.barrier()
    # The oracle can fail: a checkpoint that fits loads and changes both.
    fits = os.path.join(root, "fits")
    source = wrap(Case(**{**LIVE.__dict__, "seed": 3}))
    source_opt = optimizer_for(source, "by_dim")
    fake_step(source, source_opt, 3.0)
    save_checkpoint(fits, source, source_opt)
    before = snapshot(model, opt)
    results["fits"] = (attempt(lambda: load_checkpoint(fits, model, opt)), same_bits(before, snapshot(model, opt)))
    return results


def expected_fragments(name: str, door: str) -> list[str]:
    """What the error must name, from the real models: the first offending key with both shapes,
    or the parameter groups."""
    case, grouping, _ = SOURCES[name]
    saved, live = build_model(case).state_dict(), build_model(LIVE).state_dict()
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    mismatched = [k for k in live if k in saved and saved[k].shape != live[k].shape]
    if missing:
        return [f"missing keys ['{missing[0]}'"]
    if unexpected:
        return [f"unexpected keys ['{unexpected[0]}'"]
    if mismatched:
        k = mismatched[0]
        return [f"shape mismatch for '{k}': checkpoint {tuple(saved[k].shape)} vs model {tuple(live[k].shape)}"]
    s, mine = plain_group_names(case, grouping), plain_group_names(LIVE, "by_dim")
    if len(s) != len(mine):
        return [f"{len(s)} param group(s) of {[len(g) for g in s]} parameters, this optimizer {len(mine)} of {[len(g) for g in mine]}"]
    if door == "load_full":  # a full optimizer state dict has indices, paired by position
        return [f"of {[len(g) for g in s]} parameters, this optimizer {len(mine)} of {[len(g) for g in mine]}"]
    i = next(i for i in range(len(s)) if set(s[i]) != set(mine[i]))
    return [
        f"param group {i} holds {len(s[i])} parameters in the checkpoint, {len(mine[i])} in this optimizer",
        f"only in the checkpoint's: ['{next(n for n in s[i] if n not in mine[i])}'",
    ]


def test_a_load_that_does_not_fit_names_the_keys_and_changes_nothing(tmp_path):
    results = run_on_ranks(2, on_ranks_refused_loads, str(tmp_path), timeout=240)
    for rank, r in enumerate(results):
        message, unchanged = r.pop("fits")
        assert message == "no error" and not unchanged, "a load that fits must change the model (the oracle can fail)"
        assert len(r) == 2 * (len(SOURCES) * 2 + len(MODEL_ONLY))
        for (steps, name, door), (message, unchanged) in r.items():
            what = f"rank {rank}, {door} of '{name}' (optimizer after {steps} steps)"
            assert message.startswith("ValueError"), f"{what}: {message}"
            for fragment in expected_fragments(name, door):
                assert fragment in message, f"{what}: '{fragment}' not in: {message}"
            assert message == results[0][(steps, name, door)][0], f"{what}: ranks raised different errors"
            assert unchanged, f"{what}: the model or the optimizer changed"


def on_ranks_disagreeing_load_state_dict() -> dict:
    model = wrap(LIVE)
    other = wrap(Case(**{**LIVE.__dict__, "seed": 5}))
    sd = dict(other.state_dict())
    if dist.get_rank() == 1:  # only this rank's dict is bad
        sd["head.weight"] = torch.zeros(3, 3)
    before = snapshot(model, None)
    message = attempt(lambda: model.load_state_dict(sd))
    return {"message": message, "unchanged": same_bits(before, snapshot(model, None))}


def test_load_state_dict_refused_on_one_rank_is_refused_on_all():
    results = run_on_ranks(2, on_ranks_disagreeing_load_state_dict)
    for r in results:
        assert "rank 1: shape mismatch for 'head.weight': checkpoint (3, 3) vs model (5, 16)" in r["message"], r["message"]
        assert r["unchanged"], "a rank loaded while another refused"


def on_ranks_non_strict(sd: dict) -> dict:
    model = wrap(LIVE)
    result = model.load_full_state_dict(sd if dist.get_rank() == 0 else {}, strict=False)
    return {"missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys), "full": model.full_state_dict(rank0_only=False)}


def test_load_full_state_dict_non_strict_reports_keys_as_torch_does():
    source = build_model(Case(**{**LIVE.__dict__, "seed": 6})).state_dict()
    sd = {k: v for k, v in source.items() if not k.startswith("blocks.1.")}
    sd["extra.weight"] = torch.ones(2)
    plain = build_model(LIVE)  # the same initial values as the ranks' model
    expected = plain.load_state_dict(sd, strict=False)
    assert expected.missing_keys and expected.unexpected_keys
    for r in run_on_ranks(2, on_ranks_non_strict, sd):
        assert r["missing"] == expected.missing_keys and r["unexpected"] == expected.unexpected_keys
        for k, v in plain.state_dict().items():
            assert torch.equal(r["full"][k], v), k
