"""SUBSCRIBE/STATS and queue positions in the cores, with explicit clocks."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from trio_broker.core import protocol as p
from trio_broker.core.broker import Broker
from trio_broker.core.figures import (
    Answer,
    JobFigures,
    answer_from_position,
    answer_from_stats,
    queue_position,
)
from trio_broker.testing.values import receipt

from .test_broker import Harness, make_broker
from .test_client import Net, broker, config


def stats_of(frames: list[p.Message]) -> list[p.Stats]:
    return [m for m in frames if isinstance(m, p.Stats)]


def subscribed(*names: str, size: int = 2, **pool: Any) -> Harness:
    """A broker with one registered connection per name, each subscribed (first STATS read)."""
    h = Harness(make_broker(size, **pool), *names)
    for name in names:
        h.send(name, p.Subscribe(job_id=p.STATS_TAG))
    h.frames()
    return h


# -- the execserver side ----------------------------------------------------------------


def test_subscribe_sends_the_figures_at_once() -> None:
    """The first STATS answers SUBSCRIBE at once and carries the pool's figures."""
    h = Harness(make_broker(3, fast_reserve=1), "a")
    h.want("a", "j1")
    h.send("a", p.Subscribe(job_id=p.STATS_TAG))
    (stats,) = stats_of(h.frames("a"))
    assert (stats.instance_id, stats.name) == ("inst", "exec")
    assert (stats.slots, stats.fast_reserve) == (3, 1)
    assert (stats.running, stats.offered, stats.waiting, stats.clients) == (0, 1, 0, 1)
    assert (stats.finished, stats.failed, stats.per_minute) == (0, 0, 0)
    assert stats.services == {
        "s": p.ServiceFigures(kind="unknown", capacity=3, mean_s=None, running=0, waiting=0)
    }
    assert stats.callback_check is None
    assert not stats.draining


def test_unchanged_figures_cost_no_frame_and_changes_come_once_a_second() -> None:
    """While nothing changes a subscriber hears nothing; a change is told at the next look,
    at most once a second however many changes happen in between."""
    h = subscribed("a", "b", size=1)
    for second in range(1, 6):
        h.at(100.0 + second)
        assert stats_of(h.frames("a")) == []
    h.now = 105.1
    h.want("b", "j1")  # offered: the slot is busy
    h.want("b", "j2")  # parked
    h.want("b", "j3")
    assert stats_of(h.frames("a")) == []  # not before the next look
    h.at(105.9)
    assert stats_of(h.frames("a")) == []
    h.at(106.0)
    (stats,) = stats_of(h.frames("a"))
    assert (stats.offered, stats.waiting) == (1, 2)
    assert stats.waiting_by_priority == (p.PriorityCount(priority=0, waiting=2),)
    h.at(107.0)
    assert stats_of(h.frames("a")) == []


def test_nobody_subscribed_means_nothing_but_liveness() -> None:
    """A connection that never subscribed sees only PING over a minute of changes."""
    h = Harness(make_broker(1), "a", "b")
    h.send("a", p.Subscribe(job_id=p.STATS_TAG))
    h.send("a", p.Unsubscribe(job_id=p.STATS_TAG))
    h.frames()
    kinds: set[str] = set()
    for second in range(1, 61):
        h.now = 100.0 + second - 0.5
        h.want("b", f"j{second}")  # the book changes every second
        h.send("a", p.Pong(nonce="alive"))
        h.at(100.0 + second)
        kinds |= {m.TYPE for m in h.frames("a")}
    assert kinds <= {"PING", "HELLO"}
    assert "PING" in kinds


def test_subscribe_needs_register_and_a_second_one_changes_nothing() -> None:
    """SUBSCRIBE before REGISTER is refused like any request; a repeated one is silent."""
    h = Harness(make_broker(1))
    h.open("a", register=False)
    h.frames()
    h.send("a", p.Subscribe(job_id="stats"))
    (error,) = h.frames("a")
    assert isinstance(error, p.Error)
    assert (error.code, error.job_id) == ("not_registered", "stats")
    h.send("a", p.Register(backend_id="a", name="a", version="1"))
    h.send("a", p.Subscribe(job_id="stats"))
    assert len(stats_of(h.frames("a"))) == 1
    h.send("a", p.Subscribe(job_id="stats"))
    assert h.frames("a") == []


def test_each_connection_is_told_its_own_callback_check() -> None:
    """The callback check in STATS is the receiving connection's; only it hears of a change,
    at its next look."""
    h = subscribed("a", "b")
    h.broker.callback_checked(h.conns["b"], "mismatch: answered 'x'", now=100.5)
    h.at(101.0)
    frames = h.broker.frames_to_send()
    told = {
        name: [m.callback_check for c, m in frames if c == conn and isinstance(m, p.Stats)]
        for name, conn in h.conns.items()
    }
    assert told == {"a": [], "b": ["mismatch: answered 'x'"]}
    assert h.broker.stats_for(h.conns["a"]).callback_check is None


def test_job_ends_are_counted_with_their_bytes_and_the_throughput_decays() -> None:
    """finished/failed never overlap, bytes add up, and per_minute forgets after 60 s."""
    h = subscribed("a", size=2)
    runs = [h.start("a", "ok1"), h.start("a", "bad1")]
    h.frames()
    ok = attrs.evolve(receipt("ok"), stdin_bytes=10, stdout_bytes=100)
    bad = attrs.evolve(receipt("failed"), stdin_bytes=1, stdout_bytes=2)
    h.broker.job_ended(runs[0], ok, now=100.2)
    h.broker.job_ended(runs[1], bad, now=100.7)
    h.at(101.0)
    (stats,) = stats_of(h.frames("a"))
    assert (stats.finished, stats.failed, stats.per_minute) == (1, 1, 2)
    assert (stats.bytes_in, stats.bytes_out) == (11, 102)
    assert stats.services["s"].mean_s == pytest.approx(0.5)
    for second in range(2, 60):
        h.send("a", p.Pong(nonce="alive"))  # the client keeps the connection alive
        h.at(100.0 + second)
        assert stats_of(h.frames("a")) == []
    h.send("a", p.Pong(nonce="alive"))
    h.at(160.0)  # the second 100 left the window
    (stats,) = stats_of(h.frames("a"))
    assert (stats.finished, stats.failed, stats.per_minute) == (1, 1, 0)


def test_unsubscribe_and_close_end_the_looks() -> None:
    """After UNSUBSCRIBE (or a close) no STATS comes, and an old timer does nothing."""
    h = subscribed("a", "b")
    h.send("a", p.Unsubscribe(job_id=p.STATS_TAG))
    h.send("a", p.Subscribe(job_id=p.STATS_TAG))  # a new subscription: a new first frame
    assert len(stats_of(h.frames("a"))) == 1
    h.broker.close_connection(h.conns["b"], now=100.5)
    h.at(101.0)
    # one look for a (its old timer's generation is stale): the client count changed
    assert [s.clients for s in stats_of(h.frames("a"))] == [1]
    h.want("a", "j1")
    h.at(101.5)
    assert stats_of(h.frames("a")) == []
    h.at(102.0)
    assert len(stats_of(h.frames("a"))) == 1


def test_draining_is_told_and_the_book_is_empty() -> None:
    """A subscriber learns of draining at its next look; the figures stay truthful."""
    h = subscribed("a", "b", size=1)
    h.want("b", "j1")
    h.want("b", "j2")
    h.broker.drain(now=100.5)
    h.at(101.0)
    (stats,) = stats_of(h.frames("a"))
    assert stats.draining
    assert (stats.waiting, stats.offered, stats.waiting_by_priority) == (0, 0, ())


def test_figures_count_whole_seconds() -> None:
    """A job ended at t counts while floor(now) < floor(t) + 60."""
    figures = JobFigures()
    figures.record(receipt("ok"), now=10.9)
    figures.record(receipt("stopped"), now=11.0)
    assert figures.per_minute(now=69.99) == 2
    assert figures.per_minute(now=70.0) == 1
    assert figures.per_minute(now=71.0) == 0
    assert (figures.finished, figures.failed) == (1, 1)


# -- the client side ---------------------------------------------------------------------


class OlderBroker(Broker):
    """An execserver from before SUBSCRIBE: the new types are as unknown to it as any."""

    def receive(self, conn_id: int, message: p.Message, *, now: float) -> None:
        if isinstance(message, p.Subscribe | p.Unsubscribe):
            text = p.encode(message).replace(message.TYPE, "NOT_IN_VERSION_1_YET", 1)
            self.receive_text(conn_id, text, now=now)
        else:
            super().receive(conn_id, message, now=now)


def test_client_subscribes_everywhere_and_on_new_connections() -> None:
    """subscribe() asks every ready execserver and each that becomes ready; STATS are kept."""
    a, b = broker("a"), broker("b")
    net = Net(config("A", "B"), {"A": [a], "B": [b]})
    net.client.subscribe(now=0.0)  # before any connection is ready: asked at first HELLO
    net.dial_all()
    net.flush()
    conns = sorted(net.links)
    assert [net.client.stats(c).instance_id for c in conns] == ["a", "b"]  # type: ignore[union-attr]
    net.submit("j")
    net.flush()
    net.at(1.0)
    net.flush()
    assert sorted(net.client.stats(c).running for c in conns) == [0, 1]  # type: ignore[union-attr]
    net.client.unsubscribe(now=1.0)
    net.route()
    assert [m.TYPE for c in conns for m in net.to_server(c)] == ["UNSUBSCRIBE"] * 2
    net.flush()
    assert [net.client.stats(c) for c in conns] == [None, None]
    net.at(5.0)
    net.flush()
    assert [net.client.stats(c) for c in conns] == [None, None]


def test_an_older_execserver_is_not_asked_again() -> None:
    """unknown_type for the tagged SUBSCRIBE marks the connection: no further asking."""
    old, new = OlderBroker(broker("old").config, now=0.0), broker("new")
    net = Net(config("OLD", "NEW"), {"OLD": [old], "NEW": [new]})
    net.dial_all()
    net.flush()
    net.client.subscribe(now=0.0)
    net.route()
    net.flush()
    old_conn, new_conn = sorted(net.links)
    assert net.client.stats_refused(old_conn)
    assert net.client.stats(old_conn) is None
    assert net.client.stats(new_conn) is not None
    net.client.unsubscribe(now=0.0)
    net.client.subscribe(now=0.0)
    net.route()
    assert [m.TYPE for m in net.to_server(old_conn)] == []  # never asked again
    assert [m.TYPE for m in net.to_server(new_conn)] == ["UNSUBSCRIBE", "SUBSCRIBE"]


# -- queue positions ---------------------------------------------------------------------


def test_the_best_answer_wins_and_rows_ahead_add_up() -> None:
    """The fewest wants ahead wins; unclaimed rows come on top; running and capacity add
    up over the answers; eta waits for the slot releases ahead at the whole capacity."""
    slow = Answer(instance_id="x", running=2, waiting=9, ahead=8, capacity=2, mean_s=3.0)
    fast = Answer(instance_id="y", running=3, waiting=7, ahead=6, capacity=4, mean_s=2.0)
    position = queue_position([slow, fast], rows_ahead=4, ready_rows=10)
    assert position is not None
    assert (position.instance_id, position.running, position.capacity) == ("y", 5, 6)
    assert position.position == 11
    assert position.waiting == 9 + 10  # the most wants known, and every unclaimed row
    # 10 ahead and itself, 1 slot free: 10 releases at 6 slots, then its own run
    assert position.eta_s == pytest.approx(2.0 * (10 / 6 + 1))
    assert queue_position([]) is None
    with pytest.raises(ValueError, match="rows_ahead must be >= 0, got -1"):
        queue_position([fast], rows_ahead=-1)
    with pytest.raises(ValueError, match="claimed_ahead must be >= 0, got -2"):
        queue_position([fast], claimed_ahead=-2)


def test_claimed_rows_no_execserver_sees_count_ahead() -> None:
    """A dispatcher holds 40 claimed rows, 2 run, 1 is offered: the execserver sees 1 want,
    the queue 38 rows that hold no slot. The step is number 39 + the unclaimed rows ahead,
    never "1 waiting, you are number 41", and the estimate counts them all."""
    book = Answer(instance_id="x", running=2, waiting=1, ahead=1, capacity=2, mean_s=1.0)
    position = queue_position([book], rows_ahead=2, claimed_ahead=40, ready_rows=5, claimed_rows=40)
    assert position is not None
    assert position.held_ahead == 38
    assert position.position == 38 + 2 + 1
    assert position.waiting == 38 + 5
    assert position.eta_s == pytest.approx(1.0 * (41 / 2 + 1))
    # the execserver's book wins when it knows more (other clients' wants)
    crowded = attrs.evolve(book, ahead=50, waiting=60)
    position = queue_position([crowded], claimed_ahead=40, claimed_rows=40)
    assert position is not None
    assert (position.position, position.waiting) == (51, 60)


def test_answers_from_stats_count_the_wants_at_or_above_the_priority() -> None:
    """A want not parked yet would wait behind every want at its priority or above."""
    h = Harness(make_broker(1), "a")
    h.want("a", "busy")
    for job_id, priority in (("lo", -2), ("n1", 0), ("n2", 0), ("hi", 4)):
        h.want("a", job_id, priority=priority)
    stats = h.broker.stats_for(h.conns["a"])
    assert [answer_from_stats(stats, "s", prio).ahead for prio in (-2, 0, 4, 5)] == [4, 3, 1, 0]  # type: ignore[union-attr]
    assert answer_from_stats(stats, "other", 0) is None


def test_answer_from_position_works_the_mean_back_from_eta() -> None:
    """Without STATS the mean is eta_s / (ahead // capacity + 1)."""
    answer = p.Position(job_id="j", running=2, ahead=5, capacity=2, eta_s=9.0)
    assert answer_from_position("x", answer, None, "s").mean_s == pytest.approx(3.0)
    unmeasured = attrs.evolve(answer, eta_s=None)
    assert answer_from_position("x", unmeasured, None, "s").mean_s is None


def test_a_job_within_one_second_shows_up_at_the_next_look() -> None:
    """A job started and ended between two looks is told once, as ended."""
    h = subscribed("a")
    run = h.start("a", "j")
    h.broker.job_ended(run, receipt("ok"), now=100.5)
    h.frames()
    h.at(101.0)
    (stats,) = stats_of(h.frames("a"))
    assert (stats.running, stats.finished) == (0, 1)


def test_the_first_look_after_subscribing_is_a_second_later() -> None:
    """A change right after SUBSCRIBE waits for the look a second after the first frame."""
    h = subscribed("a", "b", size=1)
    h.now = 100.2
    h.want("b", "j1")
    h.at(100.5)
    assert stats_of(h.frames("a")) == []
    h.at(101.0)
    (stats,) = stats_of(h.frames("a"))
    assert stats.offered == 1


def test_stats_count_waiting_and_running_jobs_per_service() -> None:
    h = Harness(make_broker(1, services={"s": 0, "t": 0}), "a")
    h.start("a", "j1", service="t")
    for job in ("j2", "j3"):
        h.send("a", p.Want(job_id=job, service="s", priority=0))
    h.send("a", p.Want(job_id="j4", service="t", priority=1))
    stats = h.broker.stats_for(h.conns["a"])
    assert {name: (f.running, f.waiting) for name, f in stats.services.items()} == {
        "s": (0, 2),
        "t": (1, 1),
    }
    assert stats.waiting_by_priority == (
        p.PriorityCount(priority=1, waiting=1),
        p.PriorityCount(priority=0, waiting=2),
    )
