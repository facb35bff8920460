"""The client core's rules one at a time, with explicit clocks (beside test_client.py's
scenarios): usage errors, queries, counts, callback bases, liveness, growth timing."""

from __future__ import annotations

from typing import Any

import pytest

from trio_broker.core import protocol as p
from trio_broker.core.client import (
    Accepted,
    ClientCore,
    ClientEffect,
    ClientUsageError,
    Close,
    Dial,
    Failed,
    Finished,
    PeerError,
)
from trio_broker.testing.values import receipt

from .test_client import config

SERVER = "127.0.0.1:7000"  # an execserver's own address (HELLO.addr)
BALANCER = "127.0.0.3:80"  # the socket's peer when a balancer fronts the fleet
LOCAL = "127.0.0.2:40000"  # the client's side of every socket


def hello(instance: str, *services: str, draining: bool = False, idle: int = 1) -> p.Hello:
    return p.Hello(
        protocol=1,
        instance_id=instance,
        name=instance,
        services={s: p.ServiceInfo(max_slots=0, kind="unknown") for s in services},
        processes=1,
        idle=idle,
        clients=1,
        draining=draining,
        addr=SERVER,
    )


def stats(instance: str) -> p.Stats:
    return p.Stats(
        instance_id=instance,
        name=instance,
        slots=1,
        fast_reserve=0,
        running=0,
        offered=0,
        waiting=0,
        finished=0,
        failed=0,
        per_minute=0,
        bytes_in=0,
        bytes_out=0,
        clients=1,
        draining=False,
        services={},
        waiting_by_priority=(),
    )


class Raw:
    """A client core driven by hand: the test plays the transport and every execserver."""

    def __init__(self, *addresses: str, **overrides: Any) -> None:
        self.core = ClientCore(config(*addresses, **overrides), now=0.0)
        self.dials: list[Dial] = []
        self.effects: list[ClientEffect] = []
        self._frames: list[tuple[int, p.Message]] = []
        self._collect()
        self.take()

    def _collect(self) -> None:
        self.core.check_invariants()
        self._frames += self.core.frames_to_send()
        for effect in self.core.effects():
            if isinstance(effect, Dial):
                self.dials.append(effect)
            else:
                self.effects.append(effect)

    def take(self) -> list[tuple[int, str]]:
        """The frames sent since the last look, as (connection, type)."""
        self._collect()
        frames, self._frames = self._frames, []
        return [(conn, message.TYPE) for conn, message in frames]

    def take_messages(self) -> list[tuple[int, p.Message]]:
        self._collect()
        frames, self._frames = self._frames, []
        return frames

    def up(
        self, conn: int, instance: str, *services: str, now: float = 0.0, peer: str = SERVER
    ) -> None:
        """The dial of ``conn`` lands and the execserver says HELLO."""
        self.core.connected(conn, local_addr=LOCAL, peer_addr=peer, now=now)
        self.receive(conn, hello(instance, *services), now=now)

    def receive(self, conn: int, message: p.Message, now: float = 0.0) -> None:
        self.core.receive(conn, message, now=now)
        self._collect()

    def error(self, conn: int, code: p.ErrorCode, job_id: str, now: float = 0.0) -> None:
        self.receive(conn, p.Error(code=code, message=code, job_id=job_id), now=now)

    def submit(self, job_id: str, service: str = "s", now: float = 0.0) -> None:
        self.core.submit(job_id, service, {"n": 1}, now=now)
        self._collect()

    def tick(self, now: float) -> None:
        self.core.tick(now=now)
        self._collect()

    def of(self, kind: type) -> list[Any]:
        self._collect()
        return [e for e in self.effects if isinstance(e, kind)]

    def dialled(self) -> list[tuple[int, str]]:
        """The dials asked for since the last look, as (connection, address)."""
        self._collect()
        dials, self.dials = self.dials, []
        return [(d.conn, d.address) for d in dials]


def ready_with_two() -> Raw:
    """Two execservers offering ``s`` (connections 1 and 2), the dials and REGISTERs taken."""
    raw = Raw("A", "B")
    raw.up(1, "a", "s")
    raw.up(2, "b", "s")
    raw.dialled()
    raw.take()
    return raw


# -- usage errors and forgotten connections ------------------------------------------------


def test_connected_twice_or_after_the_close_is_a_usage_error() -> None:
    raw = Raw("A", "B")
    raw.core.connected(1, local_addr=LOCAL, now=0.0)
    with pytest.raises(ClientUsageError, match="connection 1 is already connected"):
        raw.core.connected(1, local_addr=LOCAL, now=0.0)
    raw.core.dial_failed(2, now=0.0)
    with pytest.raises(ClientUsageError, match="connection 2 is closed"):
        raw.core.connected(2, local_addr=LOCAL, now=0.0)
    with pytest.raises(ClientUsageError, match="connection 3 was never dialled"):
        raw.core.connected(3, local_addr=LOCAL, now=0.0)


def test_ids_never_issued_are_usage_errors_and_forgotten_ones_are_ignored() -> None:
    """Ids 1..last were issued: the first and the last, once forgotten, take late reports
    and frames quietly; 0 and last + 1 are misuse, and the clock does not move."""
    raw = Raw("A", "B")
    raw.core.dial_failed(1, now=0.0)
    raw.core.dial_failed(2, now=0.0)
    for conn in (1, 2):
        raw.core.connection_closed(conn, now=1.0)
        raw.core.dial_failed(conn, now=1.0)
        raw.receive(conn, p.Ping(nonce="late"), now=1.0)
        raw.core.receive_text(conn, "not a frame", now=1.0)
    assert raw.take() == []  # no PONG on a forgotten connection
    assert raw.of(PeerError) == []
    for conn in (0, 3):
        with pytest.raises(ClientUsageError, match=f"connection {conn} was never dialled"):
            raw.core.connection_closed(conn, now=5.0)
        with pytest.raises(ClientUsageError, match=f"connection {conn} was never dialled"):
            raw.core.receive(conn, p.Ping(nonce="x"), now=5.0)
        with pytest.raises(ClientUsageError, match=f"connection {conn} was never dialled"):
            raw.core.dial_failed(conn, now=5.0)
    raw.core.connection_closed(1, now=1.0)  # the refused calls left the clock alone


def test_a_frame_before_connected_is_a_usage_error() -> None:
    raw = Raw("A")
    with pytest.raises(ClientUsageError, match="before connected"):
        raw.core.receive(1, hello("a", "s"), now=0.0)
    with pytest.raises(ClientUsageError, match="before connected"):
        raw.core.receive_text(1, "not a frame", now=0.0)
    raw.up(1, "a", "s")
    assert raw.core.ready_connections() == [1]


def test_a_bad_frame_becomes_a_peer_error_and_counts_as_a_sign_of_life() -> None:
    raw = Raw("A", ping_interval=5.0, ping_timeout=15.0)
    raw.up(1, "a", "s")
    raw.core.receive_text(1, "not a frame", now=10.0)
    (error,) = raw.of(PeerError)
    assert error.conn == 1
    assert error.error.code == "bad_frame"
    raw.tick(15.0)
    assert raw.of(Close) == []  # heard from at 10: alive until 25
    raw.tick(25.0)
    assert [c.conn for c in raw.of(Close)] == [1]


def test_connected_needs_the_local_address_when_the_callback_port_is_set() -> None:
    raw = Raw("A", callback_port=8123)
    with pytest.raises(ClientUsageError, match="local_addr"):
        raw.core.connected(1, now=0.0)
    raw.core.connected(1, local_addr=LOCAL, now=0.0)


# -- callback bases ------------------------------------------------------------------------


def register_of(raw: Raw) -> p.Register:
    ((_, message),) = raw.take_messages()
    assert isinstance(message, p.Register)
    return message


def test_without_callback_settings_the_base_is_none() -> None:
    raw = Raw("A")
    raw.core.connected(1, local_addr=LOCAL, now=0.0)
    assert register_of(raw).callback_url is None
    assert raw.core.callback_base(1) is None
    assert raw.core.callback_base(99) is None


def test_the_callback_port_goes_with_each_connections_local_host() -> None:
    """An IPv6 local address keeps its brackets; a callback_url is taken verbatim."""
    raw = Raw("A", "B", callback_port=8123)
    raw.core.connected(1, local_addr="[::1]:40000", now=0.0)
    assert register_of(raw).callback_url == "http://[::1]:8123"
    raw.core.connected(2, local_addr="127.0.0.7:5", now=0.0)
    assert register_of(raw).callback_url == "http://127.0.0.7:8123"
    assert raw.core.callback_base(1) == "http://[::1]:8123"
    fixed = Raw("A", callback_url="https://me.example", callback_port=8123)
    fixed.core.connected(1, local_addr="[::1]:40000", now=0.0)
    assert register_of(fixed).callback_url == "https://me.example"


# -- submit, query, counts -----------------------------------------------------------------


def test_a_want_has_priority_zero_unless_told() -> None:
    raw = ready_with_two()
    raw.core.submit("j", "s", {}, now=0.0)
    raw.core.submit("k", "s", {}, priority=3, now=0.0)
    wants = [m for _, m in raw.take_messages() if isinstance(m, p.Want)]
    assert [(w.job_id, w.priority) for w in wants] == [("j", 0), ("j", 0), ("k", 3), ("k", 3)]


def test_query_asks_where_the_job_is_parked_then_where_it_runs() -> None:
    raw = ready_with_two()
    raw.submit("j")
    raw.take()
    raw.core.query("j", now=0.0)
    assert raw.take() == [(1, "QUERY"), (2, "QUERY")]
    raw.receive(2, p.Offer(job_id="j", token="t"))
    assert raw.take() == [(1, "UNWANT"), (2, "JOB")]
    raw.core.query("j", now=0.0)
    assert raw.take() == [(2, "QUERY")]
    raw.core.query("unknown", now=0.0)
    assert raw.take() == []


def test_counts_and_states_of_waiting_running_and_ended_jobs() -> None:
    raw = ready_with_two()
    raw.submit("run")
    raw.receive(1, p.Offer(job_id="run", token="t"))
    raw.submit("wait")
    assert (raw.core.running_count(), raw.core.waiting_count()) == (1, 1)
    assert [raw.core.state_of(j) for j in ("run", "wait", "unknown")] == [
        "accepted",
        "waiting",
        None,
    ]
    raw.receive(1, p.Done(job_id="run", receipt=receipt()))
    assert raw.of(Finished) == [Finished(job_id="run", receipt=receipt())]
    assert (raw.core.running_count(), raw.core.waiting_count()) == (0, 1)
    assert raw.core.state_of("run") is None


def test_a_done_from_another_connection_or_for_an_unknown_job_is_ignored() -> None:
    raw = ready_with_two()
    raw.submit("j")
    raw.receive(2, p.Offer(job_id="j", token="t"))
    raw.receive(1, p.Done(job_id="j", receipt=receipt()))
    raw.receive(2, p.Done(job_id="ghost", receipt=receipt()))
    assert raw.of(Finished) == []
    assert raw.core.state_of("j") == "accepted"
    raw.receive(2, p.Done(job_id="j", receipt=receipt()))
    assert [f.job_id for f in raw.of(Finished)] == ["j"]


def test_surplus_offers_are_declined_and_counted() -> None:
    """A late offer for a job that got its slot elsewhere, and one for a job id this client
    does not know, are declined; each counts once."""
    raw = ready_with_two()
    assert raw.core.surplus_offers == 0
    raw.submit("j")
    raw.take()
    raw.receive(1, p.Offer(job_id="j", token="t1"))
    assert raw.core.surplus_offers == 0
    raw.receive(2, p.Offer(job_id="j", token="t2"))  # crossed our UNWANT
    raw.receive(1, p.Offer(job_id="ghost", token="t3"))
    assert [(c, m) for c, m in raw.take_messages() if isinstance(m, p.Decline)] == [
        (2, p.Decline(token="t2")),
        (1, p.Decline(token="t3")),
    ]
    assert raw.core.surplus_offers == 2
    assert raw.of(Accepted) == [Accepted(job_id="j", conn=1)]


# -- ERROR ---------------------------------------------------------------------------------


def test_an_expired_offer_parks_the_want_again_and_other_codes_unpark_or_leave_it() -> None:
    raw = ready_with_two()
    raw.submit("j")
    raw.take()
    raw.error(1, "offer_expired", "j")
    assert raw.take() == [(1, "WANT")]
    assert raw.core.parked_on("j") == {1, 2}
    raw.error(2, "draining", "j")  # the want is gone there: not parked again
    assert raw.take() == []
    assert raw.core.parked_on("j") == {1}
    raw.error(2, "offer_expired", "j")  # not parked there any more: nothing to renew
    raw.error(1, "unknown_job", "j")  # not a code that drops a want
    assert raw.take() == []
    assert raw.core.parked_on("j") == {1}
    assert raw.core.waiting_count() == 1


def test_a_want_refused_for_too_many_wants_is_sent_there_again_a_retry_tick_later() -> None:
    """too_many_wants: the want is not parked on that connection; the job still waits
    (nothing failed, its deadline untouched) and its WANT goes there again one
    retry_tick later, until the execserver takes it."""
    raw = ready_with_two()
    raw.submit("j")
    raw.take()
    raw.error(1, "too_many_wants", "j", now=0.5)
    assert raw.core.parked_on("j") == {2}
    assert raw.take() == []
    raw.error(2, "too_many_wants", "j", now=0.7)
    assert raw.core.parked_on("j") == set()
    assert raw.core.waiting_count() == 1
    assert raw.of(Failed) == []
    raw.tick(1.5)  # retry_tick (1 s) after the first refusal
    assert raw.take() == [(1, "WANT")]
    raw.tick(1.7)
    assert raw.take() == [(2, "WANT")]
    assert raw.core.parked_on("j") == {1, 2}
    raw.receive(1, p.Queued(job_id="j"), now=1.8)
    raw.error(2, "too_many_wants", "j", now=1.9)
    raw.receive(1, p.Offer(job_id="j", token="t"), now=2.0)  # JOB sent: accepted
    raw.tick(2.9)  # the job holds a slot: no WANT again on connection 2
    assert [t for _, t in raw.take()] == ["JOB"]
    assert raw.of(Failed) == []


def test_a_refused_job_waits_again_everywhere_but_other_errors_leave_it_running() -> None:
    raw = ready_with_two()
    raw.submit("j")
    raw.receive(1, p.Offer(job_id="j", token="t"))
    raw.take()
    raw.error(1, "unknown_job", "j")  # say an answer to a QUERY that crossed the JOB
    raw.error(2, "token_mismatch", "j")  # not the job's connection
    assert raw.core.state_of("j") == "accepted"
    assert raw.take() == []
    raw.error(1, "token_mismatch", "j")
    assert raw.core.state_of("j") == "waiting"
    assert (raw.core.running_count(), raw.core.waiting_count()) == (0, 1)
    assert raw.take() == [(1, "WANT"), (2, "WANT")]


# -- SUBSCRIBE and STATS -------------------------------------------------------------------


def test_subscribe_asks_ready_execservers_keeps_stats_and_unsubscribe_ends_it() -> None:
    raw = Raw("A", "B", "C")
    raw.up(1, "a", "s")
    raw.up(2, "b", "s")
    raw.take()
    assert not raw.core.subscribed
    raw.receive(1, stats("a"))  # not asked for: not kept
    assert raw.core.stats(1) is None
    raw.core.subscribe(now=0.0)
    assert raw.core.subscribed
    assert raw.take() == [(1, "SUBSCRIBE"), (2, "SUBSCRIBE")]
    raw.core.subscribe(now=0.0)
    assert raw.take() == []
    raw.up(3, "c", "s")
    assert raw.take() == [(3, "REGISTER"), (3, "SUBSCRIBE")]
    raw.receive(1, stats("a"))
    assert raw.core.stats(1) == stats("a")
    raw.error(2, "unknown_type", p.STATS_TAG)  # an older execserver
    raw.error(3, "unknown_type", "j")  # another frame it did not know
    raw.error(3, "bad_field", p.STATS_TAG)
    assert [raw.core.stats_refused(c) for c in (1, 2, 3, 99)] == [False, True, False, False]
    raw.core.unsubscribe(now=0.0)
    assert not raw.core.subscribed
    assert raw.take() == [(1, "UNSUBSCRIBE"), (3, "UNSUBSCRIBE")]
    assert raw.core.stats(1) is None
    raw.receive(1, stats("a"))  # crossed the UNSUBSCRIBE
    assert raw.core.stats(1) is None
    raw.dialled()
    raw.core.connection_closed(3, now=0.0)
    raw.tick(1.0)
    ((conn, _),) = raw.dialled()
    raw.up(conn, "c", "s", now=1.0)
    assert raw.take() == [(conn, "REGISTER")]  # unsubscribed: new connections are not asked


# -- HELLO ---------------------------------------------------------------------------------


def test_a_figures_only_hello_leaves_a_probing_job_waiting_for_the_dial_in_flight() -> None:
    """The pool is full once growth dialled for a probing job; until that dial lands, only
    a change in the fleet (not new figures, not a PING) may settle the job."""
    raw = Raw("LB", pool_max=2)
    raw.up(1, "r1", "a", peer=BALANCER)
    raw.dialled()
    raw.submit("j", service="b")
    assert raw.dialled() == [(2, "LB")]  # grown at once
    raw.receive(1, hello("r1", "a", idle=0), now=0.5)
    raw.receive(1, p.Ping(nonce="1"), now=0.6)
    raw.core.query("j", now=0.7)
    assert raw.of(Failed) == []
    assert raw.core.state_of("j") == "waiting"
    raw.take()
    raw.up(2, "r2", "a", "b", now=1.0, peer=BALANCER)
    assert raw.take() == [(2, "REGISTER"), (2, "WANT")]
    assert raw.core.parked_on("j") == {2}


def test_a_draining_hello_unparks_and_the_end_of_draining_parks_again() -> None:
    raw = ready_with_two()
    raw.submit("j")
    raw.take()
    raw.receive(2, hello("b", "s", draining=True))
    assert raw.core.parked_on("j") == {1}
    raw.receive(2, hello("b", "s"))
    assert raw.take() == [(2, "WANT")]
    assert raw.core.parked_on("j") == {1, 2}


def test_a_duplicate_is_found_behind_connections_to_other_instances() -> None:
    raw = Raw("A", "B", "C")
    raw.up(1, "a", "s")
    raw.up(2, "b", "s")
    raw.up(3, "b", "s")  # C leads to b, already reached through B
    assert raw.of(Close) == [Close(conn=3, code=p.CLOSE_NORMAL, reason="duplicate instance")]
    assert raw.core.covered("C")
    assert raw.core.pool("C") == []
    assert raw.core.ready_connections() == [1, 2]


# -- timers: connect_timeout, liveness, redial, growth -------------------------------------


def test_connect_timeout_fails_at_the_deadline_or_at_a_later_tick() -> None:
    raw = Raw("A", connect_timeout=30.0, pool_max=1)
    raw.up(1, "a", "s")
    raw.submit("j")
    raw.submit("k", now=1.0)
    raw.take()
    raw.tick(30.0)
    assert [(f.job_id, f.reason) for f in raw.of(Failed)] == [("j", "no_slot")]
    assert raw.take() == [(1, "UNWANT")]
    raw.tick(45.0)  # the driver woke late
    assert [(f.job_id, f.reason) for f in raw.of(Failed)] == [("j", "no_slot"), ("k", "no_slot")]
    assert raw.core.waiting_count() == 0


def test_a_silent_execserver_is_pinged_then_dropped_and_dialled_again() -> None:
    raw = Raw("A", ping_interval=5.0, ping_timeout=15.0, reconnect_min=1.0)
    raw.up(1, "a", "s")
    raw.take()
    raw.dialled()
    assert raw.core.next_deadline() == 5.0
    raw.tick(5.0)
    assert raw.take() == [(1, "PING")]
    raw.tick(10.0)
    assert raw.take() == [(1, "PING")]
    assert raw.of(Close) == []
    raw.tick(15.0)
    assert raw.of(Close) == [
        Close(conn=1, code=p.CLOSE_GOING_AWAY, reason="nothing received for 15s")
    ]
    assert raw.core.ready_connections() == []
    redial = raw.core.next_deadline()
    assert redial is not None
    assert 15.5 <= redial <= 16.0
    raw.tick(redial)
    assert raw.dialled() == [(2, "A")]


def test_a_lost_connection_of_a_grown_pool_is_replaced() -> None:
    raw = Raw("LB", pool_max=2, retry_tick=1.0, reconnect_min=1.0)
    raw.up(1, "r1", "s", peer=BALANCER)
    raw.submit("j")
    raw.tick(1.0)
    assert raw.dialled() == [(1, "LB"), (2, "LB")]
    raw.up(2, "r2", "s", now=1.0, peer=BALANCER)
    raw.core.cancel("j", now=1.0)  # nothing waits: no more growth
    raw.core.connection_closed(2, now=2.0)
    redial = raw.core.next_deadline()
    assert redial is not None
    assert 2.5 <= redial <= 3.0
    raw.tick(redial)
    assert raw.dialled() == [(3, "LB")]
    assert raw.core.pool("LB") == [1, 3]


def test_growth_waits_a_retry_tick_on_its_own_timer() -> None:
    raw = Raw("A", retry_tick=1.0, pool_max=2)
    raw.up(1, "a", "s")
    raw.dialled()
    raw.submit("j")
    assert raw.core.next_deadline() == 1.0
    raw.tick(1.0)
    assert raw.dialled() == [(2, "A")]


def test_a_probing_job_grows_at_once_then_once_per_grow_interval() -> None:
    raw = Raw("LB", pool_max=3, pool_grow_interval=2.0)
    raw.up(1, "r1", "a", peer=BALANCER)
    raw.dialled()
    raw.submit("j", service="b")
    assert raw.dialled() == [(2, "LB")]
    assert raw.core.next_deadline() == 60.0  # the dial is in flight: only connect_timeout
    raw.up(2, "r2", "a", now=0.5, peer=BALANCER)
    assert raw.core.next_deadline() == 2.0
    raw.tick(2.0)
    assert raw.dialled() == [(3, "LB")]


def test_a_covered_address_does_not_stop_another_from_growing() -> None:
    raw = Raw("A", "B", pool_max=2, retry_tick=1.0)
    raw.core.connected(1, local_addr=LOCAL, peer_addr=SERVER, now=0.0)
    raw.up(2, "x", "s")
    raw.receive(1, hello("x", "s"))  # A leads to x too: its connection is the duplicate
    assert raw.core.covered("A")
    raw.dialled()
    raw.submit("j")
    raw.tick(1.0)
    assert raw.dialled() == [(3, "B")]


def test_a_dial_in_flight_at_one_address_does_not_stop_another_from_growing() -> None:
    raw = Raw("A", "B", pool_max=2, retry_tick=1.0)
    raw.up(2, "b", "s")  # A's dial (connection 1) stays in flight
    raw.dialled()
    raw.submit("j")
    raw.tick(1.0)
    assert raw.dialled() == [(3, "B")]


def test_an_address_that_just_grew_does_not_stop_another_from_growing() -> None:
    raw = Raw("A", "B", pool_max=3, retry_tick=1.0, pool_grow_interval=10.0)
    raw.up(1, "a1", "s")  # B's dial (connection 2) stays in flight for now
    raw.dialled()
    raw.submit("j")
    raw.tick(1.0)
    assert raw.dialled() == [(3, "A")]
    raw.up(3, "a2", "s", now=2.0)
    assert raw.dialled() == []  # A grew at 1; B's dial is in flight
    raw.up(2, "b", "s", now=2.0)
    assert raw.dialled() == [(4, "B")]
    assert raw.core.next_deadline() == 11.0  # A may grow again 10 s after it grew


def test_growth_is_retimed_when_the_oldest_waiting_job_gets_its_slot() -> None:
    """The growth timer follows the oldest job still waiting: j (from 0) gets its slot at 2,
    so growth is due a retry tick after k (from 1), at 5, and not at 4. (With these times
    the armed timer's handle is 5 as well: comparing the handle, not the time, would keep
    the timer at 4.)"""
    raw = Raw("A", retry_tick=4.0, pool_max=2)
    raw.up(1, "a", "s")
    raw.dialled()
    raw.submit("j")
    raw.submit("k", now=1.0)
    assert raw.core.next_deadline() == 4.0
    raw.receive(1, p.Offer(job_id="j", token="t"), now=2.0)
    assert raw.core.next_deadline() == 5.0
    raw.tick(4.9)
    assert raw.dialled() == []
    raw.tick(5.0)
    assert raw.dialled() == [(2, "A")]
