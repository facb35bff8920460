"""Defects the fleet simulator found, each kept as a test once fixed.

Each is kept twice: the simulator's shrunk trace (``traces/*.json``, replayed
exactly) and the same thing said directly to the core it lives in. A defect not
fixed yet is a strict expected failure (it fails the run as XPASS once fixed,
and is then made a plain test), and :data:`KNOWN_DEFECTS` tells the other
simulator tests how its violations look, so that they look for others. None is
open now.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trio_broker.core import protocol as p
from trio_broker.core.broker import Broker, StartJob
from trio_broker.core.client import ClientConfig, ClientCore, Dial
from trio_broker.core.pool import PoolConfig
from trio_broker.testing.machines import registered_broker
from trio_broker.testing.sim.library import SCENARIOS
from trio_broker.testing.sim.model import Violation
from trio_broker.testing.sim.run import replay, simulate
from trio_broker.testing.sim.trace import Trace
from trio_broker.testing.values import receipt

TRACES = Path(__file__).parent / "traces"

KNOWN_DEFECTS: dict[str, Callable[[Violation], bool]] = {}
"""Each known defect not fixed yet, and how its violations look (none now)."""


def known(violation: Violation) -> bool:
    """Whether a violation is one of the known defects."""
    return any(matches(violation) for matches in KNOWN_DEFECTS.values())


def trace(name: str) -> Trace:
    return Trace.from_json((TRACES / f"{name}.json").read_text(encoding="utf-8"))


# -- two fylrs on a mixed fleet (fixed) -------------------------------------------------------
#
# Two clients behind one balancer whose first pod offers only image_metadata: one client's
# pool was marked covered with one of the two pods (the other client's dial took the other
# pod), its preview steps failed unknown_service at every claim and failed for good after
# unknown_service_attempts claims, long before the re-probe. The pool keeps looking while a
# job waits for a service no connection announced (a covered address backs off instead of
# stopping), and only a search of a whole pool_reprobe_interval makes the service "not
# offered" (core/client.py, core/_client_pool.py); the fylr follows that verdict.


def test_two_fylrs_on_a_mixed_fleet_do_every_step_shrunk_trace() -> None:
    """One preview step, two fylrs behind a balancer whose first pod lacks preview: the
    step is done (the shrunk trace of seed 0 of mixed-fleet-2)."""
    result = replay(trace("mixed-fleet-2"))
    assert result.violations == ()


def test_two_fylrs_on_a_mixed_fleet_do_every_step_seed_0() -> None:
    """Seed 0 of the shipped mixed-fleet-2 scenario keeps every check (it found the defect)."""
    result = simulate(SCENARIOS["mixed-fleet-2"](), 0, record=False)
    assert result.violations == ()


# -- the turn hold (fixed) ------------------------------------------------------------------------
#
# The turn hold judged a connection owed the turn by the grant of the job that ended, not by
# its latest grant: a connection with two jobs running got a turn of the rotation and then a
# held slot while another connection's fitting want waited, against the bound of book.py's
# Aging. It judges by the connection's latest grant at the priority now (WantBook.last_grant).


def _broker() -> tuple[Broker, int, int]:
    pool = PoolConfig(size=2, unknown_share=1.0, max_slots={"s": 0})
    broker, (x, y) = registered_broker("turns", pool, 2, turn_hold=0.05)
    return broker, x, y


def _offers(broker: Broker) -> list[tuple[int, p.Offer]]:
    return [(c, m) for c, m in broker.frames_to_send() if isinstance(m, p.Offer)]


def _redeem(broker: Broker, conn: int, offer: p.Offer) -> StartJob:
    broker.receive(
        conn,
        p.Job(job_id=offer.job_id, token=offer.token, service="s", subject=None, job={}),
        now=0.0,
    )
    (start,) = [e for e in broker.effects() if isinstance(e, StartJob)]
    return start


def _want(broker: Broker, conn: int, job_id: str) -> list[tuple[int, p.Offer]]:
    broker.receive(conn, p.Want(job_id=job_id, service="s", priority=0), now=0.0)
    return _offers(broker)


def _end(broker: Broker, start: StartJob) -> list[tuple[int, p.Offer]]:
    broker.job_ended(start.run_id, receipt(), now=0.0)
    return _offers(broker)


def test_a_connection_served_by_the_rotation_is_not_also_held_a_slot() -> None:
    """Two slots, connections X and Y at one priority. Y's first job runs; X's runs and
    X keeps two wants; Y parks one. X's job ends: X's second want takes the slot. That
    job ends: Y's want takes it (Y now served after X). Y's first job ends: X, owed the
    turn, gets the slot; Y is not held one for its next want."""
    broker, x, y = _broker()
    ((_, offer),) = _want(broker, y, "y1")
    y1 = _redeem(broker, y, offer)
    ((_, offer),) = _want(broker, x, "x1")
    x1 = _redeem(broker, x, offer)
    assert _want(broker, x, "x2") == _want(broker, x, "x3") == []
    assert _want(broker, y, "y2") == []
    ((conn, offer),) = _end(broker, x1)
    assert (conn, offer.job_id) == (x, "x2")
    x2 = _redeem(broker, x, offer)
    ((conn, offer),) = _end(broker, x2)
    assert (conn, offer.job_id) == (y, "y2")
    _redeem(broker, y, offer)
    assert [(c, o.job_id) for c, o in _end(broker, y1)] == [(x, "x3")]


def test_the_turn_hold_keeps_the_round_robin_bound_shrunk_trace() -> None:
    """Three clients calling one execserver of four slots: no connection is passed over more
    than C - 1 times between two of its turns (the shrunk trace of one-execserver seed 4)."""
    assert replay(trace("turn-hold")).violations == ()


# -- the pool's growth timer (fixed) ---------------------------------------------------------
#
# Pool growth compared now - last_grow < pool_grow_interval but woke at last_grow +
# pool_grow_interval; where the two disagreed in floating point the grow timer fired, grew
# nothing and asked for the same instant again: a mock clock spun for ever. The pool compares
# now with the sum the timer asks for now (core/_client_pool.py ConnectionPool.grow).


def _hello(instance: str) -> p.Hello:
    return p.Hello(
        protocol=1,
        instance_id=instance,
        name=instance,
        services={"a": p.ServiceInfo(max_slots=0, kind="light")},
        processes=1,
        idle=1,
        clients=1,
        draining=False,
        addr=f"{instance}:7000",
    )


def _grown_at_0_002() -> tuple[ClientCore, Callable[[], list[int]]]:
    """A job waits for a service no connection announced; the balanced address grew at
    0.002 s and may grow again 2 s later (the timer's instant, 2.002)."""
    config = ClientConfig(
        backend_id="c",
        name="c",
        version="1",
        addresses=("lb:80",),
        pool_grow_interval=2.0,
        ping_interval=1e6,
        ping_timeout=2e6,
    )
    core = ClientCore(config, now=0.0)

    def dials() -> list[int]:
        return [effect.conn for effect in core.effects() if isinstance(effect, Dial)]

    (first,) = dials()
    core.connected(first, peer_addr="lb:80", now=0.0)
    core.receive(first, _hello("pod-a"), now=0.0)
    assert core.balanced("lb:80")
    core.submit("j", "b", {}, now=0.002)  # no connection offers b: the pool grows at once
    (second,) = dials()
    core.connected(second, peer_addr="lb:80", now=0.002)
    core.receive(second, _hello("pod-b"), now=0.002)
    assert core.next_deadline() == 0.002 + 2.0
    return core, dials


def test_growth_due_at_its_timer_grows() -> None:
    """At the timer, 2.002 s, the pool dials (the floating point of 2.002 - 0.002 is just
    under 2: the timer must not wake for the same instant again)."""
    core, dials = _grown_at_0_002()
    due = core.next_deadline()
    assert due is not None
    core.tick(now=due)
    assert dials() or core.next_deadline() != due


def test_growth_is_not_due_a_moment_before_its_instant() -> None:
    """Half a microsecond before 2.002 nothing grows yet (an input then, not the timer)."""
    core, dials = _grown_at_0_002()
    due = core.next_deadline()
    assert due is not None
    core.tick(now=due - 5e-7)
    assert dials() == []
    assert core.next_deadline() == due


def test_no_core_asks_for_the_instant_it_was_woken_at_shrunk_trace() -> None:
    """Twenty fylrs on a mixed fleet: no core's timer asks for the instant it fired at
    again (the shrunk trace of a mixed-fleet-20 seed)."""
    result = replay(trace("grow-timer"), tolerate=lambda v: v.kind != "timer")
    assert result.violations == ()


def test_growth_wakes_for_the_address_that_may_grow_first() -> None:
    """Two balanced addresses, grown at 0.002 and at 1.0: the growth timer asks for the
    first of their next instants, 2.002, not the last."""
    config = ClientConfig(
        backend_id="c",
        name="c",
        version="1",
        addresses=("lb:80", "lb2:80"),
        pool_grow_interval=2.0,
        ping_interval=1e6,
        ping_timeout=2e6,
    )
    core = ClientCore(config, now=0.0)

    def dials() -> list[int]:
        return [effect.conn for effect in core.effects() if isinstance(effect, Dial)]

    first, other = dials()
    core.connected(first, peer_addr="lb:80", now=0.0)
    core.receive(first, _hello("pod-a"), now=0.0)
    core.submit("j", "b", {}, now=0.002)  # probes: lb:80 grows (lb2:80 is still dialling)
    (grown,) = dials()
    core.connected(grown, peer_addr="lb:80", now=0.002)
    core.receive(grown, _hello("pod-b"), now=0.002)
    core.connected(other, peer_addr="lb2:80", now=1.0)
    core.receive(other, _hello("pod-c"), now=1.0)  # lb2:80 grows at 1.0
    (grown,) = dials()
    core.connected(grown, peer_addr="lb2:80", now=1.0)
    core.receive(grown, _hello("pod-d"), now=1.0)
    assert core.next_deadline() == 0.002 + 2.0


def test_growth_waits_a_whole_retry_tick_to_the_microsecond() -> None:
    """A job of a service the pool offers waits from 0.002 s: the pool grows at 1.002 s
    (a retry tick later), not half a microsecond before."""
    config = ClientConfig(
        backend_id="c",
        name="c",
        version="1",
        addresses=("lb:80",),
        retry_tick=1.0,
        ping_interval=1e6,
        ping_timeout=2e6,
    )
    core = ClientCore(config, now=0.0)

    def dials() -> list[int]:
        return [effect.conn for effect in core.effects() if isinstance(effect, Dial)]

    (first,) = dials()
    core.connected(first, peer_addr="lb:80", now=0.0)
    core.receive(first, _hello("pod-a"), now=0.0)
    core.submit("j", "a", {}, now=0.002)
    due = core.next_deadline()
    assert due == 0.002 + 1.0
    core.tick(now=due - 5e-7)
    assert dials() == []
    core.tick(now=due)
    assert len(dials()) == 1
