"""The reference execserver daemon's wiring: its YAML configuration as library values.

:class:`~trio_broker_daemons.config.ExecserverConfig` is what an operator writes;
the library's :func:`~trio_broker.trio.execserver.serve_execserver` takes a
:class:`~trio_broker.core.broker.BrokerConfig`, a runner and listener settings.
This module translates one into the other and serves it.

What the configuration leaves to the host (``slots: 0``, ``memory_budget: auto``,
``threads`` relative to the CPUs) is resolved against one
:class:`~trio_broker.trio.host.HostResources`, read once by :func:`serve_from_config`
(or built by hand in tests), so the pool, the memory budget and the thread counts
all see the same figures.
"""

from __future__ import annotations

import os
import secrets

import trio

from trio_broker.core.broker import BrokerConfig
from trio_broker.core.pool import PoolConfig
from trio_broker.trio.command import CommandRunner, CommandSpec
from trio_broker.trio.execserver import ExecserverHandle, serve_execserver
from trio_broker.trio.host import HostResources, probe_host
from trio_broker.trio.listener import ListenerSettings
from trio_broker.trio.runner import Runner
from trio_broker_daemons.config import ExecserverConfig, resolve_threads

__all__ = [
    "broker_config_from",
    "command_runner_from",
    "listener_from",
    "serve_from_config",
]


def broker_config_from(
    config: ExecserverConfig, host: HostResources, *, instance_id: str | None = None
) -> BrokerConfig:
    """The core's configuration for an execserver configuration.

    Args:
        config: the daemon's configuration.
        host: the host's CPUs and memory (``slots: 0``, ``memory_budget: auto``).
        instance_id: announced in ``HELLO``; random by default.

    Returns:
        The broker core's configuration.
    """
    return BrokerConfig(
        instance_id=instance_id or secrets.token_hex(8),
        name=config.name,
        pool=PoolConfig(
            size=config.pool_size(host),
            fast_reserve=config.resolved_fast_reserve(host),
            heavy_threshold=config.heavy_threshold,
            unknown_share=config.unknown_share,
            memory_budget=config.resolved_memory_budget(host),
            max_slots={name: service.max_slots for name, service in config.services.items()},
        ),
        offer_ttl=config.offer_ttl,
        ping_interval=config.ping_interval,
        ping_timeout=config.ping_timeout,
        drain_timeout=config.drain_timeout,
    )


def command_runner_from(
    config: ExecserverConfig,
    host: HostResources,
    *,
    instance_id: str = "",
    sample_interval: float = 1.0,
) -> CommandRunner:
    """The reference runner for an execserver configuration.

    Args:
        config: the daemon's configuration.
        host: the host's CPUs (each service's ``threads``) and memory
            (``memory_budget: auto``).
        instance_id: copied into every receipt.
        sample_interval: seconds between samples of a running job.

    Returns:
        The runner of ``config.services``.
    """
    services = {
        name: CommandSpec(
            argv=service.argv,
            builtin=service.builtin,
            threads=resolve_threads(service.threads, host.cpus),
            timeout=service.timeout,
            stall_timeout=service.stall_timeout,
            memory_limit=service.memory_limit,
            env=service.env,
        )
        for name, service in config.services.items()
    }
    return CommandRunner(
        services,
        env=config.env,
        temp_dir=str(config.temp_dir) if config.temp_dir is not None else None,
        memory_budget=config.resolved_memory_budget(host),
        instance_id=instance_id,
        sample_interval=sample_interval,
    )


def listener_from(config: ExecserverConfig) -> ListenerSettings:
    """The listener settings of an execserver configuration."""
    tls = config.tls
    return ListenerSettings(
        listen=config.listen,
        certfile=os.fspath(tls.cert) if tls is not None else None,
        keyfile=os.fspath(tls.key) if tls is not None else None,
    )


async def serve_from_config(
    config: ExecserverConfig,
    runner: Runner | None = None,
    *,
    host: HostResources | None = None,
    instance_id: str | None = None,
    task_status: trio.TaskStatus[ExecserverHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an execserver configured by YAML values (see ``serve_execserver``).

    Args:
        config: the daemon's configuration.
        runner: runs the jobs; by default the reference runner of ``config.services``.
        host: the host's CPUs and memory; by default read once from this host
            (:func:`~trio_broker.trio.host.probe_host`).
        instance_id: announced in ``HELLO``; random by default.
    """
    if host is None:
        host = await trio.to_thread.run_sync(probe_host)
    instance = instance_id or secrets.token_hex(8)
    if runner is None:
        runner = command_runner_from(config, host, instance_id=instance)
    await serve_execserver(
        broker_config_from(config, host, instance_id=instance),
        runner,
        listener=listener_from(config),
        broker_token=config.broker_token,
        max_frame_bytes=config.max_frame_bytes,
        task_status=task_status,
    )
