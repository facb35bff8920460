"""A model check of the adaptive admission against its documented rule.

:func:`admission_machine` feeds a real :class:`~trio_broker.core.admission.Admission`
and :class:`AdmissionModel` (written from rules 1 to 4 of
:mod:`trio_broker.core.admission`, sharing no code with it) the same sequence of
observations: execservers that come, go, fill up and idle, this client's jobs
waiting at them or not, a deep queue or a short one, and time moving by less
than the adjustment interval and by more. After every observation both must
agree on every figure of the :class:`~trio_broker.core.admission.Limits` and on
the accumulated rise, and the limits must keep their own bounds (the odd
reserve within the cap, never more than half the limit). So a rise or a fall
taken at the wrong time, by the wrong amount or on the wrong observation shows
within a few updates::

    from trio_broker.core.admission import AdmissionConfig
    from trio_broker.testing.admission import admission_machine

    TestMyAdmission = admission_machine(AdmissionConfig(cpus=2)).TestCase
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from trio_broker.core.admission import Admission, AdmissionConfig, InstanceLoad, Limits

__all__ = ["AdmissionMachine", "AdmissionModel", "admission_machine"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class AdmissionModel:
    """Rules 1 to 4 of the admission, restated plainly (integers only)."""

    cpus: int
    odd_reserve: int
    max_in_flight: int
    db_pool: int
    use_idle: bool
    interval: float
    rise: int = 0
    started: float | None = None  # when the current interval began (None: none yet)
    # the fewest and the most jobs seen waiting since the current interval began
    # (or since the fleet came back: those observations count towards the first)
    fewest: int | None = None
    most: int = 0

    def limits(self, loads: list[InstanceLoad]) -> tuple[int, int, int, int, int]:
        """(base, limit, reserve, cap, rise) for the rise kept now."""
        share = sum(_ceil_div(load.processes, load.clients or 1) for load in loads)
        if share == 0:
            return (0, 0, 0, 0, 0)
        base = share + self.cpus
        cap = self.max_in_flight or min(max(4 * base, 32), 2 * self.db_pool)
        rise = min(max(self.rise, 0), max(cap - base, 0))
        wanted = min(base + rise, cap)
        reserve = min(self.odd_reserve, wanted // 2)
        return (base, min(base + rise, cap - reserve), reserve, cap, rise)

    def update(
        self, now: float, loads: list[InstanceLoad], waiting: int, deep: bool
    ) -> tuple[int, int, int, int, int]:
        share = sum(_ceil_div(load.processes, load.clients or 1) for load in loads)
        if share == 0:  # no slot anywhere: start over when execservers are back
            self.rise, self.started, self.fewest, self.most = 0, None, waiting, waiting
            return self.limits(loads)
        fewest = waiting if self.fewest is None else min(self.fewest, waiting)
        most = max(self.most, waiting)
        if self.started is not None and now - self.started < self.interval:
            self.fewest, self.most = fewest, most
            figures = self.limits(loads)
            self.rise = figures[4]
            return figures
        # the first observation of a new interval: adjust by the one that ended
        if fewest > self.cpus:
            self.rise = max(self.rise - 1, 0)  # jobs stayed queued: fall by one
        elif waiting == 0 and deep and self.use_idle:
            idle = sum(_ceil_div(load.idle, load.clients or 1) for load in loads)
            self.rise += idle if idle or most else 1  # idle slots, or at least one
        self.started, self.fewest, self.most = now, waiting, waiting
        figures = self.limits(loads)
        self.rise = figures[4]
        return figures


_INSTANCES = ("e1", "e2", "e3")


class AdmissionMachine(RuleBasedStateMachine):
    """See the module docstring; configure it with :func:`admission_machine`."""

    config: ClassVar[AdmissionConfig] = AdmissionConfig(cpus=2)
    steps: ClassVar[tuple[float, ...]] = (0.0, 0.25, 0.5, 1.0, 1.5, 3.0)

    def __init__(self) -> None:
        super().__init__()
        config = self.config
        self.real = Admission(config)
        self.model = AdmissionModel(
            cpus=config.cpu_count,
            odd_reserve=config.odd_reserve,
            max_in_flight=config.max_in_flight,
            db_pool=config.db_pool,
            use_idle=config.use_idle,
            interval=config.adapt_interval,
        )
        self.now = 0.0
        self.loads: dict[str, InstanceLoad] = {}

    @rule(
        instance=st.sampled_from(_INSTANCES),
        processes=st.integers(0, 9),
        clients=st.integers(0, 4),
        data=st.data(),
    )
    def hello(self, instance: str, processes: int, clients: int, data: st.DataObject) -> None:
        """An execserver (re)announces itself: its slots, clients and idle slots."""
        idle = data.draw(st.integers(0, processes), label="idle")
        self.loads[instance] = InstanceLoad(
            instance_id=instance, processes=processes, clients=clients, idle=idle
        )

    @rule(instance=st.sampled_from(_INSTANCES))
    def gone(self, instance: str) -> None:
        """An execserver is lost or drains."""
        self.loads.pop(instance, None)

    @rule(data=st.data(), deep=st.booleans(), times=st.integers(1, 4))
    def observe(self, data: st.DataObject, deep: bool, times: int) -> None:
        """The dispatcher decides a claim (once or a few times, time moving between,
        its jobs waiting at the execservers coming and going)."""
        loads = [self.loads[name] for name in sorted(self.loads)]
        for _ in range(times):
            self.now += data.draw(st.sampled_from(self.steps), label="dt")
            waiting = data.draw(st.sampled_from([0, 0, 0, 1, 2, 3, 5, 8]), label="waiting")
            got = self.real.update(self.now, loads, waiting=waiting, queue_deep=deep)
            expected = self.model.update(self.now, loads, waiting, deep)
            note(f"t={self.now} waiting={waiting} deep={deep}: {got}")
            shape = (got.base, got.limit, got.reserve, got.cap, got.rise)
            assert shape == expected, f"{got}, the rule says {expected}"
            assert self.real.rise == self.model.rise, f"rise {self.real.rise} != {self.model.rise}"

    @invariant()
    def bounded(self) -> None:
        limits: Limits = self.real.current
        assert 0 <= limits.reserve <= self.config.odd_reserve
        assert 2 * limits.reserve <= min(limits.base + limits.rise, limits.cap)
        assert limits.limit + limits.reserve <= limits.cap
        assert limits.base + limits.rise <= limits.cap or limits.rise == 0


def admission_machine(
    config: AdmissionConfig | None = None,
    *,
    steps: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 1.5, 3.0),
) -> type[AdmissionMachine]:
    """An :class:`AdmissionMachine` for these knobs; time moves by ``steps`` per update."""
    return type(
        "ConfiguredAdmissionMachine", (AdmissionMachine,), {"config": config, "steps": steps}
    )
