"""What drives a simulated client's core: a dispatcher on the queue, or direct callers.

:class:`Dispatcher` is the claim loop of :mod:`trio_broker.trio.dispatcher`
around the real :class:`~trio_broker.core.dispatch.DispatchCore` (and through
it the real :class:`~trio_broker.core.admission.Admission`), on the modelled
queue: it registers its backend (returning rows an earlier life left), claims
once per ``tick_interval`` and at once when an item ends (claims never overlap;
a wake during a claim makes one more), plans each claim with the client core's
instance loads and waiting jobs, reconciles after a claim whose reply was lost,
writes outcomes in batches (retried with back-off), and heartbeats and sweeps
stale backends. Each claimed row becomes one job of the client core; its end is
judged by the core's outcome table (:func:`~trio_broker.core.dispatch.judge`),
``unknown_service`` bounded at ``unknown_service_attempts`` claims (the fylr's
setting), and written once settled (the simulated application has nothing of
its own to settle).

:class:`DirectCaller` is application code that calls ``run()`` on the client
and, for what the outcome table requeues, calls again after the delay (at
least a second for what it requeues "at once": a caller has no queue to hold
the job back).
"""

from __future__ import annotations

from typing import Final

from trio_broker.core.admission import AdmissionConfig, InstanceLoad
from trio_broker.core.client import Failed, Finished
from trio_broker.core.dispatch import Backoff, DispatchConfig, DispatchCore, judge
from trio_broker.core.endings import receipt_failure, run_failure
from trio_broker.core.errors import ClientClosed
from trio_broker.testing.sim.model import Client, Engine, Item
from trio_broker.testing.sim.queue import ClaimedRow, Outcome

__all__ = [
    "DirectCaller",
    "Dispatcher",
    "instance_loads",
    "note_probe",
    "outcome_of",
]

RETRY_AT_ONCE: Final = 1.0
"""A direct caller's wait before calling again for what the table requeues at once."""


def outcome_of(effect: Finished | Failed) -> Exception | None:
    """What the handler of a job ends with: None (it returned) or the exception.

    The library's own rules (:mod:`trio_broker.core.endings`): a receipt ``ok``
    returns; a job the execserver stopped raises ``JobStopped``; any other
    ending ``JobFailed`` (the input's fault); the client core's failures raise
    their error classes (a caller's own cancellation: ``ClientClosed``).
    """
    if isinstance(effect, Finished):
        return receipt_failure(effect.receipt)
    return run_failure(effect) or ClientClosed(f"job {effect.job_id}: {effect.detail}")


def note_probe(client: Client, job_id: str, service: str, now: float) -> None:
    """Remember when a job of ``service`` first waited with no connection announcing it."""
    core = client.core
    assert core is not None
    if service in client.probed or core.state_of(job_id) != "waiting":
        return
    for conn_id in core.ready_connections():
        hello = core.hello(conn_id)
        if hello is not None and not hello.draining and service in hello.services:
            return
    client.probed[service] = now


def instance_loads(client: Client) -> list[InstanceLoad]:
    """One load per ready, non-draining instance (``BrokerClient.instance_loads``).

    Kept until the client's connections or the ``HELLO`` they carry change.
    """
    if client.loads is not None:
        return client.loads
    core = client.core
    assert core is not None
    seen: dict[str, InstanceLoad] = {}
    for conn_id in core.ready_connections():
        hello = core.hello(conn_id)
        if hello is None or hello.draining or hello.instance_id in seen:
            continue
        seen[hello.instance_id] = InstanceLoad(
            instance_id=hello.instance_id,
            processes=hello.processes,
            clients=hello.clients,
            idle=hello.idle,
        )
    client.loads = list(seen.values())
    return client.loads


class Dispatcher:
    """The claim loop of one dispatcher-driven client (see the module docstring)."""

    def __init__(self, engine: Engine, client: Client) -> None:
        self.engine = engine
        self.client = client
        self.incarnation = client.incarnation
        spec = client.spec
        services = frozenset(s.name for s in engine.scenario.services)
        bound = spec.unknown_service_attempts
        self.core = DispatchCore(
            DispatchConfig(
                exec_actions=services,
                admission=AdmissionConfig(
                    cpus=spec.cpus,
                    odd_reserve=spec.odd_reserve,
                    max_in_flight=spec.max_in_flight,
                    db_pool=spec.db_pool,
                ),
                retry_delay=spec.retry_delay,
                unknown_service_attempts={} if bound is None else dict.fromkeys(services, bound),
            )
        )
        self.backend = client.backend_id
        self.running: dict[str, ClaimedRow] = {}
        self.claiming = False
        self.again = False
        self.round = 0
        self.writing = False
        self.write_backoff = Backoff(0.1, 5.0)
        self.claim_backoff = Backoff(0.1, 5.0)
        self.claims = 0

    def alive(self) -> bool:
        return self.client.alive and self.client.incarnation == self.incarnation

    def holds(self, job_id: str) -> bool:
        """Whether the job's claim is still running (not decided yet)."""
        return job_id in self.running

    # -- start ---------------------------------------------------------------------------

    def start(self) -> None:
        queue, backend = self.engine.queue, self.backend

        def register(now: float) -> int:
            queue.register(backend, now=now)
            return queue.return_claimed(backend, now=now)

        self.engine.database(self.client, register, self._registered, self._register_failed)

    def _registered(self, returned: int) -> None:
        self.core.returned(returned)
        engine = self.engine
        engine.at(engine.now + self.client.spec.heartbeat_interval, self._heartbeat)
        self._round(None)

    def _register_failed(self) -> None:
        self.engine.at(self.engine.now + self.claim_backoff.failed(), self._restart)

    def _restart(self) -> None:
        if self.alive():
            self.start()

    # -- claiming ------------------------------------------------------------------------

    def wake(self) -> None:
        """Claim now (an item ended, or stale rows came back)."""
        self.engine.at(self.engine.now, self._round, None)

    def _round(self, generation: int | None) -> None:
        if not self.alive() or (generation is not None and generation != self.round):
            return
        if self.claiming:
            self.again = True
            return
        engine = self.engine
        self.round += 1
        engine.at(engine.now + self.client.spec.tick_interval, self._round, self.round)
        if self.core.needs_reconcile:
            self.claiming = True
            queue, backend, keep = engine.queue, self.backend, self.core.known_ids()
            engine.database(
                self.client,
                lambda now: queue.return_claimed(backend, keep, now=now),
                self._reconciled,
                self._claim_done,
            )
            return
        self._claim()

    def _reconciled(self, returned: int) -> None:
        self.core.reconciled(returned)
        self.claiming = False
        self._claim()

    def _claim(self) -> None:
        client = self.client
        assert client.core is not None
        engine = self.engine
        plan = self.core.plan(
            instance_loads(client), waiting=client.core.waiting_count(), now=engine.now
        )
        if not plan.total:
            self._claim_done()
            return
        self.claiming = True
        queue, backend = engine.queue, self.backend
        engine.database(
            client,
            lambda now: queue.claim(backend, plan, now=now),
            self._claimed,
            self._claim_failed,
        )

    def _claim_failed(self) -> None:
        self.core.claim_failed()
        self._claim_done()

    def _claimed(self, rows: list[ClaimedRow]) -> None:
        core, engine, client = self.core, self.engine, self.client
        core.claimed(rows)
        self.claims += 1
        in_flight = len(self.running) + len(rows)
        if engine.scenario.checks == "full":
            stats = core.statistics()
            if stats.exec_in_flight > stats.exec_limit + stats.odd_reserve:
                engine.violation(
                    "admission",
                    client.name,
                    f"{stats.exec_in_flight} items in flight > limit {stats.exec_limit} "
                    f"+ odd reserve {stats.odd_reserve}",
                )
        spec = client.spec
        if spec.max_in_flight and in_flight > spec.max_in_flight:
            engine.violation(
                "admission",
                client.name,
                f"{in_flight} in flight > max_in_flight {spec.max_in_flight}",
            )
        assert client.core is not None
        for row in rows:
            job_id = f"{row.id}.{row.attempts}"
            self.running[job_id] = row
            item = engine.items[engine.queue.rows[row.id].job]
            engine.job_items[job_id] = item
            engine.log(
                "%s claims %s (%s, priority %d)", client.name, job_id, row.action, row.priority
            )
            client.core.submit(
                job_id, row.action, {"item": item.index}, priority=row.priority, now=engine.now
            )
            note_probe(client, job_id, row.action, engine.now)
        engine.route_client(client)
        self._claim_done()

    def _claim_done(self) -> None:
        self.claiming = False
        if self.again:
            self.again = False
            self.wake()

    # -- ends ----------------------------------------------------------------------------

    def job_ended(self, job_id: str, effect: Finished | Failed) -> None:
        row = self.running.pop(job_id)
        decision = self.core.finished(row, outcome_of(effect))
        self.core.settled(decision)  # the simulated application has no state to settle
        self.engine.log(
            "%s: %s ends %s (%s)",
            self.client.name,
            job_id,
            decision.verdict.outcome,
            decision.verdict.kind,
        )
        self._write()
        self.wake()

    def _write(self) -> None:
        if self.writing or not self.core.pending or not self.alive():
            return
        batch = self.core.take_outcomes()
        if not batch:
            return
        outcomes = [
            Outcome(
                item_id=d.item_id,
                attempts=d.attempts,
                kind=d.verdict.kind,
                delay=d.verdict.delay,
                error=d.verdict.error,
            )
            for d in batch
        ]
        self.writing = True
        queue, backend = self.engine.queue, self.backend
        self.engine.database(
            self.client,
            lambda now: queue.finish(backend, outcomes, now=now),
            self._written,
            self._write_failed,
        )

    def _written(self, applied: set[int]) -> None:
        self.core.written(applied)
        self.writing = False
        self.write_backoff.succeeded()
        engine = self.engine
        for row_id in sorted(applied):
            row = engine.queue.rows[row_id]
            if row.status in ("done", "failed"):
                engine.item_ended(engine.items[row.job])
        self._write()

    def _write_failed(self) -> None:
        self.core.write_failed()
        self.writing = False
        self.engine.at(self.engine.now + self.write_backoff.failed(), self._write)

    # -- heartbeats ------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        if not self.alive():
            return
        engine = self.engine
        queue, backend, stale = engine.queue, self.backend, self.client.spec.stale_after

        def beat(now: float) -> tuple[bool, int]:
            return queue.heartbeat(backend, now=now), queue.requeue_stale(stale, now=now)

        engine.database(self.client, beat, self._beaten, lambda: None)
        engine.at(engine.now + self.client.spec.heartbeat_interval, self._heartbeat)

    def _beaten(self, result: tuple[bool, int]) -> None:
        existed, requeued = result
        if not existed:
            self.engine.log("%s was swept as stale", self.backend)
        if requeued:
            self.engine.log("%s requeued %d rows of stale backends", self.backend, requeued)
            self.wake()


class DirectCaller:
    """Callers that submit straight to one client and retry what the table requeues."""

    def __init__(self, engine: Engine, client: Client) -> None:
        self.engine = engine
        self.client = client
        self.incarnation = client.incarnation
        self.jobs: dict[str, Item] = {}

    def alive(self) -> bool:
        return self.client.alive and self.client.incarnation == self.incarnation

    def holds(self, job_id: str) -> bool:
        """Whether a caller still waits for the job."""
        return job_id in self.jobs

    def start(self) -> None:
        pass

    def submit(self, item: Item) -> None:
        client, engine = self.client, self.engine
        if not self.alive():
            item.ended, item.failure = "abandoned", "its client was down"
            engine.item_ended(item)
            return
        assert client.core is not None
        item.attempts += 1
        job_id = f"{client.name}.{item.index}.{item.attempts}"
        self.jobs[job_id] = item
        engine.job_items[job_id] = item
        job = item.job
        client.core.submit(
            job_id, job.service, {"item": item.index}, priority=job.priority, now=engine.now
        )
        note_probe(client, job_id, job.service, engine.now)
        engine.route_client(client)

    def job_ended(self, job_id: str, effect: Finished | Failed) -> None:
        item = self.jobs.pop(job_id)
        spec = self.client.spec
        verdict = judge(
            outcome_of(effect),
            retry_delay=spec.retry_delay,
            attempts=item.attempts,
            unknown_service_attempts=spec.unknown_service_attempts,
        )
        engine = self.engine
        if verdict.kind == "complete":
            item.ended = "done"
            engine.item_ended(item)
        elif verdict.kind == "fail":
            item.ended, item.failure = "failed", verdict.error
            engine.item_ended(item)
        else:
            engine.at(engine.now + max(verdict.delay, RETRY_AT_ONCE), self._again, item)

    def _again(self, item: Item) -> None:
        if not self.alive():
            item.ended, item.failure = "abandoned", "its client crashed"
            self.engine.item_ended(item)
            return
        self.submit(item)

    def crashed(self) -> None:
        """The process died: its callers died with it."""
        for item in self.jobs.values():
            item.ended, item.failure = "abandoned", "its client crashed"
            self.engine.item_ended(item)
        self.jobs.clear()
