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
3. **FIFO within a connection**, among its fitting wants at that priority: a want
   that does not fit never blocks one behind it (no head-of-line blocking).

Cost
----

A grant must not cost more as the book grows. The structures below make a grant
cost O(S log n) where S is the number of services that fit (small: a pool offers a
handful of services) and n the number of entries of one heap:

* per service, a max-heap of the priorities at which it has parked wants, so the
  highest fitting priority is the best of S heap tops;
* per priority, the rotation is kept as a *stamp* per connection (a counter value
  taken when the connection joined or last moved to the tail: smaller stamp =
  earlier in the rotation) and, per service, a min-heap of ``(stamp, connection)``
  for the connections holding wants of that service at that priority. The first
  connection of the rotation with a fitting want is the smallest valid stamp among
  the S heap tops;
* per connection, priority and service, an insertion-ordered dict of wants, so the
  connection's oldest fitting want is the earliest of S dict heads.

Heap entries are never searched for: an entry whose stamp is no longer the
connection's current one, or whose connection no longer has wants of that service,
is stale and dropped when it reaches the top. A heap holding many stale entries is
rebuilt from the live ones, which keeps memory proportional to the book.

Invariants (checked by :meth:`WantBook.check_invariants`)
--------------------------------------------------------

* every parked want is reachable from its connection, its level and its service;
* a connection is in a priority's rotation exactly when it has wants parked there;
* the counts per level, per service and per (service, priority) match the wants.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Hashable, Iterator
from typing import Final, Generic, TypeVar

__all__ = ["ParkedWant", "WantBook"]

_REBUILD_SLACK: Final = 64

C = TypeVar("C", bound=Hashable)


class ParkedWant(Generic[C]):
    """One parked want. ``seq`` orders wants by arrival (FIFO)."""

    __slots__ = ("conn", "job_id", "priority", "seq", "service")

    def __init__(self, conn: C, job_id: str, service: str, priority: int, seq: int):
        self.conn = conn
        self.job_id = job_id
        self.service = service
        self.priority = priority
        self.seq = seq

    def __repr__(self) -> str:
        return (
            f"ParkedWant(conn={self.conn!r}, job_id={self.job_id!r}, "
            f"service={self.service!r}, priority={self.priority!r}, seq={self.seq!r})"
        )


class _Level(Generic[C]):
    """The wants parked at one priority: its rotation and per-service heaps."""

    __slots__ = ("count", "heaps", "next_stamp", "stamps", "svc_conns")

    def __init__(self) -> None:
        self.count = 0
        # connection -> its current place in the rotation (smaller = earlier)
        self.stamps: dict[C, int] = {}
        self.next_stamp = 0
        # service -> lazy min-heap of (stamp, tiebreak, connection)
        self.heaps: dict[str, list[tuple[int, int, C]]] = {}
        # service -> connections holding wants of it here -> how many
        self.svc_conns: dict[str, dict[C, int]] = {}

    def stamp(self) -> int:
        self.next_stamp += 1
        return self.next_stamp


class WantBook(Generic[C]):
    """Parked wants and the grant rule. Pure data structure: no I/O, no clock.

    Connections are any hashable values chosen by the caller. ``job_id`` values
    are unique per connection (the caller refuses duplicates before adding).
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._seq = 0
        self._tiebreak = itertools.count()
        self._levels: dict[int, _Level[C]] = {}
        # conn -> priority -> service -> job_id -> want (insertion ordered = FIFO)
        self._conns: dict[C, dict[int, dict[str, dict[str, ParkedWant[C]]]]] = {}
        self._index: dict[tuple[C, str], ParkedWant[C]] = {}
        # service -> priority -> parked count; service -> lazy max-heap of -priority
        self._svc_prio_count: dict[str, dict[int, int]] = {}
        self._svc_prio_heap: dict[str, list[int]] = {}

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

    def count_for(self, service: str) -> int:
        """How many wants of this service are parked."""
        return sum(self._svc_prio_count.get(service, {}).values())

    def connection_wants(self, conn: C) -> list[ParkedWant[C]]:
        """This connection's parked wants, by priority (high first), then FIFO."""
        levels = self._conns.get(conn, {})
        result = []
        for priority in sorted(levels, reverse=True):
            wants = [w for queue in levels[priority].values() for w in queue.values()]
            wants.sort(key=lambda w: w.seq)
            result.extend(wants)
        return result

    # -- changes ---------------------------------------------------------------

    def add(self, conn: C, job_id: str, service: str, priority: int) -> ParkedWant[C]:
        """Park a want. The connection joins the priority's rotation if new there.

        Raises:
            ValueError: the connection already has a parked want with this job_id.
        """
        key = (conn, job_id)
        if key in self._index:
            raise ValueError(f"job_id {job_id!r} is already parked on {conn!r}")
        self._seq += 1
        want = ParkedWant(conn, job_id, service, priority, self._seq)
        self._index[key] = want

        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = _Level[C]()
        if conn not in level.stamps:
            level.stamps[conn] = level.stamp()
        level.count += 1
        svc_conns = level.svc_conns.setdefault(service, {})
        held = svc_conns.get(conn, 0)
        svc_conns[conn] = held + 1
        if held == 0:
            heap = level.heaps.setdefault(service, [])
            heapq.heappush(heap, (level.stamps[conn], next(self._tiebreak), conn))
            if len(heap) > 2 * len(svc_conns) + _REBUILD_SLACK:
                self._rebuild_heap(level, service)

        by_prio = self._conns.setdefault(conn, {})
        by_prio.setdefault(priority, {}).setdefault(service, {})[job_id] = want

        counts = self._svc_prio_count.setdefault(service, {})
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
        return wants

    def clear(self) -> list[ParkedWant[C]]:
        """Empty the book (draining); returns what was parked."""
        wants = list(self._index.values())
        self._reset()
        return wants

    def pick(self, fitting: Collection[str]) -> ParkedWant[C] | None:
        """Apply the grant rule to the wants of ``fitting`` services.

        The picked want leaves the book and its connection moves to the tail of
        the rotation (or leaves it). Returns None when no fitting want is parked.
        """
        best: int | None = None
        for service in fitting:
            top = self._top_priority(service)
            if top is not None and (best is None or top > best):
                best = top
        if best is None:
            return None
        level = self._levels[best]

        first: tuple[int, int, C] | None = None
        for service in fitting:
            entry = self._top_conn(level, service)
            if entry is not None and (first is None or entry[0] < first[0]):
                first = entry
        assert first is not None, "a level without a rotation entry"
        conn = first[2]

        queues = self._conns[conn][best]
        chosen: ParkedWant[C] | None = None
        for service in fitting:
            queue = queues.get(service)
            if queue:
                head = next(iter(queue.values()))
                if chosen is None or head.seq < chosen.seq:
                    chosen = head
        assert chosen is not None, "rotation entry without a fitting want"
        self._unlink(chosen, granted=True)
        return chosen

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
        rank = sum(1 for queue in mine.values() for w in queue.values() if w.seq < want.seq)
        my_stamp = level.stamps[want.conn]
        ahead += rank
        for conn, stamp in level.stamps.items():
            if conn == want.conn:
                continue
            held = sum(len(q) for q in self._conns[conn][want.priority].values())
            ahead += min(held, rank + 1) if stamp < my_stamp else min(held, rank)
        return ahead

    def rotation(self, priority: int) -> list[C]:
        """The rotation at a priority, first connection first (for tests, inspection)."""
        level = self._levels.get(priority)
        if level is None:
            return []
        return [conn for conn, _ in sorted(level.stamps.items(), key=lambda kv: kv[1])]

    def priorities(self) -> list[int]:
        """The priorities with parked wants, highest first."""
        return sorted(self._levels, reverse=True)

    # -- internals -----------------------------------------------------------------

    def _top_priority(self, service: str) -> int | None:
        heap = self._svc_prio_heap.get(service)
        if not heap:
            return None
        counts = self._svc_prio_count[service]
        while heap and counts.get(-heap[0], 0) == 0:
            heapq.heappop(heap)
        return -heap[0] if heap else None

    def _top_conn(self, level: _Level[C], service: str) -> tuple[int, int, C] | None:
        heap = level.heaps.get(service)
        if not heap:
            return None
        holders = level.svc_conns.get(service, {})
        stamps = level.stamps
        while heap:
            stamp, _, conn = heap[0]
            if stamps.get(conn) == stamp and holders.get(conn, 0) > 0:
                return heap[0]
            heapq.heappop(heap)
        return None

    def _rebuild_heap(self, level: _Level[C], service: str) -> None:
        holders = level.svc_conns.get(service, {})
        heap = [(level.stamps[conn], next(self._tiebreak), conn) for conn in holders]
        heapq.heapify(heap)
        level.heaps[service] = heap

    def _unlink(self, want: ParkedWant[C], *, granted: bool = False) -> None:
        conn, service, priority = want.conn, want.service, want.priority
        del self._index[(conn, want.job_id)]

        by_prio = self._conns[conn]
        queues = by_prio[priority]
        queue = queues[service]
        del queue[want.job_id]
        if not queue:
            del queues[service]

        level = self._levels[priority]
        level.count -= 1
        holders = level.svc_conns[service]
        holders[conn] -= 1
        if holders[conn] == 0:
            del holders[conn]
            if not holders:
                del level.svc_conns[service]
                level.heaps.pop(service, None)

        if not queues:
            del by_prio[priority]
            if not by_prio:
                del self._conns[conn]
            del level.stamps[conn]
        elif granted:
            # Move the served connection to the tail of the rotation.
            stamp = level.stamps[conn] = level.stamp()
            for other in queues:
                heap = level.heaps[other]
                heapq.heappush(heap, (stamp, next(self._tiebreak), conn))
                if len(heap) > 2 * len(level.svc_conns[other]) + _REBUILD_SLACK:
                    self._rebuild_heap(level, other)
        if level.count == 0:
            del self._levels[priority]

        counts = self._svc_prio_count[service]
        counts[priority] -= 1
        if counts[priority] == 0:
            del counts[priority]

    # -- checks ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the internal structures disagree."""
        total = 0
        for conn, by_prio in self._conns.items():
            assert by_prio, f"empty entry for {conn!r}"
            for priority, queues in by_prio.items():
                assert queues, f"empty level {priority} for {conn!r}"
                level = self._levels[priority]
                assert conn in level.stamps, f"{conn!r} missing from rotation {priority}"
                for service, queue in queues.items():
                    assert queue, f"empty queue {service!r}"
                    assert level.svc_conns[service][conn] == len(queue)
                    seqs = [w.seq for w in queue.values()]
                    assert seqs == sorted(seqs), "FIFO order broken"
                    for job_id, want in queue.items():
                        assert self._index[(conn, job_id)] is want
                        assert (want.service, want.priority) == (service, priority)
                        total += 1
        assert total == len(self._index)
        for priority, level in self._levels.items():
            expected = sum(len(q) for c in level.stamps for q in self._conns[c][priority].values())
            assert level.count == expected > 0
            for conn in level.stamps:
                assert priority in self._conns.get(conn, {}), "rotation holds an idle conn"
        for service, counts in self._svc_prio_count.items():
            for priority, count in counts.items():
                assert count == sum(
                    len(by_prio.get(priority, {}).get(service, {}))
                    for by_prio in self._conns.values()
                )
