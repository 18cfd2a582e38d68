"""Checkpoints on disk: sharded (``torch.distributed.checkpoint``) and single-file (``torch.save``)
[design/notes/safe-loading.md].

Saves are atomic: everything, the manifest of checksums included, is written under a temporary
name beside the target and renamed into place only after every rank finished, so a save that dies
halfway leaves the previous checkpoint loadable.

Loads change nothing unless they succeed. Each step is agreed on by every rank before the next:
the manifest is read and ``.metadata`` checked against it; ``.metadata`` is unpickled by an
allow-list of DCP's own classes (``checkpoint_files.py``); every key and shape is checked against
the model and optimizer (from the metadata alone); DCP reads into scratch copies, tensors and
values with ``torch.load(weights_only=True)``, each rank verifying its share of the data files as
it reads them (the rest of its share after); the optimizer's groups are checked; only then are the
optimizer and the model written.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypeVar

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from shardwrap import checkpoint_files as files
from shardwrap import collectives, state_dict
from shardwrap.checkpoint_files import (
    CheckpointError,
    DamagedCheckpointError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
)

if TYPE_CHECKING:
    from shardwrap.sharded_module import ShardedModule

__all__ = [
    "save_checkpoint", "load_checkpoint", "export_to_torch_save", "save_full", "load_full",
    "CheckpointError", "DamagedCheckpointError", "UnsafeCheckpointError", "UnverifiedCheckpointWarning",
]

T = TypeVar("T")

_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (FileNotFoundError, DamagedCheckpointError, UnsafeCheckpointError, CheckpointError, ValueError, RuntimeError)
}


def _agree(value: Any, model: "ShardedModule", group: collectives.Group | None = None) -> Any:
    """The mesh's first rank's ``value`` on every rank (over ``group``, default the mesh's)."""
    return collectives.broadcast_object(value, group or model.world_group)


def _agreed(model: "ShardedModule", step: Callable[[], T]) -> T:
    """Run ``step`` on every rank; if it raised on any rank, raise the first rank's error on every
    rank (same type and message), so that no rank goes on alone."""
    own: BaseException | None = None
    try:
        result, failure = step(), None
    except BaseException as exc:  # an interrupt too: the other ranks wait for this rank's answer
        result, own = None, exc
        failure = (type(exc).__name__, str(exc), isinstance(exc, Exception))
    failures = collectives.all_gather_object(failure, model.world_group)
    if own is not None and not isinstance(own, Exception):
        raise own  # KeyboardInterrupt or SystemExit stays what it was on the rank it reached
    for rank, found in enumerate(failures):
        if found is not None:
            name, message, is_error = found
            if not is_error:
                raise RuntimeError(f"rank {rank} was stopped ({name}: {message}); every rank stops here with it")
            raise _ERRORS.get(name, RuntimeError)(message)
    return result  # type: ignore[return-value]


# ---- sharded checkpoints (DCP) ------------------------------------------------------------------


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer (each file synced to disk), with the ``"writing"`` fault point."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        _reached("writing")
        return super().write_data(plan, planner)


def _write(state: dict[str, Any], tmp: str, group: collectives.Group) -> Metadata:
    return dcp.save(state, storage_writer=_Writer(tmp), process_group=group)


def _first_ranks_buffers(model: "ShardedModule", sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with every plain tensor (a buffer: BatchNorm's running statistics differ between
    ranks without SyncBatchNorm) replaced by a copy of the first rank's, as ``save_full`` saves
    them: DCP writes each tensor every rank holds whole from whichever rank balances the writes, so
    a resume got some other rank's statistics. One broadcast per dtype; the live buffers stay."""
    plain = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)]
    if not plain or model.world_group.size() == 1:
        return sd
    copies = [sd[k].detach().clone() for k in plain]
    collectives.broadcast_tensors(copies, model.world_group)
    return {**sd, **dict(zip(plain, copies))}


def _my_checksums(tmp: str, metadata: Metadata, rank: int, world: int) -> dict[str, files.FileRecord]:
    """Size and xxh3-64 hash of this rank's share (``checkpoint_files.share``) of the files of the
    checkpoint in ``tmp``; the ranks' shares together cover every file."""
    names = sorted({files.METADATA} | {info.relative_path for info in metadata.storage_data.values()})
    try:
        return {name: files.checksum(os.path.join(tmp, name)) for name in files.share(names, rank, world)}
    except OSError as exc:
        raise OSError(f"the checkpoint's files could not be checksummed ({exc})") from exc


# Tests set this to simulate a crash (SIGKILL) or a slow write at a named point of a save: "started"
# (the save's own work begins: on the helper thread for a background save), "writing" (DCP starts
# writing this rank's data files into the temporary directory), "written" (every rank's
# files are in the temporary directory), "agreed" (checksums gathered and the manifest written,
# before the first rename), "moved_old" (the previous checkpoint renamed aside, the new one not
# yet in place). Nothing in the package sets it.
fault_point: Callable[[str], None] | None = None


def _reached(point: str) -> None:
    if fault_point is not None:
        fault_point(point)


def _fsync_dir(directory: str) -> None:
    """Flush a directory's entries (the renames and new files in it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _leftovers(path: str) -> list[str]:
    """What killed saves to ``path`` may have left beside it: temporary and set-aside directories."""
    parent, base = os.path.split(os.path.abspath(path))
    return [
        os.path.join(parent, name) for name in os.listdir(parent or ".")
        if name.startswith(f"{base}.tmp-") or name.startswith(f"{base}.old-")
    ]


def _commit(tmp: str, path: str) -> None:
    """Swap ``tmp`` into ``path``: the old checkpoint stays complete until the new one is.

    DCP has synced the data files and ``write_manifest`` the manifest; the directory entries are
    synced here before the rename that publishes them, and the parent after it. Between the two
    renames nothing is at ``path``; a load then finds the set-aside ``path.old-*`` instead
    (``_published``). After the swap, every leftover of earlier killed saves goes."""
    _fsync_dir(tmp)
    old = f"{path}.old-{uuid.uuid4().hex[:8]}"
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(path):
        os.rename(path, old)
        _reached("moved_old")
    os.rename(tmp, path)
    _fsync_dir(parent)
    for leftover in _leftovers(path):
        shutil.rmtree(leftover, ignore_errors=True)


def _published(path: str) -> str:
    """The directory a load of ``path`` reads: ``path`` itself, or, when a save was killed between
    its two renames (nothing at ``path``), the newest set-aside ``path.old-*`` that is a complete
    checkpoint, with a warning. ``path.tmp-*`` directories are never read."""
    if os.path.exists(path):
        return path
    candidates = sorted(
        (d for d in _leftovers(path) if ".old-" in os.path.basename(d) and os.path.isfile(os.path.join(d, files.MANIFEST))),
        key=os.path.getmtime, reverse=True,
    )
    for candidate in candidates:
        try:
            files.check_files(candidate)
        except (CheckpointError, OSError):
            continue
        warnings.warn(
            f"checkpoint '{path}' is missing: a save was interrupted while replacing it; loading the previous "
            f"checkpoint from '{candidate}' (the next successful save to '{path}' removes it)",
            stacklevel=3,
        )
        return candidate
    return path


_SAVER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwrap-checkpoint-save")
_pending: "Future[None] | None" = None  # the last background save, in order


def wait_for_saves() -> None:
    """Block until the background save in flight (``save_checkpoint(..., blocking=False)``) has
    committed or failed; its error stays with its future."""
    if _pending is not None:
        wait([_pending])


def _staged(state: Any) -> Any:
    """A copy of ``state`` that training cannot change: every tensor (DTensors: their local shard)
    cloned to CPU memory, everything else as it is."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _staged(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_staged(v) for v in state]
    return state


def _encode_extra_state(extra_state: Mapping[str, Any] | None, model: "ShardedModule") -> bytes | None:
    """``extra_state`` as JSON text, checked on every rank before anything is written: it must be
    a JSON object, and the same on every rank (None on every rank saves none). Every rank takes
    part in the check even without one, so that a rank that passed one cannot wait alone."""

    def encode() -> bytes | None:
        if extra_state is None:
            return None
        if not isinstance(extra_state, Mapping):
            raise ValueError(f"extra_state must be a dict of plain values, not a {type(extra_state).__name__}")
        try:
            return json.dumps(dict(extra_state), sort_keys=True, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"extra_state cannot be saved as JSON ({exc}); keep to dicts, lists, strings, finite numbers, "
                f"bools and None (convert tensors with .tolist() or .item())"
            ) from None

    body = _agreed(model, encode)
    bodies = collectives.all_gather_object(body, model.world_group)
    differ = [r for r, b in enumerate(bodies) if b != bodies[0]]
    if differ:
        raise ValueError(
            f"extra_state differs between rank 0 and rank(s) {differ}; nothing was saved. Pass the same "
            f"value on every rank (gather per-rank values into one dict first)"
        )
    return body


@collectives.holds_interrupt
def save_checkpoint(
    path: str,
    model: "ShardedModule",
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra_state: Mapping[str, Any] | None = None,
    blocking: bool = True,
) -> "Future[None] | None":
    """Save the sharded model (and optimizer) state to the directory ``path`` with DCP; every rank
    writes its own shards, and a manifest records every file's size and xxh3-64 hash. Load it at any
    world size with ``load_checkpoint``.

    ``extra_state``, a dict of plain JSON values that is the same on every rank (the training
    loop's position in its data, say), is saved inside the same atomic directory and comes back
    from ``load_checkpoint``.

    ``blocking=False`` (as ``torch.distributed.checkpoint.async_save``): the state is staged to CPU
    memory (a copy), and the write, the checksums and the commit run on a helper thread over a
    process group of their own, with the same atomicity; the call returns a ``Future`` at once and
    training may go on. A later save (or load) waits for it first; ``result()`` raises its error.
    """
    model.check_between_steps("save_checkpoint")
    model.agree_on_call("save_checkpoint")
    wait_for_saves()  # a second save waits for the first
    body = _encode_extra_state(extra_state, model)
    return save_checkpoint_with(path, model, optimizer, extra_files={} if body is None else {files.EXTRA_STATE: body}, blocking=blocking)


def save_checkpoint_with(
    path: str,
    model: "ShardedModule",
    optimizer: torch.optim.Optimizer | None,
    *,
    extra_files: Mapping[str, bytes],
    blocking: bool = True,
) -> "Future[None] | None":
    """``save_checkpoint``, with more files in the same commit: the mesh's first rank writes
    ``extra_files`` (name -> bytes; the other ranks' values are ignored) into the checkpoint
    directory, and the manifest covers them. ``load_checkpoint_with`` reads them back."""
    global _pending
    wait_for_saves()
    if optimizer is not None:
        state_dict.agree_on_optimizer(model, optimizer, "save_checkpoint")
    state: dict[str, Any] = {"model": _first_ranks_buffers(model, model.state_dict())}
    if optimizer is not None:
        # no template for a fresh optimizer: its checkpoint holds no state, and loads as a fresh one
        state["optim"] = state_dict.sharded_optim_state_dict(model, optimizer, template=False)
    extras = dict(extra_files)
    if blocking:
        _save(path, state, extras, model, model.world_group)
        return None
    group = collectives.checkpoint_group_for(model.world_group)
    staged = _staged(state)
    _pending = _SAVER.submit(_save, path, staged, extras, model, group)
    return _pending


def _write_file(directory: str, name: str, body: bytes) -> files.FileRecord:
    """Write ``body`` to ``directory/name``, flushed to disk; its manifest record."""
    target = os.path.join(directory, name)
    with open(target, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    return files.checksum(target)


def _save(path: str, state: dict[str, Any], extras: dict[str, bytes], model: "ShardedModule", group: collectives.Group) -> None:
    """Write ``state`` (and the first rank's ``extras``: file name -> bytes) into a temporary
    directory beside ``path``, record checksums, and have the first rank publish it
    (``_commit``); every collective runs over ``group``.

    A failure on one rank between collectives (an error, or an interrupt: ``KeyboardInterrupt``
    on one rank) still reaches the next collective as that rank's answer, so every rank fails
    together, the temporary directory goes only once no rank writes into it, and the ranks stay
    in step for whatever the program does next (design/notes/failure-modes.md)."""
    rank, world = collectives.group_rank(group), collectives.group_size(group)
    own: BaseException | None = None

    def together(work: Callable[[], Any]) -> list[Any]:
        """``work()`` here, and every rank's result or failure (a string) from one gather."""
        nonlocal own
        try:
            mine = work()
        except BaseException as exc:
            own, mine = exc, f"rank {rank}: {type(exc).__name__}: {exc}"
        parts = collectives.all_gather_object(mine, group)
        failures = [p for p in parts if isinstance(p, str)]
        if failures:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)  # no rank writes into it any more
            if own is not None and not isinstance(own, Exception):
                raise own  # an interrupt, or DCP's CheckpointException (every rank has it)
            raise RuntimeError(f"checkpoint '{path}' could not be saved ({failures[0]}); what was at that path is unchanged")
        return parts

    def start() -> tuple[str]:
        _reached("started")
        return (f"{path}.tmp-{uuid.uuid4().hex[:8]}",)

    tmp = ""
    tmp = together(start)[0][0]  # the first rank's name

    def write() -> dict[str, files.FileRecord]:
        metadata = _write(state, tmp, group)  # DCP gathers a failure while writing itself
        _reached("written")
        return _my_checksums(tmp, metadata, rank, world)

    parts = together(write)  # every rank has finished writing here
    records: dict[str, files.FileRecord] = {}
    for part in parts:
        records.update(part)
    failure = None
    if rank == 0:
        try:
            for name, body in extras.items():
                records[name] = _write_file(tmp, name, body)
            files.write_manifest(tmp, records)
            _reached("agreed")
            _commit(tmp, path)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            own, failure = exc, f"rank 0: {type(exc).__name__}: {exc}"
    failure = _agree(failure, model, group)  # every rank waits here for the commit
    if own is not None and not isinstance(own, Exception):
        raise own
    if failure:
        raise RuntimeError(f"checkpoint '{path}' could not be saved ({failure}); what was at that path is unchanged")


def _refusal(path: str, exc: CheckpointError) -> CheckpointError:
    """``exc`` (which names the file) as the error a load raises: the checkpoint, what was (not)
    done, and what to do."""
    if isinstance(exc, UnsafeCheckpointError):
        advice = (
            "Nothing in it was run. save_checkpoint never writes such objects: the checkpoint was altered "
            "or made elsewhere, so load it only if you know who made it"
        )
    else:
        advice = "Restore the checkpoint from a copy or load an earlier one"
    return type(exc)(f"checkpoint '{path}': {exc}; nothing was loaded. {advice}")


def _check_files(path: str) -> dict[str, files.FileRecord] | None:
    try:
        return files.check_files(path)
    except CheckpointError as exc:
        raise _refusal(path, exc) from None


def _verify(path: str, records: dict[str, files.FileRecord] | None, names: list[str]) -> None:
    problems = files.verify(path, records, names) if records else []
    if problems:
        raise _refusal(path, DamagedCheckpointError("; ".join(problems)))


def _read_metadata(path: str, records: dict[str, files.FileRecord] | None) -> Metadata:
    try:
        return files.read_metadata(path, records)
    except CheckpointError as exc:
        raise _refusal(path, exc) from None


def _warn_unverified(path: str) -> None:
    warnings.warn(
        f"checkpoint '{path}' has no {files.MANIFEST} (saved before shardwrap recorded checksums): "
        f"its files are loaded unverified; save it again to add one",
        UnverifiedCheckpointWarning,
        stacklevel=3,
    )


def _optim_template(
    model: "ShardedModule", optimizer: torch.optim.Optimizer, entries: list[tuple[tuple[str | int, ...], Any]]
) -> tuple[dict[str, Any], list[str]]:
    """Scratch tensors for the optimizer entries the checkpoint holds, built from its metadata
    (the optimizer itself is not touched), and the problems those entries have: state for
    parameters the optimizer does not hold, state of another shape."""
    if not entries:
        return {}, ["it holds no optimizer state: pass optimizer=None to load the model alone"]
    index = state_dict.optimizer_slots(model, optimizer)
    rank = model.shard_rank  # which rows of each parameter (and of its state) this rank holds
    template: dict[str, Any] = {"state": {}, "param_groups": []}
    unknown: list[str] = []
    problems: list[str] = []
    for path, entry in entries:
        value: Any = None  # a non-tensor entry: DCP puts the loaded value here
        if path[0] == "state" and len(path) == 3:
            name, key = str(path[1]), path[2]
            if name not in index:
                unknown += [name] if name not in unknown else []
                continue
            slot = index[name][1]
            if isinstance(entry, TensorStorageMetadata):
                size, dtype = tuple(entry.size), entry.properties.dtype
                if size and size != tuple(slot.full_shape):
                    problems.append(f"shape mismatch for optimizer state '{name}'.{key}: checkpoint {size} vs parameter {tuple(slot.full_shape)}")
                    continue
                if size:  # saved as a Shard(0) DTensor of the parameter's full shape
                    value = state_dict.as_dtensor(torch.empty(slot.sharded_shape(rank), dtype=dtype), slot, model)
                else:
                    value = torch.empty((), dtype=dtype)
        elif not (path[0] == "param_groups" and len(path) == 3 and isinstance(path[1], int)):
            continue  # not an optimizer state dict's entry: left out
        files.set_path(template, path, value)
    if unknown:
        problems.insert(0, f"optimizer state for parameters this optimizer does not hold: {state_dict.listed(unknown)}")
    return template, problems


def _scratch(path: str, metadata: Metadata, model: "ShardedModule", optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Scratch copies for DCP to fill, after checking the checkpoint's keys and shapes (from its
    metadata alone) against the model and optimizer."""
    found: dict[str, tuple[int, ...] | str] = {}
    optim_entries = []
    for key, entry_path in files.entry_paths(metadata).items():
        entry = metadata.state_dict_metadata[key]
        if entry_path[0] == "model" and len(entry_path) == 2:
            found[str(entry_path[1])] = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else "non-tensor value"
        elif entry_path[0] == "optim" and len(entry_path) > 1:
            optim_entries.append((entry_path[1:], entry))
    problems = state_dict.key_problems(found, state_dict.expected_shapes(model), strict=True)
    scratch: dict[str, Any] = {}
    if optimizer is not None:
        scratch["optim"], optim_problems = _optim_template(model, optimizer, optim_entries)
        problems += optim_problems
    if problems:
        raise ValueError(
            f"checkpoint '{path}' does not fit this model{' and optimizer' if optimizer is not None else ''}: "
            f"{len(problems)} problem(s), nothing was loaded: " + "; ".join(problems)
            + ". Load it into a model (and optimizer) built like the ones that saved it"
        )
    scratch["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return scratch


def _read_into(path: str, reader: files.SafeReader, scratch: dict[str, Any], *, no_dist: bool = False) -> None:
    """DCP fills ``scratch`` from the files, through the safe reader and planner."""
    try:
        dcp.load(scratch, storage_reader=reader, planner=files.PlainValuePlanner(path), no_dist=no_dist)
    except CheckpointException as exc:  # a BaseException: DCP gathered every rank's failure
        first = exc.failures[min(exc.failures)][0] if exc.failures else exc
        if isinstance(first, CheckpointError):
            raise _refusal(path, first) from None
        raise RuntimeError(
            f"checkpoint '{path}' could not be loaded into this model ({type(first).__name__}: {first}); "
            f"the model and optimizer are unchanged"
        ) from None
    except CheckpointError as exc:
        raise _refusal(path, exc) from None


def _read_extra_state(path: str, records: dict[str, files.FileRecord] | None) -> dict[str, Any] | None:
    try:
        return files.read_extra_state(path, records)
    except CheckpointError as exc:
        raise _refusal(path, exc) from None


def load_checkpoint(
    path: str, model: "ShardedModule", optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any] | None:
    """Load a checkpoint written by ``save_checkpoint`` at any world size. Returns the
    ``extra_state`` it was saved with (None when it was saved without one), read and verified
    before anything is written.

    Raises on every rank, with the model and optimizer unchanged, when a file is damaged
    (``DamagedCheckpointError``), holds a pickled object other than DCP's metadata, tensors and
    plain values (``UnsafeCheckpointError``), or does not fit the model or optimizer (``ValueError``
    naming the first offending keys with both shapes). A checkpoint without a manifest (saved
    before checksums existed) loads with an ``UnverifiedCheckpointWarning``."""
    return _load(path, model, optimizer, _read_extra_state)


def load_checkpoint_with(
    path: str, model: "ShardedModule", optimizer: torch.optim.Optimizer | None, *, extra_files: list[str]
) -> dict[str, Any]:
    """``load_checkpoint`` of a ``save_checkpoint_with`` directory. Returns each of
    ``extra_files`` read with ``torch.load(weights_only=True)`` (tensors and plain values only),
    checked against the manifest before anything is written; a file that is not there is an error."""
    return _load(path, model, optimizer, lambda where, records: {n: _read_torch_file(where, n, records) for n in extra_files})


def _read_torch_file(path: str, name: str, records: dict[str, files.FileRecord] | None) -> Any:
    target = os.path.join(path, name)
    try:
        if records is not None:
            if name not in records:
                why = "it was added after the save" if os.path.exists(target) else "the checkpoint was saved without it"
                raise DamagedCheckpointError(f"file '{target}' is not in the manifest ({why})")
            problems = files.verify(path, records, [name])
            if problems:
                raise DamagedCheckpointError("; ".join(problems))
        elif not os.path.exists(target):
            raise DamagedCheckpointError(f"file '{target}' is missing")
        try:
            return torch.load(target, map_location="cpu", weights_only=True)
        except Exception as exc:
            if files.refused_object(exc):
                raise UnsafeCheckpointError(f"file '{target}' holds an object that is not a tensor or plain value ({files.gist(exc)}) and was not unpickled") from None
            raise DamagedCheckpointError(f"file '{target}' could not be read ({type(exc).__name__}: {files.gist(exc)})") from None
    except CheckpointError as exc:
        raise _refusal(path, exc) from None


@collectives.holds_interrupt
def _load(
    path: str, model: "ShardedModule", optimizer: torch.optim.Optimizer | None, read_extras: Callable[[str, Any], T]
) -> T:
    """The load: ``read_extras(path, records)`` reads what the caller keeps beside the state,
    checked like the rest before anything is written."""
    model.check_between_steps("load_checkpoint")
    model.agree_on_call("load_checkpoint")
    wait_for_saves()
    rank, world = model.world_rank, model.world_size
    found = _agreed(model, lambda: _published(path) if rank == 0 else None)  # an error on rank 0 reaches every rank
    path = _agree(found, model)
    records = _agreed(model, lambda: _check_files(path))
    if records is None and rank == 0:
        _warn_unverified(path)
    metadata = _agreed(model, lambda: _read_metadata(path, records))
    extra_state = _agreed(model, lambda: read_extras(path, records))
    scratch = _agreed(model, lambda: _scratch(path, metadata, model, optimizer))
    # Each rank verifies its share of the data files, while DCP reads them where it can.
    mine = files.share(files.data_files(metadata), rank, world)
    reader = files.SafeReader(path, metadata, records, verify=mine)
    _read_into(path, reader, scratch)
    _agreed(model, lambda: _verify(path, records, [n for n in mine if n not in reader.verified]))
    if optimizer is not None:
        osd = scratch["optim"]
        problems = _agreed(model, lambda: state_dict.sharded_optim_problems(model, optimizer, osd))
        if problems:
            raise ValueError(
                f"checkpoint '{path}' does not fit this optimizer: {len(problems)} problem(s), nothing was loaded: "
                + "; ".join(problems) + ". Build the optimizer with the parameter groups it was saved with"
            )
        optimizer.load_state_dict(state_dict.sharded_optim_load(model, optimizer, osd, copy=False))
    state_dict.commit_writes(model, state_dict.model_writes(model, scratch["model"]))
    return extra_state


def export_to_torch_save(checkpoint_dir: str, out_file: str) -> None:
    """Convert a DCP checkpoint into one ``torch.save`` file of full tensors, atomically.
    Run it in one process; ``torch.load(out_file, weights_only=True)["model"]`` loads into the
    unwrapped model. The checkpoint is verified and read as ``load_checkpoint`` reads it."""
    whole = read_whole(checkpoint_dir)
    save_atomically({**whole, CHECKSUM_KEY: content_digest(whole)}, out_file)


def read_whole(checkpoint_dir: str, extra_files: Sequence[str] = ()) -> dict[str, Any]:
    """Everything a DCP checkpoint holds as full tensors and plain values, in one process, verified
    and read as ``load_checkpoint`` reads it; with each of ``extra_files`` (``save_checkpoint_with``)
    under its name."""
    checkpoint_dir = _published(checkpoint_dir)
    records = _check_files(checkpoint_dir)
    if records is None:
        _warn_unverified(checkpoint_dir)
    metadata = _read_metadata(checkpoint_dir, records)
    extras = {name: _read_torch_file(checkpoint_dir, name, records) for name in extra_files}
    state = files.empty_state(metadata)
    reader = files.SafeReader(checkpoint_dir, metadata, records, verify=files.data_files(metadata))
    _read_into(checkpoint_dir, reader, state, no_dist=True)
    _verify(checkpoint_dir, records, [n for n in files.data_files(metadata) if n not in reader.verified])
    return {**state, **extras}


def save_atomically(state: Any, out_file: str) -> None:
    """``torch.save(state, out_file)`` through a temporary name, so ``out_file`` is whole or absent."""
    tmp = f"{out_file}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, out_file)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# ---- single files (torch.save) -------------------------------------------------------------------

# The key under which a single file keeps the hash of the rest of its contents (``save_full``,
# ``export_to_torch_save``), as "<algorithm>:<hex digest>"; ``load_full`` refuses a file whose
# contents no longer match it (design/notes/safe-loading.md).
CHECKSUM_KEY = "shardwrap_checksum"


def content_digest(value: Any) -> str:
    """The hash of a checkpoint's contents, as ``CHECKSUM_KEY`` holds it: every key, value, dtype,
    shape and tensor byte, in order (what ``torch.load`` gives back, so it is computed alike on
    both sides), with the algorithm the manifests use (xxh3-64)."""
    digest = xxhash.xxh3_64()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            digest.update(f"T{t.dtype}{tuple(t.shape)};".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(v, Mapping):
            digest.update(f"D{len(v)};".encode())
            for k, item in v.items():
                walk(k)
                walk(item)
        elif isinstance(v, (list, tuple)):
            digest.update(f"{type(v).__name__}{len(v)};".encode())
            for item in v:
                walk(item)
        else:
            digest.update(f"{type(v).__name__}:{v!r};".encode())

    walk(value)
    return f"xxh3_64:{digest.hexdigest()}"


@collectives.holds_interrupt
def save_full(path: str, model: "ShardedModule", optimizer: torch.optim.Optimizer | None = None) -> None:
    """Gather full model (and optimizer) state on the first rank and ``torch.save`` it atomically:
    a plain PyTorch checkpoint that loads into the unwrapped model."""
    if optimizer is not None:
        state_dict.agree_on_optimizer(model, optimizer, "save_full")
    state: dict[str, Any] = {"model": model.full_state_dict()}
    if optimizer is not None:  # as model.full_optim_state_dict, less the optimizer check made above
        model.agree_on_call("full_optim_state_dict")
        state["optim"] = state_dict.full_optim_state_dict(model, optimizer, True)
    if model.world_rank == 0:
        state[CHECKSUM_KEY] = content_digest(state)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        torch.save(state, tmp)
        os.replace(tmp, path)
    collectives.barrier(model.world_group)


def _read_full(
    path: str, model: "ShardedModule", optimizer: torch.optim.Optimizer | None, layout: Callable[[Any], dict[str, Any]]
) -> dict[str, Any]:
    """The file's contents (tensors and plain values only) as ``layout`` finds ``{"model": ...,
    "optim": ...}`` in them, checked against model and optimizer."""
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(content, dict) and CHECKSUM_KEY in content:
            recorded = content.pop(CHECKSUM_KEY)
            if recorded != content_digest(content):
                damaged = DamagedCheckpointError(f"its contents do not match the checksum recorded when it was saved ({recorded!r}): bytes changed")
                raise _refusal(path, damaged)
        state = layout(content)
    except CheckpointError:
        raise
    except Exception as exc:
        if files.refused_object(exc):
            unsafe = UnsafeCheckpointError(f"it holds an object that is not a tensor or plain value ({files.gist(exc)}) and was not unpickled")
            raise _refusal(path, unsafe) from None
        raise RuntimeError(f"checkpoint '{path}' could not be read ({type(exc).__name__}: {exc}); the model is unchanged") from None
    problems = state_dict.check_full(model, optimizer, state)
    if problems:
        raise ValueError(
            f"checkpoint '{path}': {len(problems)} problem(s), nothing was loaded: " + "; ".join(problems)
            + ". Load it into a model (and optimizer) built like the ones that saved it"
        )
    return state


def load_full(path: str, model: "ShardedModule", optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a ``save_full`` file (or any ``{"model": state_dict}`` file) at any world size. The first
    rank reads it with ``torch.load(weights_only=True)`` and checks everything before any rank
    writes anything."""
    load_full_with(path, model, optimizer, lambda content: content)


@collectives.holds_interrupt
def load_full_with(
    path: str, model: "ShardedModule", optimizer: torch.optim.Optimizer | None, layout: Callable[[Any], dict[str, Any]]
) -> dict[str, Any]:
    """``load_full`` of a file laid out otherwise: ``layout(content)`` gives ``{"model": state
    dict, "optim": optimizer state dict, ...}`` (raising ``KeyError``/``TypeError`` when the file is
    not so laid out). Returns the other keys of that dict, on every rank."""
    model.check_between_steps("load_full")
    model.agree_on_call("load_full")
    is_src = model.world_rank == 0
    state = _agreed(model, lambda: _read_full(path, model, optimizer, layout) if is_src else {})
    # Checked in full above: the optimizer goes first, since torch's load_state_dict is the one
    # step with checks of its own; the model's scatter cannot fail after check_full.
    if optimizer is not None:
        model.load_full_optim_state_dict(optimizer, state.get("optim", {}))
    model.load_full_state_dict(state.get("model", {}))
    rest = {k: v for k, v in state.items() if k not in ("model", "optim")} if is_src else None
    return _agree(rest, model)
