"""The reference daemons' wiring: configuration, warnings, start-up failures, signals.

Both daemons start the same way (:func:`run_execserver`, :func:`run_fylr`):

1. The configuration is loaded with the process environment laid over the file
   (``TRIO_BROKER_…``). A problem prints one line naming the key and exits 2.
2. What loads but will hurt is logged as one warning line each
   (:func:`~trio_broker_daemons.execserver.config_warnings` for the execserver;
   :func:`exposed_listener_warning` is shared).
3. The service starts. A failure before it serves (a port in use, a missing or
   unreadable TLS file, a database that cannot be started or reached) prints
   one line and exits 1: ``trio-broker execserver: cannot listen on
   127.0.0.1:7000: address already in use``. A failure after that is a bug and
   keeps its traceback.
4. SIGTERM or SIGINT stops gracefully (the execserver drains); a second signal
   stops at once. A graceful end exits 0.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_broker.trio.execserver import ExecserverHandle
from trio_broker_daemons.config import ConfigError, ExecserverConfig, load_config
from trio_broker_daemons.execserver import config_warnings, serve_from_config, tls_problem
from trio_broker_daemons.logfmt import fields

if TYPE_CHECKING:  # the fylr's modules (psycopg…) load only for the fylr command
    from trio_broker_daemons.fylr.app import FylrHandle

__all__ = [
    "StartupFailure",
    "exposed_listener_warning",
    "run_daemon",
    "run_execserver",
    "run_fylr",
    "startup_problems",
]

log = logging.getLogger("trio_broker_daemons.daemon")

_LISTEN_ERRNOS = {errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES}


class StartupFailure(Exception):
    """A problem found before the daemon served; its text is the one line to print."""


@attrs.define
class _Started:
    """Set once the daemon serves: later failures are not start-up failures."""

    serving: bool = False


def exposed_listener_warning(host: str, port: int, token: str | None, *, what: str) -> str | None:
    """The warning for a listener reachable beyond this host without a token, else ``None``.

    Args:
        host: the listen host (an address or a name; only ``localhost`` and
            loopback addresses count as private).
        port: the listen port.
        token: the configured bearer token.
        what: what a stranger could do, for the sentence (``"run jobs"``).
    """
    if token is not None:
        return None
    try:
        private = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        private = False
    if private:
        return None
    shown = f"[{host}]" if ":" in host else host
    return (
        f"listening on {shown}:{port} without a broker_token: anyone who can reach it can"
        f" {what} (set broker_token or broker_token_file, or listen on 127.0.0.1)"
    )


def startup_problems(
    exc: BaseException, *, listen: str, serving: bool, always: tuple[type[BaseException], ...] = ()
) -> list[str] | None:
    """The one-line reasons of a failure, when it is a start-up failure; else ``None``.

    Args:
        exc: what the daemon's ``trio.run`` raised (an exception group or one exception).
        listen: the configured ``host:port``, for a failed bind.
        serving: whether the daemon had started serving (then only ``always`` count).
        always: exception types that are operational failures at any time (the
            fylr's database errors).

    Returns:
        One line per distinct reason, or ``None`` when any part of ``exc`` is
        something else (a bug, which keeps its traceback).
    """
    leaves = _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    lines: list[str] = []
    for leaf in leaves:
        if isinstance(leaf, (*always, StartupFailure)):
            line = " ".join(str(leaf).split())
        elif serving or not isinstance(leaf, OSError):
            return None
        elif isinstance(leaf, ssl.SSLError):
            line = f"TLS: {' '.join(str(leaf).split())}"
        elif leaf.errno in _LISTEN_ERRNOS:
            line = f"cannot listen on {listen}: {os.strerror(leaf.errno or 0).lower()}"
        else:
            line = f"cannot start: {' '.join(str(leaf).split())}"
        if line not in lines:
            lines.append(line)
    return lines


def run_daemon(
    command: str,
    listen: str,
    main: Callable[[_Started], Awaitable[None]],
    *,
    always: tuple[type[BaseException], ...] = (),
) -> int:
    """Run a daemon's ``main`` under ``trio.run``: 0 when it ends, 1 for a start-up failure.

    Args:
        command: ``execserver`` or ``fylr``, for the printed line.
        listen: the configured listener, for a failed bind.
        main: the daemon; it sets ``started.serving`` once it serves.
        always: exception types printed as one line at any time.

    Returns:
        The exit status (anything else is raised with its traceback).
    """
    started = _Started()
    try:
        trio.run(main, started)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        problems = startup_problems(exc, listen=listen, serving=started.serving, always=always)
        if problems is None:
            raise
        for line in problems:
            print(f"trio-broker {command}: {line}", file=sys.stderr)
        return 1
    return 0


async def _watch_signals(
    first: tuple[str, Callable[[], None]], second: tuple[str, Callable[[], None]]
) -> None:
    """The first SIGTERM/SIGINT calls ``first``, every later one ``second``.

    Each is ``(what it does, for the log line; the call)``.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        count = 0
        async for signum in signals:
            count += 1
            name = signal.Signals(signum).name
            if count == 1:
                log.info("%s: %s (send it again to stop at once)", name, first[0])
                first[1]()
            else:
                log.info("%s again: %s", name, second[0])
                second[1]()


def _config_line(command: str, config_path: str, exc: ConfigError) -> int:
    where = "" if exc.file else f"{config_path}: "
    print(f"trio-broker {command}: {where}{exc}", file=sys.stderr)
    return 2


async def _write_ready(ready_file: Path | None, host: str, port: int) -> None:
    if ready_file is not None:
        await trio.Path(ready_file).write_text(f"{host} {port}\n")


def run_execserver(
    config_path: str,
    *,
    ready_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """``trio-broker execserver --config FILE``: returns the exit status.

    Args:
        config_path: the YAML file.
        ready_file: written with ``HOST PORT`` once the listener is bound.
        environ: the ``TRIO_BROKER_…`` variables laid over the file; by default
            this process's environment.

    Returns:
        0 once drained; 1 for a start-up failure (one line printed); 2 for a
        configuration problem (one line naming the key path).
    """
    try:
        config = ExecserverConfig.from_yaml(
            config_path, environ=os.environ if environ is None else environ
        )
    except ConfigError as exc:
        return _config_line("execserver", config_path, exc)
    for warning in config_warnings(config):
        log.warning(warning.text, extra=fields(**warning.fields))
    problem = tls_problem(config)
    if problem is not None:
        print(f"trio-broker execserver: {problem}", file=sys.stderr)
        return 1
    ready = Path(ready_file) if ready_file else None

    async def main(started: _Started) -> None:
        async with trio.open_nursery() as nursery:
            handle: ExecserverHandle = await nursery.start(serve_from_config, config)
            started.serving = True
            nursery.start_soon(
                _watch_signals,
                ("draining", handle.drain),
                ("stopping running jobs now", handle.stop),
            )
            await _write_ready(ready, handle.host, handle.port)
            await handle.wait_closed()
            nursery.cancel_scope.cancel()

    return run_daemon("execserver", config.listen, main)


def run_fylr(
    config_path: str,
    *,
    ready_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """``trio-broker fylr --config FILE``: returns the exit status.

    The configuration is read like the execserver's
    (:func:`~trio_broker_daemons.config.load_config`: relative paths relative to
    the file, ``TRIO_BROKER_…`` variables over it).

    Args:
        config_path: the YAML file.
        ready_file: written with ``HOST PORT`` once it serves.
        environ: the variables laid over the file; by default this process's.

    Returns:
        0 once stopped by SIGTERM or SIGINT; 1 for a start-up failure (a port in
        use, a database that cannot be started or reached: one line printed); 2
        for a configuration problem (one line naming the key path).
    """
    from trio_broker.trio.store import StoreUnavailable
    from trio_broker_daemons.fylr.app import serve_fylr
    from trio_broker_daemons.fylr.config import FylrConfig
    from trio_broker_daemons.pgcluster import PgClusterError

    try:
        config = load_config(
            config_path, FylrConfig, environ=os.environ if environ is None else environ
        )
    except ConfigError as exc:
        return _config_line("fylr", config_path, exc)
    ready = Path(ready_file) if ready_file else None

    async def main(started: _Started) -> None:
        async with trio.open_nursery() as nursery:
            handle: FylrHandle = await nursery.start(serve_fylr, config)
            started.serving = True
            nursery.start_soon(
                _watch_signals,
                ("stopping", handle.stop),
                ("stopping at once", nursery.cancel_scope.cancel),
            )
            await _write_ready(ready, handle.host, handle.port)
            await handle.wait_closed()
            nursery.cancel_scope.cancel()

    return run_daemon("fylr", config.listen, main, always=(PgClusterError, StoreUnavailable))


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found
