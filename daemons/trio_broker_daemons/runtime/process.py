"""The daemons' process: start-up failures, signals, the ready file.

Both daemons start the same way
(:func:`~trio_broker_daemons.execserver.daemon.run_execserver`,
:func:`~trio_broker_daemons.fylr.daemon.run_fylr`), with the parts here:

1. The configuration is loaded with the process environment laid over the file
   (``TRIO_BROKER_…``). A problem prints one line naming the key and exits 2
   (:func:`config_line`).
2. What loads but will hurt is logged as one warning line each
   (:func:`~trio_broker_daemons.execserver.app.config_warnings` for the
   execserver; :func:`exposed_listener_warning` is for any daemon).
3. The service starts under :func:`run_daemon`. A failure before it serves (a
   port in use, a missing or unreadable TLS file, a database that cannot be
   started or reached) prints one line and exits 1: ``trio-broker execserver:
   cannot listen on 127.0.0.1:7000: address already in use``. A failure after
   that is a bug and keeps its traceback.
4. SIGTERM or SIGINT stops gracefully (:func:`watch_signals`: the execserver
   drains); a second signal stops at once. A graceful end exits 0.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from trio_broker_daemons.config.rules import loopback_host
from trio_broker_daemons.config.values import ConfigError

__all__ = [
    "Started",
    "StartupFailure",
    "config_line",
    "exposed_listener_warning",
    "run_daemon",
    "startup_problems",
    "watch_signals",
    "write_ready",
]

log = logging.getLogger("trio_broker_daemons.daemon")  # the name its lines have always had

_LISTEN_ERRNOS = {errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES}


class StartupFailure(Exception):
    """A problem found before the daemon served; its text is the one line to print."""


@attrs.define
class Started:
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
    if token is not None or loopback_host(host):
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
    main: Callable[[Started], Awaitable[None]],
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
    started = Started()
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


async def watch_signals(
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


def config_line(command: str, config_path: str, exc: ConfigError) -> int:
    """Print a configuration problem as the one line ``trio-broker COMMAND: FILE: …``; 2."""
    where = "" if exc.file else f"{config_path}: "
    print(f"trio-broker {command}: {where}{exc}", file=sys.stderr)
    return 2


async def write_ready(ready_file: Path | None, host: str, port: int) -> None:
    """Write ``HOST PORT`` to ``--ready-file`` (when one is given) once the listener is bound."""
    if ready_file is not None:
        await trio.Path(ready_file).write_text(f"{host} {port}\n")


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found
