"""The collective schedule: which unit's collective comes next, the same on every rank.

Collectives pair up by position in each process group's sequence, so every rank must issue the
same collectives in the same order even when ranks' backward graphs differ (a unit unused on some
ranks). The schedule fixes that order from the forward, which every rank runs identically, and
hands units out in that order; the units themselves do the collectives and change their own
state (design/notes/collective-schedule.md):

* all-gathers for backward go in reverse post-forward order (outputs made last get their
  gradient first); asking for a unit first hands out every unit before it in that order;
* reduce-scatters go in reverse pre-forward order (a unit's parameters finish their gradient
  after its children's), run asynchronously on their own process group, and a ready unit waits
  for every unit before it;
* at the end of backward, whatever a rank's graph skipped is handed out anyway: the missing
  all-gathers, and reduce-scatters (of zeros where a rank has no gradient);
* reduce-scatters in flight are bounded by waiting only for those every rank has started, which
  ranks learn from a small all-gather beside each scheduled backward unit (CPU groups), or, where
  every reduce-scatter is pairwise, from its own receives (then only the first of those
  all-gathers is issued).

The schedule reads a unit's state (``grad_state``, ``data_state``, ``reduce_completed``) but
never writes it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from shardwrap import collectives

if TYPE_CHECKING:
    from shardwrap.unit import Unit


OUT_OF_STEP_HINT = (
    "Every rank must run the same forwards and backwards, in the same order, through the same "
    "units: an extra forward, a skipped backward or a data-dependent branch on one rank breaks that "
    "(a generation loop must go on until every rank is done, as Hugging Face's generate does with "
    "synced_gpus=True, its default on a ShardedModule)"
)


def header_text(kind: int, value: int, unit_names: list[str] | None = None) -> str:
    """What a peer's small exchange says it is, in words. A gather header's value is the unit's
    index plus, from bit 32 up, how many gathers that rank started together (stage 2's forward),
    and its kind carries, from bit 8 up, a digest of those gathers' units. Bits 48 up of every
    value are the sender's history, which ``history_hint`` reads."""
    base, value = kind & 0xFF, value & collectives.LOW_BITS
    if base in (collectives.HEADER_FORWARD, collectives.HEADER_BACKWARD):
        index, together = value & 0xFFFFFFFF, value >> 32
        name = unit_names[index] if unit_names is not None and index < len(unit_names) else f"#{index}"
        phase = "forward" if base == collectives.HEADER_FORWARD else "backward"
        started = f" (the first of {together} gathers started together)" if together else ""
        return f"all-gather of unit '{name}' in {phase}{started}"
    if base == collectives.HEADER_COUNTS:
        return "a reduce-scatter count exchange in backward"
    if base == collectives.HEADER_END:
        return "the end of a backward"
    if base == collectives.HEADER_CALL:
        return f"{collectives.CALLS.get(value, 'a call')}, between steps"
    return f"an unknown exchange ({kind}, {value})"


def history_hint(rows: Sequence[Sequence[int]]) -> str:
    """Where every rank's header (``(kind, value)``, one per rank) names the same collective and
    the histories differ, a sentence saying how the ranks' pasts differ and what to do; else
    ``""`` (ranks at different collectives differ in history too, for another reason)."""
    if len({(k, v & collectives.LOW_BITS) for k, v in rows}) > 1:
        return ""
    pasts = [collectives.split_history(v)[1:] for _, v in rows]
    if len(set(pasts)) == 1:
        return ""
    which = 0 if len({steps for steps, _ in pasts}) > 1 else 1
    seen = ", ".join(f"rank {r}: {past[which]}" for r, past in enumerate(pasts))
    return _HISTORY_HINTS[which].format(seen=seen, modulo=(collectives.STEPS_MODULO, collectives.DROPS_MODULO)[which])


_HISTORY_HINTS = (
    " The ranks have stepped this model a different number of times ({seen}; counted modulo {modulo}): an "
    "optimizer.step() that was skipped, or that raised, on some ranks only, left their shards behind the others'. "
    "Decide to skip a step on every rank alike (all-reduce the flag), and restart from the last checkpoint.",
    " Some ranks dropped a forward or backward that raised, and the others did not ({seen}; counted modulo "
    "{modulo}): a failed pass drops every gradient pending on its rank, those of the no_sync micro-batches before "
    "it too, so the ranks' gradients no longer cover the same batches. Catch an error on every rank alike "
    "(all-reduce a flag), and restart from the last checkpoint.",
)


class CollectiveSchedule:
    def __init__(
        self, *, max_unsharded: int = 2, group: collectives.Group | None = None, max_reduces_in_flight: int = 1
    ) -> None:
        self.max_unsharded = max_unsharded  # current unit + units gathered ahead of use
        # The count exchange runs on the all-gather group, whose sequence is the same on every rank;
        # only CPU groups: reading the counts of a CUDA collective would synchronize the stream.
        self.group = group
        self.max_reduces_in_flight = max_reduces_in_flight
        self._counting = False  # exchange counts in this backward
        self._accumulated: list[int] = []  # units with no_sync gradients outside this backward's schedule
        self._one_count = False  # ... at the first scheduled unit only (every reduce-scatter is pairwise)
        self._counts_issued = 0
        self._started = 0  # reduce-scatters this rank started in this backward
        self._started_everywhere = 0  # ... that every rank is known to have started
        self._exchanges: deque[tuple[collectives.Work | None, torch.Tensor]] = deque()
        self.pre_forward: list[Unit] = []  # units forwarded with grad enabled, first call order
        self.post_forward: list[Unit] = []  # units whose outputs required grad, first return order
        self.forward_trace: list[Unit] = []  # every unit forwarded this step, in order
        self.last_forward: list[Unit] = []  # the previous step's trace: the prefetch order
        self.prefetched: set[Unit] = set()  # gathered ahead of use, not used yet
        self.gather_all_ahead = True  # stage 2 on a CPU: the first unit's pre_forward gathers every unit (phases.py turns it off)
        self._gather: list[Unit] = []
        self._gather_pos = 0
        self._reduce: list[Unit] = []
        self._reduce_pos = 0
        self._in_flight: list[tuple[int, Unit]] = []  # (position in the reduce sequence, unit)
        self._released = False  # a unit finished its backward: activations are being freed
        # The first "ranks disagree" error: from then on the module issues no collective
        # (ShardedModule.refuse_out_of_step; design/notes/rank-agreement.md, "After ranks disagreed")
        self.fell_out: str | None = None
        self.history = 0  # the model's ``collectives.history``, which every header carries (ShardedModule.note_history)
        self._trained_done = False  # a unit that trains finished its forward in this forward call
        self._behind_training: set[Unit] = set()  # units that started after one did (this step)

    def out_of_step(self, message: str) -> RuntimeError:
        """The ranks were found to disagree on the next collective: remember the first such error
        (every later collective is refused) and return this one to raise."""
        if self.fell_out is None:
            self.fell_out = message
        return RuntimeError(message)

    def clear(self) -> None:
        self.pre_forward.clear()
        self.post_forward.clear()
        self._behind_training.clear()

    # ---- forward ------------------------------------------------------------------------------

    def start_forward(self) -> None:
        """A new step's first forward: the last trace becomes the prefetch order."""
        if self.forward_trace:
            self.last_forward, self.forward_trace = self.forward_trace, []

    def record_pre_forward(self, unit: Unit, grad_enabled: bool) -> None:
        if unit.index == 0:
            self._trained_done = False
        elif self._trained_done:
            self._behind_training.add(unit)
        if unit not in self.forward_trace:
            self.forward_trace.append(unit)
        if grad_enabled and unit not in self.pre_forward:
            self.pre_forward.append(unit)

    def record_post_forward(self, unit: Unit) -> None:
        if unit not in self.post_forward:
            self.post_forward.append(unit)

    def finished_forward(self, trains: bool) -> None:
        """A unit's forward returned (grad enabled): after one that trains, the units that start
        may take inputs that need a gradient on some ranks only."""
        self._trained_done = self._trained_done or trains

    def behind_training(self, unit: Unit) -> bool:
        """Whether ``unit`` started, in a grad-enabled forward of this step, after a unit that
        trains had finished: the same on every rank that runs the same units in the same order."""
        return unit in self._behind_training

    def ended_last_forward(self, unit: Unit) -> bool:
        """Whether ``unit`` was the last unit to start its forward in the previous step."""
        return bool(self.last_forward) and self.last_forward[-1] is unit

    def arrived(self, unit: Unit) -> None:
        """``unit`` is about to run: it no longer counts as gathered ahead."""
        self.prefetched.discard(unit)

    def forward_prefetch(self, unit: Unit) -> Unit | None:
        """The unit that followed ``unit`` in the previous step's forward, if it may be gathered
        ahead now (within ``max_unsharded``); it then counts as prefetched."""
        order = self.last_forward
        if unit not in order:
            return None
        i = order.index(unit)
        return self._take_prefetch(order[i + 1]) if i + 1 < len(order) else None

    def forward_prefetch_rest(self, unit: Unit) -> list[Unit]:
        """Every unit after ``unit`` in the previous step's forward that needs a gather, in that
        order; they then count as prefetched. Stage 2 on a CPU keeps every unit's parameters from
        its forward to its backward, so every unit is gathered at the end of the forward anyway:
        gathering them all when the forward starts adds nothing to the step's peak, and the ranks
        meet once instead of at every unit (design/notes/prefetch.md, "Stage 2 on a CPU")."""
        order = self.last_forward
        if unit not in order:
            return []
        ahead = [u for u in order[order.index(unit) + 1 :] if u not in self.prefetched and u.needs_gather]
        self.prefetched.update(ahead)
        return ahead

    def gathers_after(self, unit: Unit) -> Unit | None:
        """The unit the forward gathers ahead when the unit after ``unit`` starts: two after it in
        the previous step's order (a spare buffer of ``unit``'s may serve it)."""
        order = self.last_forward
        if unit not in order:
            return None
        i = order.index(unit)
        return order[i + 2] if i + 2 < len(order) else None

    def _take_prefetch(self, unit: Unit) -> Unit | None:
        if unit in self.prefetched or len(self.prefetched) + 1 >= self.max_unsharded or not unit.needs_gather:
            return None
        self.prefetched.add(unit)
        return unit

    def take_prefetched(self) -> list[Unit]:
        """Units gathered ahead that the forward did not use (its order changed): the caller
        reshards them."""
        out = list(self.prefetched)
        self.prefetched.clear()
        return out

    # ---- backward -----------------------------------------------------------------------------

    def begin_backward(self, *, sync: bool, accumulated: Sequence[int] = ()) -> None:
        """``accumulated``: the indices of units holding gradients from ``no_sync`` backwards,
        which the end of backward reduces too: the order digest covers them with the rest."""
        self._gather, self._gather_pos = self.post_forward[::-1], 0
        self._reduce, self._reduce_pos = [u for u in self.pre_forward[::-1] if u.trains], 0
        scheduled = {u.index for u in self._reduce}
        self._accumulated = sorted(i for i in accumulated if i not in scheduled)
        self.prefetched.clear()
        self._released = False
        self._counting = sync and self.group is not None and collectives.world_size() > 1
        # Pairwise reduce-scatters say themselves when every peer started them (their receives
        # landed): one count exchange at the first scheduled unit then keeps the backward's
        # sequence checked, and the rest are left out (design/notes/collective-schedule.md).
        self._one_count = self._counting and all(u.reduces_pairwise for u in self._reduce)
        self._counts_issued = 0
        self._order_checked = False  # the first count exchange (it carries the reduce-scatter order) was waited for
        self._started = self._started_everywhere = 0

    @property
    def accumulated(self) -> list[int]:
        """The indices of units holding ``no_sync`` gradients (on some rank) outside this
        backward's schedule, which the end of a reducing backward reduces in index order."""
        return self._accumulated

    def scheduled_reductions(self) -> list[int]:
        """The indices of the units this backward schedules to reduce."""
        return [u.index for u in self._reduce]

    def gathers_through(self, unit: Unit) -> Iterator[Unit]:
        """Every scheduled unit up to and including ``unit`` that is not handed out yet, in
        schedule order (nothing if ``unit`` is past or outside the schedule). The caller gathers
        each; the count exchange follows each gather (only the first, where every reduce-scatter is
        pairwise)."""
        if unit not in self._gather[self._gather_pos :]:
            return
        while True:
            current = self._gather[self._gather_pos]
            self._gather_pos += 1
            yield current
            self._exchange_counts()
            if current is unit:
                return

    def unit_backward_done(self) -> None:
        """A unit's post_backward ran: from now on backward may gather ahead (notes/prefetch.md)."""
        self._released = True

    def backward_prefetch(self) -> Unit | None:
        """The next scheduled unit to gather ahead, within the limit, but not before the first
        unit has finished its backward: until then every activation is alive, and a unit gathered
        ahead would add its whole size to the step's peak. The caller starts its gather and then
        calls ``gathered_ahead``."""
        if not self._released or len(self.prefetched) + 1 >= self.max_unsharded:
            return None
        if self._gather_pos >= len(self._gather):
            return None
        ahead = self._gather[self._gather_pos]
        self._gather_pos += 1
        self.prefetched.add(ahead)
        return ahead

    def gathered_ahead(self) -> None:
        self._exchange_counts()

    def _exchange_counts(self) -> None:
        """Beside each scheduled backward unit (the same sequence on every rank), tell every rank
        how many reduce-scatters this one has started; where every reduce-scatter of the backward
        is pairwise, beside the first only (design/notes/collective-schedule.md)."""
        if self._counting and self.group is not None and not (self._one_count and self._counts_issued):
            # The first carries a digest of this backward's reduce-scatter order: ranks whose
            # forwards ran different units would pair their reduce-scatters wrongly
            # (check_landed_exchanges waits for it before the first one starts).
            order = [u.index for u in self._reduce] + [0xFFFFFFFF] + self._accumulated
            digest = collectives.digest48(order) if self._counts_issued == 0 else 0
            self._counts_issued += 1
            self._exchanges.append(collectives.exchange_counts(self._started, self.group, digest, self.history))

    def _wait_exchange(self, work: collectives.Work | None, counts: torch.Tensor) -> None:
        """Wait for a count exchange; raise if a peer sent something else in its place (its
        sequence diverged: design/notes/rank-agreement.md)."""
        collectives.wait(work, "a reduce-scatter count exchange in backward")
        self._order_checked = True
        kinds = counts[:, 0].tolist()
        if any(k & 0xFF != collectives.HEADER_COUNTS for k in kinds):
            names = list(self._reduce[0].unit_names) if self._reduce else None
            seen = ", ".join(f"rank {r}: {header_text(k, int(v), names)}" for r, (k, v) in enumerate(counts.tolist()))
            raise self.out_of_step(f"rank {collectives.rank()}: shardwrap: ranks disagree on the next collective ({seen}). {OUT_OF_STEP_HINT}")
        hint = history_hint([[0, v & ~collectives.LOW_BITS] for v in counts[:, 1].tolist()])  # (the counts may differ)
        if hint:
            raise self.out_of_step(f"rank {collectives.rank()}: shardwrap: ranks disagree at a reduce-scatter count exchange in backward.{hint}")
        if len(set(kinds)) > 1:  # the first exchange's digests of the reduce-scatter order differ
            group = self.group
            assert group is not None  # counts are exchanged only on a group
            mine = kinds[torch.distributed.get_rank(group)]
            differ = ", ".join(f"rank {torch.distributed.get_global_rank(group, r)}" for r, k in enumerate(kinds) if k != mine)
            order = ", ".join(f"'{u.name}'" for u in self._reduce)
            names = list(self._reduce[0].unit_names) if self._reduce else []
            kept = ", ".join(f"'{names[i]}'" if i < len(names) else f"#{i}" for i in self._accumulated)
            kept = f", then accumulated under no_sync: {kept}" if kept else ""
            raise self.out_of_step(
                f"rank {collectives.rank()}: shardwrap: ranks disagree on which units this backward reduces: "
                f"their forwards ran different units, or ran a unit under torch.no_grad() on some ranks only "
                f"(give each unit the same grad mode on every rank) (this rank's, in reduce order: {order}{kept}; "
                f"{differ} ran others). "
                f"{OUT_OF_STEP_HINT}"
            )

    def reductions_due(self) -> Iterator[Unit]:
        """Units whose reduce-scatter may start now, in order: each has its gradient packed and
        every unit before it has started. The caller starts each, then calls ``started``."""
        while self._reduce_pos < len(self._reduce) and self._reduce[self._reduce_pos].grad_packed:
            self._reduce_pos += 1
            yield self._reduce[self._reduce_pos - 1]

    def started(self, unit: Unit) -> None:
        self._in_flight.append((self._started, unit))
        self._started += 1

    def completed(self) -> list[Unit]:
        """Take the units whose reduce-scatter has finished (never waits): the caller applies them.

        Never *waiting* here matters: a peer whose graph deferred that reduce-scatter may be
        blocked in an all-gather this rank has yet to issue (notes/collective-schedule.md).
        """
        done = [u for _, u in self._in_flight if u.reduce_completed()]
        self._in_flight = [(pos, u) for pos, u in self._in_flight if u not in done]
        return done

    def over_bound(self) -> Unit | None:
        """While more than ``max_reduces_in_flight`` are in flight, the oldest, if every rank is
        known to have started it (then waiting for it cannot deadlock); the caller waits for it
        and applies it."""
        if len(self._in_flight) <= self.max_reduces_in_flight:
            return None
        position, oldest = self._in_flight[0]
        if not (oldest.reduce_started_everywhere() or self._started_by_everyone(position)):
            return None
        self._in_flight.pop(0)
        return oldest

    def check_landed_exchanges(self) -> None:
        """Check every count exchange that has already completed, in order (never waits; gloo's
        all-gather says it completed without a ``wait()``): a peer whose small exchange met this
        one's with another meaning (a header of its next forward: it left this backward out)
        makes every rank raise before a reduce-scatter that peer will never issue
        (design/notes/rank-agreement.md, "After ranks disagreed")."""
        while self._exchanges and (
            self._exchanges[0][0] is None or self._exchanges[0][0].is_completed() or not self._order_checked
        ):  # the first exchange is waited for: no reduce-scatter may start before the order is agreed
            work, counts = self._exchanges.popleft()
            self._wait_exchange(work, counts)
            self._started_everywhere = max(self._started_everywhere, int((counts[:, 1] & collectives.LOW_BITS).min()))

    def _started_by_everyone(self, position: int) -> bool:
        """Whether every rank has started the reduce-scatter at ``position``, waiting for the count
        exchanges in order until one says so. Waiting for an exchange is safe: every rank issues
        it beside the same scheduled unit without waiting for anything this rank has not issued."""
        while self._started_everywhere <= position and self._exchanges:
            work, counts = self._exchanges.popleft()
            self._wait_exchange(work, counts)
            self._started_everywhere = max(self._started_everywhere, int((counts[:, 1] & collectives.LOW_BITS).min()))
        return self._started_everywhere > position

    # ---- end of backward ----------------------------------------------------------------------

    def skipped_gathers(self) -> list[Unit]:
        """Scheduled all-gathers this rank's graph did not reach; the caller issues each, then
        calls ``gathered_ahead`` (the count exchange)."""
        rest = self._gather[self._gather_pos :]
        self._gather_pos = len(self._gather)
        return rest

    def skipped_reductions(self) -> list[Unit]:
        """Scheduled reduce-scatters not started yet, in order."""
        rest = self._reduce[self._reduce_pos :]
        self._reduce_pos = len(self._reduce)
        return rest

    def end_backward(self, wait: bool = True, keep_forward: bool = False) -> None:
        """Wait for the count exchanges still in flight and forget this backward. A failed wait
        does not stop the reset; the first failure is raised after it. After a lost peer the
        other exchanges are still waited for (they fail at once); after any other failure (a
        timeout), or with ``wait=False``, they are not, since each could take the whole timeout.
        ``keep_forward``: another forward's graph still waits for its backward, which schedules
        from the same record (design/notes/collective-schedule.md, "A backward each")."""
        exchanges, self._exchanges = self._exchanges, deque()
        failure: BaseException | None = None
        for work, counts in exchanges:
            if not wait or (failure is not None and not collectives.lost_a_peer(failure)):
                break
            try:
                self._wait_exchange(work, counts)
            except Exception as exc:
                failure = failure or exc
        self._counting = False
        self._in_flight = []
        self._gather, self._reduce = [], []
        self.prefetched.clear()
        if not keep_forward:
            self.clear()
        if failure is not None:
            raise failure
