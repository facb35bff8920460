"""Faults of the network between real daemons on separate test hosts.

A fylr daemon (with the private PostgreSQL it starts in its ``state_dir``) and
two execserver daemons run as subprocesses, each in a network namespace of its
own (:mod:`tests.support.netns`): the fylr dials the execservers at their own
addresses, and the execservers call the fylr's pipes back at the fylr's address
as their hosts see it. The test reaches each daemon's HTTP API through a
forwarder that never crosses the switch, so the faults touch only the traffic
between the daemons. Services are coreutils commands (``sha256sum``, ``gzip``)
plus a ``sh`` wrapper that reports its start on a FIFO and waits for a gate
file, so a test knows which execserver runs a job and when it may end.

Waiting: file progress through ``GET /api/v1/eas/<id>?wait=S`` (the fylr wakes
the request on each change), job starts through the FIFO; states that only the
inspection documents show (connections, parked wants) are read again every
50 ms (:func:`~tests.support.netns.until`). Every wait is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gzip
import hashlib
import os
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import attrs
import httpx
import pytest
import trio
import yaml
from trio_broker_daemons.commands.upload import follow

from tests.network.conftest import HOSTS
from tests.support.netns import Host, Network, until
from tests.support.processes import open_execserver_process, open_fylr_process

FYLR_PORT = 7100
EXEC_PORT = 7000
EXECSERVERS = HOSTS[1:]
WAIT = 90.0
"""Bound of the waits that no protocol timeout bounds (startup, whole pipelines)."""
RECONNECT_WITHIN = 30.0
"""Bound for a reconnection after a heal: a dial that saw no answer gives up after
10 s (the client's dial timeout) and the back-off between dials is at most 5 s."""

GATED = 'printf "started %s\\n" "$1" >"$0"; until [ -e "$2" ]; do sleep 0.05; done; exec sha256sum'
"""Report "started <host>" on the FIFO $0, wait for the gate file $2, then hash stdin."""


def sha256_line(data: bytes) -> bytes:
    """What ``sha256sum`` prints for ``data`` on its stdin."""
    return hashlib.sha256(data).hexdigest().encode() + b"  -\n"


def text(seed: int, lines: int) -> bytes:
    """A text file that compresses well but is different for every seed."""
    return b"".join(
        b"file %d line %06d holds %x\n" % (seed, n, n * 2654435761 % 2**32) for n in range(lines)
    )


@attrs.frozen
class Ping:
    """The liveness settings both sides use in a test."""

    interval: float
    timeout: float

    def config(self) -> dict[str, str]:
        return {"ping_interval": f"{self.interval:g}s", "ping_timeout": f"{self.timeout:g}s"}


FAST_PING = Ping(interval=0.5, timeout=2.0)
"""Short liveness for the partition tests: a dead peer is found within 2 s."""


def execserver_config(host: Host, services: Mapping[str, Any], ping: Ping, slots: int) -> str:
    return yaml.safe_dump(
        {
            "listen": f"{host.address}:{EXEC_PORT}",
            "name": host.name,
            "slots": slots,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            **ping.config(),
            "services": dict(services),
        }
    )


def fylr_config(network: Network, state_dir: Path, classes: Mapping[str, Any], ping: Ping) -> str:
    return yaml.safe_dump(
        {
            "listen": f"{network['fylr'].address}:{FYLR_PORT}",
            # beyond loopback, but on the test's own network namespace: no tokens needed
            "insecure_open_api": True,
            "name": "fylr",
            "state_dir": str(state_dir),
            # no database: the fylr runs a private PostgreSQL in state_dir/pg
            "database_pool": 4,
            "execservers": [f"{network[name].address}:{EXEC_PORT}" for name in EXECSERVERS],
            "connect_timeout": "60s",
            "retry_delay": "1s",
            "counts_interval": "0s",
            "heartbeat_interval": "0.5s",
            "stale_after": "2s",
            **ping.config(),
            "classes": dict(classes),
        }
    )


@attrs.frozen
class Fleet:
    """The running daemons of one test, as the test reaches them."""

    network: Network
    fylr: httpx.AsyncClient
    execservers: Mapping[str, httpx.AsyncClient]

    async def fylr_page(self) -> dict[str, Any]:
        page: dict[str, Any] = (await self.fylr.get("/inspect/system/fylr")).json()
        return page

    async def exec_page(self, name: str) -> dict[str, Any]:
        page: dict[str, Any] = (
            await self.execservers[name].get("/inspect/system/execserver")
        ).json()
        return page

    def address(self, name: str) -> str:
        """The ``host:port`` the fylr dials for one execserver."""
        return f"{self.network[name].address}:{EXEC_PORT}"


@asynccontextmanager
async def http_client(host: Host, port: int) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for ``host``'s ``port``, reached around every fault."""
    async with host.forward(port) as url, httpx.AsyncClient(base_url=url, timeout=WAIT) as client:
        yield client


@asynccontextmanager
async def running_execservers(
    network: Network, services: Callable[[Host], Mapping[str, Any]], ping: Ping, slots: int
) -> AsyncIterator[dict[str, httpx.AsyncClient]]:
    """Both execserver daemons, each on its own host; yields an HTTP client per name."""
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for name in EXECSERVERS:
            host = network[name]
            config = execserver_config(host, services(host), ping, slots)
            await stack.enter_async_context(
                open_execserver_process(config, log_level="info", prefix=host.prefix)
            )
            clients[name] = await stack.enter_async_context(http_client(host, EXEC_PORT))
        yield clients


@asynccontextmanager
async def running_fylr(
    network: Network,
    state_dir: Path,
    classes: Mapping[str, Any],
    ping: Ping,
    execservers: Mapping[str, httpx.AsyncClient],
) -> AsyncIterator[Fleet]:
    """The fylr daemon on its host, once it is connected to both execservers."""
    host = network["fylr"]
    config = fylr_config(network, state_dir, classes, ping)
    async with (
        open_fylr_process(config, log_level="info", prefix=host.prefix),
        http_client(host, FYLR_PORT) as http,
    ):
        fleet = Fleet(network=network, fylr=http, execservers=execservers)
        backend_id = (await fleet.fylr_page())["backend_id"]
        with trio.fail_after(WAIT):
            for name in EXECSERVERS:
                await until(
                    functools.partial(fleet.exec_page, name), lambda p: bool(ours(p, backend_id))
                )
        yield fleet


def ours(page: Mapping[str, Any], backend_id: str) -> list[dict[str, Any]]:
    """The connections of an execserver's inspection document that this fylr opened."""
    return [c for c in page["connections"] if c["backend_id"] == backend_id]


def address_state(page: Mapping[str, Any], address: str) -> dict[str, Any]:
    """One configured address in the fylr's inspection document."""
    (state,) = [a for a in page["client"]["addresses"] if a["address"] == address]
    return dict(state)


async def put(http: httpx.AsyncClient, filename: str, data: bytes) -> int:
    response = await http.put("/eas/put", params={"filename": filename}, content=data)
    assert response.status_code == 201, response.text
    file_id: int = response.json()["id"]
    return file_id


async def ended(http: httpx.AsyncClient, file_id: int) -> dict[str, Any]:
    """The file's document once it is done or failed (each request waits for a change)."""
    return await follow(http, str(http.base_url), file_id, wait=10)


async def download(http: httpx.AsyncClient, file_id: int, version: str) -> bytes:
    response = await http.get(f"/api/v1/eas/download/{file_id}/{version}")
    assert response.status_code == 200, (file_id, version, response.text)
    return response.content


async def receipts(fleet: Fleet) -> dict[str, list[dict[str, Any]]]:
    """Every execserver's recent finished jobs, by execserver name."""
    return {name: (await fleet.exec_page(name))["recent"] for name in EXECSERVERS}


def delivered_ok(found: Mapping[str, Sequence[Mapping[str, Any]]]) -> collections.Counter[str]:
    """How many times each subject (``file #id version``) ended ok and was delivered."""
    return collections.Counter(
        job["subject"]
        for jobs in found.values()
        for job in jobs
        if job["delivered"] and job["receipt"]["status"] == "ok"
    )


class Events:
    """Lines the services' commands write into a FIFO, read as they come."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        # read-write: the FIFO never reports end-of-file, and writers never block
        self._stream = trio.lowlevel.FdStream(os.open(path, os.O_RDWR | os.O_NONBLOCK))
        self._buffer = b""

    async def next(self) -> str:
        """The next line."""
        while b"\n" not in self._buffer:
            self._buffer += await self._stream.receive_some(4096)
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    async def aclose(self) -> None:
        await self._stream.aclose()


# -- the tests ---------------------------------------------------------------------------------

SHA_CLASS = {"text": {"extensions": ["txt"], "versions": {"sha256": {"service": "sha256"}}}}


async def test_a_silent_partition_is_detected_on_both_sides_within_ping_timeout(
    network: Network, shared_dir: Path
) -> None:
    """A silent cut closes the connection at both ends within ping_timeout; healed, it returns."""
    ping = FAST_PING
    async with (
        running_execservers(
            network, lambda _: {"sha256": {"argv": ["sha256sum"]}}, ping, 1
        ) as execs,
        running_fylr(network, shared_dir / "state", SHA_CLASS, ping, execs) as fleet,
    ):
        backend_id = (await fleet.fylr_page())["backend_id"]
        address = fleet.address("exec-a")
        with trio.fail_after(WAIT):
            await until(fleet.fylr_page, lambda p: bool(address_state(p, address)["instances"]))
        network.partition("fylr", "exec-a")
        started = trio.current_time()
        seen: dict[str, float] = {}

        async def fylr_side() -> None:
            await until(fleet.fylr_page, lambda p: not address_state(p, address)["instances"])
            seen["fylr"] = trio.current_time() - started

        async def exec_side() -> None:
            await until(lambda: fleet.exec_page("exec-a"), lambda p: not ours(p, backend_id))
            seen["exec-a"] = trio.current_time() - started

        # the last frame either side received came at the latest when the cut began
        with trio.fail_after(ping.timeout + ping.interval):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fylr_side)
                nursery.start_soon(exec_side)
        assert set(seen) == {"fylr", "exec-a"}
        assert network.dropped()[0] > 0  # the pings went into the void
        # the other execserver was never cut off
        page = await fleet.fylr_page()
        assert address_state(page, fleet.address("exec-b"))["connections"] == 1
        assert len(ours(await fleet.exec_page("exec-b"), backend_id)) == 1

        network.heal("fylr", "exec-a")
        with trio.fail_after(RECONNECT_WITHIN):
            back = await until(
                lambda: fleet.exec_page("exec-a"),
                lambda p: [c["callback_check"] for c in ours(p, backend_id)] == ["ok"],
            )
        (connection,) = ours(back, backend_id)
        assert connection["callback_url"] == f"http://{network['fylr'].address}:{FYLR_PORT}"
        page = await fleet.fylr_page()
        assert address_state(page, address)["connections"] == 1


async def test_a_job_on_a_partitioned_execserver_is_lost_requeued_and_runs_once(
    network: Network, shared_dir: Path
) -> None:
    """A job cut off mid-run is lost, requeued and run elsewhere with the parked wants, once."""
    ping = FAST_PING
    events = Events(shared_dir / "events")
    gate = shared_dir / "gate"

    def services(host: Host) -> dict[str, Any]:
        return {
            "gated": {"argv": ["sh", "-c", GATED, str(events.path), host.name, str(gate)]},
            "gzip": {"argv": ["gzip", "-c", "-n", "-{level}"]},
        }

    classes = {
        "text": {
            "extensions": ["txt"],
            "versions": {
                "sum": {"service": "gated"},
                "gz": {"service": "gzip", "params": {"level": 9}},
            },
        }
    }
    contents = {f"f{n}.txt": text(n, 3000 + n) for n in range(3)}
    try:
        async with (
            running_execservers(network, services, ping, 1) as execs,
            running_fylr(network, shared_dir / "state", classes, ping, execs) as fleet,
        ):
            backend_id = (await fleet.fylr_page())["backend_id"]
            ids = {}
            with trio.fail_after(WAIT):
                # two gated jobs hold the only slot of each execserver
                for name in ("f0.txt", "f1.txt"):
                    ids[name] = await put(fleet.fylr, name, contents[name])
                starts = [await events.next(), await events.next()]
            assert sorted(starts) == ["started exec-a", "started exec-b"]
            lost, other = starts[0].split()[1], starts[1].split()[1]
            with trio.fail_after(WAIT):
                # the third file's wants park on both
                ids["f2.txt"] = await put(fleet.fylr, "f2.txt", contents["f2.txt"])
                for name in (lost, other):
                    await until(
                        functools.partial(fleet.exec_page, name),
                        lambda p: sum(c["parked"] for c in ours(p, backend_id)) == 2,
                    )

            network.partition("fylr", lost)
            with trio.fail_after(ping.timeout + ping.interval):
                await until(lambda: fleet.exec_page(lost), lambda p: not ours(p, backend_id))
                await until(
                    fleet.fylr_page,
                    lambda p: not address_state(p, fleet.address(lost))["instances"],
                )
            with trio.fail_after(WAIT):
                # the lost job went back to the queue, to be run at once
                await until(fleet.fylr_page, lambda p: p["steps"].get("produce.requeued", 0) == 1)
                # and the execserver, on its side, stopped it (it ends its processes
                # first: its receipt may come a moment after the fylr's requeue)
                page = await until(
                    lambda: fleet.exec_page(lost),
                    lambda p: any(j["service"] == "gated" for j in p["recent"]),
                )
            stopped = [j for j in page["recent"] if j["service"] == "gated"]
            assert [(j["receipt"]["status"], j["delivered"]) for j in stopped] == [
                ("stopped", False)
            ]
            lost_subject = stopped[0]["subject"]

            gate.touch()
            with trio.fail_after(WAIT):
                documents = {name: await ended(fleet.fylr, ids[name]) for name in contents}
            for name, document in documents.items():
                assert document["status"] == "done", (name, document)
                assert {v: d["status"] for v, d in document["versions"].items()} == {
                    "sum": "done",
                    "gz": "done",
                }
                assert await download(fleet.fylr, ids[name], "sum") == sha256_line(contents[name])
                gz = await download(fleet.fylr, ids[name], "gz")
                assert gzip.decompress(gz) == contents[name]

            network.heal("fylr", lost)
            with trio.fail_after(RECONNECT_WITHIN):
                await until(
                    lambda: fleet.exec_page(lost),
                    lambda p: [c["callback_check"] for c in ours(p, backend_id)] == ["ok"],
                )
            found = await receipts(fleet)
            subjects = {f"{name} #{ids[name]} {v}" for name in contents for v in ("sum", "gz")}
            # every version was made exactly once, the lost one on the other execserver
            assert delivered_ok(found) == dict.fromkeys(subjects, 1)
            assert lost_subject in {j["subject"] for j in found[other] if j["delivered"]}
            # the wants parked on the lost execserver were served by the other one
            f2 = {s for s in subjects if s.startswith("f2.txt ")}
            assert f2 <= {j["subject"] for j in found[other]}
            assert not f2 & {j["subject"] for j in found[lost]}
            page = await fleet.fylr_page()
            assert page["steps"]["produce.ok"] == len(subjects)
            assert page["files"]["version"] == {"done": len(subjects)}
    finally:
        await events.aclose()


async def test_with_delay_and_loss_every_job_runs_once_and_every_byte_arrives(
    network: Network, shared_dir: Path
) -> None:
    """Over 50 ms each way and 1 % loss every job runs exactly once and every pipe byte arrives."""
    # The broker connections must never drop (checked below). Lost segments cost TCP
    # retransmits of a second or more, and on a busy 2-core machine a daemon's loop can
    # stall for seconds besides: a 5 s ping timeout judged such a stall a dead peer now
    # and then. 20 s still names a real outage a dead peer.
    ping = Ping(interval=1.0, timeout=20.0)
    delay = 0.05

    def services(_: Host) -> dict[str, Any]:
        return {
            "mime": {"argv": ["file", "--mime-type", "--brief", "-"]},
            "sha256": {"argv": ["sha256sum"]},
            "gzip": {"argv": ["gzip", "-c", "-n", "-{level}"]},
        }

    classes = {
        "text": {
            "extensions": ["txt"],
            "metadata": {"service": "mime"},
            "versions": {
                "gz": {"service": "gzip", "params": {"level": 6}},
                "sha256": {"service": "sha256"},
                "gz_sha256": {"service": "sha256", "source": "gz"},
            },
        }
    }
    contents = {f"f{n}.txt": text(n, 2000 + 1500 * n) for n in range(6)}
    fylr = network["fylr"]
    async with (
        running_execservers(network, services, ping, 2) as execs,
        contextlib.AsyncExitStack() as stack,
    ):
        relays = {}
        for name in EXECSERVERS:
            relays[f"broker {name}"] = await stack.enter_async_context(
                network.delay("fylr", name, EXEC_PORT, delay)
            )
            relays[f"pipes {name}"] = await stack.enter_async_context(
                network.delay(name, "fylr", FYLR_PORT, delay)
            )
        network.set_loss(1)
        fleet = await stack.enter_async_context(
            running_fylr(network, shared_dir / "state", classes, ping, execs)
        )
        backend_id = (await fleet.fylr_page())["backend_id"]
        first = {
            name: [c["id"] for c in ours(await fleet.exec_page(name), backend_id)]
            for name in EXECSERVERS
        }
        with trio.fail_after(WAIT):
            ids = {name: await put(fleet.fylr, name, data) for name, data in contents.items()}
            documents = {name: await ended(fleet.fylr, ids[name]) for name in contents}
        network.set_loss(0)
        assert network.dropped()[1] > 0  # the loss was real
        for name, data in contents.items():
            document = documents[name]
            assert document["status"] == "done", (name, document)
            assert document["metadata"] == {"mimetype": "text/plain"}
            assert {v: d["status"] for v, d in document["versions"].items()} == {
                "gz": "done",
                "sha256": "done",
                "gz_sha256": "done",
            }
            gz = await download(fleet.fylr, ids[name], "gz")
            assert gzip.decompress(gz) == data
            assert document["versions"]["gz"]["hash"] == {"sha256": hashlib.sha256(gz).hexdigest()}
            assert await download(fleet.fylr, ids[name], "sha256") == sha256_line(data)
            assert await download(fleet.fylr, ids[name], "gz_sha256") == sha256_line(gz)
            assert document["versions"]["gz"]["metadata"]["produced"]["stdin_bytes"] == len(data)
        found = await receipts(fleet)
        subjects = {
            f"{name} #{ids[name]} {step}"
            for name in contents
            for step in ("metadata", "gz", "sha256", "gz_sha256")
        }
        assert delivered_ok(found) == dict.fromkeys(subjects, 1)
        assert sum(len(jobs) for jobs in found.values()) == len(subjects)
        page = await fleet.fylr_page()
        assert page["steps"].get("produce.requeued", 0) == 0
        for name in EXECSERVERS:
            # the broker connection crossed its relay and never dropped: the one there
            # before the uploads is the one there now (jobs waiting on a loaded machine
            # may make the pool dial once more to look for another execserver behind
            # the address; such a dial finds the same one and is closed, not kept)
            assert relays[f"broker {name}"].connections >= 1
            (connection,) = ours(await fleet.exec_page(name), backend_id)
            assert [connection["id"]] == first[name]
            # the pipes' base is the fylr's address on the test network, checked through its relay
            assert connection["callback_url"] == f"http://{fylr.address}:{FYLR_PORT}"
            assert connection["callback_check"] == "ok"
            assert relays[f"pipes {name}"].connections >= 1
        # every whole stdin (the originals for gz and sha256, the gz for gz_sha256)
        # came down through the pipe relays
        stdin = sum(
            2 * len(data) + documents[n]["versions"]["gz"]["filesize"]
            for n, data in contents.items()
        )
        assert sum(relays[f"pipes {name}"].bytes_down for name in EXECSERVERS) >= stdin


ZEROS = 48 << 20
"""Bytes of output of the out-pipe test: more than every buffer on the way."""

STREAMS = {
    # the command waits at its gate before it reads its stdin (the upload, in mid-stream)
    "stdin": GATED,
    # the command has written 8 MiB of output (the PUT is open) when it waits at its gate
    "stdout": (
        "cat >/dev/null; head -c 8388608 /dev/zero; "
        'printf "started %s\\n" "$1" >"$0"; '
        'until [ -e "$2" ]; do sleep 0.05; done; '
        f"exec head -c {ZEROS - 8388608} /dev/zero"
    ),
}


@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_a_pipe_cut_mid_stream_is_run_again_not_failed(
    network: Network, shared_dir: Path, stream: str
) -> None:
    """A pipe that goes silent mid-stream, broker connection alive, gets the job run again."""
    # run here rather than by pytest-trio, whose nursery would wrap the assertion in a group
    version, receipt, made, expected = trio.run(pipe_cut_mid_stream, network, shared_dir, stream)
    assert version["status"] == "done", (receipt, version)
    assert made == expected


async def pipe_cut_mid_stream(
    network: Network, shared_dir: Path, stream: str
) -> tuple[dict[str, Any], dict[str, Any], bytes, bytes]:
    """Cut the fylr's pipes off one execserver mid-stream; what became of the version.

    Returns:
        The version's document, the first receipt of the cut execserver, the
        version's bytes (empty unless done) and the bytes it should hold.
    """
    ping = FAST_PING
    stall = 3.0
    events = Events(shared_dir / "events")
    gate = shared_dir / "gate"

    def services(host: Host) -> dict[str, Any]:
        argv = ["sh", "-c", STREAMS[stream], str(events.path), host.name, str(gate)]
        return {"gated": {"argv": argv, "stall_timeout": f"{stall:g}s"}}

    classes = {"data": {"extensions": ["bin"], "versions": {"sum": {"service": "gated"}}}}
    if stream == "stdin":
        # larger than every buffer on the way (socket buffers, the command's stdin pipe)
        data = random.Random(7).randbytes(48 << 20)
        expected = sha256_line(data)
    else:
        data = b"a small input\n"
        expected = bytes(ZEROS)
    try:
        async with (
            running_execservers(network, services, ping, 1) as execs,
            running_fylr(network, shared_dir / "state", classes, ping, execs) as fleet,
        ):
            backend_id = (await fleet.fylr_page())["backend_id"]
            with trio.fail_after(WAIT):
                file_id = await put(fleet.fylr, "big.bin", data)
                cut = (await events.next()).split()[1]
                # the command waits at its gate with one of its pipes in mid-stream
                page = await until(fleet.fylr_page, lambda p: p["pipes"]["active"] == 1)
            if stream == "stdin":
                assert page["pipes"]["bytes_served"] < len(data)
            else:
                assert 0 < page["pipes"]["bytes_received"] < ZEROS
            (before,) = ours(await fleet.exec_page(cut), backend_id)

            network.partition("fylr", cut, port=FYLR_PORT)
            gate.touch()
            with trio.fail_after(WAIT):
                # the execserver gives the job up (the stall timeout bounds it)
                first = await until(
                    functools.partial(fleet.exec_page, cut), lambda p: bool(p["recent"])
                )
            network.heal("fylr", cut, port=FYLR_PORT)
            with trio.fail_after(WAIT):
                document = await ended(fleet.fylr, file_id)
            (after,) = ours(await fleet.exec_page(cut), backend_id)
            assert after["id"] == before["id"]  # the broker connection never dropped
            receipt = first["recent"][0]["receipt"]
            version = document["versions"]["sum"]
            made = (
                await download(fleet.fylr, file_id, "sum") if version["status"] == "done" else b""
            )
    finally:
        await events.aclose()
    return version, receipt, made, expected


CUT = 5.0
"""Seconds the execservers at least cannot reach the fylr's pipes in the cut test."""


@pytest.mark.parametrize(("how", "cause"), [("reset", "connection refused"), ("drop", "timed out")])
async def test_a_cut_of_the_pipe_path_requeues_every_step_and_every_file_ends_done(
    network: Network, shared_dir: Path, how: Literal["drop", "reset"], cause: str
) -> None:
    """For at least 5 s neither execserver can open a connection to the fylr's listener (a
    rule in their own output that refuses the connections, or drops them until each pipe's
    connect times out), while the broker connections, which the fylr opened, stay up: every
    job that starts meanwhile ends ``stopped`` naming the pipe and the cause, its step is
    requeued after retry_delay, and once the path is back every file ends done with the
    right bytes; nothing failed."""
    ping = FAST_PING
    contents = {f"c{n}.txt": text(n, 200 + n) for n in range(8)}
    async with (
        running_execservers(
            network, lambda _: {"sha256": {"argv": ["sha256sum"]}}, ping, 2
        ) as execs,
        running_fylr(network, shared_dir / "state", SHA_CLASS, ping, execs) as fleet,
    ):
        for name in EXECSERVERS:
            network.block(name, "fylr", FYLR_PORT, how=how)
        cut_at = trio.current_time()
        try:
            with trio.fail_after(WAIT):
                ids = {name: await put(fleet.fylr, name, data) for name, data in contents.items()}
                # every step met the cut at least once (it is requeued a second later)
                await until(
                    fleet.fylr_page, lambda p: p["steps"].get("produce.requeued", 0) >= len(ids)
                )
            await trio.sleep_until(cut_at + CUT)  # the cut lasts its whole length
        finally:
            dropped = sum(network.unblock(name, "fylr", FYLR_PORT) for name in EXECSERVERS)
        assert dropped > 0
        with trio.fail_after(WAIT):
            documents = {name: await ended(fleet.fylr, file_id) for name, file_id in ids.items()}
        for name, document in documents.items():
            assert document["status"] == "done", (name, document)
            assert document["versions"]["sha256"]["status"] == "done", (name, document)
            assert await download(fleet.fylr, ids[name], "sha256") == sha256_line(contents[name])
        page = await fleet.fylr_page()
        assert page["steps"].get("produce.error", 0) == 0
        assert page["queue"]["failed"] == 0
        stopped = [
            job["receipt"]["error"]
            for jobs in (await receipts(fleet)).values()
            for job in jobs
            if job["receipt"]["status"] == "stopped"
        ]
        assert stopped
        address = network["fylr"].address
        for error in stopped:
            assert error.startswith(
                f"the in-pipe at http://{address}:{FYLR_PORT} could not be reached ({cause}):"
            ), error
