"""trio_broker: a slot broker for scarce external jobs, on trio.

Execservers own pools of execution slots; clients park *wants* on them over one
persistent websocket each, and every freed slot is offered to exactly one want:
highest priority first, then round-robin across connections, then FIFO.

The layers:

- :mod:`trio_broker.core`: the sans-IO core (protocol, want-book, slot pool,
  broker, client core, admission, dispatch decisions, supervision rules). It is
  the product: every rule lives there, fed events and asked what to send.
- :mod:`trio_broker.trio`: the trio layer around it (the execserver service, the
  client, pipes, runners, the PostgreSQL queue and dispatcher). Glue; no policy.
- :mod:`trio_broker.testing`: the public hypothesis model checks.

The most used names are importable from here (``from trio_broker import
open_broker_client, serve_execserver, Broker, ClientCore``). They load on first
use, so ``import trio_broker`` alone, or a core name, does not import trio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trio_broker._version import __version__

if TYPE_CHECKING:
    from trio_broker.core import protocol
    from trio_broker.core.admission import AdmissionConfig, InstanceLoad
    from trio_broker.core.argv import ArgvTemplate
    from trio_broker.core.book import WantBook
    from trio_broker.core.broker import Broker, BrokerConfig
    from trio_broker.core.client import ClientConfig, ClientCore
    from trio_broker.core.dispatch import DispatchCore, judge
    from trio_broker.core.endings import JobFailed
    from trio_broker.core.errors import (
        BrokerError,
        BrokerUsageError,
        ClientClosed,
        ClientUsageError,
        DispatchUsageError,
        JobLost,
        JobStopped,
        NoExecserver,
        NoSlot,
        ProtocolError,
        RetryLater,
        ServiceNotOffered,
        StoreUnavailable,
        UnknownService,
        UsageError,
        WorkFailed,
    )
    from trio_broker.core.job import JobSpec
    from trio_broker.core.pool import PoolConfig, SlotPool
    from trio_broker.trio.client import BrokerClient, ClientStatistics, open_broker_client
    from trio_broker.trio.command import CommandRunner, CommandSpec
    from trio_broker.trio.dispatcher import Action, Dispatcher, DispatcherConfig, serve_dispatcher
    from trio_broker.trio.execserver import ExecserverHandle, serve_execserver
    from trio_broker.trio.inspection import ExecserverStatistics
    from trio_broker.trio.listener import ListenerSettings
    from trio_broker.trio.pipes import PipeRegistry
    from trio_broker.trio.runner import JobControl, JobRequest, Runner
    from trio_broker.trio.store import Store, open_store

_EXPORTS: dict[str, str] = {
    "protocol": "trio_broker.core",
    "BrokerError": "trio_broker.core.errors",
    "BrokerUsageError": "trio_broker.core.errors",
    "ClientClosed": "trio_broker.core.errors",
    "ClientUsageError": "trio_broker.core.errors",
    "DispatchUsageError": "trio_broker.core.errors",
    "JobLost": "trio_broker.core.errors",
    "JobStopped": "trio_broker.core.errors",
    "NoExecserver": "trio_broker.core.errors",
    "NoSlot": "trio_broker.core.errors",
    "ProtocolError": "trio_broker.core.errors",
    "RetryLater": "trio_broker.core.errors",
    "ServiceNotOffered": "trio_broker.core.errors",
    "StoreUnavailable": "trio_broker.core.errors",
    "UnknownService": "trio_broker.core.errors",
    "UsageError": "trio_broker.core.errors",
    "WorkFailed": "trio_broker.core.errors",
    "JobFailed": "trio_broker.core.endings",
    "Broker": "trio_broker.core.broker",
    "BrokerConfig": "trio_broker.core.broker",
    "PoolConfig": "trio_broker.core.pool",
    "SlotPool": "trio_broker.core.pool",
    "WantBook": "trio_broker.core.book",
    "ClientConfig": "trio_broker.core.client",
    "ClientCore": "trio_broker.core.client",
    "AdmissionConfig": "trio_broker.core.admission",
    "InstanceLoad": "trio_broker.core.admission",
    "DispatchCore": "trio_broker.core.dispatch",
    "judge": "trio_broker.core.dispatch",
    "JobSpec": "trio_broker.core.job",
    "ArgvTemplate": "trio_broker.core.argv",
    "BrokerClient": "trio_broker.trio.client",
    "ClientStatistics": "trio_broker.trio.client",
    "open_broker_client": "trio_broker.trio.client",
    "ExecserverHandle": "trio_broker.trio.execserver",
    "ExecserverStatistics": "trio_broker.trio.inspection",
    "serve_execserver": "trio_broker.trio.execserver",
    "ListenerSettings": "trio_broker.trio.listener",
    "JobControl": "trio_broker.trio.runner",
    "JobRequest": "trio_broker.trio.runner",
    "Runner": "trio_broker.trio.runner",
    "CommandRunner": "trio_broker.trio.command",
    "CommandSpec": "trio_broker.trio.command",
    "PipeRegistry": "trio_broker.trio.pipes",
    "Action": "trio_broker.trio.dispatcher",
    "Dispatcher": "trio_broker.trio.dispatcher",
    "DispatcherConfig": "trio_broker.trio.dispatcher",
    "serve_dispatcher": "trio_broker.trio.dispatcher",
    "Store": "trio_broker.trio.store",
    "open_store": "trio_broker.trio.store",
}

__all__ = [
    "Action",
    "AdmissionConfig",
    "ArgvTemplate",
    "Broker",
    "BrokerClient",
    "BrokerConfig",
    "BrokerError",
    "BrokerUsageError",
    "ClientClosed",
    "ClientConfig",
    "ClientCore",
    "ClientStatistics",
    "ClientUsageError",
    "CommandRunner",
    "CommandSpec",
    "DispatchCore",
    "DispatchUsageError",
    "Dispatcher",
    "DispatcherConfig",
    "ExecserverHandle",
    "ExecserverStatistics",
    "InstanceLoad",
    "JobControl",
    "JobFailed",
    "JobLost",
    "JobRequest",
    "JobSpec",
    "JobStopped",
    "ListenerSettings",
    "NoExecserver",
    "NoSlot",
    "PipeRegistry",
    "PoolConfig",
    "ProtocolError",
    "RetryLater",
    "Runner",
    "ServiceNotOffered",
    "SlotPool",
    "Store",
    "StoreUnavailable",
    "UnknownService",
    "UsageError",
    "WantBook",
    "WorkFailed",
    "__version__",
    "judge",
    "open_broker_client",
    "open_store",
    "protocol",
    "serve_dispatcher",
    "serve_execserver",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trio_broker' has no attribute {name!r}")
    package = importlib.import_module(module)
    value = getattr(package, name, None)
    if value is None:  # a submodule (protocol)
        value = importlib.import_module(f"{module}.{name}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
