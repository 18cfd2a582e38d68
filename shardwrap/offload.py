"""Offload: the sharded fp32 master parameters, their gradients and the optimizer state live in host
memory (``"cpu"``, ZeRO-Offload) or in files mapped into memory (``"disk"``, ZeRO-Infinity), and
the optimizer step runs there [design/notes/offload.md].

A unit's master shard is allocated by the rank's ``OffloadStore`` instead of on the compute
device; the unit copies it to the compute device before each all-gather and copies each reduced
gradient shard back. With ``"disk"`` the store also holds the optimizer state: ``StateOnDisk``
catches the optimizer's ``zeros_like``/``empty_like`` of an offloaded parameter during the step
that creates its state, and ``settle_state`` moves any other state tensor shaped like an offloaded
parameter (SGD's momentum, a loaded state) into the store, so that a plain torch optimizer over
``model.parameters()`` never knows where its tensors live.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import sys
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

MARKER = "SHARDWRAP-OFFLOAD-SCRATCH.txt"  # says what the directory is: never a checkpoint
_KINDS = (None, "cpu", "disk")
_STATE_BYTES_PER_ELEMENT = 12  # what the space check plans for: the master shard and two fp32 states (Adam)


@dataclass(frozen=True)
class Offload:
    """``optimizer``: where the sharded fp32 master parameters, their gradients and the optimizer
    state live and where the step runs: ``None`` (the compute device), ``"cpu"`` (host memory,
    pinned when there is an accelerator) or ``"disk"`` (files under ``path``; gradient shards stay
    in host memory). ``path``: the directory for ``"disk"``; each rank writes its files in a
    directory of its own under it and removes it when the model is deleted or the process exits."""

    optimizer: str | None = None
    path: str | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in _KINDS:
            raise ValueError(f"Offload(optimizer={self.optimizer!r}): expected None, 'cpu' or 'disk'")
        if self.optimizer == "disk" and not self.path:
            raise ValueError("Offload(optimizer='disk') needs path=: a directory on a disk with room for this rank's shards and optimizer state")
        if self.optimizer != "disk" and self.path is not None:
            raise ValueError(f"Offload(path={self.path!r}) is only used with optimizer='disk'")

    @property
    def enabled(self) -> bool:
        return self.optimizer is not None


def check_disk(offload: Offload, needed: int, rank: int) -> None:
    """Refuse (before anything is built) a path that is not a writable directory, or lacks room
    for ``needed`` bytes of this rank's files."""
    path = str(offload.path)
    if not os.path.isdir(path):
        raise ValueError(f"Offload(path={path!r}): not a directory; create it first (rank {rank})")
    probe = os.path.join(path, f".shardwrap-write-probe-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"Offload(path={path!r}): rank {rank} cannot write there ({exc})") from None
    free = shutil.disk_usage(path).free
    if free < needed:
        raise ValueError(
            f"Offload(path={path!r}): rank {rank} needs {needed / 2**30:.2f} GiB for its master shards and optimizer "
            f"state ({needed} bytes) and the disk has {free / 2**30:.2f} GiB free; free space or choose another path"
        )


def disk_bytes(shard_elements: int, element_size: int = 4) -> int:
    """Bytes one rank's disk files take for ``shard_elements`` fp32 shard elements: the master
    shard and two optimizer states (AdamW's moments), which is what the space check asks for."""
    return shard_elements * element_size * _STATE_BYTES_PER_ELEMENT // 4


PAGE_BY_UNIT = True  # a disk-offload step releases each unit's pages when it moves on (UnitPager); benchmarks/offload.py compares
# A disk-offload step maps each tensor it updates in place writable with one madvise instead of a
# write fault per 4 KiB page (design/notes/offload.md, "Faulting in a unit at once"); Linux 5.14+
# only: on an older kernel the first refusal (EINVAL) turns it off. It runs inside UnitPager, so
# PAGE_BY_UNIT = False turns it off too. benchmarks/offload.py --no-populate compares.
POPULATE = sys.platform.startswith("linux")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Python 3.11's mmap lacks the name
DISK_STORES: "weakref.WeakSet[OffloadStore]" = weakref.WeakSet()  # live "disk" stores: the step hooks skip all work without one


class OffloadStore:
    """One rank's offloaded tensors: plain (pinned when the model computes on CUDA) host tensors for
    ``"cpu"``; for ``"disk"``, one file per tensor in a directory of the rank's own, each mapped
    shared into memory, so that the kernel writes its pages back and drops them as it needs."""

    def __init__(self, offload: Offload, rank: int, owner: object, pin: bool = False) -> None:
        self.kind = offload.optimizer
        self.pin = pin  # page-locked host memory: only when the model computes on CUDA
        self.directory: str | None = None
        self._maps: list[mmap.mmap] = []
        self._unit_maps: dict[int, list[mmap.mmap]] = {}  # unit index -> its files' mappings
        self._shard_maps: dict[int, mmap.mmap] = {}  # unit index -> its master shard's mapping
        self._files: dict[int, tuple[int, mmap.mmap]] = {}  # data_ptr of a file-backed storage -> (its unit's index, its mapping)
        # (optimizer number, unit index, state number) -> flat state: each optimizer has files of its own
        self.arenas: dict[tuple[int, int, int], torch.Tensor] = {}
        self._optimizers: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
        self._arena_files: dict[tuple[int, int, int], str] = {}
        self._next_owner = 0
        if self.kind == "disk":
            DISK_STORES.add(self)
            self.directory = os.path.join(str(offload.path), f"shardwrap-offload-{os.getpid()}-{uuid.uuid4().hex[:8]}-rank{rank}")
            os.makedirs(self.directory)
            with open(os.path.join(self.directory, MARKER), "w") as f:
                f.write(
                    "Scratch files of a running shardwrap job (Offload(optimizer='disk')): master shards and optimizer "
                    "state in shardwrap's own layout, not a checkpoint. Safe to delete when no job runs.\n"
                )
            # Removed when the model goes or the process exits cleanly. Open mappings keep their
            # pages until the tensors over them die; the names go at once.
            weakref.finalize(owner, shutil.rmtree, self.directory, True)

    def tensor(self, name: str, numel: int, dtype: torch.dtype, unit: int) -> torch.Tensor:
        """A new zero tensor of ``numel`` elements on the offload side, for unit number ``unit``."""
        if self.kind != "disk" or numel == 0:
            return torch.zeros(numel, dtype=dtype, pin_memory=self.pin)
        assert self.directory is not None
        nbytes = numel * dtype.itemsize
        with open(os.path.join(self.directory, f"{name}.bin"), "w+b") as f:
            f.truncate(nbytes)  # sparse: zeros, no disk blocks until written
            mapped = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._maps.append(mapped)
        self._unit_maps.setdefault(unit, []).append(mapped)
        if name.endswith("-params"):
            self._shard_maps[unit] = mapped
        out = torch.frombuffer(mapped, dtype=dtype, count=numel)
        self._files[out.untyped_storage().data_ptr()] = (unit, mapped)
        return out

    def state_arena(self, optimizer: object, unit: int, number: int, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
        """The flat ``number``-th state of unit number ``unit`` for ``optimizer``, and whether it
        was just made (zeros). Each optimizer gets files of its own, removed when it goes: two
        optimizers over the same parameters (one per task over a shared backbone, or the next
        phase's optimizer while the last one lives) never share a state."""
        owner = self._optimizers.get(optimizer)
        if owner is None:
            owner = self._optimizers[optimizer] = self._next_owner
            self._next_owner += 1
            weakref.finalize(optimizer, _drop_optimizer_files, weakref.ref(self), owner)
        key = (owner, unit, number)
        arena = self.arenas.get(key)
        if arena is not None:
            return arena, False
        name = f"unit{unit}-opt{owner}-state{number}"
        arena = self.arenas[key] = self.tensor(name, numel, dtype, unit)
        self._arena_files[key] = name
        return arena, True

    def drop_optimizer(self, owner: int) -> None:
        """Forget optimizer number ``owner``'s state files and remove them; their pages go once the
        last tensor over them does."""
        for key in [k for k in self.arenas if k[0] == owner]:
            arena = self.arenas.pop(key)
            name = self._arena_files.pop(key)
            file = self._files.pop(arena.untyped_storage().data_ptr(), None)
            if file is not None:
                unit, mapped = file
                self._maps = [m for m in self._maps if m is not mapped]
                self._unit_maps[unit] = [m for m in self._unit_maps.get(unit, []) if m is not mapped]
            if self.directory is not None:
                try:
                    os.unlink(os.path.join(self.directory, f"{name}.bin"))
                except OSError:
                    pass  # the directory went first (the model was deleted)

    def populate_for_write(self, local: torch.Tensor) -> None:
        """Map every page of ``local`` (a plain tensor, a contiguous view of one of this store's
        files) writable now, in one ``madvise(MADV_POPULATE_WRITE)``, instead of one write fault
        per page as the step reaches it. The pages would be written (so dirtied) by the caller
        anyway. Not a file-backed tensor, or a kernel that refuses: nothing."""
        global POPULATE
        storage = local.untyped_storage()
        file = self._files.get(storage.data_ptr())
        if file is None or not POPULATE or not local.is_contiguous() or local.numel() == 0:
            return
        mapped = file[1]
        start = local.data_ptr() - storage.data_ptr()
        end = start + local.numel() * local.element_size()
        first = start - start % mmap.PAGESIZE
        try:
            mapped.madvise(_MADV_POPULATE_WRITE, first, end - first)
        except OSError as exc:  # the step's own writes fault the pages in, as without it
            if exc.errno == errno.EINVAL:  # a kernel before 5.14: never ask again
                POPULATE = False
            # else (a signal, memory or disk space short): this tensor only; a disk that is
            # full fails the write itself, as it would have without the call

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (a DTensor: its local tensor) lives in one of this store's files."""
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.untyped_storage().data_ptr() in self._files

    def release_pages(self) -> None:
        """Ask the kernel to write back and drop the mapped pages (they are read again from the
        files when next touched): keeps the page cache from filling with a step's worth of state."""
        for mapped in self._maps:
            _page_out(mapped)

    def unit_of(self, tensor: torch.Tensor) -> int | None:
        """The index of the unit whose file ``tensor`` (a DTensor: its local tensor) lives in."""
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        file = self._files.get(local.untyped_storage().data_ptr())
        return file[0] if file is not None else None

    def release_unit(self, unit: int) -> None:
        """``release_pages`` for one unit's files."""
        for mapped in self._unit_maps.get(unit, []):
            _page_out(mapped)

    def read_ahead(self, unit: int, shard_only: bool = True) -> None:
        """Ask the kernel to start reading unit number ``unit``'s master shard (``shard_only``) or
        all its files into the page cache, without waiting: a hint that lets the disk work
        while this rank computes the units before it. An index with no files: nothing."""
        if shard_only:
            maps = [self._shard_maps[unit]] if unit in self._shard_maps else []
        else:
            maps = self._unit_maps.get(unit, [])
        for mapped in maps:
            mapped.madvise(mmap.MADV_WILLNEED)


def _page_out(mapped: mmap.mmap) -> None:
    mapped.madvise(mmap.MADV_PAGEOUT if hasattr(mmap, "MADV_PAGEOUT") else mmap.MADV_DONTNEED)


class UnitPager(TorchDispatchMode):
    """During a disk-offload optimizer step: once the step moves from one unit's file-backed
    tensors to another unit's, the pages of the unit it left are written back and dropped, so the
    step keeps about one unit's master shard and state resident instead of the rank's whole state
    (design/notes/offload.md). torch's per-parameter loop (the CPU default) visits a unit's
    parameters together; a ``foreach`` step touches every unit in each op, and the pager then
    releases nothing until the step ends."""

    def __init__(self) -> None:
        super().__init__()
        self._current: tuple[OffloadStore, int] | None = None
        self._populated: set[int] = set()  # data_ptr of every file-backed tensor faulted in by this step

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func.__name__.split(".")[0]  # "_fused_adamw_" of "_fused_adamw_.default"
        in_place = packet.endswith("_") and not packet.startswith("__")  # "add_", not "__and__"
        if args and isinstance(args[0], list) and packet.startswith("_fused_") and in_place:
            return self._fused_unit_by_unit(func, args, kwargs)
        for arg in args:
            if not isinstance(arg, torch.Tensor):
                continue
            where = self._where(arg)
            if where is not None:
                self._move_to(where)
                if in_place:  # the per-parameter loop writes this tensor: its pages at once
                    self._populate(where[0], [arg])
            break  # the first tensor operand names the parameter being updated
        return func(*args, **kwargs)

    def _populate(self, store: OffloadStore, tensors: list[Any]) -> None:
        """``store.populate_for_write`` for each of ``tensors`` not yet faulted in by this step."""
        for tensor in tensors:
            local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
            if isinstance(local, torch.Tensor) and local.numel() and local.data_ptr() not in self._populated:
                self._populated.add(local.data_ptr())
                store.populate_for_write(local)

    @staticmethod
    def _where(tensor: torch.Tensor) -> tuple[OffloadStore, int] | None:
        for store in DISK_STORES:
            unit = store.unit_of(tensor)
            if unit is not None:
                return store, unit
        return None

    def _fused_unit_by_unit(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A fused optimizer kernel that updates in place (``AdamW(fused=True)``'s
        ``_fused_adamw_``; not the functional ``_fused_adamw`` nor its ``out=`` form, which run
        whole) runs once per run of consecutive parameters in one unit's files, each call with
        the same slice of every per-parameter list, so that the step pages unit by unit as the
        per-parameter loop does. The kernel updates each parameter from its own tensors and the
        shared scalars alone, so the slices give the bits of one call."""
        params = args[0]
        n = len(params)
        runs: list[tuple[tuple[OffloadStore, int] | None, int, int]] = []
        for i, param in enumerate(params):
            where = self._where(param)
            if runs and runs[-1][0] == where:
                runs[-1] = (where, runs[-1][1], i + 1)
            else:
                runs.append((where, i, i + 1))
        if len(runs) <= 1:
            if runs and runs[0][0] is not None:
                self._move_to(runs[0][0])
                self._populate_lists(runs[0][0][0], args, kwargs)
            return func(*args, **kwargs)
        for where, lo, hi in runs:
            sliced = [a[lo:hi] if isinstance(a, list) and len(a) == n else a for a in args]
            if where is not None:
                self._move_to(where)
                self._populate_lists(where[0], sliced, kwargs)
            func(*sliced, **kwargs)
        return None

    def _populate_lists(self, store: OffloadStore, args: Any, kwargs: dict[str, Any]) -> None:
        """Fault in, writable, every file-backed tensor of a fused kernel's per-parameter lists
        that the kernel updates in place: the parameters and their state, not the gradients
        (which live in RAM) nor the step counts (read and written, but host tensors of 4 bytes).
        Not when the kernel will skip the update (a ``GradScaler`` found an inf): the pages would
        be dirtied, and written back, for nothing."""
        found_inf = kwargs.get("found_inf")
        if isinstance(found_inf, torch.Tensor) and bool(found_inf.item()):
            return
        for arg in args:
            if isinstance(arg, list):
                self._populate(store, arg)  # the gradients are not in the files: populate_for_write skips them

    def _move_to(self, where: tuple[OffloadStore, int] | None) -> None:
        if self._current is not None and where != self._current:
            store, unit = self._current
            store.release_unit(unit)
        if where is not None and where != self._current:
            store, unit = where
            store.read_ahead(unit + 1, shard_only=False)  # the step's next unit, while this one runs
        self._current = where

    def __exit__(self, *exc: Any) -> None:
        self._move_to(None)  # the last unit's pages
        super().__exit__(*exc)


def _drop_optimizer_files(store: "weakref.ref[OffloadStore]", owner: int) -> None:
    live = store()
    if live is not None:
        live.drop_optimizer(owner)


class StateOnDisk(TorchDispatchMode):
    """During an optimizer step that creates state: ``zeros_like(p)`` / ``empty_like(p)`` of an
    offloaded parameter ``p`` (how Adam, AdamW, Adagrad... create theirs) returns zeros in the
    store instead of anonymous memory. ``place(p, zeros)`` gives the next such tensor for ``p``,
    zeroed for ``zeros_like`` where its file held a state before (files start as zeros)."""

    def __init__(self, place: Callable[[torch.Tensor, bool], torch.Tensor | None]) -> None:
        super().__init__()
        self._place = place

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.ops.aten.zeros_like.default, torch.ops.aten.empty_like.default) and isinstance(args[0], DTensor):
            dtype = kwargs.get("dtype")
            if dtype is None or dtype == args[0].dtype:
                placed = self._place(args[0], func is torch.ops.aten.zeros_like.default)
                if placed is not None:
                    return placed
        return func(*args, **kwargs)
