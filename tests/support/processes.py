"""The reference daemons as real processes, for tests, benchmarks and demos (trio)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

__all__ = [
    "ROOT_JOBS",
    "DaemonProcess",
    "open_execserver_process",
    "open_fylr_process",
    "read_fifo",
]

ROOT_JOBS = "root"
"""The execservers' ``job_user`` here when these run as root (see
:func:`open_execserver_process`)."""


@attrs.frozen
class DaemonProcess:
    """A running daemon and where it listens."""

    process: trio.Process
    host: str
    port: int

    @property
    def url(self) -> str:
        """The ``ws://`` address of its ``/broker`` endpoint."""
        return f"ws://{self.host}:{self.port}/broker"

    @property
    def http_url(self) -> str:
        """``http://host:port``: the daemon's HTTP API (a fylr's file API)."""
        return f"http://{self.host}:{self.port}"


@asynccontextmanager
async def open_execserver_process(
    config: str | os.PathLike[str],
    *,
    log_level: str = "warning",
    ready_within: float = 60.0,
    stop_within: float = 60.0,
    prefix: Sequence[str] = (),
    job_user: str | None = ROOT_JOBS,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[DaemonProcess]:
    """Run ``trio-broker execserver`` in a subprocess until the block ends.

    Args:
        config: a configuration file, or YAML text (a ``str`` with a newline).
        log_level: the daemon's ``--log-level``.
        ready_within: seconds to wait for the listener (it reports through a FIFO
            given as ``--ready-file``, so nothing is polled).
        stop_within: at the end, seconds to wait after SIGTERM before SIGKILL.
        prefix: an argv prefix that the daemon's command runs under, e.g.
            ``["ip", "netns", "exec", "NAME"]`` to run it on a test host in a
            network namespace. It must exec the command (so that the signals reach
            the daemon itself) and pass the standard streams through.
        job_user: when these run as root, the daemon's ``job_user``
            (``TRIO_BROKER_JOB_USER``) unless the environment sets one. Root runs
            jobs as ``nobody`` by default, and an interpreter in root's home (a
            virtualenv of root's Python) is closed to ``nobody``: the test
            scripts keep running as root, as they did before ``job_user``.
            ``None``: the daemon's default (the variable is not passed on).
        env: more variables for the daemon's environment (over this process's).

    Yields:
        The process and its bound address. If it is still running when the block
        ends it is sent SIGTERM (which drains it) and waited for.
    """
    environment = {**os.environ, **(env or {})}
    if job_user is None:
        environment.pop("TRIO_BROKER_JOB_USER", None)
    elif os.geteuid() == 0:
        environment.setdefault("TRIO_BROKER_JOB_USER", job_user)
    async with _open_daemon_process(
        "execserver",
        config,
        log_level=log_level,
        ready_within=ready_within,
        stop_within=stop_within,
        prefix=prefix,
        env=environment,
    ) as daemon:
        yield daemon


@asynccontextmanager
async def open_fylr_process(
    config: str | os.PathLike[str],
    *,
    log_level: str = "warning",
    ready_within: float = 120.0,
    stop_within: float = 60.0,
    prefix: Sequence[str] = (),
    stderr: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[DaemonProcess]:
    """Run ``trio-broker fylr`` in a subprocess until the block ends.

    Like :func:`open_execserver_process`; the fylr's file API is at the
    :attr:`DaemonProcess.http_url`. It is ready once its database is up and its
    listener bound (a first start with a private PostgreSQL cluster runs
    ``initdb``, hence the longer ``ready_within``).

    Args:
        config: a configuration file, or YAML text (a ``str`` with a newline).
        log_level: the daemon's ``--log-level``.
        ready_within: seconds to wait until it serves.
        stop_within: at the end, seconds to wait after SIGTERM before SIGKILL.
        prefix: an argv prefix the command runs under (see
            :func:`open_execserver_process`).
        stderr: a file that gets the daemon's log (appended); ``None``: this
            process's stderr.
        env: the daemon's whole environment (default: this process's).

    Yields:
        The process and its bound address. If it is still running when the block
        ends it is sent SIGTERM (a graceful stop) and waited for.
    """
    async with _open_daemon_process(
        "fylr",
        config,
        log_level=log_level,
        ready_within=ready_within,
        stop_within=stop_within,
        prefix=prefix,
        stderr=stderr,
        env=env,
    ) as daemon:
        yield daemon


@asynccontextmanager
async def _open_daemon_process(
    command: str,
    config: str | os.PathLike[str],
    *,
    log_level: str,
    ready_within: float,
    stop_within: float,
    prefix: Sequence[str],
    stderr: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[DaemonProcess]:
    with (
        tempfile.TemporaryDirectory(prefix="trio-broker-daemon-") as tmp,
        contextlib.ExitStack() as files,
    ):
        # open to a daemon that a prefix starts as another user: it reads its
        # configuration and writes its ready file here
        os.chmod(tmp, 0o755)
        if isinstance(config, str) and "\n" in config:
            path = Path(tmp) / f"{command}.yml"
            path.write_text(config)
        else:
            path = Path(config)
        ready = Path(tmp) / "ready"
        os.mkfifo(ready, 0o666)
        os.chmod(ready, 0o666)
        log = None if stderr is None else files.enter_context(stderr.open("ab"))
        process = await trio.lowlevel.open_process(
            [*prefix, sys.executable, "-m", "trio_broker_daemons", "--log-level", log_level,
             command, "--config", str(path), "--ready-file", str(ready)],
            stderr=log,
            env=None if env is None else dict(env),
        )  # fmt: skip
        try:
            with trio.fail_after(ready_within):
                text = await read_fifo(ready, process, command)
            host, port = text.split()
            yield DaemonProcess(process=process, host=host, port=int(port))
        finally:
            with trio.CancelScope(shield=True):
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
                    with trio.move_on_after(stop_within):
                        await process.wait()
                if process.returncode is None:
                    process.kill()
                await process.wait()


async def read_fifo(ready: Path, process: trio.Process, command: str = "execserver") -> str:
    """The FIFO's contents, or an error if the daemon exits before writing them."""
    result: list[str] = []
    exited: list[int] = []
    async with trio.open_nursery() as nursery:

        async def read() -> None:
            result.append(await trio.to_thread.run_sync(ready.read_text, abandon_on_cancel=True))
            nursery.cancel_scope.cancel()

        async def watch() -> None:
            exited.append(await process.wait())
            # unblock the reader, which waits for a writer that will never come
            with contextlib.suppress(OSError):
                os.close(os.open(ready, os.O_WRONLY | os.O_NONBLOCK))
            nursery.cancel_scope.cancel()

        nursery.start_soon(read)
        nursery.start_soon(watch)
    if not result or not result[0].strip():
        status = exited[0] if exited else process.returncode
        raise RuntimeError(f"the {command} exited with status {status} before listening")
    return result[0]
