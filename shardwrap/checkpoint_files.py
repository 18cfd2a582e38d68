"""The files of a checkpoint, read without trusting them [design/notes/safe-loading.md].

``checkpoint.py`` decides what to save and load; this module is what touches the bytes:

- The manifest (``shardwrap-manifest.json``): the size and xxh3-64 hash of every file of a DCP
  checkpoint (manifests saved with CRC-32s before are still read and verified). ``save_checkpoint``
  writes it inside the temporary directory, so the rename that commits the checkpoint commits the
  manifest with it; loads check every file against it before reading anything into a model. It is
  JSON followed by the CRC-32 of that JSON: damage to the manifest itself is caught too.
- DCP's ``.metadata`` is a pickle. It is read here by an unpickler that builds nothing but DCP's
  metadata classes and the torch values inside them (``torch.Size``, dtypes, layouts), then checked
  field by field. DCP's own ``FileSystemReader.read_metadata`` (a plain ``pickle.load``) is never
  called.
- ``SafeReader`` hands DCP that checked metadata, reads the data files (verifying this rank's
  share of them against the manifest as it reads: every byte once) and names the file behind any
  failure; tensors are parsed with ``torch.load(weights_only=True)``, as DCP's own reader does.
  ``PlainValuePlanner`` loads non-tensor entries with ``torch.load(weights_only=True)`` too, where
  DCP's ``DefaultLoadPlanner.load_bytes`` uses ``weights_only=False``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import pickle
import re
import zlib
from typing import IO, Any, Callable, Mapping, Protocol, Sequence, cast

import torch
import xxhash
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

MANIFEST = "shardwrap-manifest.json"
EXTRA_STATE = "shardwrap-extra-state.json"  # the caller's JSON (``save_checkpoint(extra_state=...)``)
METADATA = ".metadata"
_FORMAT = "shardwrap-manifest/1"
_CHUNK = 8 << 20  # bytes read at a time when hashing


class CheckpointError(RuntimeError):
    """A checkpoint on disk that shardwrap refuses to load; the message names the file."""


class DamagedCheckpointError(CheckpointError):
    """A file is missing, truncated, or its bytes changed since it was saved."""


class UnsafeCheckpointError(CheckpointError):
    """A file holds a pickled object that shardwrap does not build (it could run code)."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without a manifest (saved before shardwrap recorded checksums) was loaded."""


# ---- the manifest -----------------------------------------------------------------------------


class Hasher(Protocol):
    """An incremental hash, fed a file's bytes in order (xxhash's hashers have this shape)."""

    def update(self, data: memoryview, /) -> None: ...

    def intdigest(self) -> int: ...


class _Crc32:
    """``zlib.crc32`` as a ``Hasher``: how the manifests of the previous release are verified."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: memoryview, /) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def intdigest(self) -> int:
        return self._crc


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A checksum that a manifest may name."""

    label: str  # its name in messages
    digits: int  # hex digits of a digest in the manifest
    new: Callable[[], Hasher]


# By the name the manifest's "algorithm" field (and each file's digest key) gives them.
ALGORITHMS: dict[str, Algorithm] = {
    "xxh3_64": Algorithm("xxh3-64", 16, xxhash.xxh3_64),
    "crc32": Algorithm("CRC-32", 8, _Crc32),
}
ALGORITHM = "xxh3_64"  # what new checkpoints are saved with: about 4x the speed of zlib.crc32 here


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """A file as the manifest records it: its size and its digest under ``algorithm``."""

    size: int
    algorithm: str  # a key of ALGORITHMS
    digest: int

    def hex(self) -> str:
        return f"{self.digest:0{ALGORITHMS[self.algorithm].digits}x}"


def checksum(path: str, algorithm: str = ALGORITHM) -> FileRecord:
    """The size and digest of the file at ``path``, read in chunks."""
    hasher, size = ALGORITHMS[algorithm].new(), 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])
            size += n
    return FileRecord(size, algorithm, hasher.intdigest())


def write_manifest(directory: str, records: Mapping[str, FileRecord]) -> None:
    """Write the manifest of ``records`` (all hashed with one algorithm) into ``directory`` and
    flush it to disk. Its trailer stays the CRC-32 of the JSON, whatever the files' algorithm: the
    JSON is small, and the algorithm it names can only be trusted once the trailer matched."""
    (algorithm,) = {r.algorithm for r in records.values()}
    body = json.dumps(
        {
            "format": _FORMAT,
            "algorithm": algorithm,
            "files": {name: {"size": r.size, algorithm: r.hex()} for name, r in sorted(records.items())},
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    with open(os.path.join(directory, MANIFEST), "wb") as f:
        f.write(body + b"\n" + b"crc32 %08x\n" % zlib.crc32(body))
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: str) -> dict[str, FileRecord] | None:
    """The manifest of the checkpoint in ``directory``, or None when it has none (a checkpoint
    saved before manifests existed). A damaged manifest raises ``DamagedCheckpointError``."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        raw = f.read()
    parts = raw.split(b"\n")
    if len(parts) != 3 or parts[2] != b"" or parts[1] != b"crc32 %08x" % zlib.crc32(parts[0]):
        raise DamagedCheckpointError(f"the manifest '{path}' is damaged (its own CRC-32 does not match)")
    try:
        content = json.loads(parts[0])
        if content["format"] != _FORMAT:
            raise ValueError(f"format {content['format']!r}")
        algorithm = content["algorithm"]
        if algorithm not in ALGORITHMS:
            raise DamagedCheckpointError(
                f"the manifest '{path}' uses the checksum algorithm {algorithm!r}, which this version of "
                f"shardwrap does not know (it knows {', '.join(sorted(ALGORITHMS))})"
            )
        files = content["files"]
        records = {name: FileRecord(int(e["size"]), algorithm, int(e[algorithm], 16)) for name, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DamagedCheckpointError(f"the manifest '{path}' is not a shardwrap manifest ({exc})") from None
    if any(not _is_plain_name(name) for name in records) or METADATA not in records:
        raise DamagedCheckpointError(f"the manifest '{path}' lists no {METADATA} or names a file outside the checkpoint")
    return records


def share(names: Sequence[str], rank: int, world: int) -> list[str]:
    """The files that ``rank`` checksums: ``__r_*`` files for rank ``r`` (the files it wrote or,
    at the same world size, will read), the others dealt out in name order. The same split on every
    rank, from the names alone."""
    mine, rest = [], []
    for name in sorted(names):
        found = re.match(r"__(\d+)_", name)
        if found and int(found.group(1)) < world:
            if int(found.group(1)) == rank:
                mine.append(name)
        else:
            rest.append(name)
    return mine + rest[rank::world]


def verify(directory: str, records: Mapping[str, FileRecord], names: Sequence[str]) -> list[str]:
    """A problem for each file of ``names`` whose size or digest differs from ``records``."""
    problems = []
    for name in names:
        path, want = os.path.join(directory, name), records[name]
        if not os.path.isfile(path):
            problems.append(f"file '{path}' is missing")
            continue
        size = os.path.getsize(path)
        got = checksum(path, want.algorithm) if size == want.size else dataclasses.replace(want, size=size)  # not read
        problem = _mismatch(path, want, got)
        if problem:
            problems.append(problem)
    return problems


def _mismatch(path: str, want: FileRecord, got: FileRecord) -> str | None:
    """How the file at ``path`` as read (``got``) differs from its record (``want``), or None."""
    if got.size != want.size:
        return f"file '{path}' has {got.size} bytes, the manifest says {want.size} (truncated or overwritten)"
    if got.digest != want.digest:
        return (
            f"file '{path}' fails its {ALGORITHMS[want.algorithm].label} check (saved {want.hex()}, now {got.hex()}): "
            "its bytes changed since it was saved"
        )
    return None


def check_files(directory: str) -> dict[str, FileRecord] | None:
    """Check that ``directory`` is a DCP checkpoint, read its manifest and verify its ``.metadata``
    (before anything unpickles it). Returns the manifest (None for a checkpoint without one). The
    data files are verified while they are read (``SafeReader``) or by ``verify``."""
    if not os.path.isfile(os.path.join(directory, METADATA)):
        raise FileNotFoundError(f"checkpoint '{directory}': no DCP checkpoint there (no {METADATA} file)")
    records = read_manifest(directory)
    if records is not None:
        problems = verify(directory, records, [METADATA])
        if problems:
            raise DamagedCheckpointError("; ".join(problems))
    return records


def read_extra_state(directory: str, records: Mapping[str, FileRecord] | None) -> dict[str, Any] | None:
    """The extra state saved with the checkpoint in ``directory`` (a JSON object), or None when it
    was saved without one. With a manifest, the file must be listed in it and match its record: a
    listed file that is gone, or an unlisted one that appeared, is damage."""
    path = os.path.join(directory, EXTRA_STATE)
    listed = records is not None and EXTRA_STATE in records
    if not listed and not os.path.exists(path):
        return None
    if records is not None:
        if not listed:
            raise DamagedCheckpointError(f"file '{path}' is not in the manifest (it was added after the save)")
        problems = verify(directory, records, [EXTRA_STATE])
        if problems:
            raise DamagedCheckpointError("; ".join(problems))
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise DamagedCheckpointError(f"file '{path}' is not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise DamagedCheckpointError(f"file '{path}' holds a JSON {type(value).__name__}, not an object")
    return value


def data_files(metadata: Metadata) -> list[str]:
    """The data files DCP's metadata points into, by name."""
    return sorted({info.relative_path for info in metadata.storage_data.values()})


def _is_plain_name(name: Any) -> bool:
    """A file name directly inside the checkpoint directory: no separators, no '..'."""
    return isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name and "\\" not in name


# ---- DCP's metadata, unpickled without running code --------------------------------------------


def _layout_named(name: str) -> torch.layout:
    """Rebuild a layout from its name, which is how torch pickles one."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise _Refused(f"'{name}' is not a torch layout")
    return value


def _metadata_classes() -> dict[tuple[str, str], Any]:
    # _StorageInfo and _MEM_FORMAT_ENCODING are private to torch, but they are what DCP pickles
    # into .metadata: no public name exists for them.
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    classes: list[Any] = [Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                          TensorProperties, StorageMeta, MetadataIndex, _MEM_FORMAT_ENCODING]
    allowed: dict[tuple[str, str], Any] = {("torch.distributed.checkpoint.metadata", c.__name__): c for c in classes}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _layout_named
    # The checkpoint id DCP records (unused when loading) is a path: keep it as a pure path.
    for module in ("pathlib", "pathlib._local"):
        for name in ("PosixPath", "PurePosixPath"):
            allowed[(module, name)] = pathlib.PurePosixPath
        for name in ("WindowsPath", "PureWindowsPath"):
            allowed[(module, name)] = pathlib.PureWindowsPath
    return allowed


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's metadata is made of; any other global is refused before it is looked
    up, so nothing named in the file is imported or called."""

    _allowed = _metadata_classes()

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"it asks for '{module}.{name}', which is not part of DCP's metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it holds a persistent id, which DCP's metadata never does")


def read_metadata(directory: str, records: Mapping[str, FileRecord] | None) -> Metadata:
    """DCP's metadata of the checkpoint in ``directory``, unpickled without running code and
    checked: every data file it names lies in the directory (and in the manifest, if any)."""
    path = os.path.join(directory, METADATA)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as exc:
        raise UnsafeCheckpointError(f"'{path}' was not unpickled: {exc}") from None
    except Exception as exc:
        raise DamagedCheckpointError(f"'{path}' could not be read as DCP metadata ({type(exc).__name__}: {exc})") from None
    problem = _metadata_problem(metadata)
    if problem:
        raise DamagedCheckpointError(f"'{path}' is not valid DCP metadata: {problem}")
    if records is not None:
        unlisted = sorted({info.relative_path for info in metadata.storage_data.values()} - set(records))
        if unlisted:
            raise DamagedCheckpointError(f"'{path}' names files the manifest does not list: {unlisted}")
    return metadata


def _metadata_problem(md: Any) -> str | None:
    """What is wrong with the structure of an unpickled ``.metadata``, or None."""
    if not isinstance(md, Metadata):
        return f"it holds a {type(md).__name__}"
    if not isinstance(md.state_dict_metadata, dict):
        return "no table of entries"
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            return f"an entry named {key!r}"
        if isinstance(entry, TensorStorageMetadata):
            sizes_ok = isinstance(entry.size, torch.Size) and isinstance(entry.chunks, list) and all(
                isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size) and isinstance(c.sizes, torch.Size)
                for c in entry.chunks
            )
            if not sizes_ok or not isinstance(entry.properties, TensorProperties) or not isinstance(entry.properties.dtype, torch.dtype):
                return f"entry '{key}' is not a well-formed tensor description"
        elif not isinstance(entry, BytesStorageMetadata):
            return f"entry '{key}' is a {type(entry).__name__}"
    if not isinstance(md.storage_data, dict):
        return "no table of storage locations"
    for index, info in md.storage_data.items():
        relative = getattr(info, "relative_path", None)
        if not isinstance(index, MetadataIndex) or type(info).__name__ != "_StorageInfo":
            return "a storage location of the wrong type"
        if not _is_plain_name(relative) or relative == METADATA:
            return f"entry '{index.fqn}' points at {relative!r}, not a data file inside the checkpoint"
        if not all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)):
            return f"entry '{index.fqn}' has a bad offset or length"
        if info.transform_descriptors:
            return f"entry '{index.fqn}' was written through stream transforms {list(info.transform_descriptors)}, which shardwrap does not read"
    if md.planner_data is not None:
        if not isinstance(md.planner_data, dict) or not all(
            isinstance(k, str) and isinstance(p, tuple) and p and all(isinstance(x, (str, int)) for x in p)
            for k, p in md.planner_data.items()
        ):
            return "malformed key paths (planner_data)"
    return None


def entry_paths(metadata: Metadata) -> dict[str, tuple[str | int, ...]]:
    """Each entry's path in the nested state dict that was saved (``"optim.state.w.step"`` ->
    ``("optim", "state", "w", "step")``); an entry without one is a top-level key."""
    recorded = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {key: tuple(recorded.get(key, (key,))) for key in metadata.state_dict_metadata}


def set_path(root: dict[str, Any], path: Sequence[str | int], value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, creating dicts (for string keys) and lists (for
    integer keys) on the way."""
    node: Any = root
    for key, following in zip(path, path[1:]):
        child = _get(node, key)
        if child is None:
            child = [] if isinstance(following, int) else {}
            _put(node, key, child)
        node = child
    _put(node, path[-1], value)


def _get(node: Any, key: str | int) -> Any:
    if isinstance(node, list):
        return node[int(key)] if int(key) < len(node) else None
    return node.get(key)


def _put(node: Any, key: str | int, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (int(key) + 1 - len(node)))
        node[int(key)] = value
    else:
        node[key] = value


def empty_state(metadata: Metadata) -> dict[str, Any]:
    """The saved state dict's structure with zero tensors of the saved full shapes and ``None`` for
    non-tensor values: a template that DCP fills (``export_to_torch_save``)."""
    state: dict[str, Any] = {}
    for key, path in entry_paths(metadata).items():
        entry = metadata.state_dict_metadata[key]
        value = torch.zeros(entry.size, dtype=entry.properties.dtype) if isinstance(entry, TensorStorageMetadata) else None
        set_path(state, path, value)
    return state


# ---- DCP reader and planner ---------------------------------------------------------------------


def gist(exc: BaseException) -> str:
    """The informative part of an unpickling error (torch's weights-only errors are long)."""
    text = str(exc)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return f"it asks for '{found.group(1)}'"
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    if found:
        return found.group(1)
    return text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__


def refused_object(exc: BaseException) -> bool:
    """Whether torch's weights-only unpickler stopped at an object it does not build (a global,
    or a call of one), rather than at bytes that are no pickle at all (damage)."""
    return isinstance(exc, pickle.UnpicklingError) and re.search(
        r"[Gg]lobal|reduce for unrecognized function|Can only create new object", str(exc)
    ) is not None


class SafeReader(FileSystemReader):
    """DCP's file reader, given metadata that ``read_metadata`` above already read and checked.

    DCP never opens ``.metadata`` through it. Each data file's entries are read in order of offset
    and parsed with ``torch.load(weights_only=True)``; a failure names the file. The files named
    in ``verify`` are read from start to end, gaps included, through the hash their manifest names,
    compared with the manifest when the file ends: every byte is read once, and a file that fails
    raises ``DamagedCheckpointError``. DCP only fills scratch copies, so nothing reaches the model before
    every verdict is in (the bytes of a damaged file reach only torch's weights-only unpickler)."""

    def __init__(
        self, directory: str, metadata: Metadata, records: Mapping[str, FileRecord] | None = None, verify: Sequence[str] = ()
    ) -> None:
        super().__init__(directory)
        self._directory = directory
        self._checked = metadata
        self._records = records or {}
        self._verify = set(verify) & set(self._records)
        self.verified: set[str] = set()  # the files read through the hash and found intact

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._checked.storage_meta is None:
            self._checked.storage_meta = StorageMeta()
        self._checked.storage_meta.load_id = self.load_id
        return self._checked

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in sorted(by_file.items()):
            path = os.path.join(self._directory, name)
            try:
                if name in self._verify:
                    self._read_verified(path, self._records[name], items, planner)
                    self.verified.add(name)
                else:
                    self._read(path, items, planner)
            except Exception as exc:
                raise _file_error(path, exc) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _entries(self, items: list[ReadItem]) -> list[tuple[Any, list[ReadItem]]]:
        """The stored ranges these items read, in file order, each with its items."""
        ranges: dict[tuple[int, int], list[ReadItem]] = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            ranges.setdefault((info.offset, info.length), []).append(item)
        return sorted(ranges.items())

    def _read(self, path: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        buffer = _EntryBuffer()
        with open(path, "rb", buffering=0) as f:
            for (offset, length), users in self._entries(items):
                f.seek(offset)
                data = buffer.read(f, length)
                if len(data) != length:
                    raise DamagedCheckpointError(f"file '{path}' ends inside entry '{users[0].storage_index.fqn}' (truncated)")
                for item in users:
                    _load_item(item, data, planner)

    def _read_verified(self, path: str, want: FileRecord, items: list[ReadItem], planner: LoadPlanner) -> None:
        # Hashed on this thread, between reading the bytes and parsing them: with xxh3-64 that costs
        # less CPU and wall time than folding the hash on a helper thread over alternating buffers.
        hasher, buffer = ALGORITHMS[want.algorithm].new(), _EntryBuffer()
        pos, failure = 0, None
        with open(path, "rb", buffering=0) as f:

            def read(n: int) -> memoryview:
                nonlocal pos
                view = buffer.read(f, n)
                hasher.update(view)
                pos += len(view)
                return view

            for (offset, length), users in [*self._entries(items), ((-1, -1), [])]:  # then the rest of the file
                if 0 <= offset < pos:
                    raise DamagedCheckpointError(f"file '{path}' has overlapping entries")
                while offset < 0 or pos < offset:  # bytes no entry of this rank's needs: into the hash only
                    if not len(read(_CHUNK if offset < 0 else min(_CHUNK, offset - pos))):
                        break
                if offset < 0:
                    break
                data = read(length)
                if failure is None and len(data) == length:
                    try:
                        for item in users:
                            _load_item(item, data, planner)
                    except Exception as exc:  # reported only if the file is intact (else: the damage)
                        failure = exc
        problem = _mismatch(path, want, FileRecord(pos, want.algorithm, hasher.intdigest()))
        if problem:
            raise DamagedCheckpointError(problem)
        if failure is not None:
            raise failure


class _EntryBuffer:
    """One reusable buffer that entries are read into: reading a file costs no fresh memory per
    entry (torch.load copies each tensor out of it)."""

    def __init__(self) -> None:
        self._buf = bytearray(0)

    def read(self, f: Any, n: int) -> memoryview:
        """Up to ``n`` bytes from ``f`` (fewer at its end), valid until the next read."""
        if len(self._buf) < n:
            self._buf = bytearray(n)
        view = memoryview(self._buf)[:n]
        got = 0
        while got < n:
            k = f.readinto(view[got:])
            if not k:
                break
            got += k
        return view[:got]


class _BytesView(io.RawIOBase):
    """A read-only, seekable file over a memoryview (``io.BytesIO`` would copy it)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._data) - self._pos))
        memoryview(b).cast("B")[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


def _load_item(item: ReadItem, data: memoryview, planner: LoadPlanner) -> None:
    """Parse one stored entry and hand it to the planner, as DCP's reader does: tensors with
    ``torch.load(weights_only=True)``, narrowed to the part this rank reads; values through the
    planner's ``load_bytes``."""
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(data))
        return
    tensor = torch.load(cast(IO[bytes], _BytesView(data)), map_location="cpu", weights_only=True)
    if not isinstance(tensor, torch.Tensor):
        raise DamagedCheckpointError(f"entry '{item.storage_index.fqn}' holds a {type(tensor).__name__}, not a tensor")
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
        tensor = tensor.narrow(dim, offset, length)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise DamagedCheckpointError(f"entry '{item.storage_index.fqn}' has shape {tuple(tensor.size())}, the metadata says {tuple(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)


def _file_error(path: str, exc: Exception) -> CheckpointError:
    """An error reading the data file at ``path`` as shardwrap reports it."""
    if isinstance(exc, CheckpointError):
        return exc if path in str(exc) else type(exc)(f"file '{path}': {exc}")
    if refused_object(exc):
        return UnsafeCheckpointError(f"file '{path}' holds an object that is not a tensor ({gist(exc)}) and was not unpickled")
    return DamagedCheckpointError(f"file '{path}' could not be read ({type(exc).__name__}: {gist(exc)})")


class PlainValuePlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries (optimizer hyperparameters,
    parameter names) are loaded with ``torch.load(weights_only=True)``: numbers, strings, lists,
    tuples, dicts, ``None`` and tensors, never an arbitrary object."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self._directory = directory

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as exc:
            name = self.metadata.storage_data[read_item.storage_index].relative_path if self.metadata else "?"
            if not refused_object(exc):
                raise DamagedCheckpointError(
                    f"file '{os.path.join(self._directory, name)}', entry '{key}', could not be read ({type(exc).__name__}: {gist(exc)})"
                ) from None
            raise UnsafeCheckpointError(
                f"file '{os.path.join(self._directory, name)}', entry '{key}', holds an object that is not a plain value "
                f"({gist(exc)}) and was not unpickled"
            ) from None
        if self.flatten_state_dict:
            set_path(self.original_state_dict, self.mappings[key], obj)
        else:
            self.state_dict[key] = obj
