"""A race model: one client parked on several execservers, any interleaving.

:func:`race_machine` wires one :class:`~trio_broker.core.client.ClientCore` to
two or three :class:`~trio_broker.core.broker.Broker` cores through an in-memory
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
from typing import ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_broker.core.broker import Broker, BrokerConfig, StartJob
from trio_broker.core.client import (
    Accepted,
    ClientConfig,
    ClientCore,
    ClientEffect,
    Failed,
    Finished,
)
from trio_broker.core.pool import PoolConfig
from trio_broker.testing.network import Link, Network

__all__ = ["RaceMachine", "race_machine"]

_FAR = 1e9


class RaceMachine(RuleBasedStateMachine):
    """See the module docstring; configure it with :func:`race_machine`."""

    servers: ClassVar[int] = 2
    slots: ClassVar[tuple[int, ...]] = (1, 2)
    offer_ttl: ClassVar[float] = 3.0
    pool_max: ClassVar[int] = 2

    def __init__(self) -> None:
        super().__init__()
        brokers = [
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
        client = ClientCore(
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
        self.started: dict[str, int] = {}  # job id -> StartJob count
        self.accepted_on: dict[str, int] = {}  # job id -> client conn of its JOB
        self.submitted: list[str] = []
        self.outcomes: dict[str, list[Finished | Failed]] = {}
        self.job_numbers = itertools.count()
        self.cancelled = False  # a cancelled job need not run
        self.net = Network(client, {f"exec-{i}": [b] for i, b in enumerate(brokers)})
        self.net.on_client_effect = self.client_effect
        self.net.on_start = self.started_run

    @property
    def client(self) -> ClientCore:
        return self.net.client

    @property
    def broken(self) -> bool:
        """Whether something was lost, so that exactly-once is no longer promised."""
        lost = any(isinstance(o, Failed) and o.reason == "lost" for o in self.net.client_effects)
        return self.cancelled or lost or self.net.lost_in_flight

    def client_effect(self, effect: ClientEffect) -> None:
        if isinstance(effect, Accepted):
            self.accepted_on[effect.job_id] = effect.conn
        elif isinstance(effect, Finished | Failed):
            self.outcomes.setdefault(effect.job_id, []).append(effect)
            if isinstance(effect, Failed) and effect.reason == "no_execserver":
                # refused at once, as documented, because nothing was connected
                assert not self.client.ready_connections()
                self.submitted.remove(effect.job_id)

    def started_run(self, server: int, effect: StartJob, link: Link) -> None:
        job_id = effect.job_id
        self.started[job_id] = self.started.get(job_id, 0) + 1
        assert self.started[job_id] == 1, f"{job_id} started twice"
        assert self.accepted_on.get(job_id) == link.client_conn, (
            f"{job_id} started on a connection the client did not send JOB on"
        )

    # -- rules --------------------------------------------------------------------------

    @rule(count=st.integers(1, 3), priority=st.integers(0, 2))
    def submit(self, count: int, priority: int) -> None:
        for _ in range(count):
            job_id = f"job-{next(self.job_numbers)}"
            self.submitted.append(job_id)
            self.client.submit(job_id, "s", {}, priority=priority, now=self.net.now)
        self.net.route()

    @precondition(lambda self: self.net.dials)
    @rule(data=st.data(), fail=st.integers(0, 9))
    def finish_dial(self, data: st.DataObject, fail: int) -> None:
        self.net.dial(data.draw(st.sampled_from(sorted(self.net.dials))), fail=fail == 0)

    @precondition(
        lambda self: any(link.to_server or link.to_client for link in self.net.links.values())
    )
    @rule(data=st.data(), count=st.integers(1, 3), to_server=st.booleans())
    def deliver(self, data: st.DataObject, count: int, to_server: bool) -> None:
        """Release up to ``count`` frames in flight on one connection, one way."""

        def waiting(link: Link) -> bool:
            return bool(link.to_server if to_server else link.to_client)

        conns = sorted(conn for conn, link in self.net.links.items() if waiting(link))
        if not conns:
            return
        conn = data.draw(st.sampled_from(conns))
        for _ in range(count):
            if conn not in self.net.links or not waiting(self.net.links[conn]):
                break
            if to_server:
                note(f"client {conn} -> execserver: {self.net.deliver_to_server(conn)}")
            else:
                note(f"execserver -> client {conn}: {self.net.deliver_to_client(conn)}")

    @precondition(lambda self: self.net.running)
    @rule(data=st.data())
    def end_job(self, data: st.DataObject) -> None:
        self.net.end_run(*data.draw(st.sampled_from(sorted(self.net.running))))

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5, 4.0]))
    def advance(self, dt: float) -> None:
        self.net.at(self.net.now + dt)

    @precondition(lambda self: self.submitted)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        job_id = data.draw(st.sampled_from(self.submitted))
        if job_id not in self.outcomes:
            self.cancelled = True
            self.client.cancel(job_id, now=self.net.now)
            self.net.route()

    @precondition(lambda self: self.net.links)
    @rule(data=st.data(), weight=st.integers(0, 4))
    def break_connection(self, data: st.DataObject, weight: int) -> None:
        if not weight:
            self.net.cut(data.draw(st.sampled_from(sorted(self.net.links))))

    # -- checks ---------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.client.check_invariants()
        for broker in self.net.brokers:
            broker.check_invariants()
        for job_id, outcomes in self.outcomes.items():
            assert len(outcomes) == 1, f"{job_id} ended twice: {outcomes}"

    def teardown(self) -> None:
        if self.broken:
            return
        # A quiet network: everything in flight arrives, every dial works, every
        # run ends, time passes. Every job must then have run exactly once.
        net = self.net
        for _ in range(200):
            if all(j in self.outcomes for j in self.submitted) and not net.running:
                break
            net.dial_all()
            net.flush()
            for server, run_id in sorted(net.running):
                net.end_run(server, run_id)
            net.at(net.now + 0.5)
            self.consistent()
        missing = [j for j in self.submitted if j not in self.outcomes]
        assert not missing, f"jobs never finished although slots exist: {missing}"
        for job_id in self.submitted:
            (outcome,) = self.outcomes[job_id]
            assert isinstance(outcome, Finished), f"{job_id}: {outcome}"
            assert self.started.get(job_id) == 1, f"{job_id} started {self.started.get(job_id)}"
        for broker in net.brokers:
            assert broker.pool.busy == 0, "a slot leaked"
            assert not len(broker.book), "a want leaked"


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
