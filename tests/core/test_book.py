"""The want-book on its own, beyond what the model check's short runs reach: long
rotations (stamps renumbered many times), and aging's bookkeeping."""

from __future__ import annotations

import random

import pytest

from trio_broker.core.book import WantBook
from trio_broker.testing.book import BookModel

CONNS = (1, 2, 3)
SERVICES = ("a", "b", "c")
PRIORITIES = (0, 2)


def test_long_rotations_keep_the_grant_rule_through_renumbering() -> None:
    """Thousands of grants at one level renumber its stamps again and again; every
    pick, position and turn still agrees with the plain list model."""
    rng = random.Random(7)
    book: WantBook[int] = WantBook()
    model = BookModel()
    jobs = 0
    renumbered = 0
    for _ in range(8_000):
        parked = len(book)
        if parked < 6 or rng.random() < 0.45:
            conn, service = rng.choice(CONNS), rng.choice(SERVICES)
            priority = rng.choice(PRIORITIES)
            jobs += 1
            book.add(conn, f"j{jobs}", service, priority)
            model.add(conn, f"j{jobs}", service, priority)
        elif rng.random() < 0.1:
            victim = rng.choice(list(book.wants()))
            book.remove(victim.conn, victim.job_id)
            model.remove(victim.conn, victim.job_id)
        else:
            fitting = {s for s in SERVICES if rng.random() < 0.7}
            got, expected = book.pick(fitting), model.pick(fitting)
            picked = (got.conn, got.job_id) if got else None
            assert picked == (expected[:2] if expected else None)
        for want in book.wants():
            (shape,) = [w for w in model.wants if w[:2] == (want.conn, want.job_id)]
            assert book.ahead_of(want) == model.ahead(shape)
        for priority in PRIORITIES:
            for conn in CONNS:
                assert book.turn_comes_first(conn, priority) == (
                    model.turn_comes_first(conn, priority)
                )
        renumbered = max([renumbered, *(level.base for level in book._levels.values())])
        book.check_invariants()
    assert renumbered > 0  # the run did reach renumbered stamps


@pytest.mark.parametrize("aging", [0.0, -1.0])
def test_aging_must_be_positive(aging: float) -> None:
    with pytest.raises(ValueError, match="aging must be positive seconds or None"):
        WantBook(aging=aging)


def test_aging_below_a_second_is_accepted() -> None:
    assert WantBook(aging=0.5).aging == 0.5


def test_age_lifts_every_due_want_in_one_call_past_removed_ones() -> None:
    book: WantBook[str] = WantBook(aging=10.0)
    book.add("c", "gone", "s", 0, now=0.0)  # due first, but removed
    book.add("c", "first", "s", 0, now=1.0)
    book.add("d", "second", "s", 0, now=2.0)
    book.remove("c", "gone")
    assert book.age(5.0) == 0
    assert book.age(12.0) == 2
    assert {w.job_id: w.priority for w in book.wants()} == {"first": 2, "second": 2}
    book.check_invariants()


def test_aging_forgets_removed_wants_in_bulk_and_keeps_the_live_ones() -> None:
    """Removed wants stay in the aging queue until it outgrows the book; the clean-up
    then keeps every live want's due time."""
    book: WantBook[str] = WantBook(aging=10.0)
    for n in range(100):
        book.add("c", f"w{n}", "s", 0, now=float(n) / 100)
    for n in range(95):
        book.remove("c", f"w{n}")
    book.add("d", "late", "s", 0, now=5.0)  # the queue holds 101 entries for 6 wants
    assert len(book._aging_heap) == len(book)
    assert book.age(10.9) == 0  # the live ones were parked at 0.95..0.99
    assert book.age(11.0) == 5
    assert book.age(15.0) == 1
    assert {w.priority for w in book.wants()} == {2}
    book.check_invariants()


def test_a_want_that_leaves_the_book_is_no_longer_live() -> None:
    """Whoever keeps a ParkedWant can tell it left: removed, granted, gone with its
    connection, or cleared by a drain."""
    book: WantBook[str] = WantBook()
    wants = {job: book.add("c", job, "s", 0) for job in ("removed", "granted", "cleared")}
    gone = book.add("d", "closed", "s", 0)
    assert all(w.live for w in [*wants.values(), gone])
    book.remove("c", "removed")
    book.grant("c", "granted")
    book.remove_connection("d")
    assert [w.live for w in [*wants.values(), gone]] == [False, False, True, False]
    assert book.clear() == [wants["cleared"]]
    assert not wants["cleared"].live
    assert len(book) == 0


def test_a_wide_rotation_keeps_its_order_through_renumbering() -> None:
    """Seventeen connections dealt round-robin past the renumbering point (more than
    two bytes of rotation bits) keep their order."""
    book: WantBook[int] = WantBook()
    conns = list(range(17))
    jobs = 0
    for conn in conns:
        for _ in range(2):
            jobs += 1
            book.add(conn, f"j{jobs}", "s", 0)
    for turn in range(1_300):
        want = book.pick({"s"})
        assert want is not None
        assert want.conn == conns[turn % len(conns)]
        jobs += 1
        book.add(want.conn, f"j{jobs}", "s", 0)
    assert book._levels[0].base > 0  # renumbered on the way
    done = 1_300 % len(conns)
    assert book.rotation(0) == [*conns[done:], *conns[:done]]
    book.check_invariants()
