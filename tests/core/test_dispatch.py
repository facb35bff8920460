"""The dispatch core: the outcome table, exception groups, and the bookkeeping's misuse rules."""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest

from trio_broker.core import dispatch
from trio_broker.core.admission import AdmissionConfig, ClaimPlan, InstanceLoad
from trio_broker.core.callers import answer_caller
from trio_broker.core.dispatch import (
    OUTCOMES,
    Backoff,
    DispatchConfig,
    DispatchCore,
    Verdict,
    judge,
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
)

RETRY = 60.0

# -- the table -------------------------------------------------------------------------------


def table_rows() -> list[list[str]]:
    """The rows of the outcome table in the module docstring, as three cells each."""
    doc = dispatch.__doc__ or ""
    block = doc.split("The outcome table", 1)[1].split("Why.", 1)[0]
    lines = [line for line in block.splitlines() if line.startswith("``")]
    return [re.split(r"\s{2,}", line.strip()) for line in lines]


def test_the_docstring_table_is_the_table() -> None:
    """Every row of the docstring's table names the same outcome, exception and verdict
    as OUTCOMES, in the same order."""
    rows = table_rows()
    assert [row[0].strip("`") for row in rows] == [rule.outcome for rule in OUTCOMES]
    for (_, raised, item), rule in zip(rows, OUTCOMES, strict=True):
        if rule.raised:
            assert raised == f"raises ``{rule.raised[0].__name__}``"
        expected = {
            ("complete", None): "complete: its row is deleted",
            ("requeue", "retry_delay"): "requeued after ``retry_delay``",
            ("requeue", "at_once"): "requeued at once",
            ("requeue", "raised"): "requeued after its ``delay``",
            ("fail", None): "failed, with the exception's text",
        }[rule.kind, rule.delay]
        assert item == expected


@pytest.mark.parametrize(
    ("exc", "outcome", "kind", "delay"),
    [
        (None, "ok", "complete", 0.0),
        (NoSlot("no slot within 60 s"), "no_slot", "requeue", RETRY),
        (JobStopped("drained"), "stopped", "requeue", RETRY),
        (UnknownService("nobody offers x"), "unknown_service", "requeue", RETRY),
        (NoExecserver("none"), "no_execserver", "requeue", 0.0),
        (JobLost("gone"), "lost", "requeue", 0.0),
        (ClientClosed("closing"), "client_closed", "requeue", 0.0),
        (StoreUnavailable("down"), "store_unavailable", "requeue", 0.0),
        (RetryLater(7, "busy upstream"), "retry_later", "requeue", 7.0),
        (ValueError("boom"), "failed", "fail", 0.0),
        (TimeoutError(), "failed", "fail", 0.0),
    ],
)
def test_each_row_judges_its_exception(
    exc: Exception | None, outcome: str, kind: str, delay: float
) -> None:
    """A handler's end is judged by its row: the outcome, what is written and the delay."""
    verdict = judge(exc, retry_delay=RETRY)
    assert (verdict.outcome, verdict.kind, verdict.delay) == (outcome, kind, delay)


def test_the_text_is_the_exceptions_description() -> None:
    """The stored text names the type and message, a RetryLater's reason, nothing for ok."""
    assert judge(None, retry_delay=RETRY).error is None
    assert judge(NoSlot("no slot"), retry_delay=RETRY).error == "NoSlot: no slot"
    assert judge(RetryLater(1, "stopped: drained"), retry_delay=RETRY).error == "stopped: drained"
    assert judge(ValueError("boom"), retry_delay=RETRY).error == "ValueError: boom"


def test_a_subclass_follows_its_bases_row() -> None:
    """An exception derived from a row's type is judged by that row."""

    class SlotTimeout(NoSlot):
        pass

    assert judge(SlotTimeout("x"), retry_delay=RETRY).outcome == "no_slot"


def test_a_group_of_one_is_judged_as_its_exception() -> None:
    """A single exception inside (nested) groups gets the same verdict as on its own."""
    alone = judge(NoSlot("in a group"), retry_delay=RETRY)
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [NoSlot("in a group")])])
    assert judge(nested, retry_delay=RETRY) == alone
    assert judge(ExceptionGroup("", [ValueError("x")]), retry_delay=RETRY) == judge(
        ValueError("x"), retry_delay=RETRY
    )


def test_in_a_group_a_failure_wins_over_any_requeue() -> None:
    """A group holding a bug and a temporary reason fails, with the bug's text."""
    group = ExceptionGroup("", [NoSlot("busy"), ExceptionGroup("", [KeyError("k")])])
    verdict = judge(group, retry_delay=RETRY)
    assert (verdict.outcome, verdict.kind, verdict.error) == ("failed", "fail", "KeyError: 'k'")


def test_in_a_group_of_requeues_the_longest_delay_wins() -> None:
    """Of several temporary reasons the most patient decides; RetryLaters give their longest."""
    at_once_and_later = ExceptionGroup("", [JobLost("a"), UnknownService("b")])
    verdict = judge(at_once_and_later, retry_delay=RETRY)
    assert (verdict.outcome, verdict.delay, verdict.error) == (
        "unknown_service",
        RETRY,
        "UnknownService: b",
    )
    retries = ExceptionGroup("", [RetryLater(5, "a"), ExceptionGroup("", [RetryLater(500, "b")])])
    assert judge(retries, retry_delay=RETRY) == Verdict(
        outcome="retry_later", kind="requeue", delay=500.0, error="a; b"
    )
    assert judge(ExceptionGroup("", [RetryLater(5, "a"), NoSlot("n")]), retry_delay=RETRY) == (
        Verdict(outcome="no_slot", kind="requeue", delay=RETRY, error="NoSlot: n")
    )


def test_in_a_group_a_tie_goes_to_the_earlier_row() -> None:
    """Two reasons with the same delay: the one listed first in the table decides."""
    group = ExceptionGroup("", [StoreUnavailable("s"), NoExecserver("n")])
    assert judge(group, retry_delay=RETRY).outcome == "no_execserver"


# -- the bookkeeping -------------------------------------------------------------------------


@attrs.frozen
class Item:
    id: int
    action: str
    priority: int = 0
    attempts: int = 1


LOADS = [InstanceLoad(instance_id="x", processes=4, clients=1, idle=0)]


def decide(c: DispatchCore, item: Item, exc: BaseException | None) -> dispatch.Decision:
    """The item's handler ended with ``exc``; its decision settled at once (nothing to settle)."""
    decision = c.finished(item, exc)
    c.settled(decision)
    return decision


def core(**overrides: Any) -> DispatchCore:
    settings: dict[str, Any] = {
        "exec_actions": frozenset({"exec"}),
        "local_actions": frozenset({"sync"}),
        "local_limit": 2,
        "admission": AdmissionConfig(cpus=2, odd_reserve=2, db_pool=10),
        "retry_delay": RETRY,
    }
    settings.update(overrides)
    return DispatchCore(DispatchConfig(**settings))


def test_a_plan_takes_the_limit_plus_the_odd_reserve() -> None:
    """Four slots: limit 6 (share + CPUs) for any priority, 2 more for odd ones only."""
    c = core()
    assert c.plan(LOADS) == ClaimPlan(general=6, odd_only=2, local=2, local_odd_only=1)
    c.claimed([Item(i, "exec", priority=1) for i in range(8)])
    stats = c.statistics()
    assert (stats.exec_limit, stats.odd_reserve, stats.exec_in_flight) == (6, 2, 8)
    assert (stats.exec_base, stats.max_in_flight) == (6, 20)
    assert c.plan(LOADS) == ClaimPlan(general=0, odd_only=0, local=2, local_odd_only=1)


def test_config_defaults_are_the_documented_ones() -> None:
    config = DispatchConfig()
    assert (config.exec_actions, config.local_actions) == (frozenset(), frozenset())
    assert (config.local_limit, config.retry_delay) == (1, 60.0)
    assert config.admission == AdmissionConfig()


def test_without_local_actions_there_is_no_local_reserve() -> None:
    c = core(local_actions=frozenset(), local_limit=3)
    assert c.config.local_reserve == 0
    assert c.statistics().local_reserve == 0
    assert core(local_limit=3).statistics().local_reserve > 0


def test_value_classes_are_keyword_only() -> None:
    # Rule is a table row, built by position on purpose; the rest take keywords
    for cls in (Verdict, dispatch.Decision, DispatchConfig, dispatch.DispatchStatistics):
        assert all(field.kw_only for field in attrs.fields(cls)), cls


def test_no_exec_action_means_no_exec_claim() -> None:
    """A core without exec-bound actions plans nothing exec-bound, whatever the loads."""
    c = core(exec_actions=frozenset())
    assert c.plan(LOADS) == ClaimPlan(general=0, odd_only=0, local=2, local_odd_only=1)


def test_no_local_action_means_no_local_claim() -> None:
    c = core(local_actions=frozenset(), local_limit=3)
    assert c.plan(LOADS) == ClaimPlan(general=6, odd_only=2, local=0, local_odd_only=0)


def test_local_slots_held_by_even_items_leave_the_reserve_to_odd_ones() -> None:
    """With every local slot held by even items, the next plan still asks for an odd local
    item, and refuses an even one in its place."""
    c = core()
    c.plan(LOADS)
    c.claimed([Item(1, "sync", priority=0), Item(2, "sync", priority=2)])
    plan = c.plan(LOADS)
    assert (plan.local, plan.local_odd_only) == (0, 1)
    with pytest.raises(DispatchUsageError, match="local"):
        c.claimed([Item(3, "sync", priority=0)])
    c.claimed([Item(3, "sync", priority=3)])
    stats = c.statistics()
    assert (stats.local_in_flight, stats.local_odd_in_flight, stats.local_reserve) == (3, 1, 1)
    assert c.plan(LOADS).local_total == 0
    c.check_invariants()


def test_the_core_accumulates_the_rise_with_the_time_passed_in() -> None:
    """Idle slots raise the limit once per second of the clock passed in, and it stays up."""
    c = core()
    idle = [InstanceLoad(instance_id="x", processes=4, clients=1, idle=2)]
    assert c.plan(idle, now=0.0).general == 6
    c.claimed([Item(i, "exec") for i in range(6)])  # got all it asked for: the queue is deep
    assert c.plan(idle, now=0.5).general == 0  # same second: no new rise
    c.claimed([])
    assert c.plan(idle, now=1.0).general == 2
    c.claimed([Item(i, "exec") for i in range(6, 8)])
    assert c.plan(idle, now=2.0).general == 2
    assert c.statistics().admission_rise == 4


def test_finishing_frees_the_slot_and_queues_one_decision() -> None:
    """A finished item leaves the counts in flight and waits to be written, once."""
    c = core()
    c.plan(LOADS)
    item = Item(1, "exec", priority=3)
    c.claimed([item])
    decision = decide(c, item, NoSlot("busy"))
    assert decision.verdict.delay == RETRY
    assert c.statistics().exec_in_flight == c.statistics().odd_in_flight == 0
    assert c.take_outcomes() == [decision]
    c.written({1})
    assert (c.statistics().requeued, c.statistics().unwritten) == (1, 0)
    c.check_invariants()


def test_a_failed_write_goes_first_in_the_next_batch() -> None:
    """Decisions whose write failed are written again, ahead of the newer ones."""
    c = core()
    c.plan(LOADS)
    a, b = Item(1, "exec"), Item(2, "exec")
    c.claimed([a, b])
    first = decide(c, a, None)
    assert c.take_outcomes() == [first]
    second = decide(c, b, None)
    c.write_failed()
    assert c.take_outcomes() == [first, second]
    c.written({2})  # 1 committed unseen before: fenced now
    stats = c.statistics()
    assert (stats.completed, stats.fenced, stats.pending_outcomes) == (1, 1, 0)


def test_a_lost_claim_keeps_the_known_rows() -> None:
    """After a claim's reply is lost, the rows to keep are the ones claimed and unwritten."""
    c = core()
    c.plan(LOADS)
    c.claimed([Item(1, "exec"), Item(2, "sync")])
    c.plan(LOADS)
    c.claim_failed()
    assert c.needs_reconcile
    with pytest.raises(DispatchUsageError, match="reconciled"):
        c.plan(LOADS)
    assert c.known_ids() == {1, 2}
    c.reconciled(returned=3)
    assert (c.needs_reconcile, c.statistics().returned) == (False, 3)


def test_shutdown_returns_what_is_unwritten() -> None:
    """Abandoned items and undelivered decisions are all returned when the core stops."""
    c = core()
    c.plan(LOADS)
    a, b = Item(1, "exec"), Item(2, "sync")
    c.claimed([a, b])
    c.abandoned(a)
    decide(c, b, None)
    c.close()
    assert c.plan(LOADS).total == 0
    c.stopped(returned=2)
    stats = c.statistics()
    assert (stats.unwritten, stats.pending_outcomes, stats.returned) == (0, 0, 2)
    c.check_invariants()


def planned(c: DispatchCore) -> DispatchCore:
    c.plan(LOADS)
    return c


MISUSES: dict[str, tuple[Any, Any]] = {
    "more even rows than the general share": (
        planned,
        lambda c: c.claimed([Item(i, "exec") for i in range(7)]),
    ),
    "more exec rows than general plus odd-only": (
        planned,
        lambda c: c.claimed([Item(i, "exec", priority=1) for i in range(9)]),
    ),
    "more local rows than the local share": (
        planned,
        lambda c: c.claimed([Item(i, "sync") for i in range(3)]),
    ),
    "a row of an unknown action": (planned, lambda c: c.claimed([Item(1, "other")])),
    "the same claim twice in one reply": (
        planned,
        lambda c: c.claimed([Item(1, "exec"), Item(1, "exec")]),
    ),
    "a reply without a plan": (lambda c: c, lambda c: c.claimed([Item(1, "exec")])),
    "a failed claim without a plan": (lambda c: c, lambda c: c.claim_failed()),
    "a plan while a claim is out": (planned, lambda c: c.plan(LOADS)),
    "finishing an item that is not running": (planned, lambda c: c.finished(Item(9, "x"), None)),
    "abandoning an item that is not running": (planned, lambda c: c.abandoned(Item(9, "x"))),
    "a write reported without a batch": (planned, lambda c: c.written({1})),
    "a failed write without a batch": (planned, lambda c: c.write_failed()),
}


@pytest.mark.parametrize("name", sorted(MISUSES))
def test_misuse_raises_and_changes_nothing(name: str) -> None:
    """Each misuse of the dispatch core raises DispatchUsageError and leaves it as it was."""
    setup, misuse = MISUSES[name]
    c = setup(core())
    before = c.statistics()
    with pytest.raises(DispatchUsageError):
        misuse(c)
    assert c.statistics() == before
    c.check_invariants()


def test_a_row_twice_in_a_claim_a_second_batch_and_stopping_while_running_are_misuse() -> None:
    """A row twice in one claim, a second batch before the first is written, and
    stopping while items run all raise."""
    c = core()
    c.plan(LOADS)
    item = Item(1, "exec")
    c.claimed([item])
    c.plan(LOADS)
    before = c.statistics()
    with pytest.raises(DispatchUsageError, match="twice"):
        c.claimed([Item(2, "exec"), Item(2, "exec")])
    assert c.statistics() == before
    c.claimed([])
    decide(c, item, None)
    c.take_outcomes()
    with pytest.raises(DispatchUsageError, match="being written"):
        c.take_outcomes()
    running = core()
    running.plan(LOADS)
    running.claimed([Item(5, "exec")])
    with pytest.raises(DispatchUsageError, match="items run"):
        running.stopped(0)


def test_a_stopped_core_claims_and_writes_nothing() -> None:
    """stopped() without close() first still ends the claims, and a batch taken before
    it cannot be written after it."""
    c = core()
    c.plan(LOADS)
    item = Item(1, "exec")
    c.claimed([item])
    decide(c, item, None)
    assert c.take_outcomes()
    c.stopped(returned=None)
    assert c.plan(LOADS) == ClaimPlan()
    with pytest.raises(DispatchUsageError, match="without a batch"):
        c.written([1])
    assert c.statistics().returned == 0


@pytest.mark.parametrize(("low", "high"), [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (1.0, -1.0)])
def test_backoff_needs_positive_delays(low: float, high: float) -> None:
    with pytest.raises(ValueError, match="expected delays above 0"):
        Backoff(low, high)


def test_backoff_doubles_to_its_ceiling_and_resets() -> None:
    """A failing call waits low, 2·low, … up to high; a success starts over at low."""
    backoff = Backoff(0.1, 0.5)
    assert [backoff.failed() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.succeeded()
    assert backoff.failed() == 0.1


def test_sweep_reclaim_outcomes_in_one_batch_race() -> None:
    """A row swept back while its item ran and claimed again has two claims in one batch;
    when the store applies the row's id, only the latest claim counts, the older is fenced."""
    c = core()
    c.plan(LOADS)
    first = Item(5, "exec", attempts=1)
    c.claimed([first])
    c.plan(LOADS)
    second = Item(5, "exec", attempts=2)
    c.claimed([second])
    decide(c, first, None)
    decide(c, second, None)
    assert [d.key for d in c.take_outcomes()] == [(5, 1), (5, 2)]
    c.written({5})
    stats = c.statistics()
    assert (stats.completed, stats.fenced, stats.unwritten) == (1, 1, 0)


# -- waiting callers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "outcome", "status", "retry_after"),
    [
        (NoSlot("no slot within 60s"), "no_slot", 503, None),
        (NoExecserver("no execserver is connected"), "no_execserver", 503, None),
        (JobLost("connection lost"), "lost", 503, None),
        (RetryLater(30.0, "source busy"), "retry_later", 503, 30.0),
        (ValueError("bad input"), "failed", 500, None),
        (ExceptionGroup("g", [NoSlot("busy"), ValueError("bug")]), "failed", 500, None),
    ],
)
def test_a_waiting_caller_gets_an_error_where_a_step_would_be_requeued(
    exc: Exception, outcome: str, status: int, retry_after: float | None
) -> None:
    """What the table requeues a queued step on is 503 with its reason for a caller that
    waits for its answer; a failure is 500; never a requeue."""
    answer = answer_caller(exc)
    assert (answer.outcome, answer.status, answer.retry_after) == (outcome, status, retry_after)
    assert answer.error == judge(exc, retry_delay=60.0).error


# -- the bound of unknown_service, the cause, settling ---------------------------------------


def test_unknown_service_fails_from_its_actions_bound_on() -> None:
    """Below the action's bound an UnknownService requeues; from the bound on it fails as
    ServiceNotOffered, saying how often the item came back; an action without a bound waits."""
    c = core(unknown_service_attempts={"exec": 3})
    c.plan(LOADS)
    c.claimed(
        [Item(1, "exec", attempts=2), Item(2, "exec", attempts=3), Item(3, "sync", attempts=9)]
    )
    early = c.finished(Item(1, "exec", attempts=2), UnknownService("nobody offers 'x'"))
    bounded = c.finished(Item(2, "exec", attempts=3), UnknownService("nobody offers 'x'"))
    unbounded = c.finished(Item(3, "sync", attempts=9), UnknownService("nobody offers 'x'"))
    assert (early.verdict.outcome, early.verdict.kind) == ("unknown_service", "requeue")
    assert unbounded.verdict.kind == "requeue"
    assert bounded.verdict == Verdict(
        outcome="service_not_offered",
        kind="fail",
        error="ServiceNotOffered: nobody offers 'x', after 3 attempts",
    )
    cause = bounded.verdict.cause
    assert isinstance(cause, ServiceNotOffered)
    assert isinstance(cause.__cause__, UnknownService)


def test_the_bound_applies_to_the_unknown_service_of_a_group() -> None:
    """In a group the bounded UnknownService is a failure, and a failure wins."""
    group = ExceptionGroup("", [RetryLater(3600, "later"), UnknownService("nobody")])
    verdict = judge(group, retry_delay=RETRY, attempts=5, unknown_service_attempts=5)
    assert (verdict.outcome, verdict.kind) == ("service_not_offered", "fail")
    assert judge(group, retry_delay=RETRY, attempts=4, unknown_service_attempts=5).outcome == (
        "retry_later"
    )


def test_a_verdict_names_the_exception_that_decided() -> None:
    """The cause is the deciding part's first leaf, not part of the value."""
    slot, bug = NoSlot("busy"), KeyError("k")
    assert judge(ExceptionGroup("", [ExceptionGroup("", [slot])]), retry_delay=RETRY).cause is slot
    assert judge(ExceptionGroup("", [slot, bug]), retry_delay=RETRY).cause is bug
    assert judge(None, retry_delay=RETRY).cause is None
    assert judge(slot, retry_delay=RETRY) == Verdict(
        outcome="no_slot", kind="requeue", delay=RETRY, error="NoSlot: busy"
    )
    assert "cause" not in repr(judge(slot, retry_delay=RETRY))


def test_a_retry_later_without_a_delay_waits_the_retry_delay() -> None:
    """RetryLater(None) leaves the delay to the queue's one retry_delay."""
    verdict = judge(RetryLater(None, "storage: disk full"), retry_delay=RETRY)
    assert (verdict.outcome, verdict.delay, verdict.error) == (
        "retry_later",
        RETRY,
        "storage: disk full",
    )
    assert str(RetryLater(None, "x")) == "retry later: x"
    group = ExceptionGroup("", [RetryLater(None, "a"), RetryLater(5, "b")])
    assert judge(group, retry_delay=RETRY).delay == RETRY


def test_a_decision_is_written_only_once_settled() -> None:
    """Between finished() and settled() the decision is neither in flight nor to be written;
    shutdown meanwhile abandons the item, and its decision is never written."""
    c = core()
    c.plan(LOADS)
    a, b = Item(1, "exec"), Item(2, "exec")
    c.claimed([a, b])
    first = c.finished(a, JobLost("gone"))
    second = c.finished(b, ValueError("bad input"))
    stats = c.statistics()
    assert (stats.exec_in_flight, stats.settling, stats.pending_outcomes) == (0, 2, 0)
    assert c.take_outcomes() == []
    c.settled(first)
    c.check_invariants()
    c.close()
    c.abandoned(b)
    assert c.take_outcomes() == [first]
    c.written({1})
    c.stopped(returned=1)
    stats = c.statistics()
    assert (stats.requeued, stats.failed, stats.returned, stats.settling) == (1, 0, 1, 0)
    assert second.verdict.kind == "fail"


def test_settling_misuse_raises_and_changes_nothing() -> None:
    """A decision settled twice, one never made, and stopping while one is settled raise."""
    c = core()
    c.plan(LOADS)
    item = Item(1, "exec")
    c.claimed([item])
    decision = c.finished(item, None)
    foreign = attrs.evolve(decision, item_id=9)
    before = c.statistics()
    with pytest.raises(DispatchUsageError, match="not being settled"):
        c.settled(foreign)
    with pytest.raises(DispatchUsageError, match="1 are being settled"):
        c.stopped(0)
    assert c.statistics() == before
    c.settled(decision)
    with pytest.raises(DispatchUsageError, match="not being settled"):
        c.settled(decision)
    with pytest.raises(DispatchUsageError, match="neither running nor settling"):
        c.abandoned(item)
    c.check_invariants()


@pytest.mark.parametrize(
    ("attempts", "match"),
    [({"other": 2}, "unknown action 'other'"), ({"exec": 0}, r"\['exec'\] must be at least 1")],
)
def test_a_bound_for_an_unknown_action_or_below_one_is_refused(
    attempts: dict[str, int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        core(unknown_service_attempts=attempts)


def test_a_recheck_drops_the_claims_the_database_no_longer_shows() -> None:
    """Running and settling items whose claim the database no longer shows are lost:
    out of flight, out of the rows to keep, never decided or written; the ones still
    held stay."""
    c = core()
    c.plan(LOADS)
    a, b, d = Item(1, "exec"), Item(2, "exec"), Item(3, "exec")
    c.claimed([a, b, d])
    settling = c.finished(b, None)
    assert c.recheck({(3, 1)}) == [(1, 1), (2, 1)]
    stats = c.statistics()
    assert (stats.lost, stats.exec_in_flight, stats.settling, stats.unwritten) == (2, 1, 0, 1)
    assert c.known_ids() == {3}
    with pytest.raises(DispatchUsageError):
        c.settled(settling)
    c.check_invariants()


def test_a_recheck_waits_for_the_outstanding_claim() -> None:
    c = core()
    c.plan(LOADS)
    with pytest.raises(DispatchUsageError, match="outstanding"):
        c.recheck(set())


def test_a_claim_returned_again_at_the_same_attempt_is_not_started_twice() -> None:
    """A restart lost a claim's commit and this backend claimed the row again at the
    same attempt: the item running under it stands; only new rows start."""
    c = core()
    c.plan(LOADS)
    c.claimed([Item(1, "exec")])
    c.plan(LOADS)
    fresh = c.claimed([Item(1, "exec"), Item(2, "exec")])
    assert fresh == [Item(2, "exec")]
    stats = c.statistics()
    assert (stats.claimed, stats.reclaimed, stats.exec_in_flight) == (2, 1, 2)
    c.check_invariants()
    c.plan(LOADS)
    with pytest.raises(DispatchUsageError, match="twice"):
        c.claimed([Item(3, "exec"), Item(3, "exec")])
