"""Reusing a freed CPU buffer for the next unit of the same size [design/notes/spare-buffers.md].

torch's CPU allocator caches nothing: a buffer of more than 32 MiB comes from glibc as a fresh
``mmap``, and every page of it faults in (and is zeroed by the kernel) on first write, then goes
back with ``munmap`` when freed. A stage-3 unit's unsharded buffer is allocated and freed twice a
step, so on a CPU with large units the kernel's page faulting costs more than the arithmetic.

``Spares`` keeps the memory of the last buffer a unit freed, one per kind (the unsharded buffer,
the offload send buffer), and hands it to the next allocation of exactly that many bytes. The
root drops whatever nobody took once the next unit's prefetch has been issued, so a spare never
lives across compute and the peak stays what it was without it. The memory moves between storage
objects with ``UntypedStorage._swap_data_ptr_``: the storage autograd's saved views point at keeps
its identity, as with ``resize_``.
"""

from __future__ import annotations

import torch

_SWAP = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)  # torch builds without it never reuse
REUSE = True  # benchmarks/offload.py --no-spares turns it off to measure what it saves


class Spares:
    """At most one freed CPU storage per kind, waiting for an allocation of its size."""

    def __init__(self) -> None:
        self._kept: dict[str, torch.UntypedStorage] = {}
        self._open = False  # only inside a forward or backward: a reshard elsewhere frees at once
        self.reused = 0  # allocations served from a spare (tests read it)

    def open(self) -> None:
        """A forward or backward starts: freed buffers may wait for the next unit."""
        self._open = True

    def close(self) -> None:
        """The forward or backward ended (or failed): free every spare, keep none until the next."""
        self._kept.clear()
        self._open = False

    def allocate(self, kind: str, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory: the spare of ``kind`` if it has
        exactly that size, else new memory (and the spare, of another size, is freed first)."""
        spare = self._kept.pop(kind, None)
        if spare is not None and spare.nbytes() == nbytes:
            _SWAP(storage, spare)  # type: ignore[misc]
            self.reused += 1
            return
        del spare
        storage.resize_(nbytes)

    def release(self, kind: str, storage: torch.UntypedStorage) -> None:
        """Free ``storage`` (it keeps its identity, at 0 bytes); on a CPU its memory becomes the
        spare of ``kind``, replacing any older one."""
        if not (self._open and REUSE) or _SWAP is None or storage.device.type != "cpu" or storage.nbytes() == 0:
            storage.resize_(0)
            return
        holder = torch.UntypedStorage(0, device=storage.device)
        _SWAP(storage, holder)
        self._kept[kind] = holder

    def drop(self) -> None:
        """Free every spare: called once the allocations that could use them have been made."""
        self._kept.clear()

    @property
    def kept_bytes(self) -> int:
        return sum(s.nbytes() for s in self._kept.values())


def _find_malloc_trim():  # type: ignore[no-untyped-def]
    """glibc's ``malloc_trim``, or None (another C library, or no C library to load: nothing to
    return). Never raises: ``import shardwrap`` must work everywhere."""
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim
    except Exception:  # AttributeError (no such symbol), OSError, TypeError (Windows: CDLL(None))
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()
TRIM = True  # benchmarks/offload.py --no-trim turns it off to measure what it returns


def return_free_heap() -> None:
    """Give glibc's free heap pages back to the kernel (``malloc_trim(0)``).

    Tensors under glibc's mmap threshold (which grows to 32 MiB once a larger block was freed)
    come from its heaps, and a freed one stays resident there unless it lay at the top of the
    heap. In a CPU offload backward the forward's activations are freed while the gradient shards
    (mapped separately) grow, so the free heap memory stays resident beside them at the step's
    peak [design/notes/offload.md]."""
    if TRIM and _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
