"""The core's records print as values: the class, then every field by name.

Effects, frames, statistics snapshots and configuration values are what a
failing model check or a log line shows, so each prints as code that builds an
equal value, and the few records that are not plain values (rows holding code,
counters holding state) still name their class and fields. The core's machines
(objects fed inputs) are not values and keep the default repr.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from types import ModuleType
from typing import Any

import attrs
import pytest

import trio_broker.core
from trio_broker.core import protocol as p
from trio_broker.core.admission import Admission, AdmissionConfig, InstanceLoad
from trio_broker.core.argv import ArgvTemplate
from trio_broker.core.book import WantBook
from trio_broker.core.broker import REFUSALS, Broker, BrokerConfig, StartJob, new_token
from trio_broker.core.client import ClientConfig, ClientCore, Dial
from trio_broker.core.dispatch import Backoff, DispatchCore
from trio_broker.core.figures import Subscriptions
from trio_broker.core.job import JobSpec, LastLine
from trio_broker.core.liveness import Liveness
from trio_broker.core.pool import PoolConfig, SlotPool
from trio_broker.core.sansio import SansIOCore
from trio_broker.core.supervision import MemoryBudget, Watchdog
from trio_broker.testing.values import receipt

MACHINES: frozenset[type] = frozenset(
    {
        Admission,
        Backoff,
        Broker,
        ClientCore,
        DispatchCore,
        LastLine,
        MemoryBudget,
        SansIOCore,
        SlotPool,
        Subscriptions,
        WantBook,
        Watchdog,
    }
)
"""Objects fed inputs (state machines, accumulators): their state is not a value."""


def public_modules() -> list[ModuleType]:
    return [
        importlib.import_module(f"trio_broker.core.{info.name}")
        for info in pkgutil.iter_modules(trio_broker.core.__path__)
        if not info.name.startswith("_")
    ]


def records() -> list[type]:
    """Every public class of the core's public modules that is neither an exception,
    nor a typing protocol, nor a machine."""
    found = []
    for module in public_modules():
        for name, cls in vars(module).items():
            if (
                inspect.isclass(cls)
                and cls.__module__ == module.__name__
                and not name.startswith("_")
                and not issubclass(cls, BaseException)
                and not getattr(cls, "_is_protocol", False)
                and cls not in MACHINES
            ):
                found.append(cls)
    return found


def names() -> dict[str, Any]:
    """The namespace a pasted repr is read in: every public core class by its name."""
    namespace: dict[str, Any] = {"new_token": new_token}
    for cls in records():
        namespace.setdefault(cls.__name__, cls)  # a clash is resolved per value below
    return namespace


@pytest.mark.parametrize("cls", records(), ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_record_of_the_core_has_a_readable_repr(cls: type) -> None:
    """An attrs record keeps the repr attrs writes (the class, then field=value for
    each field); a plain record writes its own. None prints as <object at 0x…>."""
    if attrs.has(cls):
        written_by = cls.__repr__.__code__.co_filename
        assert written_by.startswith("<attrs generated"), f"{cls.__name__}: {written_by}"
    else:
        assert "__repr__" in vars(cls), f"{cls.__name__} prints as <object at 0x…>"


# -- values from a real exchange -------------------------------------------------------


def broker_values() -> list[object]:
    """What a broker hands out over one job's life, a cancel, a silent peer and a drain."""
    pool = PoolConfig(size=1, max_slots={"s": 0}, unknown_share=1.0)
    config = BrokerConfig(instance_id="inst", name="exec", pool=pool, ping_timeout=20.0)
    broker = Broker(config, now=0.0)
    conn = broker.open_connection("10.0.0.1:7000", now=0.0)
    register = p.Register(backend_id="b", name="n", version="1", callback_url="http://c:1")
    broker.receive(conn, register, now=0.0)
    broker.receive(conn, p.Want(job_id="j", service="s", priority=2), now=0.0)
    broker.receive(conn, p.Want(job_id="k", service="s", priority=1), now=0.0)
    frames = [m for _, m in broker.frames_to_send()]
    (offer,) = [m for m in frames if isinstance(m, p.Offer)]
    job = p.Job(job_id="j", token=offer.token, service="s", subject="f", job={"a": [1]})
    broker.receive(conn, job, now=1.0)
    broker.receive(conn, p.Query(job_id="k"), now=1.0)
    broker.receive(conn, p.Cancel(job_id="j"), now=1.0)
    middle = [*broker.book.wants(), broker.statistics(), broker.stats_for(conn)]
    effects = broker.effects()
    (start,) = [e for e in effects if isinstance(e, StartJob)]
    finished = broker.job_ended(start.run_id, receipt("cancelled"), now=2.0)
    figures = [*broker.pool.services.values(), broker.figures, broker.statistics()]
    broker.tick(now=30.0)  # the client sent nothing for ping_timeout
    broker.drain(now=30.0)
    frames += [m for _, m in broker.frames_to_send()]
    return [config, pool, *frames, *middle, *effects, finished, *figures, *broker.effects()]


def client_values() -> list[object]:
    """What a client core hands out: a dial, a slot, a position, a refusal, an end, a
    failure and the close of a silent connection."""
    config = ClientConfig(backend_id="b", name="n", version="1", addresses=("10.0.0.1:7000",))
    core = ClientCore(config, now=0.0)
    (dial,) = core.effects()
    assert isinstance(dial, Dial)
    conn = dial.conn
    core.connected(conn, local_addr="10.0.0.2:4000", peer_addr="10.0.0.1:7000", now=0.0)
    services = {"s": p.ServiceInfo(max_slots=0, kind="unknown")}
    hello = p.Hello(
        protocol=1,
        instance_id="inst",
        name="exec",
        services=services,
        processes=1,
        idle=1,
        clients=1,
        draining=False,
        addr="10.0.0.1:7000",
    )
    core.receive(conn, hello, now=0.0)
    core.submit("j", "s", {"a": 1}, now=0.0)
    core.receive(conn, p.Offer(job_id="j", token="t"), now=0.0)
    core.query("j", now=0.0)
    position = p.Position(job_id="j", running=1, ahead=0, capacity=1, eta_s=0.0)
    core.receive(conn, position, now=0.0)
    core.receive(conn, p.Error(code="unknown_job", message="no", job_id="x"), now=0.0)
    core.receive(conn, p.Done(job_id="j", receipt=receipt()), now=1.0)
    core.submit("k", "other", {}, now=1.0)
    core.tick(now=100.0)
    return [config, dial, *core.effects(), *(m for _, m in core.frames_to_send())]


def other_values() -> list[object]:
    return [
        AdmissionConfig(cpus=4),
        InstanceLoad(instance_id="inst", processes=4, clients=2, idle=1),
        JobSpec.from_wire({"params": {"size": 10}, "timeout": "30s"}),
        ArgvTemplate.parse(["convert", "{input}", "-resize", "{size}x", "{output}"]),
        Liveness(5.0, 15.0),
        *REFUSALS,
    ]


VALUES = broker_values() + client_values() + other_values()

# Records whose repr is readable but not code that builds them: rows that hold code,
# a template whose parsed parts are derived, and counters holding state.
NOT_PASTEABLE = {"Refusal", "ArgvTemplate", "ServiceStats", "JobFigures"}


def test_the_exchange_hands_out_every_kind_of_effect_and_snapshot() -> None:
    """The sampled values cover each effect of both cores, the statistics snapshots
    and the plain records (so the round trip below tests them all)."""
    kinds = {type(value).__name__ for value in VALUES}
    effects = {"StartJob", "AbortJob", "CloseConnection", "CheckCallback", "Drained"}
    client = {"Dial", "Close", "Accepted", "Finished", "Failed", "PositionReport", "PeerError"}
    snapshots = {"BrokerStatistics", "ServiceSnapshot", "ConnectionSnapshot", "FinishedJob"}
    plain = {"ParkedWant", "ServiceStats", "JobFigures"}
    configs = {"BrokerConfig", "PoolConfig", "ClientConfig", "AdmissionConfig", "Liveness"}
    missing = (effects | client | {"Stats", "Position"} | plain | configs) - kinds
    assert not missing
    nested = " ".join(repr(value) for value in VALUES)
    assert all(f"{name}(" in nested for name in snapshots)


@pytest.mark.parametrize("value", VALUES, ids=lambda value: type(value).__name__)
def test_a_record_prints_as_code_that_builds_it_again(value: object) -> None:
    """repr() names the class and each field; pasted back it builds an equal value
    (the same repr, for records compared by identity), but for the few that cannot."""
    cls = type(value)
    text = repr(value)
    assert text.startswith(f"{cls.__name__}(")
    shown = (
        [f.name for f in attrs.fields(cls) if f.repr]
        if attrs.has(cls)
        else [name for name in getattr(cls, "__slots__", ()) if not name.startswith("_")]
    )
    for name in shown:
        assert re.search(rf"[(, ]{name}=", text), f"{name} missing from {text}"
    if cls.__name__ in NOT_PASTEABLE:
        return
    namespace = {**names(), **vars(inspect.getmodule(cls)), cls.__name__: cls}
    again = eval(text, namespace)
    assert again == value if attrs.has(cls) else repr(again) == text
