"""The shipped scenarios: installations worth checking by the thousand seeds.

Each is a function of no arguments returning a :class:`Scenario`;
:data:`SCENARIOS` names them (``trio-broker simulate NAME`` runs one):

``mixed-fleet-2``, ``mixed-fleet-5``, ``mixed-fleet-20``
    A mixed fleet behind one round-robin balancer whose first pod in rotation
    offers only ``image_metadata`` and the others ``image_metadata`` and
    ``preview``; 2, 5 or 20 fylr-like clients (dispatchers on one shared queue)
    know only the balancer, retry after 1 s and fail a step whose service no
    connection offers on its 5th claim (the fylr's default).
``pod-churn``
    Three pods behind a balancer under load; a fourth joins at 20 s, one drains
    and leaves at 40 s.
``pinning-balancer``
    A sticky balancer: every connection of a client goes to the pod its first
    went to, so pool growth meets duplicates only.
``partition``
    One client's network cut for 20 s (its connections die by liveness), and
    later for 60 s with its database (its rows are swept as stale and run
    elsewhere, its own late outcomes fenced).
``crash-loop``
    A pod in a crash loop, a client crash and restart, and a silent host loss.
``one-execserver``, ``two-pods``
    The small installations the simulator is held against real daemons with
    (``benchmarks/sim.py``): one execserver with four slots and three direct
    clients; a balancer with two pods and two direct clients.
``fleet-100x20``, ``fleet-100x1000``
    Size: a conversion fleet, half busy, of 100 execservers and 20 clients; of
    100 fylrs and 1,000 execservers behind ten balancers of a hundred (light
    checks: the simulator's own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from trio_broker.testing.sim.scenario import (
    BalancerSpec,
    ClientSpec,
    Dist,
    FaultSpec,
    PodSpec,
    ProducerSpec,
    Scenario,
    ScenarioError,
    ServiceSpec,
)

__all__ = [
    "FYLR",
    "SCENARIOS",
    "STEP_SERVICES",
    "fleet",
    "fylrs",
    "mixed_fleet",
    "what_if",
]

STEP_SERVICES = (
    ServiceSpec(name="image_metadata", duration=Dist.lognormal(0.3, 0.5)),
    ServiceSpec(
        name="preview",
        duration=Dist.lognormal(1.5, 0.6),
        memory=Dist.uniform(50e6, 200e6),
        failure_rate=0.01,
    ),
)
"""A fylr's two kinds of step: a short metadata read and a longer rendition."""

FYLR = ClientSpec(
    name="fylr",
    addresses=("lb",),
    retry_delay=1.0,
    unknown_service_attempts=5,
    cpus=2,
)
"""A fylr as an operator runs it behind a balancer (the chaos soak's retry delay)."""

_MIX = {"image_metadata": 1.0, "preview": 1.0}
_BANDS = {0: 0.6, 2: 0.2, -2: 0.15, 3: 0.05}
"""Priorities: mostly normal, some interactive and background, a little urgent."""


def fylrs(count: int, **changes: Any) -> ClientSpec:
    """``count`` fylr-like clients (named ``fylr-0``...; ``fylr`` alone for one)."""
    return attrs.evolve(FYLR, count=count, **changes)


def mixed_fleet(clients: int, *, full: int = 1, meta: int = 1, duration: float = 60.0) -> Scenario:
    """A mixed fleet behind one balancer (see the module docstring)."""
    pods = (
        PodSpec(name="meta", services=("image_metadata",), slots=4, count=meta),
        PodSpec(name="full", services=("image_metadata", "preview"), slots=4, count=full),
    )
    capacity = 4 * (meta + full)
    return Scenario(
        name=f"mixed-fleet-{clients}",
        description=(
            f"{clients} fylrs behind one round-robin balancer; the first pod in rotation "
            "offers only image_metadata"
        ),
        services=STEP_SERVICES,
        pods=pods,
        balancers=(BalancerSpec(name="lb", pods=("meta", "full")),),
        clients=(fylrs(clients),),
        producers=(
            ProducerSpec(
                name="uploads",
                arrival=Dist.exponential(2.0 / capacity),
                services=_MIX,
                priorities=_BANDS,
            ),
        ),
        duration=duration,
    )


def _homogeneous(
    name: str,
    description: str,
    *,
    pods: int = 3,
    clients: int = 3,
    duration: float = 60.0,
    **lb: Any,
) -> Scenario:
    return Scenario(
        name=name,
        description=description,
        services=STEP_SERVICES,
        pods=(PodSpec(name="pod", services=("image_metadata", "preview"), slots=4, count=pods),),
        balancers=(BalancerSpec(name="lb", pods=("pod",), **lb),),
        clients=(fylrs(clients),),
        producers=(
            ProducerSpec(
                name="uploads",
                arrival=Dist.exponential(2.0 / (4 * pods)),
                services=_MIX,
                priorities=_BANDS,
            ),
        ),
        duration=duration,
    )


def pod_churn() -> Scenario:
    base = _homogeneous("pod-churn", "a pod joins and another leaves under load")
    return _with(
        base,
        pods=(
            PodSpec(name="pod", services=("image_metadata", "preview"), slots=4, count=2),
            PodSpec(name="late", services=("image_metadata", "preview"), slots=4, up_at=20.0),
            PodSpec(name="leaving", services=("image_metadata", "preview"), slots=4, down_at=40.0),
        ),
        balancers=(BalancerSpec(name="lb", pods=("pod", "late", "leaving")),),
    )


def pinning_balancer() -> Scenario:
    return _homogeneous(
        "pinning-balancer",
        "a sticky balancer: each client's connections all reach one pod",
        sticky=True,
    )


def partition() -> Scenario:
    base = _homogeneous(
        "partition", "one client cut off, then cut from its database too", duration=90.0
    )
    return _with(
        base,
        faults=(
            FaultSpec(kind="partition", target="fylr-0", at=10.0, duration=20.0),
            FaultSpec(kind="partition", target="fylr-0", at=35.0, duration=60.0, database=True),
        ),
    )


def crash_loop() -> Scenario:
    base = _homogeneous(
        "crash-loop", "a pod in a crash loop, a client crash, a host lost", duration=90.0
    )
    return _with(
        base,
        faults=(
            FaultSpec(
                kind="crash",
                target="pod-1",
                at=10.0,
                restart_after=3.0,
                repeat_every=Dist.uniform(5.0, 15.0),
                until=70.0,
            ),
            FaultSpec(kind="crash", target="fylr-2", at=30.0, restart_after=5.0),
            FaultSpec(kind="crash", target="pod-2", at=50.0, restart_after=20.0, silent=True),
        ),
    )


def _callers(rates: dict[str, float], *, addresses: tuple[str, ...], **changes: Any
             ) -> tuple[tuple[ClientSpec, ...], tuple[ProducerSpec, ...]]:  # fmt: skip
    """Direct clients, each called at its own rate (calls per second)."""
    clients = tuple(
        ClientSpec(name=name, addresses=addresses, kind="direct", retry_delay=1.0, **changes)
        for name in rates
    )
    producers = tuple(
        ProducerSpec(
            name=f"calls-{name}",
            target=name,
            arrival=Dist.exponential(1.0 / rate),
            services={"hold": 1.0},
            priorities={0: 0.7, 2: 0.3},
        )
        for name, rate in rates.items()
    )
    return clients, producers


HOLD = ServiceSpec(name="hold", duration=Dist.uniform(0.2, 0.6))
"""The faithfulness runs' one service: the execserver's builtin ``sleep``."""
LOOPBACK = Dist.uniform(0.0005, 0.0025)
"""A hop between two daemons on one machine: loopback and each side's own processing."""


def one_execserver() -> Scenario:
    """Four slots, 10 jobs/s of capacity; three callers at 5, 2.5 and 1.25 calls/s."""
    clients, producers = _callers({"a": 5.0, "b": 2.5, "c": 1.25}, addresses=("exec",))
    return Scenario(
        name="one-execserver",
        description="one execserver with four slots, three clients calling it directly",
        services=(HOLD,),
        pods=(PodSpec(name="exec", services=("hold",), slots=4),),
        clients=clients,
        producers=producers,
        duration=60.0,
        latency=LOOPBACK,
    )


def two_pods() -> Scenario:
    """Two pods of four slots behind a balancer; two callers at 12.5 and 5 calls/s."""
    clients, producers = _callers(
        {"a": 12.5, "b": 5.0}, addresses=("lb",), retry_tick=0.2, pool_grow_interval=0.2
    )
    return Scenario(
        name="two-pods",
        description="a balancer with two pods of four slots, two clients that know only it",
        services=(HOLD,),
        pods=(PodSpec(name="pod", services=("hold",), slots=4, count=2),),
        balancers=(BalancerSpec(name="lb", pods=("pod",)),),
        clients=clients,
        producers=producers,
        duration=60.0,
        latency=LOOPBACK,
    )


CONVERSIONS = (
    *STEP_SERVICES,
    ServiceSpec(name="document", duration=Dist.lognormal(15.0, 0.7)),
    ServiceSpec(name="video", duration=Dist.lognormal(60.0, 0.8)),
)
"""A conversion fleet's services: metadata reads and previews, documents, videos."""
_CONVERSION_MIX = {"image_metadata": 1.0, "preview": 1.0, "document": 0.5, "video": 0.5}


def fleet(pods: int, clients: int, *, balancers: int = 1, duration: float = 600.0) -> Scenario:
    """``clients`` fylrs on ``pods`` conversion execservers of 8 slots behind
    ``balancers`` balancers, half busy (a job takes 18 s on average)."""
    per = pods // balancers
    services = tuple(s.name for s in CONVERSIONS)
    pod_specs = tuple(
        PodSpec(name=f"pod{b}", services=services, slots=8, count=per) for b in range(balancers)
    )
    balancer_specs = tuple(BalancerSpec(name=f"lb{b}", pods=(f"pod{b}",)) for b in range(balancers))
    total = sum(_CONVERSION_MIX.values())
    mean = sum(
        next(s for s in CONVERSIONS if s.name == name).duration.mean * weight / total
        for name, weight in _CONVERSION_MIX.items()
    )
    return Scenario(
        name=f"fleet-{pods}x{clients}" if balancers == 1 else f"fleet-{clients}x{pods}",
        description=f"{clients} fylrs, {pods} execservers behind {balancers} balancer(s)",
        services=CONVERSIONS,
        pods=pod_specs,
        balancers=balancer_specs,
        clients=(fylrs(clients, addresses=tuple(b.name for b in balancer_specs), cpus=4),),
        producers=(
            ProducerSpec(
                name="uploads",
                arrival=Dist.exponential(mean / (0.5 * 8 * pods)),
                services=_CONVERSION_MIX,
                priorities=_BANDS,
            ),
        ),
        duration=duration,
        checks="light",
    )


def _with(scenario: Scenario, **changes: Any) -> Scenario:
    return attrs.evolve(scenario, **changes)


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "mixed-fleet-2": lambda: mixed_fleet(2),
    "mixed-fleet-5": lambda: mixed_fleet(5, full=2),
    "mixed-fleet-20": lambda: mixed_fleet(20, full=4, meta=2, duration=40.0),
    "pod-churn": pod_churn,
    "pinning-balancer": pinning_balancer,
    "partition": partition,
    "crash-loop": crash_loop,
    "one-execserver": one_execserver,
    "two-pods": two_pods,
    "fleet-100x20": lambda: fleet(100, 20),
    "fleet-100x1000": lambda: fleet(1000, 100, balancers=10, duration=3600.0),
}
"""Every shipped scenario by name."""


def what_if(
    scenario: Scenario,
    *,
    add_execservers: int = 0,
    slots: int | None = None,
    clients: int | None = None,
) -> Scenario:
    """The scenario with more execservers, other slot counts, or another number of clients.

    Args:
        add_execservers: this many more pods like the last one, behind the same
            balancer (without balancers: configured as addresses of every client).
        slots: every pod's slot count (its fast reserve capped to it).
        clients: how many clients the first client spec makes.

    Raises:
        ScenarioError: a count below what it may be.
    """
    if add_execservers < 0:
        raise ScenarioError(f"add_execservers: expected a number >= 0, got {add_execservers}")
    if add_execservers:
        scenario = _add_pods(scenario, add_execservers)
    if slots is not None:
        if slots < 1:
            raise ScenarioError(f"slots: expected a number >= 1, got {slots}")
        pods = tuple(
            attrs.evolve(pod, slots=slots, fast_reserve=min(pod.fast_reserve, slots))
            for pod in scenario.pods
        )
        scenario = attrs.evolve(scenario, pods=pods)
    if clients is not None:
        if clients < 1:
            raise ScenarioError(f"clients: expected a number >= 1, got {clients}")
        first, *rest = scenario.clients
        scenario = attrs.evolve(scenario, clients=(attrs.evolve(first, count=clients), *rest))
    return scenario


def _add_pods(scenario: Scenario, count: int) -> Scenario:
    template = scenario.pods[-1]
    added = attrs.evolve(
        template, name="added", count=count, up_at=0.0, down_at=None, max_slots=template.max_slots
    )
    pods = (*scenario.pods, added)
    if scenario.balancers:
        balancer = next(
            (b for b in scenario.balancers if template.name in b.pods), scenario.balancers[0]
        )
        balancers = tuple(
            attrs.evolve(b, pods=(*b.pods, "added")) if b is balancer else b
            for b in scenario.balancers
        )
        return attrs.evolve(scenario, pods=pods, balancers=balancers)
    names = tuple(added.names())
    clients = tuple(attrs.evolve(c, addresses=(*c.addresses, *names)) for c in scenario.clients)
    return attrs.evolve(scenario, pods=pods, clients=clients)
