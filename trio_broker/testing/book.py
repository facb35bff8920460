"""A model check of the want-book alone, against a plain list model.

:func:`book_machine` drives a :class:`~trio_broker.core.book.WantBook` and
:class:`BookModel` (a list of wants in arrival order and one list per rotation,
written straight from the grant rule) with the same random adds, removals,
closed connections, picks with random sets of fitting services, direct grants
and clears. After every step it checks that both agree on every pick, on each
rotation, on the position (``ahead_of``) of every parked want, on the highest
and the highest fitting priority, and on whether a connection is owed the
turn (:meth:`~trio_broker.core.book.WantBook.turn_comes_first`); and that the
book's own invariants hold. Without a broker around it, it reaches many more
states per second than the broker machines, so a slip in the book shows fast::

    from trio_broker.testing.book import book_machine

    TestMyBook = book_machine(services=("a", "b", "c"), priorities=(0, 2)).TestCase
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_broker.core.book import WantBook

__all__ = ["BookMachine", "BookModel", "book_machine"]

_Want = tuple[int, str, str, int, int]  # conn, job_id, service, priority, seq


@dataclass
class BookModel:
    """The grant rule by scanning: slow, short and obviously right."""

    wants: list[_Want] = field(default_factory=list)
    rotation: dict[int, list[int]] = field(default_factory=dict)
    # priority -> connection -> the grant that put it where it is in the rotation
    served: dict[int, dict[int, int]] = field(default_factory=dict)
    # (connection, priority) -> its latest grant there, until it closes
    latest: dict[tuple[int, int], int] = field(default_factory=dict)
    grants: int = 0
    seq: int = 0
    aging: float | None = None
    # (connection, job_id) -> (base priority, when it was parked), for aging
    parked: dict[tuple[int, str], tuple[int, float]] = field(default_factory=dict)

    def holds(self, conn: int, priority: int) -> bool:
        return any(w[0] == conn and w[3] == priority for w in self.wants)

    def add(self, conn: int, job_id: str, service: str, priority: int, now: float = 0.0) -> None:
        self.parked[(conn, job_id)] = (priority, now)
        self._append(conn, job_id, service, priority)

    def _append(self, conn: int, job_id: str, service: str, priority: int) -> None:
        if not self.holds(conn, priority):
            self.rotation.setdefault(priority, []).append(conn)
            self.served.setdefault(priority, {})
        self.seq += 1
        self.wants.append((conn, job_id, service, priority, self.seq))

    def age(self, now: float) -> int:
        """Apply every lift due by ``now``, earliest due first (then arrival)."""
        if self.aging is None:
            return 0
        lifted = 0
        while True:
            due = []
            for want in self.wants:
                base, parked_at = self.parked[want[:2]]
                if want[3] < 4 + (base & 1):  # below the top band (its odd variant: 5)
                    at = parked_at + ((want[3] - base) // 2 + 1) * self.aging
                    if at <= now:
                        due.append((at, want[4], want))
            if not due:
                return lifted
            _, _, want = min(due)
            self._take(want, granted=False)
            self._append(want[0], want[1], want[2], want[3] + 2)
            lifted += 1

    def _take(self, want: _Want, *, granted: bool) -> None:
        conn, priority = want[0], want[3]
        self.wants.remove(want)
        rotation = self.rotation[priority]
        if granted:
            self.grants += 1
            self.latest[(conn, priority)] = self.grants
        if not self.holds(conn, priority):
            rotation.remove(conn)
            self.served[priority].pop(conn, None)
        elif granted:
            rotation.remove(conn)
            rotation.append(conn)
            self.served[priority][conn] = self.grants
        # a removal that leaves wants behind keeps the connection's place
        if not rotation:
            del self.rotation[priority]
            del self.served[priority]

    def remove(self, conn: int, job_id: str) -> _Want | None:
        want = next((w for w in self.wants if w[:2] == (conn, job_id)), None)
        if want is not None:
            self._take(want, granted=False)
        return want

    def pick(self, fitting: set[str]) -> _Want | None:
        candidates = [w for w in self.wants if w[2] in fitting]
        if not candidates:
            return None
        top = max(w[3] for w in candidates)
        for conn in self.rotation[top]:
            mine = [w for w in candidates if w[0] == conn and w[3] == top]
            if mine:
                chosen = min(mine, key=lambda w: w[4])
                self._take(chosen, granted=True)
                return chosen
        raise AssertionError("a fitting want whose connection is not in the rotation")

    def grant(self, conn: int, job_id: str) -> _Want:
        want = next(w for w in self.wants if w[:2] == (conn, job_id))
        self._take(want, granted=True)
        return want

    def ahead(self, want: _Want) -> int:
        wants = list(self.wants)
        rotation = {prio: list(conns) for prio, conns in self.rotation.items()}
        count = 0
        while True:
            top = max(w[3] for w in wants)
            conn = rotation[top].pop(0)
            chosen = min((w for w in wants if w[0] == conn and w[3] == top), key=lambda w: w[4])
            if chosen == want:
                return count
            count += 1
            wants.remove(chosen)
            if any(w[0] == conn and w[3] == top for w in wants):
                rotation[top].append(conn)

    def fitting_priority(self, fitting: set[str]) -> int | None:
        return max((w[3] for w in self.wants if w[2] in fitting), default=None)

    def turn_comes_first(self, conn: int, priority: int) -> bool:
        waiting = self.rotation.get(priority, [])
        served = self.served.get(priority, {})
        since = self.latest.get((conn, priority))
        return (
            since is not None
            and bool(waiting)
            and conn not in waiting
            and all(c in served and served[c] > since for c in waiting)
        )

    def close(self, conn: int) -> None:
        for want in [w for w in self.wants if w[0] == conn]:
            self._take(want, granted=False)
        self.latest = {k: n for k, n in self.latest.items() if k[0] != conn}


class BookMachine(RuleBasedStateMachine):
    """The differential check of the want-book; configure it with :func:`book_machine`."""

    services: ClassVar[tuple[str, ...]] = ("a", "b", "c")
    priorities: ClassVar[tuple[int, ...]] = (-1, 0, 2)
    connections: ClassVar[int] = 4
    job_ids: ClassVar[tuple[str, ...]] = ("j1", "j2", "j3", "j4", "j5")
    aging: ClassVar[float | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.book: WantBook[int] = WantBook(aging=self.aging)
        self.model = BookModel(aging=self.aging)
        self.fresh = itertools.count()
        self.now = 0.0

    @precondition(lambda self: self.aging is not None)
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """Time passes (a fraction or a few aging intervals); due lifts apply."""
        assert self.aging is not None
        step = data.draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0]), label="intervals")
        self.now += step * self.aging
        assert self.book.age(self.now) == self.model.age(self.now)

    @staticmethod
    def _shape(want: Any) -> _Want | None:
        if want is None:
            return None
        return (want.conn, want.job_id, want.service, want.priority, want.seq)

    def draw(self, data: st.DataObject, values: Any) -> Any:
        return data.draw(st.sampled_from(list(values)))

    @rule(data=st.data(), count=st.integers(1, 3))
    def add(self, data: st.DataObject, count: int) -> None:
        """Park one or several wants of one connection at one priority."""
        conn = self.draw(data, range(self.connections))
        priority = self.draw(data, self.priorities)
        for n in range(count):
            job_id, service = self.draw(data, self.job_ids), self.draw(data, self.services)
            job = job_id if n == 0 else f"{job_id}-{next(self.fresh)}"
            if (conn, job) in self.book:
                try:
                    self.book.add(conn, job, service, priority)
                except ValueError:
                    continue
                raise AssertionError("a duplicate job_id was parked")
            self.book.add(conn, job, service, priority, now=self.now)
            self.model.add(conn, job, service, priority, self.now)

    @rule(data=st.data())
    def burst(self, data: st.DataObject) -> None:
        """One want of every service, in a random order, from one connection at one priority.

        Then a pick that leaves one service out often finds the connection's
        oldest want not fitting and several fitting ones: FIFO among those.
        """
        conn = self.draw(data, range(self.connections))
        priority = self.draw(data, self.priorities)
        for service in data.draw(st.permutations(self.services)):
            job = f"b-{next(self.fresh)}"
            self.book.add(conn, job, service, priority, now=self.now)
            self.model.add(conn, job, service, priority, self.now)

    @rule(data=st.data())
    def pick_all_but_one(self, data: st.DataObject) -> None:
        """A grant while one service does not fit (a capped or heavy one, say)."""
        left_out = self.draw(data, self.services)
        fitting = set(self.services) - {left_out}
        got = self._shape(self.book.pick(fitting))
        expected = self.model.pick(fitting)
        note(f"pick {sorted(fitting)} -> {got}")
        assert got == expected, f"picked {got}, the rule says {expected}"

    @precondition(lambda self: self.model.wants)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        conn, job_id = data.draw(st.sampled_from(sorted(w[:2] for w in self.model.wants)))
        removed = self._shape(self.book.remove(conn, job_id))
        assert removed == self.model.remove(conn, job_id)
        assert self.book.remove(conn, job_id) is None

    @rule(data=st.data())
    def remove_connection(self, data: st.DataObject) -> None:
        conn = self.draw(data, range(self.connections))
        expected = [w for w in self.model.wants if w[0] == conn]
        expected.sort(key=lambda w: (-w[3], w[4]))
        got = [self._shape(w) for w in self.book.remove_connection(conn)]
        assert got == expected, f"{got} != {expected}"
        self.model.close(conn)

    def fitting(self, data: st.DataObject) -> set[str]:
        return data.draw(st.sets(st.sampled_from(self.services)))

    @rule(data=st.data(), times=st.integers(1, 3))
    def pick(self, data: st.DataObject, times: int) -> None:
        fitting = self.fitting(data)
        for _ in range(times):
            rotations = {prio: list(conns) for prio, conns in self.model.rotation.items()}
            got = self._shape(self.book.pick(fitting))
            expected = self.model.pick(fitting)
            note(f"pick {sorted(fitting)} -> {got} (rotations {rotations})")
            assert got == expected, f"picked {got}, the rule says {expected}"
            assert self.book.grants == self.model.grants

    @precondition(lambda self: self.model.wants)
    @rule(data=st.data())
    def grant(self, data: st.DataObject) -> None:
        conn, job_id = data.draw(st.sampled_from(sorted(w[:2] for w in self.model.wants)))
        assert self._shape(self.book.grant(conn, job_id)) == self.model.grant(conn, job_id)

    @rule(weight=st.integers(0, 9))
    def clear(self, weight: int) -> None:
        if weight:  # rare
            return
        got = sorted(w.seq for w in self.book.clear())
        assert got == sorted(w[4] for w in self.model.wants)
        self.model = BookModel(aging=self.aging)
        assert self.book.grants == 0

    @invariant()
    def agree(self) -> None:
        book, model = self.book, self.model
        book.check_invariants()
        assert len(book) == len(model.wants)
        assert book.highest() == max((w[3] for w in model.wants), default=None)
        for priority in self.priorities:
            assert book.rotation(priority) == model.rotation.get(priority, [])
        for want in model.wants:
            parked = book.get(want[0], want[1])
            assert self._shape(parked) == want
            assert parked is not None
            assert (parked.base, parked.parked_at) == model.parked[want[:2]]
            assert book.ahead_of(parked) == model.ahead(want)
        for conn in range(self.connections):
            mine = sorted((w for w in model.wants if w[0] == conn), key=lambda w: (-w[3], w[4]))
            assert [self._shape(w) for w in book.connection_wants(conn)] == mine

    @rule(data=st.data())
    def query_fitting(self, data: st.DataObject) -> None:
        fitting = self.fitting(data)
        assert self.book.fitting_priority(fitting) == self.model.fitting_priority(fitting)

    @rule(data=st.data())
    def query_turn(self, data: st.DataObject) -> None:
        conn = self.draw(data, range(self.connections))
        priority = self.draw(data, self.priorities)
        assert self.book.last_grant(conn, priority) == self.model.latest.get((conn, priority))
        got = self.book.turn_comes_first(conn, priority)
        assert got == self.model.turn_comes_first(conn, priority)


def book_machine(
    *,
    services: tuple[str, ...] = ("a", "b", "c"),
    priorities: tuple[int, ...] = (-1, 0, 2),
    connections: int = 4,
    aging: float | None = None,
) -> type[BookMachine]:
    """A :class:`BookMachine` over these services, priorities and connections.

    With ``aging`` (seconds per band), time passes by fractions and multiples of
    it between the other steps and every due lift applies, as the broker does
    at each input: every pick, rotation, position and FIFO order is then
    checked at the lifted priorities (a lifted want is a new arrival there).
    """
    if connections < 1 or not services or not priorities:
        raise ValueError("book_machine needs a connection, a service and a priority")
    return type(
        "ConfiguredBookMachine",
        (BookMachine,),
        {
            "services": services,
            "priorities": priorities,
            "connections": connections,
            "aging": aging,
        },
    )
