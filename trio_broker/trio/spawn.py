"""Starting a job's leader from one long-lived thread, and waiting for it.

Why not ``trio.lowlevel.open_process``: a leader's parent-death signal
(``PR_SET_PDEATHSIG``, set between fork and exec) fires when the *thread* that
forked it ends, not the process; trio forks from its worker threads, which end
after a few seconds idle, and a leader started by one would be killed then. So
every leader is forked by one thread that lives as long as the process (a daemon
thread started on first use), and only its death (the process's) sends the
signal. Forking there also keeps the event loop free while a large process forks.

:func:`spawn` returns a :class:`Child`: the leader's pid, its pipes as trio
streams and a :meth:`Child.wait` that reaps it. Every child started here is
listed (:func:`reaping_lock`, :func:`is_spawned`) until it is reaped, so that
whoever reaps adopted orphans (:mod:`trio_broker.trio.containment`) never takes
the exit status of a leader away from its :class:`Child`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

__all__ = ["Child", "is_spawned", "reaping_lock", "spawn", "track", "untrack"]

_requests: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_thread_lock = threading.Lock()
_spawned: set[int] = set()
_reaping = threading.Lock()
"""Held while a child is forked and listed, and while adopted orphans are reaped."""


def reaping_lock() -> threading.Lock:
    """Hold it while reaping children that :func:`is_spawned` does not list.

    It is held from before a fork until the child is listed, so a reaper that
    holds it sees every child of :func:`spawn` listed.
    """
    return _reaping


def is_spawned(pid: int) -> bool:
    """Whether ``pid`` is a child of :func:`spawn` not yet reaped (its :class:`Child` will)."""
    return pid in _spawned


def track(pid: int) -> None:
    """List a child started elsewhere that its starter reaps (hold :func:`reaping_lock`)."""
    _spawned.add(pid)


def untrack(pid: int) -> None:
    """Take a child off the list once its starter reaped it."""
    _spawned.discard(pid)


def _serve() -> None:
    while True:
        _requests.get()()


def _submit(call: Callable[[], subprocess.Popen[bytes]]) -> concurrent.futures.Future[Any]:
    global _thread
    with _thread_lock:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="trio-broker-spawn", daemon=True)
            _thread.start()
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)

    _requests.put(run)
    return future


class Child:
    """A process started by :func:`spawn`.

    Attributes:
        pid: its pid (its session and process-group id: it leads a new session).
        stdin: the write end of its stdin, or ``None`` (its stdin is ``/dev/null``).
        stdout, stderr: the read ends of its output.
        pidfd: readable once it exits (without reaping it); ``None`` on kernels
            without pidfds.
    """

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdin: trio.lowlevel.FdStream | None,
        stdout: trio.lowlevel.FdStream,
        stderr: trio.lowlevel.FdStream,
    ) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        try:
            self.pidfd: int | None = os.pidfd_open(self.pid)
        except (OSError, AttributeError):
            self.pidfd = None

    @property
    def returncode(self) -> int | None:
        """Its exit status once reaped (negative: the signal), else ``None``."""
        return self._popen.returncode

    async def wait_exited(self) -> None:
        """Return once it has exited; it stays a zombie (unreaped) where pidfds exist."""
        if self._popen.returncode is not None:
            return
        if self.pidfd is not None:
            await trio.lowlevel.wait_readable(self.pidfd)
            return
        await trio.to_thread.run_sync(
            os.waitid, os.P_PID, self.pid, os.WEXITED | os.WNOWAIT, abandon_on_cancel=True
        )

    async def wait(self) -> int:
        """Wait for it to exit and reap it; its exit status."""
        await self.wait_exited()
        code = self._popen.wait()  # it has exited: this returns at once
        _spawned.discard(self.pid)
        return code

    def send_signal(self, sig: int) -> None:
        """Signal it, unless it was reaped already."""
        if self._popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def close(self) -> None:
        """Close its pidfd (the streams are closed by their owner)."""
        if self.pidfd is not None:
            trio.lowlevel.notify_closing(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None


def _start(
    argv: Sequence[str],
    *,
    stdin: int,
    stdout: int,
    stderr: int,
    cwd: str,
    env: Mapping[str, str],
    setup: Callable[[], None] | None,
) -> subprocess.Popen[bytes]:
    with _reaping:
        popen = subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            cwd=cwd,
            env=env,
            start_new_session=True,
            close_fds=True,
            preexec_fn=setup,  # forked by the one spawning thread: see the module docstring
        )
        _spawned.add(popen.pid)
    return popen


async def spawn(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    stdin: bool,
    setup: Callable[[], None] | None = None,
) -> Child:
    """Start ``argv`` as the leader of a new session, forked by the spawning thread.

    Args:
        argv: the program and its arguments.
        cwd: its working folder.
        env: its whole environment.
        stdin: give it a pipe for stdin (else ``/dev/null``).
        setup: runs in the child between fork and exec (after the new session
            is made), e.g. to enter a cgroup, change user and set the
            parent-death signal. It must not take locks.

    Returns:
        The started child. Waiting for the spawning thread is shielded from
        cancellation: a child that was started is always returned to be ended.

    Raises:
        OSError: the program cannot run (not found, not executable…).
        subprocess.SubprocessError: ``setup`` failed in the child.
        ValueError: a bad ``argv`` or ``env`` (a NUL character).
    """
    fds: list[int] = []
    ours: list[int] = []
    child_in = subprocess.DEVNULL
    try:
        if stdin:
            child_in, parent_in = os.pipe()
            fds.append(child_in)
            ours.append(parent_in)
        parent_out, child_out = os.pipe()
        parent_err, child_err = os.pipe()
        fds += [child_out, child_err]
        ours += [parent_out, parent_err]
        future = _submit(
            lambda: _start(
                argv,
                stdin=child_in,
                stdout=child_out,
                stderr=child_err,
                cwd=cwd,
                env=env,
                setup=setup,
            )
        )
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: object) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        future.add_done_callback(wake)
        with trio.CancelScope(shield=True):
            await done.wait()
        popen = future.result()
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    streams = [trio.lowlevel.FdStream(fd) for fd in ours]
    return Child(popen, streams[0] if stdin else None, streams[-2], streams[-1])
