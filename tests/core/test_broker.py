"""The broker core with explicit clocks: HELLO, idle, liveness, positions, limits."""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import re
from collections.abc import Callable
from typing import Any, get_args

import pytest

from tests.support.values import assert_keyword_only
from trio_broker.core import broker as broker_module
from trio_broker.core import protocol as p
from trio_broker.core.book import WantBook
from trio_broker.core.broker import (
    REFUSALS,
    AbortJob,
    Broker,
    BrokerConfig,
    BrokerUsageError,
    CloseConnection,
    Drained,
    StartJob,
    new_token,
)
from trio_broker.core.errors import ErrorCode
from trio_broker.core.pool import PoolConfig, SlotPool
from trio_broker.testing.machines import registered_broker
from trio_broker.testing.values import receipt as make_receipt


def broker_with(pool: PoolConfig, **settings: Any) -> Broker:
    """A broker at 100.0 with deterministic offer tokens and these BrokerConfig settings."""
    tokens = itertools.count()
    config = BrokerConfig(
        instance_id="inst",
        name="exec",
        pool=pool,
        token_factory=lambda: f"token-{next(tokens):016d}",
        **settings,
    )
    return Broker(config, now=100.0)


def make_broker(
    size: int = 2,
    *,
    services: dict[str, int] | None = None,
    now: float = 100.0,
    **pool: Any,
) -> Broker:
    """A broker whose services start unmeasured with the whole pool to share."""
    tokens = itertools.count()
    pool.setdefault("unknown_share", 1.0)
    config = BrokerConfig(
        instance_id="inst",
        name="exec",
        pool=PoolConfig(size=size, max_slots=services or {"s": 0}, **pool),
        token_factory=lambda: f"token-{next(tokens):016d}",
    )
    return Broker(config, now=now)


def receipt(status: p.Status = "ok", duration: float = 1.0, peak: int | None = None) -> p.Receipt:
    return make_receipt(status, duration=duration, peak_memory=peak)


class Harness:
    """A broker plus one registered connection per name, with frames sorted by connection."""

    def __init__(self, broker: Broker, *names: str, now: float = 100.0) -> None:
        self.broker = broker
        self.now = now
        self.conns: dict[str, int] = {}
        for name in names:
            self.open(name)
        self.frames()

    def open(self, name: str, register: bool = True) -> int:
        conn = self.broker.open_connection("127.0.0.1:7000", now=self.now)
        self.conns[name] = conn
        if register:
            self.send(name, p.Register(backend_id=name, name=name, version="1"))
        return conn

    def send(self, name: str, message: p.Message | str) -> None:
        if isinstance(message, str):
            self.broker.receive_text(self.conns[name], message, now=self.now)
        else:
            self.broker.receive(self.conns[name], message, now=self.now)

    def at(self, when: float) -> None:
        self.now = when
        self.broker.tick(now=when)

    def frames(self, name: str | None = None) -> list[p.Message]:
        frames = self.broker.frames_to_send()
        if name is None:
            return [m for _, m in frames]
        return [m for c, m in frames if c == self.conns[name]]

    def want(self, name: str, job_id: str, service: str = "s", priority: int = 0) -> p.Message:
        self.send(name, p.Want(job_id=job_id, service=service, priority=priority))
        (answer,) = [m for m in self.frames(name) if not isinstance(m, p.Hello)]
        return answer

    def start(self, name: str, job_id: str, service: str = "s") -> int:
        offer = self.want(name, job_id, service)
        assert isinstance(offer, p.Offer), offer
        self.send(
            name, p.Job(job_id=job_id, token=offer.token, service=service, subject=None, job={})
        )
        (start,) = [e for e in self.broker.effects() if isinstance(e, StartJob)]
        return start.run_id


# -- HELLO -------------------------------------------------------------------------


def test_first_hello_at_once_and_counts_clients() -> None:
    broker = make_broker()
    first = broker.open_connection("127.0.0.1:7000", now=100.0)
    (hello,) = [m for _, m in broker.frames_to_send()]
    assert isinstance(hello, p.Hello)
    assert (hello.clients, hello.idle, hello.processes, hello.addr) == (1, 0, 2, "127.0.0.1:7000")
    second = broker.open_connection("[::1]:7000", now=100.2)
    frames = broker.frames_to_send()
    # the newcomer hears at once; the first connection only at the end of its window
    assert [(c, m.clients) for c, m in frames if isinstance(m, p.Hello)] == [(second, 2)]
    assert broker.hello_for(second).addr == "[::1]:7000"
    assert broker.next_deadline() == pytest.approx(101.0)
    broker.tick(now=101.0)
    hellos = [(c, m) for c, m in broker.frames_to_send() if isinstance(m, p.Hello)]
    assert [(c, m.clients, m.idle) for c, m in hellos] == [(first, 2, 2)]
    # the newcomer's window was still open at that round: it hears at the next one
    assert broker.next_deadline() == pytest.approx(102.0)
    broker.tick(now=101.2)
    assert not [m for _, m in broker.frames_to_send() if isinstance(m, p.Hello)]
    broker.tick(now=102.0)
    hellos = [(c, m) for c, m in broker.frames_to_send() if isinstance(m, p.Hello)]
    assert [(c, m.clients, m.idle) for c, m in hellos] == [(second, 2, 2)]


def test_a_burst_of_arrivals_costs_each_open_connection_one_hello() -> None:
    """N open connections and K newcomers within one second: each open connection
    gets one HELLO for the whole burst (not one at once and one more a second
    later), each newcomer its first HELLO and one with the burst's count."""
    h = Harness(make_broker(), *(f"old{i}" for i in range(50)))
    h.at(101.0)
    h.frames()  # the first round: idle became 2
    h.at(103.0)  # quiet: every window is long closed
    for k in range(10):
        h.now = 103.05 + k * 0.09
        h.open(f"new{k}", register=False)
    h.at(104.0)
    h.at(105.0)
    names = {conn: name for name, conn in h.conns.items()}
    counted: dict[str, int] = dict.fromkeys(h.conns, 0)
    for conn, message in h.broker.frames_to_send():
        if isinstance(message, p.Hello):
            counted[names[conn]] += 1
    assert [counted[f"old{i}"] for i in range(50)] == [1] * 50
    # the last newcomer's first HELLO already had the burst's count
    assert [counted[f"new{k}"] for k in range(10)] == [2] * 9 + [1]


def test_a_change_costs_no_work_per_connection() -> None:
    """A change marks the broker changed and arms one round; it does not visit the
    open connections (here: a thousand arrivals within one second arm one timer)."""
    h = Harness(make_broker(), "a")
    h.at(101.0)
    h.frames()
    timers = len(h.broker._timers)
    for k in range(1000):
        h.now = 101.1 + k * 0.0005
        h.broker.open_connection("127.0.0.1:7000", now=h.now)
    # per newcomer: its two liveness timers; for the HELLO changes: one round
    assert len(h.broker._timers) - timers == 2 * 1000 + 1


def test_changes_inside_the_window_are_coalesced() -> None:
    """Several changes within one second give one HELLO with the latest content."""
    h = Harness(make_broker(), "a")
    for offset in (0.1, 0.2, 0.3):
        h.now = 100 + offset
        h.open(f"x{offset}", register=False)
    assert not [m for m in h.frames("a") if isinstance(m, p.Hello)]
    h.at(101.0)
    hellos = [m for m in h.frames("a") if isinstance(m, p.Hello)]
    assert [m.clients for m in hellos] == [4]


def test_a_change_that_reverts_inside_the_window_sends_nothing() -> None:
    h = Harness(make_broker(), "a")
    h.at(101.0)
    h.frames()  # idle became 2 after the first full second
    h.now = 101.2
    h.open("b", register=False)
    h.broker.close_connection(h.conns["b"], now=101.3)
    h.at(102.5)
    assert not [m for m in h.frames("a") if isinstance(m, p.Hello)]


def test_an_idle_execserver_sends_no_hello() -> None:
    h = Harness(make_broker(), "a")
    h.at(101.0)
    assert [m.idle for m in h.frames("a") if isinstance(m, p.Hello)] == [2]
    assert h.broker.next_deadline() is not None  # liveness only
    for second in range(102, 200):
        h.at(float(second))
        h.send("a", p.Pong(nonce="x"))
    assert not [m for m in h.frames("a") if isinstance(m, p.Hello)]


def test_draining_hello_goes_out_at_once() -> None:
    h = Harness(make_broker(), "a")
    h.now = 100.5
    h.open("b", register=False)  # a's next HELLO would wait until 101.0
    h.broker.drain(now=100.6)
    hellos = [m for m in h.frames("a") if isinstance(m, p.Hello)]
    assert len(hellos) == 1
    assert (hellos[0].draining, hellos[0].services, hellos[0].processes) == (True, {}, 0)


# -- idle ----------------------------------------------------------------------------


def test_idle_is_the_smallest_free_count_of_the_last_second_minus_the_reserve() -> None:
    h = Harness(make_broker(size=4, fast_reserve=1), "a")
    assert h.broker.idle() == 0  # until the first full second
    h.at(100.5)
    offer = h.want("a", "j1")  # an offered slot is not free
    assert isinstance(offer, p.Offer)
    h.send("a", p.Decline(token=offer.token))
    h.at(101.0)
    assert h.broker.idle() == 2  # min free 3 during [100, 101), minus the reserve
    h.at(102.0)
    assert h.broker.idle() == 3  # all 4 free through [101, 102)
    h.at(110.0)
    assert h.broker.idle() == 3


def test_idle_never_goes_below_zero() -> None:
    h = Harness(make_broker(size=2, fast_reserve=1), "a")
    h.start("a", "j1")
    h.start("a", "j2")
    h.at(103.0)
    assert h.broker.idle() == 0


# -- liveness ---------------------------------------------------------------------------


def test_ping_after_sending_nothing_for_the_interval() -> None:
    h = Harness(make_broker(), "a")
    h.at(101.0)  # the idle figure changes: a HELLO is the last frame sent
    h.frames()
    h.at(105.9)
    assert not [m for m in h.frames("a") if isinstance(m, p.Ping)]
    h.at(106.0)
    pings = [m for m in h.frames("a") if isinstance(m, p.Ping)]
    assert len(pings) == 1
    h.send("a", p.Ping(nonce="theirs"))
    assert h.frames("a") == [p.Pong(nonce="theirs")]


def test_silent_peer_is_closed_after_ping_timeout() -> None:
    h = Harness(make_broker(), "a", "b")
    offer = h.want("a", "j")
    assert isinstance(offer, p.Offer)
    h.at(110.0)
    h.send("b", "not even json")  # any frame is a sign of life
    h.at(115.0)
    effects = h.broker.effects()
    assert effects == [
        CloseConnection(conn=h.conns["a"], code=1001, reason="nothing received for 15s")
    ]
    assert h.conns["a"] not in h.broker.connections()
    assert h.broker.pool.busy == 0  # its offer was released
    h.at(125.0)
    assert [e for e in h.broker.effects() if isinstance(e, CloseConnection)] == [
        CloseConnection(conn=h.conns["b"], code=1001, reason="nothing received for 15s")
    ]


# -- offers, jobs, positions --------------------------------------------------------------


def test_tokens_are_url_safe_128_bit_values() -> None:
    broker = Broker(
        BrokerConfig(
            instance_id="i",
            name="n",
            pool=PoolConfig(size=64, max_slots={"s": 0}, unknown_share=1.0),
        ),
        now=0.0,
    )
    h = Harness(broker, "a", now=0.0)
    tokens = set()
    for n in range(64):
        offer = h.want("a", f"j{n}")
        assert isinstance(offer, p.Offer)
        assert len(offer.token) >= 22
        assert set(offer.token) <= set(
            "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
        )
        tokens.add(offer.token)
    assert len(tokens) == 64


def test_position_replays_the_grant_rule() -> None:
    """ahead counts higher priorities, then the dealing order of the rotation."""
    h = Harness(make_broker(size=1, unknown_share=1.0), "a", "b", "c")
    h.start("a", "running")
    for job_id in ("a1", "a2", "a3"):
        h.want("a", job_id)
    h.want("b", "b1")
    h.want("c", "c1")
    h.want("c", "c2")
    h.want("b", "urgent", priority=9)
    h.send("c", p.Query(job_id="c2"))
    (position,) = h.frames("c")
    # urgent; then dealing a1 b1 c1 a2 (b has no second) c2
    assert position == p.Position(job_id="c2", running=1, ahead=5, capacity=1, eta_s=None)
    h.send("a", p.Query(job_id="running"))
    assert h.frames("a") == [
        p.Position(job_id="running", running=1, ahead=0, capacity=1, eta_s=0.0)
    ]


def test_position_of_an_offered_job_is_at_the_front() -> None:
    h = Harness(make_broker(size=2, unknown_share=1.0), "a")
    h.start("a", "running")
    offer = h.want("a", "offered")
    assert isinstance(offer, p.Offer)
    h.send("a", p.Query(job_id="offered"))
    assert h.frames("a") == [
        p.Position(job_id="offered", running=2, ahead=0, capacity=2, eta_s=0.0)
    ]


def test_eta_uses_the_rolling_mean_runtime() -> None:
    h = Harness(make_broker(size=1, unknown_share=1.0, heavy_threshold=100.0), "a")
    run = h.start("a", "first")
    h.broker.job_ended(run, receipt(duration=30.0), now=h.now)
    h.frames()
    h.start("a", "second")
    for job_id in ("w1", "w2", "w3"):
        h.want("a", job_id)
    h.send("a", p.Query(job_id="w3"))
    (position,) = h.frames("a")
    assert isinstance(position, p.Position)
    assert (position.ahead, position.capacity, position.eta_s) == (2, 1, 90.0)


def test_done_carries_the_receipt_with_our_instance_id() -> None:
    h = Harness(make_broker(), "a")
    run = h.start("a", "j")
    h.broker.job_ended(run, receipt(status="failed"), now=h.now)
    (done,) = h.frames("a")
    assert isinstance(done, p.Done)
    assert (done.job_id, done.receipt.status, done.receipt.instance_id) == ("j", "failed", "inst")


def test_cancel_of_running_job_aborts_it_once() -> None:
    h = Harness(make_broker(), "a")
    run = h.start("a", "j")
    h.send("a", p.Cancel(job_id="j"))
    h.send("a", p.Cancel(job_id="j"))
    assert h.broker.effects() == [
        AbortJob(run_id=run, status="cancelled", reason="cancelled by the client")
    ]
    assert h.frames("a") == []


def test_unwant_of_unknown_ids_and_foreign_tokens_are_silent() -> None:
    h = Harness(make_broker(size=1), "a", "b")
    offer = h.want("a", "j")
    assert isinstance(offer, p.Offer)
    h.send("b", p.Unwant(job_id="j"))
    h.send("b", p.Decline(token=offer.token))
    assert h.frames() == []
    assert h.broker.pool.busy == 1  # a's offer is untouched


# -- the pool ---------------------------------------------------------------------------------


def test_classification_and_the_fast_reserve() -> None:
    """A measured heavy service never takes the last fast_reserve slots; light ones do."""
    broker = make_broker(
        size=3, fast_reserve=1, heavy_threshold=10.0, unknown_share=1.0,
        services={"video": 0, "meta": 0},
    )  # fmt: skip
    h = Harness(broker, "a")
    run = h.start("a", "warm-video", "video")
    broker.job_ended(run, receipt(duration=60.0), now=h.now)
    h.frames()
    run = h.start("a", "warm-meta", "meta")
    broker.job_ended(run, receipt(duration=0.2), now=h.now)
    h.frames()
    assert broker.pool.kind("video") == "heavy"
    assert broker.pool.kind("meta") == "light"
    assert isinstance(h.want("a", "v1", "video"), p.Offer)
    assert isinstance(h.want("a", "v2", "video"), p.Offer)
    assert isinstance(h.want("a", "v3", "video"), p.Queued)  # the last slot is reserved
    assert isinstance(h.want("a", "m1", "meta"), p.Offer)  # ... for light work


def test_unknown_services_share_a_part_of_the_pool() -> None:
    h = Harness(make_broker(size=4, unknown_share=0.5), "a")
    assert isinstance(h.want("a", "u1"), p.Offer)
    assert isinstance(h.want("a", "u2"), p.Offer)
    assert isinstance(h.want("a", "u3"), p.Queued)


def test_memory_budget_with_learned_footprints() -> None:
    broker = make_broker(size=4, unknown_share=1.0, memory_budget=1000)
    h = Harness(broker, "a")
    run = h.start("a", "measure")
    broker.job_ended(run, receipt(peak=400), now=h.now)
    h.frames()
    assert broker.pool.services["s"].footprint == 400
    assert isinstance(h.want("a", "m1"), p.Offer)
    assert isinstance(h.want("a", "m2"), p.Offer)
    assert isinstance(h.want("a", "m3"), p.Queued)  # 3 x 400 > 1000
    assert broker.pool.free == 2


def test_a_footprint_above_the_budget_still_runs_alone() -> None:
    pool = SlotPool(PoolConfig(size=2, memory_budget=100, unknown_share=1.0, max_slots={"s": 0}))
    pool.record("s", receipt(peak=500))
    assert pool.fits("s")
    reserved = pool.acquire("s")
    assert reserved == 500
    assert not pool.fits("s")


def test_max_slots_caps_a_service() -> None:
    h = Harness(make_broker(size=4, unknown_share=1.0, services={"ffmpeg": 2, "x": 0}), "a")
    assert isinstance(h.want("a", "f1", "ffmpeg"), p.Offer)
    assert isinstance(h.want("a", "f2", "ffmpeg"), p.Offer)
    assert isinstance(h.want("a", "f3", "ffmpeg"), p.Queued)
    assert isinstance(h.want("a", "x1", "x"), p.Offer)  # no head-of-line blocking


# -- draining --------------------------------------------------------------------------------


def test_drain_withdraws_offers_then_reports_drained_after_the_last_job() -> None:
    h = Harness(make_broker(size=2), "a")
    run = h.start("a", "running")
    offer = h.want("a", "offered")
    assert isinstance(offer, p.Offer)
    h.broker.drain(now=h.now)
    assert h.broker.pool.busy == 1
    assert h.broker.effects() == []
    h.send("a", p.Job(job_id="offered", token=offer.token, service="s", job={}))
    assert [m for m in h.frames("a") if isinstance(m, p.Error)][-1].code == "draining"
    h.broker.job_ended(run, receipt(), now=h.now)
    assert h.broker.effects() == [Drained()]
    assert h.broker.drained


def test_drain_timeout_and_stop() -> None:
    h = Harness(make_broker(size=2), "a")
    first = h.start("a", "first")
    h.broker.drain(now=h.now)
    for _ in range(6):  # keep the connection alive through the drain timeout
        h.at(h.now + 10.0)
        h.send("a", p.Pong(nonce="alive"))
    assert h.broker.effects() == [
        AbortJob(run_id=first, status="stopped", reason="drain_timeout of 60s expired")
    ]
    h.broker.stop(now=h.now)
    assert h.broker.effects() == []  # already being stopped: not twice


# -- errors and misuse -------------------------------------------------------------------------


def test_error_precedence_not_registered_before_draining() -> None:
    h = Harness(make_broker())
    h.open("a", register=False)
    h.broker.drain(now=h.now)
    h.frames()
    h.send("a", p.Want(job_id="j", service="s", priority=0))
    assert h.frames("a") == [
        p.Error(code="not_registered", message="send REGISTER before WANT", job_id="j")
    ]


# -- refusals: one ordered table --------------------------------------------------------------


def test_the_refusal_table_is_in_the_protocols_precedence_order() -> None:
    """REFUSALS lists the broker's codes in ErrorCode order (PROTOCOL.md section 8); the
    codec's own codes and the offer_expired notice are the only ones not in it."""
    codes = [row.code for row in REFUSALS]
    assert codes == [
        "unknown_type",
        "not_registered",
        "already_registered",
        "draining",
        "unknown_service",
        "duplicate_job",
        "unknown_token",
        "token_mismatch",
        "unknown_job",
        "too_many_wants",
    ]
    every: tuple[ErrorCode, ...] = get_args(ErrorCode)
    assert codes == [code for code in every if code in codes]
    assert set(every) - set(codes) == {"bad_frame", "bad_field", "offer_expired"}
    for row in REFUSALS:
        assert set(row.frames) <= set(p.MESSAGE_TYPES), row
    assert repr(REFUSALS[5]) == "Refusal(code='duplicate_job', frames=('WANT',))"


def refused(h: Harness, name: str, message: p.Message) -> list[ErrorCode]:
    """The codes of every row of REFUSALS ``message`` breaks on ``name``'s connection."""
    conn = h.broker._conns[h.conns[name]]
    return [
        row.code
        for row in REFUSALS
        if message.TYPE in row.frames and row.broken(h.broker, conn, message)
    ]


def want(job_id: str = "j", service: str = "s") -> p.Want:
    return p.Want(job_id=job_id, service=service, priority=0)


def job(job_id: str = "j", token: str = "bogus", service: str = "s") -> p.Job:
    return p.Job(job_id=job_id, token=token, service=service, subject=None, job={})


def token_of(h: Harness, name: str, job_id: str) -> str:
    """Park a want for ``job_id`` on a broker with a free slot; the token it is offered."""
    offer = h.want(name, job_id)
    assert isinstance(offer, p.Offer)
    return offer.token


def on_draining(h: Harness, message: p.Message) -> p.Message:
    h.broker.drain(now=h.now)
    return message


# Each row's frame on a broker with two free slots and a registered connection "a":
# what to set up, the frame, and the ERROR the broker sends.
ROW_CASES: dict[str, tuple[Callable[[Harness], p.Message], p.Error]] = {
    "unknown_type": (
        lambda h: p.Queued(job_id="j"),
        p.Error(code="unknown_type", message="type 'QUEUED' is not accepted here", job_id="j"),
    ),
    "not_registered": (
        lambda h: (h.open("b", register=False), p.Unwant(job_id="j"))[1],
        p.Error(code="not_registered", message="send REGISTER before UNWANT", job_id="j"),
    ),
    "already_registered": (
        lambda h: p.Register(backend_id="a", name="a", version="1"),
        p.Error(code="already_registered", message="this connection already registered"),
    ),
    "draining": (
        lambda h: on_draining(h, want()),
        p.Error(code="draining", message="this execserver is draining", job_id="j"),
    ),
    "unknown_service": (
        lambda h: want(service="nope"),
        p.Error(code="unknown_service", message="service 'nope' is not offered here", job_id="j"),
    ),
    "duplicate_job": (
        lambda h: (token_of(h, "a", "j"), want())[1],
        p.Error(code="duplicate_job", message="job_id 'j' is already live", job_id="j"),
    ),
    "unknown_token": (
        lambda h: job(),
        p.Error(
            code="unknown_token",
            message="the token is expired, used, or was never offered on this connection",
            job_id="j",
        ),
    ),
    "token_mismatch": (
        lambda h: job("k", token_of(h, "a", "j")),
        p.Error(
            code="token_mismatch",
            message="the token was offered for job 'j' of service 's'",
            job_id="k",
        ),
    ),
    "unknown_job": (
        lambda h: p.Query(job_id="j"),
        p.Error(code="unknown_job", message="job_id 'j' is not live", job_id="j"),
    ),
    "too_many_wants": (
        lambda h: at_cap(h, want()),
        p.Error(
            code="too_many_wants",
            message=(
                "this connection already has 10000 wants parked or offered "
                "(max_wants_per_connection); send it again once one is served or withdrawn"
            ),
            job_id="j",
        ),
    ),
}


def at_cap(h: Harness, message: p.Message) -> p.Message:
    """``message``, once a's connection has max_wants_per_connection wants parked."""
    for n in range(h.broker.config.max_wants_per_connection):
        h.send("a", want(f"fill-{n}"))
    return message


@pytest.mark.parametrize("row", REFUSALS, ids=lambda row: row.code)
def test_every_refusal_row_is_reachable_and_alone_answers(row: Any) -> None:
    """For each row a frame that breaks it and no other gets that row's ERROR, and
    nothing else happens: no effect, no other frame, the counters but errors_sent kept."""
    h = Harness(make_broker(), "a")
    setup, error = ROW_CASES[row.code]
    message = setup(h)
    name = "b" if "b" in h.conns else "a"
    h.frames()
    h.broker.effects()
    before = h.broker.statistics()
    assert refused(h, name, message) == [row.code]
    h.send(name, message)
    assert h.frames(name) == [error]
    assert h.broker.effects() == []
    after = h.broker.statistics()
    assert after.counters == {**before.counters, "errors_sent": before.counters["errors_sent"] + 1}
    assert (after.busy, after.connections) == (before.busy, before.connections)
    h.broker.check_invariants()


# A frame that breaks two rows (or more) is answered by the earliest; one that
# breaks a single row shows the rows before it do not count on each other.
PAIRS: list[tuple[str, Callable[[Harness], p.Message], list[ErrorCode]]] = [
    (
        "an unregistered connection's JOB while draining",
        lambda h: (h.open("b", register=False), on_draining(h, job()))[1],
        ["not_registered", "draining", "unknown_token"],
    ),
    (
        "an unregistered connection's QUERY of no job",
        lambda h: (h.open("b", register=False), p.Query(job_id="j"))[1],
        ["not_registered", "unknown_job"],
    ),
    (
        "a WANT of a service not offered while draining",
        lambda h: on_draining(h, want(service="nope")),
        ["draining", "unknown_service"],
    ),
    (
        "a WANT repeating a running job while draining",
        lambda h: (h.start("a", "j"), on_draining(h, want()))[1],
        ["draining", "duplicate_job"],
    ),
    (
        "a WANT repeating a live job under a service not offered",
        lambda h: (token_of(h, "a", "j"), want(service="nope"))[1],
        ["unknown_service", "duplicate_job"],
    ),
    (
        "a JOB of a service not offered with a made-up token",
        lambda h: job(service="nope"),
        ["unknown_service", "unknown_token"],
    ),
    (
        "a JOB of a service not offered with a token offered for another service",
        lambda h: job("j", token_of(h, "a", "j"), service="nope"),
        ["unknown_service", "token_mismatch"],
    ),
    (
        "a WANT repeating a live job on a connection at its cap",
        lambda h: at_cap(h, want("fill-7")),
        ["duplicate_job", "too_many_wants"],
    ),
    (
        "a WANT of a service not offered on a connection at its cap",
        lambda h: at_cap(h, want(service="nope")),
        ["unknown_service", "too_many_wants"],
    ),
    (
        "a JOB with another connection's token",
        lambda h: (h.open("c"), job("j", token_of(h, "c", "j")))[1],
        ["unknown_token"],
    ),
]


@pytest.mark.parametrize(
    ("setup", "broken"), [case[1:] for case in PAIRS], ids=[case[0] for case in PAIRS]
)
def test_a_frame_breaking_several_rows_gets_the_earliest_rows_code(
    setup: Callable[[Harness], p.Message], broken: list[ErrorCode]
) -> None:
    """The frame breaks each listed row (in table order), and the ERROR sent is the first's."""
    h = Harness(make_broker(), "a")
    message = setup(h)
    name = "b" if "b" in h.conns else "a"
    h.frames()
    assert refused(h, name, message) == broken
    h.send(name, message)
    (error,) = h.frames(name)
    assert isinstance(error, p.Error)
    assert error.code == broken[0]


def test_caller_misuse_raises() -> None:
    h = Harness(make_broker(), "a")
    with pytest.raises(BrokerUsageError, match="time went backwards"):
        h.broker.tick(now=h.now - 1)
    with pytest.raises(BrokerUsageError, match="run 99 is not running"):
        h.broker.job_ended(99, receipt(), now=h.now)


# -- the book ------------------------------------------------------------------------------------


def test_book_rotation_keeps_places_of_connections_passed_over() -> None:
    """A connection with nothing that fits keeps its place in the rotation."""
    book: WantBook[str] = WantBook()
    book.add("heavy-only", "h1", "heavy", 0)
    book.add("mixed", "l1", "light", 0)
    book.add("mixed", "l2", "light", 0)
    assert book.rotation(0) == ["heavy-only", "mixed"]
    picked = book.pick({"light"})
    assert picked is not None
    assert picked.job_id == "l1"
    assert book.rotation(0) == ["heavy-only", "mixed"]  # passed over, kept its place
    picked = book.pick({"light", "heavy"})
    assert picked is not None
    assert picked.job_id == "h1"
    book.check_invariants()


def test_book_no_head_of_line_blocking_within_a_connection() -> None:
    book: WantBook[str] = WantBook()
    book.add("c", "heavy-first", "heavy", 0)
    book.add("c", "light-second", "light", 0)
    picked = book.pick({"light"})
    assert picked is not None
    assert picked.job_id == "light-second"


def test_book_rotation_stamps_are_renumbered() -> None:
    """A connection passed over for ever does not let the bitsets grow without bound."""
    book: WantBook[int] = WantBook()
    book.add(99, "never-fits", "heavy", 0)
    for conn in range(10):
        book.add(conn, "blocked", "heavy", 0)
        for n in range(200):
            book.add(conn, f"l{n}", "light", 0)
    for _ in range(5000):
        picked = book.pick({"light"})
        assert picked is not None
        book.add(picked.conn, f"again-{picked.job_id}-{_}", "light", 0)
    level = book._levels[0]
    assert all(bits.bit_length() <= 4 * 11 + 1024 + 1 for bits in level.bits.values())
    assert book.rotation(0)[0] == 99  # passed over all along: it kept the head
    book.check_invariants()


def test_book_fifo_across_fitting_services_of_one_connection() -> None:
    """Among a connection's fitting wants the oldest wins, whatever its service."""
    book: WantBook[str] = WantBook()
    book.add("c", "first", "x", 0)
    book.add("c", "second", "y", 0)
    book.add("c", "third", "x", 0)
    order = []
    while (picked := book.pick({"x", "y"})) is not None:
        order.append(picked.job_id)
    assert order == ["first", "second", "third"]


def test_book_first_connection_in_rotation_across_services() -> None:
    """The rotation is one order for every service at a priority."""
    book: WantBook[str] = WantBook()
    book.add("early", "e1", "x", 0)
    book.add("late", "l1", "y", 0)
    book.add("early", "e2", "y", 0)
    picked = book.pick({"y"})
    assert picked is not None
    assert picked.job_id == "e2"  # early is ahead of late in the rotation
    picked = book.pick({"x", "y"})
    assert picked is not None
    assert picked.job_id == "l1"  # early moved to the tail


# -- the wait of each job ----------------------------------------------------------


def test_a_finished_job_tells_its_wait_from_want_to_job_and_its_client() -> None:
    """wait_s runs from the WANT to the JOB (slot wait + offer answer); client is REGISTER.name."""
    broker = make_broker(1)
    h = Harness(broker, "a", "b")
    first = h.start("a", "j1")
    h.at(102.0)
    assert isinstance(h.want("b", "j2"), p.Queued)  # the one slot is busy
    h.at(105.0)
    done = broker.job_ended(first, receipt(), now=105.0)
    assert (done.job_id, done.wait_s, done.client) == ("j1", 0.0, "a")
    (offer,) = [m for m in h.frames("b") if isinstance(m, p.Offer)]
    h.at(106.5)
    h.send("b", p.Job(job_id="j2", token=offer.token, service="s", subject=None, job={}))
    (start,) = [e for e in broker.effects() if isinstance(e, StartJob)]
    second = broker.job_ended(start.run_id, receipt(), now=107.0)
    assert (second.job_id, second.wait_s, second.client) == ("j2", 4.5, "b")
    assert broker.statistics().recent[-1] == second
    broker.check_invariants()


# -- fairness when a slot frees: the turn hold -------------------------------------


class TwoProducers:
    """A flood (A parks every job at once) and B with one job in flight, on one broker.

    An event simulation with an explicit clock: frames take ``latency`` seconds
    each way, every job lasts ``length`` seconds, a client answers an OFFER with
    JOB at once, and B parks its next WANT as soon as the DONE of the last one
    arrives. ``busy`` adds up each connection's slot time (StartJob to job end).
    """

    def __init__(self, *, turn_hold: float, slots: int = 4, flood: int = 2000) -> None:
        self.latency, self.length = 0.001, 1.0
        tokens = itertools.count()
        self.broker = Broker(
            BrokerConfig(
                instance_id="inst",
                name="exec",
                pool=PoolConfig(size=slots, unknown_share=1.0, max_slots={"s": 0}),
                token_factory=lambda: f"token-{next(tokens):016d}",
                ping_interval=1e9,
                ping_timeout=1e9,
                turn_hold=turn_hold,
            ),
            now=0.0,
        )
        self.a = self.broker.open_connection("127.0.0.1:7000", now=0.0)
        self.b = self.broker.open_connection("127.0.0.1:7000", now=0.0)
        for conn in (self.a, self.b):
            self.broker.receive(conn, p.Register(backend_id="x", name="x", version="1"), now=0.0)
        self.events: list[tuple[float, int, Any]] = []
        self.seq = itertools.count()
        self.busy = {self.a: 0.0, self.b: 0.0}
        self.started: dict[int, tuple[int, float]] = {}
        self.b_jobs = itertools.count()
        for n in range(flood):
            self.broker.receive(self.a, p.Want(job_id=f"a{n}", service="s", priority=0), now=0.0)
        self.b_want(0.0)
        self.flush(0.0)

    def later(self, when: float, action: Any) -> None:
        heapq.heappush(self.events, (when, next(self.seq), action))

    def b_want(self, now: float) -> None:
        want = p.Want(job_id=f"b{next(self.b_jobs)}", service="s", priority=0)
        self.broker.receive(self.b, want, now=now)

    def flush(self, now: float) -> None:
        """Deliver what the broker said: JOB answers, next WANTs, job ends."""
        for conn, message in self.broker.frames_to_send():
            if isinstance(message, p.Offer):
                job = p.Job(
                    job_id=message.job_id, token=message.token, service="s", subject=None, job={}
                )
                self.later(
                    now + 2 * self.latency,
                    functools.partial(self.broker.receive, conn, job),
                )
            elif isinstance(message, p.Done) and conn == self.b:
                self.later(now + 2 * self.latency, self.b_want)
        for effect in self.broker.effects():
            if isinstance(effect, StartJob):
                self.started[effect.run_id] = (effect.conn, now)
                self.later(now + self.length, functools.partial(self.end, effect.run_id))

    def end(self, run_id: int, *, now: float) -> None:
        conn, started = self.started.pop(run_id)
        self.busy[conn] += now - started
        self.broker.job_ended(run_id, receipt(duration=self.length), now=now)

    def run(self, until: float) -> float:
        """B's share of the slot time until ``until``."""
        while self.events and self.events[0][0] <= until:
            when, _, action = heapq.heappop(self.events)
            deadline = self.broker.next_deadline()
            while deadline is not None and deadline < when:
                self.broker.tick(now=deadline)
                self.flush(deadline)
                deadline = self.broker.next_deadline()
            action(now=when)
            self.flush(when)
            self.broker.check_invariants()
        return self.busy[self.b] / sum(self.busy.values())


def test_one_job_in_flight_gets_its_share_against_a_flood() -> None:
    """B, with one job in flight, gets >= 90 % of its ideal quarter of 4 slots against a flood.

    Equal job lengths make the slots free together; without the turn hold B's
    next WANT always arrives after the whole wave was offered to the flood.
    """
    share = TwoProducers(turn_hold=0.25).run(until=200.0)
    assert share >= 0.9 * 0.25, share


def test_without_the_turn_hold_one_job_in_flight_loses_every_other_wave() -> None:
    """The cause, measured: granting a freed slot at once leaves B an eighth."""
    share = TwoProducers(turn_hold=0.0).run(until=200.0)
    assert share < 0.14, share


# -- priority aging -------------------------------------------------------------------


def test_aging_lifts_one_band_per_interval_up_to_the_top_band() -> None:
    """A want rises by 2 (one band, the high variant kept) per interval, to 4 or 5 at most."""
    book: WantBook[str] = WantBook(aging=300.0)
    for job, priority in (("bg", -2), ("bg-high", -1), ("sync", 4), ("custom", 9)):
        book.add("c", job, "s", priority, now=0.0)
    assert book.age(299.0) == 0

    def now_at() -> dict[str, int]:
        return {w.job_id: w.priority for w in book.wants()}

    book.age(300.0)
    assert now_at() == {"bg": 0, "bg-high": 1, "sync": 4, "custom": 9}
    book.age(10_000.0)  # late: every promotion that fell due, in order
    assert now_at() == {"bg": 4, "bg-high": 5, "sync": 4, "custom": 9}
    assert {w.job_id: w.base for w in book.wants()}["bg"] == -2
    book.check_invariants()


def test_an_aged_want_queues_behind_its_connections_wants_already_there() -> None:
    """Entering a priority by aging counts as arriving there now (FIFO at that priority)."""
    book: WantBook[str] = WantBook(aging=10.0)
    book.add("c", "old-low", "s", 0, now=0.0)
    book.add("c", "new-high", "s", 2, now=5.0)
    book.age(10.0)
    assert [w.job_id for w in book.connection_wants("c")] == ["new-high", "old-low"]
    picked = book.pick({"s"})
    assert picked is not None
    assert picked.job_id == "new-high"


def test_without_aging_strict_priority_starves_a_low_want() -> None:
    """Aging is off by default: a background want waits while normal work keeps coming."""
    book: WantBook[str] = WantBook()
    book.add("low", "bg", "s", -2, now=0.0)
    for n in range(50):
        book.add("flood", f"f{n}", "s", 0, now=float(n))
        assert book.age(1e9) == 0
        picked = book.pick({"s"})
        assert picked is not None
        assert picked.job_id == f"f{n}"


def test_aging_reaches_a_slot_and_shows_in_the_position() -> None:
    """A background want climbs to the top band and shares it with a synchronous flood.

    Without aging it would wait behind every synchronous want; POSITION follows.
    """
    tokens = itertools.count()
    broker = Broker(
        BrokerConfig(
            instance_id="inst",
            name="exec",
            pool=PoolConfig(size=1, unknown_share=1.0, max_slots={"s": 0}, priority_aging=60.0),
            token_factory=lambda: f"token-{next(tokens):016d}",
            ping_interval=1e6,
            ping_timeout=2e6,
        ),
        now=100.0,
    )
    h = Harness(broker, "flood", "low")
    running = h.start("flood", "f0")
    for n in range(1, 4):
        assert isinstance(h.want("flood", f"f{n}", priority=4), p.Queued)
    assert isinstance(h.want("low", "bg", priority=-2), p.Queued)

    def ahead() -> int:
        h.send("low", p.Query(job_id="bg"))
        (position,) = [m for m in h.frames("low") if isinstance(m, p.Position)]
        return position.ahead

    assert ahead() == 3  # every synchronous want goes first
    h.at(100.0 + 179.0)
    assert ahead() == 3  # at 2 after two intervals: still below
    h.at(100.0 + 180.0)  # three intervals: -2 -> 0 -> 2 -> 4, the top band
    assert ahead() == 1  # round-robin there: the flood's next want, then this one
    offered = []
    for _ in range(2):
        broker.job_ended(running, receipt(), now=h.now)
        (offer,) = [(c, m) for c, m in broker.frames_to_send() if isinstance(m, p.Offer)]
        offered.append(offer[1].job_id)
        h.send(
            "flood" if offer[0] == h.conns["flood"] else "low",
            p.Job(job_id=offer[1].job_id, token=offer[1].token, service="s", subject=None, job={}),
        )
        (start,) = [e for e in broker.effects() if isinstance(e, StartJob)]
        running = start.run_id
    assert offered == ["f1", "bg"]
    broker.check_invariants()


def test_priority_aging_must_be_positive() -> None:
    with pytest.raises(ValueError, match="priority_aging must be positive"):
        PoolConfig(size=1, priority_aging=0.0)
    with pytest.raises(ValueError, match="aging must be positive"):
        WantBook(aging=-1.0)


def test_book_fallback_skips_wants_removed_behind_a_service_head() -> None:
    """The oldest fitting want is found past removed ones at the front of a service's queue."""
    book: WantBook[str] = WantBook()
    book.add("c", "h", "heavy", 0)  # the connection's oldest want; it will not fit
    for job in ("l1", "l2", "l3"):
        book.add("c", job, "light", 0)
    book.remove("c", "l2")  # removed in the middle of the light queue...
    book.remove("c", "l1")  # ...which is its front now
    picked = book.pick({"light"})
    assert picked is not None
    assert picked.job_id == "l3"
    book.check_invariants()


def test_a_redeemed_or_declined_offer_leaves_no_timer_behind() -> None:
    """Once an offer is redeemed or declined its expiry timer is disarmed: the driver is not
    woken at the time it would have expired (stale timers cost CPU after a burst)."""
    h = Harness(
        broker_with(PoolConfig(size=2, max_slots={"s": 0}, unknown_share=1.0), offer_ttl=6.5), "a"
    )
    h.start("a", "j1")  # offered and redeemed at 100: it would expire at 106.5
    declined = h.want("a", "j2")
    assert isinstance(declined, p.Offer)
    h.send("a", p.Decline(token=declined.token))
    deadlines = []
    while (due := h.broker.next_deadline()) is not None and due < 110.0:
        deadlines.append(due)
        h.at(due)
    assert 106.5 not in deadlines
    assert deadlines  # the liveness and figure timers still run


# -- configuration ----------------------------------------------------------------------


def config_with(**values: Any) -> BrokerConfig:
    return BrokerConfig(instance_id="inst", name="exec", pool=PoolConfig(size=1), **values)


def test_config_defaults_are_the_documented_ones() -> None:
    config = config_with()
    assert (config.offer_ttl, config.ping_interval, config.ping_timeout) == (10.0, 5.0, 15.0)
    assert (config.drain_timeout, config.turn_hold, config.recent_receipts) == (60.0, 0.05, 100)
    assert config.token_factory is new_token


@pytest.mark.parametrize("name", ["offer_ttl", "ping_interval", "ping_timeout"])
def test_config_durations_must_be_positive(name: str) -> None:
    assert getattr(config_with(**{name: 0.5}), name) == 0.5
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=f"{name} must be positive, got {bad}"):
            config_with(**{name: bad})


@pytest.mark.parametrize("name", ["drain_timeout", "turn_hold"])
def test_config_waits_may_be_zero_but_not_negative(name: str) -> None:
    assert getattr(config_with(**{name: 0.0}), name) == 0.0
    for bad in (-0.001, math.nan):
        with pytest.raises(ValueError, match=f"{name} must be >= 0"):
            config_with(**{name: bad})


def test_offer_tokens_carry_128_random_bits() -> None:
    tokens = {new_token() for _ in range(200)}
    assert len(tokens) == 200
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{22}", token) for token in tokens)


def test_value_classes_are_keyword_only() -> None:
    assert_keyword_only(broker_module)


def test_statistics_keep_the_last_recent_receipts() -> None:
    h = Harness(
        broker_with(PoolConfig(size=1, max_slots={"s": 0}, unknown_share=1.0), recent_receipts=2),
        "a",
    )
    for job in ("j1", "j2", "j3"):
        h.broker.job_ended(h.start("a", job), receipt(), now=h.now)
        h.frames()
    assert [f.job_id for f in h.broker.statistics().recent] == ["j2", "j3"]


# -- statistics and counters -----------------------------------------------------------


def test_counters_start_at_zero_and_count_each_event_once() -> None:
    broker = make_broker(size=2)
    assert set(broker.statistics().counters.values()) == {0}
    h = Harness(broker, "a", "b")
    run = h.start("a", "j1")
    declined = h.want("b", "j2")
    assert isinstance(declined, p.Offer)
    h.send("b", p.Decline(token=declined.token))
    unwanted = h.want("b", "j4")
    assert isinstance(unwanted, p.Offer)
    h.send("b", p.Unwant(job_id="j4"))  # releasing an offer declines it
    expiring = h.want("b", "j5")
    assert isinstance(expiring, p.Offer)
    h.at(h.now + 10.0)  # the default offer_ttl: it expires, with an error frame
    assert [m.code for m in h.frames("b") if isinstance(m, p.Error)] == ["offer_expired"]
    broker.job_ended(run, receipt(), now=h.now)
    h.frames()
    assert broker.statistics().counters["wants"] == 4
    withdrawn = h.want("a", "j3")
    assert isinstance(withdrawn, p.Offer)
    broker.drain(now=h.now)
    broker.close_connection(h.conns["b"], now=h.now)
    counters = broker.statistics().counters
    assert counters["connections_opened"] == 2
    assert counters["connections_closed"] == 1
    assert (counters["offers"], counters["offers_redeemed"]) == (5, 1)
    assert (counters["offers_declined"], counters["offers_withdrawn"]) == (2, 1)
    assert (counters["offers_expired"], counters["errors_sent"]) == (1, 1)
    assert (counters["jobs_started"], counters["jobs_ended"]) == (1, 1)
    assert counters["wants"] == 5


def test_drained_only_once_draining_and_no_job_runs() -> None:
    h = Harness(make_broker(size=2), "a")
    assert not h.broker.drained  # nothing runs, but no drain was asked
    run = h.start("a", "j1")
    h.broker.drain(now=h.now)
    assert not h.broker.drained  # draining, one job still runs
    h.broker.job_ended(run, receipt(), now=h.now)
    assert h.broker.drained


def test_a_draining_execserver_is_never_idle() -> None:
    h = Harness(make_broker(size=3), "a")
    h.at(101.0)
    assert h.broker.idle() == 3
    h.broker.drain(now=101.5)
    assert h.broker.idle() == 0
    assert h.broker.statistics().idle == 0
    h.at(103.0)
    assert h.broker.idle() == 0


def test_service_statistics_split_busy_slots_into_running_offered_and_held() -> None:
    h = Harness(
        broker_with(
            PoolConfig(size=3, max_slots={"s": 0, "t": 0}, unknown_share=1.0), turn_hold=5.0
        ),
        "a",
        "b",
    )
    a1 = h.start("a", "a1")
    b1 = h.start("b", "b1")
    h.want("a", "t1", service="t")  # offered, not redeemed: the pool is full now
    for job in ("a2", "a3"):
        h.send("a", p.Want(job_id=job, service="s", priority=0))  # parked
    h.frames()

    def row(name: str) -> tuple[int, int, int]:
        (snap,) = [s for s in h.broker.statistics().services if s.name == name]
        return snap.running, snap.offered, snap.parked

    assert (row("s"), row("t")) == ((2, 0, 2), (0, 1, 0))
    h.broker.job_ended(a1, receipt(), now=h.now)  # a's slot goes to a's next want
    assert [m.job_id for m in h.frames() if isinstance(m, p.Offer)] == ["a2"]
    assert (row("s"), row("t")) == ((1, 1, 1), (0, 1, 0))
    # b is owed the next turn now: the slot its job frees is held for it, busy
    # but neither running nor offered
    h.broker.job_ended(b1, receipt(), now=h.now)
    assert not [m for m in h.frames() if isinstance(m, p.Offer)]
    assert h.broker.statistics().busy == 3
    assert (row("s"), row("t")) == ((0, 1, 1), (0, 1, 0))


def held_for_b(turn_hold: float = 5.0, b_jobs: int = 1) -> tuple[Harness, list[int]]:
    """a floods one service at priority 0 and was served there after b's jobs started;
    b's jobs run (returned) and b has no want parked: b is owed the next turn."""
    h = Harness(
        broker_with(
            PoolConfig(size=1 + b_jobs, max_slots={"s": 0}, unknown_share=1.0), turn_hold=turn_hold
        ),
        "a",
        "b",
    )
    a1 = h.start("a", "a1")
    b_runs = [h.start("b", f"b{n}") for n in range(1, b_jobs + 1)]
    for job in ("a2", "a3", "a4"):
        h.send("a", p.Want(job_id=job, service="s", priority=0))
    h.broker.job_ended(a1, receipt(), now=h.now)
    assert [m.job_id for m in h.frames() if isinstance(m, p.Offer)] == ["a2"]
    return h, b_runs


def offered(h: Harness) -> list[str]:
    return [m.job_id for m in h.frames() if isinstance(m, p.Offer)]


def test_a_held_slot_goes_to_its_connection_only_at_the_held_priority_or_above() -> None:
    h, (b1,) = held_for_b()
    h.broker.job_ended(b1, receipt(), now=h.now)
    assert offered(h) == []  # held for b
    # b comes back below the held priority: the hold ends and the rule decides
    h.send("b", p.Want(job_id="low", service="s", priority=-1))
    assert offered(h) == ["a3"]
    h.broker.check_invariants()


def test_a_connection_holds_one_slot_at_most() -> None:
    h, (b1, b2) = held_for_b(b_jobs=2)
    h.broker.job_ended(b1, receipt(), now=h.now)
    assert offered(h) == []  # held for b
    h.broker.job_ended(b2, receipt(), now=h.now)
    assert offered(h) == ["a3"]  # b holds one already: this one is dealt
    h.broker.check_invariants()


def test_a_zero_turn_hold_holds_nothing() -> None:
    h, (b1,) = held_for_b(turn_hold=0.0)
    h.broker.job_ended(b1, receipt(), now=h.now)
    assert offered(h) == ["a3"]  # at once, without waiting for a tick


def test_no_hold_while_a_want_waits_above_its_priority() -> None:
    h, (b1,) = held_for_b()
    h.send("a", p.Want(job_id="urgent", service="s", priority=2))  # parked: no slot
    assert offered(h) == []
    h.broker.job_ended(b1, receipt(), now=h.now)
    assert offered(h) == ["urgent"]


def test_a_want_parked_above_a_hold_ends_it() -> None:
    h, (b1,) = held_for_b()
    h.broker.job_ended(b1, receipt(), now=h.now)
    assert offered(h) == []  # held for b
    h.send("a", p.Want(job_id="urgent", service="s", priority=2))
    assert offered(h) == ["urgent"]
    h.broker.check_invariants()


def test_an_idle_change_wakes_the_driver_at_the_end_of_its_second() -> None:
    """Followed only through next_deadline(), the new idle figure goes out within the
    second after it settles, not with the next ping."""
    h = Harness(make_broker(size=2), "a")
    h.frames()
    told: list[tuple[float, int]] = []
    while (due := h.broker.next_deadline()) is not None and due < 104.0:
        h.at(due)
        told += [(due, m.idle) for m in h.frames("a") if isinstance(m, p.Hello)]
    assert told[:1] == [(101.0, 2)]


def test_a_hold_ends_when_its_time_is_up() -> None:
    h, (b1,) = held_for_b(turn_hold=5.0)
    h.broker.job_ended(b1, receipt(), now=h.now)
    ends = h.now + 5.0
    while (due := h.broker.next_deadline()) is not None and due < ends:
        h.at(due)
        h.send("a", p.Pong(nonce="x"))
        h.send("b", p.Pong(nonce="x"))
    assert offered(h) == []
    h.at(ends)
    assert offered(h) == ["a3"]


def test_every_window_sends_its_changes() -> None:
    """The HELLO timer fires once per window and is armed again by the next change."""
    h = Harness(make_broker(), "a")
    h.frames()
    told: list[tuple[float, int]] = []
    for second in (100, 101, 102):
        h.now = second + 0.3
        h.open(f"x{second}", register=False)  # one more client, inside each window
        while (due := h.broker.next_deadline()) is not None and due <= second + 1.0:
            h.at(due)
        told += [(h.now, m.clients) for m in h.frames("a") if isinstance(m, p.Hello)]
    assert [clients for _, clients in told] == [2, 3, 4]


def test_each_idle_change_wakes_the_driver_in_its_second() -> None:
    """Not only the first: after the per-second timer fired once it is armed again."""
    h = Harness(make_broker(size=2), "a")
    h.frames()
    told: list[tuple[float, int]] = []
    while (due := h.broker.next_deadline()) is not None and due < 101.5:
        h.at(due)
        told += [(due, m.idle) for m in h.frames("a") if isinstance(m, p.Hello)]
    h.now = 101.5
    h.start("a", "j1")  # one slot busy from 101.5: the second ending at 102 saw 1 free
    h.frames()
    while (due := h.broker.next_deadline()) is not None and due < 104.5:
        h.at(due)
        told += [(due, m.idle) for m in h.frames("a") if isinstance(m, p.Hello)]
    assert told == [(101.0, 2), (102.0, 1)]


def test_a_quiet_execserver_asks_for_no_wake_but_liveness() -> None:
    """Once the idle figure is settled and nothing changes, the per-second timer is off:
    the next deadline is liveness, with or without a fast reserve, full or free."""
    for size, reserve, busy in ((2, 0, 0), (3, 1, 0), (2, 1, 2)):
        h = Harness(make_broker(size=size, fast_reserve=reserve), "a")
        for n in range(busy):
            h.start("a", f"j{n}")
        h.at(101.0)
        h.frames()
        h.at(102.0)  # the figure settled in the second before
        h.frames()
        sent = h.broker.statistics().idle
        assert sent == max(0, size - busy - reserve)
        due = h.broker.next_deadline()
        assert due is not None
        assert due >= 105.0, (size, reserve, busy)  # a ping's, not the second's (103)


def follow(h: Harness, until: float, told: list[tuple[float, int]]) -> None:
    """Advance through the broker's own deadlines only (connection "a" answers each
    ping), noting the idle figure of every HELLO "a" is sent."""
    while (due := h.broker.next_deadline()) is not None and due < until:
        h.at(due)
        h.send("a", p.Pong(nonce="x"))
        told.extend((due, m.idle) for m in h.frames("a") if isinstance(m, p.Hello))


def test_a_job_inside_one_second_lowers_that_seconds_idle_only() -> None:
    """The figure is the smallest free count of the second: a job that starts and ends
    inside one second shows for that second, and the next second is free again."""
    h = Harness(make_broker(size=2), "a")
    h.frames()
    told: list[tuple[float, int]] = []

    follow(h, 101.2, told)
    h.now = 101.3
    run = h.start("a", "j1")
    h.now = 101.6
    h.broker.job_ended(run, receipt(), now=h.now)
    h.frames()
    follow(h, 104.5, told)
    assert told == [(101.0, 2), (102.0, 1), (103.0, 2)]


def test_idle_after_one_second_with_every_slot_busy_is_zero() -> None:
    h = Harness(make_broker(size=2, fast_reserve=1), "a")
    h.start("a", "j1")
    h.start("a", "j2")
    h.at(101.0)
    assert h.broker.idle() == 0


@pytest.mark.parametrize("later", [102.0, 105.0])
def test_after_quiet_seconds_idle_is_the_free_count_not_the_last_busy_second(
    later: float,
) -> None:
    h = Harness(make_broker(size=2), "a")
    h.now = 100.3
    h.broker.job_ended(h.start("a", "j1"), receipt(), now=100.6)
    h.at(later)  # one or more quiet seconds: the last one saw both slots free
    assert h.broker.idle() == 2


def test_a_job_across_a_second_boundary_shows_in_both_seconds() -> None:
    """The slot frees inside a second that started busy: that second still counts it
    busy, and the driver is woken to tell the free one after it."""
    h = Harness(make_broker(size=2), "a")
    h.broker.job_ended(h.start("a", "j0"), receipt(), now=100.0)  # the service is measured
    h.frames()
    told: list[tuple[float, int]] = []

    follow(h, 101.2, told)
    h.now = 101.3
    run = h.start("a", "j1")
    h.frames()
    follow(h, 102.3, told)
    h.now = 102.3
    h.broker.job_ended(run, receipt(), now=h.now)
    h.frames()
    follow(h, 104.5, told)
    # busy for part of every second from 100 to 103: idle 1 until the second to 104
    assert told == [(101.0, 1), (104.0, 2)]


def test_a_draining_execserver_asks_for_no_per_second_wake() -> None:
    h = Harness(make_broker(size=2), "a")
    run = h.start("a", "j1")
    h.at(101.0)
    h.at(102.0)
    h.frames()
    h.broker.drain(now=102.5)
    h.broker.job_ended(run, receipt(), now=102.7)
    due = h.broker.next_deadline()
    assert due is not None
    assert due >= 105.0  # liveness or the drain, never the end of the second (103)


def test_connection_ids_never_issued_are_usage_errors_closed_ones_are_ignored() -> None:
    h = Harness(make_broker(), "a", "b")
    first, last = h.conns["a"], h.conns["b"]
    assert (first, last) == (1, 2)
    for never in (0, last + 1):
        with pytest.raises(BrokerUsageError, match=f"connection {never} was never opened"):
            h.broker.receive(never, p.Unwant(job_id="x"), now=h.now)
        with pytest.raises(BrokerUsageError, match="was never opened"):
            h.broker.receive_text(never, "not json", now=h.now)
        with pytest.raises(BrokerUsageError, match="was never opened"):
            h.broker.close_connection(never, now=h.now)
    for closed in (first, last):  # both ends of the issued range
        h.broker.close_connection(closed, now=h.now)
        h.broker.receive(closed, p.Unwant(job_id="x"), now=h.now)
        h.broker.receive_text(closed, "not json", now=h.now)
        h.broker.close_connection(closed, now=h.now)
    assert h.frames() == []


def _aging_holds() -> tuple[Broker, int, int, Callable[[float], list[tuple[int, str]]]]:
    """X was offered a slot at 0, then Y twice, and Y keeps a want parked there; X keeps
    a want at -2, parked at 0.0, which aging lifts to 0 at 1.0 (one band per second)."""
    pool = PoolConfig(size=2, unknown_share=1.0, max_slots={"s": 0}, priority_aging=1.0)
    broker, (x, y) = registered_broker("aging-holds", pool, 2, turn_hold=0.5)

    def offers(now: float) -> list[tuple[int, str]]:
        del now
        return [(c, m.job_id) for c, m in broker.frames_to_send() if isinstance(m, p.Offer)]

    def start(conn: int, job_id: str, now: float) -> int:
        token = next(m.token for c, m in broker.frames_to_send() if isinstance(m, p.Offer))
        broker.receive(
            conn, p.Job(job_id=job_id, token=token, service="s", subject=None, job={}), now=now
        )
        (effect,) = [e for e in broker.effects() if isinstance(e, StartJob)]
        return effect.run_id

    broker.receive(x, p.Want(job_id="x1", service="s", priority=0), now=0.0)
    x1 = start(x, "x1", 0.0)
    broker.receive(y, p.Want(job_id="y0", service="s", priority=0), now=0.0)
    y0 = start(y, "y0", 0.0)
    for job in ("y1", "y2"):
        broker.receive(y, p.Want(job_id=job, service="s", priority=0), now=0.0)
    broker.receive(x, p.Want(job_id="x2", service="s", priority=-2), now=0.0)
    broker.frames_to_send()
    broker.job_ended(y0, receipt(), now=0.0)  # y1 takes the slot: Y served after X
    start(y, "y1", 0.0)
    broker.job_ended(x1, receipt(), now=0.9)  # X is owed the turn: the slot is held for it
    assert offers(0.9) == []
    return broker, x, y, offers


def test_a_lift_of_the_holders_own_want_to_the_held_priority_ends_the_hold() -> None:
    """At 1.0 X's want x2 reaches priority 0 by aging, before X's next WANT (x3, at 0)
    arrives in the same input: the hold ends first and the rule gives the slot to Y,
    the first of the rotation; X's x3 waits behind its own older x2 (FIFO)."""
    broker, x, y, offers = _aging_holds()
    broker.receive(x, p.Want(job_id="x3", service="s", priority=0), now=1.0)
    assert offers(1.0) == [(y, "y2")]
    assert [w.job_id for w in broker.book.connection_wants(x)] == ["x2", "x3"]
    broker.check_invariants()


def test_a_hold_is_taken_by_the_holders_want_while_no_lift_reached_it() -> None:
    """The same a moment before the lift (0.95): X's x3 takes the held slot at once."""
    broker, x, _, offers = _aging_holds()
    broker.receive(x, p.Want(job_id="x3", service="s", priority=0), now=0.95)
    assert offers(0.95) == [(x, "x3")]
    broker.check_invariants()


# -- limits: what one peer can make the broker keep -----------------------------------------------


def test_wants_beyond_the_cap_are_refused_per_connection_and_change_nothing() -> None:
    """max_wants_per_connection counts a connection's parked and offered wants; one more
    WANT gets too_many_wants and is not parked; a withdrawn want makes room again;
    another connection has its own count."""
    h = Harness(broker_with(PoolConfig(size=1, max_slots={"s": 0}), max_wants_per_connection=3))
    h.open("a")
    h.open("b")
    h.frames()
    assert isinstance(h.want("a", "j0"), p.Offer)  # offered: counts
    assert isinstance(h.want("a", "j1"), p.Queued)
    assert isinstance(h.want("a", "j2"), p.Queued)
    refused_want = h.want("a", "j3")
    assert isinstance(refused_want, p.Error)
    assert (refused_want.code, refused_want.job_id) == ("too_many_wants", "j3")
    assert (h.conns["a"], "j3") not in h.broker.book
    assert isinstance(h.want("b", "k0"), p.Queued)  # b's own count
    h.send("a", p.Unwant(job_id="j1"))
    assert isinstance(h.want("a", "j3"), p.Queued)
    h.broker.check_invariants()


def test_max_wants_per_connection_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_wants_per_connection must be at least 1, got 0"):
        broker_with(PoolConfig(size=1, max_slots={"s": 0}), max_wants_per_connection=0)
    assert (
        BrokerConfig(
            instance_id="i", name="n", pool=PoolConfig(size=1, max_slots={})
        ).max_wants_per_connection
        == 10_000
    )


def test_a_long_subject_is_kept_cut_and_the_job_runs() -> None:
    """A JOB.subject of 300 kB starts its job; the broker keeps (StartJob, statistics,
    the finished record) its first MAX_SUBJECT_CHARS - 1 characters and an ellipsis."""
    h = Harness(make_broker(), "a")
    offer = h.want("a", "j")
    assert isinstance(offer, p.Offer)
    subject = "x" * 300_000
    h.send("a", p.Job(job_id="j", token=offer.token, service="s", subject=subject, job={}))
    (start,) = [e for e in h.broker.effects() if isinstance(e, StartJob)]
    assert start.subject == "x" * (p.MAX_SUBJECT_CHARS - 1) + "…"
    finished = h.broker.job_ended(start.run_id, receipt(), now=h.now)
    assert finished.subject == start.subject
    assert [r.subject for r in h.broker.statistics().recent] == [start.subject]
    short = "y" * p.MAX_SUBJECT_CHARS
    assert p.clip_subject(short) == short
    assert p.clip_subject(None) is None


# -- liveness after a stall ------------------------------------------------------------------


def test_a_stall_is_not_the_peers_silence() -> None:
    """A tick long after its due deadline (the process was stopped) does not close a
    connection whose silence is the stall: the peer's waiting frames are read first."""
    h = Harness(
        broker_with(PoolConfig(size=1, max_slots={"s": 0}), ping_interval=1.0, ping_timeout=3.0)
    )
    h.open("a")
    h.frames()
    due = h.broker.next_deadline()
    assert due == pytest.approx(101.0)  # a's ping
    h.now = 110.0  # stopped from 100 to 110: nothing ran, a's PINGs wait in the socket
    h.broker.tick(now=h.now, due=due)
    assert not [e for e in h.broker.effects() if isinstance(e, CloseConnection)]
    h.send("a", p.Ping(nonce="sent during the stop"))  # the reader gets to it
    assert isinstance(h.frames("a")[-1], p.Pong)
    h.broker.check_invariants()


def test_after_a_stall_a_silent_peer_is_closed_by_listening_time() -> None:
    """Silence before and after the stall counts; the stall does not. A peer last heard
    at 100 with a stall from 101 to 110 is closed at 112 (3 s of listening), not at 103."""
    h = Harness(
        broker_with(PoolConfig(size=1, max_slots={"s": 0}), ping_interval=1.0, ping_timeout=3.0)
    )
    h.open("a")
    h.frames()
    h.now = 110.0
    h.broker.tick(now=h.now, due=101.0)
    closes: list[float] = []
    while not closes:
        deadline = h.broker.next_deadline()
        assert deadline is not None
        assert deadline < 200
        h.at(deadline)
        if [e for e in h.broker.effects() if isinstance(e, CloseConnection)]:
            closes.append(deadline)
    assert closes == [pytest.approx(112.0)]


def test_a_late_tick_of_less_than_a_second_is_no_stall() -> None:
    """Ticks that come a little late (a busy loop) are no stall: the rule is the same."""
    h = Harness(
        broker_with(PoolConfig(size=1, max_slots={"s": 0}), ping_interval=1.0, ping_timeout=3.0)
    )
    h.open("a")
    h.frames()
    h.now = 103.5
    h.broker.tick(now=h.now, due=103.49)  # 0.01 s late: not a stall
    assert [e.reason for e in h.broker.effects() if isinstance(e, CloseConnection)] == [
        "nothing received for 3s"
    ]
