"""The collective schedule: the order in which every rank issues its collectives in backward.

Collectives pair up by position in each process group's sequence, so every rank must issue the
same collectives in the same order even when ranks' backward graphs differ (a unit unused on some
ranks). The schedule fixes that order from the forward, which every rank runs identically, and
issues collectives only in that order (design/notes/collective-schedule.md):

* all-gathers for backward go in reverse post-forward order (outputs made last get their
  gradient first); asking for a unit first gathers every unit before it in that order;
* reduce-scatters go in reverse pre-forward order (a unit's parameters finish their gradient
  after its children's), run asynchronously on their own process group, and a ready unit waits
  for every unit before it;
* at the end of backward, whatever a rank's graph skipped is issued anyway: the missing
  all-gathers, and reduce-scatters of zeros;
* reduce-scatters in flight are bounded by waiting only for those every rank has started, which
  ranks learn from a one-integer all-gather beside each scheduled backward unit (CPU groups).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from shardwrap import collectives
from shardwrap.handle import DataState, TrainingState, UnitHandle


class CollectiveSchedule:
    def __init__(
        self, *, max_unsharded: int = 2, group: dist.ProcessGroup | None = None, max_reduces_in_flight: int = 1
    ) -> None:
        self.max_unsharded = max_unsharded  # current unit + units gathered ahead of use
        # The count exchange runs on the all-gather group, whose sequence is the same on every rank;
        # only CPU groups: reading the counts of a CUDA collective would synchronize the stream.
        self.group = group
        self.max_reduces_in_flight = max_reduces_in_flight
        self._counting = False  # exchange counts in this backward
        self._started = 0  # reduce-scatters this rank started in this backward
        self._started_everywhere = 0  # ... that every rank is known to have started
        self._exchanges: deque[tuple[dist.Work | None, torch.Tensor]] = deque()
        self.pre_forward: list[UnitHandle] = []  # units forwarded with grad enabled, first call order
        self.post_forward: list[UnitHandle] = []  # units whose outputs required grad, first return order
        self.forward_trace: list[UnitHandle] = []  # every unit forwarded this step, in order
        self.last_forward: list[UnitHandle] = []  # the previous step's trace: the prefetch order
        self.prefetched: set[UnitHandle] = set()  # gathered ahead of use, not used yet
        self._gather: list[UnitHandle] = []
        self._gather_pos = 0
        self._reduce: list[UnitHandle] = []
        self._reduce_pos = 0
        self._in_flight: list[tuple[int, UnitHandle]] = []  # (position in the reduce sequence, unit)
        self._released = False  # a unit finished its backward: activations are being freed

    def clear(self) -> None:
        self.pre_forward.clear()
        self.post_forward.clear()

    # ---- forward ------------------------------------------------------------------------------

    def start_forward(self) -> None:
        """A new step's first forward: the last trace becomes the prefetch order."""
        if self.forward_trace:
            self.last_forward, self.forward_trace = self.forward_trace, []

    def record_pre_forward(self, handle: UnitHandle, grad_enabled: bool) -> None:
        if handle not in self.forward_trace:
            self.forward_trace.append(handle)
        if grad_enabled and handle not in self.pre_forward:
            self.pre_forward.append(handle)

    def record_post_forward(self, handle: UnitHandle) -> None:
        if handle not in self.post_forward:
            self.post_forward.append(handle)

    def unshard_for_forward(self, handle: UnitHandle) -> None:
        """Unshard ``handle`` and start gathering the unit that followed it last step."""
        self.prefetched.discard(handle)
        handle.unshard()
        order = self.last_forward
        if handle in order:
            i = order.index(handle)
            if i + 1 < len(order):
                self._prefetch(order[i + 1])

    def _prefetch(self, handle: UnitHandle) -> None:
        if handle.gathering or handle in self.prefetched or len(self.prefetched) + 1 >= self.max_unsharded:
            return
        if handle.data_state is DataState.UNSHARDED and not handle.stale:
            return
        handle.unshard(async_op=True)
        self.prefetched.add(handle)

    def drop_prefetched(self) -> None:
        """Reshard units gathered ahead that the forward did not use (its order changed)."""
        for handle in self.prefetched:
            handle.reshard()
        self.prefetched.clear()

    # ---- backward -----------------------------------------------------------------------------

    def begin_backward(self, *, sync: bool) -> None:
        self._gather, self._gather_pos = self.post_forward[::-1], 0
        self._reduce, self._reduce_pos = [h for h in self.pre_forward[::-1] if h.has_trainable], 0
        self.prefetched.clear()
        self._released = False
        self._counting = sync and self.group is not None and dist.get_world_size(self.group) > 1
        self._started = self._started_everywhere = 0

    def gather_through(self, handle: UnitHandle) -> None:
        """Unshard ``handle`` for backward, after every unit scheduled before it; then start
        gathering the next scheduled unit if the limit allows."""
        if handle in self._gather[self._gather_pos :]:
            while True:
                current = self._gather[self._gather_pos]
                self._gather_pos += 1
                current.unshard(async_op=current is not handle)
                self._exchange_counts()
                current.training_state = TrainingState.BACKWARD
                if current is handle:
                    break
        self.prefetched.discard(handle)
        self.retire_reductions()  # before this unit's buffers are allocated
        handle.unshard()  # finishes a prefetch, or re-gathers a unit outside the schedule
        self._prefetch_backward()

    def unit_backward_done(self) -> None:
        """A unit's post_backward ran: from now on backward may gather ahead (notes/prefetch.md)."""
        self._released = True
        self._prefetch_backward()

    def _prefetch_backward(self) -> None:
        """Start gathering the next scheduled unit, within the limit, but not before the first
        unit has finished its backward: until then every activation is alive, and a unit gathered
        ahead would add its whole size to the step's peak."""
        if not self._released or len(self.prefetched) + 1 >= self.max_unsharded:
            return
        if self._gather_pos < len(self._gather):
            ahead = self._gather[self._gather_pos]
            self._gather_pos += 1
            ahead.unshard(async_op=True)
            self._exchange_counts()
            self.prefetched.add(ahead)

    def _exchange_counts(self) -> None:
        """Beside each scheduled backward unit (the same sequence on every rank), tell every rank
        how many reduce-scatters this one has started (design/notes/collective-schedule.md)."""
        if self._counting:
            self._exchanges.append(collectives.exchange_counts(self._started, self.group))

    def flush_reductions(self) -> None:
        """Start the reduce-scatter of every ready unit whose predecessors have all started."""
        while self._reduce_pos < len(self._reduce) and self._reduce[self._reduce_pos].grad_ready:
            self._start_reduce(self._reduce[self._reduce_pos])
            self._reduce_pos += 1

    def _start_reduce(self, handle: UnitHandle) -> None:
        """Start ``handle``'s reduce-scatter, after retiring every earlier one that completed, and
        then bound how many are in flight."""
        self.retire_reductions()
        handle.start_reduce()
        self._in_flight.append((self._started, handle))
        self._started += 1
        self._bound_reductions()

    def retire_reductions(self) -> None:
        """Apply every completed reduce-scatter and free its packed gradient (a whole unit each).

        Never *waits*: a peer whose graph deferred that reduce-scatter may be blocked in an
        all-gather this rank has yet to issue (notes/collective-schedule.md).
        """
        waiting = []
        for position, earlier in self._in_flight:
            if earlier.reduce_completed():
                earlier.finish_reduce()
            else:
                waiting.append((position, earlier))
        self._in_flight = waiting

    def _bound_reductions(self) -> None:
        """Wait for the oldest reduce-scatters while more than ``max_reduces_in_flight`` are in
        flight, but only for those every rank has started: waiting for one a peer deferred could
        deadlock, waiting for one every rank started cannot."""
        while len(self._in_flight) > self.max_reduces_in_flight:
            position, oldest = self._in_flight[0]
            if not self._started_by_everyone(position):
                return
            oldest.finish_reduce()
            self._in_flight.pop(0)

    def _started_by_everyone(self, position: int) -> bool:
        """Whether every rank has started the reduce-scatter at ``position``, waiting for the count
        exchanges in order until one says so. Waiting for an exchange is safe: every rank issues
        it beside the same scheduled unit without waiting for anything this rank has not issued."""
        while self._started_everywhere <= position and self._exchanges:
            work, counts = self._exchanges.popleft()
            if work is not None:
                work.wait()
            self._started_everywhere = max(self._started_everywhere, int(counts.min()))
        return self._started_everywhere > position

    def finish(self, handles: list[UnitHandle], *, sync: bool) -> None:
        """Issue what this rank's graph skipped, then (when syncing) wait for every reduction."""
        for handle in self._gather[self._gather_pos :]:
            handle.unshard()
            self._exchange_counts()
        if sync:
            for handle in self._reduce[self._reduce_pos :]:
                handle.pack_grad()  # gradient kept from no_sync micro-batches, if any
                self._start_reduce(handle)
            for handle in handles:
                if handle.grad_pending or handle.grad_ready:  # a unit outside the recorded forward
                    handle.pack_grad()
                    self._start_reduce(handle)
            for handle in handles:
                handle.finish_reduce()
        for work, _ in self._exchanges:
            if work is not None:
                work.wait()
        self._exchanges.clear()
        self._counting = False
        self._in_flight = []
        self._gather, self._reduce = [], []
        self.prefetched.clear()
        self.clear()
