"""A real HAProxy in front of test backends: one loopback address, round-robin (trio).

Tests of the client's per-address connection pool need what production has: one
address that spreads new TCP connections over several execserver replicas.
:func:`open_haproxy` runs the system's ``haproxy`` binary (Debian package
``haproxy``) as a subprocess for the length of an ``async with`` block.

Theory of operation:

- **The listening socket is ours.** We bind a socket on ``host`` port 0 ourselves,
  listen on it and hand it to haproxy as an inherited file descriptor
  (``bind fd@N``). The port is therefore known before haproxy starts and no other
  process can take it in between: there is no "find a free port, hope it stays free,
  retry on a bind failure" loop.
- **Readiness is an event, not a poll.** haproxy runs in master-worker mode with
  systemd-style readiness (``-Ws``): it sends ``READY=1`` to the datagram socket
  named by ``NOTIFY_SOCKET`` once the configuration is loaded, every listener
  (the front end, the admin socket, the master's CLI socket) is bound and the
  worker is forked. We wait for that datagram or for the process to exit (a
  configuration error), whichever comes first. The master sends ``READY=1`` a moment
  *before* it installs its signal handlers, so we then ask its CLI (``-S``) for
  ``show proc``: it answers from its event loop, handlers in place, and a SIGTERM
  from then on stops it in order. Both waits together are bounded by
  ``ready_within``. This needs a build with systemd support, which Debian's package
  has (``haproxy -vv`` lists ``+SYSTEMD``).
- **One TCP connection, one pick.** ``balance roundrobin`` over one backend ``bk``
  whose servers are named ``s0``, ``s1``… In ``mode tcp`` (the default) each new
  client connection goes to the next server and stays there for its whole life; in
  ``mode http`` each request does, and a websocket upgrade then holds its server
  for the life of the tunnel. Long-lived connections are allowed an hour of silence
  (``timeout client/server/tunnel``).
- **Health checks take dead replicas out.** Every server is checked every
  ``check_interval`` seconds with ``GET health_path`` (a TCP connect when
  ``health_path`` is None); two failures in a row mark it DOWN (so a draining
  execserver, whose ``/healthz`` answers 503, leaves too), one success brings it
  back. A connection that reaches a dead server before its check noticed is retried
  once on the same server, a second later, and then given up (no redispatch): in
  ``mode tcp`` the client's connection is closed before any byte came back, in
  ``mode http`` it gets a 503, as from a plain balancer.
- **Replicas added later use spare slots.** ``spare`` extra servers are declared in
  the configuration, disabled. :meth:`HAProxy.add_backend` points a free one at the
  new address and makes it ready through the admin socket (the runtime API:
  ``set server bk/sN addr … port …``, ``health up``, ``state ready``);
  :meth:`HAProxy.remove_backend` puts it back in maintenance and frees the slot.
  These commands take effect at once inside haproxy, so a call that returned has
  changed the rotation for the next connection.
- **Logs go to a file.** haproxy's stdout and stderr (its own notices and one log
  line per connection) go to ``haproxy.log`` in the work folder, and a start-up
  failure quotes it, so a failing test shows what the balancer saw.
- **Stopping is bounded.** At the end of the block the master gets SIGTERM (it stops
  its worker and exits); if it has not exited within ``stop_within`` seconds, its
  whole process group (haproxy runs in a session of its own) gets SIGKILL, sent
  while the master is not yet reaped so that the group id is still ours.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

import attrs
import trio

__all__ = [
    "BackendState",
    "HAProxy",
    "HAProxyError",
    "HAProxyNotFound",
    "find_haproxy",
    "open_haproxy",
    "render_config",
]

_SEARCH_PATH = ("/usr/sbin", "/usr/local/sbin", "/sbin")
"""Where ``haproxy`` lives when it is not on PATH (Debian installs it in /usr/sbin)."""

_BACKEND = "bk"
_PATH = re.compile(r"/[A-Za-z0-9._~/%?=&+-]*")
_COMMAND_WITHIN = 30.0
"""Bound on one admin-socket command (haproxy answers at once; this catches a hang)."""


class HAProxyNotFound(RuntimeError):
    """No ``haproxy`` executable was found."""


class HAProxyError(RuntimeError):
    """haproxy failed to start, or refused an admin command."""


@attrs.frozen(kw_only=True)
class BackendState:
    """One backend server as haproxy reports it.

    Attributes:
        name: the server's name in backend ``bk`` (``s0``, ``s1``…).
        host, port: where it points.
        status: haproxy's status column: ``UP``, ``DOWN``, ``MAINT``, or a
            transition such as ``UP 1/2`` (in the rotation, but one more failed
            check takes it out: a server starts so, and so does an added one, until
            its first check passes).
        sessions: connections it holds now.
        total: connections it has been given since haproxy started (a reused
            spare slot keeps counting).
    """

    name: str
    host: str
    port: int
    status: str
    sessions: int
    total: int

    @property
    def up(self) -> bool:
        """In the rotation: ``UP``, or ``UP x/y`` while checks are failing."""
        return self.status == "UP" or self.status.startswith("UP ")


def find_haproxy(executable: str | os.PathLike[str] | None = None) -> str:
    """The path of the ``haproxy`` binary.

    Args:
        executable: a path or name to use instead of searching.

    Returns:
        ``executable`` if given and present, else ``haproxy`` from PATH, else from
        ``/usr/sbin``, ``/usr/local/sbin`` or ``/sbin`` (often not on a user's PATH).

    Raises:
        HAProxyNotFound: nothing executable was found.
    """
    if executable is not None:
        found = shutil.which(os.fspath(executable))
        where = f"{os.fspath(executable)!r}"
    else:
        found = shutil.which("haproxy") or shutil.which(
            "haproxy", path=os.pathsep.join(_SEARCH_PATH)
        )
        where = f"PATH or {', '.join(_SEARCH_PATH)}"
    if found is None:
        raise HAProxyNotFound(
            f"no haproxy executable in {where}; install it with `apt-get install haproxy`"
        )
    return found


def render_config(
    backends: Sequence[tuple[str, int]],
    *,
    listen_fd: int,
    admin_socket: Path,
    spare: int = 4,
    mode: Literal["tcp", "http"] = "tcp",
    health_path: str | None = "/healthz",
    check_interval: float = 0.2,
) -> str:
    """The haproxy configuration :func:`open_haproxy` runs.

    Args:
        backends: ``(ipv4, port)`` of the servers ``s0``, ``s1``… in order.
        listen_fd: the inherited, bound socket the front end listens on.
        admin_socket: where the admin (runtime API) unix socket goes.
        spare: disabled servers declared after them, for
            :meth:`HAProxy.add_backend`.
        mode: ``tcp`` (one pick per connection) or ``http`` (one pick per
            request; a websocket upgrade keeps its server).
        health_path: the path of the HTTP health check; None checks by TCP connect.
        check_interval: seconds between two health checks of a server.

    Returns:
        The configuration text.

    Raises:
        ValueError: a backend that is not an IPv4 address with a port in 1..65535,
            one given twice, a bad ``health_path``, a negative ``spare`` or a non-positive interval.
    """
    for host, port in backends:
        _check_address(host, port)
    if len(set(map(tuple, backends))) != len(backends):
        raise ValueError(f"backends: each address at most once, got {list(backends)}")
    if spare < 0:
        raise ValueError(f"spare: expected a count >= 0, got {spare}")
    if not check_interval > 0:
        raise ValueError(f"check_interval: expected seconds > 0, got {check_interval}")
    if health_path is not None and not _PATH.fullmatch(health_path):
        raise ValueError(f"health_path: expected a path such as '/healthz', got {health_path!r}")
    inter = max(1, round(check_interval * 1000))
    lines = [
        "global",
        "    log stderr format raw local0 info",
        f"    stats socket {admin_socket} mode 600 level admin",
        "    nbthread 1",
        "",
        "defaults",
        f"    mode {mode}",
        "    log global",
        f"    option {'httplog' if mode == 'http' else 'tcplog'}",
        "    retries 1",
        "    timeout connect 2s",
        "    timeout client 1h",
        "    timeout server 1h",
        "    timeout tunnel 1h",
        "    timeout client-fin 5s",
        "    timeout server-fin 5s",
        "    timeout check 2s",
    ]
    if mode == "http":
        lines += [
            "    timeout http-request 10s",
            "    timeout http-keep-alive 10s",
            "    option forwardfor",
        ]
    lines += [
        "",
        "frontend fe",
        f"    bind fd@{listen_fd}",
        f"    default_backend {_BACKEND}",
        "",
        f"backend {_BACKEND}",
        "    balance roundrobin",
    ]
    if health_path is not None:
        lines += [
            "    option httpchk",
            f"    http-check send meth GET uri {health_path} ver HTTP/1.1 hdr Host localhost",
            "    http-check expect status 200",
        ]
    lines.append(f"    default-server check inter {inter}ms fastinter {inter}ms fall 2 rise 1")
    for index, (host, port) in enumerate(backends):
        lines.append(f"    server s{index} {host}:{port}")
    for index in range(len(backends), len(backends) + spare):
        # A placeholder address: a disabled server is never dialled or checked.
        lines.append(f"    server s{index} 127.0.0.1:1 disabled")
    return "\n".join(lines) + "\n"


class HAProxy:
    """A running haproxy (see :func:`open_haproxy`).

    Attributes:
        host, port: where it listens.
        address: ``"host:port"``, the one address a client is configured with.
        workdir: the folder holding ``haproxy.cfg`` and ``haproxy.log``.
        config_path, log_path: those two files.
        process: the haproxy master process.
    """

    def __init__(
        self,
        *,
        process: trio.Process,
        host: str,
        port: int,
        workdir: Path,
        admin_socket: Path,
        slots: list[tuple[str, int] | None],
        stop_within: float,
    ) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self.workdir = workdir
        self.config_path = workdir / "haproxy.cfg"
        self.log_path = workdir / "haproxy.log"
        self._admin_socket = admin_socket
        self._slots = slots
        self._stop_within = stop_within
        self._closed = False

    @property
    def url(self) -> str:
        """The ``ws://`` address of ``/broker`` behind the balancer."""
        return f"ws://{self.address}/broker"

    @property
    def http_url(self) -> str:
        """The ``http://`` address behind the balancer (``/healthz``, inspection)."""
        return f"http://{self.address}"

    def log_text(self) -> str:
        """What haproxy has written to its log so far (for a failing test's report)."""
        return _read_log(self.log_path)

    async def command(self, line: str) -> str:
        """Send one command to haproxy's runtime API and return its answer.

        Args:
            line: the command, e.g. ``"show servers state"``.

        Returns:
            haproxy's answer as text ("" or a newline for most successful ``set``
            commands).

        Raises:
            ValueError: the line holds a newline or ``;`` (that would be several
                commands).
            trio.TooSlowError: haproxy did not answer within 30 s.
            OSError: the admin socket is gone (haproxy stopped).
        """
        if _unsafe(line):
            raise ValueError(f"one runtime command without newline or ';', got {line!r}")
        return await _ask(self._admin_socket, line)

    async def add_backend(self, host: str, port: int) -> str:
        """Put one more server into the rotation, at once.

        It takes the first free spare slot, points it at ``host:port``, marks it
        healthy and ready; its health checks then keep it (or take it out).

        Args:
            host: an IPv4 address.
            port: its port.

        Returns:
            The server's name in backend ``bk`` (``s3``, say).

        Raises:
            ValueError: not an IPv4 address and port, or already a backend.
            HAProxyError: no spare slot is left (see ``open_haproxy(spare=...)``), or
                haproxy refused a command.
        """
        _check_address(host, port)
        if (host, port) in self._slots:
            raise ValueError(f"{host}:{port} is already a backend of this haproxy")
        try:
            index = self._slots.index(None)
        except ValueError:
            raise HAProxyError(
                f"no spare server slot left for {host}:{port}: "
                f"all {len(self._slots)} are in use; open_haproxy(spare=...) declares more"
            ) from None
        self._slots[index] = (host, port)  # taken before awaiting: concurrent adds differ
        server = f"{_BACKEND}/s{index}"
        try:
            await self._expect(
                f"set server {server} addr {host} port {port}", "by 'stats socket command'"
            )
            await self._expect(f"set server {server} health up")
            await self._expect(f"set server {server} state ready")
        except BaseException:
            self._slots[index] = None
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self.command(f"set server {server} state maint")
            raise
        return f"s{index}"

    async def remove_backend(self, host: str, port: int, *, kill_connections: bool = False) -> None:
        """Take a server out of the rotation and free its slot for a later add.

        New connections no longer reach it from the moment this returns.

        Args:
            host, port: the server, as it was given.
            kill_connections: also close the connections it holds now; by default
                they stay open, as on a balancer taken through maintenance.

        Raises:
            KeyError: it is not a backend of this haproxy.
            HAProxyError: haproxy refused a command.
        """
        await self.disable_backend(host, port, kill_connections=kill_connections)
        self._slots[self._index(host, port)] = None

    async def disable_backend(
        self, host: str, port: int, *, kill_connections: bool = False
    ) -> None:
        """Put a server in maintenance: no new connections, slot kept.

        Args:
            host, port: the server.
            kill_connections: also close the connections it holds now.

        Raises:
            KeyError: it is not a backend of this haproxy.
            HAProxyError: haproxy refused a command.
        """
        server = f"{_BACKEND}/s{self._index(host, port)}"
        await self._expect(f"set server {server} state maint")
        if kill_connections:
            await self._expect(f"shutdown sessions server {server}")

    async def enable_backend(self, host: str, port: int) -> None:
        """Bring a disabled server back into the rotation, marked healthy.

        Raises:
            KeyError: it is not a backend of this haproxy.
            HAProxyError: haproxy refused a command.
        """
        server = f"{_BACKEND}/s{self._index(host, port)}"
        await self._expect(f"set server {server} health up")
        await self._expect(f"set server {server} state ready")

    async def backends(self) -> tuple[BackendState, ...]:
        """The servers in use (initial and added, not removed), as haproxy sees them.

        Returns:
            One :class:`BackendState` per server, in slot order.

        Raises:
            HAProxyError: the statistics could not be read.
        """
        text = await self.command(f"show stat {_BACKEND} 4 -1")
        lines = text.strip().splitlines()
        if not lines or not lines[0].startswith("# "):
            raise HAProxyError(f"unexpected answer to 'show stat': {text!r}")
        header = lines[0][2:].split(",")
        rows: dict[str, dict[str, str]] = {}
        for line in lines[1:]:
            fields = dict(zip(header, line.split(","), strict=False))
            rows[fields["svname"]] = fields
        states = []
        for index, slot in enumerate(self._slots):
            if slot is None:
                continue
            row = rows.get(f"s{index}")
            if row is None:
                raise HAProxyError(f"'show stat' has no server s{index}: {text!r}")
            states.append(
                BackendState(
                    name=f"s{index}",
                    host=slot[0],
                    port=slot[1],
                    status=row["status"],
                    sessions=int(row["scur"] or 0),
                    total=int(row["stot"] or 0),
                )
            )
        return tuple(states)

    async def aclose(self) -> None:
        """Stop haproxy: SIGTERM, then SIGKILL to its process group after ``stop_within``.

        Safe to call more than once; shielded from cancellation (bounded anyway).
        """
        if self._closed:
            return
        self._closed = True
        await _stop(self.process, self._stop_within)

    def _index(self, host: str, port: int) -> int:
        try:
            return self._slots.index((host, port))
        except ValueError:
            raise KeyError(f"{host}:{port} is not a backend of this haproxy") from None

    async def _expect(self, line: str, success: str = "") -> None:
        """Run a command whose answer is empty on success (or contains ``success``)."""
        answer = (await self.command(line)).strip()
        if (success and success not in answer) or (not success and answer):
            raise HAProxyError(f"haproxy refused {line!r}: {answer!r}")


@asynccontextmanager
async def open_haproxy(
    backends: Sequence[tuple[str, int]],
    *,
    spare: int = 4,
    workdir: Path | None = None,
    host: str = "127.0.0.1",
    mode: Literal["tcp", "http"] = "tcp",
    health_path: str | None = "/healthz",
    check_interval: float = 0.2,
    executable: str | os.PathLike[str] | None = None,
    ready_within: float = 30.0,
    stop_within: float = 10.0,
) -> AsyncIterator[HAProxy]:
    """Run haproxy, round-robin over ``backends``, until the block ends.

    Args:
        backends: ``(ipv4, port)`` of the initial servers (may be empty).
        spare: how many more servers :meth:`HAProxy.add_backend` can add.
        workdir: where ``haproxy.cfg`` and ``haproxy.log`` go (kept afterwards);
            by default a temporary folder removed at the end.
        host: the loopback address to listen on (port chosen by the system).
        mode: ``tcp`` (one pick per TCP connection) or ``http`` (per request).
        health_path: HTTP health-check path (the daemons serve ``/healthz``);
            None checks by TCP connect only.
        check_interval: seconds between health checks of one server.
        executable: the haproxy binary; by default found by :func:`find_haproxy`.
        ready_within: seconds to wait for haproxy to report itself ready.
        stop_within: at the end, seconds to wait after SIGTERM before SIGKILL.

    Yields:
        The running :class:`HAProxy`. It is stopped when the block ends.

    Raises:
        HAProxyNotFound: no haproxy binary (``apt-get install haproxy``).
        HAProxyError: haproxy exited during start-up, or did not report ready
            within ``ready_within``; the message quotes its log.
        ValueError: see :func:`render_config`.
    """
    binary = find_haproxy(executable)
    with tempfile.TemporaryDirectory(prefix="trio-broker-haproxy-") as tmp:
        # Unix socket paths are limited to ~100 bytes: they live in the short
        # temporary folder even when the caller's workdir is long.
        sockets = Path(tmp)
        folder = Path(workdir) if workdir is not None else sockets
        admin_socket = sockets / "admin.sock"
        master_socket = sockets / "master.sock"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind((host, 0))
            listener.listen(1024)
            port = listener.getsockname()[1]
            config = render_config(
                backends,
                listen_fd=listener.fileno(),
                admin_socket=admin_socket,
                spare=spare,
                mode=mode,
                health_path=health_path,
                check_interval=check_interval,
            )
            log_path = _write_files(folder, config)
            notify = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            with notify:
                await notify.bind(os.fspath(sockets / "notify.sock"))
                with log_path.open("ab") as log:
                    process = await trio.lowlevel.open_process(
                        [
                            binary,
                            "-Ws",
                            "-S",
                            os.fspath(master_socket),
                            "-f",
                            os.fspath(folder / "haproxy.cfg"),
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        pass_fds=(listener.fileno(),),
                        start_new_session=True,
                        env={**os.environ, "NOTIFY_SOCKET": os.fspath(sockets / "notify.sock")},
                    )
                proxy = HAProxy(
                    process=process,
                    host=host,
                    port=port,
                    workdir=folder,
                    admin_socket=admin_socket,
                    slots=[*((h, p) for h, p in backends), *([None] * spare)],
                    stop_within=stop_within,
                )
                try:
                    with trio.move_on_after(ready_within) as waiting:
                        await _wait_ready(notify, process, log_path)
                        # The master's CLI answers from its event loop, which it
                        # enters after READY=1 and after installing its SIGTERM
                        # handler: from here a SIGTERM stops it in order.
                        await _ask(master_socket, "show proc")
                    if waiting.cancelled_caught:
                        raise HAProxyError(
                            f"haproxy did not report ready within {ready_within} s (readiness "
                            "needs a build with systemd support: +SYSTEMD in `haproxy -vv`); "
                            "its log:\n" + _read_log(log_path)
                        )
                except BaseException:
                    await proxy.aclose()
                    raise
        # haproxy holds its own copy of the listening socket; ours is closed.
        try:
            yield proxy
        finally:
            await proxy.aclose()


async def _wait_ready(notify: trio.socket.SocketType, process: trio.Process, log: Path) -> None:
    """Return on haproxy's ``READY=1``; raise if it exits first."""
    exited: list[int] = []
    async with trio.open_nursery() as nursery:

        async def ready() -> None:
            while b"READY=1" not in await notify.recv(4096):
                pass
            nursery.cancel_scope.cancel()

        async def watch() -> None:
            exited.append(await process.wait())
            nursery.cancel_scope.cancel()

        nursery.start_soon(ready)
        nursery.start_soon(watch)
    if exited:
        raise HAProxyError(
            f"haproxy exited with status {exited[0]} during start-up; its log:\n" + _read_log(log)
        )


async def _ask(path: Path, line: str) -> str:
    """One command on an haproxy CLI socket, answered until haproxy closes it."""
    with trio.fail_after(_COMMAND_WITHIN):
        stream = await trio.open_unix_socket(os.fspath(path))
        async with stream:
            await stream.send_all(line.encode() + b"\n")
            await stream.send_eof()
            chunks = []
            while chunk := await stream.receive_some():
                chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


async def _stop(process: trio.Process, stop_within: float) -> None:
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(stop_within):
                await process.wait()
        if process.returncode is None:
            # The group is still ours: the master is not reaped yet.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


def _write_files(folder: Path, config: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "haproxy.cfg").write_text(config)
    log = folder / "haproxy.log"
    log.write_bytes(b"")
    return log


def _read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _check_address(host: str, port: int) -> None:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"backend host: expected an IPv4 address, got {host!r}") from None
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"backend port: expected an int in 1..65535, got {port!r}")


def _unsafe(text: str) -> bool:
    return any(c in text for c in "\n\r;")
