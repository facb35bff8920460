"""The discrete-event engine: the real cores, wired through a modelled world.

Theory of operation
===================

One heap of events ordered by (virtual time, sequence number) is the whole
world's clock; nothing sleeps. Each event is one input to one part: a batch of
frames arriving on a link, a dial reaching a balancer, a core's timer falling
due, a job ending on a pod, a database statement running or answering, a job
arriving, a fault. After each input the engine drains the core it fed
(``frames_to_send()``, ``effects()``) and turns what came out into new events:

- frames become one *packet* on their link, arriving after a latency drawn from
  the scenario (plus ``rto`` for a batch TCP had to retransmit); a link keeps
  the arrival time of its last packet each way and never delivers earlier, so
  nothing is reordered within a connection, while connections race each other;
- a cut link (a partition of either end) holds its packets and delivers them in
  order when it heals; a closed end drops what arrives for it;
- ``Dial`` travels to the address: a pod, or a balancer that picks one of the
  pods in its rotation (round-robin, least-connections, random, sticky); the
  pod's broker opens the connection at once, and the client hears
  ``connected`` (the upgrade's answer) one latency later, before the ``HELLO``
  that follows it. A dial that lands on a pod that is down is refused; one
  that has not completed after ``dial_timeout`` fails;
- ``StartJob`` starts a run that ends after the job's duration (``AbortJob``
  ends it at once with its status); ``CloseConnection`` and ``Close`` close
  their end of the link and tell the other end one latency later;
- the next deadline of each core is one event; a stale one is skipped.

Crashes drop a process's core and everything it held; its peers hear of the
reset one latency later, or, for a silent crash (the host vanished), by their
own liveness timers. A restart builds new cores (a new incarnation: a new
``instance_id``, a new backend id). Balancers learn of pods coming, going and
draining after their ``health_delay``.

After every event the checks (:mod:`trio_broker.testing.sim.checks`) run on
the parts it touched; the first violation stops the run. Every random choice
comes from one :class:`~trio_broker.testing.sim.trace.Choices`, so a trace
replays exactly.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Literal

from trio_broker.core import protocol as p
from trio_broker.core.broker import (
    AbortJob,
    Broker,
    BrokerConfig,
    CheckCallback,
    CloseConnection,
    Drained,
    StartJob,
)
from trio_broker.core.client import (
    Accepted,
    ClientConfig,
    ClientCore,
    Close,
    Dial,
    Failed,
    Finished,
    PeerError,
    PositionReport,
)
from trio_broker.core.pool import PoolConfig
from trio_broker.testing.sim.checks import Checks
from trio_broker.testing.sim.drivers import DirectCaller, Dispatcher
from trio_broker.testing.sim.model import (
    Balancer,
    Client,
    Item,
    Link,
    PacketKind,
    Pod,
    Run,
    Toward,
    Violation,
)
from trio_broker.testing.sim.queue import QueueModel
from trio_broker.testing.sim.trace import Choices, FaultInput, Trace
from trio_broker.testing.values import receipt

__all__ = ["World"]

ABORT_GRACE: Final = 0.05
"""How long a stopped or cancelled run takes to end (its process group is killed)."""
DATABASE_TIMEOUT: Final = 5.0
"""How long a database call waits before it fails, when the database is cut off."""


class World:
    """One run of one trace (see the module docstring).

    Args:
        trace: the scenario, the seed and every input.
        record: keep the noise drawn (for a trace that replays the run).
        log_size: how many recent events the log keeps (0: none).
        sample_every: the period of the queue-depth samples (None: 60 per run).
        tolerate: violations it accepts are kept apart (:attr:`tolerated`, at
            most a hundred) and do not stop the run: known defects, while the
            run looks for others.
    """

    def __init__(
        self,
        trace: Trace,
        *,
        record: bool = True,
        log_size: int = 400,
        sample_every: float | None = None,
        tolerate: Callable[[Violation], bool] | None = None,
    ) -> None:
        scenario = trace.scenario
        self.trace = trace
        self.scenario = scenario
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        if trace.noise is None:
            self.choices = Choices(_noise_seed(trace), record=record)
        else:
            self.choices = Choices(None, trace.noise, record=record)
        self.queue = QueueModel()
        self.items = [Item(i, job) for i, job in enumerate(trace.jobs)]
        self.job_items: dict[str, Item] = {}
        self.run_started: dict[str, float] = {}
        self.open_items = len(self.items)
        self.direct_open = 0  # direct jobs arrived and not ended (the depth figure)
        self.pods: dict[str, Pod] = {}
        for pod_spec in scenario.pods:
            for name in pod_spec.names():
                self.pods[name] = Pod(name, pod_spec, len(self.pods))
        self.balancers: dict[str, Balancer] = {}
        for spec in scenario.balancers:
            members = [
                self.pods[n] for s in scenario.pods if s.name in spec.pods for n in s.names()
            ]
            self.balancers[spec.name] = Balancer(spec, members)
        self.clients: dict[str, Client] = {}
        for client_spec in scenario.clients:
            for name in client_spec.names():
                self.clients[name] = Client(name, client_spec, len(self.clients))
        self._links = itertools.count(1)
        self.events = 0
        self.violations: list[Violation] = []
        self.tolerated: list[Violation] = []
        self._tolerate = tolerate
        self._log: deque[tuple[float, str, tuple[Any, ...]]] = deque(maxlen=log_size)
        self._logging = log_size > 0
        self.checks = Checks(self)
        self.spun: set[str] = set()
        self._touched_pods: set[Pod] = set()
        self._touched_clients: set[Client] = set()
        self.last_arrival = max((job.at for job in trace.jobs), default=0.0)
        self.faults_left = len(trace.faults)
        longest = max((job.duration for job in trace.jobs), default=0.0)
        self.end = scenario.duration + scenario.settle_bound() + longest
        self.finished_at: float | None = None
        self.depth: list[tuple[float, int]] = []
        self.cpu: list[tuple[float, float]] = []  # (virtual, CPU seconds) at each sample
        self._sample_every = sample_every or max(scenario.duration / 60, 1.0)

    # -- the engine ----------------------------------------------------------------------

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Schedule ``fn(*args)`` at virtual time ``when`` (never before now)."""
        now = self.now
        heapq.heappush(self._heap, (when if when > now else now, next(self._seq), fn, args))

    def log(self, text: str, *args: Any) -> None:
        if self._logging:
            self._log.append((self.now, text, args))

    def log_lines(self) -> list[str]:
        """The recent events, oldest first."""
        return [f"{t:10.4f}  {text % args if args else text}" for t, text, args in self._log]

    def violation(self, kind: str, where: str, message: str) -> None:
        found = Violation(kind=kind, where=where, at=self.now, message=message)
        if self._tolerate is not None and self._tolerate(found):
            if len(self.tolerated) < 100:
                self.tolerated.append(found)
            self.log("tolerated: %s at %s: %s", kind, where, message)
            return
        self.violations.append(found)
        self.log("VIOLATION %s at %s: %s", kind, where, message)

    def run(self) -> None:
        """Run until every job ended and the world is quiet, or the bound passed."""
        self._start()
        heap = self._heap
        end = self.end
        while heap and not self.violations:
            when, _, fn, args = heapq.heappop(heap)
            if when > end:
                break
            self.now = when
            self.events += 1
            fn(*args)
            if self._touched_pods or self._touched_clients:
                self.checks.after_event(self._touched_pods, self._touched_clients)
                self._touched_pods.clear()
                self._touched_clients.clear()
            if self.finished_at is not None:
                break
        if not self.violations:
            self.checks.at_the_end()

    def _start(self) -> None:
        for pod in self.pods.values():
            self.at(pod.spec.up_at, self._pod_start, pod)
            if pod.spec.down_at is not None:
                self.at(pod.spec.down_at, self._pod_drain, pod)
        for balancer in self.balancers.values():
            for pod in balancer.pods:
                balancer.in_rotation[pod.name] = pod.spec.up_at == 0
        for client in self.clients.values():
            self.at(0.0, self._client_start, client)
        for item in self.items:
            self.at(item.job.at, self._arrive, item)
        for fault in self.trace.faults:
            self.at(fault.at, self._fault, fault)
        self.at(0.0, self._sample)

    def _sample(self) -> None:
        self.depth.append((self.now, self.queue.depth() + self.direct_open))
        self.cpu.append((self.now, time.process_time()))
        if self.now < self.last_arrival or self.open_items:
            self.at(self.now + self._sample_every, self._sample)

    def item_ended(self, item: Item) -> None:
        if item.ended is None:
            row = item.row
            item.ended = "done" if row is None or row.status == "done" else "failed"
            if row is not None and row.status == "failed":
                item.failure = row.last_error
        if item.ended == "done" and item.job.fails:
            item.ended, item.failure = "failed", "its input failed"
        self.open_items -= 1
        if item.row is None:
            self.direct_open -= 1
        item.ended_at = self.now
        self.log(
            "item %d ended %s%s",
            item.index,
            item.ended,
            f" ({item.failure})" if item.failure else "",
        )
        self._maybe_quiet()

    def _maybe_quiet(self) -> None:
        """Stop once every job ended, no fault is left and nothing runs or waits."""
        if self.open_items or self.faults_left or self.now < self.last_arrival:
            return
        if any(pod.runs for pod in self.pods.values()):
            return
        for client in self.clients.values():
            core = client.core
            if core is not None and (core.waiting_count() or core.running_count()):
                return
        self.finished_at = self.now

    # -- arrivals and faults -------------------------------------------------------------

    def _arrive(self, item: Item) -> None:
        job = item.job
        if job.target == "queue":
            item.row = self.queue.enqueue(job.service, job.priority, item.index, now=self.now)
            self.log(
                "item %d arrives: row %d (%s, priority %d)",
                item.index,
                item.row.id,
                job.service,
                job.priority,
            )
            # an upload reaches one fylr, which wakes its own dispatcher; the others
            # find the row at their next claim
            live = [c for c in self.clients.values() if isinstance(c.driver, Dispatcher)]
            if live:
                live[self.choices.index(len(live))].driver.wake()
            return
        client = self.clients[job.target]
        self.direct_open += 1
        self.log("item %d arrives at %s (%s)", item.index, client.name, job.service)
        if isinstance(client.driver, DirectCaller):
            client.driver.submit(item)
        else:
            item.ended, item.failure = "abandoned", "its client was down"
            self.item_ended(item)

    def _fault(self, fault: FaultInput) -> None:
        self.faults_left -= 1
        self.log("FAULT %s %s%s", fault.action, fault.target, " (silent)" if fault.silent else "")
        target = self.pods.get(fault.target) or self.clients[fault.target]
        if fault.action == "crash":
            self._crash(target, silent=fault.silent)
        elif fault.action == "restart":
            if isinstance(target, Pod):
                self._pod_start(target)
            else:
                self._client_start(target)
        elif fault.action == "cut":
            self._cut(target, database=fault.database)
        elif fault.action == "heal":
            self._heal(target)
        else:
            self._drop(target)
        self._maybe_quiet()

    def _crash(self, target: Pod | Client, *, silent: bool) -> None:
        if isinstance(target, Pod):
            self._pod_crash(target, silent=silent)
        else:
            self._client_crash(target, silent=silent)

    def _cut(self, target: Pod | Client, *, database: bool) -> None:
        target.cut = True
        if isinstance(target, Client):
            target.db_cut = database
        else:
            self._health_changed(target)

    def _heal(self, target: Pod | Client) -> None:
        target.cut = False
        links = target.links.values()
        if isinstance(target, Client):
            target.db_cut = False
        else:
            self._health_changed(target)
        for link in list(links):
            held, link.held = link.held, []
            for toward, kind, payload in held:
                self._send(link, toward, kind, payload)

    def _drop(self, target: Pod | Client) -> None:
        for link in list(target.links.values()):
            self._send(link, "s", "close", None)
            self._send(link, "c", "close", None)

    # -- the network -----------------------------------------------------------------------

    def _latency(self) -> float:
        scenario = self.scenario
        delay = self.choices.sample(scenario.latency)
        if scenario.loss and self.choices.chance(scenario.loss):
            delay += scenario.rto
        return delay

    def _send(self, link: Link, toward: Toward, kind: PacketKind, payload: Any) -> None:
        """Put a packet on a link: it arrives after a latency, in order, unless cut."""
        if link.cut():
            link.held.append((toward, kind, payload))
            return
        when = self.now + self._latency()
        if toward == "c":
            if when < link.t_c:
                when = link.t_c
            link.t_c = when
        else:
            if when < link.t_s:
                when = link.t_s
            link.t_s = when
        self.at(when, self._deliver, link, toward, kind, payload)

    def _deliver(self, link: Link, toward: Toward, kind: PacketKind, payload: Any) -> None:
        if toward == "s":
            self._deliver_to_pod(link, kind, payload)
        else:
            self._deliver_to_client(link, kind, payload)

    def _deliver_to_pod(self, link: Link, kind: PacketKind, payload: Any) -> None:
        pod = link.pod
        broker = pod.broker
        if link.state_s == "closed" or broker is None or pod.incarnation != link.pod_inc:
            return
        if kind == "close":
            link.state_s = "closed"
            pod.links.pop(link.server_conn, None)
            self.log("%s: connection %d closed by the client side", pod.name, link.server_conn)
            broker.close_connection(link.server_conn, now=self.now)
        else:
            # each frame is its own input: the checks judge each grant on the book it saw
            for message in payload:
                self.log("%s <- %s:%d %r", pod.name, link.client.name, link.conn, message)
                if isinstance(message, p.Want):
                    self.checks.want_arrives(pod, link.server_conn, message)
                broker.receive(link.server_conn, message, now=self.now)
                self.route_pod(pod)
                if pod.broker is not broker:
                    return
            return
        self.route_pod(pod)

    def _deliver_to_client(self, link: Link, kind: PacketKind, payload: Any) -> None:
        client = link.client
        if kind != "frames" or any(isinstance(m, p.Hello) for m in payload):
            client.loads = None  # its ready connections or their HELLO change: look again
        core = client.core
        if (
            link.state_c == "closed"
            or core is None
            or client.incarnation != link.client_inc
            or (kind != "open" and link.state_c != "open")
        ):
            return
        if kind == "open":
            link.state_c = "open"
            client.dialing.pop(link.conn, None)
            client.reached.add(link.pod.name)
            peer = link.via_addr
            self.log(
                "%s: connection %d open (%s via %s)",
                client.name,
                link.conn,
                link.pod.name,
                link.via,
            )
            core.connected(link.conn, local_addr=link.local, peer_addr=peer, now=self.now)
        elif kind == "close":
            link.state_c = "closed"
            client.links.pop(link.conn, None)
            self.log("%s: connection %d closed by the pod side", client.name, link.conn)
            core.connection_closed(link.conn, now=self.now)
        else:
            for message in payload:
                self.log("%s:%d <- %s %r", client.name, link.conn, link.pod.name, message)
                core.receive(link.conn, message, now=self.now)
        self.route_client(client)

    # -- dials and balancers -------------------------------------------------------------

    def _dial(self, client: Client, conn: int, address: str) -> None:
        client.dialing[conn] = self.now
        self.at(
            self.now + self.scenario.dial_timeout,
            self._dial_timeout,
            client,
            client.incarnation,
            conn,
        )
        if client.cut:
            return  # the SYN goes nowhere: the timeout fails the dial
        self.at(
            self.now + self._latency(),
            self._dial_arrives,
            client,
            client.incarnation,
            conn,
            address,
        )

    def _dial_arrives(self, client: Client, incarnation: int, conn: int, address: str) -> None:
        if client.incarnation != incarnation or not client.alive or conn not in client.dialing:
            return
        pod, via_addr = self._pick(client, address)
        if pod is None or pod.broker is None or pod.cut or pod.state in ("down", "removed"):
            self.log("%s: dial %d to %s refused", client.name, conn, address)
            self.at(self.now + self._latency(), self._dial_refused, client, incarnation, conn)
            return
        broker = pod.broker
        server_conn = broker.open_connection(pod.addr, now=self.now)
        client.ports += 1
        link = Link(
            next(self._links),
            client,
            conn,
            pod,
            server_conn,
            via=address,
            via_addr=via_addr,
            local=f"{client.name}:{client.ports}",
        )
        client.links[conn] = link
        pod.links[server_conn] = link
        self.log(
            "%s: dial %d to %s lands on %s (connection %d)",
            client.name,
            conn,
            address,
            pod.name,
            server_conn,
        )
        self._send(link, "c", "open", None)
        self.route_pod(pod)

    def _dial_refused(self, client: Client, incarnation: int, conn: int) -> None:
        if client.incarnation != incarnation or client.dialing.pop(conn, None) is None:
            return
        assert client.core is not None
        client.core.dial_failed(conn, now=self.now)
        self.route_client(client)

    def _dial_timeout(self, client: Client, incarnation: int, conn: int) -> None:
        if client.incarnation != incarnation or client.dialing.pop(conn, None) is None:
            return
        assert client.core is not None
        link = client.links.pop(conn, None)
        if link is not None:
            link.state_c = "closed"
            self._send(link, "s", "close", None)
        self.log("%s: dial %d timed out", client.name, conn)
        client.core.dial_failed(conn, now=self.now)
        self.route_client(client)

    def _pick(self, client: Client, address: str) -> tuple[Pod | None, str]:
        """The pod a dial to ``address`` lands on, and the peer address the client sees."""
        balancer = self.balancers.get(address.rsplit(":", 1)[0])
        if balancer is None:
            pod = self.pods[address.rsplit(":", 1)[0]]
            return pod, pod.addr
        balancer.dials += 1
        live = [pod for pod in balancer.pods if balancer.in_rotation[pod.name]]
        if not live:
            return None, balancer.addr
        if balancer.spec.sticky:
            pinned = balancer.pinned.get(client.name)
            for pod in live:
                if pod.name == pinned:
                    return pod, balancer.addr
        pod = self._by_policy(balancer, live, client)
        if balancer.spec.sticky:
            balancer.pinned[client.name] = pod.name
        return pod, balancer.addr

    def _by_policy(self, balancer: Balancer, live: list[Pod], client: Client) -> Pod:
        policy = balancer.spec.policy
        if policy == "random":
            return live[self.choices.index(len(live))]
        if policy == "least_connections":
            return min(live, key=lambda pod: (len(pod.links), pod.index))
        members = balancer.pods
        for step in range(len(members)):
            pod = members[(balancer.turn + step) % len(members)]
            if balancer.in_rotation[pod.name]:
                balancer.turn = (balancer.turn + step + 1) % len(members)
                return pod
        raise AssertionError("a live pod is in the rotation")

    def _health_changed(self, pod: Pod) -> None:
        """The balancers' health checks see the change after their delay."""
        for balancer in self.balancers.values():
            if pod.name in balancer.in_rotation:
                self.at(self.now + balancer.spec.health_delay, self._health_check, balancer, pod)

    def _health_check(self, balancer: Balancer, pod: Pod) -> None:
        healthy = pod.healthy()
        if balancer.in_rotation[pod.name] != healthy:
            balancer.in_rotation[pod.name] = healthy
            self.log(
                "%s: %s %s the rotation", balancer.name, pod.name, "joins" if healthy else "leaves"
            )

    # -- pods ------------------------------------------------------------------------------

    def _pod_start(self, pod: Pod) -> None:
        if pod.state in ("up", "draining", "removed"):
            return
        spec = pod.spec
        pod.incarnation += 1
        pod.tokens = 0
        pod.timer_at = None
        pod.parked_at.clear()
        pod.broker = Broker(
            BrokerConfig(
                instance_id=f"{pod.name}#{pod.incarnation}",
                name=pod.name,
                pool=PoolConfig(
                    size=spec.slots,
                    fast_reserve=spec.fast_reserve,
                    heavy_threshold=spec.heavy_threshold,
                    unknown_share=spec.unknown_share,
                    memory_budget=spec.memory_budget,
                    max_slots={s: spec.max_slots.get(s, 0) for s in spec.services},
                    priority_aging=spec.priority_aging,
                ),
                offer_ttl=spec.offer_ttl,
                ping_interval=spec.ping_interval,
                ping_timeout=spec.ping_timeout,
                drain_timeout=spec.drain_timeout,
                turn_hold=spec.turn_hold,
                token_factory=pod.next_token,
            ),
            now=self.now,
        )
        pod.state = "up"
        pod.up_since = self.now
        self.log("%s starts (instance %s)", pod.name, pod.broker.config.instance_id)
        if self.now > 0:
            self._health_changed(pod)
        self.route_pod(pod)

    def _pod_drain(self, pod: Pod) -> None:
        if pod.state != "up" or pod.broker is None:
            pod.state = "removed"
            return
        pod.state = "draining"
        self.log("%s drains", pod.name)
        self._health_changed(pod)
        pod.broker.drain(now=self.now)
        self.route_pod(pod)

    def _pod_down(self, pod: Pod, *, silent: bool, state: Literal["down", "removed"]) -> None:
        """The process is gone: its broker and runs with it; peers hear of it (or not)."""
        if pod.up_since is not None:
            pod.up_time += self.now - pod.up_since
            pod.up_since = None
        for run in pod.runs.values():
            self._account(pod, run)
        pod.runs.clear()
        pod.broker = None
        pod.state = state
        for link in list(pod.links.values()):
            link.state_s = "closed"
            if not silent:
                self._send(link, "c", "close", None)
        pod.links.clear()
        self._health_changed(pod)
        self._maybe_quiet()

    def _pod_crash(self, pod: Pod, *, silent: bool) -> None:
        if pod.broker is None:
            return
        self.log("%s crashes%s", pod.name, " silently" if silent else "")
        self._pod_down(pod, silent=silent, state="down")

    def route_pod(self, pod: Pod) -> None:
        """Carry out what the pod's broker asks for, and arm its timer."""
        broker = pod.broker
        if broker is None:
            return
        self._touched_pods.add(pod)
        frames = broker.frames_to_send()
        if frames:
            self.checks.frames_sent(pod, frames)
            for conn, messages in _by_connection(frames):
                link = pod.links.get(conn)
                if link is not None and link.state_s == "open":
                    self._send(link, "c", "frames", messages)
        for effect in broker.effects():
            self._pod_effect(pod, effect)
        if pod.broker is not None:
            self._arm(pod, pod.broker.next_deadline())

    def _pod_effect(self, pod: Pod, effect: Any) -> None:
        if isinstance(effect, StartJob):
            self._start_run(pod, effect)
        elif isinstance(effect, AbortJob):
            run = pod.runs.get(effect.run_id)
            if run is not None and run.aborting is None:
                run.aborting = effect.status
                run.end_at = self.now + ABORT_GRACE
                self.at(run.end_at, self._run_ends, pod, pod.incarnation, run)
        elif isinstance(effect, CloseConnection):
            link = pod.links.pop(effect.conn, None)
            if link is not None:
                link.state_s = "closed"
                self.log("%s closes connection %d: %s", pod.name, effect.conn, effect.reason)
                self._send(link, "c", "close", None)
        elif isinstance(effect, Drained):
            self.log("%s drained: it leaves", pod.name)
            self._pod_down(pod, silent=False, state="removed")
        elif isinstance(effect, CheckCallback):
            assert pod.broker is not None
            pod.broker.callback_checked(effect.conn, "ok", now=self.now)

    def _start_run(self, pod: Pod, effect: StartJob) -> None:
        index = effect.job.get("item")
        item = self.items[index] if isinstance(index, int) else None
        run = Run(effect.run_id, effect.conn, effect.job_id, item, effect.service, self.now)
        link = pod.links.get(effect.conn)
        self.checks.run_starts(pod, link, effect, item)
        pod.runs[run.run_id] = run
        self.run_started[effect.job_id] = self.now
        duration = item.job.duration if item is not None else 0.0
        run.end_at = self.now + duration
        self.log(
            "%s starts run %d: %s (%s, %.3fs)",
            pod.name,
            run.run_id,
            effect.job_id,
            effect.service,
            duration,
        )
        if item is not None:
            item.starts += 1
        self.at(run.end_at, self._run_ends, pod, pod.incarnation, run)

    def _run_ends(self, pod: Pod, incarnation: int, run: Run) -> None:
        broker = pod.broker
        if (
            broker is None
            or pod.incarnation != incarnation
            or pod.runs.get(run.run_id) is not run
            or run.end_at != self.now
        ):
            return
        del pod.runs[run.run_id]
        item = run.item
        if run.aborting is not None:
            status: p.Status = "stopped" if run.aborting == "stopped" else "cancelled"
        elif item is not None and item.job.fails:
            status = "failed"
        else:
            status = "ok"
        duration = self.now - run.started
        memory = item.job.memory if item is not None else None
        self._account(pod, run)
        if status == "ok" and item is not None:
            item.ok_runs += 1
        pod.jobs_done += 1
        broker.job_ended(
            run.run_id,
            receipt(status, duration=duration, peak_memory=memory, started_at=run.started),
            now=self.now,
        )
        self.log("%s: run %d (%s) ends %s", pod.name, run.run_id, run.job_id, status)
        self.route_pod(pod)
        self._maybe_quiet()

    def _account(self, pod: Pod, run: Run) -> None:
        busy = pod.busy_time
        busy[run.service] = busy.get(run.service, 0.0) + (self.now - run.started)

    # -- clients ---------------------------------------------------------------------------

    def _client_start(self, client: Client) -> None:
        if client.alive:
            return
        spec = client.spec
        client.incarnation += 1
        client.alive = True
        client.loads = None
        client.timer_at = None
        client.accepted.clear()
        addresses = tuple(self._address(name) for name in spec.addresses)
        jitter = self.choices.unit()
        client.core = ClientCore(
            ClientConfig(
                backend_id=client.backend_id,
                name=client.name,
                version="sim",
                addresses=addresses,
                connect_timeout=spec.connect_timeout,
                retry_tick=spec.retry_tick,
                pool_grow_interval=spec.pool_grow_interval,
                pool_max=spec.pool_max,
                pool_reprobe_interval=spec.pool_reprobe_interval,
                ping_interval=spec.ping_interval,
                ping_timeout=spec.ping_timeout,
                reconnect_min=spec.reconnect_min,
                reconnect_max=spec.reconnect_max,
            ),
            now=self.now,
            random=random.Random(0 if jitter is None else int(jitter * 2**32)),
        )
        self.log("%s starts (backend %s)", client.name, client.backend_id)
        if spec.kind == "dispatcher":
            client.driver = Dispatcher(self, client)
        else:
            client.driver = DirectCaller(self, client)
        self.route_client(client)
        client.driver.start()

    def _address(self, name: str) -> str:
        if name in self.balancers:
            return self.balancers[name].addr
        return self.pods[name].addr

    def _client_crash(self, client: Client, *, silent: bool) -> None:
        if not client.alive:
            return
        self.log("%s crashes%s", client.name, " silently" if silent else "")
        client.alive = False
        client.core = None
        driver = client.driver
        client.driver = None
        if isinstance(driver, DirectCaller):
            driver.crashed()
        for link in list(client.links.values()):
            link.state_c = "closed"
            if not silent:
                self._send(link, "s", "close", None)
        client.links.clear()
        client.dialing.clear()
        self._maybe_quiet()

    def route_client(self, client: Client) -> None:
        """Carry out what the client's core asks for, and arm its timer."""
        core = client.core
        if core is None:
            return
        self._touched_clients.add(client)
        while True:
            frames = core.frames_to_send()
            effects = core.effects()
            if not frames and not effects:
                break
            self._client_frames(client, frames)
            for effect in effects:
                self._client_effect(client, effect)
            if client.core is not core:
                return
        self._arm(client, core.next_deadline())

    def _client_frames(self, client: Client, frames: list[tuple[int, p.Message]]) -> None:
        for conn, messages in _by_connection(frames):
            link = client.links.get(conn)
            if link is not None and link.state_c == "open":
                self._send(link, "s", "frames", messages)

    def _client_effect(self, client: Client, effect: Any) -> None:
        if isinstance(effect, Dial):
            self._dial(client, effect.conn, effect.address)
        elif isinstance(effect, Close):
            client.loads = None
            client.dialing.pop(effect.conn, None)
            link = client.links.pop(effect.conn, None)
            if link is not None:
                link.state_c = "closed"
                self.log("%s closes connection %d: %s", client.name, effect.conn, effect.reason)
                self._send(link, "s", "close", None)
        elif isinstance(effect, Accepted):
            client.accepted[effect.job_id] = effect.conn
        elif isinstance(effect, Finished | Failed):
            self.checks.job_outcome(client, effect)
            item = self.job_items.get(effect.job_id)
            if isinstance(effect, Finished) and item is not None and item.start_of_done is None:
                item.start_of_done = self.run_started.get(effect.job_id)
                item.done_by = client.name
            client.accepted.pop(effect.job_id, None)
            driver = client.driver
            assert driver is not None
            driver.job_ended(effect.job_id, effect)
        elif isinstance(effect, PeerError):
            self.log(
                "%s: connection %d refused a frame: %s", client.name, effect.conn, effect.error.code
            )
        else:
            assert isinstance(effect, PositionReport)

    # -- timers and the database ---------------------------------------------------------

    def _arm(self, holder: Pod | Client, deadline: float | None) -> None:
        if deadline is None:
            return
        if deadline < self.now:
            deadline = self.now
        if holder.timer_at is None or deadline < holder.timer_at:
            holder.timer_at = deadline
            self.at(deadline, self._tick, holder, holder.incarnation)

    def _tick(self, holder: Pod | Client, incarnation: int) -> None:
        if holder.incarnation != incarnation or holder.timer_at != self.now:
            return
        holder.timer_at = None
        core: Broker | ClientCore | None
        if isinstance(holder, Pod):
            core = holder.broker
            if core is not None:
                core.tick(now=self.now)
                self.route_pod(holder)
        else:
            core = holder.core
            if core is not None:
                core.tick(now=self.now)
                self.route_client(holder)
        if core is not None and holder.timer_at == self.now:
            self._spin(holder, core)

    def _spin(self, holder: Pod | Client, core: Broker | ClientCore) -> None:
        """A core woken at its deadline asked to be woken at that same instant again.

        Its timer would fire for ever without the time advancing (a real clock
        moves on by a hair; a mock clock does not). Reported once per core, and
        the clock moved on by the smallest step so that the run goes on.
        """
        if holder.name not in self.spun:
            self.spun.add(holder.name)
            self.violation(
                "timer",
                holder.name,
                f"a timer fell due at {self.now!r}, and after the tick the core asked to be "
                f"woken at {core.next_deadline()!r} again",
            )
        holder.timer_at = math.nextafter(self.now, math.inf)
        self.at(holder.timer_at, self._tick, holder, holder.incarnation)

    def database(
        self,
        client: Client,
        statement: Callable[[float], Any],
        reply: Callable[[Any], None],
        failed: Callable[[], None],
    ) -> None:
        """Run a statement for a client: it reaches the database one latency later
        and runs whole there; its answer comes back one latency after that. Cut
        off from the database, the call fails after :data:`DATABASE_TIMEOUT`;
        an answer lost on the way back fails it too (the statement ran)."""
        incarnation = client.incarnation
        issued = self.now
        if client.db_cut:
            self.at(issued + DATABASE_TIMEOUT, self._db_answer, client, incarnation, failed, ())
            return
        latency = self.choices.sample(self.scenario.database_latency)
        self.at(
            self.now + latency, self._db_runs, client, incarnation, statement, reply, failed, issued
        )

    def _db_runs(
        self,
        client: Client,
        incarnation: int,
        statement: Callable[[float], Any],
        reply: Callable[[Any], None],
        failed: Callable[[], None],
        issued: float,
    ) -> None:
        if client.db_cut and client.incarnation == incarnation:
            self.at(issued + DATABASE_TIMEOUT, self._db_answer, client, incarnation, failed, ())
            return
        result = statement(self.now)
        latency = self.choices.sample(self.scenario.database_latency)
        self.at(
            self.now + latency, self._db_back, client, incarnation, reply, failed, result, issued
        )

    def _db_back(
        self,
        client: Client,
        incarnation: int,
        reply: Callable[[Any], None],
        failed: Callable[[], None],
        result: Any,
        issued: float,
    ) -> None:
        if client.db_cut:
            self.at(issued + DATABASE_TIMEOUT, self._db_answer, client, incarnation, failed, ())
            return
        self._db_answer(client, incarnation, reply, (result,))

    def _db_answer(
        self, client: Client, incarnation: int, fn: Callable[..., None], args: tuple[Any, ...]
    ) -> None:
        if client.incarnation == incarnation and client.alive:
            fn(*args)
            self.route_client(client)


def _by_connection(frames: list[tuple[int, p.Message]]) -> list[tuple[int, list[p.Message]]]:
    """The frames of one input grouped by connection, in order (one packet each)."""
    if len(frames) == 1:
        conn, message = frames[0]
        return [(conn, [message])]
    grouped: dict[int, list[p.Message]] = {}
    for conn, message in frames:
        grouped.setdefault(conn, []).append(message)
    return list(grouped.items())


def _noise_seed(trace: Trace) -> int:
    """The seed of a run's noise: its scenario's name and the seed, stable everywhere."""
    return zlib.crc32(f"{trace.scenario.name}/{trace.seed}/noise".encode()) * 1_000_003 + trace.seed
