"""The dispatcher: drains the PostgreSQL queue into actions, within admission limits.

Theory of operation
===================

One :class:`Dispatcher` per client process (the reference ``fylr`` daemon) turns
``broker_queue`` rows into running work. It is generic: every action is registered
as an :class:`Action` with a handler that does the work, and optionally a
*settle* hook through which the application learns the one decision about each
item. An *exec-bound* handler runs its command through the broker client itself
(``await client.run(…)``); a *local-bound* one works in this process.

Tasks, all in one nursery (:meth:`Dispatcher.serve`):

- **claimer**: once per ``tick_interval`` (one second), and at once when an item
  finishes, when the broker client's capacity changes (a first ``HELLO``, an
  execserver gone: :meth:`ExecClient.wait_capacity_changed`, watched by a task
  of its own) or :meth:`Dispatcher.wake` is called, it asks the admission
  arithmetic (:mod:`trio_broker.core.admission`) how many items of each kind may
  start, and claims them in *one* statement (:meth:`Store.claim_batch`). With
  nothing free it sends nothing; with an empty queue it sends one claim per
  tick. Claims never overlap: wakes that arrive during a claim cause one more.
- **one task per claimed item** runs its handler; local-bound handlers also hold
  a slot of a CPU-count :class:`trio.CapacityLimiter` (plus the odd-priority
  reserve the claim plan keeps for interactive work).
- **writer**: records outcomes, batched, in one statement each
  (:meth:`Store.finish`), retrying until the database takes them.
- **heartbeat**: every ``heartbeat_interval`` it marks this backend alive,
  re-checks its own claims (rows held under its id that it does not know go back
  to the queue; items whose row it no longer holds, requeued by another node's
  sweep or lost by a database restart, are cancelled and their outcome
  discarded: :meth:`DispatchCore.recheck <trio_broker.core.dispatch.DispatchCore.recheck>`),
  and requeues the rows of backends silent for ``stale_after`` (any survivor
  does this for a dispatcher that was killed).

One verdict per item. Every decision about an item is the sans-IO
:class:`~trio_broker.core.dispatch.DispatchCore`'s, taken once, when its
handler ends; this module claims, runs, settles and writes for it. A handler
*returns* (the item is complete: its row is deleted) or *raises*, and never
judges what it raised: what each exception means is the one outcome table of
:mod:`trio_broker.core.dispatch`: ``NoSlot``, ``JobStopped`` and
``UnknownService`` requeue after ``retry_delay`` (``UnknownService`` fails as
``ServiceNotOffered`` from the action's ``unknown_service_attempts``-th claim
on); ``NoExecserver``, ``JobLost``, ``ClientClosed`` and ``StoreUnavailable``
requeue at once; ``RetryLater`` after its own delay (or ``retry_delay``);
anything else, a failed job (``JobFailed``) included, fails the item: its row
stays ``failed`` with the exception's text, its attempts and its claim, for
someone to read and requeue. The handler's end is caught with ``except*`` (so an
exception group is judged by the table, and a cancellation inside one still
cancels); a handler that was cancelled (shutdown) has no outcome, and its row
goes back to the queue.

Settling. The decision is then handed to the action's ``settle`` hook, once:
``await settle(item, decision)``, for the application to move its own state by
it (a file back to where its step started when the item is requeued, to its
error when it failed) and to describe it (the decision's ``verdict.cause`` is
the exception that decided: a receipt, a notice). The hook cannot change the
decision. The decision is written only once the hook returned; a hook that
raises ``StoreUnavailable`` is called again after a back-off (settling must be
safe to repeat), one that raises anything else is logged and the decision
written as it is. Cancelled while settling (shutdown), the item has no outcome
and its row goes back to the queue, like a cancelled handler's.

Settled but not written. The hook's writes and the outcome's are two
transactions: a process killed between them leaves the application's state
settled and the row claimed, and that row comes back to the queue (this
backend's next start returns it, or a survivor's sweep requeues it) to run
again. So the rule for a handler: a step whose state already shows that it
*failed* for good raises again (the fylr raises ``FailedEarlier`` with the
reason its file recorded), never returns; the replayed failure is then judged,
settled (a no-op the second time) and written like the first, and the row
stays ``failed`` for someone to read and requeue. A handler that returned
there would have its row deleted as complete, and the failure lost. A
requeue decision needs nothing of the kind: its replay simply runs the step.

Admission. The core plans each claim with the adaptive admission of
:mod:`trio_broker.core.admission`, fed the client's
:meth:`ExecClient.instance_loads`, :meth:`ExecClient.waiting` and the time (the
rise above the base accumulates there, not here); local-bound items are bounded
by ``local_workers`` plus a reserve for odd priorities. An item is in flight
from its claim until its handler ends.

Queued steps and waiting callers. The dispatcher runs *queued* steps: an
action's handler that could not run now (no slot in time, no execserver…) is
requeued and tried again later, since nobody waits for it. Work a caller waits
for (an on-demand request) does not go through the dispatcher and must never be
requeued: run it under :func:`run_on_demand`, which turns what the outcome table
would requeue into :class:`OnDemandFailed` with status 503 and the reason (500
for a failure), for the caller to answer at once
(:func:`~trio_broker.core.callers.answer_caller`).

Failures. A database call that fails (:class:`~trio_broker.core.errors.StoreUnavailable`)
is retried after a back-off that doubles from ``retry_min`` to ``retry_max``.
Outcomes are fenced to their claim, so a retried outcome never touches a row
claimed again since. A claim whose reply was lost may have claimed rows this
process does not know: before its next claim the dispatcher returns every row
it holds except the ones it knows (``return_claimed(keep=…)``). So a database
restart loses and duplicates nothing.

Shutdown (the ``serve`` task is cancelled): running handlers are cancelled (an
exec-bound job is withdrawn or cancelled by the client), outcomes already known
are written, and every row still claimed is returned to the queue at once; the
backend is unregistered. All of that is shielded and bounded by
``shutdown_timeout``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import attrs
import trio

from trio_broker.core.admission import AdmissionConfig, ClaimPlan, InstanceLoad
from trio_broker.core.callers import CallerAnswer, answer_caller
from trio_broker.core.dispatch import Backoff, Decision, DispatchConfig, DispatchCore, Key
from trio_broker.core.errors import RetryLater, StoreUnavailable
from trio_broker.trio import tracing
from trio_broker.trio.attempt_note import AttemptNote, noting
from trio_broker.trio.host import cpu_count
from trio_broker.trio.store import TRACEPARENT, ClaimRequest, Outcome, QueueItem, Store

__all__ = [
    "Action",
    "Dispatcher",
    "DispatcherConfig",
    "DispatcherStatistics",
    "ExecClient",
    "OnDemandFailed",
    "RetryLater",
    "run_on_demand",
    "serve_dispatcher",
]

log = logging.getLogger("trio_broker.trio.dispatcher")

Handler = Callable[[QueueItem], Awaitable[None]]
Settle = Callable[[QueueItem, Decision], Awaitable[None]]


class ExecClient(Protocol):
    """What the dispatcher needs of the broker client.

    :class:`~trio_broker.trio.client.BrokerClient` is the real one.
    """

    def instance_loads(self) -> Sequence[InstanceLoad]:
        """One load per connected, non-draining execserver instance."""
        ...

    def waiting(self) -> int:
        """This client's jobs now waiting at execservers for a slot."""
        ...

    async def wait_capacity_changed(self) -> None:
        """Return once the execservers' capacity (instances, slots, clients) changed."""
        ...


@attrs.frozen
class Action:
    """A kind of queue item and what to do with it.

    Attributes:
        name: the ``action`` column of the rows it handles.
        exec_bound: whether the work holds an execserver slot (admission by the
            execservers) or runs locally (the CPU-count semaphore).
        handler: ``async (QueueItem) -> None``; how its end maps to the item's
            outcome is the table of :mod:`trio_broker.core.dispatch`.
        settle: ``async (QueueItem, Decision) -> None``, called once with the
            decision about each item of this action before it is written (see
            *Settling* in the module docstring); ``None``: nothing to settle.
        unknown_service_attempts: from an item's this-many-th claim on, an
            ``UnknownService`` fails it (``ServiceNotOffered``) instead of
            requeueing it; ``None``: it follows the broker client's verdict (a
            ``BrokerClient`` raises ``ServiceNotOffered`` once its pool looked for
            the service a whole ``pool_reprobe_interval``).
    """

    name: str
    exec_bound: bool
    handler: Handler
    settle: Settle | None = attrs.field(default=None, kw_only=True)
    unknown_service_attempts: int | None = attrs.field(default=None, kw_only=True)


def _not_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be at least 0, got {value}")


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be more than 0, got {value}")


@attrs.frozen(kw_only=True)
class DispatcherConfig:
    """How a dispatcher claims, heartbeats and retries. Durations are seconds.

    Attributes:
        backend_id: this process's id in ``claimed_by`` and ``backends``; unique
            among the live processes on one database.
        name: shown beside the backend id.
        tick_interval: claim at least this often.
        heartbeat_interval: mark this backend alive (and sweep stale ones) this often.
        stale_after: a backend silent this long has its rows requeued (with the
            default heartbeat, a killed process's rows are back within a minute).
        local_workers: local-bound items of any priority in flight at most; 0 =
            the CPUs this process may use (affinity and cgroup quota). Odd
            priorities may take a quarter more (at least one) beyond it.
        admission: CPU count, odd reserve, ``max_in_flight`` (0 = automatic),
            whether idle slots count; its ``db_pool`` is replaced by the store's
            pool size, and a ``cpus`` of ``None`` by the CPUs this process may use.
        retry_delay: the requeue delay of the outcomes that try again *later*
            (``NoSlot``, ``JobStopped``, ``UnknownService``, a ``RetryLater``
            without a delay of its own; see :mod:`trio_broker.core.dispatch`):
            the one delay of the queue, which no handler repeats.
        retry_min, retry_max: the back-off range after a database error (and
            a settle hook's).
        shutdown_timeout: bound on writing outcomes and returning rows at shutdown.
    """

    backend_id: str
    name: str = ""
    tick_interval: float = attrs.field(default=1.0, validator=_positive)
    heartbeat_interval: float = attrs.field(default=10.0, validator=_positive)
    stale_after: float = attrs.field(default=45.0, validator=_positive)
    local_workers: int = attrs.field(default=0, validator=_not_negative)
    admission: AdmissionConfig = attrs.field(factory=AdmissionConfig)
    retry_delay: float = attrs.field(default=60.0, validator=_not_negative)
    retry_min: float = attrs.field(default=0.1, validator=_positive)
    retry_max: float = attrs.field(default=5.0, validator=_positive)
    shutdown_timeout: float = attrs.field(default=10.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if not self.backend_id:
            raise ValueError("backend_id must not be empty")
        if self.stale_after <= self.heartbeat_interval:
            raise ValueError(
                f"stale_after ({self.stale_after:g}) must exceed heartbeat_interval "
                f"({self.heartbeat_interval:g}), or live backends would be swept"
            )


@attrs.frozen(kw_only=True)
class DispatcherStatistics:
    """A snapshot of a dispatcher (:meth:`Dispatcher.statistics`).

    Attributes:
        backend_id: whose.
        exec_limit: exec-bound items allowed in flight at the last claim decision.
        odd_reserve: the slots beyond ``exec_limit`` only odd priorities may take.
        exec_base: the fair share plus the CPU count, at the last claim decision.
        admission_rise: the accumulated rise above the base (idle slots absorbed).
        max_in_flight: the cap on ``exec_limit + odd_reserve``.
        exec_in_flight, odd_in_flight: exec-bound items in flight (all; odd ones).
        peak_exec_in_flight: the most exec-bound items ever in flight at once.
        local_limit, local_in_flight: the local-bound semaphore and its use.
        local_reserve, local_odd_in_flight: the local slots only odd priorities
            may take beyond ``local_limit``; odd local items in flight.
        queue_deep: whether the last claim got all the exec-bound items it asked for.
        ticks: claim decisions taken.
        claims: claim statements sent.
        claimed: items claimed.
        completed, requeued, failed: outcomes recorded.
        fenced: outcomes that no longer counted (the row was requeued meanwhile).
        returned: rows returned to the queue (reconciliation after a lost claim
            reply, rows held unknown to this dispatcher found by a heartbeat's
            re-check, and shutdown).
        lost: items whose row a heartbeat's re-check found no longer held by
            this backend (requeued by another node's sweep, claimed by another
            backend, a claim a database restart lost): cancelled, no outcome.
        reclaimed: rows a claim returned that this dispatcher already ran under
            the same claim (its first commit was lost): not started twice.
        stale_requeued: rows of stale backends this dispatcher's sweeps requeued.
        store_errors: database calls that failed.
        pending_outcomes: outcomes known but not yet written.
    """

    backend_id: str
    exec_limit: int
    odd_reserve: int
    exec_base: int
    admission_rise: int
    max_in_flight: int
    exec_in_flight: int
    odd_in_flight: int
    peak_exec_in_flight: int
    local_limit: int
    local_in_flight: int
    local_reserve: int
    local_odd_in_flight: int
    queue_deep: bool
    ticks: int
    claims: int
    claimed: int
    completed: int
    requeued: int
    failed: int
    fenced: int
    returned: int
    lost: int
    reclaimed: int
    stale_requeued: int
    store_errors: int
    pending_outcomes: int


class Dispatcher:
    """Drains ``broker_queue`` into registered actions (see the module docstring).

    Args:
        store: the queue database (opened).
        actions: the actions this process handles; rows of other actions are
            never claimed by it.
        config: identity, intervals, admission.
        exec_client: the broker client exec-bound admission follows (``None``:
            no execserver, so exec-bound actions are never claimed).

    Raises:
        ValueError: two actions share a name.
    """

    def __init__(
        self,
        store: Store,
        actions: Iterable[Action],
        config: DispatcherConfig,
        *,
        exec_client: ExecClient | None = None,
    ) -> None:
        self._store = store
        self.config = config
        self._exec = exec_client
        self._actions: dict[str, Action] = {}
        for action in actions:
            if action.name in self._actions:
                raise ValueError(f"action {action.name!r} is registered twice")
            self._actions[action.name] = action
        self._exec_names = tuple(sorted(a.name for a in self._actions.values() if a.exec_bound))
        self._local_names = tuple(
            sorted(a.name for a in self._actions.values() if not a.exec_bound)
        )
        local_limit = config.local_workers or cpu_count()
        admission = attrs.evolve(config.admission, db_pool=store.pool_size)
        if admission.cpus is None:
            admission = attrs.evolve(admission, cpus=cpu_count())
        core_config = DispatchConfig(
            exec_actions=frozenset(self._exec_names),
            local_actions=frozenset(self._local_names),
            local_limit=local_limit,
            admission=admission,
            retry_delay=config.retry_delay,
            unknown_service_attempts={
                a.name: a.unknown_service_attempts
                for a in self._actions.values()
                if a.unknown_service_attempts is not None
            },
        )
        self._core = DispatchCore(core_config)
        # the claim plan keeps even items within local_limit; odd ones may use the reserve
        self._local_slots = trio.CapacityLimiter(local_limit + core_config.local_reserve)
        self._claim_wanted = trio.Event()
        self._outcome_ready = trio.Event()
        self._changed = trio.Event()
        self._counters = dict.fromkeys(("ticks", "stale_requeued", "store_errors"), 0)
        self._store_down = False
        # a claim and a re-check of the claims never overlap (see _recheck)
        self._claim_lock = trio.Lock()
        self._scopes: dict[Key, trio.CancelScope] = {}
        self._lost: set[Key] = set()
        # what each decided item's jobs told (instance, decisive line), until written
        self._notes: dict[Key, AttemptNote] = {}

    # -- public API ------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[Dispatcher] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Register, then claim and run items until cancelled.

        Reports itself to ``task_status.started()`` once registered in the
        database (waiting, with back-off, while the database is unreachable).
        On cancellation it returns every row it holds to the queue.
        """
        await self._register()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer)
                nursery.start_soon(self._heartbeats)
                nursery.start_soon(self._claimer, nursery)
                if self._exec is not None and self._exec_names:
                    nursery.start_soon(self._watch_capacity, self._exec)
                task_status.started(self)
        finally:
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + self.config.shutdown_timeout
                await self._shutdown()

    def wake(self) -> None:
        """Claim now instead of at the next tick (after enqueueing urgent work)."""
        self._claim_wanted.set()

    async def recheck(self) -> None:
        """Re-check this backend's claims now instead of at the next heartbeat.

        After an operator took a row away (cancelled it, deleted its file): the
        item whose row is no longer held is cancelled at once (a running job
        gets the broker's ``CANCEL``) and no outcome of it is written.

        Raises:
            StoreUnavailable: the database could not be read (the next
                heartbeat re-checks).
        """
        await self._recheck()

    def statistics(self) -> DispatcherStatistics:
        """A frozen snapshot of the counters and what is in flight."""
        core = self._core.statistics()
        c = self._counters
        return DispatcherStatistics(
            backend_id=self.config.backend_id,
            exec_limit=core.exec_limit,
            odd_reserve=core.odd_reserve,
            exec_base=core.exec_base,
            admission_rise=core.admission_rise,
            max_in_flight=core.max_in_flight,
            exec_in_flight=core.exec_in_flight,
            odd_in_flight=core.odd_in_flight,
            peak_exec_in_flight=core.peak_exec_in_flight,
            local_limit=core.local_limit,
            local_in_flight=core.local_in_flight,
            local_reserve=core.local_reserve,
            local_odd_in_flight=core.local_odd_in_flight,
            queue_deep=core.queue_deep,
            ticks=c["ticks"],
            claims=core.claims,
            claimed=core.claimed,
            completed=core.completed,
            requeued=core.requeued,
            failed=core.failed,
            fenced=core.fenced,
            returned=core.returned,
            lost=core.lost,
            reclaimed=core.reclaimed,
            stale_requeued=c["stale_requeued"],
            store_errors=c["store_errors"],
            pending_outcomes=core.pending_outcomes,
        )

    async def wait_until(self, predicate: Callable[[DispatcherStatistics], bool]) -> None:
        """Wait until ``predicate(self.statistics())`` holds; re-checked after every change."""
        while not predicate(self.statistics()):
            await self._changed.wait()

    # -- claiming --------------------------------------------------------------------------

    async def _claimer(self, nursery: trio.Nursery) -> None:
        core = self._core
        backoff = Backoff(self.config.retry_min, self.config.retry_max)
        deadline = trio.current_time()
        while True:
            with trio.move_on_at(deadline):
                await self._claim_wanted.wait()
            self._claim_wanted = trio.Event()
            deadline = trio.current_time() + self.config.tick_interval
            self._counters["ticks"] += 1
            try:
                async with self._claim_lock:
                    if core.needs_reconcile:
                        await self._return_unknown()
                    plan = self._plan()
                    if plan.total:
                        items = await self._claim(plan)
                        self._start(nursery, items)
            except StoreUnavailable as exc:
                self._store_failed("claim", exc)
                deadline = trio.current_time() + backoff.failed()
            else:
                backoff.succeeded()
                self._store_ok()
            self._notify()

    async def _watch_capacity(self, exec_client: ExecClient) -> None:
        """Claim at once whenever the execservers' capacity changes."""
        while True:
            await exec_client.wait_capacity_changed()
            self._claim_wanted.set()

    def _plan(self) -> ClaimPlan:
        now = trio.current_time()
        if self._exec is not None and self._exec_names:
            loads, waiting = self._exec.instance_loads(), self._exec.waiting()
            return self._core.plan(loads, waiting=waiting, now=now)
        return self._core.plan(now=now)

    async def _claim(self, plan: ClaimPlan) -> list[QueueItem]:
        requests = [
            ClaimRequest(limit=plan.general, actions=self._exec_names),
            ClaimRequest(limit=plan.odd_only, actions=self._exec_names, odd_only=True),
            ClaimRequest(limit=plan.local, actions=self._local_names),
            ClaimRequest(limit=plan.local_odd_only, actions=self._local_names, odd_only=True),
        ]
        try:
            return await self._store.claim_batch(self.config.backend_id, requests)
        except StoreUnavailable:
            # the claim may have taken rows whose reply never came
            self._core.claim_failed()
            raise

    async def _return_unknown(self) -> None:
        core = self._core
        returned = await self._store.return_claimed(self.config.backend_id, keep=core.known_ids())
        core.reconciled(returned)
        if returned:
            log.info("returned %d rows claimed by a claim whose reply was lost", returned)

    def _start(self, nursery: trio.Nursery, items: Sequence[QueueItem]) -> None:
        fresh = self._core.claimed(items)
        if len(fresh) < len(items):
            log.info(
                "%d claimed rows are claims this process already runs (their first "
                "commit was lost): not started twice",
                len(items) - len(fresh),
            )
        for item in fresh:
            self._scopes[item.id, item.attempts] = trio.CancelScope()
            nursery.start_soon(self._run_item, item, self._actions[item.action])

    # -- running ---------------------------------------------------------------------------

    async def _run_item(self, item: QueueItem, action: Action) -> None:
        key = (item.id, item.attempts)
        settled = False
        try:
            # the scope a heartbeat's re-check cancels when the row is no longer ours
            with self._scopes[key]:
                settled = await self._run_and_settle(item, action)
        finally:
            del self._scopes[key]
            if not settled:
                self._notes.pop(key, None)
            if key in self._lost:
                # the row is another holder's now: no decision of this run counts
                self._lost.discard(key)
            elif not settled:
                # cancelled (shutdown) before its decision was settled: no outcome,
                # the row is returned
                self._core.abandoned(item)
            self._claim_wanted.set()
            self._notify()

    async def _run_and_settle(self, item: QueueItem, action: Action) -> bool:
        """Run the handler, decide, settle; whether the decision is queued for writing."""
        traceparent = item.payload.get(TRACEPARENT)
        with tracing.span(
            "trio_broker.step",
            traceparent=traceparent if isinstance(traceparent, str) else None,
            remote=True,
            kind="consumer",
            attributes={
                "trio_broker.action": item.action,
                "trio_broker.item": item.id,
                "trio_broker.file_ref": item.file_ref,
                "trio_broker.priority": item.priority,
                "trio_broker.attempt": item.attempts,
            },
        ) as opened:
            return await self._run_and_settle_traced(item, action, opened)

    async def _run_and_settle_traced(
        self, item: QueueItem, action: Action, opened: tracing.Span
    ) -> bool:
        core = self._core
        key = (item.id, item.attempts)
        failure: BaseException | None = None
        with noting() as note:
            try:
                if action.exec_bound:
                    await action.handler(item)
                else:
                    async with self._local_slots:
                        await action.handler(item)
            except* Exception as group:
                failure = group
        if key in self._lost:
            return False
        decision = core.finished(item, failure)  # the one decision; its slot is free
        tracing.set_attributes(opened, {"trio_broker.outcome": decision.verdict.outcome})
        if decision.verdict.kind == "fail":
            tracing.set_error(opened, decision.verdict.error or "failed")
        self._notes[key] = note
        self._claim_wanted.set()
        if action.settle is not None:
            await self._settle(action.settle, item, decision)
        if key in self._lost:
            self._notes.pop(key, None)
            return False
        core.settled(decision)
        if decision.verdict.kind == "fail":
            log.info("item %d (%s) failed: %s", item.id, item.action, decision.verdict.error)
        self._outcome_ready.set()
        return True

    async def _settle(self, settle: Settle, item: QueueItem, decision: Decision) -> None:
        """Hand the decision to the action's hook; again after a back-off while the
        database is unavailable."""
        backoff = Backoff(self.config.retry_min, self.config.retry_max)
        while True:
            try:
                await settle(item, decision)
            except StoreUnavailable as exc:
                self._store_failed("settle", exc)
                await trio.sleep(backoff.failed())
                continue
            except Exception:
                log.exception(
                    "settling item %d (%s) by its decision (%s) failed; it is written as it is",
                    item.id,
                    item.action,
                    decision.verdict.outcome,
                )
            else:
                self._store_ok()
            return

    # -- writing outcomes ------------------------------------------------------------------

    async def _writer(self) -> None:
        backoff = Backoff(self.config.retry_min, self.config.retry_max)
        while True:
            if not self._core.pending:
                await self._outcome_ready.wait()
                self._outcome_ready = trio.Event()
                continue
            try:
                await self._write_pending()
            except StoreUnavailable as exc:
                self._store_failed("outcome", exc)
                await trio.sleep(backoff.failed())
            else:
                backoff.succeeded()
                self._store_ok()

    async def _write_pending(self) -> None:
        core = self._core
        batch = core.take_outcomes()
        if not batch:
            return
        outcomes = [self._outcome(d) for d in batch]
        try:
            applied = await self._store.finish(self.config.backend_id, outcomes)
        except BaseException:
            core.write_failed()
            raise
        for d in batch:
            self._notes.pop(d.key, None)
        core.written(applied)
        self._notify()

    def _outcome(self, decision: Decision) -> Outcome:
        """The outcome to write for a decision, with what its jobs told."""
        note = self._notes.get(decision.key)
        verdict = decision.verdict
        return Outcome(
            item_id=decision.item_id,
            attempts=decision.attempts,
            kind=verdict.kind,
            delay=verdict.delay,
            error=verdict.error,
            outcome=verdict.outcome,
            instance_id=None if note is None else note.instance_id,
            line=None if note is None else note.line,
        )

    # -- heartbeats ------------------------------------------------------------------------

    async def _register(self) -> None:
        backoff = Backoff(self.config.retry_min, self.config.retry_max)
        while True:
            try:
                await self._store.register_backend(self.config.backend_id, self.config.name)
                # rows held under this id by an earlier life of this process
                returned = await self._store.return_claimed(self.config.backend_id)
            except StoreUnavailable as exc:
                self._store_failed("register", exc)
                await trio.sleep(backoff.failed())
            else:
                self._store_ok()
                self._core.returned(returned)
                if returned:
                    log.info("returned %d rows left claimed by an earlier start", returned)
                return

    async def _heartbeats(self) -> None:
        while True:
            await trio.sleep(self.config.heartbeat_interval)
            try:
                existed = await self._store.heartbeat(self.config.backend_id, self.config.name)
                if not existed:
                    log.warning(
                        "backend %s was swept as stale: its rows went back to the queue",
                        self.config.backend_id,
                    )
                await self._recheck()
                requeued = await self._store.requeue_stale(self.config.stale_after)
            except StoreUnavailable as exc:
                self._store_failed("heartbeat", exc)
                continue
            self._store_ok()
            if requeued:
                log.info("requeued %d rows of stale backends", requeued)
                self._counters["stale_requeued"] += requeued
                self._claim_wanted.set()
            self._notify()

    async def _recheck(self) -> None:
        """Compare the claims this dispatcher knows with the ones the database shows.

        Rows held but unknown (a claim or an outcome whose commit a database
        restart lost) go back to the queue; items whose row is no longer held
        (requeued by a sweep, taken by another backend, a claim that was lost)
        are cancelled without an outcome. Under the claim lock: no claim's reply
        is outstanding, so every row held is either known or truly unknown.
        """
        core = self._core
        async with self._claim_lock:
            reconciling = core.needs_reconcile
            returned, held = await self._store.recheck_claims(
                self.config.backend_id, keep=core.known_ids()
            )
            if reconciling:
                core.reconciled(returned)
            else:
                core.returned(returned)
            lost = core.recheck(held)
        if returned:
            log.warning("returned %d rows this backend held without knowing them", returned)
        for key in lost:
            self._lost.add(key)
            self._scopes[key].cancel()
        if lost:
            log.warning(
                "%d items' rows are no longer held by this backend (requeued or taken "
                "meanwhile): their handlers are cancelled, their outcomes discarded",
                len(lost),
            )
            self._claim_wanted.set()

    # -- shutdown --------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        core = self._core
        backend_id = self.config.backend_id
        core.close()
        returned: int | None = None
        try:
            if core.pending:
                await self._write_pending()
            returned = await self._store.return_claimed(backend_id)
            await self._store.unregister_backend(backend_id)
        except StoreUnavailable as exc:
            log.warning(
                "could not return the rows of %s at shutdown (%s): they go back to the "
                "queue when its heartbeat is stale",
                backend_id,
                exc,
            )
        finally:
            core.stopped(returned)
            self._notify()

    # -- helpers ---------------------------------------------------------------------------

    def _store_failed(self, what: str, exc: StoreUnavailable) -> None:
        self._counters["store_errors"] += 1
        if not self._store_down:
            self._store_down = True
            log.warning("queue database unavailable (%s): %s; retrying", what, exc)
        else:
            log.debug("queue database still unavailable (%s): %s", what, exc)

    def _store_ok(self) -> None:
        if self._store_down:
            self._store_down = False
            log.info("queue database reachable again")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


async def serve_dispatcher(
    store: Store,
    actions: Iterable[Action],
    config: DispatcherConfig,
    *,
    exec_client: ExecClient | None = None,
    task_status: trio.TaskStatus[Dispatcher] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a :class:`Dispatcher` until cancelled; ``task_status.started()`` gets it.

    ``dispatcher = await nursery.start(serve_dispatcher, store, actions, config)``.
    """
    await Dispatcher(store, actions, config, exec_client=exec_client).serve(task_status=task_status)


T = TypeVar("T")


class OnDemandFailed(Exception):
    """Work a caller waits for did not succeed; answer the caller with this, at once.

    Attributes:
        answer: the status (503 unavailable, 500 failed), reason and retry hint.
    """

    def __init__(self, answer: CallerAnswer) -> None:
        super().__init__(answer.error)
        self.answer = answer


async def run_on_demand(work: Callable[[], Awaitable[T]]) -> T:
    """Run work a caller waits for; what a queued step would requeue on is an error.

    ``NoSlot``, ``NoExecserver``, ``JobLost`` and the other requeue outcomes of
    :mod:`trio_broker.core.dispatch` raise :class:`OnDemandFailed` with status 503
    and their reason; anything else with 500. Cancellation passes through.

    Returns:
        What ``work`` returned.

    Raises:
        OnDemandFailed: ``work`` raised an exception (chained as its cause).
    """
    try:
        return await work()
    except* Exception as group:
        failure = group.exceptions[0] if len(group.exceptions) == 1 else group
        raise OnDemandFailed(answer_caller(failure)) from failure
