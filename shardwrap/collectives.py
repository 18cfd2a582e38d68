"""Every collective shardwrap issues, and the process groups it builds.

This is the only module of the package that calls ``torch.distributed``, so every byte that
crosses ranks is visible here and counted by ``count_collectives``: the data collectives, the
one-integer count exchanges, object broadcasts and barriers. Process-group construction
(``default_mesh``, ``reduce_group_for``, ``init_fake_world``) lives here too, and so does the
exit hook that lets gloo's worker threads finish before the interpreter finalizes.

The tensor functions work on flat 1-D tensors over the process group of a 1-D mesh.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import hashlib
import os
import pickle
import signal
import threading
import time
import weakref
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator, ParamSpec, Protocol, Sequence, TypeVar, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

Group = dist.ProcessGroup

# torch 2.13 renamed the tensor collectives; older releases (>= 2.6) only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_counter: Counter[str] | None = None


@contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count what each kind of collective sends while the context is open.

    ``counts[kind]`` is input elements per rank (an all-gather of a 4-element shard counts 4, a
    reduce-scatter of a 12-element buffer counts 12, a broadcast of n elements counts n),
    ``counts[kind + "_calls"]`` the number of calls, and ``counts["bytes"]`` the input bytes of
    every collective together (a pickled object counts its pickle's length; a barrier counts 0).
    """
    global _counter
    previous, _counter = _counter, Counter()
    try:
        yield _counter
    finally:
        _counter = previous


def _count(kind: str, numel: int, nbytes: int) -> None:
    if _counter is not None:
        _counter[kind] += numel
        _counter[kind + "_calls"] += 1
        _counter["bytes"] += nbytes


def _count_tensor(kind: str, tensor: torch.Tensor) -> None:
    _count(kind, tensor.numel(), tensor.numel() * tensor.element_size())


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False
) -> Work | None:
    """Concatenate every rank's ``shard`` into ``output`` in rank order.

    With 2 ranks, rank 0 passing ``[1, 2]`` and rank 1 passing ``[3, 4]``, every rank's
    ``output`` becomes ``[1, 2, 3, 4]``. ``output.numel()`` must be ``world_size * shard.numel()``.
    """
    _count_tensor("all_gather", shard)
    if uses_pairwise(group, shard.device, shard.numel() * shard.element_size()):
        rows = output.view(dist.get_world_size(group), shard.numel())
        return _finished_unless(async_op, _gather_pieces([[row] for row in rows], [shard], group))
    return _all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor, padded_input: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False
) -> Work | None:
    """Sum ``padded_input`` over ranks and keep this rank's slice of the sum.

    With 2 ranks, rank 0 passing ``[1, 2, 3, 4]`` and rank 1 passing ``[10, 20, 30, 40]``,
    rank 0's ``output`` becomes ``[11, 22]`` and rank 1's becomes ``[33, 44]``.
    """
    _count_tensor("reduce_scatter", padded_input)
    if uses_pairwise(group, padded_input.device, padded_input.numel() * padded_input.element_size()):
        chunks = padded_input.view(dist.get_world_size(group), output.numel())
        return _finished_unless(async_op, _reduce_pieces([output], [[chunk] for chunk in chunks], group))
    return _reduce_scatter_single(output, padded_input, group=group, async_op=async_op)


# ---- pairwise collectives for CPU groups (design/notes/cpu-collectives.md) -----------------------

# Below this many bytes per rank torch's gloo collectives are as fast (one round trip either way).
PAIRWISE_MIN_BYTES = 64 << 10


def all_gather_pieces(
    rows: Sequence[Sequence[torch.Tensor]], pieces: Sequence[torch.Tensor], group: dist.ProcessGroup, *, async_op: bool = False
) -> Work | None:
    """An all-gather whose shard is this rank's ``pieces`` and whose output is scattered: rank
    ``r``'s piece ``i`` lands in ``rows[r][i]`` (the same sizes on every rank). Pairwise only: call
    it when ``uses_pairwise`` holds. Counted as one all-gather of the pieces' elements."""
    _count("all_gather", sum(p.numel() for p in pieces), sum(p.numel() * p.element_size() for p in pieces))
    return _finished_unless(async_op, _gather_pieces(rows, pieces, group))


def reduce_scatter_pieces(
    outputs: Sequence[torch.Tensor], sends: Sequence[Sequence[torch.Tensor]], group: dist.ProcessGroup, *, async_op: bool = False
) -> Work | None:
    """A reduce-scatter whose input is cut in pieces: ``sends[r][i]`` is this rank's piece ``i``
    for rank ``r``, and ``outputs[i]`` receives the sum over ranks of their piece ``i`` for this
    rank. Pairwise only. Counted as one reduce-scatter of ``W`` times the pieces' elements."""
    mine = sends[dist.get_rank(group)]
    world = dist.get_world_size(group)
    _count("reduce_scatter", world * sum(p.numel() for p in mine), world * sum(p.numel() * p.element_size() for p in mine))
    return _finished_unless(async_op, _reduce_pieces(outputs, sends, group))


def uses_pairwise(group: dist.ProcessGroup, device: torch.device, nbytes: int) -> bool:
    """Whether a data collective of ``nbytes`` per rank on ``device`` over ``group`` is pairwise.
    gloo's reduce-scatter and all-gather cost 1.2-2.4x an all-reduce of the same buffer here,
    where a ring's halves should cost 0.5x each; one send and one receive per peer reach it. CPU
    tensors on a gloo group of more than one rank only: NCCL keeps torch's collectives."""
    return device.type == "cpu" and nbytes >= max(PAIRWISE_MIN_BYTES, 1) and _is_multi_rank_gloo(group)


# A group's size and backend never change; asked for each collective, they are remembered (weakly:
# a destroyed group is not kept alive).
_MULTI_RANK_GLOO: "weakref.WeakKeyDictionary[dist.ProcessGroup, bool]" = weakref.WeakKeyDictionary()


_TIMEOUTS: "weakref.WeakKeyDictionary[dist.ProcessGroup, datetime.timedelta | None]" = weakref.WeakKeyDictionary()


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The group's timeout, for the waits of its point-to-point works (gloo's collectives keep it
    by themselves, but a receive's ``wait()`` with no argument waits for ever) and for the groups
    shardwrap makes (``_GroupCache``). None where the group's CPU backend does not say."""
    if group not in _TIMEOUTS:
        try:
            _TIMEOUTS[group] = group._get_backend(torch.device("cpu")).options._timeout
        except (AttributeError, RuntimeError):
            _TIMEOUTS[group] = None
    return _TIMEOUTS[group]


def _is_multi_rank_gloo(group: dist.ProcessGroup) -> bool:
    known = _MULTI_RANK_GLOO.get(group)
    if known is None:
        known = _MULTI_RANK_GLOO[group] = dist.get_world_size(group) > 1 and dist.get_backend(group) == "gloo"
    return known


# The smallest mean piece (bytes per rank) for which a unit's collectives send per-parameter pieces.
# Every piece is a message of its own, at roughly 0.1 ms of host time a send and receive pair on
# gloo here; below this a unit of many small parameters (a GPT-2 block: 13 pieces of 0.12 MB) is
# faster as one message and a copy-out (design/notes/cpu-collectives.md, "Pieces or one message").
PIECES_MIN_BYTES = 256 << 10


def sends_pieces(group: dist.ProcessGroup, device: torch.device, shard_bytes: int, pieces: int) -> bool:
    """Whether a unit's all-gather or reduce-scatter of ``shard_bytes`` per rank, cut in
    ``pieces`` (its parameters and the tag), sends the pieces as messages of their own (the
    pairwise path, each piece straight to where it belongs) rather than one contiguous message.
    The same answer on every rank: sizes, dtype and group only."""
    return uses_pairwise(group, device, shard_bytes) and shard_bytes >= max(PIECES_MIN_BYTES, 1) * pieces


def _gather_pieces(rows: Sequence[Sequence[torch.Tensor]], pieces: Sequence[torch.Tensor], group: dist.ProcessGroup) -> "PairwiseWork":
    """Post every peer's pieces into its rows and copy this rank's own (unless already in place)."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    peers = [p for p in range(world) if p != me]
    works, sends = _exchange([(piece, p) for p in peers for piece in pieces], [(dst, p) for p in peers for dst in rows[p]], group)
    for dst, piece in zip(rows[me], pieces):
        if dst.data_ptr() != piece.data_ptr():
            dst.copy_(piece)
    return PairwiseWork(works, sends=sends, timeout=group_timeout(group))


def _reduce_pieces(outputs: Sequence[torch.Tensor], sends: Sequence[Sequence[torch.Tensor]], group: dist.ProcessGroup) -> "PairwiseWork":
    """Each peer gets its pieces; the sum of every rank's pieces for this rank is taken in rank
    order when the work is waited on (the same bits on every run). At W=2 the peer's pieces are
    received straight into ``outputs`` and this rank's are added: ``a + b == b + a`` bit for bit,
    so the result equals gloo's, with no buffer beyond the output."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    peers = [p for p in range(world) if p != me]
    if world == 2:
        received: dict[int, list[torch.Tensor]] = {peers[0]: list(outputs)}
    else:
        received = {p: [torch.empty_like(o) for o in outputs] for p in peers}
    works, posted = _exchange([(piece, p) for p in peers for piece in sends[p]], [(dst, p) for p in peers for dst in received[p]], group)

    def finish() -> None:
        if world == 2:
            for out, own in zip(outputs, sends[me]):
                out.add_(own)
            return
        for i, out in enumerate(outputs):
            parts = [sends[me][i] if r == me else received[r][i] for r in range(world)]
            out.copy_(parts[0])
            for part in parts[1:]:
                out.add_(part)

    return PairwiseWork(works, finish, sends=posted, timeout=group_timeout(group))


class PairwiseWork:
    """A pairwise collective in flight, waited on like torch's ``Work``: ``wait()`` waits for every
    receive, then every send, then runs the collective's last local step (the sum of a
    reduce-scatter) once; later calls return at once, or raise its failure again.

    ``works`` are ``sends`` send works followed by the receive works. Once every receive has
    landed, ``peers_started`` turns true: every peer has posted its part of this collective, so
    waiting for the rest cannot wait on a peer that is blocked elsewhere (the bound on
    reduce-scatters in flight relies on it: design/notes/collective-schedule.md)."""

    def __init__(
        self, works: list[dist.Work], finish: Callable[[], None] | None = None, *, sends: int = 0,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        self._works, self._finish, self._sends, self._timeout = works, finish, sends, timeout
        self.peers_started = False
        self._failure: BaseException | None = None

    def wait(self) -> bool:
        """Receives first, then sends, then the sum. A part that fails (a peer went away, a
        timeout, the sum itself) ends the wait there: its sum is never taken (or not finished),
        ``peers_started`` stays as it was, and every later ``wait()`` raises the same failure, as
        torch's ``Work`` does. The parts not waited for keep their tensors alive in their own
        ``Work``."""
        if self._failure is not None:
            raise self._failure
        works, self._works = self._works, []
        finish, self._finish = self._finish, None
        try:
            for work in works[self._sends :]:
                work.wait() if self._timeout is None else work.wait(self._timeout)
            self.peers_started = True
            for work in works[: self._sends]:
                work.wait() if self._timeout is None else work.wait(self._timeout)
            if finish is not None:
                finish()
        except Exception as exc:
            # Also a failed sum: the reduce waiter thread may be the first to wait, and the unit's
            # own wait after it must raise, not return with an output never written.
            self._failure = exc
            raise
        return True

    def is_completed(self) -> bool:
        return not self._works and self._finish is None


Work = Union[dist.Work, PairwiseWork]  # what the data collectives return when asynchronous


def _finished_unless(async_op: bool, work: PairwiseWork) -> PairwiseWork | None:
    if async_op:
        return work
    work.wait()
    return None


def _exchange(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: dist.ProcessGroup
) -> tuple[list[dist.Work], int]:
    """Post every send and receive (peers as group ranks) at once; the same order on every rank.
    Returns the works and how many of the first are sends (0 where the backend coalesced them:
    then every work counts as a receive)."""
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, p), group) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, p), group) for t, p in recvs]
    works = dist.batch_isend_irecv(ops) if ops else []
    return works, len(sends) if len(works) == len(ops) else 0


# The first element of every small exchange on the all-gather group says what it is, so that two
# ranks whose sequences diverged meet two exchanges of the same size and can name the difference
# instead of pairing a small exchange with a data all-gather (design/notes/rank-agreement.md).
HEADER_FORWARD, HEADER_BACKWARD, HEADER_COUNTS, HEADER_END, HEADER_CALL = 1, 2, 3, 4, 5

# Bits 48 to 62 of every header's value carry the sender's history (``history``): how many
# optimizer steps wrote the model, and how many failed passes it dropped. Two ranks can run the
# same units in the same order and still be a step apart (a step skipped or raised on one rank, a
# failed no_sync micro-batch), which phase and unit alone never show (design/notes/rank-agreement.md).
HISTORY_SHIFT, STEPS_MODULO, DROPS_MODULO = 48, 1 << 10, 1 << 5
LOW_BITS = (1 << HISTORY_SHIFT) - 1


def history(steps: int, drops: int) -> int:
    """A model's history as the 15 bits a header carries: steps modulo 1024, drops modulo 32."""
    return (steps % STEPS_MODULO) | (drops % DROPS_MODULO) << 10


def split_history(value: int) -> tuple[int, int, int]:
    """A header value as (its own low 48 bits, steps, drops)."""
    h = value >> HISTORY_SHIFT
    return value & LOW_BITS, h % STEPS_MODULO, h >> 10


def call_code(what: str) -> int:
    """The code that stands for the between-steps call ``what`` in a header (HEADER_CALL's
    value): the same on every rank."""
    return int.from_bytes(hashlib.blake2b(what.encode(), digest_size=6).digest(), "little")


# The calls that start with such a header, by code: a peer names the call in its error
CALLS = {call_code(name): name for name in (
    "full_state_dict", "load_full_state_dict", "full_optim_state_dict", "load_full_optim_state_dict",
    "save_checkpoint", "load_checkpoint", "load_full", "summon_full_params",
)}


def digest48(indices: Sequence[int]) -> int:
    """A 48-bit digest of a list of unit indices: the same on every rank for the same list."""
    data = b"".join(i.to_bytes(4, "little") for i in indices)
    return int.from_bytes(hashlib.blake2b(data, digest_size=6).digest(), "little")


def exchange_counts(count: int, group: dist.ProcessGroup, digest: int = 0, past: int = 0) -> tuple[dist.Work | None, torch.Tensor]:
    """Start gathering ``[HEADER_COUNTS + (digest << 8), count + (past << 48)]`` from every rank
    (CPU groups); returns the work and the ``(W, 2)`` output. ``digest``: 48 bits that every rank
    must agree on (a backward's first exchange: its reduce-scatter order); ``past``: the model's
    ``history``. Counted apart from the data all-gathers, under ``"counts"``.
    """
    mine = torch.tensor([HEADER_COUNTS + (digest << 8), count | past << HISTORY_SHIFT], dtype=torch.int64)
    _count_tensor("counts", mine)
    out = torch.empty(dist.get_world_size(group), 2, dtype=torch.int64)
    work = _all_gather_single(out.view(-1), mine, group=group, async_op=True)
    return work, out


@contextmanager
def interrupt_held() -> Iterator[None]:
    """Hold back a Ctrl-C (SIGINT) that arrives inside: the handler that was installed runs on
    leaving, so the ``KeyboardInterrupt`` comes after the body, not in the middle of it.

    Around a header exchange and the data collective it announces: the header's wait is where a
    rank spends its idle time, and Python raises a signal that arrived during a blocking call
    right after it returns. Raised there, the peers have posted the data gather the header
    promised and this rank never does; its next collective (a checkpoint saved on the way out)
    then meets their data, and gloo aborts the process (SIGABRT). Nothing is delayed that would
    not be anyway: the collective's wait cannot be interrupted, and the posts after it return at
    once (design/notes/rank-agreement.md, "A Ctrl-C between a header and its gather"). Only on the
    main thread (the only one Python delivers signals to) and under a Python handler; a handler
    of SIG_IGN or SIG_DFL is left alone.
    """
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        yield
        return
    frames: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: frames.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if frames:
            previous(signal.SIGINT, frames[0])


_P = ParamSpec("_P")
_R = TypeVar("_R")


def holds_interrupt(call: Callable[_P, _R]) -> Callable[_P, _R]:
    """A call between steps that starts with a header (``ShardedModule.agree_on_call``) and goes
    on into data collectives: a Ctrl-C in its header's wait is held to its end. Raised there, the
    peers would already be in the call's collectives, and this rank's next one (a checkpoint saved
    on the way out) would meet them, and gloo would abort the process. A save completes, then the
    interrupt comes (design/notes/rank-agreement.md, "A Ctrl-C between a header and its gather")."""

    @functools.wraps(call)
    def held(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with interrupt_held():
            return call(*args, **kwargs)

    return held


def carrier_device(group: dist.ProcessGroup) -> torch.device:
    """Where a small tensor of this package's own (digests, headers) must live for a collective on
    ``group``: the host when the group has a CPU backend (gloo, ``"cpu:gloo,cuda:nccl"``, the fake
    group), else this process's current GPU. An NCCL-only group carries no host tensor: a CPU
    int64 all-gather there raises "No backend type associated with device type cpu"."""
    try:
        group._get_backend(torch.device("cpu"))
        return torch.device("cpu")
    except RuntimeError:
        return torch.device("cuda")  # the current device, as torch's object collectives use


def all_gather_ints(values: Sequence[int], group: dist.ProcessGroup, *, what: str = "", kind: str = "ints") -> list[list[int]]:
    """Every rank's list of ``len(values)`` int64 values, in rank order (one small collective).

    With 2 ranks, rank 0 passing ``[7, 1]`` and rank 1 passing ``[7, 2]``, both get
    ``[[7, 1], [7, 2]]``. Counted under ``kind``. The output starts as this rank's values
    repeated, so a fake process group (which moves nothing) reports every rank equal. ``what``
    names the collective in a timeout error. The values travel on ``carrier_device(group)``.
    """
    mine = torch.tensor(list(values), dtype=torch.int64, device=carrier_device(group))
    _count_tensor(kind, mine)
    out = mine.repeat(dist.get_world_size(group))
    wait(_all_gather_single(out, mine, group=group, async_op=True), what)
    return out.view(-1, len(values)).tolist()


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process group's timeout."""


# Every CollectiveTimeout and PeerLost raised in this process, in order (ShardedModule._recover
# reads those raised since its failed step began)
_fatal: list[str] = []


def fatal_failures() -> list[str]:
    """The messages of the collective timeouts and lost peers raised in this process so far."""
    return _fatal


class PeerLost(RuntimeError):
    """A collective failed because another rank's process went away: its connection closed
    (killed, out of memory, crashed, or its node or the network went down)."""


# How the backends say that a peer's connection went: gloo at once, nccl as a remote error.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited", "ncclRemoteError")


def lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (from a collective) says that another rank's process went away."""
    return isinstance(exc, PeerLost) or any(s in str(exc) for s in PEER_GONE)


class Waitable(Protocol):
    def wait(self) -> Any: ...


def wait(work: dist.Work | Waitable | None, what: str = "") -> None:
    """Block until ``work`` finished (on NCCL: order the current stream after it). A timeout is
    re-raised as ``CollectiveTimeout`` and a peer's closed connection as ``PeerLost``, each naming
    ``what`` (the unit, the collective, the step)."""
    if work is None:
        return
    try:
        work.wait()
    except RuntimeError as exc:
        if what and lost_a_peer(exc):
            _fatal.append(f"{what} failed: another rank's process went away, or its connection closed")
            raise PeerLost(
                f"rank {rank()}: {what} failed: another rank's process went away (killed, out of memory, "
                f"crashed, or its node or the network went down), or it gave up (or exited) after waiting "
                f"for this rank past the process group's timeout (then this rank was the late one). Its own "
                f"log, or the scheduler's, says which; this error follows from it. Restart the job from the last checkpoint "
                f"(shardwrap.save_checkpoint / load_checkpoint) ({exc})"
            ) from exc
        if not what or "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise
        _fatal.append(f"{what} timed out")
        raise CollectiveTimeout(
            f"rank {rank()}: {what} did not complete within the process group's timeout: another rank "
            f"stalled, died, or runs other collectives. Look at the other ranks' errors; if the delay is "
            f"expected, raise the timeout with torch.distributed.init_process_group(timeout=...) ({exc})"
        ) from exc


def broadcast(tensor: torch.Tensor, group: dist.ProcessGroup, group_src: int = 0) -> None:
    """Overwrite ``tensor`` on every rank with the ``tensor`` of the group's rank ``group_src``."""
    _count_tensor("broadcast", tensor)
    dist.broadcast(tensor, src=dist.get_global_rank(group, group_src), group=group)


def broadcast_tensors(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, group_src: int = 0) -> None:
    """Overwrite every tensor with the group's rank ``group_src``'s, one collective per dtype (the
    same dtype order on every rank)."""
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            if flat.device.type == "cpu":
                flat = flat.to(carrier_device(group))  # an NCCL-only group carries no host tensor
            broadcast(flat, group, group_src)
            for t, piece in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(piece.view_as(t))


def all_reduce_replicas(tensor: torch.Tensor, group: dist.ProcessGroup) -> dist.Work | None:
    """Start summing a reduced gradient shard over the replicate axis of a hybrid mesh (in place,
    asynchronous). Counted under ``"replicate_all_reduce"``: elements per rank."""
    _count_tensor("replicate_all_reduce", tensor)
    return dist.all_reduce(tensor, group=group, async_op=True)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, what: str = "") -> None:
    """Sum ``tensor`` in place over ranks (used for small scalars such as gradient norms);
    ``what`` names it in a timeout or a lost peer's error (``wait``)."""
    _count_tensor("all_reduce", tensor)
    wait(dist.all_reduce(tensor, group=group, async_op=True), what)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup, what: str = "") -> None:
    """Take the elementwise maximum of ``tensor`` in place over ranks."""
    _count_tensor("all_reduce", tensor)
    wait(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True), what)


def scatter(output: torch.Tensor, pieces: list[torch.Tensor] | None, group: dist.ProcessGroup) -> None:
    """The group's first rank's ``pieces[r]`` lands in rank ``r``'s ``output``.

    With 2 ranks and the first passing ``[[1, 2], [3, 4]]``, rank 0 gets ``[1, 2]`` and rank 1
    gets ``[3, 4]``. Other ranks pass ``pieces=None``.
    """
    _count_tensor("scatter", output)
    src = dist.get_global_rank(group, 0)
    dist.scatter(output, pieces if dist.get_rank() == src else None, src=src, group=group)


def broadcast_object(value: Any, group: dist.ProcessGroup) -> Any:
    """The group's first rank's ``value`` (any picklable object), returned on every rank.

    Only for values this package built itself (verdicts, names, temporary paths): the receiving
    ranks unpickle what the first rank sent, never anything read from a file.
    """
    first = group_rank(group) == 0
    _count("object", 1, len(pickle.dumps(value)) if first else 0)
    box = [value if first else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def all_gather_object(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``value`` (any picklable object), in rank order, on every rank.

    With 2 ranks, rank 0 passing ``"a"`` and rank 1 passing ``None``, both get ``["a", None]``.
    Only for values this package built itself (verdicts, checksums), as ``broadcast_object``.
    """
    _count("object", 1, len(pickle.dumps(value)))
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def barrier(group: dist.ProcessGroup) -> None:
    """Wait until every rank of ``group`` reached this point."""
    _count("barrier", 0, 0)
    dist.barrier(group=group)


# ---- ranks and groups ------------------------------------------------------------------------


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (for error messages), or 0 without a process group."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size()


def group_rank(group: dist.ProcessGroup) -> int:
    return dist.get_rank(group)


def group_size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def backend() -> str:
    return str(dist.get_backend())


def default_group() -> dist.ProcessGroup:
    """The default process group (every rank)."""
    group = dist.group.WORLD
    assert group is not None  # is_initialized() was checked by the caller
    return group


def default_mesh(device_type: str) -> DeviceMesh:
    """A 1-D mesh over every rank of the default process group."""
    return init_device_mesh(device_type, (dist.get_world_size(),))


class _GroupCache:
    """Process groups shardwrap made, by rank set, for the default group they were made under.

    ``destroy_process_group()`` unregisters every group, so after a new ``init_process_group``
    (a second run in the same process: a notebook, a hyperparameter search) the old entries are
    dead handles. The cache holds weak references only (torch's registry holds the groups while
    they are registered), so a destroyed group is freed, not kept alive by shardwrap until exit,
    and it starts empty under a new default group. Called at the same point on every rank (making
    a group is collective over the default group).
    """

    def __init__(self) -> None:
        self._world: weakref.ref[dist.ProcessGroup] | None = None
        # a weak reference, or (on a rank outside ``ranks``) a function returning new_group's
        # non-member marker, an int
        self._groups: dict[tuple[int, ...], Callable[[], Any]] = {}

    def get(self, ranks: tuple[int, ...], **new_group_kwargs: Any) -> dist.ProcessGroup:
        """The cached group over ``ranks``, made (collectively, over the default group) if absent."""
        world = default_group()
        if self._world is None or self._world() is not world:
            self._world, self._groups = weakref.ref(world), {}
        cached = self._groups.get(ranks)
        group = cached() if cached is not None else None
        if group is None:
            timeout = group_timeout(world)  # new_group's own default is 30 minutes, not the job's
            if timeout is not None:
                new_group_kwargs.setdefault("timeout", timeout)
            group = dist.new_group(list(ranks), **new_group_kwargs)
            made = group
            self._groups[ranks] = weakref.ref(group) if isinstance(group, dist.ProcessGroup) else (lambda: made)
        return group


_REDUCE_GROUPS = _GroupCache()


def reduce_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second process group over the same ranks, for reduce-scatters (cached per rank set):
    its own sequence lets reduce-scatters run beside all-gathers [design/notes/collective-schedule.md]."""
    return _REDUCE_GROUPS.get(tuple(dist.get_process_group_ranks(group)))


def reduce_group_of_mesh(mesh: DeviceMesh, axis: int = -1) -> dist.ProcessGroup:
    """``reduce_group_for`` the shard axis of a 2-D mesh (the last for hybrid sharding, the first
    for (dp, tp)): every rank creates the reduce group of every line of ranks along that axis, in
    the same order (``new_group`` is collective over the default group), and keeps its own."""
    lines = mesh.mesh.movedim(axis, -1)
    rows = [tuple(int(r) for r in row) for row in lines.reshape(-1, lines.shape[-1]).tolist()]
    me = dist.get_rank()
    mine = None
    for ranks in rows:
        made = _REDUCE_GROUPS.get(ranks)
        if me in ranks:
            mine = made
    assert mine is not None  # the mesh covers every rank (checked by the caller)
    return mine


_CHECKPOINT_GROUPS = _GroupCache()


def checkpoint_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo process group over the same ranks for checkpoint saves that run in the background
    (cached per rank set; every rank must call it at the same point the first time): its own
    sequence, so a save's collectives on a helper thread never interleave with training's."""
    return _CHECKPOINT_GROUPS.get(tuple(dist.get_process_group_ranks(group)), backend="gloo")


def init_fake_world(world: int) -> None:
    """A fake process group of ``world`` ranks in this one process (the estimator's simulation):
    collectives return at once and move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError(
                f"shardwrap.estimate.simulate needs a fake process group of {world} ranks, but this process "
                f"already has a real one ({dist.get_backend()}, {dist.get_world_size()} ranks): run the estimate "
                f"in a process of its own (python -m shardwrap.estimate ... --simulate)"
            )
        if dist.get_world_size() == world:
            return
        dist.destroy_process_group()  # a simulation at another world size: the last one's fake world goes
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


# ---- process exit --------------------------------------------------------------------------------

GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives each gloo process group's worker threads


def gloo_worker_states() -> list[str] | None:
    """The scheduler state of each of this process's gloo worker threads ('R': running or waiting
    for a core, 'D': in an uninterruptible wait such as a page fault, 'S': asleep), from
    ``/proc``; None where ``/proc`` is not there to ask."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name_end = stat.rindex(")")
        if stat[stat.index("(") + 1 : name_end] == GLOO_WORKER:
            states.append(stat[name_end + 2])
    return states


def let_gloo_workers_finish(limit_s: float = 2.0) -> None:
    """Free the GIL until no gloo worker thread is running: the last thing a worker does with a
    finished collective is drop its tensors, and one whose Python object the caller dropped
    first needs the GIL for that. Called at exit, before the interpreter finalizes: CPython
    3.10-3.13 end a thread that takes the GIL after that point with ``pthread_exit``, whose
    unwinding through torch's ``noexcept`` destructors aborts the process ("terminate called
    without an active exception"). Registered when shardwrap is imported, so it runs after the
    exit handlers registered later. Collectives still in flight (never waited for) are not
    covered: a worker blocked on a peer looks asleep. [design/notes/failure-modes.md, "An abort
    at exit"]"""
    states = gloo_worker_states()
    if states is None:  # no /proc: a short pause covers a worker that is about to finish
        if dist.is_available() and dist.is_initialized():
            time.sleep(0.02)
        return
    if not states:
        return
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < 3 and time.monotonic() < deadline:
        time.sleep(0.002)  # the GIL is free: a worker waiting for it takes it now
        busy = any(state in "RD" for state in gloo_worker_states() or [])  # running, or in the kernel
        quiet = 0 if busy else quiet + 1


atexit.register(let_gloo_workers_finish)
