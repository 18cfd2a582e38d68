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
  all-gathers, and reduce-scatters of zeros.
"""

from __future__ import annotations

from shardwrap.handle import TrainingState, UnitHandle


class CollectiveSchedule:
    def __init__(self) -> None:
        self.pre_forward: list[UnitHandle] = []  # units forwarded with grad enabled, first call order
        self.post_forward: list[UnitHandle] = []  # units whose outputs required grad, first return order
        self._gather: list[UnitHandle] = []
        self._gather_pos = 0
        self._reduce: list[UnitHandle] = []
        self._reduce_pos = 0

    def clear(self) -> None:
        self.pre_forward.clear()
        self.post_forward.clear()

    def record_pre_forward(self, handle: UnitHandle) -> None:
        if handle not in self.pre_forward:
            self.pre_forward.append(handle)

    def record_post_forward(self, handle: UnitHandle) -> None:
        if handle not in self.post_forward:
            self.post_forward.append(handle)

    def begin_backward(self) -> None:
        self._gather, self._gather_pos = self.post_forward[::-1], 0
        self._reduce, self._reduce_pos = [h for h in self.pre_forward[::-1] if h.has_trainable], 0

    def gather_through(self, handle: UnitHandle) -> None:
        """Unshard ``handle`` for backward, after every unit scheduled before it."""
        if handle not in self._gather[self._gather_pos :]:
            handle.unshard()  # already gathered in this backward (or outside the schedule)
            return
        while True:
            current = self._gather[self._gather_pos]
            self._gather_pos += 1
            current.unshard()
            current.training_state = TrainingState.BACKWARD
            if current is handle:
                return

    def flush_reductions(self) -> None:
        """Start the reduce-scatter of every ready unit whose predecessors have all started."""
        while self._reduce_pos < len(self._reduce) and self._reduce[self._reduce_pos].grad_ready:
            self._reduce[self._reduce_pos].start_reduce()
            self._reduce_pos += 1

    def finish(self, handles: list[UnitHandle]) -> None:
        """Issue what this rank's graph skipped, then wait for every reduction."""
        for handle in self._gather[self._gather_pos :]:
            handle.unshard()
        for handle in self._reduce[self._reduce_pos :]:
            handle.start_reduce()
        for handle in handles:
            if handle.grad_ready:  # gradient from a unit outside the recorded forward
                handle.start_reduce()
            handle.finish_reduce()
        self._gather, self._reduce = [], []
        self.clear()
