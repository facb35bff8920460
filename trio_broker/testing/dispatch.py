"""A hypothesis state machine that model-checks the dispatch core.

Use it against your own admission settings::

    from trio_broker.core.admission import AdmissionConfig
    from trio_broker.testing.dispatch import dispatch_machine

    TestMyDispatcher = dispatch_machine(
        admission=AdmissionConfig(cpus=1, odd_reserve=3, db_pool=4), local_limit=2
    ).TestCase

:class:`DispatchMachine` drives a real :class:`~trio_broker.core.dispatch.DispatchCore`
through every one of its inputs, in any order the dispatcher loop allows: claim
plans over random execserver loads, claim replies and lost claims (which may
have taken rows unseen) with their reconciliation, the end of each item in each
outcome of the table (alone, in a group of one, nested, or beside another
outcome; an ``UnknownService`` before and after its action's bound), the
application settling each decision, cancellations at shutdown (of a running
handler or of a settling), writes that succeed, fail, or commit unseen, and
shutdown with the database reachable or not. Beside the core run two plain
models:

- :class:`QueueModel`, the database: rows, claims in priority order (the odd-only
  request, as the store does it), outcomes fenced to their claim, a stale-backend
  sweep that requeues the rows under a running item, and returning rows. It
  records how each claim left the state *claimed by this backend*;
- :class:`ReferenceDispatch`, an obviously correct re-statement of the core:
  counts kept from lists, the outcome table as plain sets (and its bound as one
  comparison), the claim plan as a few lines of arithmetic (the admission limit itself comes from
  its own :class:`~trio_broker.core.admission.Admission`, fed the same figures
  and clock, which has its own tests).

After every step the machine checks that:

1. the plan, each verdict (and its cause), each batch of decisions to write and
   every statistic of the core equal the reference's; a decision is written only
   once it was settled;
2. what is in flight never exceeds the limit plus the odd reserve, nor the cap
   (``max_in_flight``), and even items never exceed the limit; local-bound items
   never exceed the local limit plus its odd reserve, even ones the local limit
   (checked at each claim);
3. the rows to keep after a lost claim are exactly the claims not yet written;
4. the core's own :meth:`~trio_broker.core.dispatch.DispatchCore.check_invariants`
   hold;
5. every claim leaves *claimed by this backend* at most once, and after a
   shutdown with the database reachable every claim has left it exactly once:
   by its written outcome, or by going back to the queue.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeAlias

import attrs
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from trio_broker.core.admission import (
    Admission,
    AdmissionConfig,
    ClaimPlan,
    InstanceLoad,
    local_reserve,
)
from trio_broker.core.dispatch import Decision, DispatchConfig, DispatchCore
from trio_broker.core.errors import (
    ClientClosed,
    JobLost,
    JobStopped,
    NoExecserver,
    NoSlot,
    RetryLater,
    ServiceNotOffered,
    StoreUnavailable,
    UnknownService,
)

__all__ = ["ClaimedRow", "DispatchMachine", "QueueModel", "ReferenceDispatch", "dispatch_machine"]

Key: TypeAlias = tuple[int, int]

EXEC_ACTIONS = ("exec_a", "exec_b")
LOCAL_ACTIONS = ("local",)

# -- the outcome table, restated plainly ---------------------------------------------------

_ORDER = (
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
)
_LATER = {"no_slot", "stopped", "unknown_service"}
_AT_ONCE = {"no_execserver", "lost", "client_closed", "store_unavailable"}
_RAISE: dict[str, Any] = {
    "no_slot": NoSlot,
    "stopped": JobStopped,
    "unknown_service": UnknownService,
    "no_execserver": NoExecserver,
    "lost": JobLost,
    "client_closed": ClientClosed,
    "store_unavailable": StoreUnavailable,
    "service_not_offered": ServiceNotOffered,
    "failed": ValueError,
}


@attrs.frozen
class Part:
    """One exception a handler raises: its outcome and, for ``retry_later``, its delay
    (``None``: the dispatcher's ``retry_delay``)."""

    outcome: str
    delay: float | None = 0.0

    def exception(self, message: str) -> Exception:
        if self.outcome == "retry_later":
            return RetryLater(self.delay, message)
        exc: Exception = _RAISE[self.outcome](message)
        return exc


@attrs.frozen
class Shape:
    """How a handler ends: ``plain`` (one exception, or returning for ``ok``), ``group``
    (a group of one), ``nested`` (a group of one inside a group of one) or ``pair``."""

    wrapping: Literal["plain", "group", "nested", "pair"]
    parts: tuple[Part, ...]


def expected_verdict(
    shape: Shape, retry_delay: float, *, attempts: int = 0, bound: int | None = None
) -> tuple[str, str, float]:
    """(outcome, kind, delay) the table gives ``shape``, worked out the plain way, for an
    item claimed ``attempts`` times whose action bounds ``unknown_service`` at ``bound``."""
    judged = []
    for part in shape.parts:
        outcome = part.outcome
        if outcome == "unknown_service" and bound is not None and attempts >= bound:
            outcome = "service_not_offered"
        if outcome == "ok":
            judged.append(("ok", "complete", 0.0))
        elif outcome in ("failed", "service_not_offered"):
            judged.append((outcome, "fail", 0.0))
        elif outcome in _LATER:
            judged.append((outcome, "requeue", retry_delay))
        elif outcome in _AT_ONCE:
            judged.append((outcome, "requeue", 0.0))
        else:
            delay = retry_delay if part.delay is None else part.delay
            judged.append(("retry_later", "requeue", delay))
    failures = [j for j in judged if j[1] == "fail"]
    if failures:
        return min(failures, key=lambda j: _ORDER.index(j[0]))
    longest = max(j[2] for j in judged)
    return min((j for j in judged if j[2] == longest), key=lambda j: _ORDER.index(j[0]))


def raised(shape: Shape) -> BaseException | None:
    """What a handler of this shape raises (``None``: it returns)."""
    if shape.parts == (Part("ok"),):
        return None
    exceptions = [part.exception(f"reason {i}") for i, part in enumerate(shape.parts)]
    if shape.wrapping == "plain":
        return exceptions[0]
    if shape.wrapping == "group":
        return ExceptionGroup("one", exceptions)
    if shape.wrapping == "nested":
        return ExceptionGroup("outer", [ExceptionGroup("inner", exceptions)])
    return ExceptionGroup("pair", [exceptions[0], ExceptionGroup("inner", exceptions[1:])])


_raising = st.sampled_from([o for o in _ORDER if o != "ok"])
# In a pair the precedence rules matter: failures and RetryLaters (whose delays
# compete) come up more often there.
_paired = st.sampled_from(
    [o for o in _ORDER if o != "ok"] + ["failed", "retry_later", "unknown_service"] * 2
)


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    """Every way a handler may end."""
    wrapping: Literal["plain", "group", "nested", "pair"] = draw(
        st.sampled_from(["plain", "plain", "group", "nested", "pair", "pair"])
    )

    def part(outcomes: st.SearchStrategy[str]) -> Part:
        outcome = draw(outcomes)
        delay = draw(st.sampled_from([0.0, 5.0, 3600.0, None])) if outcome == "retry_later" else 0.0
        return Part(outcome, delay)

    if wrapping == "plain" and draw(st.booleans()):
        return Shape("plain", (Part("ok"),))
    if wrapping == "pair":
        return Shape("pair", (part(_paired), part(_paired)))
    return Shape(wrapping, (part(_raising),))


# -- the database ----------------------------------------------------------------------------


@attrs.frozen
class ClaimedRow:
    """A claimed row as the store hands it out."""

    id: int
    attempts: int
    action: str
    priority: int


@attrs.define
class _Row:
    id: int
    action: str
    priority: int
    attempts: int = 0
    status: Literal["new", "claimed", "failed"] = "new"
    ours: bool = False


class QueueModel:
    """The queue table, plainly: what the store's statements do to it."""

    def __init__(self) -> None:
        self.rows: dict[int, _Row] = {}
        self.ids = itertools.count(1)
        self.exits: dict[Key, list[str]] = {}
        """How each claim left *claimed by this backend* (at most once)."""

    def enqueue(self, action: str, priority: int) -> None:
        row_id = next(self.ids)
        self.rows[row_id] = _Row(row_id, action, priority)

    def claim(self, plan: ClaimPlan) -> list[ClaimedRow]:
        """The best new rows for each request of the plan, one statement."""
        new = sorted(
            (r for r in self.rows.values() if r.status == "new"), key=lambda r: (-r.priority, r.id)
        )
        general = [r for r in new if r.action in EXEC_ACTIONS][: plan.general]
        odd = [r for r in new if r.action in EXEC_ACTIONS and r.priority % 2 and r not in general][
            : plan.odd_only
        ]
        local = [r for r in new if r.action in LOCAL_ACTIONS][: plan.local]
        local_odd = [
            r for r in new if r.action in LOCAL_ACTIONS and r.priority % 2 and r not in local
        ][: plan.local_odd_only]
        taken = sorted(general + odd + local + local_odd, key=lambda r: (-r.priority, r.id))
        for row in taken:
            row.status, row.ours = "claimed", True
            row.attempts += 1
            self.exits[row.id, row.attempts] = []
        return [ClaimedRow(r.id, r.attempts, r.action, r.priority) for r in taken]

    def _leave(self, row: _Row, how: str) -> None:
        self.exits[row.id, row.attempts].append(how)
        row.ours = False

    def finish(self, outcomes: Iterable[tuple[int, int, str]]) -> set[int]:
        """Apply (id, attempts, kind) outcomes fenced to their claim; the ids that applied."""
        applied = set()
        for item_id, attempts, kind in outcomes:
            row = self.rows.get(item_id)
            if row is None or not row.ours or row.attempts != attempts:
                continue
            self._leave(row, kind)
            applied.add(item_id)
            if kind == "complete":
                del self.rows[item_id]
            else:
                row.status = "new" if kind == "requeue" else "failed"
        return applied

    def sweep(self) -> int:
        """This backend looked stale to another one: its claimed rows are new again."""
        return self.return_ours((), how="swept")

    def return_ours(self, keep: Iterable[int], how: str = "returned") -> int:
        keep = set(keep)
        returned = 0
        for row in self.rows.values():
            if row.ours and row.id not in keep:
                self._leave(row, how)
                row.status = "new"
                returned += 1
        return returned

    def ours(self) -> set[int]:
        return {r.id for r in self.rows.values() if r.ours}


# -- the reference ---------------------------------------------------------------------------


class ReferenceDispatch:
    """The dispatch core re-stated the obvious way: lists, a dictionary, arithmetic."""

    def __init__(self, config: DispatchConfig) -> None:
        self.config = config
        self.running: list[ClaimedRow] = []
        self.settling: list[tuple[Key, str, str, float]] = []  # key, outcome, kind, delay
        self.pending: list[tuple[Key, str, str, float]] = []
        self.batch: list[tuple[Key, str, str, float]] | None = None
        self.abandoned: list[Key] = []
        self.plan_out: ClaimPlan | None = None
        self.reconcile = False
        self.closed = False
        self.stopped = False
        self.limit = self.reserve = self.peak = self.cap = 0
        self.queue_deep = False
        self.admission = Admission(config.admission)
        self.counts = dict.fromkeys(
            ("claims", "claimed", "completed", "requeued", "failed", "fenced", "returned"), 0
        )

    def exec_running(self) -> list[ClaimedRow]:
        return [i for i in self.running if i.action in self.config.exec_actions]

    def odd_running(self) -> list[ClaimedRow]:
        return [i for i in self.exec_running() if i.priority % 2 != 0]

    def unwritten(self) -> set[Key]:
        keys = {(i.id, i.attempts) for i in self.running} | set(self.abandoned)
        keys |= {d[0] for d in self.settling}
        return keys | {d[0] for d in self.pending} | {d[0] for d in self.batch or ()}

    def local_running(self) -> list[ClaimedRow]:
        return [i for i in self.running if i.action not in self.config.exec_actions]

    def plan(self, loads: Sequence[InstanceLoad], waiting: int, now: float) -> ClaimPlan:
        if self.closed:
            return ClaimPlan()
        config = self.config
        if not config.exec_actions:
            loads, waiting = (), 0
        limits = self.admission.update(now, loads, waiting=waiting, queue_deep=self.queue_deep)
        limit, reserve = limits.limit, limits.reserve
        assert limit + reserve <= limits.cap or limits.cap == 0, "limit + reserve above the cap"
        self.limit, self.reserve, self.cap = limit, reserve, limits.cap
        in_flight = len(self.exec_running())
        even = in_flight - len(self.odd_running())
        free = max(0, limit + reserve - in_flight)
        general = max(0, min(limit - even, free))
        local_limit = config.local_limit if config.local_actions else 0
        local_extra = local_reserve(local_limit)
        local_items = self.local_running()
        local_even = sum(1 for i in local_items if i.priority % 2 == 0)
        local_free = max(0, local_limit + local_extra - len(local_items))
        local = max(0, min(local_limit - local_even, local_free))
        plan = ClaimPlan(
            general=general,
            odd_only=free - general,
            local=local,
            local_odd_only=local_free - local,
        )
        if plan.total:
            self.plan_out = plan
            self.counts["claims"] += 1
        return plan


# -- the machine -----------------------------------------------------------------------------

_loads = st.lists(
    st.builds(
        InstanceLoad,
        instance_id=st.sampled_from(["x", "y", "z"]),
        processes=st.integers(0, 6),
        clients=st.integers(0, 3),
        idle=st.integers(0, 4),
    ),
    max_size=3,
)


class DispatchMachine(RuleBasedStateMachine):
    """The model check of the dispatch core; configure it via :func:`dispatch_machine`."""

    admission: ClassVar[AdmissionConfig] = AdmissionConfig(cpus=1, odd_reserve=2, db_pool=4)
    local_limit: ClassVar[int] = 2
    retry_delay: ClassVar[float] = 60.0
    priorities: ClassVar[tuple[int, ...]] = (-2, -1, 0, 1, 2, 3)
    unknown_service_attempts: ClassVar[Mapping[str, int]] = {"exec_a": 2}

    running = Bundle("running")
    settling = Bundle("settling")

    def __init__(self) -> None:
        super().__init__()
        self.config = DispatchConfig(
            exec_actions=frozenset(EXEC_ACTIONS),
            local_actions=frozenset(LOCAL_ACTIONS),
            local_limit=self.local_limit,
            admission=self.admission,
            retry_delay=self.retry_delay,
            unknown_service_attempts=self.unknown_service_attempts,
        )
        self.core = DispatchCore(self.config)
        self.ref = ReferenceDispatch(self.config)
        self.db = QueueModel()
        self.claimed_keys: set[Key] = set()
        self.now = 0.0

    # -- setup -------------------------------------------------------------------------------

    @initialize(earlier=st.integers(0, 3), data=st.data())
    def start(self, earlier: int, data: st.DataObject) -> None:
        """Rows an earlier life of this backend left claimed went back at start, into a
        queue that already holds some work."""
        self.core.returned(earlier)
        self.ref.counts["returned"] += earlier
        rows = st.tuples(
            st.sampled_from(EXEC_ACTIONS + LOCAL_ACTIONS), st.sampled_from(self.priorities)
        )
        for action, priority in data.draw(st.lists(rows, max_size=12), label="queue"):
            self.db.enqueue(action, priority)

    @rule(action=st.sampled_from(EXEC_ACTIONS + LOCAL_ACTIONS), data=st.data())
    def enqueue(self, action: str, data: st.DataObject) -> None:
        """Work arrives in the queue (not an input of the core: the database changes)."""
        priorities = st.lists(st.sampled_from(self.priorities), min_size=1, max_size=3)
        for priority in data.draw(priorities, label="priorities"):
            self.db.enqueue(action, priority)

    # -- claiming ----------------------------------------------------------------------------

    def can_plan(self) -> bool:
        ref = self.ref
        return not ref.stopped and ref.plan_out is None and not ref.reconcile

    @precondition(can_plan)
    @rule(
        loads=_loads,
        waiting=st.integers(0, 4),
        elapsed=st.sampled_from([0.0, 0.25, 1.0, 2.5]),
    )
    def plan(self, loads: list[InstanceLoad], waiting: int, elapsed: float) -> None:
        """The claimer asks how much to claim, over the execservers' latest figures,
        some time after the last plan (the admission adapts once per interval)."""
        self.now += elapsed
        expected = self.ref.plan(loads, waiting, self.now)
        got = self.core.plan(loads, waiting=waiting, now=self.now)
        note(f"plan {got} (limit {self.ref.limit}, reserve {self.ref.reserve})")
        assert got == expected, f"plan {got} != reference {expected}"

    @precondition(lambda self: self.ref.plan_out is not None)
    @rule(target=running)
    def claim_answered(self) -> Any:
        """The claim statement returns its rows: they are in flight."""
        ref = self.ref
        plan = ref.plan_out
        assert plan is not None
        items = self.db.claim(plan)
        note(f"claimed {items}")
        self.core.claimed(items)
        ref.plan_out = None
        ref.running += items
        ref.counts["claimed"] += len(items)
        exec_items = [i for i in items if i.action in self.config.exec_actions]
        if plan.general:
            ref.queue_deep = len(exec_items) >= plan.general
        in_flight = len(ref.exec_running())
        ref.peak = max(ref.peak, in_flight)
        # (the limit may have dropped below what was already in flight: a claim only
        # must not add beyond it)
        if exec_items:
            assert in_flight <= ref.limit + ref.reserve, "above the limit plus the odd reserve"
            assert in_flight <= ref.cap, "above max_in_flight"
        if any(i.priority % 2 == 0 for i in exec_items):
            assert in_flight - len(ref.odd_running()) <= ref.limit, "even items above the limit"
        local_items = [i for i in items if i.action not in self.config.exec_actions]
        local_running = ref.local_running()
        local_limit = self.config.local_limit
        if local_items:
            assert len(local_running) <= local_limit + local_reserve(local_limit), "local"
        if any(i.priority % 2 == 0 for i in local_items):
            even_local = [i for i in local_running if i.priority % 2 == 0]
            assert len(even_local) <= local_limit, "even local items above the local limit"
        self.claimed_keys |= {(i.id, i.attempts) for i in items}
        return multiple(*items)

    @precondition(lambda self: self.ref.plan_out is not None)
    @rule(took_rows=st.booleans(), now=st.sampled_from([False] * 3 + [True]))
    def claim_lost(self, took_rows: bool, now: bool) -> None:
        """The claim statement fails; it may have claimed rows whose reply never came.

        About one draw in four loses the claim, so most claims are answered.
        """
        plan = self.ref.plan_out
        assert plan is not None
        if not now:
            return
        if took_rows:
            note(f"lost claim took {self.db.claim(plan)}")
        self.core.claim_failed()
        self.ref.plan_out = None
        self.ref.reconcile = True

    @precondition(lambda self: self.ref.reconcile)
    @rule()
    def reconcile(self) -> None:
        """Every row of this backend but the known ones goes back to the queue."""
        keep = self.core.known_ids()
        assert keep == {item_id for item_id, _ in self.ref.unwritten()}, "rows to keep"
        returned = self.db.return_ours(keep, how="reconciled")
        self.core.reconciled(returned)
        self.ref.reconcile = False
        self.ref.counts["returned"] += returned

    # -- running -----------------------------------------------------------------------------

    @rule(target=settling, item=consumes(running), shape=shapes())
    def finish(self, item: ClaimedRow, shape: Shape) -> Any:
        """An item's handler ends in one of the table's outcomes, in any wrapping; the
        decision (bounded by the item's attempts) goes to the application to settle."""
        exc = raised(shape)
        decision = self.core.finished(item, exc)
        verdict = decision.verdict
        bound = self.unknown_service_attempts.get(item.action)
        outcome, kind, delay = expected_verdict(
            shape, self.retry_delay, attempts=item.attempts, bound=bound
        )
        note(f"{item} ended {shape}: {verdict}")
        assert (verdict.outcome, verdict.kind, verdict.delay) == (outcome, kind, delay)
        assert (verdict.error is None) == (exc is None)
        _check_cause(verdict.cause, outcome, exc)
        if len(shape.parts) == 1 and exc is not None:
            name = type(shape.parts[0].exception("")).__name__
            text = "reason 0" if outcome == "retry_later" else f"{name}: reason 0"
            if outcome == "service_not_offered" and name == "UnknownService":
                text = f"ServiceNotOffered: reason 0, after {item.attempts} attempts"
            assert verdict.error == text, f"{verdict.error!r} != {text!r}"
        self.ref.running.remove(item)
        self.ref.settling.append(((item.id, item.attempts), outcome, kind, delay))
        return (item, decision)

    @rule(settled=consumes(settling))
    def settle(self, settled: tuple[ClaimedRow, Decision]) -> None:
        """The application settled its state by the decision: it may be written now."""
        item, decision = settled
        self.core.settled(decision)
        entry = next(d for d in self.ref.settling if d[0] == (item.id, item.attempts))
        self.ref.settling.remove(entry)
        self.ref.pending.append(entry)

    @precondition(lambda self: self.ref.closed)
    @rule(item=consumes(running))
    def abandon(self, item: ClaimedRow) -> None:
        """Shutdown cancels a running handler: no outcome."""
        self.core.abandoned(item)
        self.ref.running.remove(item)
        self.ref.abandoned.append((item.id, item.attempts))

    @precondition(lambda self: self.ref.closed)
    @rule(settled=consumes(settling))
    def abandon_settling(self, settled: tuple[ClaimedRow, Decision]) -> None:
        """Shutdown cancels the application's settling: its decision is never written."""
        item, _ = settled
        self.core.abandoned(item)
        key = (item.id, item.attempts)
        self.ref.settling = [d for d in self.ref.settling if d[0] != key]
        self.ref.abandoned.append(key)

    # -- writing -----------------------------------------------------------------------------

    @precondition(lambda self: self.ref.batch is None and self.ref.pending)
    @rule()
    def take_outcomes(self) -> None:
        """The writer takes every decision not yet written, oldest first."""
        got = [
            (d.key, d.verdict.outcome, d.verdict.kind, d.verdict.delay)
            for d in self.core.take_outcomes()
        ]
        expected, self.ref.pending = self.ref.pending, []
        assert got == expected, f"batch {got} != reference {expected}"
        self.ref.batch = expected or None

    def _apply(self) -> set[int]:
        batch = self.ref.batch
        assert batch is not None
        return self.db.finish((key[0], key[1], kind) for key, _, kind, _ in batch)

    @precondition(lambda self: self.ref.batch is not None)
    @rule()
    def write_succeeds(self) -> None:
        """The batch is written; outcomes of claims the database moved on from are fenced."""
        batch = self.ref.batch
        assert batch is not None
        ours_before = {key: self._still_ours(key) for key, *_ in batch}
        applied = self._apply()
        self.core.written(applied)
        for key, _, kind, _ in batch:
            if ours_before[key]:
                self.ref.counts[_COUNTER[kind]] += 1
            else:
                self.ref.counts["fenced"] += 1
        self.ref.batch = None

    def _still_ours(self, key: Key) -> bool:
        row = self.db.rows.get(key[0])
        return row is not None and row.ours and row.attempts == key[1]

    @precondition(lambda self: self.ref.batch is not None)
    @rule(committed=st.booleans())
    def write_fails(self, committed: bool) -> None:
        """The write fails, having committed unseen or not: the batch is written again."""
        if committed:
            self._apply()
        self.core.write_failed()
        batch = self.ref.batch
        assert batch is not None
        self.ref.pending = batch + self.ref.pending
        self.ref.batch = None

    @precondition(lambda self: self.db.ours())
    @rule(now=st.sampled_from([False] * 3 + [True]))
    def stale_sweep(self, now: bool) -> None:
        """Another backend found this one stale and requeued its rows (the database changes).

        About one draw in four sweeps: a sweep fences every outcome in flight.
        """
        if now:
            note(f"swept {self.db.sweep()} rows")

    # -- shutdown ----------------------------------------------------------------------------

    @precondition(lambda self: not self.ref.closed)
    @rule(now=st.sampled_from([False] * 7 + [True]))
    def close(self, now: bool) -> None:
        """Shutdown begins: nothing more is claimed.

        Only about one draw in eight closes, so most runs claim and write for a
        while first.
        """
        if not now:
            return
        self.core.close()
        self.ref.closed = True

    @precondition(
        lambda self: (
            self.ref.closed
            and not self.ref.running
            and not self.ref.settling
            and self.ref.batch is None
            and self.ref.plan_out is None
            and not self.ref.stopped
        )
    )
    @rule(reachable=st.booleans())
    def stop(self, reachable: bool) -> None:
        """Shutdown ends: every row still held goes back to the queue, or cannot."""
        returned = self.db.return_ours(()) if reachable else None
        self.core.stopped(returned)
        ref = self.ref
        ref.stopped = True
        ref.pending, ref.abandoned, ref.settling = [], [], []
        ref.reconcile = False
        if returned is not None:
            ref.counts["returned"] += returned
            for key, exits in self.db.exits.items():
                assert len(exits) == 1, f"claim {key} left {exits} after a clean shutdown"

    # -- checks ------------------------------------------------------------------------------

    @invariant()
    def agrees_with_the_reference(self) -> None:
        core, ref = self.core, self.ref
        core.check_invariants()
        stats = core.statistics()
        expected = {
            **ref.counts,
            "exec_in_flight": len(ref.exec_running()),
            "odd_in_flight": len(ref.odd_running()),
            "local_in_flight": len(ref.running) - len(ref.exec_running()),
            "peak_exec_in_flight": ref.peak,
            "exec_limit": ref.limit,
            "odd_reserve": ref.reserve,
            "max_in_flight": ref.cap,
            "local_odd_in_flight": sum(1 for i in ref.local_running() if i.priority % 2),
            "queue_deep": ref.queue_deep,
            "settling": len(ref.settling),
            "pending_outcomes": len(ref.pending) + len(ref.batch or ()),
            "unwritten": 0 if ref.stopped else len(ref.unwritten()),
        }
        got = {name: getattr(stats, name) for name in expected}
        assert got == expected, f"statistics {got} != reference {expected}"
        if not ref.stopped:
            assert core.known_ids() == {item_id for item_id, _ in ref.unwritten()}

    @invariant()
    def each_claim_leaves_at_most_once(self) -> None:
        for key, exits in self.db.exits.items():
            assert len(exits) <= 1, f"claim {key} left twice: {exits}"


_COUNTER = {"complete": "completed", "requeue": "requeued", "fail": "failed"}


def _check_cause(cause: BaseException | None, outcome: str, exc: BaseException | None) -> None:
    """A verdict's cause is a leaf of what was raised, of its deciding row's type; the
    bound's ``ServiceNotOffered`` is caused by a raised ``UnknownService``."""
    if exc is None:
        assert cause is None, f"ok with a cause: {cause!r}"
        return
    leaves = list(_leaves(exc))
    assert cause is not None, "no cause"
    if isinstance(cause, ServiceNotOffered) and cause not in leaves:
        assert outcome == "service_not_offered", outcome
        assert isinstance(cause.__cause__, UnknownService)
        assert cause.__cause__ in leaves
    elif outcome == "failed":
        assert cause in leaves
        assert not isinstance(cause, (RetryLater, *(_RAISE[o] for o in _TABLED)))
    else:
        expected = RetryLater if outcome == "retry_later" else _RAISE[outcome]
        assert cause in leaves
        assert isinstance(cause, expected), (cause, outcome)


_TABLED = [o for o in _ORDER if o not in ("ok", "retry_later", "failed")]


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for member in exc.exceptions for leaf in _leaves(member)]
    return [exc]


def dispatch_machine(
    *,
    admission: AdmissionConfig | None = None,
    local_limit: int = 2,
    retry_delay: float = 60.0,
    priorities: tuple[int, ...] = (-2, -1, 0, 1, 2, 3),
    unknown_service_attempts: Mapping[str, int] | None = None,
) -> type[DispatchMachine]:
    """A :class:`DispatchMachine` for these settings.

    Args:
        admission: CPU count, odd reserve, ``max_in_flight``, database pool, idle use.
        local_limit: local-bound items in flight at most.
        retry_delay: the delay of the outcomes that requeue *later*.
        priorities: the priorities of the rows enqueued (odd ones are the reserve's).
        unknown_service_attempts: the bound of ``unknown_service`` per action
            (``exec_a``, ``exec_b``, ``local``); by default ``exec_a`` fails from
            its second claim on and the others are unbounded.

    Returns:
        A state machine class; run it with ``.TestCase`` under pytest/unittest.
    """
    attributes: dict[str, Any] = {
        "admission": admission or AdmissionConfig(cpus=1, odd_reserve=2, db_pool=4),
        "local_limit": local_limit,
        "retry_delay": retry_delay,
        "priorities": priorities,
        "unknown_service_attempts": (
            {"exec_a": 2} if unknown_service_attempts is None else dict(unknown_service_attempts)
        ),
    }
    return type("ConfiguredDispatchMachine", (DispatchMachine,), attributes)
