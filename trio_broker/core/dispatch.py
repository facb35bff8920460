"""The dispatch core: what becomes of a claimed queue item, and what is in flight.

Theory of operation
===================

A dispatcher claims rows of the queue, runs each through the handler of its
action, decides once how it ended, lets the application settle its own state
by that decision, and writes it. This module is every decision of that loop,
without I/O: the trio dispatcher (:mod:`trio_broker.trio.dispatcher`) claims,
runs, settles and writes for it and owns no policy.

The outcome table
-----------------

A handler ends in one of these outcomes; :data:`OUTCOMES` is the table itself,
in this order, and :func:`judge` the only reader of it:

=========================  ===============================  =================================
outcome                    the handler…                     the item
=========================  ===============================  =================================
``ok``                     returns                          complete: its row is deleted
``no_slot``                raises ``NoSlot``                requeued after ``retry_delay``
``stopped``                raises ``JobStopped``            requeued after ``retry_delay``
``unknown_service``        raises ``UnknownService``        requeued after ``retry_delay``
``no_execserver``          raises ``NoExecserver``          requeued at once
``lost``                   raises ``JobLost``               requeued at once
``client_closed``          raises ``ClientClosed``          requeued at once
``store_unavailable``      raises ``StoreUnavailable``      requeued at once
``retry_later``            raises ``RetryLater``            requeued after its ``delay``
``service_not_offered``    raises ``ServiceNotOffered``     failed, with the exception's text
``failed``                 raises anything else             failed, with the exception's text
=========================  ===============================  =================================

Why. *Later* (``retry_delay``, a minute by default) when trying again at once
would meet the same wall: every slot was busy for all of ``connect_timeout``
(``no_slot``); the execserver running the job went away in the middle, as a
whole fleet does during a rolling restart (``stopped``); no execserver offers
the service, which is what a fleet that is being redeployed looks like, so the
item waits instead of failing its file (``unknown_service``; the client raises
it only once no pool can still reach a server offering the service).
*At once* when the queue itself already holds the item back, or the reason is
gone by the time it is claimed again: while no execserver is connected nothing
exec-bound is claimed at all (``no_execserver``); the connection that broke
under a running job is redialled and other execservers may be free (``lost``);
this process is closing and another one takes the item (``client_closed``); the
handler's own database work failed, and the claim loop backs off until the
database answers (``store_unavailable``). A handler's own temporary reason
(``retry_later``) names its delay, or leaves it to ``retry_delay``
(``RetryLater(None, …)``). Every step a handler runs must be safe
to run twice for that to hold: the item may have done its work before its end
was lost. Anything else is a bug or bad input that would fail the same way
again, so the item fails and its row keeps the text for someone to read
(``failed``): a job that ran and failed
(:class:`~trio_broker.core.endings.JobFailed`, whose text is the receipt's decisive
line) is one of these.

*Bounded.* A service nobody offers may be a fleet being redeployed, or a recipe
naming a service that does not exist (a misspelling), which would wait for ever.
The client core bounds it, by time: its pool looks for the service a whole
``pool_reprobe_interval`` (behind a balancer it keeps dialling replicas while a
job waits), answering ``UnknownService`` meanwhile and
:class:`~trio_broker.core.errors.ServiceNotOffered` after, which fails the item
(``service_not_offered``); this table only follows that verdict. An action may
still bound ``UnknownService`` by claims
(:attr:`DispatchConfig.unknown_service_attempts`, none by default) for a client
that gives no verdict of its own: from the claim that reaches the bound on, an
``UnknownService`` is judged as the ``ServiceNotOffered`` it has become
(``ServiceNotOffered: <its text>, after <attempts> attempts``). Counting claims
is no substitute for the client's verdict: claims come every ``retry_delay``
whatever the pool did meanwhile, so a count can end the search before the pool
had a full re-probe (the reference fylr sets no bound).

Exception groups are judged by the same table: the group is split by each
row's exception types in turn (:meth:`BaseExceptionGroup.split`), what no row
takes is ``failed``, and of the parts, a failure wins (a bug must surface, not
be retried forever), else the longest delay (the most patient reason is the
safe one), ties going to the earlier row. A group of one exception is judged
as that exception. A verdict names its :attr:`~Verdict.cause`: the exception of
the deciding part (its first leaf), for the application to describe the
decision with (a receipt, a notice), never to change it.

Queued steps and waiting callers
--------------------------------

The table is for *queued* steps, which nobody waits for: a step that could not
run now goes back to the queue. A caller that waits for its answer (an
on-demand request) must get an error at once instead:
:func:`trio_broker.core.callers.answer_caller` is the table for it.

The bookkeeping
---------------

:class:`DispatchCore` holds what the loop knows between statements:

- the admission plan (:mod:`trio_broker.core.admission`): :meth:`~DispatchCore.plan`
  feeds the adaptive :class:`~trio_broker.core.admission.Admission` the
  execservers' figures and the time, and asks how many items of each kind a
  claim may take; :meth:`~DispatchCore.claimed` admits the rows the claim
  returned and refuses (before any change) more than the plan allowed, so
  exec-bound items in flight never exceed the limit plus the odd reserve (never
  more than ``max_in_flight``), even ones never exceed the limit, and local-bound
  ones never exceed the local limit plus its odd reserve (even ones the limit);
- the items in flight: exec-bound (all, and odd ones) and local-bound counts,
  the peak, from the claim until :meth:`~DispatchCore.finished` (the one
  decision) or :meth:`~DispatchCore.abandoned` (cancelled at shutdown: no
  decision, the row goes back to the queue);
- the decisions being settled: the application moves its own state by the
  decision (a file back to where its step started, or to its error) before the
  decision may be written (:meth:`~DispatchCore.settled`); cancelled at
  shutdown meanwhile, the item is abandoned and its row goes back (every
  settling is fenced by the state it expects, so the step's next run finds its
  way);
- the decisions not yet written, handed out one batch at a time
  (:meth:`~DispatchCore.take_outcomes`, then :meth:`~DispatchCore.written` or
  :meth:`~DispatchCore.write_failed`);
- every row claimed and not yet written (*unwritten*): the rows to keep when the
  reply of a claim was lost and the backend's other rows go back
  (:meth:`~DispatchCore.known_ids`), and what shutdown returns.

Invariants (:meth:`DispatchCore.check_invariants`): the counts in flight are
the running items' counts; every unwritten row is exactly one of running,
settling, decided (pending or being written) or abandoned; a row has at most one
decision; the peak is at least what is in flight. Each claimed row therefore
ends with exactly one written outcome, or goes back to the queue.

Everything here is pure: no trio, no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal, Protocol, TypeAlias, TypeVar

import attrs

from trio_broker.core.admission import (
    Admission,
    AdmissionConfig,
    ClaimPlan,
    InstanceLoad,
    is_odd,
    local_reserve,
    plan_claims,
)
from trio_broker.core.errors import (
    ClientClosed,
    DispatchUsageError,
    JobLost,
    JobStopped,
    NoExecserver,
    NoSlot,
    RetryLater,
    ServiceNotOffered,
    StoreUnavailable,
    UnknownService,
    describe,
)

__all__ = [
    "OUTCOMES",
    "Backoff",
    "ClaimedItem",
    "Decision",
    "DispatchConfig",
    "DispatchCore",
    "DispatchStatistics",
    "Kind",
    "OutcomeName",
    "Rule",
    "Verdict",
    "judge",
]

OutcomeName: TypeAlias = Literal[
    "ok",
    "no_slot",
    "stopped",
    "unknown_service",
    "no_execserver",
    "lost",
    "client_closed",
    "store_unavailable",
    "retry_later",
    "service_not_offered",
    "failed",
]
"""The rows of the outcome table."""

Kind: TypeAlias = Literal["complete", "requeue", "fail"]
"""What is written for an item: its row deleted, made new again, or failed."""

Key: TypeAlias = tuple[int, int]
"""A claim: (row id, attempts). A row claimed again is a different claim."""


# -- the table -----------------------------------------------------------------------------


@attrs.frozen
class Rule:
    """One row of the outcome table.

    Attributes:
        outcome: the row's name.
        raised: the exception types that mean it (empty for ``ok`` and ``failed``).
        kind: what is written.
        delay: ``"retry_delay"``, ``"at_once"`` or ``"raised"`` (the
            :class:`~trio_broker.core.errors.RetryLater`'s own); ``None`` when
            nothing is requeued.
    """

    outcome: OutcomeName
    raised: tuple[type[Exception], ...]
    kind: Kind
    delay: Literal["retry_delay", "at_once", "raised"] | None


OUTCOMES: Final[tuple[Rule, ...]] = (
    Rule("ok", (), "complete", None),
    Rule("no_slot", (NoSlot,), "requeue", "retry_delay"),
    Rule("stopped", (JobStopped,), "requeue", "retry_delay"),
    Rule("unknown_service", (UnknownService,), "requeue", "retry_delay"),
    Rule("no_execserver", (NoExecserver,), "requeue", "at_once"),
    Rule("lost", (JobLost,), "requeue", "at_once"),
    Rule("client_closed", (ClientClosed,), "requeue", "at_once"),
    Rule("store_unavailable", (StoreUnavailable,), "requeue", "at_once"),
    Rule("retry_later", (RetryLater,), "requeue", "raised"),
    Rule("service_not_offered", (ServiceNotOffered,), "fail", None),
    Rule("failed", (), "fail", None),
)
"""The outcome table of the module docstring, row by row."""

_FAILED: Final = OUTCOMES[-1]
_RAISED: Final = tuple(rule for rule in OUTCOMES if rule.raised)
_NOT_OFFERED: Final = next(rule for rule in OUTCOMES if rule.outcome == "service_not_offered")
_ROW: Final = {rule.outcome: index for index, rule in enumerate(OUTCOMES)}


@attrs.frozen(kw_only=True)
class Verdict:
    """How the table judged one handler's end.

    Attributes:
        outcome: the deciding row.
        kind: what is written.
        delay: seconds before a requeued item may be claimed again (0 otherwise).
        error: the text stored as the row's ``last_error`` (``None`` for ``ok``).
        cause: the exception of the deciding part (its first leaf; for
            ``service_not_offered`` the ``ServiceNotOffered`` the bound made),
            ``None`` for ``ok``: what the application describes the decision
            with. Not part of the value (equality and repr leave it out).
    """

    outcome: OutcomeName
    kind: Kind
    delay: float = 0.0
    error: str | None = None
    cause: BaseException | None = attrs.field(default=None, eq=False, repr=False)


_OK_VERDICT: Final = Verdict(outcome="ok", kind="complete")


@attrs.frozen(kw_only=True)
class _Judging:
    """What a verdict depends on besides the exception."""

    retry_delay: float
    attempts: int
    unknown_service_attempts: int | None

    @property
    def bounded(self) -> bool:
        """Whether an ``UnknownService`` has become a ``ServiceNotOffered``."""
        limit = self.unknown_service_attempts
        return limit is not None and self.attempts >= limit


def judge(
    exc: BaseException | None,
    *,
    retry_delay: float,
    attempts: int = 0,
    unknown_service_attempts: int | None = None,
) -> Verdict:
    """Judge one handler's end by the outcome table.

    Args:
        exc: what the handler raised (an exception group is judged as the
            module docstring says), or ``None`` when it returned.
        retry_delay: the delay of the rows that requeue *later*.
        attempts: how often the item has been claimed, this claim included.
        unknown_service_attempts: the bound of ``unknown_service``: from this
            many attempts on, an ``UnknownService`` is judged as a
            ``ServiceNotOffered`` (``None``: unbounded).

    Returns:
        The verdict: the deciding row, what to write, the delay, the text and
        the cause.
    """
    if exc is None:
        return _OK_VERDICT
    how = _Judging(
        retry_delay=retry_delay,
        attempts=attempts,
        unknown_service_attempts=unknown_service_attempts,
    )
    if not isinstance(exc, BaseExceptionGroup):
        for rule in _RAISED:
            if isinstance(exc, rule.raised):
                return _verdict(rule, exc, how)
        return _verdict(_FAILED, exc, how)
    parts: list[Verdict] = []
    rest: BaseExceptionGroup[BaseException] | None = exc
    for rule in _RAISED:
        if rest is None:
            break
        matched, rest = rest.split(rule.raised)
        if matched is not None:
            parts.append(_verdict(rule, matched, how))
    if rest is not None:
        parts.append(_verdict(_FAILED, rest, how))
    # a failure wins, else the longest delay; max() keeps the earliest row of a tie
    return max(parts, key=lambda v: (v.kind == "fail", v.delay, -_ROW[v.outcome]))


def _verdict(rule: Rule, exc: BaseException, how: _Judging) -> Verdict:
    leaves = list(_leaves(exc))
    if rule.outcome == "unknown_service" and how.bounded:
        texts = "; ".join(str(leaf) for leaf in leaves)
        bounded = ServiceNotOffered(f"{texts}, after {how.attempts} attempts")
        bounded.__cause__ = leaves[0]
        return _verdict(_NOT_OFFERED, bounded, how)
    if rule.delay == "retry_delay":
        delay = how.retry_delay
    elif rule.delay == "raised":
        delay = max(
            how.retry_delay if e.delay is None else e.delay
            for e in leaves
            if isinstance(e, RetryLater)
        )
    else:
        delay = 0.0
    return Verdict(
        outcome=rule.outcome, kind=rule.kind, delay=delay, error=describe(exc), cause=leaves[0]
    )


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions of a group that are not groups (``exc`` itself for a plain one)."""
    if isinstance(exc, BaseExceptionGroup):
        for member in exc.exceptions:
            yield from _leaves(member)
    else:
        yield exc


# -- values --------------------------------------------------------------------------------


class ClaimedItem(Protocol):
    """What the core needs of a claimed row (:class:`~trio_broker.trio.store.QueueItem` is one)."""

    @property
    def id(self) -> int: ...

    @property
    def attempts(self) -> int: ...

    @property
    def action(self) -> str: ...

    @property
    def priority(self) -> int: ...


ItemT = TypeVar("ItemT", bound=ClaimedItem)


@attrs.frozen(kw_only=True)
class Decision:
    """A claimed item's verdict, to be written to its row (fenced to its claim).

    Attributes:
        item_id, attempts: the claim.
        verdict: what the table decided.
    """

    item_id: int
    attempts: int
    verdict: Verdict

    @property
    def key(self) -> Key:
        """The claim: ``(item_id, attempts)``."""
        return self.item_id, self.attempts


def _not_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be at least 0, got {value}")


def _copied(attempts: Mapping[str, int]) -> dict[str, int]:
    return dict(attempts)


@attrs.frozen(kw_only=True)
class DispatchConfig:
    """What the dispatch core decides with.

    Attributes:
        exec_actions: actions whose work holds an execserver slot.
        local_actions: actions run in this process, under ``local_limit``.
        local_limit: local-bound items of any priority in flight at most (>= 1
            when there are local actions); odd priorities may take
            :func:`~trio_broker.core.admission.local_reserve` more.
        admission: CPU count, odd reserve, ``max_in_flight`` and the database pool
            the automatic cap follows (:mod:`trio_broker.core.admission`).
        retry_delay: the delay of the rows that requeue *later* (seconds).
        unknown_service_attempts: the bound of ``unknown_service`` per action
            (see the module docstring): from its item's this-many-th claim on, an
            ``UnknownService`` fails the item as ``ServiceNotOffered``; an action
            not named here follows its client's verdict (the client core's
            ``ServiceNotOffered``).
    """

    exec_actions: frozenset[str] = frozenset()
    local_actions: frozenset[str] = frozenset()
    local_limit: int = attrs.field(default=1, validator=_not_negative)
    admission: AdmissionConfig = attrs.field(factory=AdmissionConfig)
    retry_delay: float = attrs.field(default=60.0, validator=_not_negative)
    unknown_service_attempts: Mapping[str, int] = attrs.field(
        factory=dict, converter=_copied, hash=False
    )

    def __attrs_post_init__(self) -> None:
        both = self.exec_actions & self.local_actions
        if both:
            raise ValueError(f"actions both exec- and local-bound: {sorted(both)}")
        if self.local_actions and self.local_limit < 1:
            raise ValueError("local_limit must be at least 1 when there are local actions")
        for action, attempts in self.unknown_service_attempts.items():
            if action not in self.exec_actions | self.local_actions:
                raise ValueError(f"unknown_service_attempts names an unknown action {action!r}")
            if attempts < 1:
                raise ValueError(
                    f"unknown_service_attempts[{action!r}] must be at least 1, got {attempts}"
                )

    @property
    def local_reserve(self) -> int:
        """Local slots beyond ``local_limit`` only odd priorities may take."""
        return local_reserve(self.local_limit) if self.local_actions else 0


@attrs.frozen(kw_only=True)
class DispatchStatistics:
    """A snapshot of the core (:meth:`DispatchCore.statistics`).

    Attributes:
        exec_limit: exec-bound items allowed in flight at the last plan.
        odd_reserve: the slots beyond ``exec_limit`` only odd priorities may take.
        exec_base: the base of the last plan (fair share plus CPU count).
        admission_rise: the accumulated rise above the base (idle slots absorbed).
        max_in_flight: the cap on ``exec_limit + odd_reserve`` at the last plan.
        exec_in_flight, odd_in_flight: exec-bound items in flight (all; odd ones).
        peak_exec_in_flight: the most exec-bound items ever in flight at once.
        local_limit, local_in_flight: the local-bound limit and its use.
        local_reserve, local_odd_in_flight: local slots beyond the limit only odd
            priorities may take; odd local items in flight.
        queue_deep: whether the last claim got all the exec-bound items it asked for.
        claims: claims planned that asked for something (each is one statement).
        claimed: items claimed.
        completed, requeued, failed: outcomes written that took effect.
        fenced: outcomes written that no longer counted (the row was requeued meanwhile).
        returned: rows returned to the queue (an earlier life's, a lost claim's,
            rows the database showed this backend holding unknown to it, and at
            shutdown).
        lost: items whose claim the database no longer showed this backend
            holding (:meth:`DispatchCore.recheck`): dropped without an outcome.
        reclaimed: rows a claim returned that this backend already ran under
            the same claim (its first commit was lost): not started again.
        settling: decisions the application is settling (not yet to be written).
        pending_outcomes: decisions not yet written.
        unwritten: rows claimed whose outcome is not written.
    """

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
    claims: int
    claimed: int
    completed: int
    requeued: int
    failed: int
    fenced: int
    returned: int
    lost: int
    reclaimed: int
    settling: int
    pending_outcomes: int
    unwritten: int


# -- the core ------------------------------------------------------------------------------


class DispatchCore:
    """The decisions and bookkeeping of one dispatcher. See the module docstring.

    Inputs are method calls in the order the loop meets them: a claim is
    :meth:`plan`, then :meth:`claimed` or :meth:`claim_failed`; an item's end is
    :meth:`finished` (the decision), then :meth:`settled`, or :meth:`abandoned`
    at any point before; a write is :meth:`take_outcomes`, then
    :meth:`written` or :meth:`write_failed`. Misuse raises
    :class:`~trio_broker.core.errors.DispatchUsageError` before anything changes.

    Args:
        config: the actions, limits and delays.
    """

    def __init__(self, config: DispatchConfig) -> None:
        self.config = config
        self._running: dict[Key, ClaimedItem] = {}
        self._settling: dict[Key, Decision] = {}
        self._abandoned: set[Key] = set()
        self._pending: list[Decision] = []
        self._writing: list[Decision] = []
        self._batch_out = False
        self._unwritten: set[Key] = set()
        self._exec_in_flight = 0
        self._odd_in_flight = 0
        self._local_in_flight = 0
        self._local_odd_in_flight = 0
        self._peak_exec = 0
        self._admission = Admission(config.admission)
        self._queue_deep = False
        self._plan: ClaimPlan | None = None
        self._reconcile = False
        self._closed = False
        self._counts = dict.fromkeys(
            (
                "claims",
                "claimed",
                "completed",
                "requeued",
                "failed",
                "fenced",
                "returned",
                "lost",
                "reclaimed",
            ),
            0,
        )

    # -- claiming --------------------------------------------------------------------------

    def plan(
        self, loads: Iterable[InstanceLoad] = (), *, waiting: int = 0, now: float = 0.0
    ) -> ClaimPlan:
        """How many items of each kind the next claim may take.

        Args:
            loads: one per connected, non-draining execserver instance (ignored
                when no action is exec-bound).
            waiting: this client's jobs now waiting at the execservers for a slot.
            now: the time (any monotonic clock, in seconds): the admission's rise
                adjusts at most once per ``adapt_interval``.

        Returns:
            The plan (all zeros once :meth:`close`\\ d). A plan that asks for
            something is a claim to send: report its reply with :meth:`claimed`
            or its failure with :meth:`claim_failed` before the next plan.

        Raises:
            DispatchUsageError: a claim is still outstanding, or a reconciliation
                is due (:attr:`needs_reconcile`).
        """
        if self._plan is not None:
            raise DispatchUsageError("plan() while the previous claim is outstanding")
        if self._reconcile:
            raise DispatchUsageError("a lost claim must be reconciled before the next plan()")
        if self._closed:
            return ClaimPlan()
        if not self.config.exec_actions:
            loads, waiting = (), 0
        # The odd reserve comes on top of the limit (within the cap): even items keep
        # the whole base, and odd ones may go ``reserve`` beyond it, waiting ahead of
        # the even wants.
        limits = self._admission.update(now, loads, waiting=waiting, queue_deep=self._queue_deep)
        local = self.config.local_actions
        plan = plan_claims(
            exec_limit=limits.limit + limits.reserve,
            reserve=limits.reserve,
            exec_in_flight=self._exec_in_flight,
            even_in_flight=self._exec_in_flight - self._odd_in_flight,
            local_limit=self.config.local_limit if local else 0,
            local_in_flight=self._local_in_flight,
            local_reserve=self.config.local_reserve,
            local_even_in_flight=self._local_in_flight - self._local_odd_in_flight,
        )
        if plan.total:
            self._plan = plan
            self._counts["claims"] += 1
        return plan

    def claimed(self, items: Sequence[ItemT]) -> list[ItemT]:
        """The claim of the last :meth:`plan` returned these rows: they are in flight.

        A row whose claim (id and attempts) this backend already knows is that
        same claim again: its first commit was lost (an immediate database
        restart, a fail-over) and the row was claimed anew by this backend at the
        same attempt. The item already running (or decided) under it stands;
        the row is not started again.

        Returns:
            The items to start: the rows, less the claims already known.

        Raises:
            DispatchUsageError: no claim is outstanding; a row's action is not
                registered; a row comes twice in the claim; or the rows exceed the plan
                (more even exec-bound rows than its general share, more exec-bound
                rows than general plus odd-only, more local rows than its local
                share). Nothing changed.
        """
        plan = self._plan
        if plan is None:
            raise DispatchUsageError("claimed() without an outstanding plan()")
        exec_actions, local_actions = self.config.exec_actions, self.config.local_actions
        exec_items = odd_items = local_items = local_odd = 0
        keys: set[Key] = set()
        fresh: list[ItemT] = []
        for item in items:
            key = (item.id, item.attempts)
            if key in keys:
                raise DispatchUsageError(f"item {item.id} (attempt {item.attempts}) comes twice")
            keys.add(key)
            if key in self._unwritten:
                continue
            fresh.append(item)
            if item.action in exec_actions:
                exec_items += 1
                odd_items += is_odd(item.priority)
            elif item.action in local_actions:
                local_items += 1
                local_odd += is_odd(item.priority)
            else:
                raise DispatchUsageError(f"item {item.id}: action {item.action!r} is unknown")
        if (
            exec_items - odd_items > plan.general
            or exec_items > plan.exec_total
            or local_items - local_odd > plan.local
            or local_items > plan.local_total
        ):
            raise DispatchUsageError(
                f"the claim returned {exec_items} exec-bound ({odd_items} odd) and "
                f"{local_items} local rows for a plan of {plan}"
            )
        self._plan = None
        for item in fresh:
            key = (item.id, item.attempts)
            self._unwritten.add(key)
            self._running[key] = item
        self._exec_in_flight += exec_items
        self._odd_in_flight += odd_items
        self._local_in_flight += local_items
        self._local_odd_in_flight += local_odd
        self._peak_exec = max(self._peak_exec, self._exec_in_flight)
        self._counts["claimed"] += len(fresh)
        self._counts["reclaimed"] += len(items) - len(fresh)
        if plan.general:
            self._queue_deep = exec_items >= plan.general
        return fresh

    def claim_failed(self) -> None:
        """The claim of the last :meth:`plan` failed; it may have taken rows unseen.

        Before the next :meth:`plan`, return every row of this backend but
        :meth:`known_ids` and report :meth:`reconciled`.

        Raises:
            DispatchUsageError: no claim is outstanding.
        """
        if self._plan is None:
            raise DispatchUsageError("claim_failed() without an outstanding plan()")
        self._plan = None
        self._reconcile = True

    @property
    def needs_reconcile(self) -> bool:
        """Whether a lost claim must be reconciled before the next :meth:`plan`."""
        return self._reconcile

    def known_ids(self) -> set[int]:
        """Ids of the rows claimed whose outcome is not written: the rows to keep."""
        return {item_id for item_id, _ in self._unwritten}

    def reconciled(self, returned: int) -> None:
        """Every row but :meth:`known_ids` went back to the queue (``returned`` of them)."""
        self._reconcile = False
        self._counts["returned"] += returned

    def returned(self, count: int) -> None:
        """Rows an earlier life of this backend left claimed went back to the queue."""
        self._counts["returned"] += count

    def recheck(self, held: Collection[Key]) -> list[Key]:
        """The database shows this backend holding the claims ``held`` (id, attempts).

        Read while no claim was outstanding, after every row this backend held
        beyond :meth:`known_ids` went back to the queue. A running or settling
        item whose claim is not among them is *lost*: its row was requeued
        meanwhile (another backend's sweep found this one stale), taken by
        another backend, or its claim never became durable (an immediate
        database restart, a fail-over). It leaves the bookkeeping without a
        decision: its handler is to be cancelled, and nothing of it is settled
        or written, so nothing is written over the row's new holder.

        Returns:
            The lost claims, in the order they were claimed.

        Raises:
            DispatchUsageError: a claim is outstanding; nothing changed.
        """
        if self._plan is not None:
            raise DispatchUsageError("recheck() while a claim is outstanding")
        held_keys = set(held)
        lost = [key for key in (*self._running, *self._settling) if key not in held_keys]
        for key in lost:
            if key in self._running:
                self._stop_running(key)
            else:
                del self._settling[key]
            self._unwritten.discard(key)
        self._counts["lost"] += len(lost)
        return lost

    # -- running ---------------------------------------------------------------------------

    def finished(self, item: ClaimedItem, exc: BaseException | None) -> Decision:
        """An item's handler ended: returned (``exc`` is ``None``) or raised ``exc``.

        The item is no longer in flight. Its decision is the only one it gets: the
        application settles its own state by it, then reports :meth:`settled`
        (at once when it has nothing to settle), and only then is it written.

        Returns:
            The decision, by :func:`judge` with this item's attempts and its
            action's bound of ``unknown_service``.

        Raises:
            DispatchUsageError: the item is not running; nothing changed.
        """
        key = (item.id, item.attempts)
        if key not in self._running:
            raise DispatchUsageError(f"item {item.id} (attempt {item.attempts}) is not running")
        verdict = judge(
            exc,
            retry_delay=self.config.retry_delay,
            attempts=item.attempts,
            unknown_service_attempts=self.config.unknown_service_attempts.get(item.action),
        )
        decision = Decision(item_id=item.id, attempts=item.attempts, verdict=verdict)
        self._stop_running(key)
        self._settling[key] = decision
        return decision

    def settled(self, decision: Decision) -> None:
        """The application settled its state by ``decision``: it is queued for writing.

        Raises:
            DispatchUsageError: the decision is not being settled; nothing changed.
        """
        key = decision.key
        if self._settling.get(key) is not decision:
            raise DispatchUsageError(
                f"item {decision.item_id} (attempt {decision.attempts}) is not being settled"
            )
        del self._settling[key]
        self._pending.append(decision)

    def abandoned(self, item: ClaimedItem) -> None:
        """An item's handler or settling was cancelled (shutdown): no decision is written;
        its row goes back.

        Raises:
            DispatchUsageError: the item is neither running nor being settled;
                nothing changed.
        """
        key = (item.id, item.attempts)
        if key in self._running:
            self._stop_running(key)
        elif self._settling.pop(key, None) is None:
            raise DispatchUsageError(
                f"item {item.id} (attempt {item.attempts}) is neither running nor settling"
            )
        self._abandoned.add(key)

    def _stop_running(self, key: Key) -> None:
        item = self._running.pop(key)
        if item.action in self.config.exec_actions:
            self._exec_in_flight -= 1
            if is_odd(item.priority):
                self._odd_in_flight -= 1
        else:
            self._local_in_flight -= 1
            if is_odd(item.priority):
                self._local_odd_in_flight -= 1

    # -- writing ---------------------------------------------------------------------------

    def take_outcomes(self) -> list[Decision]:
        """The decisions to write now, in the order they were made (may be empty).

        Report the write with :meth:`written` or :meth:`write_failed`.

        Raises:
            DispatchUsageError: the previous batch is still being written.
        """
        if self._batch_out:
            raise DispatchUsageError("take_outcomes() while a batch is being written")
        self._writing, self._pending = self._pending, []
        self._batch_out = bool(self._writing)
        return list(self._writing)

    def written(self, applied: Collection[int]) -> None:
        """The batch was written; ``applied`` are the ids whose outcome took effect.

        The others were fenced: their row had been requeued meanwhile (a stale
        heartbeat), or an earlier try of this write had committed unseen.

        Raises:
            DispatchUsageError: no batch is being written; nothing changed.
        """
        if not self._batch_out:
            raise DispatchUsageError("written() without a batch from take_outcomes()")
        counts = self._counts
        # The store answers with row ids. A row swept back to the queue while its
        # item ran, and claimed again, has two claims in one batch; only the latest
        # can have applied (the row's attempts moved past the older one).
        latest: dict[int, int] = {}
        for decision in self._writing:
            item_id, attempts = decision.key
            latest[item_id] = max(latest.get(item_id, attempts), attempts)
        for decision in self._writing:
            self._unwritten.discard(decision.key)
            if decision.item_id not in applied or decision.attempts != latest[decision.item_id]:
                counts["fenced"] += 1
            elif decision.verdict.kind == "complete":
                counts["completed"] += 1
            elif decision.verdict.kind == "requeue":
                counts["requeued"] += 1
            else:
                counts["failed"] += 1
        self._writing = []
        self._batch_out = False

    def write_failed(self) -> None:
        """The batch was not (or not surely) written: it goes first in the next one.

        Raises:
            DispatchUsageError: no batch is being written; nothing changed.
        """
        if not self._batch_out:
            raise DispatchUsageError("write_failed() without a batch from take_outcomes()")
        self._pending[:0] = self._writing
        self._writing = []
        self._batch_out = False

    @property
    def pending(self) -> int:
        """Decisions not yet written (being written included)."""
        return len(self._pending) + len(self._writing)

    # -- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        """Claim nothing more: every later :meth:`plan` is empty."""
        self._closed = True

    def stopped(self, returned: int | None) -> None:
        """Shutdown ended: every unwritten row went back to the queue, or could not.

        Args:
            returned: how many rows went back; ``None`` when the database could
                not be reached (the rows come back once this backend's heartbeat
                is stale).

        Raises:
            DispatchUsageError: an item is still running; nothing changed.
        """
        if self._running or self._settling:
            raise DispatchUsageError(
                f"stopped() while {len(self._running)} items run and "
                f"{len(self._settling)} are being settled"
            )
        self._closed = True
        if returned is not None:
            self._counts["returned"] += returned
        self._plan = None
        self._pending = []
        self._writing = []
        self._batch_out = False
        self._abandoned.clear()
        self._unwritten.clear()

    # -- queries ---------------------------------------------------------------------------

    def statistics(self) -> DispatchStatistics:
        """A frozen snapshot of the plan, what is in flight and the outcome counts."""
        c = self._counts
        limits = self._admission.current
        return DispatchStatistics(
            exec_limit=limits.limit,
            odd_reserve=limits.reserve,
            exec_base=limits.base,
            admission_rise=limits.rise,
            max_in_flight=limits.cap,
            exec_in_flight=self._exec_in_flight,
            odd_in_flight=self._odd_in_flight,
            peak_exec_in_flight=self._peak_exec,
            local_limit=self.config.local_limit,
            local_in_flight=self._local_in_flight,
            local_reserve=self.config.local_reserve,
            local_odd_in_flight=self._local_odd_in_flight,
            queue_deep=self._queue_deep,
            claims=c["claims"],
            claimed=c["claimed"],
            completed=c["completed"],
            requeued=c["requeued"],
            failed=c["failed"],
            fenced=c["fenced"],
            returned=c["returned"],
            lost=c["lost"],
            reclaimed=c["reclaimed"],
            settling=len(self._settling),
            pending_outcomes=self.pending,
            unwritten=len(self._unwritten),
        )

    def running(self) -> list[ClaimedItem]:
        """The items in flight, in the order they were claimed."""
        return list(self._running.values())

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with itself."""
        exec_actions = self.config.exec_actions
        running = list(self._running.values())
        exec_running = [i for i in running if i.action in exec_actions]
        assert self._exec_in_flight == len(exec_running), "exec_in_flight"
        assert self._odd_in_flight == sum(is_odd(i.priority) for i in exec_running), "odd"
        assert self._local_in_flight == len(running) - len(exec_running), "local_in_flight"
        local_odd = sum(is_odd(i.priority) for i in running if i.action not in exec_actions)
        assert self._local_odd_in_flight == local_odd, "local_odd_in_flight"
        assert self._peak_exec >= self._exec_in_flight, "peak"
        decided = [d.key for d in (*self._writing, *self._pending)]
        assert len(decided) == len(set(decided)), "a claim decided twice"
        assert all(key == d.key for key, d in self._settling.items()), "settling keys"
        parts = (set(self._running), set(self._settling), set(decided), self._abandoned)
        assert sum(len(part) for part in parts) == len(self._unwritten), "unwritten overlaps"
        assert set().union(*parts) == self._unwritten, (
            "unwritten != running + settling + decided + abandoned"
        )


# -- back-off ------------------------------------------------------------------------------


class Backoff:
    """A delay that doubles from ``low`` to ``high`` while calls fail, and resets.

    Args:
        low: the first delay (seconds, > 0).
        high: the most it grows to.
    """

    def __init__(self, low: float, high: float) -> None:
        if low <= 0 or high <= 0:
            raise ValueError(f"expected delays above 0, got {low} and {high}")
        self.low, self.high = low, high
        self._next = low

    def failed(self) -> float:
        """A call failed: the delay to wait before the next try."""
        delay = self._next
        self._next = min(delay * 2, self.high)
        return delay

    def succeeded(self) -> None:
        """A call succeeded: the next failure waits ``low`` again."""
        self._next = self.low
