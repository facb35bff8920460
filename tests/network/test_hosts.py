"""The test hosts and their faults (:mod:`tests.support.netns`), on real namespaces.

Each test makes its own small network (two hosts on a switch), runs real TCP
through it, and checks that the root namespace is left as it was.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests.support import netns
from tests.support.netns import SUBNET, Network, open_network, require_namespaces, until

WAIT = 30.0
ROOT = Path(__file__).resolve().parents[2]
IP = netns.tool("ip") or "ip"


def root_state() -> tuple[str, str, str]:
    """The root namespace's interfaces, addresses and routes, as ``ip`` lists them."""

    def ip(*args: str) -> str:
        return subprocess.run([IP, "-o", *args], capture_output=True, text=True, check=True).stdout

    links = "\n".join(line.split(":")[1] for line in ip("link", "show").splitlines())
    return links, ip("addr", "show"), ip("route", "show", "table", "all")


def namespaces() -> set[str]:
    """The names ``ip netns list`` shows."""
    listing = subprocess.run([IP, "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.strip()}


def process_state(pid: int) -> str | None:
    """A process's state letter from ``/proc`` (``Z``: a zombie), ``None`` once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rpartition(")")[2].split()[0]


@pytest.fixture
def pair() -> Iterator[Network]:
    """Two test hosts, ``a`` and ``b``."""
    require_namespaces()
    with open_network("a", "b") as net:
        yield net


async def retransmits(stream: trio.SocketStream) -> int:
    """Segments this socket sent again (``tcpi_total_retrans`` of ``TCP_INFO``)."""
    info = stream.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    total: int = struct.unpack_from("I", info, 100)[0]
    await trio.lowlevel.checkpoint()
    return total


async def echo(listener: trio.SocketListener) -> None:
    """Echo each connection's bytes back until it half-closes, then close."""
    async with listener:
        stream = await listener.accept()
        async with stream:
            while data := await stream.receive_some(65536):
                await stream.send_all(data)


async def exchange(stream: trio.SocketStream, data: bytes) -> bytes:
    """Send ``data``, half-close, and return everything that comes back until EOF."""
    received = bytearray()

    async def send() -> None:
        await stream.send_all(data)
        await stream.send_eof()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        while chunk := await stream.receive_some(65536):
            received += chunk
    return bytes(received)


async def test_hosts_have_their_own_addresses_and_the_root_namespace_is_untouched() -> None:
    """Each host holds one address of the test subnet; root keeps its links, addresses, routes."""
    require_namespaces()
    before = root_state()
    with open_network("a", "b") as net:
        for host in net.hosts.values():
            result = await trio.run_process(
                [*host.prefix, IP, "-o", "-4", "addr", "show", "scope", "global"],
                capture_stdout=True,
            )
            assert [line.split()[3] for line in result.stdout.decode().splitlines()] == [
                f"{host.address}/{SUBNET.prefixlen}"
            ]
            assert host.netns.startswith(f"tb{os.getpid()}-")
        assert root_state() == before
    assert root_state() == before


async def test_a_failing_block_still_removes_namespaces_and_their_processes() -> None:
    """An exception inside the block kills what runs on the hosts and deletes every namespace."""
    require_namespaces()
    before = root_state()
    names: set[str] = set()
    processes: list[trio.Process] = []

    async def failing() -> None:
        with open_network("a", "b") as net:
            names.update({net.switch, *(h.netns for h in net.hosts.values())})
            assert names <= namespaces()
            processes.append(
                await trio.lowlevel.open_process(
                    [*net["a"].prefix, sys.executable, "-c", "import time; time.sleep(600)"]
                )
            )
            raise RuntimeError("the test failed here")

    with pytest.raises(RuntimeError, match="the test failed here"):
        await failing()
    (process,) = processes
    with trio.fail_after(WAIT):
        assert await process.wait() == -9
    assert not names & namespaces()
    assert root_state() == before


async def test_a_cancelled_block_still_removes_its_namespaces() -> None:
    """A cancellation inside the block deletes the namespaces too."""
    require_namespaces()
    names: set[str] = set()
    with trio.CancelScope() as scope, open_network("a") as net:
        names = {net.switch, net["a"].netns}
        scope.cancel()
        await trio.sleep_forever()
    assert scope.cancelled_caught
    assert names
    assert not names & namespaces()


# A test process that makes a network, starts a process on a host and says so.
KILLED = """
import subprocess, sys
sys.path.insert(0, sys.argv[1])
from tests.support.netns import open_network
with open_network("a") as net:
    command = [*net["a"].prefix, "sh", "-c", "echo in; exec sleep 600"]
    subprocess.Popen(command, stdout=subprocess.PIPE).stdout.readline()  # it is on the host
    print(net.switch, net["a"].netns, flush=True)
    sys.stdin.read()
"""


async def test_leftovers_of_a_killed_test_process_are_swept() -> None:
    """The namespaces and processes of a test process killed with SIGKILL go at the next start."""
    require_namespaces()
    async with trio.open_nursery() as nursery:
        killed: trio.Process = await nursery.start(
            functools.partial(
                trio.run_process,
                [sys.executable, "-c", KILLED, str(ROOT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                check=False,
            )
        )
        assert killed.stdout is not None
        said = b""
        with trio.fail_after(WAIT):
            while not said.endswith(b"\n"):
                said += await killed.stdout.receive_some(1000)
        names = said.decode().split()
        assert len(names) == 2
        listed = await trio.run_process([IP, "netns", "pids", names[1]], capture_stdout=True)
        sleeper = listed.stdout.split()
        assert len(sleeper) == 1
        killed.kill()
    assert killed.returncode == -signal.SIGKILL
    assert set(names) <= namespaces()  # nothing cleaned up after a SIGKILL
    assert set(names) <= set(netns.sweep_leftovers())
    assert not set(names) & namespaces()
    assert process_state(int(sleeper[0])) in (None, "Z")  # killed (maybe not reaped yet)


async def test_a_partition_drops_silently_and_healing_delivers_what_was_sent(
    pair: Network,
) -> None:
    """Across a partition nothing arrives and no reset either; after the heal TCP delivers."""
    a, b = pair["a"], pair["b"]
    listener = await b.listen()
    port = listener.socket.getsockname()[1]
    async with listener:
        with trio.fail_after(WAIT):
            client = await a.connect(b.address, port)
            server = await listener.accept()
        async with client, server:
            with trio.fail_after(WAIT):
                await client.send_all(b"before\n")
                assert await server.receive_some(100) == b"before\n"
            pair.partition("a", "b")
            with trio.fail_after(WAIT):
                await client.send_all(b"during\n")
                # sent, lost, sent again, lost again (the kernel tells no event for it)
                await until(lambda: retransmits(client), lambda count: count >= 2)
            assert pair.dropped()[0] >= 2
            # still established on both ends: no reset arrived anywhere
            assert client.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == 1
            assert server.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == 1
            pair.heal("a", "b")
            with trio.fail_after(WAIT):
                assert await server.receive_some(100) == b"during\n"


async def test_under_loss_a_megabyte_still_arrives_whole(pair: Network) -> None:
    """Under 10 % loss a megabyte echoes back whole, and the loss rule counted its drops."""
    a, b = pair["a"], pair["b"]
    data = random.Random(5).randbytes(1 << 20)
    listener = await b.listen()
    port = listener.socket.getsockname()[1]
    pair.set_loss(10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo, listener)
        with trio.fail_after(WAIT):
            stream = await a.connect(b.address, port)
            async with stream:
                back = await exchange(stream, data)
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
    assert pair.dropped()[1] > 0
    with pytest.raises(ValueError, match="percent"):
        pair.set_loss(101)


async def test_the_relay_delays_both_ways_and_keeps_every_byte(pair: Network) -> None:
    """Through the delay, a round trip takes at least twice the delay and every byte arrives."""
    a, b = pair["a"], pair["b"]
    delay = 0.2
    data = random.Random(6).randbytes(3 << 20)
    listener = await b.listen()
    port = listener.socket.getsockname()[1]
    async with trio.open_nursery() as nursery, pair.delay("a", "b", port, delay) as relay:
        nursery.start_soon(echo, listener)
        with trio.fail_after(WAIT):
            stream = await a.connect(b.address, port)
        async with stream:
            # the dialler still sees the real peer
            assert stream.socket.getpeername() == (b.address, port)
            started = trio.current_time()
            with trio.fail_after(WAIT):
                await stream.send_all(b"x")
                assert await stream.receive_some(1) == b"x"
            assert trio.current_time() - started >= 2 * delay
            with trio.fail_after(WAIT):
                back = await exchange(stream, data)
        assert back == data
        assert relay.connections == 1
        assert relay.bytes_up == relay.bytes_down == len(data) + 1
