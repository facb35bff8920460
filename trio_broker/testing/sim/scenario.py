"""Scenarios: a whole installation, its workload and its faults, as plain values.

A :class:`Scenario` names everything the simulator builds: the services
(:class:`ServiceSpec`, with the distributions of their jobs' durations and
memory), the execserver pods (:class:`PodSpec`: services, slots, the broker's
settings, when each pod comes and goes), the balancers in front of pods
(:class:`BalancerSpec`: round-robin, least-connections, random, sticky or not),
the clients (:class:`ClientSpec`: the addresses they know, the client core's
settings, and whether a dispatcher drives them from the shared queue or callers
submit to them directly), the producers (:class:`ProducerSpec`: arrival process,
service mix, priorities) and the faults (:class:`FaultSpec`: crashes and
restarts, partitions, dropped connections, crash loops).

Every value is frozen and checked when built: a bad one raises ``ValueError``
naming the field. :meth:`Scenario.from_dict` builds one from plain data (a YAML
or JSON document); :meth:`Scenario.to_dict` gives that data back. Durations are
seconds of virtual time, memory is bytes.

A distribution (:class:`Dist`) is written in data as a number (fixed), or as one
of ``{uniform: [low, high]}``, ``{exponential: mean}``, ``{lognormal: [median,
sigma]}``, ``{fixed: value}``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

__all__ = [
    "BalancerSpec",
    "ClientSpec",
    "Dist",
    "FaultSpec",
    "PodSpec",
    "ProducerSpec",
    "Scenario",
    "ScenarioError",
    "ServiceSpec",
]

DistKind: TypeAlias = Literal["fixed", "uniform", "exponential", "lognormal"]
Policy: TypeAlias = Literal["round_robin", "least_connections", "random"]
ClientKind: TypeAlias = Literal["dispatcher", "direct"]
FaultKind: TypeAlias = Literal["crash", "partition", "drop"]

_NORMAL = statistics.NormalDist()
_U_EDGE = 1e-12


class ScenarioError(ValueError):
    """A scenario that cannot be simulated; the message names the field."""


def _check(condition: bool, field: str, expected: str, got: object) -> None:
    if not condition:
        where = f"{field}: " if field else ""
        raise ScenarioError(f"{where}expected {expected}, got {got!r}")


def _not_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    _check(value >= 0, attribute.name, "a number >= 0", value)


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    _check(value > 0, attribute.name, "a number > 0", value)


def _optional_positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    _check(value is None or value > 0, attribute.name, "null or a number > 0", value)


def _at_least_one(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    _check(value >= 1, attribute.name, "an integer >= 1", value)


def _share(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    _check(0 <= value <= 1, attribute.name, "a number within 0..1", value)


@attrs.frozen(kw_only=True)
class Dist:
    """A distribution of non-negative numbers, sampled by its inverse CDF.

    ``sample(u)`` maps a uniform ``u`` in [0, 1) to a value, so one random draw
    makes one value and a replayed draw makes the same one. :attr:`simplest` is
    the median (``u = 0.5``): the value a shrunk trace uses where it has no draw.

    Attributes:
        kind: ``fixed`` (``value``), ``uniform`` (``low``..``high``),
            ``exponential`` (mean ``value``) or ``lognormal`` (median ``value``,
            shape ``sigma``).
    """

    kind: DistKind = "fixed"
    value: float = attrs.field(default=0.0, validator=_not_negative)
    low: float = attrs.field(default=0.0, validator=_not_negative)
    high: float = attrs.field(default=0.0, validator=_not_negative)
    sigma: float = attrs.field(default=0.0, validator=_not_negative)

    def __attrs_post_init__(self) -> None:
        if self.kind == "uniform":
            _check(self.low <= self.high, "high", f"a number >= low ({self.low})", self.high)

    @classmethod
    def fixed(cls, value: float) -> Dist:
        return cls(kind="fixed", value=value)

    @classmethod
    def uniform(cls, low: float, high: float) -> Dist:
        return cls(kind="uniform", low=low, high=high)

    @classmethod
    def exponential(cls, mean: float) -> Dist:
        return cls(kind="exponential", value=mean)

    @classmethod
    def lognormal(cls, median: float, sigma: float) -> Dist:
        return cls(kind="lognormal", value=median, sigma=sigma)

    def sample(self, u: float) -> float:
        """The value at quantile ``u`` (clamped into the open interval (0, 1))."""
        kind = self.kind
        if kind == "fixed":
            return self.value
        if kind == "uniform":
            return self.low + (self.high - self.low) * u
        u = min(max(u, _U_EDGE), 1 - _U_EDGE)
        if kind == "exponential":
            return -self.value * math.log1p(-u)
        return self.value * math.exp(self.sigma * _NORMAL.inv_cdf(u))

    @property
    def simplest(self) -> float:
        return self.sample(0.5)

    @property
    def mean(self) -> float:
        """The distribution's mean (for bounds and capacity estimates)."""
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        if self.kind == "lognormal":
            return self.value * math.exp(self.sigma**2 / 2)
        return self.value

    def to_data(self) -> Any:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return {"uniform": [self.low, self.high]}
        if self.kind == "exponential":
            return {"exponential": self.value}
        return {"lognormal": [self.value, self.sigma]}

    @classmethod
    def from_data(cls, data: Any, field: str = "") -> Dist:
        """A distribution from its data form (see the module docstring)."""
        _check(not isinstance(data, bool), field, "a number or a distribution", data)
        if isinstance(data, int | float):
            return cls.fixed(float(data))
        _check(
            isinstance(data, Mapping) and len(data) == 1,
            field,
            "a number or one of {fixed|uniform|exponential|lognormal: ...}",
            data,
        )
        ((kind, args),) = data.items()
        if kind in ("fixed", "exponential"):
            _check(_is_number(args), f"{field}.{kind}".lstrip("."), "a number", args)
            return cls(kind=kind, value=float(args))
        if kind in ("uniform", "lognormal"):
            _check(
                isinstance(args, list | tuple) and len(args) == 2 and all(map(_is_number, args)),
                f"{field}.{kind}".lstrip("."),
                "two numbers",
                args,
            )
            a, b = (float(x) for x in args)
            return cls.uniform(a, b) if kind == "uniform" else cls.lognormal(a, b)
        _check(False, field, "one of fixed, uniform, exponential, lognormal", kind)
        raise AssertionError("unreachable")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _names(instance: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    _check(len(set(value)) == len(value), attribute.name, "distinct names", list(value))


@attrs.frozen(kw_only=True)
class ServiceSpec:
    """A service some pods offer, and what its jobs are like.

    Attributes:
        name: the service's name.
        duration: how long one job runs (seconds).
        memory: its peak memory (bytes); ``None``: not measured.
        failure_rate: the share of inputs whose job fails (a permanent failure
            of that input, the same on every attempt).
    """

    name: str
    duration: Dist = attrs.field(factory=lambda: Dist.fixed(1.0))
    memory: Dist | None = None
    failure_rate: float = attrs.field(default=0.0, validator=_share)


@attrs.frozen(kw_only=True)
class PodSpec:
    """One execserver, or ``count`` alike (named ``NAME-0``, ``NAME-1``...).

    Attributes:
        services: the services it offers.
        slots, fast_reserve, unknown_share, memory_budget, max_slots,
            heavy_threshold, priority_aging: its slot pool (:class:`PoolConfig`).
        offer_ttl, turn_hold, ping_interval, ping_timeout, drain_timeout: the
            broker's settings (:class:`BrokerConfig`).
        up_at: when it starts (later than 0: a pod added under load).
        down_at: when it drains and leaves for good (``None``: never).
    """

    name: str
    services: tuple[str, ...] = attrs.field(validator=_names)
    slots: int = attrs.field(default=4, validator=_at_least_one)
    count: int = attrs.field(default=1, validator=_at_least_one)
    fast_reserve: int = attrs.field(default=0, validator=_not_negative)
    unknown_share: float = 1.0
    memory_budget: int | None = None
    max_slots: Mapping[str, int] = attrs.field(factory=dict)
    heavy_threshold: float = attrs.field(default=10.0, validator=_positive)
    priority_aging: float | None = attrs.field(default=None, validator=_optional_positive)
    offer_ttl: float = attrs.field(default=10.0, validator=_positive)
    turn_hold: float = attrs.field(default=0.05, validator=_not_negative)
    ping_interval: float = attrs.field(default=5.0, validator=_positive)
    ping_timeout: float = attrs.field(default=15.0, validator=_positive)
    drain_timeout: float = attrs.field(default=60.0, validator=_not_negative)
    up_at: float = attrs.field(default=0.0, validator=_not_negative)
    down_at: float | None = attrs.field(default=None, validator=_optional_positive)

    def __attrs_post_init__(self) -> None:
        _check(bool(self.services), "services", "at least one service", [])
        _check(
            self.fast_reserve <= self.slots,
            "fast_reserve",
            f"at most slots ({self.slots})",
            self.fast_reserve,
        )
        unknown = set(self.max_slots) - set(self.services)
        _check(not unknown, "max_slots", "offered services", sorted(unknown))

    def names(self) -> list[str]:
        """The names of the pods this spec makes."""
        if self.count == 1:
            return [self.name]
        return [f"{self.name}-{i}" for i in range(self.count)]


@attrs.frozen(kw_only=True)
class BalancerSpec:
    """A balancer: one address in front of pods; each new connection goes to one.

    Attributes:
        pods: pod spec names (every pod a spec makes is behind it).
        policy: ``round_robin``, ``least_connections`` or ``random``.
        sticky: a client's connections all go to the pod its first went to,
            while that pod is in the rotation (a balancer that pins).
        health_delay: how long a pod that went down, drains, or came up takes to
            leave or join the rotation (the balancer's health checks).
    """

    name: str
    pods: tuple[str, ...] = attrs.field(validator=_names)
    policy: Policy = "round_robin"
    sticky: bool = False
    health_delay: float = attrs.field(default=2.0, validator=_not_negative)


@attrs.frozen(kw_only=True)
class ClientSpec:
    """A client process, or ``count`` alike (``NAME-0``...): its core and who drives it.

    Attributes:
        addresses: balancer or pod names: the addresses it is configured with.
        kind: ``dispatcher``: it claims work from the shared queue (the fylr's
            loop: admission, claims, outcomes, heartbeats); ``direct``: producers
            submit to it and a caller retries what the outcome table requeues.
        connect_timeout ... reconnect_max: the client core's settings
            (:class:`~trio_broker.core.client.ClientConfig`).
        retry_delay: the delay of the outcomes that requeue *later*.
        unknown_service_attempts: the claim on which a step whose service no
            reachable pod offers fails for good (the dispatch core's bound, the fylr's
            setting); ``None``: never.
        tick_interval, heartbeat_interval, stale_after: the dispatcher's loop.
        cpus, max_in_flight, odd_reserve, db_pool: its admission.
    """

    name: str
    addresses: tuple[str, ...] = attrs.field(validator=_names)
    kind: ClientKind = "dispatcher"
    count: int = attrs.field(default=1, validator=_at_least_one)
    connect_timeout: float = attrs.field(default=60.0, validator=_positive)
    retry_tick: float = attrs.field(default=1.0, validator=_positive)
    pool_grow_interval: float = attrs.field(default=2.0, validator=_positive)
    pool_max: int = attrs.field(default=16, validator=_at_least_one)
    pool_reprobe_interval: float = attrs.field(default=60.0, validator=_positive)
    ping_interval: float = attrs.field(default=5.0, validator=_positive)
    ping_timeout: float = attrs.field(default=15.0, validator=_positive)
    reconnect_min: float = attrs.field(default=0.1, validator=_positive)
    reconnect_max: float = attrs.field(default=5.0, validator=_positive)
    retry_delay: float = attrs.field(default=60.0, validator=_not_negative)
    unknown_service_attempts: int | None = attrs.field(default=5, validator=_optional_positive)
    tick_interval: float = attrs.field(default=1.0, validator=_positive)
    heartbeat_interval: float = attrs.field(default=10.0, validator=_positive)
    stale_after: float = attrs.field(default=45.0, validator=_positive)
    cpus: int = attrs.field(default=1, validator=_not_negative)
    max_in_flight: int = attrs.field(default=0, validator=_not_negative)
    odd_reserve: int = attrs.field(default=2, validator=_not_negative)
    db_pool: int = attrs.field(default=10, validator=_at_least_one)

    def __attrs_post_init__(self) -> None:
        _check(bool(self.addresses), "addresses", "at least one", [])
        _check(
            self.stale_after > self.heartbeat_interval,
            "stale_after",
            f"more than heartbeat_interval ({self.heartbeat_interval})",
            self.stale_after,
        )

    def names(self) -> list[str]:
        if self.count == 1:
            return [self.name]
        return [f"{self.name}-{i}" for i in range(self.count)]


@attrs.frozen(kw_only=True)
class ProducerSpec:
    """Work arriving: into the shared queue, or straight to direct clients.

    Attributes:
        target: ``queue`` (the dispatchers' shared queue) or a ``direct``
            client spec's name (its clients take the jobs in turn).
        arrival: the time between two arrivals (seconds).
        services: service name -> weight of the mix.
        priorities: priority -> weight of the mix.
        start, stop: when arrivals begin and end (``stop`` None: the scenario's
            ``duration``).
        count: at most this many arrivals (``None``: no bound but ``stop``).
    """

    name: str
    target: str = "queue"
    arrival: Dist = attrs.field(factory=lambda: Dist.exponential(1.0))
    services: Mapping[str, float] = attrs.field(factory=dict)
    priorities: Mapping[int, float] = attrs.field(factory=lambda: {0: 1.0})
    start: float = attrs.field(default=0.0, validator=_not_negative)
    stop: float | None = attrs.field(default=None, validator=_optional_positive)
    count: int | None = attrs.field(default=None, validator=_optional_positive)

    def __attrs_post_init__(self) -> None:
        _check(bool(self.services), "services", "at least one service", {})
        _check(bool(self.priorities), "priorities", "at least one priority", {})
        for name, mix in (("services", self.services), ("priorities", self.priorities)):
            _check(all(w >= 0 for w in mix.values()), name, "weights >= 0", dict(mix))
            _check(sum(mix.values()) > 0, name, "a weight above 0", dict(mix))
        _check(
            self.arrival.mean > 0 or self.count is not None,
            "arrival",
            "a mean above 0 (or a count)",
            self.arrival,
        )


@attrs.frozen(kw_only=True)
class FaultSpec:
    """A fault: when, to whom, for how long, and whether it repeats.

    Attributes:
        kind: ``crash`` (the process dies, its volatile state is lost; restarted
            after ``restart_after`` unless that is None), ``partition`` (the
            target's network is cut for ``duration``; with ``database`` its
            database too) or ``drop`` (every connection of the target breaks).
        target: a pod or client name (one the specs make).
        at: when it happens first.
        silent: a crash where the host vanishes (no reset reaches the peers:
            they notice by liveness), not only the process.
        repeat_every: while not None, it happens again this long after each
            restart (a crash loop), until ``until``.
    """

    kind: FaultKind
    target: str
    at: float = attrs.field(validator=_not_negative)
    duration: float = attrs.field(default=10.0, validator=_not_negative)
    restart_after: float | None = attrs.field(default=5.0)
    silent: bool = False
    database: bool = False
    repeat_every: Dist | None = None
    until: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.restart_after is not None:
            _check(self.restart_after >= 0, "restart_after", "null or a number >= 0", 0)
        if self.repeat_every is not None:
            _check(self.kind == "crash", "repeat_every", "a crash (a crash loop)", self.kind)
            _check(self.restart_after is not None, "repeat_every", "with restart_after", None)
            _check(self.until is not None, "until", "a bound for a repeating fault", None)


@attrs.frozen(kw_only=True)
class Scenario:
    """A whole installation, its workload and its faults (see the module docstring).

    Attributes:
        duration: how long producers produce (virtual seconds).
        settle: how long after ``duration`` every job must be done by
            (``None``: derived from the scenario, :meth:`settle_bound`).
        latency: one-way network latency of each frame batch.
        loss: the share of frame batches TCP had to retransmit (they arrive
            ``rto`` later, in order: TCP reorders nothing within a connection).
        database_latency: one-way latency to the queue's database.
        dial_timeout: how long a dial may take before the client gives up.
        checks: ``full`` (every core's own invariants after every event that
            touched it) or ``light`` (the simulator's checks only).
    """

    name: str
    description: str = ""
    services: tuple[ServiceSpec, ...] = attrs.field()
    pods: tuple[PodSpec, ...] = attrs.field()
    balancers: tuple[BalancerSpec, ...] = attrs.field(default=())
    clients: tuple[ClientSpec, ...] = attrs.field()
    producers: tuple[ProducerSpec, ...] = attrs.field()
    faults: tuple[FaultSpec, ...] = attrs.field(default=())
    duration: float = attrs.field(default=300.0, validator=_positive)
    settle: float | None = attrs.field(default=None, validator=_optional_positive)
    latency: Dist = attrs.field(factory=lambda: Dist.uniform(0.0002, 0.001))
    loss: float = attrs.field(default=0.0, validator=_share)
    rto: float = attrs.field(default=0.2, validator=_not_negative)
    database_latency: Dist = attrs.field(factory=lambda: Dist.fixed(0.0005))
    dial_timeout: float = attrs.field(default=10.0, validator=_positive)
    checks: Literal["full", "light"] = "full"

    def __attrs_post_init__(self) -> None:
        self._check_names()
        self._check_references()

    def _check_names(self) -> None:
        hosts = [n for pod in self.pods for n in pod.names()]
        hosts += [pod.name for pod in self.pods if pod.count > 1]
        hosts += [b.name for b in self.balancers]
        hosts += [n for client in self.clients for n in client.names()]
        hosts += [c.name for c in self.clients if c.count > 1]
        for group, names in (
            ("services", [s.name for s in self.services]),
            ("producers", [p.name for p in self.producers]),
            ("pods, balancers and clients", hosts),
        ):
            twice = sorted({name for name in names if names.count(name) > 1})
            _check(not twice, group, "each name once", twice)

    def _check_references(self) -> None:
        services = {s.name for s in self.services}
        pod_specs = {pod.name for pod in self.pods}
        pods = pod_specs | {n for pod in self.pods for n in pod.names()}
        for pod in self.pods:
            missing = sorted(set(pod.services) - services)
            _check(not missing, f"pods.{pod.name}.services", "declared services", missing)
        for balancer in self.balancers:
            missing = sorted(set(balancer.pods) - pod_specs)
            _check(not missing, f"balancers.{balancer.name}.pods", "pod names", missing)
        addresses = pods | {b.name for b in self.balancers}
        for client in self.clients:
            missing = sorted(set(client.addresses) - addresses)
            _check(not missing, f"clients.{client.name}.addresses", "pods or balancers", missing)
        direct = {c.name for c in self.clients if c.kind == "direct"}
        queue = any(c.kind == "dispatcher" for c in self.clients)
        for producer in self.producers:
            where = f"producers.{producer.name}"
            missing = sorted(set(producer.services) - services)
            _check(not missing, f"{where}.services", "declared services", missing)
            if producer.target == "queue":
                _check(queue, f"{where}.target", "a dispatcher client to drain the queue", "queue")
            else:
                _check(
                    producer.target in direct,
                    f"{where}.target",
                    "queue or a direct client",
                    producer.target,
                )
        clients = {n for c in self.clients for n in c.names()}
        for fault in self.faults:
            _check(fault.target in pods | clients, "faults.target", "a pod or client", fault.target)

    # -- derived ---------------------------------------------------------------------

    def service(self, name: str) -> ServiceSpec:
        for service in self.services:
            if service.name == name:
                return service
        raise KeyError(name)

    def slot_count(self) -> int:
        return sum(pod.slots * pod.count for pod in self.pods)

    def settle_bound(self) -> float:
        """How long after ``duration`` every job must be done (``settle``, else derived).

        The work the producers make at their mean rates, spread over the slots,
        twice over; plus what any one item may spend on the way through no
        fault of capacity: the longest retry delay times the attempts a step
        may fail unknown_service, a re-probe, a stale sweep, a connect_timeout,
        the last fault's end and a restart.
        """
        if self.settle is not None:
            return self.settle
        work = 0.0
        for producer in self.producers:
            stop = self.duration if producer.stop is None else producer.stop
            arrivals = (stop - producer.start) / max(producer.arrival.mean, 1e-9)
            if producer.count is not None:
                arrivals = min(arrivals, producer.count)
            total = sum(producer.services.values())
            mean = sum(
                self.service(name).duration.mean * weight / total
                for name, weight in producer.services.items()
            )
            work += arrivals * mean
        drain = 2 * work / max(1, self.slot_count())
        per_item = max(
            (
                c.retry_delay * (c.unknown_service_attempts or 1)
                + c.pool_reprobe_interval
                + c.stale_after
                + c.heartbeat_interval
                + c.connect_timeout
                for c in self.clients
            ),
            default=0.0,
        )
        faults = max((self._fault_end(f) for f in self.faults), default=0.0)
        return drain + per_item + max(0.0, faults - self.duration) + 60.0

    @staticmethod
    def _fault_end(fault: FaultSpec) -> float:
        end = fault.until if fault.until is not None else fault.at
        return end + fault.duration + (fault.restart_after or 0.0)

    # -- data --------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scenario:
        """A scenario from plain data (a YAML or JSON document).

        Raises:
            ScenarioError: a member is missing, unknown or invalid; the message
                names it (``pods[1].slots: expected an integer >= 1, got 0``).
        """
        try:
            return _CONVERTER.structure(dict(data), cls)
        except ScenarioError:
            raise
        except (ClassValidationError, IterableValidationError) as exc:
            raise ScenarioError(_first_error(exc)) from None
        except (TypeError, ValueError, KeyError) as exc:
            raise ScenarioError(str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        """The scenario as plain data (what :meth:`from_dict` takes)."""
        data: dict[str, Any] = _CONVERTER.unstructure(self)
        return data


def _first_error(exc: BaseException, path: str = "") -> str:
    """The first leaf error of a cattrs error tree, with its path (``pods[0].slots: ...``)."""
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"{path.lstrip('.') or 'scenario'}: unknown keys {sorted(exc.extra_fields)}"
    if isinstance(exc, ClassValidationError | IterableValidationError):
        sub = exc.exceptions[0]
        notes = getattr(sub, "__notes__", None) or [""]
        return _first_error(sub, path + _path_step(str(notes[-1])))
    path = path.lstrip(".")
    if isinstance(exc, KeyError):
        key = str(exc.args[0])
        if path.rsplit(".", 1)[-1] == key:
            path = path[: -len(key)].rstrip(".")  # the path names the missing member
        return f"{path}: missing {key!r}" if path else f"missing {key!r}"
    text = str(exc)
    if isinstance(exc, TypeError | AttributeError):
        text = f"expected a mapping of its members ({text})"
    if not path:
        return text
    head = text.split(":", 1)[0]
    if isinstance(exc, ScenarioError) and head.isidentifier():
        if path.rsplit(".", 1)[-1] == head:
            return path + text[len(head) :]  # the field the path already names
        return f"{path}.{text}"  # a field of the value at the path
    return f"{path}: {text}"


def _path_step(note: str) -> str:
    """``.name`` or ``[i]`` from a cattrs note (``Structuring class X @ attribute y``)."""
    if "@ attribute " in note:
        return "." + note.rsplit("@ attribute ", 1)[1].strip()
    if "@ index " in note:
        return f"[{note.rsplit('@ index ', 1)[1].strip()}]"
    return ""


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(Dist, lambda data, _: Dist.from_data(data))
    conv.register_unstructure_hook(Dist, Dist.to_data)

    def float_hook(data: Any, _: Any) -> float:
        if not _is_number(data):
            raise ScenarioError(f"expected a number, got {data!r}")
        return float(data)

    def int_hook(data: Any, _: Any) -> int:
        if not isinstance(data, int) or isinstance(data, bool):
            raise ScenarioError(f"expected an integer, got {data!r}")
        return data

    def str_hook(data: Any, _: Any) -> str:
        if not isinstance(data, str):
            raise ScenarioError(f"expected a string, got {data!r}")
        return data

    def bool_hook(data: Any, _: Any) -> bool:
        if not isinstance(data, bool):
            raise ScenarioError(f"expected true or false, got {data!r}")
        return data

    conv.register_structure_hook(bool, bool_hook)
    conv.register_structure_hook(float, float_hook)
    conv.register_structure_hook(int, int_hook)
    conv.register_structure_hook(str, str_hook)

    def mapping(key: Callable[[Any], Any], value: Callable[[Any, Any], Any], of: type) -> Any:
        def hook(data: Any, _: Any) -> dict[Any, Any]:
            if not isinstance(data, Mapping):
                raise ScenarioError(f"expected a mapping, got {data!r}")
            return {key(k): value(v, of) for k, v in data.items()}

        return hook

    hooks = {
        Mapping[int, float]: mapping(lambda k: int_hook(_int_key(k), int), float_hook, float),
        Mapping[str, float]: mapping(lambda k: str_hook(k, str), float_hook, float),
        Mapping[str, int]: mapping(lambda k: str_hook(k, str), int_hook, int),
    }
    for kind, hook in hooks.items():
        conv.register_structure_hook_func(_is(kind), hook)
        conv.register_unstructure_hook_func(_is(kind), dict)
    return conv


def _is(kind: Any) -> Callable[[Any], bool]:
    def matches(t: Any) -> bool:
        return bool(t == kind)

    return matches


def _int_key(key: Any) -> Any:
    """Priorities as mapping keys: YAML gives ints, JSON gives strings of ints."""
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            raise ScenarioError(f"expected an integer priority, got {key!r}") from None
    return key


_CONVERTER = _make_converter()
