"""The want-book: parked wants, and the grant rule that picks the next one.

Theory of operation
===================

A *want* is a client's request for one slot: ``(connection, job_id, service,
priority)``. It stays parked here until the grant rule picks it for a free slot.
The rule, from the protocol, is applied to the wants whose service *fits* the pool
right now (the caller passes that set of services in; this module knows nothing
about pools):

1. **Priority.** Only the highest priority among fitting wants is considered.
2. **Round-robin across connections** within that priority. Each priority has a
   *rotation*: the connections with wants parked at that priority, in order. A
   connection that parks its first want at a priority joins at the tail. A grant
   takes the first connection in the rotation that has a fitting want, and moves it
   to the tail (or removes it when it has no wants left there). Connections passed
   over because nothing of theirs fits keep their places.
3. **FIFO within a connection**, among its fitting wants at that priority: the
   oldest *fitting* want is granted. A want that does not fit never blocks one
   behind it (no head-of-line blocking).

Turn hold
---------

The rule above only sees wants that are parked. A client with one job in flight
parks its next want when the ``DONE`` of the last one arrives, a round trip
after its slot freed; were the freed slot offered at once, it would go to a
flooding connection every time, and with equal job lengths (the slots free
together) the client would lose every other wave: an eighth of 4 slots instead
of a quarter. So the broker (:mod:`trio_broker.core.broker`) keeps the slot a
job frees for its connection X for ``turn_hold`` seconds (0.05 by default) when
X is *owed the turn* at the job's priority P, that is when all of these hold:

* X has no want parked at P, and no want at all is parked above P;
* a parked want at P or below would take the slot now;
* some connection has wants parked at P (the hold arbitrates between connections
  of one priority only: a slot is never held against lower priorities alone);
* every connection with wants parked at P has been granted a slot at P after
  X's *latest* grant at P, and none of them waits for its first grant since it
  joined the rotation (:meth:`WantBook.turn_comes_first`: its place comes from
  a grant).

X's latest grant at P, not the grant of the job that ended: with several jobs
at P, X's place in the rotation is the one its last grant gave it. A connection
whose older job ends after the rotation served it again is not owed the turn
(were it held a slot too, a waiting connection would be passed over twice
between two of its own turns). The book keeps each connection's latest grant
per priority (:meth:`WantBook.last_grant`) from its first grant there until it
closes (:meth:`WantBook.remove_connection`), whether or not it still has wants
there: one number per priority a connection was ever granted at.

A connection holds at most one slot this way. X's next ``WANT`` ends the hold:
when it is of priority P or above and fits, it is granted at once
(:meth:`WantBook.grant`), outside the rotation (X keeps its turn); otherwise the
rule runs as usual. A want parked above P by anyone, the end of ``turn_hold``,
X closing and draining end the hold too, and the rule runs. So does aging:
a want lifted above P (by anyone) or a want of X lifted to P ends the hold at
the start of the input that applies the lift, before the input itself (so X's
next ``WANT`` never takes a held slot over a want aged above it, nor over X's
own older want at its priority). So a held slot never
goes to a lower priority than a want parked while it was held (no inversion), a
connection waiting for its first grant is never made to wait by a hold, and the
rule stays deterministic: the hold depends only on the grant numbers the book
keeps (:attr:`WantBook.grants`, one per grant) and on the time passed in.

Aging
-----

Off by default (``WantBook(aging=None)``: strict priority). With ``aging=I``
seconds, a parked want rises one *band* per ``I`` of waiting: by 2, so a normal
want stays even and a high variant (odd) stays odd (bands: background -2,
normal 0, interactive 2, synchronous 4, each +1 for its high variant). It stops
at the top band: 4 for an even priority, 5 for an odd one
(:func:`aging_ceiling`); a want parked at or above that does not age. Its k-th
lift falls due at ``parked_at + k * I``. Time is passed in: :meth:`WantBook.age`
applies every lift due by ``now``, in due order (then arrival), so the broker
calls it at the start of each input and the book is the same as if each lift
had happened on time (nothing is granted between inputs). A lifted want enters
its new priority as a new arrival there: behind its connection's wants already
at that priority, its connection joining that rotation at the tail if new there.
A re-park (a new ``WANT`` after a declined or expired offer) starts again from
its own priority. ``priority`` is the lifted one everywhere: the grant rule,
:meth:`WantBook.ahead_of` (``POSITION``), the turn hold.

*Bound.* A want W of connection X parked at ``b`` reaches its ceiling ``c`` after
``k * I`` of waiting, ``k = ceil((c - b) / 2)`` (3 intervals from background to
synchronous). From then on, while no want is parked above ``c`` and W's service
fits whenever a slot frees, W is offered a slot after at most
``(m + 1) * (C - 1)`` offers to other connections, C the open connections and m
the wants of X that reached ``c`` before W and are still parked: at ``c`` each
other connection gets at most one offer per turn of X (a connection joining the
rotation queues behind X, and a turn hold serves a connection at most once
between two turns of X), and X's turns go to its wants in FIFO order. In time:
``k * I`` plus the time the pool takes to free ``(m + 1) * (C - 1) + 1`` slots.
:mod:`trio_broker.testing.aging` checks this bound.

Cost
----

A grant must not cost more as the book grows. Every step below is O(1) or O(S),
where S is the number of services that fit, except for operations on bitsets
whose length is bounded by the number of *connections* at a priority, never by
the number of wants:

* **Priority.** The highest priority with any want is tracked (a lazy max-heap
  finds the next one when it empties). Usually a want there fits; otherwise each
  fitting service's lazy max-heap of the priorities where it has wants gives the
  answer in S heap tops.
* **Rotation.** Each connection at a priority holds a *stamp*, a counter value
  taken when it joined or last moved to the tail: a smaller stamp is earlier in
  the rotation. Per service, a bitset (a Python ``int``) has bit ``stamp - base``
  set for each connection holding wants of that service there. The first
  connection with a fitting want is the lowest bit of the OR of the S fitting
  services' bitsets. Moving a connection to the tail clears one bit and sets
  another in each of its services' bitsets. When the stamps spread too far apart
  (a connection passed over for a long time keeps its old stamp) the level
  renumbers its connections in order: O(n) once per O(n) grants.
* **Turn hold.** :meth:`WantBook.turn_comes_first` is O(S): the grant number of
  the rotation's first connection (the lowest bit of the OR of its bitsets), the
  connection's latest grant there (a dict look-up) and two counts; a hold is
  decided once per job end, never per grant.
* **Aging.** One heap of the next lift of each want below its ceiling: a lift
  is an O(log n) heap step plus an O(1) unlink and park, at most
  ``ceil((c - b) / 2)`` per want, whatever the number of grants. Nothing on the
  grant path changes: :meth:`WantBook.pick` never looks at time.
* **FIFO.** Each connection keeps, per priority, a deque of its wants in arrival
  order and one per service. Removal is lazy (a removed want is marked and skipped
  when it reaches the front), so taking the head is O(1) amortized; a queue whose
  dead entries outnumber the live ones is compacted. Usually the connection's
  oldest want fits; otherwise the oldest fitting one is the earliest of at most S
  service heads. (A ``dict`` used as a queue would not do: popping from its front
  leaves holes that every later look at the front scans again.)

Invariants (checked by :meth:`WantBook.check_invariants`)
----------------------------------------------------------

* every parked want is reachable from its connection, its level and its service;
* a connection is in a priority's rotation exactly when it has wants parked there,
  and its bits are set exactly for the services it has wants of;
* the counts per level, per connection and per (service, priority) match the wants;
* the connections whose place in a rotation came from a grant are in grant order,
  and that grant is their latest at that priority.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection, Hashable, Iterator
from typing import Final, Generic, TypeVar

__all__ = ["TOP_BAND", "ParkedWant", "WantBook", "aging_ceiling"]

_RENUMBER_SLACK: Final = 1024
_COMPACT_SLACK: Final = 16

TOP_BAND: Final = 4
"""The top priority band (synchronous); aging never lifts a want above it."""


def aging_ceiling(base: int) -> int:
    """The highest priority aging lifts a want parked at ``base`` to.

    The top band, keeping the high variant: 4 for an even ``base``, 5 for an odd
    one. A want parked at or above its ceiling does not age.
    """
    return TOP_BAND + (base & 1)


C = TypeVar("C", bound=Hashable)


class ParkedWant(Generic[C]):
    """One parked want. ``seq`` orders wants by arrival at their priority (FIFO).

    ``priority`` is the priority the grant rule uses now; ``base`` the one it was
    parked with (they differ once aging lifted it), ``parked_at`` when.
    """

    __slots__ = ("base", "conn", "job_id", "live", "parked_at", "priority", "seq", "service")

    def __init__(
        self,
        conn: C,
        job_id: str,
        service: str,
        priority: int,
        seq: int,
        *,
        base: int | None = None,
        parked_at: float = 0.0,
        live: bool = True,
    ):
        self.conn = conn
        self.job_id = job_id
        self.service = service
        self.priority = priority
        self.seq = seq
        self.base = priority if base is None else base
        self.parked_at = parked_at
        self.live = live

    def __repr__(self) -> str:
        """The call that makes an equal want (every field, so it pastes back)."""
        return (
            f"ParkedWant(conn={self.conn!r}, job_id={self.job_id!r}, "
            f"service={self.service!r}, priority={self.priority!r}, seq={self.seq!r}, "
            f"base={self.base!r}, parked_at={self.parked_at!r}, live={self.live!r})"
        )


class _Queue(Generic[C]):
    """One connection's wants at one priority, in arrival order (lazy removal).

    A removed want is marked dead. It leaves a deque at once when it is at the
    front, otherwise when it reaches the front; a deque holding more than twice
    as many entries as live wants (plus a little) is rebuilt. So every deque stays
    proportional to the wants it holds, and looking at a front is O(1) amortized.
    """

    __slots__ = ("all", "by_service", "counts", "live")

    def __init__(self) -> None:
        self.all: deque[ParkedWant[C]] = deque()
        self.by_service: dict[str, deque[ParkedWant[C]]] = {}
        # live wants per service; a service is a key only while it has some
        self.counts: dict[str, int] = {}
        self.live = 0

    def head(self) -> ParkedWant[C]:
        """The oldest live want (there is one: empty queues are dropped)."""
        wants = self.all
        while not wants[0].live:
            wants.popleft()
        return wants[0]

    def service_head(self, service: str) -> ParkedWant[C]:
        wants = self.by_service[service]
        while not wants[0].live:
            wants.popleft()
        return wants[0]

    def forget(self, want: ParkedWant[C]) -> None:
        """Account for a want that was just marked dead."""
        self.live -= 1
        wants = self.all
        if wants[0] is want:
            wants.popleft()
        elif len(wants) > 2 * self.live + _COMPACT_SLACK:
            self.all = deque(w for w in wants if w.live)
        service = want.service
        held = self.counts[service] - 1
        if not held:
            del self.counts[service]
            del self.by_service[service]
            return
        self.counts[service] = held
        of_service = self.by_service[service]
        if of_service[0] is want:
            of_service.popleft()
        elif len(of_service) > 2 * held + _COMPACT_SLACK:
            self.by_service[service] = deque(w for w in of_service if w.live)

    def wants(self) -> list[ParkedWant[C]]:
        return [w for w in self.all if w.live]


class _Level(Generic[C]):
    """The wants parked at one priority: the rotation as stamps and bitsets."""

    __slots__ = ("base", "bits", "conn_at", "count", "granted", "next_stamp", "stamps")

    def __init__(self) -> None:
        self.count = 0
        # connection -> its place in the rotation (smaller = earlier), and back
        self.stamps: dict[C, int] = {}
        self.conn_at: dict[int, C] = {}
        self.next_stamp = 0
        self.base = 0
        # service -> bitset: bit (stamp - base) set when that connection holds
        # wants of the service at this priority
        self.bits: dict[str, int] = {}
        # connection -> the grant number that gave it its place, for connections
        # whose place comes from a grant here (the others joined and still wait)
        self.granted: dict[C, int] = {}

    def head(self) -> C:
        """The first connection of the rotation (the level has one)."""
        union = 0
        for bits in self.bits.values():
            union |= bits
        return self.conn_at[(union & -union).bit_length() - 1 + self.base]

    def join(self, conn: C) -> int:
        """Put a connection at the tail of the rotation; returns its bit index."""
        stamp = self.next_stamp
        self.next_stamp = stamp + 1
        self.stamps[conn] = stamp
        self.conn_at[stamp] = conn
        return stamp - self.base


class WantBook(Generic[C]):
    """Parked wants and the grant rule. Pure data structure: no I/O, no clock.

    Connections are any hashable values chosen by the caller. ``job_id`` values
    are unique per connection (the caller refuses duplicates before adding).

    Args:
        aging: seconds of waiting per band a parked want rises (see *Aging* in
            the module docstring); None = no aging. Time comes in through
            :meth:`add` and :meth:`age`.

    Raises:
        ValueError: ``aging`` is not positive.
    """

    def __init__(self, *, aging: float | None = None) -> None:
        if aging is not None and not aging > 0:
            raise ValueError(f"aging must be positive seconds or None, got {aging}")
        self.aging = aging
        self._reset()

    def _reset(self) -> None:
        self._seq = 0
        self.grants = 0
        """How many wants :meth:`pick` has granted (the number of the last grant)."""
        self._levels: dict[int, _Level[C]] = {}
        # conn -> priority -> its queue there
        self._conns: dict[C, dict[int, _Queue[C]]] = {}
        self._index: dict[tuple[C, str], ParkedWant[C]] = {}
        # service -> priority -> parked count; service -> lazy max-heap of -priority
        self._svc_prio_count: dict[str, dict[int, int]] = {}
        self._svc_prio_heap: dict[str, list[int]] = {}
        # the highest priority with any want (meaningful while the book is not
        # empty), and a lazy max-heap of level priorities to find the next one
        self._highest = 0
        self._level_heap: list[int] = []
        # aging: (due, seq, want) of wants below their ceiling (lazy removal)
        self._aging_heap: list[tuple[float, int, ParkedWant[C]]] = []
        # conn -> priority -> the number of its latest grant there (the turn hold)
        self._last_grants: dict[C, dict[int, int]] = {}

    # -- queries ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: tuple[C, str]) -> bool:
        return key in self._index

    def get(self, conn: C, job_id: str) -> ParkedWant[C] | None:
        """The parked want of this connection with this job_id, if any."""
        return self._index.get((conn, job_id))

    def wants(self) -> Iterator[ParkedWant[C]]:
        """Every parked want (in no particular order)."""
        return iter(self._index.values())

    def connection_wants(self, conn: C) -> list[ParkedWant[C]]:
        """This connection's parked wants, by priority (high first), then FIFO."""
        levels = self._conns.get(conn, {})
        return [w for priority in sorted(levels, reverse=True) for w in levels[priority].wants()]

    # -- changes ---------------------------------------------------------------

    def add(
        self, conn: C, job_id: str, service: str, priority: int, *, now: float = 0.0
    ) -> ParkedWant[C]:
        """Park a want at ``now``. The connection joins the priority's rotation if new there.

        Raises:
            ValueError: the connection already has a parked want with this job_id.
        """
        if (conn, job_id) in self._index:
            raise ValueError(f"job_id {job_id!r} is already parked on {conn!r}")
        return self._park(conn, job_id, service, priority, priority, now)

    def age(self, now: float) -> int:
        """Lift every want whose time came by ``now`` one band (aging); returns how many.

        Promotions are applied in the order they fell due (then by arrival), so
        calling this late gives the same book as calling it at every due time.
        A lifted want enters its new priority as if it arrived there now: behind
        the wants already there in its connection's FIFO, its connection joining
        that rotation at the tail if new there.
        """
        heap = self._aging_heap
        lifted = 0
        while heap and heap[0][0] <= now:
            _, _, want = heapq.heappop(heap)
            if not want.live:
                continue
            self._unlink(want)
            priority = min(want.priority + 2, aging_ceiling(want.base))
            self._park(want.conn, want.job_id, want.service, priority, want.base, want.parked_at)
            lifted += 1
        return lifted

    def _park(
        self, conn: C, job_id: str, service: str, priority: int, base: int, parked_at: float
    ) -> ParkedWant[C]:
        self._seq += 1
        want = ParkedWant(
            conn, job_id, service, priority, self._seq, base=base, parked_at=parked_at
        )
        self._index[(conn, job_id)] = want
        aging = self.aging
        if aging is not None and priority < aging_ceiling(base):
            heap = self._aging_heap
            due = parked_at + ((priority - base) // 2 + 1) * aging
            heapq.heappush(heap, (due, self._seq, want))
            if len(heap) > 2 * len(self._index) + 64:
                heap[:] = [entry for entry in heap if entry[2].live]
                heapq.heapify(heap)

        level = self._levels.get(priority)
        if level is None:
            level = self._new_level(priority)
        stamp = level.stamps.get(conn)
        index = level.join(conn) if stamp is None else stamp - level.base
        level.count += 1

        by_prio = self._conns.get(conn)
        if by_prio is None:
            by_prio = self._conns[conn] = {}
        queue = by_prio.get(priority)
        if queue is None:
            queue = by_prio[priority] = _Queue()
        queue.all.append(want)
        queue.live += 1
        held = queue.counts.get(service, 0)
        queue.counts[service] = held + 1
        per_service = queue.by_service.get(service)
        if per_service is None:
            per_service = queue.by_service[service] = deque()
        per_service.append(want)
        if held == 0:
            level.bits[service] = level.bits.get(service, 0) | (1 << index)

        counts = self._svc_prio_count.get(service)
        if counts is None:
            counts = self._svc_prio_count[service] = {}
        before = counts.get(priority, 0)
        counts[priority] = before + 1
        if before == 0:
            heapq.heappush(self._svc_prio_heap.setdefault(service, []), -priority)
        return want

    def remove(self, conn: C, job_id: str) -> ParkedWant[C] | None:
        """Take a parked want out of the book (UNWANT, CANCEL); None if not parked."""
        want = self._index.get((conn, job_id))
        if want is not None:
            self._unlink(want)
        return want

    def remove_connection(self, conn: C) -> list[ParkedWant[C]]:
        """Take every want of a connection out of the book (connection closed)."""
        wants = self.connection_wants(conn)
        for want in wants:
            self._unlink(want)
        self._last_grants.pop(conn, None)
        return wants

    def clear(self) -> list[ParkedWant[C]]:
        """Empty the book (draining); returns what was parked."""
        wants = list(self._index.values())
        for want in wants:
            want.live = False
        self._reset()
        return wants

    def pick(self, fitting: Collection[str]) -> ParkedWant[C] | None:
        """Apply the grant rule to the wants of ``fitting`` services.

        The picked want leaves the book and its connection moves to the tail of
        the rotation (or leaves it). Returns None when no fitting want is parked.
        """
        levels = self._levels
        if not levels:
            return None
        # Usually the highest priority of all has a fitting want.
        best = self._highest
        level = levels[best]
        bits = level.bits
        union = 0
        for service in fitting:
            union |= bits.get(service, 0)
        if not union:
            found = self._best_fitting_priority(fitting)
            if found is None:
                return None
            best = found
            level = levels[best]
            bits = level.bits
            for service in fitting:
                union |= bits.get(service, 0)
        conn = level.conn_at[(union & -union).bit_length() - 1 + level.base]

        # FIFO among the connection's fitting wants: usually its oldest one fits.
        queue = self._conns[conn][best]
        chosen = queue.head()
        if chosen.service not in fitting:
            # its oldest want does not fit: the oldest among the fitting services' heads
            by_service = queue.by_service
            first_seq = -1
            for service in fitting:
                wants = by_service.get(service)
                if wants is not None:
                    head = wants[0]
                    if not head.live:
                        head = queue.service_head(service)
                    if first_seq < 0 or head.seq < first_seq:
                        chosen, first_seq = head, head.seq
        self.grants += 1
        self._unlink(chosen, granted=True)
        return chosen

    def highest(self) -> int | None:
        """The highest priority with a parked want; None when the book is empty."""
        return self._highest if self._levels else None

    def fitting_priority(self, fitting: Collection[str]) -> int | None:
        """The priority :meth:`pick` would grant at now; None when nothing fits."""
        if not self._levels:
            return None
        bits = self._levels[self._highest].bits
        if any(bits.get(service, 0) for service in fitting):
            return self._highest
        return self._best_fitting_priority(fitting)

    def last_grant(self, conn: C, priority: int) -> int | None:
        """The number of the latest grant to ``conn`` at ``priority`` (None: never)."""
        return self._last_grants.get(conn, {}).get(priority)

    def has_wants(self, conn: C, priority: int) -> bool:
        """Whether ``conn`` has a want parked at ``priority`` (its lifted one)."""
        return priority in self._conns.get(conn, ())

    def turn_comes_first(self, conn: C, priority: int) -> bool:
        """Whether ``conn`` is owed the turn at ``priority``.

        True when the connection was granted a slot there before (its latest
        grant there is :meth:`last_grant`), has no want parked there, some other
        connection has, and every connection that has was served there after
        that latest grant (none waits for a turn since it joined). See *Turn
        hold* in the module docstring.
        """
        level = self._levels.get(priority)
        since = self.last_grant(conn, priority)
        if level is None or since is None:
            return False
        granted = level.granted
        if conn in level.stamps or len(granted) < len(level.stamps):
            return False
        return granted[level.head()] > since

    def grant(self, conn: C, job_id: str) -> ParkedWant[C]:
        """Grant this parked want now, outside the rule (the turn hold); see :meth:`pick`.

        Raises:
            KeyError: no such want is parked.
        """
        want = self._index[(conn, job_id)]
        self.grants += 1
        self._unlink(want, granted=True)
        return want

    # -- position ----------------------------------------------------------------

    def ahead_of(self, want: ParkedWant[C]) -> int:
        """How many parked wants the grant rule would pick first if all fitted.

        Higher priorities go first; at the want's priority, wants are dealt like
        cards in the current rotation order, each connection's in FIFO order.
        """
        ahead = 0
        for priority, level in self._levels.items():
            if priority > want.priority:
                ahead += level.count
        level = self._levels[want.priority]
        mine = self._conns[want.conn][want.priority]
        rank = sum(1 for w in mine.all if w.live and w.seq < want.seq)
        my_stamp = level.stamps[want.conn]
        ahead += rank
        for conn, stamp in level.stamps.items():
            if conn == want.conn:
                continue
            held = self._conns[conn][want.priority].live
            ahead += min(held, rank + 1) if stamp < my_stamp else min(held, rank)
        return ahead

    def rotation(self, priority: int) -> list[C]:
        """The rotation at a priority, first connection first (for tests, inspection)."""
        level = self._levels.get(priority)
        if level is None:
            return []
        return sorted(level.stamps, key=level.stamps.__getitem__)

    # -- internals -----------------------------------------------------------------

    def _new_level(self, priority: int) -> _Level[C]:
        if not self._levels or priority > self._highest:
            self._highest = priority
        heap = self._level_heap
        heapq.heappush(heap, -priority)
        if len(heap) > 2 * len(self._levels) + 64:
            heap[:] = [-prio for prio in self._levels]
            heap.append(-priority)
            heapq.heapify(heap)
        level = self._levels[priority] = _Level()
        return level

    def _best_fitting_priority(self, fitting: Collection[str]) -> int | None:
        """The highest priority with a want of a fitting service (heap tops)."""
        best: int | None = None
        for service in fitting:
            heap = self._svc_prio_heap.get(service)
            if not heap:
                continue
            counts = self._svc_prio_count[service]
            while heap and counts.get(-heap[0], 0) == 0:
                heapq.heappop(heap)
            if heap and (best is None or -heap[0] > best):
                best = -heap[0]
        return best

    def _unlink(self, want: ParkedWant[C], *, granted: bool = False) -> None:
        conn, service, priority = want.conn, want.service, want.priority
        del self._index[(conn, want.job_id)]
        want.live = False

        level = self._levels[priority]
        level.count -= 1
        if granted:
            self._last_grants.setdefault(conn, {})[priority] = self.grants
        by_prio = self._conns[conn]
        queue = by_prio[priority]
        queue.forget(want)
        stamp = level.stamps[conn]
        if service not in queue.counts:
            level.bits[service] ^= 1 << (stamp - level.base)
        if not queue.live:
            del by_prio[priority]
            if not by_prio:
                del self._conns[conn]
            del level.stamps[conn]
            del level.conn_at[stamp]
            level.granted.pop(conn, None)
        elif granted:
            # Move the served connection to the tail of the rotation.
            level.granted[conn] = self.grants
            del level.conn_at[stamp]
            flip = (1 << (stamp - level.base)) | (1 << level.join(conn))
            bits = level.bits
            for other in queue.counts:
                bits[other] ^= flip
            if level.next_stamp - level.base > 4 * len(level.stamps) + _RENUMBER_SLACK:
                self._renumber(level, priority)
        if level.count == 0:
            del self._levels[priority]
            if priority == self._highest and self._levels:
                heap = self._level_heap
                while -heap[0] not in self._levels:
                    heapq.heappop(heap)
                self._highest = -heap[0]

        counts = self._svc_prio_count[service]
        counts[priority] -= 1
        if counts[priority] == 0:
            del counts[priority]

    def _renumber(self, level: _Level[C], priority: int) -> None:
        """Give the level's connections stamps base..base+n-1, keeping their order."""
        order = sorted(level.stamps, key=level.stamps.__getitem__)
        level.base = level.next_stamp
        level.stamps.clear()
        level.conn_at.clear()
        size = len(order) // 8 + 1
        masks: dict[str, bytearray] = {}
        for conn in order:
            index = level.join(conn)
            byte, bit = index >> 3, 1 << (index & 7)
            for service in self._conns[conn][priority].counts:
                mask = masks.get(service)
                if mask is None:
                    mask = masks[service] = bytearray(size)
                mask[byte] |= bit
        level.bits = {service: int.from_bytes(mask, "little") for service, mask in masks.items()}

    # -- checks ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the internal structures disagree."""
        total = 0
        for conn, by_prio in self._conns.items():
            assert by_prio, f"empty entry for {conn!r}"
            for priority, queue in by_prio.items():
                level = self._levels[priority]
                assert conn in level.stamps, f"{conn!r} missing from rotation {priority}"
                live = queue.wants()
                assert live, f"empty queue at {priority} for {conn!r}"
                assert len(live) == queue.live
                assert len(queue.all) <= 2 * queue.live + _COMPACT_SLACK + 1
                seqs = [w.seq for w in live]
                assert seqs == sorted(seqs), "FIFO order broken"
                bit = 1 << (level.stamps[conn] - level.base)
                services = {w.service for w in live}
                assert set(queue.counts) == services == set(queue.by_service)
                for service in services:
                    of_service = [w for w in live if w.service == service]
                    assert queue.counts[service] == len(of_service)
                    assert [w for w in queue.by_service[service] if w.live] == of_service
                    assert len(queue.by_service[service]) <= 2 * len(of_service) + 17
                    assert level.bits[service] & bit, f"bit of {conn!r} missing for {service!r}"
                for want in live:
                    assert self._index[(conn, want.job_id)] is want
                    assert (want.conn, want.priority) == (conn, priority)
                    lift = want.priority - want.base
                    assert lift == 0 or (
                        self.aging is not None
                        and lift > 0
                        and lift % 2 == 0
                        and want.priority <= aging_ceiling(want.base)
                    ), f"{want} lifted wrongly"
                total += len(live)
        assert total == len(self._index)
        for priority, level in self._levels.items():
            expected = sum(self._conns[c][priority].live for c in level.stamps)
            assert level.count == expected > 0
            for conn, stamp in level.stamps.items():
                assert priority in self._conns.get(conn, {}), "rotation holds an idle conn"
                assert level.conn_at[stamp] == conn
            # places that came from grants are in grant order along the rotation
            served = [level.granted[c] for c in self.rotation(priority) if c in level.granted]
            assert served == sorted(served), "grant numbers out of rotation order"
            assert all(0 < n <= self.grants for n in served)
            assert set(level.granted) <= set(level.stamps)
            for conn, number in level.granted.items():
                assert self.last_grant(conn, priority) == number, "latest grant forgotten"
            assert len(level.conn_at) == len(level.stamps)
            for service, bits in level.bits.items():
                holders = [c for c in level.stamps if service in self._conns[c][priority].counts]
                expected_bits = sum(1 << (level.stamps[c] - level.base) for c in holders)
                assert bits == expected_bits, f"bitset of {service!r} at {priority} is stale"
        assert not self._levels or self._highest == max(self._levels)
        for latest in self._last_grants.values():
            assert latest, "an empty record of latest grants"
            assert all(0 < n <= self.grants for n in latest.values())
        for service, counts in self._svc_prio_count.items():
            for priority, count in counts.items():
                assert count == sum(
                    by_prio[priority].counts.get(service, 0)
                    for by_prio in self._conns.values()
                    if priority in by_prio
                )
