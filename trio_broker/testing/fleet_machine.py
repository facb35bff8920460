"""A model check of several client cores sharing one balanced, mixed fleet.

:func:`fleet_machine` drives a few :class:`~trio_broker.core.client.ClientCore`
that know one address only, a round-robin balancer in front of a fleet of
:class:`~trio_broker.core.broker.Broker` cores offering different services (by
default: the first pod in rotation offers ``a`` only, the second ``a`` and
``b``; nobody offers ``z``). The balancer is shared: each dial, whichever
client made it, lands on the next pod in turn, so one client's dial moves where
the next client's lands (the defect of a pool marked "covered" with one of two
pods came from exactly this). The machine plays every network event: jobs are
submitted, dials land (or fail), frames are delivered one connection at a time,
runs end, connections break, and time moves. At the end (:meth:`teardown`) the
fleet is left alone to settle, as a caller would: dials land, frames flow, runs
end, time moves to the next instant a core asks for, and a job that failed for
a reason that asks for another try (``no_slot``, ``unknown_service``, ``lost``,
``no_execserver``) is submitted again.

The reference is small and kept from the inputs alone:

* *not before a full re-probe*: a job of service ``s`` of client ``c`` fails
  ``service_not_offered`` at ``t`` only if ``t >= since + pool_reprobe_interval``,
  where ``since`` is the first time ``c`` submitted a job of ``s`` after its last
  job of ``s`` got a slot (no count of attempts can stand in for that time);
* *keep looking*: a job of a service some pod offers fails ``unknown_service``
  only at its ``connect_timeout``, never before (the pools here never reach
  ``pool_max``: a pool that can still grow has not looked everywhere);
* *eventually done*: after the settling every job (with its tries) ended done
  or, by the first rule, ``service_not_offered``; nothing is left in flight and
  no slot is held. Then each client in turn, alone, gets one more job of every
  service some pod offers: it ends done at its first try, whatever pods the
  client's pool reaches; and one of a service nobody offers, which ends
  ``service_not_offered``. (While several clients look at once through one
  round-robin balancer, each one's dials may keep landing on pods it knows: the
  jittered back-off makes that unlikely, not impossible, and the first rule is
  what holds then.)
* each core keeps its own invariants (``check_invariants``) after every step::

    from trio_broker.testing.fleet_machine import fleet_machine

    TestFleet = fleet_machine(clients=3).TestCase
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import ClassVar, Final

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_broker.core import protocol as p
from trio_broker.core.broker import Broker, BrokerConfig, CloseConnection, StartJob
from trio_broker.core.client import (
    Accepted,
    ClientConfig,
    ClientCore,
    ClientEffect,
    Close,
    Dial,
    Failed,
    Finished,
)
from trio_broker.core.pool import PoolConfig
from trio_broker.testing.values import receipt

__all__ = ["FleetMachine", "fleet_machine"]

_ADDRESS: Final = "lb:80"
_QUIET: Final = 1e7  # liveness is checked elsewhere: no pings in these runs
_AGAIN: Final = frozenset({"no_slot", "unknown_service", "lost", "no_execserver"})
"""The reasons a caller (a dispatcher) tries the job again for."""
_SETTLE_STEPS: Final = 5000


class _Link:
    """One connection: the client's and the pod's ids, and a FIFO queue each way."""

    def __init__(self, client: int, conn: int, pod: int, server_conn: int) -> None:
        self.client = client
        self.conn = conn
        self.pod = pod
        self.server_conn = server_conn
        self.to_server: deque[p.Message] = deque()
        self.to_client: deque[p.Message] = deque()


class _Job:
    """One job as its caller sees it: its service, and how its tries went."""

    def __init__(self, name: str, client: int, service: str) -> None:
        self.name = name
        self.client = client
        self.service = service
        self.tries = 0
        self.live: str | None = None  # the job id of the try in flight
        self.outcome: str | None = None  # "done", or the reason of its last failure

    def __repr__(self) -> str:
        return f"_Job({self.name!r}, client={self.client}, {self.service!r}, {self.outcome!r})"


class FleetMachine(RuleBasedStateMachine):
    """See the module docstring; configure it with :func:`fleet_machine`."""

    clients: ClassVar[int] = 2
    pods: ClassVar[tuple[tuple[str, ...], ...]] = (("a",), ("a", "b"))
    services: ClassVar[tuple[str, ...]] = ("a", "b", "z")
    slots: ClassVar[int] = 2
    connect_timeout: ClassVar[float] = 10.0
    reprobe: ClassVar[float] = 10.0
    grow_interval: ClassVar[float] = 1.0
    retry_tick: ClassVar[float] = 0.5
    steps: ClassVar[tuple[float, ...]] = (0.1, 0.5, 1.0, 2.5, 6.0)

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.offered = {s for services in self.pods for s in services}
        self.brokers = [
            Broker(
                BrokerConfig(
                    instance_id=f"pod-{index}",
                    name=f"pod-{index}",
                    pool=PoolConfig(
                        size=self.slots,
                        unknown_share=1.0,
                        max_slots=dict.fromkeys(services, 0),
                    ),
                    ping_interval=_QUIET,
                    ping_timeout=_QUIET * 2,
                ),
                now=0.0,
            )
            for index, services in enumerate(self.pods)
        ]
        self.cores = [
            ClientCore(
                ClientConfig(
                    backend_id=f"client-{index}",
                    name=f"client-{index}",
                    version="1",
                    addresses=(_ADDRESS,),
                    connect_timeout=self.connect_timeout,
                    retry_tick=self.retry_tick,
                    pool_grow_interval=self.grow_interval,
                    pool_reprobe_interval=self.reprobe,
                    ping_interval=_QUIET,
                    ping_timeout=_QUIET * 2,
                    reconnect_min=0.1,
                    reconnect_max=1.0,
                ),
                now=0.0,
            )
            for index in range(self.clients)
        ]
        self.turn = 0  # the balancer's rotation, shared by every client
        self.dials: dict[tuple[int, int], str] = {}  # (client, conn) -> address
        self.links: dict[tuple[int, int], _Link] = {}
        self.by_server: dict[tuple[int, int], _Link] = {}  # (pod, server conn) -> link
        self.running: dict[tuple[int, int], StartJob] = {}  # (pod, run id) -> its start
        self.jobs: dict[str, _Job] = {}
        self.tries: dict[str, _Job] = {}  # a try's job id -> its job
        self.again: list[_Job] = []  # failed for a reason that asks for another try
        self.since: dict[tuple[int, str], float] = {}  # the reference's search start
        self.submitted: dict[str, float] = {}  # a try's job id -> when it was submitted
        self.names = itertools.count()
        self._route()

    # -- plumbing ------------------------------------------------------------------------

    def _route(self) -> None:
        """Move every output of every core onto the network until all is quiet."""
        moved = True
        while moved:
            moved = False
            for client, core in enumerate(self.cores):
                for conn, message in core.frames_to_send():
                    moved = True
                    link = self.links.get((client, conn))
                    if link is not None:
                        link.to_server.append(message)
                for effect in core.effects():
                    moved = True
                    self._client_effect(client, effect)
            for pod, broker in enumerate(self.brokers):
                for server_conn, message in broker.frames_to_send():
                    moved = True
                    link = self.by_server.get((pod, server_conn))
                    if link is not None:
                        link.to_client.append(message)
                for server_effect in broker.effects():
                    moved = True
                    if isinstance(server_effect, StartJob):
                        self.running[(pod, server_effect.run_id)] = server_effect
                    elif isinstance(server_effect, CloseConnection):
                        closing = self.by_server.get((pod, server_effect.conn))
                        if closing is not None:
                            self._cut(closing.client, closing.conn, tell_client=True)

    def _client_effect(self, client: int, effect: ClientEffect) -> None:
        if isinstance(effect, Dial):
            self.dials[(client, effect.conn)] = effect.address
        elif isinstance(effect, Close):
            self._cut(client, effect.conn, tell_client=False)
        elif isinstance(effect, Accepted):
            job = self.tries[effect.job_id]
            self.since.pop((client, job.service), None)
        elif isinstance(effect, Finished | Failed):
            self._ended(client, effect)

    def _ended(self, client: int, effect: Finished | Failed) -> None:
        job = self.tries.pop(effect.job_id)
        submitted = self.submitted.pop(effect.job_id)
        job.live = None
        if isinstance(effect, Finished):
            job.outcome = "done"
            return
        job.outcome = effect.reason
        note(f"{self.now:g}s: {job} failed: {effect.detail}")
        if effect.reason == "service_not_offered":
            since = self.since.get((client, job.service))
            assert since is not None, f"{job}: not offered, yet it never waited unanswered"
            assert self.now >= since + self.reprobe, (
                f"{job} failed service_not_offered at {self.now:g}s, its client looking for "
                f"{job.service!r} since {since:g}s: before a full re-probe ({self.reprobe:g}s)"
            )
        elif effect.reason in _AGAIN:
            if effect.reason == "unknown_service" and job.service in self.offered:
                assert self.now >= submitted + self.connect_timeout, (
                    f"{job} failed unknown_service at {self.now:g}s, submitted at "
                    f"{submitted:g}s: the pool gave up looking before its connect_timeout"
                )
            self.again.append(job)

    def _cut(self, client: int, conn: int, *, tell_client: bool) -> None:
        self.dials.pop((client, conn), None)
        link = self.links.pop((client, conn), None)
        if link is not None:
            del self.by_server[(link.pod, link.server_conn)]
            self.brokers[link.pod].close_connection(link.server_conn, now=self.now)
        if tell_client:
            self.cores[client].connection_closed(conn, now=self.now)

    def _try(self, job: _Job) -> None:
        """Submit one try of the job (a new job id, as a dispatcher's next claim)."""
        job.tries += 1
        job.outcome = None
        job.live = f"{job.name}.{job.tries}"
        self.tries[job.live] = job
        self.submitted[job.live] = self.now
        self.since.setdefault((job.client, job.service), self.now)
        self.cores[job.client].submit(job.live, job.service, {}, now=self.now)
        self._route()

    def _land(self, key: tuple[int, int], *, fail: bool = False) -> None:
        client, conn = key
        del self.dials[key]
        core = self.cores[client]
        if fail:
            core.dial_failed(conn, now=self.now)
        else:
            pod = self.turn % len(self.brokers)
            self.turn += 1
            server_conn = self.brokers[pod].open_connection(f"pod-{pod}:7000", now=self.now)
            link = _Link(client, conn, pod, server_conn)
            self.links[key] = link
            self.by_server[(pod, server_conn)] = link
            core.connected(conn, local_addr="10.0.0.2:40000", peer_addr=_ADDRESS, now=self.now)
        self._route()

    def _deliver(self, link: _Link) -> None:
        """Deliver what is in flight on one connection, both ways, until it is quiet."""
        key = (link.client, link.conn)
        while key in self.links and (link.to_server or link.to_client):
            if link.to_server:
                message = link.to_server.popleft()
                self.brokers[link.pod].receive(link.server_conn, message, now=self.now)
            else:
                message = link.to_client.popleft()
                self.cores[link.client].receive(link.conn, message, now=self.now)
            self._route()

    def _flush(self) -> None:
        while any(link.to_server or link.to_client for link in self.links.values()):
            for link in list(self.links.values()):
                self._deliver(link)

    def _end(self, key: tuple[int, int]) -> None:
        pod, run_id = key
        del self.running[key]
        self.brokers[pod].job_ended(run_id, receipt(started_at=self.now), now=self.now)
        self._route()

    def _move_to(self, until: float) -> None:
        """Time passes: every core runs its due timers, at each instant asked for."""
        while True:
            due = [d for d in self._deadlines() if d <= until]
            if not due:
                break
            self.now = max(self.now, min(due))
            for core in self.cores:
                core.tick(now=self.now)
            for broker in self.brokers:
                broker.tick(now=self.now)
            self._route()
        self.now = until

    def _deadlines(self) -> list[float]:
        cores = [core.next_deadline() for core in self.cores]
        brokers = [broker.next_deadline() for broker in self.brokers]
        return [d for d in [*cores, *brokers] if d is not None]

    # -- rules ---------------------------------------------------------------------------

    @rule(data=st.data(), count=st.integers(1, 3))
    def submit(self, data: st.DataObject, count: int) -> None:
        """Jobs come to one client: of a service every pod offers, one only some pod
        offers (it probes), or one nobody offers."""
        client = data.draw(st.integers(0, self.clients - 1), label="client")
        service = data.draw(st.sampled_from(self.services), label="service")
        for _ in range(count):
            job = _Job(f"j{next(self.names)}", client, service)
            self.jobs[job.name] = job
            self._try(job)

    @precondition(lambda self: self.again)
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        """A caller tries again a job that failed for a reason that asks for it."""
        job = data.draw(st.sampled_from(self.again), label="job")
        self.again.remove(job)
        self._try(job)

    @precondition(lambda self: self.dials)
    @rule(data=st.data(), fail=st.sampled_from([False, False, False, True]))
    def land(self, data: st.DataObject, fail: bool) -> None:
        """A dial reaches the balancer, which hands it to the next pod in turn (or fails)."""
        self._land(data.draw(st.sampled_from(sorted(self.dials)), label="dial"), fail=fail)

    @precondition(lambda self: any(x.to_server or x.to_client for x in self.links.values()))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """What is in flight on one connection arrives (the others wait)."""
        busy = [key for key, x in sorted(self.links.items()) if x.to_server or x.to_client]
        self._deliver(self.links[data.draw(st.sampled_from(busy), label="link")])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        """A run ends on its pod."""
        self._end(data.draw(st.sampled_from(sorted(self.running)), label="run"))

    @precondition(lambda self: self.links)
    @rule(data=st.data())
    def cut(self, data: st.DataObject) -> None:
        """A connection breaks: frames in flight are lost, both sides hear of it."""
        client, conn = data.draw(st.sampled_from(sorted(self.links)), label="link")
        self._cut(client, conn, tell_client=True)
        self._route()

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """Time passes."""
        self._move_to(self.now + data.draw(st.sampled_from(self.steps), label="dt"))

    @invariant()
    def consistent(self) -> None:
        for core in self.cores:
            core.check_invariants()
        for broker in self.brokers:
            broker.check_invariants()

    # -- the end -------------------------------------------------------------------------

    def _settle(self) -> None:
        """Dials land, frames flow, runs end, failed tries are tried again, and time
        moves to the next instant a core asks for, until nothing is in flight."""
        for _ in range(_SETTLE_STEPS):
            while self.dials:
                self._land(min(self.dials))
            self._flush()
            while self.running:
                self._end(min(self.running))
                self._flush()
            again, self.again = self.again, []
            for job in again:  # once per instant: one failing at once waits for the next
                self._try(job)
                self._flush()
            if not self.tries and not self.dials and not self.running and not self.again:
                return
            due = self._deadlines()
            assert due, "jobs in flight, and no core asks to be woken"
            self._move_to(min(due))
        raise AssertionError(f"the fleet did not settle: {sorted(self.tries)} in flight")

    def _reconnect(self) -> None:
        """Time passes until every client has a connection again (a cut one dials back
        after its wait), so that the check of each client alone starts connected."""
        for _ in range(_SETTLE_STEPS):
            while self.dials:
                self._land(min(self.dials))
            self._flush()
            if all(any(c == client for c, _ in self.links) for client in range(self.clients)):
                return
            due = self._deadlines()
            assert due, "a client without a connection, and no core asks to be woken"
            self._move_to(min(due))
        raise AssertionError("a client never dialled back")

    def teardown(self) -> None:
        """Leave the fleet alone to settle, then hold every job to the reference."""
        self._settle()
        for job in self.jobs.values():
            if job.service in self.offered:
                assert job.outcome in ("done", "service_not_offered"), job
            else:
                assert job.outcome == "service_not_offered", job
        for broker in self.brokers:
            assert not broker.running(), "a slot is held after every job ended"
        self._reconnect()
        for client in range(self.clients):
            for service in self.services:
                job = _Job(f"last{next(self.names)}", client, service)
                self._try(job)
                self._settle()
                note(f"{job}: {job.tries} tries")
                if job.service in self.offered:
                    assert (job.outcome, job.tries) == ("done", 1), job
                else:
                    assert job.outcome == "service_not_offered", job


def fleet_machine(
    *,
    clients: int = 2,
    pods: tuple[tuple[str, ...], ...] = (("a",), ("a", "b")),
    connect_timeout: float = 10.0,
    reprobe: float = 10.0,
) -> type[FleetMachine]:
    """A :class:`FleetMachine` with ``clients`` client cores and these pods (each a
    tuple of the services it offers, in the balancer's rotation order)."""
    services = (*sorted({s for offered in pods for s in offered}), "z")
    return type(
        "ConfiguredFleetMachine",
        (FleetMachine,),
        {
            "clients": clients,
            "pods": pods,
            "services": services,
            "connect_timeout": connect_timeout,
            "reprobe": reprobe,
        },
    )
