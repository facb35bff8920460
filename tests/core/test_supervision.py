"""The pure supervision rules: Watchdog, MemoryBudget, how a job ends, the sentence helpers."""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_broker.core.supervision import (
    Ending,
    MemoryBudget,
    PipeWait,
    Verdict,
    Watchdog,
    abort_ending,
    budget_verdict,
    command_end,
    format_bytes,
    format_duration,
    pipe_ending,
    receipt_end,
    verdict_ending,
)

MB = 1_000_000


def idle(dog: Watchdog, now: float, rss: int = 0) -> Verdict | None:
    """A sample that shows no progress (nothing moved since the start)."""
    return dog.sample(now, rss=rss, cpu_seconds=0.0, io_bytes=0, dir_bytes=0)


# -- examples -------------------------------------------------------------------


def test_timeout_fires_at_the_deadline() -> None:
    """A job is timed out at the first sample at or after started + timeout."""
    dog = Watchdog(started=100.0, timeout=2.0, stall_timeout=None, memory_limit=None)
    assert dog.next_deadline() == 102.0
    assert idle(dog, 101.999) is None
    assert idle(dog, 102.0) == Verdict(status="timed_out", error="timed out after 2s")


def test_stall_fires_after_no_progress() -> None:
    """With no progress at all, the job is stalled once stall_timeout has passed."""
    dog = Watchdog(started=0.0, timeout=None, stall_timeout=600.0, memory_limit=None)
    assert idle(dog, 599.0) is None
    assert idle(dog, 600.0) == Verdict(status="stalled", error="stalled: no progress for 10m")


@pytest.mark.parametrize(
    ("cpu_seconds", "io_bytes", "dir_bytes"),
    [(0.0, 1, 0), (0.0, 0, 1), (0.5, 0, 0)],
    ids=["output", "files", "cpu"],
)
def test_each_kind_of_progress_resets_the_stall_clock(
    cpu_seconds: float, io_bytes: int, dir_bytes: int
) -> None:
    """Bytes moved, files growing, or 5 % of a core each count as progress."""
    dog = Watchdog(started=0.0, timeout=None, stall_timeout=10.0, memory_limit=None)
    assert (
        dog.sample(9.0, rss=0, cpu_seconds=cpu_seconds, io_bytes=io_bytes, dir_bytes=dir_bytes)
        is None
    )
    assert dog.last_progress == 9.0
    assert dog.next_deadline() == 19.0
    assert (
        dog.sample(18.9, rss=0, cpu_seconds=cpu_seconds, io_bytes=io_bytes, dir_bytes=dir_bytes)
        is None
    )
    assert (
        dog.sample(19.0, rss=0, cpu_seconds=cpu_seconds, io_bytes=io_bytes, dir_bytes=dir_bytes)
        is not None
    )


def test_cpu_share_threshold() -> None:
    """CPU counts as progress from exactly cpu_share of one core since the previous sample."""
    dog = Watchdog(started=0.0, timeout=None, stall_timeout=100.0, memory_limit=None)
    dog.sample(10.0, rss=0, cpu_seconds=0.5, io_bytes=0, dir_bytes=0)  # 5 % of 10 s
    assert dog.last_progress == 10.0
    dog.sample(20.0, rss=0, cpu_seconds=0.99, io_bytes=0, dir_bytes=0)  # 4.9 %
    assert dog.last_progress == 10.0


def test_shrinking_is_not_progress() -> None:
    """Deleted files or a drop in group CPU time (a member left) are no progress."""
    dog = Watchdog(started=0.0, timeout=None, stall_timeout=5.0, memory_limit=None)
    dog.sample(1.0, rss=0, cpu_seconds=1.0, io_bytes=0, dir_bytes=1000)
    assert dog.last_progress == 1.0
    assert dog.sample(2.0, rss=0, cpu_seconds=0.2, io_bytes=0, dir_bytes=10) is None
    assert dog.last_progress == 1.0
    assert dog.sample(6.0, rss=0, cpu_seconds=0.2, io_bytes=0, dir_bytes=10) is not None


def test_two_samples_at_one_instant_prove_nothing() -> None:
    """A zero-length interval with no CPU used is not progress (0 >= 0 does not count)."""
    dog = Watchdog(started=0.0, timeout=None, stall_timeout=5.0, memory_limit=None)
    idle(dog, 1.0)
    idle(dog, 1.0)
    assert dog.last_progress == 0.0


def test_memory_ceiling() -> None:
    """A sampled RSS above the job's own ceiling is out of memory; equal is fine."""
    dog = Watchdog(started=0.0, timeout=None, stall_timeout=None, memory_limit=200 * MB)
    assert idle(dog, 1.0, rss=200 * MB) is None
    assert idle(dog, 2.0, rss=310 * MB) == Verdict(
        status="out_of_memory",
        error="out of memory: 310 MB exceeds the job's ceiling of 200 MB",
    )
    assert dog.peak_memory == 310 * MB


def test_no_limits_never_decide() -> None:
    """Without any limit a watchdog only tracks the peak and never has a deadline."""
    dog = Watchdog(started=0.0, timeout=None, stall_timeout=None, memory_limit=None)
    assert dog.peak_memory is None
    assert dog.next_deadline() is None
    assert idle(dog, 1e9, rss=10**15) is None
    assert dog.peak_memory == 10**15


def test_verdict_is_final() -> None:
    """After a verdict every sample returns it again, and there is no next deadline."""
    dog = Watchdog(started=0.0, timeout=1.0, stall_timeout=None, memory_limit=10)
    first = idle(dog, 1.0)
    assert first is not None
    assert first.status == "timed_out"
    assert dog.verdict == first
    assert dog.next_deadline() is None
    assert dog.sample(5.0, rss=100, cpu_seconds=9.0, io_bytes=9, dir_bytes=9) == first
    assert dog.peak_memory == 100


def test_time_going_backwards_is_a_caller_error() -> None:
    """A sample earlier than the previous one raises ValueError."""
    dog = Watchdog(started=10.0, timeout=None, stall_timeout=None, memory_limit=None)
    with pytest.raises(ValueError, match="backwards"):
        idle(dog, 9.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": 0.0},
        {"stall_timeout": -1.0},
        {"memory_limit": 0},
        {"timeout": float("inf")},
        {"cpu_share": 0.0},
        {"cpu_share": 1.5},
    ],
)
def test_bad_limits_raise(kwargs: dict[str, float]) -> None:
    """Zero, negative or infinite limits and a cpu_share outside (0, 1] are refused."""
    args: dict[str, float | None] = {"timeout": None, "stall_timeout": None, "memory_limit": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match="must be"):
        Watchdog(started=0.0, **args)  # type: ignore[arg-type]


def test_budget_verdict_sentence() -> None:
    """The shared-budget verdict names the total in use, the budget and the job's share."""
    verdict = budget_verdict(rss=800 * MB, used=1_200 * MB, total=1_000 * MB)
    assert verdict == Verdict(
        status="out_of_memory",
        error=(
            "out of memory: 1.2 GB in use exceeds the shared budget of 1.0 GB, "
            "and this job holds the most (800 MB)"
        ),
    )


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.001, "1ms"),
        (0.5, "0.5s"),
        (2, "2s"),
        (2.25, "2.25s"),
        (59.5, "59.5s"),
        (59.999, "1m"),
        (90, "1m30s"),
        (600, "10m"),
        (3600, "1h"),
        (5400, "1h30m"),
        (43200, "12h"),
        (3661, "1h1m1s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    """Durations read like the configuration's duration strings."""
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1.0 kB"),
        (1_234_567, "1.2 MB"),
        (9_960_000, "10 MB"),
        (310 * MB, "310 MB"),
        (999_499_999, "999 MB"),
        (999_500_000, "1.0 GB"),
        (10**21, "1000 EB"),
    ],
)
def test_format_bytes(count: int, text: str) -> None:
    """Byte counts use decimal units, one decimal below 10."""
    assert format_bytes(count) == text


def test_format_helpers_refuse_negatives() -> None:
    """Negative durations and sizes are a caller's mistake."""
    with pytest.raises(ValueError, match="non-negative"):
        format_duration(-1)
    with pytest.raises(ValueError, match="non-negative"):
        format_bytes(-1)


# -- properties -----------------------------------------------------------------

gaps = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
limits = st.floats(min_value=1e-3, max_value=1e4, allow_nan=False)
starts = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(
    started=starts,
    stall=limits,
    steps=st.lists(
        st.tuples(gaps.filter(lambda g: g > 0), st.sampled_from(["io", "dir", "cpu"])),
        max_size=50,
    ),
)
def test_progress_every_sample_never_stalls(
    started: float, stall: float, steps: list[tuple[float, str]]
) -> None:
    """A job with progress at every sample is never stalled, however far apart the samples."""
    dog = Watchdog(started=started, timeout=None, stall_timeout=stall, memory_limit=None)
    now, cpu, io, dir_bytes = started, 0.0, 0, 0
    for gap, kind in steps:
        now += gap
        if kind == "io":
            io += 1
        elif kind == "dir":
            dir_bytes += 1
        else:
            cpu += gap  # one full core
        assert dog.sample(now, rss=0, cpu_seconds=cpu, io_bytes=io, dir_bytes=dir_bytes) is None
        assert dog.last_progress == now


@given(
    started=starts,
    timeout=limits | st.none(),
    stall=limits | st.none(),
    memory_limit=st.integers(1, 10**12) | st.none(),
    gap=gaps,
    rss=st.integers(0, 10**12),
)
def test_verdict_order(
    started: float,
    timeout: float | None,
    stall: float | None,
    memory_limit: int | None,
    gap: float,
    rss: int,
) -> None:
    """Of the rules that hold at a sample, timed_out beats stalled beats out_of_memory."""
    dog = Watchdog(started=started, timeout=timeout, stall_timeout=stall, memory_limit=memory_limit)
    now = started + gap
    holds = [
        status
        for status, condition in [
            ("timed_out", timeout is not None and now >= started + timeout),
            ("stalled", stall is not None and now >= started + stall),
            ("out_of_memory", memory_limit is not None and rss > memory_limit),
        ]
        if condition
    ]
    note(f"rules that hold: {holds}")
    verdict = idle(dog, now, rss=rss)
    assert (verdict.status if verdict else None) == (holds[0] if holds else None)


@given(started=starts, timeout=limits | st.none(), stall=limits | st.none())
def test_sampling_at_the_next_deadline_decides(
    started: float, timeout: float | None, stall: float | None
) -> None:
    """A sample taken exactly at next_deadline() gets a verdict (no spinning on rounding)."""
    dog = Watchdog(started=started, timeout=timeout, stall_timeout=stall, memory_limit=None)
    deadline = dog.next_deadline()
    if deadline is None:
        assert timeout is None
        assert stall is None
        return
    assert idle(dog, deadline) is not None


@st.composite
def sample_runs(draw: st.DrawFn) -> list[tuple[float, int, float, int, int]]:
    """Samples as (gap, rss, cpu delta, io delta, dir delta); cpu and dir may shrink."""
    return draw(
        st.lists(
            st.tuples(
                gaps,
                st.integers(0, 10**10),
                st.floats(-1.0, 10.0, allow_nan=False),
                st.integers(0, 3),
                st.integers(-3, 3),
            ),
            max_size=40,
        )
    )


@given(
    timeout=limits | st.none(),
    stall=limits | st.none(),
    memory_limit=st.integers(1, 10**10) | st.none(),
    cpu_share=st.floats(0.01, 1.0),
    run=sample_runs(),
)
def test_matches_a_plain_model(
    timeout: float | None,
    stall: float | None,
    memory_limit: int | None,
    cpu_share: float,
    run: list[tuple[float, int, float, int, int]],
) -> None:
    """The watchdog agrees, sample by sample, with a direct reading of the rules."""
    dog = Watchdog(
        started=0.0,
        timeout=timeout,
        stall_timeout=stall,
        memory_limit=memory_limit,
        cpu_share=cpu_share,
    )
    now = cpu = 0.0
    io = dir_bytes = 0
    last_progress = 0.0
    decided: str | None = None
    peak = 0
    for gap, rss, cpu_delta, io_delta, dir_delta in run:
        now += gap
        cpu = max(cpu + cpu_delta, 0.0)
        io += io_delta
        dir_bytes = max(dir_bytes + dir_delta, 0)
        verdict = dog.sample(now, rss=rss, cpu_seconds=cpu, io_bytes=io, dir_bytes=dir_bytes)
        peak = max(peak, rss)
        if decided is None:
            moved = io_delta > 0 or dir_delta > 0
            used = cpu_delta > 0 and cpu_delta >= cpu_share * gap
            if moved or used:
                last_progress = now
            if timeout is not None and now >= timeout:
                decided = "timed_out"
            elif stall is not None and now >= last_progress + stall:
                decided = "stalled"
            elif memory_limit is not None and rss > memory_limit:
                decided = "out_of_memory"
        assert (verdict.status if verdict else None) == decided
        assert dog.peak_memory == peak


# -- the shared budget ------------------------------------------------------------


def test_budget_examples() -> None:
    """Over the total, the largest job is named; forgetting it brings the sum back."""
    budget: MemoryBudget[str] = MemoryBudget(100)
    budget.report("a", 40)
    budget.report("b", 50)
    assert budget.over_budget() is None
    assert budget.used() == 90
    budget.report("c", 30)
    assert budget.over_budget() == "b"
    budget.report("a", 60)  # a replaces its report
    assert budget.used() == 140
    assert budget.over_budget() == "a"
    budget.forget("a")
    budget.forget("unknown")
    assert budget.used() == 80
    assert budget.over_budget() is None
    assert budget.rss("a") is None
    assert budget.rss("b") == 50


def test_budget_tie_goes_to_the_first_reported() -> None:
    """Among jobs with equal largest RSS, the one reported first is chosen."""
    budget: MemoryBudget[str] = MemoryBudget(10)
    budget.report("first", 6)
    budget.report("second", 6)
    assert budget.over_budget() == "first"


def test_budget_refuses_nonsense() -> None:
    """A non-positive total or a negative report is a caller's mistake."""
    with pytest.raises(ValueError, match="positive"):
        MemoryBudget(0)
    budget: MemoryBudget[str] = MemoryBudget(1)
    with pytest.raises(ValueError, match="non-negative"):
        budget.report("a", -1)


class BudgetMachine(RuleBasedStateMachine):
    """MemoryBudget against a dict of reports."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 1000
        self.budget: MemoryBudget[int] = MemoryBudget(self.total)
        self.model: dict[int, int] = {}

    @rule(key=st.integers(0, 5), rss=st.integers(0, 600))
    def report(self, key: int, rss: int) -> None:
        """A job reports its latest sample."""
        self.budget.report(key, rss)
        self.model[key] = rss

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        """A job ends."""
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.budget.forget(key)
        del self.model[key]

    @invariant()
    def used_is_the_sum(self) -> None:
        """used() is the sum of the latest reports."""
        assert self.budget.used() == sum(self.model.values())

    @invariant()
    def picks_the_largest_when_over(self) -> None:
        """Over the total the chosen job has the largest RSS; otherwise none is chosen."""
        chosen = self.budget.over_budget()
        if sum(self.model.values()) <= self.total:
            assert chosen is None
        else:
            assert chosen is not None
            assert self.model[chosen] == max(self.model.values())


TestBudgetMachine = BudgetMachine.TestCase


# -- how a job ends ------------------------------------------------------------------

STALLED = Verdict(status="stalled", error="stalled: no progress for 10s")
WAITING_INPUT = PipeWait(stream="input", where="http://10.0.0.5:8000", since=100.0, moved=4096)
WAITING_OUTPUT = PipeWait(stream="output", where="http://10.0.0.5:8000", since=104.0, moved=7)


def test_a_stall_while_a_pipe_waited_the_whole_window_is_that_streams_failure() -> None:
    """A stall whose window a pipe spent waiting on the network ends ``stopped`` naming that
    stream; a pipe that waited less, or another verdict, keeps the verdict."""
    ending = verdict_ending(STALLED, waits=[WAITING_INPUT], now=110.0, window=10.0)
    assert ending == Ending(
        status="stopped",
        error="the input stream from http://10.0.0.5:8000 moved no bytes for 10.0s after "
        "4096 bytes: the network or the client went silent",
    )
    output = verdict_ending(STALLED, waits=[WAITING_INPUT, WAITING_OUTPUT], now=114.0, window=12.0)
    assert output.error.startswith("the input stream")  # the input is asked first
    only_output = verdict_ending(STALLED, waits=[WAITING_OUTPUT], now=114.0, window=10.0)
    assert only_output.error == (
        "the output stream to http://10.0.0.5:8000 took no bytes for 10.0s after 7 bytes: "
        "the network or the client went silent"
    )
    short = verdict_ending(STALLED, waits=[WAITING_OUTPUT], now=113.9, window=10.0)
    assert short == Ending(status="stalled", error=STALLED.error)
    timed_out = Verdict(status="timed_out", error="timed out after 10s")
    assert verdict_ending(timed_out, waits=[WAITING_INPUT], now=500.0, window=10.0) == Ending(
        status="timed_out", error="timed out after 10s"
    )
    assert verdict_ending(STALLED, waits=[WAITING_INPUT], now=500.0).status == "stalled"


def test_aborts_and_pipe_failures_end_a_job_stopped_not_failed() -> None:
    assert abort_ending("stopped", "the execserver is draining") == Ending(
        status="stopped", error="the execserver is draining"
    )
    assert abort_ending("cancelled", "cancelled by the client").status == "cancelled"
    assert pipe_ending("the input stream broke") == Ending(
        status="stopped", error="the input stream broke"
    )


@given(exit_code=st.integers(-64, 255), ended=st.booleans())
def test_the_commands_end(exit_code: int, ended: bool) -> None:
    """An ending wins; else 0 is ok, a positive status or a signal is failed, named."""
    ending = Ending(status="timed_out", error="timed out after 1s") if ended else None
    status, error = command_end(ending, exit_code)
    if ended:
        assert (status, error) == ("timed_out", "timed out after 1s")
    elif exit_code == 0:
        assert (status, error) == ("ok", None)
    elif exit_code > 0:
        assert (status, error) == ("failed", f"exit status {exit_code}")
    else:
        assert (status, error) == ("failed", f"killed by signal {-exit_code}")


def test_the_pipes_amend_the_commands_end() -> None:
    """A failed pipe turns ok into stopped; an aborted output stream is named in the error."""
    assert receipt_end("ok", None, pipe_fault=None, output_aborted_after=None) == ("ok", None)
    assert receipt_end(
        "ok", None, pipe_fault="the output stream broke", output_aborted_after=9
    ) == (
        "stopped",
        "the output stream broke",
    )
    assert receipt_end(
        "failed", "exit status 1", pipe_fault="broke", output_aborted_after=4096
    ) == ("failed", "exit status 1; the output stream was aborted after 4096 bytes")
    assert receipt_end("timed_out", "timed out", pipe_fault=None, output_aborted_after=None) == (
        "timed_out",
        "timed out",
    )
