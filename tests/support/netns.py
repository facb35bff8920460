"""Test hosts in network namespaces, and the faults of the network between them.

Loopback never loses a packet; a network of namespaces can. :func:`open_network`
makes one namespace per test host, each with one interface (``eth0``) plugged into
a bridge that lives in a namespace of its own (the "switch"), so nothing at all
is added to the root namespace: no interface, address or route. Addresses come
from :data:`SUBNET` and exist only inside those namespaces; since every host is
a namespace of its own, every host can also use fixed ports.

Faults, all inside the namespaces:

- :meth:`Network.partition` / :meth:`Network.heal`: an nftables drop rule on the
  switch between two hosts. Packets vanish: no RST, no ICMP, so only the
  protocol's own liveness can tell.
- :meth:`Network.set_loss`: ``numgen random mod 100 < N drop`` on the switch.
- :meth:`Network.block`: an nftables rule in the *output* hook of one host's
  namespace, for its packets to one host and port: the cut of one direction of
  one service, while the connections the other host opens towards it keep
  working. ``drop`` loses the packets silently (a ``connect`` waits for its
  timeout); ``reset`` answers each with a TCP reset, so a ``connect`` is
  refused at once (a firewall that rejects, a service that is not there).
- :meth:`Network.delay`: the kernel here has no ``netem``, so a delaying TCP
  relay of this test process sits on the path. An nftables ``redirect`` in the
  dialling host's namespace sends its new connections to one host and port into
  a relay listening on that namespace's loopback, which dials the real target
  (its own packets are marked so that the rule lets them through) and forwards
  each chunk ``delay`` seconds after it arrived, both ways, through bounded
  buffers. The dialling process still sees the real peer address on its socket.
- :meth:`Host.forward`: the test's own way in. A listener on ``127.0.0.1`` of
  the test process forwards to a host's address from inside that host's
  namespace, so the test's HTTP requests never cross the switch and no fault
  touches them.

A socket belongs to the namespace it was created in; this process creates its
relay sockets in a namespace by switching its own thread into it (``setns``)
for that one system call and back. Processes run in a namespace with
``ip netns exec`` (:attr:`Host.prefix`).

Cleanup is unconditional: when the block ends, however it ends, every process
still in a namespace is killed and every namespace deleted, which removes the
bridge, the veth pairs and the nftables tables with them. Names carry this
process's id (``tb<pid>-<n>-<host>``), so runs side by side never collide, and
leftovers of a test process that died without cleaning up are swept at the
next start.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Final, Literal, TypeVar

import attrs
import pytest
import trio

T = TypeVar("T")

__all__ = [
    "SUBNET",
    "Host",
    "Network",
    "NetworkUnavailable",
    "open_network",
    "require_namespaces",
    "serve_relay",
    "sweep_leftovers",
    "tool",
    "until",
]

SUBNET: Final = ipaddress.ip_network("10.213.0.0/24")
"""Addresses of the test hosts; they exist only inside the test namespaces."""

RELAY_MARK: Final = 0x7462
"""Packet mark of the delay relay's own connections (the redirect skips them)."""

CHUNK: Final = 65536
"""Largest read of a relay."""

RELAY_BUFFER_CHUNKS: Final = 32
"""Chunks one direction of a relay holds at most (bounded memory, backpressure)."""

_CLONE_NEWNET: Final = 0x40000000
_NETNS_RUN: Final = Path("/run/netns")
_NETNS_ETC: Final = Path("/etc/netns")
_PREFIX: Final = "tb"
_OWN_NAME: Final = re.compile(rf"{_PREFIX}(\d+)-\d+-[a-z0-9-]+")
_counter = itertools.count(1)
_libc = ctypes.CDLL(None, use_errno=True)


class NetworkUnavailable(Exception):
    """Namespaces cannot be made here (not root, no ``ip`` or ``nft``)."""


def tool(name: str) -> str | None:
    """The path of a program, searched on ``PATH`` and in the sbin folders (``ip``, ``nft``)."""
    return shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin")


@functools.cache
def _missing() -> str | None:
    """Why namespaces cannot be made here, or ``None`` when they can (asked once)."""
    if os.geteuid() != 0:
        return "not running as root (namespaces and nftables rules need it)"
    if tool("ip") is None or tool("nft") is None:
        script = Path(__file__).resolve().parents[2] / "scripts" / "system-packages"
        result = subprocess.run(
            [str(script), "iproute2", "nftables"], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            lines = (result.stderr or result.stdout).strip().splitlines()
            return lines[-1] if lines else "ip and nft are missing"
    if tool("ip") is None or tool("nft") is None:
        return "ip (iproute2) or nft (nftables) is missing"
    probe = f"{_PREFIX}{os.getpid()}-0-probe"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "netns", "exec", probe, _nft(), "add", "table", "bridge", "probe"])
    except RuntimeError as exc:
        return f"cannot make a namespace with a bridge table here: {exc}"
    finally:
        with contextlib.suppress(RuntimeError):
            _run(["ip", "netns", "del", probe])
    return None


def require_namespaces() -> None:
    """Skip the calling test, with one line saying why, where namespaces cannot be made."""
    reason = _missing()
    if reason is not None:
        pytest.skip(f"no test hosts in network namespaces: {reason}")


def _nft() -> str:
    """``nft`` by its path: ``ip netns exec`` searches only ``PATH``."""
    return tool("nft") or "nft"


def _run(argv: Sequence[str], *, stdin: str | None = None) -> str:
    """Run one ``ip``/``nft`` command; its stdout, or an error naming it and its stderr."""
    program = tool(argv[0]) or argv[0]
    result = subprocess.run(
        [program, *argv[1:]], input=stdin, capture_output=True, text=True, timeout=30, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setns: {os.strerror(code)}")


@contextlib.contextmanager
def _inside(netns: str | None) -> Iterator[None]:
    """Switch this thread into a namespace (``None``: stay) for the sockets made inside.

    Keep the block synchronous: it must not let other tasks run in between.
    """
    if netns is None:
        yield
        return
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(_NETNS_RUN / netns, os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)  # if this fails the thread is unusable: let it raise
    finally:
        os.close(own)


def _socket_in(netns: str | None) -> trio.socket.SocketType:
    with _inside(netns):
        return trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)


async def _listener_in(netns: str | None, host: str, port: int = 0) -> trio.SocketListener:
    sock = _socket_in(netns)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await sock.bind((host, port))
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


async def _dial_in(
    netns: str | None, host: str, port: int, *, mark: int | None
) -> trio.SocketStream:
    sock = _socket_in(netns)
    try:
        if mark is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


# -- the relay ---------------------------------------------------------------------------------


@attrs.define
class RelayStatistics:
    """What one relay carried.

    Attributes:
        connections: connections accepted.
        failed_dials: accepted connections whose target could not be reached.
        bytes_up: bytes from the dialling side to the target.
        bytes_down: bytes from the target back.
    """

    connections: int = 0
    failed_dials: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


async def _pump(
    source: trio.SocketStream,
    sink: trio.SocketStream,
    delay: float,
    stats: RelayStatistics,
    field: str,
) -> None:
    """Copy one direction, each chunk ``delay`` seconds after it was read; EOF is passed on."""
    send, receive = trio.open_memory_channel[tuple[float, bytes]](RELAY_BUFFER_CHUNKS)

    async def read() -> None:
        async with send:
            while chunk := await source.receive_some(CHUNK):
                await send.send((trio.current_time() + delay, chunk))

    async def write() -> None:
        async with receive:
            async for due, chunk in receive:
                await trio.sleep_until(due)
                await sink.send_all(chunk)
                setattr(stats, field, getattr(stats, field) + len(chunk))
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await sink.send_eof()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        nursery.start_soon(write)


async def _relay_one(
    accepted: trio.SocketStream,
    target_netns: str | None,
    target: tuple[str, int],
    delay: float,
    mark: int | None,
    stats: RelayStatistics,
) -> None:
    async with accepted:
        try:
            outgoing = await _dial_in(target_netns, *target, mark=mark)
        except OSError:
            stats.failed_dials += 1
            return
        async with outgoing:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_pump, accepted, outgoing, delay, stats, "bytes_up")
                    nursery.start_soon(_pump, outgoing, accepted, delay, stats, "bytes_down")
            except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # one side reset: both are closed on the way out


async def serve_relay(
    listener: trio.SocketListener,
    target_netns: str | None,
    target: tuple[str, int],
    *,
    delay: float = 0.0,
    mark: int | None = None,
    task_status: trio.TaskStatus[RelayStatistics] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Forward every connection of ``listener`` to ``target``, ``delay`` seconds each way.

    Args:
        listener: where the connections arrive (it is closed at the end).
        target_netns: the namespace the outgoing connections are made in
            (``None``: this process's own).
        target: ``(address, port)`` to dial for each accepted connection.
        delay: seconds added to each direction; chunks keep their order and each
            direction buffers at most :data:`RELAY_BUFFER_CHUNKS` chunks.
        mark: ``SO_MARK`` of the outgoing sockets (``None``: unmarked).
        task_status: started with the relay's live :class:`RelayStatistics`.
    """
    stats = RelayStatistics()
    async with listener, trio.open_nursery() as nursery:
        task_status.started(stats)
        while True:
            accepted = await listener.accept()
            stats.connections += 1
            nursery.start_soon(_relay_one, accepted, target_netns, target, delay, mark, stats)


async def until(
    fetch: Callable[[], Awaitable[T]], done: Callable[[T], bool], *, interval: float = 0.05
) -> T:
    """Call ``fetch()`` every ``interval`` seconds until ``done`` holds of its value.

    For states that offer no event to wait on (an inspection document, a kernel
    counter); the caller bounds it with ``trio.fail_after``.

    Returns:
        The first value for which ``done`` held.
    """
    while True:
        value = await fetch()
        if done(value):
            return value
        await trio.sleep(interval)


# -- hosts and the network ---------------------------------------------------------------------


@attrs.frozen
class Host:
    """One test host: a network namespace with one address on the test network.

    Attributes:
        name: the host's role in the test (``fylr``, ``exec-a``).
        netns: the namespace's name (unique to this test process).
        address: its IPv4 address on :data:`SUBNET`.
    """

    name: str
    netns: str
    address: str

    @property
    def prefix(self) -> tuple[str, ...]:
        """The argv prefix that runs a command on this host."""
        return (tool("ip") or "ip", "netns", "exec", self.netns)

    async def listen(self, port: int = 0, *, address: str | None = None) -> trio.SocketListener:
        """A TCP listener in this host's namespace (on its own address by default)."""
        return await _listener_in(self.netns, address or self.address, port)

    async def connect(self, address: str, port: int) -> trio.SocketStream:
        """A TCP connection made from this host."""
        return await _dial_in(self.netns, address, port, mark=None)

    async def udp(self, address: str, port: int) -> trio.socket.SocketType:
        """A UDP socket bound to ``address:port`` in this host's namespace (a DNS server's)."""
        with _inside(self.netns):
            sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            await sock.bind((address, port))
        except BaseException:
            sock.close()
            raise
        return sock

    @contextlib.contextmanager
    def resolv_conf(self, text: str) -> Iterator[Path]:
        """Give the processes run on this host (:attr:`prefix`) their own ``/etc/resolv.conf``.

        ``ip netns exec`` mounts ``/etc/netns/<namespace>/resolv.conf`` over
        ``/etc/resolv.conf`` for the command it runs; the file and its folder
        are removed when the block ends. Nothing outside the namespace sees it.
        """
        folder = _NETNS_ETC / self.netns
        folder.mkdir(parents=True, exist_ok=False)
        path = folder / "resolv.conf"
        try:
            path.write_text(text, encoding="utf-8")
            yield path
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def pids(self) -> list[int]:
        """The processes that run in this host's namespace."""
        return [int(pid) for pid in _run(["ip", "netns", "pids", self.netns]).split()]

    @contextlib.asynccontextmanager
    async def forward(self, port: int) -> AsyncIterator[str]:
        """Reach ``address:port`` of this host from the test process, around every fault.

        Yields:
            ``http://127.0.0.1:<port>``: a listener of the test process whose
            connections are made again from inside this host's namespace to its
            own address (they never cross the switch).
        """
        listener = await _listener_in(None, "127.0.0.1")
        local_port = listener.socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_relay, listener, self.netns, (self.address, port))
            try:
                yield f"http://127.0.0.1:{local_port}"
            finally:
                nursery.cancel_scope.cancel()


@attrs.define
class Network:
    """The hosts of one test and the faults between them (see the module docstring)."""

    switch: str
    hosts: dict[str, Host]
    _partitions: set[tuple[frozenset[str], int | None]] = attrs.field(factory=set)
    _loss: int = 0
    _delays: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _switch_rules(self) -> None:
        """Write the switch's fault chains again from the current partitions and loss."""
        lines = ["flush chain bridge tbfault partition", "flush chain bridge tbfault loss"]
        for pair, port in sorted((sorted(p), port or 0) for p, port in self._partitions):
            a, b = (self.hosts[n].address for n in pair)
            ports = [f"tcp dport {port}", f"tcp sport {port}"] if port else [""]
            for source, target in ((a, b), (b, a)):
                for match in ports:
                    lines.append(
                        f"add rule bridge tbfault partition ip saddr {source} ip daddr {target}"
                        f" {match} counter name partitioned drop"
                    )
        if self._loss:
            lines.append(
                f"add rule bridge tbfault loss numgen random mod 100 < {self._loss}"
                " counter name lost drop"
            )
        _run(["ip", "netns", "exec", self.switch, _nft(), "-f", "-"], stdin="\n".join(lines) + "\n")

    def partition(self, a: str, b: str, *, port: int | None = None) -> None:
        """Cut hosts ``a`` and ``b`` apart silently: every packet between them is dropped.

        Open connections stay open at both ends; no reset or ICMP error reaches either.

        Args:
            a, b: the hosts' names.
            port: cut only the TCP connections to or from this port (one service
                of either host); ``None`` cuts everything.
        """
        self._partitions.add((frozenset((a, b)), port))
        self._switch_rules()

    def heal(self, a: str, b: str, *, port: int | None = None) -> None:
        """Undo the :meth:`partition` of ``a`` and ``b`` made with the same ``port``."""
        self._partitions.discard((frozenset((a, b)), port))
        self._switch_rules()

    def block(
        self, source: str, target: str, port: int, *, how: Literal["drop", "reset"] = "drop"
    ) -> None:
        """Cut, in ``source``'s own output, every packet it sends to ``target:port``.

        Connections ``source`` opens to that port time out (``drop``) or are
        refused at once (``reset``); ``target``'s connections to ``source`` are
        untouched. Undone by :meth:`unblock`.
        """
        verdict = "drop" if how == "drop" else "reject with tcp reset"
        host, peer = self.hosts[source], self.hosts[target]
        table = f"tbblock_{port}_{peer.address.replace('.', '_')}"
        _run(
            ["ip", "netns", "exec", host.netns, _nft(), "-f", "-"],
            stdin=f"""table ip {table} {{
  counter blocked {{ }}
  chain output {{
    type filter hook output priority 0; policy accept;
    ip daddr {peer.address} tcp dport {port} counter name blocked {verdict}
  }}
}}
""",
        )

    def unblock(self, source: str, target: str, port: int) -> int:
        """Undo :meth:`block`; returns how many packets it dropped."""
        host, peer = self.hosts[source], self.hosts[target]
        table = f"tbblock_{port}_{peer.address.replace('.', '_')}"
        nft = ["ip", "netns", "exec", host.netns, _nft()]
        listing = json.loads(_run([*nft, "-j", "list", "counter", "ip", table, "blocked"]))
        dropped = 0
        for item in listing["nftables"]:
            counter = item.get("counter")
            if counter and counter.get("name") == "blocked":
                dropped = int(counter["packets"])
        _run([*nft, "delete", "table", "ip", table])
        return dropped

    def set_loss(self, percent: int) -> None:
        """Drop ``percent`` % of all packets on the switch, at random (0 stops it)."""
        if not 0 <= percent <= 100:
            raise ValueError(f"percent must be 0..100, got {percent}")
        self._loss = percent
        self._switch_rules()

    def dropped(self) -> tuple[int, int]:
        """Packets dropped so far: ``(by partitions, by loss)``."""
        listing = _run(["ip", "netns", "exec", self.switch, _nft(), "-j", "list", "counters"])
        found = {"partitioned": 0, "lost": 0}
        for item in json.loads(listing)["nftables"]:
            counter = item.get("counter")
            if counter and counter.get("table") == "tbfault" and counter["name"] in found:
                found[counter["name"]] = int(counter["packets"])
        return found["partitioned"], found["lost"]

    @contextlib.asynccontextmanager
    async def delay(
        self, source: str, target: str, port: int, seconds: float
    ) -> AsyncIterator[RelayStatistics]:
        """Delay the connections ``source`` opens to ``target:port`` by ``seconds`` each way.

        Only connections opened inside the block are relayed; at its end the
        redirect goes first, then the relay (its connections break).

        Yields:
            The relay's live statistics.
        """
        if not 0 <= seconds < math.inf:
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        host, peer = self.hosts[source], self.hosts[target]
        table = f"tbdelay{next(self._delays)}"
        listener = await _listener_in(host.netns, "127.0.0.1")
        relay_port = listener.socket.getsockname()[1]
        nft = ["ip", "netns", "exec", host.netns, _nft(), "-f", "-"]
        async with trio.open_nursery() as nursery:
            stats: RelayStatistics = await nursery.start(
                functools.partial(
                    serve_relay,
                    listener,
                    host.netns,
                    (peer.address, port),
                    delay=seconds,
                    mark=RELAY_MARK,
                )
            )
            _run(
                nft,
                stdin=f"""table ip {table} {{
  chain output {{
    type nat hook output priority -100; policy accept;
    meta mark {RELAY_MARK:#x} accept
    ip daddr {peer.address} tcp dport {port} redirect to :{relay_port}
  }}
}}
""",
            )
            try:
                yield stats
            finally:
                with contextlib.suppress(RuntimeError):
                    _run(nft, stdin=f"delete table ip {table}\n")
                nursery.cancel_scope.cancel()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _existing() -> list[str]:
    return sorted(p.name for p in _NETNS_RUN.iterdir()) if _NETNS_RUN.is_dir() else []


def _delete_namespace(netns: str) -> None:
    """Kill whatever still runs in a namespace of ours, then delete it (and its ``/etc/netns``)."""
    shutil.rmtree(_NETNS_ETC / netns, ignore_errors=True)
    with contextlib.suppress(RuntimeError):
        for pid in _run(["ip", "netns", "pids", netns]).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    try:
        _run(["ip", "netns", "del", netns])
    except RuntimeError as exc:
        if (_NETNS_RUN / netns).exists():
            raise exc from None


def sweep_leftovers() -> list[str]:
    """Delete the namespaces of earlier test processes that died without cleaning up.

    Returns:
        The names deleted (only ``tb<pid>-…`` names whose process is gone).
    """
    swept = []
    for name in _existing():
        match = _OWN_NAME.fullmatch(name)
        if match and int(match[1]) != os.getpid() and not _alive(int(match[1])):
            _delete_namespace(name)
            swept.append(name)
    return swept


@contextlib.contextmanager
def open_network(*names: str) -> Iterator[Network]:
    """Make one test host per name on one switch; delete them all when the block ends.

    Args:
        names: the hosts' roles (lower-case letters, digits and ``-``), each made a
            namespace with ``lo`` up and ``eth0`` at the next address of :data:`SUBNET`.

    Yields:
        The :class:`Network`.

    Raises:
        NetworkUnavailable: not root, or ``ip``/``nft`` missing (see
            :func:`require_namespaces` to skip instead).
    """
    reason = _missing()
    if reason is not None:
        raise NetworkUnavailable(reason)
    if len(set(names)) != len(names) or len(names) > SUBNET.num_addresses - 3:
        raise ValueError(f"expected distinct host names, at most 250, got {names}")
    for name in names:
        if not re.fullmatch(r"[a-z0-9-]{1,20}", name):
            raise ValueError(f"expected a host name of a-z, 0-9 and '-', got {name!r}")
    sweep_leftovers()
    run = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
    switch = f"{run}-switch"
    made: list[str] = []
    try:
        _run(["ip", "netns", "add", switch])
        made.append(switch)
        _run(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", "br0", "up"])
        _run(
            ["ip", "netns", "exec", switch, _nft(), "-f", "-"],
            stdin="""table bridge tbfault {
  chain forward {
    type filter hook forward priority 0; policy accept;
    jump partition
    jump loss
  }
  chain partition {
  }
  chain loss {
  }
  counter partitioned {
  }
  counter lost {
  }
}
""",
        )
        hosts: dict[str, Host] = {}
        for index, name in enumerate(names, start=1):
            netns = f"{run}-{name}"
            address = str(SUBNET.network_address + index + 1)
            _run(["ip", "netns", "add", netns])
            made.append(netns)
            port = f"p{index}"
            _run(["ip", "-n", netns, "link", "set", "lo", "up"])
            _run(["ip", "-n", netns, "link", "add", "eth0", "type", "veth",
                  "peer", "name", port, "netns", switch])  # fmt: skip
            _run(["ip", "-n", switch, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", netns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0"])
            _run(["ip", "-n", netns, "link", "set", "eth0", "up"])
            hosts[name] = Host(name=name, netns=netns, address=address)
        yield Network(switch=switch, hosts=hosts)
    finally:
        errors = []
        for netns in reversed(made):
            try:
                _delete_namespace(netns)
            except (RuntimeError, OSError) as exc:
                errors.append(f"{netns}: {exc}")
        if errors:
            raise RuntimeError("could not delete test namespaces: " + "; ".join(errors))
