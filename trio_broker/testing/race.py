"""A race model: one client parked on several execservers, any interleaving.

:func:`race_machine` wires one :class:`~trio_broker.client_core.ClientCore` to
two or three :class:`~trio_broker.broker.Broker` cores through an in-memory
network: every connection is a pair of FIFO queues, and hypothesis chooses which
queue delivers next, when dials complete or fail, when jobs end, when time
passes (offers expire), when the caller cancels, and when a connection breaks.
So offers cross ``UNWANT`` frames, ``DECLINE`` frames cross offer expiry, ``JOB``
frames race draining, and so on, in every order the wire allows.

Checked after every step:

* every job runs at most once: at most one ``StartJob`` across all execservers
  for one submitted job, and only on the connection the client sent ``JOB`` on;
* no slot leaks: each execserver's invariants hold, and the client's too;

and at the end, after delivering everything in flight, ending what runs and
letting time pass (a quiet network, so no message is lost):

* every job ran **exactly once** when nothing broke: it finished with a receipt,
  and every execserver is idle with an empty book.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_broker import protocol as p
from trio_broker.broker import (
    AbortJob,
    Broker,
    BrokerConfig,
    CloseConnection,
    Drained,
    StartJob,
)
from trio_broker.client_core import (
    Accepted,
    ClientConfig,
    ClientCore,
    Close,
    Dial,
    Failed,
    Finished,
)
from trio_broker.pool import PoolConfig
from trio_broker.testing.values import receipt

__all__ = ["RaceMachine", "race_machine"]

_FAR = 1e9


class _Link:
    """One broker connection: the client's id, the execserver's id, two queues."""

    def __init__(self, client_conn: int, server: int, server_conn: int) -> None:
        self.client_conn = client_conn
        self.server = server
        self.server_conn = server_conn
        self.to_server: deque[p.Message] = deque()
        self.to_client: deque[p.Message] = deque()


class RaceMachine(RuleBasedStateMachine):
    """See the module docstring; configure it with :func:`race_machine`."""

    servers: ClassVar[int] = 2
    slots: ClassVar[tuple[int, ...]] = (1, 2)
    offer_ttl: ClassVar[float] = 3.0
    pool_max: ClassVar[int] = 2

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.brokers = [
            Broker(
                BrokerConfig(
                    instance_id=f"exec-{i}",
                    name=f"exec-{i}",
                    pool=PoolConfig(
                        size=self.slots[i % len(self.slots)],
                        fast_reserve=0,
                        unknown_share=1.0,
                        max_slots={"s": 0},
                    ),
                    offer_ttl=self.offer_ttl,
                    ping_interval=_FAR,
                    ping_timeout=_FAR,
                ),
                now=0.0,
            )
            for i in range(self.servers)
        ]
        self.client = ClientCore(
            ClientConfig(
                backend_id="client",
                name="client",
                version="1",
                addresses=tuple(f"exec-{i}" for i in range(self.servers)),
                connect_timeout=_FAR,
                retry_tick=1.0,
                pool_grow_interval=2.0,
                pool_max=self.pool_max,
                pool_reprobe_interval=30.0,
                ping_interval=_FAR,
                ping_timeout=_FAR,
            ),
            now=0.0,
        )
        self.dials: dict[int, int] = {}  # client conn -> server index
        self.links: dict[int, _Link] = {}  # client conn -> link
        self.by_server: dict[tuple[int, int], _Link] = {}
        self.runs: dict[tuple[int, int], str] = {}  # (server, run_id) -> job id
        self.started: dict[str, int] = {}  # job id -> StartJob count
        self.accepted_on: dict[str, int] = {}  # job id -> client conn of its JOB
        self.submitted: list[str] = []
        self.outcomes: dict[str, list[Any]] = {}
        self.job_numbers = itertools.count()
        self.broken = False  # something was lost: exactly-once no longer promised
        self.route()

    # -- the network ----------------------------------------------------------------

    def route(self) -> None:
        """Move every output of every core onto the network until all is quiet."""
        busy = True
        while busy:
            busy = False
            for conn, message in self.client.frames_to_send():
                busy = True
                link = self.links.get(conn)
                if link is not None:
                    link.to_server.append(message)
            for effect in self.client.effects():
                busy = True
                self.client_effect(effect)
            for index, broker in enumerate(self.brokers):
                for server_conn, message in broker.frames_to_send():
                    busy = True
                    link = self.by_server.get((index, server_conn))
                    if link is not None:
                        link.to_client.append(message)
                for server_effect in broker.effects():
                    busy = True
                    self.server_effect(index, server_effect)

    def client_effect(self, effect: Any) -> None:
        if isinstance(effect, Dial):
            self.dials[effect.conn] = int(effect.address.split("-")[1])
        elif isinstance(effect, Close):
            self.cut(effect.conn, tell_client=False)
        elif isinstance(effect, Accepted):
            self.accepted_on[effect.job_id] = effect.conn
        elif isinstance(effect, Finished | Failed):
            self.outcomes.setdefault(effect.job_id, []).append(effect)
            if isinstance(effect, Failed) and effect.reason == "lost":
                self.broken = True
            if isinstance(effect, Failed) and effect.reason == "no_execserver":
                # refused at once, as documented, because nothing was connected
                assert not self.client.ready_connections()
                self.submitted.remove(effect.job_id)

    def server_effect(self, index: int, effect: Any) -> None:
        if isinstance(effect, StartJob):
            link = self.by_server[(index, effect.conn)]
            job_id = effect.job_id
            self.started[job_id] = self.started.get(job_id, 0) + 1
            assert self.started[job_id] == 1, f"{job_id} started twice"
            assert self.accepted_on.get(job_id) == link.client_conn, (
                f"{job_id} started on a connection the client did not send JOB on"
            )
            self.runs[(index, effect.run_id)] = job_id
        elif isinstance(effect, CloseConnection):
            closing = self.by_server.get((index, effect.conn))
            if closing is not None:
                self.cut(closing.client_conn, tell_client=True)
        elif isinstance(effect, AbortJob | Drained):
            pass  # the runner ends aborted runs through end_job like any other

    def cut(self, client_conn: int, *, tell_client: bool) -> None:
        """The connection breaks: frames in flight are lost, both sides hear of it."""
        self.dials.pop(client_conn, None)
        link = self.links.pop(client_conn, None)
        if link is not None:
            del self.by_server[(link.server, link.server_conn)]
            self.brokers[link.server].close_connection(link.server_conn, now=self.now)
            if link.to_server or link.to_client:
                self.broken = True
        if tell_client:
            self.client.connection_closed(client_conn, now=self.now)

    # -- rules --------------------------------------------------------------------------

    @rule(count=st.integers(1, 3), priority=st.integers(0, 2))
    def submit(self, count: int, priority: int) -> None:
        for _ in range(count):
            job_id = f"job-{next(self.job_numbers)}"
            self.submitted.append(job_id)
            self.client.submit(job_id, "s", {}, priority=priority, now=self.now)
        self.route()

    @precondition(lambda self: self.dials)
    @rule(data=st.data(), fail=st.integers(0, 9))
    def finish_dial(self, data: st.DataObject, fail: int) -> None:
        conn = data.draw(st.sampled_from(sorted(self.dials)))
        server = self.dials.pop(conn)
        if fail == 0:
            self.client.dial_failed(conn, now=self.now)
        else:
            server_conn = self.brokers[server].open_connection("10.0.0.1:7000", now=self.now)
            link = _Link(conn, server, server_conn)
            self.links[conn] = link
            self.by_server[(server, server_conn)] = link
            self.client.connected(conn, local_addr="10.0.0.2:40000", now=self.now)
        self.route()

    @precondition(lambda self: any(link.to_server for link in self.links.values()))
    @rule(data=st.data(), count=st.integers(1, 3))
    def deliver_to_server(self, data: st.DataObject, count: int) -> None:
        links = [link for link in self.links.values() if link.to_server]
        link = data.draw(st.sampled_from(links))
        for _ in range(min(count, len(link.to_server))):
            message = link.to_server.popleft()
            note(f"client {link.client_conn} -> exec-{link.server}: {message}")
            self.brokers[link.server].receive(link.server_conn, message, now=self.now)
            self.route()
            if link.client_conn not in self.links:
                break

    @precondition(lambda self: any(link.to_client for link in self.links.values()))
    @rule(data=st.data(), count=st.integers(1, 3))
    def deliver_to_client(self, data: st.DataObject, count: int) -> None:
        links = [link for link in self.links.values() if link.to_client]
        link = data.draw(st.sampled_from(links))
        for _ in range(min(count, len(link.to_client))):
            message = link.to_client.popleft()
            note(f"exec-{link.server} -> client {link.client_conn}: {message}")
            self.client.receive(link.client_conn, message, now=self.now)
            self.route()
            if link.client_conn not in self.links:
                break

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def end_job(self, data: st.DataObject) -> None:
        server, run_id = data.draw(st.sampled_from(sorted(self.runs)))
        self.end_job_now(server, run_id)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5, 4.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.tick_all()

    @precondition(lambda self: self.submitted)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        job_id = data.draw(st.sampled_from(self.submitted))
        if job_id not in self.outcomes:
            self.broken = True  # a cancelled job need not run
            self.client.cancel(job_id, now=self.now)
            self.route()

    @precondition(lambda self: self.links)
    @rule(data=st.data(), weight=st.integers(0, 4))
    def break_connection(self, data: st.DataObject, weight: int) -> None:
        if weight:
            return
        conn = data.draw(st.sampled_from(sorted(self.links)))
        self.cut(conn, tell_client=True)
        self.route()

    def tick_all(self) -> None:
        self.client.tick(now=self.now)
        for broker in self.brokers:
            broker.tick(now=self.now)
        self.route()

    # -- checks ---------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.client.check_invariants()
        for broker in self.brokers:
            broker.check_invariants()
        for job_id, outcomes in self.outcomes.items():
            assert len(outcomes) == 1, f"{job_id} ended twice: {outcomes}"

    def teardown(self) -> None:
        if self.broken:
            return
        # A quiet network: everything in flight arrives, every dial works, every
        # run ends, time passes. Every job must then have run exactly once.
        for _ in range(200):
            if all(j in self.outcomes for j in self.submitted) and not self.runs:
                break
            for conn in sorted(self.dials):
                server = self.dials.pop(conn)
                server_conn = self.brokers[server].open_connection("10.0.0.1:7000", now=self.now)
                link = _Link(conn, server, server_conn)
                self.links[conn] = link
                self.by_server[(server, server_conn)] = link
                self.client.connected(conn, local_addr="10.0.0.2:40000", now=self.now)
                self.route()
            for link in list(self.links.values()):
                while link.to_server and link.client_conn in self.links:
                    self.brokers[link.server].receive(
                        link.server_conn, link.to_server.popleft(), now=self.now
                    )
                    self.route()
                while link.to_client and link.client_conn in self.links:
                    self.client.receive(link.client_conn, link.to_client.popleft(), now=self.now)
                    self.route()
            for server, run_id in sorted(self.runs):
                self.end_job_now(server, run_id)
            self.now += 0.5
            self.tick_all()
            self.consistent()
        missing = [j for j in self.submitted if j not in self.outcomes]
        assert not missing, f"jobs never finished although slots exist: {missing}"
        for job_id in self.submitted:
            (outcome,) = self.outcomes[job_id]
            assert isinstance(outcome, Finished), f"{job_id}: {outcome}"
            assert self.started.get(job_id) == 1, f"{job_id} started {self.started.get(job_id)}"
        for broker in self.brokers:
            assert broker.pool.busy == 0, "a slot leaked"
            assert not len(broker.book), "a want leaked"

    def end_job_now(self, server: int, run_id: int) -> None:
        del self.runs[(server, run_id)]
        self.brokers[server].job_ended(run_id, receipt(started_at=self.now), now=self.now)
        self.route()


def race_machine(
    *,
    servers: int = 2,
    slots: tuple[int, ...] = (1, 2),
    offer_ttl: float = 3.0,
    pool_max: int = 2,
) -> type[RaceMachine]:
    """A :class:`RaceMachine` with this many execservers of these pool sizes."""
    return type(
        "ConfiguredRaceMachine",
        (RaceMachine,),
        {"servers": servers, "slots": slots, "offer_ttl": offer_ttl, "pool_max": pool_max},
    )
