"""The admission: fair shares plus CPUs, the accumulated rise, waiting jobs, cap, reserves."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.values import assert_keyword_only
from trio_broker.core import admission
from trio_broker.core.admission import (
    Admission,
    AdmissionConfig,
    ClaimPlan,
    InstanceLoad,
    Limits,
    auto_max_in_flight,
    exec_limit,
    fair_share,
    is_odd,
    limits,
    local_reserve,
    max_in_flight,
    odd_reserve,
    plan_claims,
)

CONFIG = AdmissionConfig(cpus=2, odd_reserve=2, max_in_flight=0, db_pool=10)


def load(processes: int, clients: int, idle: int = 0, instance_id: str = "a") -> InstanceLoad:
    return InstanceLoad(instance_id=instance_id, processes=processes, clients=clients, idle=idle)


loads_strategy = st.lists(
    st.builds(
        InstanceLoad,
        instance_id=st.text(min_size=1, max_size=4),
        processes=st.integers(0, 128),
        clients=st.integers(0, 64),
        idle=st.integers(0, 128),
    ),
    max_size=6,
)
configs = st.builds(
    AdmissionConfig,
    cpus=st.integers(0, 8),
    odd_reserve=st.integers(0, 8),
    max_in_flight=st.integers(0, 200),
    db_pool=st.integers(1, 64),
    use_idle=st.booleans(),
)


def test_admission_imports_no_trio() -> None:
    """The admission module is pure: importing it alone does not import trio."""
    code = "import sys, trio_broker.core.admission; sys.exit('trio' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_five_clients_on_forty_slots_get_ten_each() -> None:
    """Forty slots shared by five clients admit 8 + 2 CPUs each; with four left, 12."""
    assert exec_limit([load(40, 5)], waiting=0, queue_deep=True, config=CONFIG) == 10
    assert exec_limit([load(40, 4)], waiting=0, queue_deep=True, config=CONFIG) == 12


def test_fair_share_rounds_up_per_instance() -> None:
    """Each instance's share is rounded up on its own, and a client count of 0 counts as 1."""
    assert fair_share([load(10, 3), load(1, 4, instance_id="b")]) == 4 + 1
    assert fair_share([load(6, 0)]) == 6
    assert fair_share([]) == 0


def test_no_execserver_means_no_exec_admission() -> None:
    """Without a connected instance (or with only empty pools) nothing exec-bound is admitted."""
    assert exec_limit([], waiting=0, queue_deep=True, config=CONFIG) == 0
    assert exec_limit([load(0, 3, idle=5)], waiting=0, queue_deep=True, config=CONFIG) == 0


def test_idle_slots_raise_the_limit_only_when_deep_and_nothing_waits() -> None:
    """Idle slots count (split among the clients) only while the queue is deep and no job waits."""
    loads = [load(8, 2, idle=3)]
    base = 4 + 2
    assert exec_limit(loads, waiting=0, queue_deep=False, config=CONFIG) == base
    assert exec_limit(loads, waiting=0, queue_deep=True, config=CONFIG) == base + 2
    assert exec_limit(loads, waiting=1, queue_deep=True, config=CONFIG) == base  # no idle bonus
    no_idle = AdmissionConfig(cpus=2, use_idle=False)
    assert exec_limit(loads, waiting=0, queue_deep=True, config=no_idle) == base


def test_waiting_jobs_do_not_lower_the_base() -> None:
    """A single observation of waiting jobs only stops the rise: the base stays."""
    assert exec_limit([load(8, 1)], waiting=2, queue_deep=False, config=CONFIG) == 10
    assert exec_limit([load(8, 1, idle=2)], waiting=50, queue_deep=True, config=CONFIG) == 10


def test_caps_include_the_odd_reserve() -> None:
    """max_in_flight caps the limit plus the odd reserve; 0 means 4 × base, at least 32, at
    most 2 × the db pool."""
    fixed = AdmissionConfig(max_in_flight=5)
    got = limits([load(40, 1)], rise=0, config=fixed)
    assert (got.limit, got.reserve, got.cap) == (3, 2, 5)
    assert exec_limit([load(40, 1)], waiting=0, queue_deep=False, config=fixed) == 3
    assert auto_max_in_flight(1, db_pool=100) == 32
    assert auto_max_in_flight(20, db_pool=100) == 80
    assert auto_max_in_flight(20, db_pool=10) == 20
    assert max_in_flight(20, AdmissionConfig(db_pool=10)) == 20
    assert max_in_flight(20, AdmissionConfig(max_in_flight=7)) == 7
    big = [load(100, 1, idle=100)]
    assert exec_limit(big, waiting=0, queue_deep=True, config=CONFIG) == 20 - 2


def test_cpus_none_counts_as_one_and_negative_is_refused() -> None:
    """An unresolved CPU count is 1 in the pure functions; a negative one is an error."""
    assert exec_limit([load(4, 1)], waiting=0, queue_deep=False, config=AdmissionConfig()) == 5
    with pytest.raises(ValueError, match="cpus"):
        AdmissionConfig(cpus=-1)
    with pytest.raises(ValueError, match="adapt_interval"):
        AdmissionConfig(adapt_interval=0)


# -- the accumulated rise ------------------------------------------------------------------


def test_rise_accumulates_second_by_second_past_twice_the_share() -> None:
    """Idle slots raise the admission once per interval, and the rise is kept: after a few
    seconds the limit is far above twice the fair share (a memoryless rule stops there)."""
    adm = Admission(CONFIG)
    loads = [load(4, 1, idle=2)]  # base 4 + 2
    assert adm.update(0.0, loads, waiting=0, queue_deep=True).limit == 8
    assert adm.update(0.5, loads, waiting=0, queue_deep=True).limit == 8  # same second
    assert adm.update(1.0, loads, waiting=0, queue_deep=True).limit == 10
    assert adm.update(2.0, loads, waiting=0, queue_deep=True).limit == 12
    assert adm.update(3.5, loads, waiting=0, queue_deep=True).limit == 14
    assert adm.rise == 8
    assert 14 > 2 * 4 + 2  # beyond what exec_limit alone ever gives


def test_rise_needs_a_deep_queue_and_no_waiting_job() -> None:
    """A shallow queue or a job waiting for a slot keeps the rise from growing."""
    adm = Admission(CONFIG)
    loads = [load(4, 1, idle=2)]
    assert adm.update(0.0, loads, waiting=0, queue_deep=False).limit == 6
    assert adm.update(1.0, loads, waiting=1, queue_deep=True).limit == 6
    assert adm.rise == 0
    off = Admission(AdmissionConfig(cpus=2, use_idle=False))
    assert off.update(0.0, loads, waiting=0, queue_deep=True).limit == 6


def test_an_interval_without_a_waiting_job_raises_by_one_without_idle_slots() -> None:
    """Short jobs leave no slot idle through a whole second; while none of this client's
    jobs was seen waiting through an interval, the rise still grows by one per interval."""
    adm = Admission(CONFIG)
    busy = [load(4, 1, idle=0)]
    adm.update(0.0, busy, waiting=0, queue_deep=True)
    adm.update(1.0, busy, waiting=0, queue_deep=True)
    assert adm.rise == 2
    adm.update(1.5, busy, waiting=1, queue_deep=True)  # a job waited in this interval
    adm.update(2.0, busy, waiting=0, queue_deep=True)
    assert adm.rise == 2
    adm.update(3.0, busy, waiting=0, queue_deep=True)
    assert adm.rise == 3
    adm.update(4.0, busy, waiting=0, queue_deep=False)  # shallow queue: no rise
    assert adm.rise == 3


def test_jobs_queued_through_an_interval_lower_the_rise_step_by_step() -> None:
    """Waiting jobs within the CPU count are pipelining and lower nothing; when more than
    that stayed queued through an interval (the fewest seen in it), the rise drops by one
    per interval, down to 0 (the base stays)."""
    adm = Admission(CONFIG)
    loads = [load(4, 1, idle=3)]
    for second in range(3):
        adm.update(float(second), loads, waiting=0, queue_deep=True)
    assert adm.rise == 9
    adm.update(3.0, loads, waiting=2, queue_deep=True)  # pipelining: kept
    assert adm.rise == 9
    adm.update(3.5, loads, waiting=9, queue_deep=True)
    adm.update(4.0, loads, waiting=9, queue_deep=True)  # fewest in 3.0..4.0 was 2: kept
    assert adm.rise == 9
    adm.update(4.5, loads, waiting=5, queue_deep=True)
    got = adm.update(5.0, loads, waiting=4, queue_deep=True)  # 4 or more through 4.0..5.0
    assert (adm.rise, got.limit) == (8, 6 + 8)
    for second in range(6, 30):
        got = adm.update(float(second), loads, waiting=10, queue_deep=True)
    assert (adm.rise, got.limit) == (0, 6)


def test_rise_is_bounded_by_the_cap_and_kept_within_it() -> None:
    """The rise never grows beyond what the cap can use, and limit + reserve stays within
    max_in_flight, the odd reserve included."""
    adm = Admission(AdmissionConfig(cpus=1, max_in_flight=10, odd_reserve=2))
    loads = [load(4, 1, idle=4)]
    for second in range(10):
        got = adm.update(float(second), loads, waiting=0, queue_deep=True)
        assert got.limit + got.reserve <= 10
    assert adm.rise == 10 - 5
    assert (got.limit, got.reserve) == (8, 2)


def test_no_execserver_resets_the_rise() -> None:
    """With no slot anywhere nothing is admitted and the rise starts over."""
    adm = Admission(CONFIG)
    adm.update(0.0, [load(4, 1, idle=4)], waiting=0, queue_deep=True)
    assert adm.rise == 4
    assert adm.update(1.0, [], waiting=0, queue_deep=True).limit == 0
    assert adm.rise == 0
    assert adm.update(2.0, [load(4, 1)], waiting=0, queue_deep=False).limit == 6


def test_idle_is_shared_among_the_clients() -> None:
    """Every client sees the same idle figure and takes ceil(idle / clients) of it."""
    adm = Admission(CONFIG)
    assert adm.update(0.0, [load(8, 3, idle=4)], waiting=0, queue_deep=True).rise == 2


def test_admission_refuses_negative_waiting() -> None:
    with pytest.raises(ValueError, match="waiting"):
        Admission(CONFIG).update(0.0, [load(4, 1)], waiting=-1, queue_deep=True)


observations = st.lists(
    st.tuples(st.floats(0, 3), loads_strategy, st.integers(0, 40), st.booleans()),
    max_size=30,
)


@given(config=configs, steps=observations)
def test_admission_bounds(
    config: AdmissionConfig, steps: list[tuple[float, list[InstanceLoad], int, bool]]
) -> None:
    """Over any run of observations the limits stay within the cap, the odd reserve
    included, the rise never exceeds what the cap can use, and no slot means no admission."""
    adm = Admission(config)
    now = 0.0
    for elapsed, loads, waiting, deep in steps:
        now += elapsed
        got = adm.update(now, loads, waiting=waiting, queue_deep=deep)
        assert got.limit >= 0
        assert got.reserve >= 0
        assert adm.rise >= 0
        if fair_share(loads) == 0:
            assert got == type(got)()
            assert adm.rise == 0
            continue
        assert got.limit + got.reserve <= got.cap == max_in_flight(got.base, config)
        assert got.base + adm.rise <= max(got.cap, got.base)


def test_odd_reserve_keeps_half_for_even() -> None:
    """The reserve is at most the configured count and at most half the limit."""
    assert [odd_reserve(n, 2) for n in range(6)] == [0, 0, 1, 1, 2, 2]
    assert odd_reserve(100, 0) == 0


def test_is_odd_covers_negative_bands() -> None:
    """Odd priorities are the high variants of every band, negative ones included."""
    assert [p for p in range(-3, 6) if is_odd(p)] == [-3, -1, 1, 3, 5]


def test_plan_when_even_items_fill_the_general_slots() -> None:
    """With even items holding limit - reserve slots, only odd items may be claimed."""
    plan = plan_claims(
        exec_limit=10,
        reserve=2,
        exec_in_flight=8,
        even_in_flight=8,
        local_limit=4,
        local_in_flight=1,
    )
    assert plan == ClaimPlan(general=0, odd_only=2, local=3)
    assert plan.total == 5
    assert plan.exec_total == 2


def test_plan_rejects_inconsistent_counts() -> None:
    """A caller passing impossible counts gets an error naming them."""
    with pytest.raises(ValueError, match="even_in_flight"):
        plan_claims(
            exec_limit=4,
            reserve=0,
            exec_in_flight=1,
            even_in_flight=2,
            local_limit=0,
            local_in_flight=0,
        )
    with pytest.raises(ValueError, match="reserve"):
        plan_claims(
            exec_limit=1,
            reserve=2,
            exec_in_flight=0,
            even_in_flight=0,
            local_limit=0,
            local_in_flight=0,
        )


@given(loads=loads_strategy, waiting=st.integers(0, 100), deep=st.booleans(), config=configs)
def test_limit_bounds(
    loads: list[InstanceLoad], waiting: int, deep: bool, config: AdmissionConfig
) -> None:
    """The limit is never negative, never above the cap less the reserve, and 0 whenever
    the fair share is 0."""
    limit = exec_limit(loads, waiting=waiting, queue_deep=deep, config=config)
    share = fair_share(loads)
    base = share + config.cpu_count
    cap = max_in_flight(base, config)
    assert 0 <= limit <= cap
    if share == 0:
        assert limit == 0
    else:
        assert limit <= base + sum(math.ceil(x.idle / max(1, x.clients)) for x in loads)


@given(loads=loads_strategy, waiting=st.integers(0, 100), config=configs)
def test_limit_monotone(loads: list[InstanceLoad], waiting: int, config: AdmissionConfig) -> None:
    """More waiting jobs never raise the limit; a deep queue never lowers it."""
    for deep in (False, True):
        more = exec_limit(loads, waiting=waiting + 1, queue_deep=deep, config=config)
        assert more <= exec_limit(loads, waiting=waiting, queue_deep=deep, config=config)
    shallow = exec_limit(loads, waiting=waiting, queue_deep=False, config=config)
    assert exec_limit(loads, waiting=waiting, queue_deep=True, config=config) >= shallow


@given(
    limit=st.integers(0, 60),
    reserve_conf=st.integers(0, 8),
    steps=st.lists(st.tuples(st.booleans(), st.lists(st.booleans(), max_size=70)), max_size=20),
)
def test_claims_respect_limit_and_reserve(
    limit: int, reserve_conf: int, steps: list[tuple[bool, list[bool]]]
) -> None:
    """Claiming what each plan allows (the queue offering items in any parity), then finishing
    some, never puts more than the limit in flight nor even items into the reserve."""
    reserve = odd_reserve(limit, reserve_conf)
    in_flight: list[bool] = []  # True = odd
    for finish_one, queue in steps:
        if finish_one and in_flight:
            in_flight.pop(0)
        plan = plan_claims(
            exec_limit=limit,
            reserve=reserve,
            exec_in_flight=len(in_flight),
            even_in_flight=in_flight.count(False),
            local_limit=0,
            local_in_flight=0,
        )
        assert plan.exec_total == max(0, limit - len(in_flight))
        queue = list(queue)
        general = queue[: plan.general]  # the general claim takes the best items, any parity
        rest: list[bool] = [odd for odd in queue[plan.general :] if odd]
        in_flight.extend(general + rest[: plan.odd_only])
        assert len(in_flight) <= limit
        assert in_flight.count(False) <= limit - reserve


def test_local_reserve_is_a_quarter_at_least_one() -> None:
    """The local semaphore keeps a quarter of its size (at least one) for odd priorities."""
    assert [local_reserve(n) for n in (0, 1, 2, 4, 8, 9)] == [0, 1, 1, 1, 2, 2]


def test_plan_when_even_items_fill_the_local_slots() -> None:
    """With every local slot held by even items, the local reserve is still claimable by odd
    items only."""
    plan = plan_claims(
        exec_limit=0,
        reserve=0,
        exec_in_flight=0,
        even_in_flight=0,
        local_limit=2,
        local_in_flight=2,
        local_reserve=1,
        local_even_in_flight=2,
    )
    assert plan == ClaimPlan(local=0, local_odd_only=1)
    assert plan.local_total == 1
    assert plan.total == 1
    with pytest.raises(ValueError, match="local_even_in_flight"):
        plan_claims(
            exec_limit=0,
            reserve=0,
            exec_in_flight=0,
            even_in_flight=0,
            local_limit=2,
            local_in_flight=1,
            local_even_in_flight=2,
        )


def test_documented_defaults() -> None:
    """The defaults the docstrings promise: two odd-only claims, a pool of 10, empty plans."""
    config = AdmissionConfig()
    assert (config.cpus, config.odd_reserve, config.max_in_flight, config.db_pool) == (
        None,
        2,
        0,
        10,
    )
    assert ClaimPlan() == ClaimPlan(general=0, odd_only=0, local=0, local_odd_only=0)
    assert ClaimPlan().total == 0
    assert Limits() == Limits(base=0, limit=0, reserve=0, cap=0, rise=0)


def test_value_classes_are_keyword_only() -> None:
    """Positional construction is refused, so fields may be added or reordered."""
    assert_keyword_only(admission)


def test_plan_with_every_count_positive() -> None:
    """Positive limits and counts everywhere are accepted (only negative ones are refused)."""
    plan = plan_claims(
        exec_limit=6,
        reserve=1,
        exec_in_flight=2,
        even_in_flight=1,
        local_limit=3,
        local_in_flight=1,
        local_reserve=1,
        local_even_in_flight=1,
    )
    assert (plan.general, plan.odd_only, plan.local) == (4, 0, 2)
    with pytest.raises(ValueError, match="at least 0"):
        plan_claims(
            exec_limit=6,
            reserve=1,
            exec_in_flight=2,
            even_in_flight=1,
            local_limit=3,
            local_in_flight=1,
            local_reserve=-1,
        )


def test_a_one_slot_fleet_keeps_its_rise() -> None:
    """A fleet of one slot is a fleet: its rise accumulates like any other."""
    adm = Admission(CONFIG)
    loads = [load(1, 1, idle=1)]  # base 1 + 2
    adm.update(0.0, loads, waiting=0, queue_deep=True)
    adm.update(1.0, loads, waiting=0, queue_deep=True)
    assert adm.rise == 2
    assert adm.update(2.0, loads, waiting=0, queue_deep=True).limit == 3 + 3


def test_after_the_fleet_returns_the_rise_starts_from_zero() -> None:
    """Execservers gone and back: the limit is the base again until the rise grows anew."""
    adm = Admission(CONFIG)
    loads = [load(4, 1, idle=4)]
    for second in range(3):
        adm.update(float(second), loads, waiting=0, queue_deep=True)
    adm.update(3.0, [], waiting=0, queue_deep=True)
    back = adm.update(3.5, [load(4, 1)], waiting=0, queue_deep=False)
    assert (back.rise, back.limit) == (0, 6)
