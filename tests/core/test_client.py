"""The client core against real broker cores, with explicit clocks and a held network."""

from __future__ import annotations

from typing import Any

import pytest

from trio_broker.core import protocol as p
from trio_broker.core.broker import Broker, BrokerConfig, StartJob
from trio_broker.core.client import (
    Accepted,
    ClientConfig,
    ClientCore,
    ClientUsageError,
    Dial,
    Failed,
    Finished,
)
from trio_broker.core.pool import PoolConfig
from trio_broker.testing.network import Network
from trio_broker.testing.values import receipt

QUIET = 1e6  # liveness is tested on its own; here time jumps far without traffic


def broker(name: str, size: int = 1, services: tuple[str, ...] = ("s",)) -> Broker:
    return Broker(
        BrokerConfig(
            instance_id=name,
            name=name,
            pool=PoolConfig(size=size, unknown_share=1.0, max_slots=dict.fromkeys(services, 0)),
            ping_interval=QUIET,
            ping_timeout=QUIET * 2,
        ),
        now=0.0,
    )


class Net(Network):
    """The shared held network, plus a few shorthands for these tests."""

    def __init__(
        self,
        client_config: ClientConfig,
        fleets: dict[str, list[Broker]],
        balancers: set[str] | None = None,
    ) -> None:
        super().__init__(ClientCore(client_config, now=0.0), fleets, balancers=balancers)

    @property
    def started(self) -> list[tuple[int, StartJob]]:
        """The runs not ended yet, in the order they started."""
        return [(server, start) for (server, _), start in self.running.items()]

    def submit(self, job_id: str, service: str = "s", priority: int = 0) -> None:
        self.client.submit(job_id, service, {"n": 1}, priority=priority, now=self.now)
        self.route()

    def end(self, index: int = 0) -> None:
        server, start = self.started[index]
        self.end_run(server, start.run_id, receipt(duration=0.1))

    def to_server(self, conn: int) -> list[p.Message]:
        return list(self.links[conn].to_server)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.client_effects if isinstance(e, kind)]


def config(*addresses: str, **overrides: Any) -> ClientConfig:
    settings: dict[str, Any] = {"ping_interval": QUIET, "ping_timeout": QUIET * 2, **overrides}
    return ClientConfig(
        backend_id="me", name="client", version="1", addresses=addresses, **settings
    )


def test_register_first_then_park_on_every_connection_offering_the_service() -> None:
    a, b, c = broker("a"), broker("b"), broker("c", services=("other",))
    net = Net(config("A", "B", "C"), {"A": [a], "B": [b], "C": [c]})
    net.dial_all()
    first = [net.to_server(conn)[0] for conn in net.links]
    assert all(isinstance(m, p.Register) for m in first)
    net.flush()
    net.submit("j")
    parked = {conn for conn, link in net.links.items() if link.to_server}
    assert net.client.parked_on("j") == frozenset(parked)
    assert len(parked) == 2  # not on C, which does not offer "s"


def test_first_offer_wins_surplus_is_declined_and_others_unwanted() -> None:
    a, b = broker("a"), broker("b")
    net = Net(config("A", "B"), {"A": [a], "B": [b]})
    net.dial_all()
    net.flush()
    net.submit("j")
    conn_a, conn_b = sorted(net.links)
    net.deliver_to_server(conn_a)
    net.deliver_to_server(conn_b)  # both execservers offer
    assert isinstance(net.deliver_to_client(conn_b), p.Offer)  # B's offer arrives first
    assert net.of(Accepted) == [Accepted(job_id="j", conn=conn_b)]
    assert [m.TYPE for m in net.to_server(conn_a)] == ["UNWANT"]
    assert isinstance(net.deliver_to_client(conn_a), p.Offer)  # A's crossed our UNWANT
    assert [m.TYPE for m in net.to_server(conn_a)] == ["UNWANT", "DECLINE"]
    net.flush()
    assert a.pool.busy == 0
    assert b.pool.busy == 1
    net.end()
    net.flush()
    (finished,) = net.of(Finished)
    assert finished.job_id == "j"
    assert finished.receipt.instance_id == "b"


def test_expired_offer_is_parked_again() -> None:
    a = broker("a")
    net = Net(config("A"), {"A": [a]})
    net.dial_all()
    net.flush()
    net.submit("j")
    (conn,) = net.links
    net.deliver_to_server(conn)  # WANT -> OFFER, which stays in flight
    net.at(10.0)  # the offer expires at the execserver
    net.deliver_to_client(conn)  # the late OFFER: accepted, JOB sent
    net.flush()  # JOB -> unknown_token; offer_expired; the client re-parks
    assert net.client.parked_on("j") or net.started
    net.flush()
    assert len(net.started) == 1


def test_connect_timeout_unwants_everywhere_and_fails() -> None:
    a, b = broker("a"), broker("b")
    net = Net(config("A", "B", connect_timeout=30.0, pool_max=1), {"A": [a], "B": [b]})
    net.dial_all()
    net.flush()
    net.submit("busy-1")
    net.flush()
    net.submit("busy-2")
    net.flush()
    net.submit("starved")
    net.flush()
    assert len(a.book) + len(b.book) == 2
    net.at(30.0)
    net.flush()
    assert net.of(Failed) == [
        Failed(job_id="starved", reason="no_slot", detail="no slot within connect_timeout (30s)")
    ]
    assert len(a.book) + len(b.book) == 0


def test_no_execserver_fails_at_once() -> None:
    net = Net(config("A"), {"A": [broker("a")]})
    net.submit("j")
    assert net.of(Failed) == [
        Failed(job_id="j", reason="no_execserver", detail="no execserver is connected")
    ]


def test_losing_every_execserver_fails_waiting_jobs_at_once_and_new_ones_run_after() -> None:
    """The only connection breaks: the running job is lost, the waiting one fails at once
    with no_execserver (not after connect_timeout); after the redial new jobs run."""
    a = broker("a")
    net = Net(config("A", reconnect_min=0.5, connect_timeout=300.0), {"A": [a]})
    net.dial_all()
    net.flush()
    net.submit("hold")
    net.flush()
    net.submit("waiting")
    net.flush()
    (conn,) = net.links
    net.cut(conn)
    assert net.of(Failed) == [
        Failed(
            job_id="hold",
            reason="lost",
            detail="the connection to A closed while the job held its slot",
        ),
        Failed(job_id="waiting", reason="no_execserver", detail="every execserver disappeared"),
    ]
    assert net.now == 0.0
    assert net.client.waiting_count() == 0
    net.at(0.5)
    net.dial_all()
    net.flush()
    assert [start.job_id for _, start in net.started] == ["hold"]
    net.end(0)  # the execserver stopped the orphaned run: its slot frees
    net.submit("next")
    net.flush()
    assert [start.job_id for _, start in net.started] == ["next"]


def test_a_waiting_job_survives_losing_one_of_two_execservers() -> None:
    """With another execserver still connected, a waiting job keeps waiting."""
    a, b = broker("a"), broker("b")
    net = Net(config("A", "B", pool_max=1), {"A": [a], "B": [b]})
    net.dial_all()
    net.flush()
    for job_id in ("x", "y", "z"):
        net.submit(job_id)
        net.flush()
    conn_a = next(c for c, link in net.links.items() if net.brokers[link.server] is a)
    net.cut(conn_a)
    assert [f.reason for f in net.of(Failed)] == ["lost"]
    assert net.client.waiting_count() == 1
    net.end(0)
    net.flush()
    assert not net.of(Finished) or net.client.waiting_count() == 0


def running_and_waiting() -> tuple[Broker, Net]:
    """One one-slot execserver running job ``running``, with job ``waiting`` parked."""
    a = broker("a")
    net = Net(config("A"), {"A": [a]})
    net.dial_all()
    net.flush()
    net.submit("running")
    net.flush()
    net.submit("waiting")
    net.flush()
    return a, net


def test_all_draining_fails_waiting_jobs_at_once() -> None:
    a, net = running_and_waiting()
    a.drain(now=net.now)
    net.route()
    net.flush()
    assert Failed(
        job_id="waiting", reason="no_execserver", detail="every execserver disappeared"
    ) in net.of(Failed)


def test_pool_grows_through_the_balancer_until_it_meets_a_known_replica() -> None:
    replicas = [broker("r1"), broker("r2")]
    net = Net(
        config("LB", retry_tick=1.0, pool_grow_interval=2.0, pool_reprobe_interval=60.0),
        {"LB": replicas},
    )
    net.dial_all()
    net.flush()
    net.submit("busy")
    net.flush()
    net.submit("waiting")
    net.flush()
    assert len(net.client.pool("LB")) == 1
    net.at(1.0)  # a whole retry tick without an offer: one more connection
    assert len(net.dials) == 1
    net.dial_all()
    net.flush()
    assert len(net.started) == 2  # the second replica took the waiting job
    net.submit("third")
    net.flush()
    net.at(3.0)
    net.dial_all()  # lands on r1 again: a duplicate instance
    net.flush()
    assert net.client.covered("LB")
    assert len(net.client.pool("LB")) == 2
    net.at(10.0)
    assert not net.dials  # covered: no growth
    net.at(63.0)  # re-probe clears the mark
    assert not net.client.covered("LB")


def test_growth_is_capped_by_pool_max() -> None:
    replicas = [broker(f"r{i}") for i in range(5)]
    net = Net(config("LB", pool_max=3, pool_grow_interval=1.0), {"LB": replicas})
    net.dial_all()
    net.flush()
    for i in range(10):
        net.submit(f"j{i}")
        net.flush()
    for second in range(1, 20):
        net.at(float(second))
        net.dial_all()
        net.flush()
    assert len(net.client.pool("LB")) == 3


def test_cancel_waiting_and_running() -> None:
    a, net = running_and_waiting()
    net.client.cancel("waiting", now=net.now)
    net.route()
    net.flush()
    assert len(a.book) == 0
    assert Failed(job_id="waiting", reason="cancelled", detail="cancelled by the caller") in (
        net.client_effects
    )
    net.client.cancel("running", now=net.now)
    net.route()
    net.flush()
    (conn,) = net.links
    assert not net.to_server(conn)


def test_draining_execserver_releases_the_wants_parked_there() -> None:
    a, b = broker("a"), broker("b")
    net = Net(config("A", "B"), {"A": [a], "B": [b]})
    net.dial_all()
    net.flush()
    net.submit("x")
    net.flush()
    net.submit("y")
    net.flush()
    net.submit("z")
    net.flush()
    a.drain(now=net.now)
    net.route()
    net.flush()
    conn_a = next(c for c, link in net.links.items() if net.brokers[link.server] is a)
    assert conn_a not in net.client.parked_on("z")


def test_duplicate_submit_is_a_usage_error() -> None:
    net = Net(config("A"), {"A": [broker("a")]})
    net.dial_all()
    net.flush()
    net.submit("j")
    with pytest.raises(ClientUsageError):
        net.client.submit("j", "s", {}, now=net.now)


def test_unknown_service_and_all_draining_fail_at_once() -> None:
    """submit() fails at once: unknown_service when no ready execserver announced the
    service, no_execserver when every ready one drains."""
    a = broker("a")
    net = Net(config("A"), {"A": [a]})
    net.dial_all()
    net.flush()
    net.submit("j", service="nobody-offers-this")
    (failed,) = net.of(Failed)
    assert (failed.reason, failed.job_id) == ("unknown_service", "j")
    a.drain(now=net.now)
    net.route()
    net.flush()
    net.submit("k")
    assert [(f.job_id, f.reason) for f in net.of(Failed)][-1] == ("k", "no_execserver")


def test_pipe_urls_are_completed_with_the_winning_connections_callback_base() -> None:
    """A job's pipe members become URLs under the callback base of the connection whose
    offer won, built from that connection's local address and the callback port."""
    net = Net(config("A", callback_port=8123), {"A": [broker("a")]})
    net.dial_all()
    net.flush()
    net.client.submit("j", "s", {"params": {}}, pipes={"stdin_url": "/pipe/x"}, now=net.now)
    net.route()
    net.flush()
    (connection,) = net.brokers[0].statistics().connections
    assert connection.register is not None
    assert connection.register.callback_url == "http://10.0.0.2:8123"  # the network's client addr
    ((_, start),) = net.started
    assert start.job == {"params": {}, "stdin_url": "http://10.0.0.2:8123/pipe/x"}


def test_pipes_need_a_callback_base() -> None:
    """A job with pipes on a client with neither callback_url nor callback_port is refused."""
    net = Net(config("A"), {"A": [broker("a")]})
    net.dial_all()
    net.flush()
    with pytest.raises(ClientUsageError, match="callback_port"):
        net.client.submit("j", "s", {}, pipes={"stdin_url": "/pipe/x"}, now=net.now)


def test_reconnect_back_off_doubles_with_jitter_and_resets_on_hello() -> None:
    """Failed dials are retried after half to all of a back-off that doubles up to
    reconnect_max; a HELLO resets it to reconnect_min."""
    core = ClientCore(config("A", reconnect_min=1.0, reconnect_max=4.0), now=0.0)
    (dial,) = [e for e in core.effects() if isinstance(e, Dial)]
    now, waits = 0.0, []
    for _ in range(5):
        core.dial_failed(dial.conn, now=now)
        deadline = core.next_deadline()
        assert deadline is not None
        waits.append(deadline - now)
        now = deadline
        core.tick(now=now)
        (dial,) = [e for e in core.effects() if isinstance(e, Dial)]
    for wait, backoff in zip(waits, [1.0, 2.0, 4.0, 4.0, 4.0], strict=True):
        assert backoff / 2 <= wait <= backoff
    assert len(set(waits)) == len(waits)  # jittered, not lockstep
    core.connected(dial.conn, local_addr="127.0.0.1:5", now=now)
    hello = p.Hello(protocol=1, instance_id="i", name="n", services={}, processes=1,
                    idle=0, clients=1, draining=False, addr="A")  # fmt: skip
    core.receive(dial.conn, hello, now=now)
    core.connection_closed(dial.conn, now=now)
    deadline = core.next_deadline()
    assert deadline is not None
    assert 0.5 <= deadline - now <= 1.0


# -- a mixed fleet behind one balancer -----------------------------------------------------


def _until_failed(net: Net) -> list[float]:
    """Run the timers until a job fails, dialling every growth at once; the growth times."""
    grown = []
    while not net.of(Failed):
        due = net.client.next_deadline()
        assert due is not None
        net.at(due)
        if net.dials:
            grown.append(due)
            net.dial_all()
            net.flush()
    return grown


def test_a_mixed_fleet_behind_one_balancer_routes_every_service() -> None:
    """The balancer's first replica offers only metadata: a job of another service waits
    (no unknown_service), the pool grows at once and the second replica runs it. A job of
    a service nobody offers keeps the pool looking after growth circled back to a known
    replica (covered), with a back-off, and fails service_not_offered only when a whole
    pool_reprobe_interval of looking (and its connect_timeout) has passed."""
    meta = broker("meta", services=("metadata",))
    full = broker("full", services=("metadata", "s"))
    cfg = config("LB", pool_grow_interval=2.0, connect_timeout=100.0, pool_reprobe_interval=60.0)
    net = Net(cfg, {"LB": [meta, full]})
    net.dial_all()
    net.flush()
    assert net.client.balanced("LB")
    net.submit("convert", service="s")
    assert not net.of(Failed)
    assert len(net.dials) == 1  # grown at once: no offer can come while nobody offers "s"
    net.dial_all()
    net.flush()
    assert [(server, start.job_id) for server, start in net.started] == [(1, "convert")]
    net.submit("meta-job", service="metadata")
    net.flush()
    assert len(net.started) == 2
    net.submit("nobody", service="nothing")
    net.at(1.9)
    assert not net.dials
    assert not net.of(Failed)
    net.at(2.0)
    assert len(net.dials) == 1
    net.dial_all()  # round robin: back on the metadata replica, a duplicate
    net.flush()
    assert net.client.covered("LB")
    assert len(net.client.pool("LB")) == 2
    assert not net.of(Failed)  # covered, and still looking
    net.submit("again", service="nothing")  # joins the search under way
    assert not net.of(Failed)
    grown = _until_failed(net)
    gaps = [b - a for a, b in zip([2.0, *grown], grown, strict=False)]
    backoffs = [4.0, 8.0] + [15.0] * (len(gaps) - 2)  # doubled from pool_grow_interval
    assert len(gaps) > 5  # to a quarter of pool_reprobe_interval, while the job waits
    for gap, backoff in zip(gaps, backoffs, strict=True):
        assert backoff / 2 <= gap <= backoff  # jittered
    assert len(set(gaps)) == len(gaps)
    assert [(f.job_id, f.reason) for f in net.of(Failed)] == [("nobody", "service_not_offered")]
    assert net.now == 100.0  # its connect_timeout, beyond its search's 60 s
    assert "'nothing'" in net.of(Failed)[0].detail
    net.at(102.0)  # the second one's (submitted at 2 s)
    assert [(f.job_id, f.reason) for f in net.of(Failed)][-1] == ("again", "service_not_offered")
    net.at(200.0)
    assert not net.dials  # nobody waits: covered stops growth again


def test_a_single_pod_behind_a_balancer_answers_service_not_offered_after_a_reprobe() -> None:
    """Behind a balancer with one pod, a job of a service it lacks waits while the pool
    dials again and again (landing on the same pod) for a whole pool_reprobe_interval;
    then service_not_offered, for good. A job submitted then starts a new search."""
    net = Net(config("LB", pool_reprobe_interval=40.0), {"LB": [broker("a")]}, balancers={"LB"})
    net.dial_all()
    net.flush()
    net.submit("j", service="nothing")
    assert not net.of(Failed)
    net.dial_all()
    net.flush()
    assert not net.of(Failed)
    assert net.client.covered("LB")
    grown = _until_failed(net)
    assert len(grown) >= 3  # several looks within the search
    assert [(f.job_id, f.reason) for f in net.of(Failed)] == [("j", "service_not_offered")]
    assert net.now == 60.0  # its connect_timeout: later than the search's end (40 s)
    net.submit("k", service="nothing")
    assert [f.job_id for f in net.of(Failed)] == ["j"]  # waits: a new search


def test_a_service_announced_ends_its_search() -> None:
    """A job waits for a service the fleet lacks; an execserver restarted with it is
    found by growth and runs the job: no failure, however long the search took."""
    a = broker("a", services=("metadata",))
    net = Net(config("LB", pool_reprobe_interval=40.0), {"LB": [a]}, balancers={"LB"})
    net.dial_all()
    net.flush()
    net.submit("j", service="s")
    net.dial_all()
    net.flush()
    net.at(30.0)
    new = broker("a2", services=("metadata", "s"))
    net.brokers.append(new)
    net._fleets["LB"] = [len(net.brokers) - 1]
    while not net.started:
        due = net.client.next_deadline()
        assert due is not None
        assert due < 60.0
        net.at(due)
        net.dial_all()
        net.flush()
    assert not net.of(Failed)


def test_a_literal_address_answers_unknown_service_at_once() -> None:
    """A connection whose HELLO.addr is the socket's peer address is direct: no waiting.
    The answer is unknown_service (try again) until the service has been missed for a
    whole pool_reprobe_interval, then service_not_offered (for good)."""
    net = Net(config("A", pool_reprobe_interval=30.0), {"A": [broker("a")]})
    net.dial_all()
    net.flush()
    assert not net.client.balanced("A")
    net.submit("j", service="nothing")
    assert [(f.job_id, f.reason) for f in net.of(Failed)] == [("j", "unknown_service")]
    assert not net.dials
    net.at(29.9)
    net.submit("k", service="nothing")
    assert [f.reason for f in net.of(Failed)][-1] == "unknown_service"
    net.at(30.0)
    net.submit("l", service="nothing")
    assert [f.reason for f in net.of(Failed)][-1] == "service_not_offered"
    net.submit("m", service="s")
    net.flush()
    assert len(net.started) == 1  # an offered service is not touched


def test_growth_for_an_unoffered_service_stops_at_pool_max() -> None:
    """Replicas that all lack the service: the pool grows to pool_max, then unknown_service
    (the pool cannot look further; the search is young: try again later)."""
    replicas = [broker(f"r{i}") for i in range(4)]
    net = Net(config("LB", pool_max=3, pool_grow_interval=1.0), {"LB": replicas})
    net.dial_all()
    net.flush()
    net.submit("j", service="nothing")
    for second in range(5):
        net.at(float(second))
        net.dial_all()
        net.flush()
        if net.of(Failed):
            break
    assert len(net.client.pool("LB")) == 3
    assert [(f.job_id, f.reason) for f in net.of(Failed)] == [("j", "unknown_service")]
    assert net.now == 1.0  # grown at 0 (on submit) and at 1; the third connection settles it


def test_a_probing_job_waits_for_its_search_beyond_connect_timeout() -> None:
    """A job that probes waits past its (shorter) connect_timeout while the pool grows:
    no no_slot; once the pool is full it fails unknown_service (its search is young)."""
    net = Net(
        config("LB", connect_timeout=5.0, pool_grow_interval=10.0, pool_max=4),
        {"LB": [broker(f"r{i}") for i in range(4)]},
    )
    net.dial_all()
    net.flush()
    net.submit("j", service="nothing")
    net.dial_all()
    net.flush()
    net.at(5.0)
    assert not net.of(Failed)
    _until_failed(net)
    assert [(f.job_id, f.reason) for f in net.of(Failed)] == [("j", "unknown_service")]


# -- balancers and duplicates -------------------------------------------------------------


def test_balanced_comes_from_the_peer_address_not_the_configured_text() -> None:
    """A host name in front of one execserver is direct when the socket's peer is the
    execserver's own address; without a peer address the configured text is compared."""
    net = Net(config("localhost:7000"), {"localhost:7000": [broker("a")]})
    net.dial_all()
    net.flush()
    assert not net.client.balanced("localhost:7000")
    core = ClientCore(config("localhost:7000"), now=0.0)
    (dial,) = core.effects()
    assert isinstance(dial, Dial)
    core.connected(dial.conn, now=0.0)
    hello = p.Hello(protocol=1, instance_id="i", name="n", services={}, processes=1,
                    idle=0, clients=1, draining=False, addr="127.0.0.1:7000")  # fmt: skip
    core.receive(dial.conn, hello, now=0.0)
    assert core.balanced("localhost:7000")


def test_one_execserver_under_two_addresses_is_one_connection() -> None:
    """The second address's connection to the same instance is closed: the execserver
    counts the client once. Losing the first connection dials the second address again."""
    a = broker("a")
    net = Net(config("A", "B", reconnect_min=1.0), {"A": [a], "B": [a]})
    net.dial_all()
    net.flush()
    assert len(net.links) == 1
    assert len(a.statistics().connections) == 1
    assert net.client.pool("B") == []
    assert (net.client.pool("A"), net.client.covered("B")) == ([1], True)
    net.submit("j")
    net.flush()
    assert len(net.started) == 1
    net.end()
    net.flush()
    (conn,) = net.links
    net.cut(conn)
    net.at(1.0)  # both addresses are dialled again after their back-off
    assert sorted(net.dials.values()) == ["A", "B"]
    net.dial_all()
    net.flush()
    assert len(net.links) == 1  # again one of the two is closed as a duplicate


def test_a_duplicate_address_is_probed_again_after_the_reprobe_interval() -> None:
    a = broker("a")
    net = Net(config("A", "B", pool_reprobe_interval=60.0), {"A": [a], "B": [a]})
    net.dial_all()
    net.flush()
    net.at(59.0)
    assert not net.dials
    net.at(60.0)
    assert list(net.dials.values()) == ["B"]
    net.dial_all()
    net.flush()
    assert net.client.pool("B") == []
    assert len(a.statistics().connections) == 1


# -- connect_timeout, timers, growth clock ----------------------------------------------------


@pytest.mark.parametrize("value", [0, 0.0, None])
def test_connect_timeout_unset_or_zero_means_sixty_seconds(value: float | None) -> None:
    assert config("A", connect_timeout=value).connect_timeout == 60.0


def test_negative_connect_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="connect_timeout"):
        config("A", connect_timeout=-1)


def test_deadlines_of_jobs_that_got_a_slot_are_never_due() -> None:
    """A finished job's connect_timeout timer is dropped: the next deadline is a live one."""
    a = broker("a", size=1)
    net = Net(config("A", connect_timeout=100.0), {"A": [a]})
    net.dial_all()
    net.flush()
    for i in range(200):
        net.at(float(i))
        net.submit(f"j{i}")
        net.flush()
        net.end()
        net.flush()
    assert len(net.of(Finished)) == 200
    assert net.client.next_deadline() == QUIET  # only the liveness timer: nothing waits
    assert len(net.client._timers) < 150  # cancelled entries were compacted away


def test_growth_is_timed_by_the_oldest_job_still_waiting() -> None:
    """A job that got its slot no longer counts: growth waits a retry tick from the
    submission of the oldest job that still waits."""
    replicas = [broker("r1"), broker("r2")]
    net = Net(config("LB", retry_tick=1.0, pool_grow_interval=0.1), {"LB": replicas})
    net.dial_all()
    net.flush()
    net.submit("first")  # gets the slot at once
    net.flush()
    net.at(0.5)
    net.submit("second")  # waits from 0.5
    net.flush()
    net.at(1.4)
    assert not net.dials
    net.at(1.5)
    assert len(net.dials) == 1
