"""The reference execserver daemon's wiring: its YAML configuration as library values.

:class:`~trio_broker_daemons.execserver.config.ExecserverConfig` is what an operator writes;
the library's :func:`~trio_broker.trio.execserver.serve_execserver` takes a
:class:`~trio_broker.core.broker.BrokerConfig`, a runner and listener settings.
This module translates one into the other and serves it.

What the configuration leaves to the host (``slots: 0``, ``memory_budget: auto``,
``threads`` relative to the CPUs) is resolved against one
:class:`~trio_broker.trio.host.HostResources`, read once by :func:`serve_from_config`
(or built by hand in tests), so the pool, the memory budget and the thread counts
all see the same figures.

Before it serves, the daemon asks :func:`job_user_from` who its jobs run as,
:func:`config_warnings` what will hurt (a program that is not there or that the
job user cannot run, a listener open to the network without a token) and
:func:`tls_problem` whether the TLS files can be used.
"""

from __future__ import annotations

import os
import secrets
import shutil
import ssl
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_broker.core.broker import BrokerConfig
from trio_broker.core.pool import PoolConfig
from trio_broker.trio.command import CommandRunner, CommandSpec
from trio_broker.trio.containment import Containment, JobUser, JobUserError
from trio_broker.trio.execserver import ExecserverHandle, serve_execserver
from trio_broker.trio.host import HostResources, probe_host
from trio_broker.trio.listener import ListenerSettings
from trio_broker.trio.produce_cache import CacheSpec, CachingRunner, ProduceCache
from trio_broker.trio.runner import Runner
from trio_broker_daemons.config.values import ConfigError, resolve_threads
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_broker_daemons.runtime.process import exposed_listener_warning

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "ConfigWarning",
    "broker_config_from",
    "command_runner_from",
    "config_warnings",
    "job_user_from",
    "listener_from",
    "serve_from_config",
    "tls_problem",
]


@attrs.frozen(kw_only=True)
class ConfigWarning:
    """One warning about a configuration that loads: the sentence and its log fields."""

    text: str
    fields: dict[str, Any] = attrs.field(factory=dict)


def job_user_from(config: ExecserverConfig) -> JobUser:
    """The user the jobs of ``config`` run as (``job_user``, or the default).

    Args:
        config: the daemon's configuration.

    Returns:
        ``job_user`` looked up on this host; without one, the daemon's own user
        when it is not root, else ``nobody``.

    Raises:
        ConfigError: no such user here (key ``job_user``), or this process
            cannot run jobs as that user (it is not root and lacks the
            capabilities to switch).
    """
    try:
        user = JobUser.default() if config.job_user is None else JobUser.named(config.job_user)
    except JobUserError as exc:
        raise ConfigError(str(exc), keys=("job_user",)) from None
    problem = user.switch_problem()
    if problem is not None:
        raise ConfigError(problem, keys=("job_user",))
    return user


def _allows(info: os.stat_result, user: JobUser, bits: int) -> bool:
    """Whether the mode of ``info`` gives ``user`` all of ``bits`` (read 4, write 2, exec 1)."""
    if user.uid == 0:
        return not bits & 1 or bool(info.st_mode & 0o111)
    if info.st_uid == user.uid:
        shift = 6
    elif info.st_gid == user.gid or info.st_gid in user.groups:
        shift = 3
    else:
        shift = 0
    return (info.st_mode >> shift) & bits == bits


def _runnable_by(path: str, user: JobUser) -> bool:
    """Whether ``user`` can reach and run ``path`` (every folder on the way searchable)."""
    real = os.path.realpath(path)
    folders = [real]
    while (parent := os.path.dirname(folders[-1])) != folders[-1]:
        folders.append(parent)
    try:
        if not _allows(os.stat(real), user, 5 if _is_script(real) else 1):
            return False
        return all(
            stat.S_ISDIR(os.stat(f).st_mode) and _allows(os.stat(f), user, 1) for f in folders[1:]
        )
    except OSError:
        return False


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as file:
            return file.read(2) == b"#!"
    except OSError:
        return False


def _program_problem(program: str, search_path: str, user: JobUser | None) -> str | None:
    """What is wrong with a service's program, or ``None`` when it can run."""
    if "/" in program:
        if not os.path.isabs(program):
            return (
                "is a relative path, but commands run in a fresh work folder of their own"
                " (write {config_dir}/… or an absolute path)"
            )
        if not os.path.isfile(program):
            return "does not exist"
        if not os.access(program, os.X_OK):
            return "is not executable"
        found = program
    else:
        which = shutil.which(program, path=search_path)
        if which is None:
            return "is not found on the PATH"
        found = which
    if user is not None and not user.is_current and not _runnable_by(found, user):
        return (
            f"cannot be run by job_user {user.name!r} ({found}: a folder on the way or the"
            " file itself is closed to that user)"
        )
    return None


def config_warnings(
    config: ExecserverConfig,
    *,
    environ: Mapping[str, str] | None = None,
    job_user: JobUser | None = None,
) -> list[ConfigWarning]:
    """What in a configuration that loads will not work, one warning each.

    - a service whose program (``argv[0]``) is not found: a path that does not
      exist or cannot be executed, a relative path (commands run in a fresh
      work folder), or a name not on the ``PATH`` its commands get;
    - a program the job user may not run (a folder on its way, or the file,
      closed to that user), when ``job_user`` is given;
    - a listener that is not on a loopback address, without a ``broker_token``.

    Args:
        config: the configuration.
        environ: where the commands' ``PATH`` comes from when ``env`` sets none;
            by default this process's environment.
        job_user: the user jobs run as (:func:`job_user_from`); ``None``: not checked.

    Returns:
        The warnings, in service order, the listener's last.
    """
    source = os.environ if environ is None else environ
    warnings: list[ConfigWarning] = []
    for name, service in config.services.items():
        if service.argv is None:
            continue
        program = service.argv[0]
        search_path = service.env.get("PATH") or config.env.get("PATH")
        problem = _program_problem(program, search_path or source.get("PATH", os.defpath), job_user)
        if problem is not None:
            warnings.append(
                ConfigWarning(
                    text=f"service {name!r}: program {program!r} {problem}",
                    fields={"service": name, "program": program},
                )
            )
    exposed = exposed_listener_warning(
        config.host, config.port, config.broker_token, what="run jobs and read its inspection"
    )
    if exposed is not None:
        warnings.append(ConfigWarning(text=exposed, fields={"listen": config.listen}))
    return warnings


def tls_problem(config: ExecserverConfig) -> str | None:
    """Why the configured TLS files cannot serve, or ``None`` (also without TLS).

    Each file must be readable, and together they must be a certificate chain
    and its private key in PEM.

    Args:
        config: the configuration.

    Returns:
        One line naming the key and the file, or ``None``.
    """
    tls = config.tls
    if tls is None:
        return None
    for key, path in (("cert", tls.cert), ("key", tls.key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            return f"tls.{key}: cannot read {os.fspath(path)!r}: {exc.strerror or exc}"
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except ssl.SSLError as exc:
        reason = exc.reason or " ".join(str(exc).split())
        return (
            f"tls: cannot use {os.fspath(tls.cert)!r} with {os.fspath(tls.key)!r}:"
            f" {reason} (expected a PEM certificate chain and its private key)"
        )
    return None


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
            priority_aging=config.priority_aging,
        ),
        offer_ttl=config.offer_ttl,
        ping_interval=config.ping_interval,
        ping_timeout=config.ping_timeout,
        drain_timeout=config.drain_timeout,
        turn_hold=config.turn_hold,
        max_wants_per_connection=config.max_wants_per_connection,
    )


def command_runner_from(
    config: ExecserverConfig,
    host: HostResources,
    *,
    instance_id: str = "",
    sample_interval: float = 1.0,
    job_user: JobUser | None = None,
    containment: Containment | None = None,
) -> CommandRunner | CachingRunner:
    """The reference runner for an execserver configuration (behind its produce caches).

    Args:
        config: the daemon's configuration.
        host: the host's CPUs (each service's ``threads``) and memory
            (``memory_budget: auto``).
        instance_id: copied into every receipt.
        sample_interval: seconds between samples of a running job.
        job_user: who the commands run as; by default :func:`job_user_from`.
        containment: what the daemon's process set up for its jobs (a cgroup…).

    Returns:
        The runner of ``config.services``.

    Raises:
        ConfigError: ``job_user`` cannot be used (see :func:`job_user_from`).
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
    runner = CommandRunner(
        services,
        env=config.env,
        temp_dir=str(config.temp_dir) if config.temp_dir is not None else None,
        memory_budget=config.resolved_memory_budget(host),
        instance_id=instance_id,
        sample_interval=sample_interval,
        job_user=job_user_from(config) if job_user is None else job_user,
        containment=containment,
    )
    return caching_runner(config, runner, instance_id=instance_id)


def caching_runner(
    config: ExecserverConfig, runner: CommandRunner, *, instance_id: str = ""
) -> CommandRunner | CachingRunner:
    """``runner`` behind the produce caches of the services that declare one (if any).

    Each cache is ``<temp_dir>/produce-cache/<service>`` (the system's temporary
    folder without ``temp_dir``); temporary files of killed producers are deleted now.
    """
    root = Path(config.temp_dir or tempfile.gettempdir()) / "produce-cache"
    caches = {
        name: ProduceCache(
            root / name, CacheSpec(key=service.cache.key, max_size=service.cache.max_size)
        )
        for name, service in config.services.items()
        if service.cache is not None
    }
    if not caches:
        return runner
    return CachingRunner(runner, caches, instance_id=instance_id)


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
    job_user: JobUser | None = None,
    containment: Containment | None = None,
    task_status: trio.TaskStatus[ExecserverHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an execserver configured by YAML values (see ``serve_execserver``).

    Args:
        config: the daemon's configuration.
        runner: runs the jobs; by default the reference runner of ``config.services``.
        host: the host's CPUs and memory; by default read once from this host
            (:func:`~trio_broker.trio.host.probe_host`).
        instance_id: announced in ``HELLO``; random by default.
        job_user: who the reference runner's commands run as; by default
            :func:`job_user_from`.
        containment: what the daemon's process set up for its jobs
            (:func:`~trio_broker.trio.containment.serve_containment`).
    """
    if host is None:
        host = await trio.to_thread.run_sync(probe_host)
    instance = instance_id or secrets.token_hex(8)
    if runner is None:
        runner = command_runner_from(
            config, host, instance_id=instance, job_user=job_user, containment=containment
        )
    await serve_execserver(
        broker_config_from(config, host, instance_id=instance),
        runner,
        listener=listener_from(config),
        broker_token=config.broker_token,
        max_frame_bytes=config.max_frame_bytes,
        task_status=task_status,
    )
