"""One-time pipes: the client's registry over real HTTP, and the runner streaming through it.

The registry is served on 127.0.0.1 by :func:`serve_pipes`; the execserver side is
a real :class:`CommandRunner` running real commands (``cat``, ``sh -c``), or a
real execserver over its websocket.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any, cast

import attrs
import h11
import httpx
import psutil
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

import trio_broker.trio.command as command_module
import trio_broker.trio.pipe_io as pipe_io
from tests.support.wire import WAIT, connect, start_execserver
from tests.trio.test_runner import open_fifo, read_line
from trio_broker.core import protocol as p
from trio_broker.core.job import STDOUT_PREFIX_BYTES
from trio_broker.core.protocol import Receipt
from trio_broker.trio import procgroup
from trio_broker.trio.command import CommandRunner, CommandSpec
from trio_broker.trio.pipes import (
    NOT_FOUND_BODY,
    Pipe,
    PipeAborted,
    PipeClosed,
    PipeRegistry,
    serve_pipes,
)
from trio_broker.trio.runner import JobControl, JobRequest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the runner reads /proc")

PY = sys.executable
MiB = 1 << 20
CHUNK = 64 * 1024


# -- helpers -----------------------------------------------------------------------


@attrs.frozen
class Served:
    """A registry served on a real loopback listener."""

    registry: PipeRegistry
    base: str

    def url(self, pipe: Pipe) -> str:
        return pipe.url(self.base)


@pytest.fixture
async def served(nursery: trio.Nursery) -> Served:
    registry = PipeRegistry("backend-1")
    port = await nursery.start(serve_pipes, registry, "127.0.0.1", 0)
    return Served(registry, f"http://127.0.0.1:{port}")


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=WAIT) as client:
        yield client


@pytest.fixture
def jobs_dir(tmp_path: Path) -> Iterator[Path]:
    """The runner's temp_dir; every work directory must be gone when the test ends."""
    path = tmp_path / "jobs"
    path.mkdir()
    yield path
    assert list(path.iterdir()) == []


def make_runner(jobs_dir: Path, services: Mapping[str, tuple[str, ...]]) -> CommandRunner:
    return CommandRunner(
        {name: CommandSpec(argv=argv) for name, argv in services.items()},
        temp_dir=str(jobs_dir),
        instance_id="inst-1",
        sample_interval=0.1,
        kill_grace=1.0,
    )


async def run_job(
    runner: CommandRunner,
    service: str,
    control: JobControl | None = None,
    **pipes: str,
) -> Receipt:
    with trio.fail_after(WAIT):
        return await runner.run(
            JobRequest(job_id="job-1", service=service, job={"params": {}, **pipes}),
            control or JobControl(),
        )


def literal(text: str) -> str:
    """``text`` as an argv template element that fills to itself."""
    return text.replace("{", "{{").replace("}", "}}")


def pattern(size: int) -> bytes:
    """Deterministic bytes that are not all alike (so a misplaced chunk shows)."""
    block = hashlib.sha256(b"pipes").digest() * (CHUNK // 32)
    return (block * (size // len(block) + 1))[:size]


async def source_of(size: int, *, fail_after: int | None = None) -> AsyncIterator[bytes]:
    """``size`` bytes in 64 KiB chunks of :func:`pattern`; raises after ``fail_after`` bytes."""
    block = pattern(CHUNK)
    sent = 0
    while sent < size:
        if fail_after is not None and sent >= fail_after:
            raise ValueError("the upload broke")
        piece = block[: min(CHUNK, size - sent)]
        yield piece
        sent += len(piece)


class Body(httpx.AsyncByteStream):
    """A chunked request body of :func:`pattern` bytes that may wait at a gate.

    Not an async generator: the HTTP client may stop iterating a body anywhere
    (the server answered early), and an abandoned generator is finalized late,
    with a warning from trio.
    """

    def __init__(self, size: int, *, gate: trio.Event | None = None) -> None:
        self.size = size
        self.sent = 0
        self.gate = gate
        self.block = pattern(CHUNK)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self.sent >= self.size:
            raise StopAsyncIteration
        if self.sent and self.gate is not None:
            await self.gate.wait()
        chunk = self.block[: min(CHUNK, self.size - self.sent)]
        self.sent += len(chunk)
        return chunk


async def put_body(http: httpx.AsyncClient, url: str, body: Body) -> httpx.Response:
    request = http.build_request("PUT", url, headers={"transfer-encoding": "chunked"})
    request.stream = body
    return await http.send(request)


class Collect:
    """A sink that keeps every byte and can wake a waiter after a given amount."""

    def __init__(self, *, fail_after: int | None = None) -> None:
        self.data = bytearray()
        self.fail_after = fail_after
        self._waiters: list[tuple[int, trio.Event]] = []

    async def __call__(self, chunk: bytes) -> None:
        if self.fail_after is not None and len(self.data) >= self.fail_after:
            raise OSError("the download went away")
        self.data += chunk
        for count, event in self._waiters:
            if len(self.data) >= count:
                event.set()

    async def wait_for(self, count: int) -> None:
        event = trio.Event()
        self._waiters.append((count, event))
        if len(self.data) >= count:
            event.set()
        with trio.fail_after(WAIT):
            await event.wait()


async def ended(pipe: Pipe) -> int | BaseException:
    """What the pipe's wait() gave: the byte count or the exception."""
    with trio.fail_after(WAIT):
        try:
            return await pipe.wait()
        except Exception as exc:
            return exc


# -- the registry over HTTP --------------------------------------------------------


async def test_whoami_answers_the_backend_id(served: Served, http: httpx.AsyncClient) -> None:
    """GET /whoami answers the registry's backend_id as JSON."""
    response = await http.get(served.base + "/whoami")
    assert response.status_code == 200
    assert response.json() == {"backend_id": "backend-1"}


async def test_in_pipe_streams_its_source_once(served: Served, http: httpx.AsyncClient) -> None:
    """GET streams the whole source and the pipe reports its size; a second GET gets 404."""
    pipe = served.registry.pipe_in(source_of(MiB + 5))
    response = await http.get(served.url(pipe))
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/octet-stream"
    assert "content-length" not in response.headers  # chunked: an incomplete body shows
    assert response.content == pattern(MiB + 5)
    assert await ended(pipe) == MiB + 5
    assert pipe.state == "done"
    again = await http.get(served.url(pipe))
    assert (again.status_code, again.text) == (404, NOT_FOUND_BODY)


async def test_out_pipe_feeds_its_sink_once(served: Served, http: httpx.AsyncClient) -> None:
    """A chunked PUT reaches the sink in order, whole; a second PUT gets 404."""
    sink = Collect()
    pipe = served.registry.pipe_out(sink)
    response = await http.put(served.url(pipe), content=source_of(3 * MiB + 1))
    assert response.status_code == 204
    assert bytes(sink.data) == pattern(3 * MiB + 1)
    assert await ended(pipe) == 3 * MiB + 1
    again = await http.put(served.url(pipe), content=b"more")
    assert (again.status_code, again.text) == (404, NOT_FOUND_BODY)
    assert bytes(sink.data) == pattern(3 * MiB + 1)


async def test_every_refusal_is_the_same_404(served: Served, http: httpx.AsyncClient) -> None:
    """Random, used, closed and wrong-direction ids get one identical 404; HEAD claims nothing."""
    registry = served.registry
    used_in = registry.pipe_in(source_of(10))
    assert (await http.get(served.url(used_in))).status_code == 200
    used_out = registry.pipe_out(Collect())
    assert (await http.put(served.url(used_out), content=b"x")).status_code == 204
    closed = registry.pipe_in(source_of(10))
    closed.close()
    in_pipe = registry.pipe_in(source_of(10))
    out_pipe = registry.pipe_out(Collect())
    refusals = [
        await http.get(served.base + "/pipe/" + "A" * 22),
        await http.put(served.base + "/pipe/" + "A" * 22, content=b"x"),
        await http.get(served.url(used_in)),
        await http.put(served.url(used_out), content=b"x"),
        await http.get(served.url(closed)),
        await http.put(served.url(in_pipe), content=b"x"),  # an in-pipe takes no PUT
        await http.get(served.url(out_pipe)),  # an out-pipe serves no GET
        await http.head(served.url(in_pipe)),
    ]
    for response in refusals:
        assert response.status_code == 404
        assert response.headers["content-type"] == refusals[0].headers["content-type"]
    assert {r.text for r in refusals[:-1]} == {NOT_FOUND_BODY}  # HEAD has no body
    # the wrong-direction requests and HEAD left both pipes usable
    assert (await http.get(served.url(in_pipe))).content == pattern(10)
    assert (await http.put(served.url(out_pipe), content=b"y")).status_code == 204


def test_pipe_ids_carry_128_random_bits() -> None:
    """Ids are distinct URL-safe strings of 22+ characters (128 bits); path is /pipe/<id>."""
    registry = PipeRegistry("b")
    pipes = [registry.pipe_out(Collect()) for _ in range(2000)]
    ids = {pipe.id for pipe in pipes}
    assert len(ids) == len(pipes)
    for pipe in pipes:
        assert re.fullmatch(r"[A-Za-z0-9_-]{22,}", pipe.id)
        assert pipe.path == f"/pipe/{pipe.id}"
        assert pipe.id not in repr(pipe)
    assert pipes[0].url("http://10.0.0.1:80/") == f"http://10.0.0.1:80/pipe/{pipes[0].id}"


async def test_put_cut_off_before_its_final_chunk_aborts_the_out_pipe(
    served: Served, http: httpx.AsyncClient
) -> None:
    """A sender that drops the connection mid-body leaves the out-pipe aborted, not done."""
    sink = Collect()
    pipe = served.registry.pipe_out(sink)

    class Dropped(Exception):
        pass

    async def body() -> AsyncIterator[bytes]:
        async for chunk in source_of(2 * MiB):
            yield chunk
        raise Dropped

    with pytest.raises(Dropped):
        await http.put(served.url(pipe), content=body())
    outcome = await ended(pipe)
    assert isinstance(outcome, PipeAborted)
    assert "incomplete" in str(outcome)
    assert pipe.state == "aborted"
    assert bytes(sink.data) == pattern(len(sink.data))  # a prefix, in order
    assert len(sink.data) <= 2 * MiB


async def test_failing_source_cuts_the_get_off(served: Served, http: httpx.AsyncClient) -> None:
    """A source that raises ends the GET without its final chunk; the pipe keeps the cause."""
    pipe = served.registry.pipe_in(source_of(4 * MiB, fail_after=MiB))
    with pytest.raises(httpx.RemoteProtocolError, match="incomplete"):
        await http.get(served.url(pipe))
    outcome = await ended(pipe)
    assert isinstance(outcome, PipeAborted)
    assert isinstance(outcome.__cause__, ValueError)
    assert pipe.bytes == MiB


async def test_reader_leaving_closes_the_source(served: Served) -> None:
    """A reader that goes away early aborts the in-pipe, and the source is closed, not drained."""
    finalized = trio.Event()
    pulled = 0

    async def source() -> AsyncIterator[bytes]:
        nonlocal pulled
        try:
            while True:
                yield b"z" * CHUNK
                pulled += CHUNK
        finally:
            finalized.set()

    pipe = served.registry.pipe_in(source())
    host, port = served.base.removeprefix("http://").split(":")
    with trio.fail_after(WAIT):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(f"GET {pipe.path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert (await stream.receive_some(CHUNK)).startswith(b"HTTP/1.1 200")
    outcome = await ended(pipe)
    assert isinstance(outcome, PipeAborted)
    assert "went away" in str(outcome)
    assert finalized.is_set()
    assert pulled < 256 * MiB  # it stopped: not read on into nowhere


async def test_closed_pipe_is_gone(served: Served, http: httpx.AsyncClient) -> None:
    """close() before any request: 404 afterwards, wait() raises PipeClosed, close is idempotent."""
    registry = served.registry
    with registry.pipe_out(Collect()) as pipe:
        assert len(registry) == 1
    assert len(registry) == 0
    pipe.close()
    response = await http.put(served.url(pipe), content=b"late")
    assert (response.status_code, response.text) == (404, NOT_FOUND_BODY)
    assert isinstance(await ended(pipe), PipeClosed)
    assert pipe.state == "closed"


async def test_close_cuts_an_active_transfer_off(served: Served, http: httpx.AsyncClient) -> None:
    """close() during a PUT ends the pipe aborted; the sender's request fails or gets 404."""
    sink = Collect()
    pipe = served.registry.pipe_out(sink)
    more = trio.Event()
    results: list[httpx.Response | Exception] = []

    async def put() -> None:
        try:
            results.append(await put_body(http, served.url(pipe), Body(64 * MiB, gate=more)))
        except httpx.HTTPError as exc:
            results.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(put)
        await sink.wait_for(1)
        assert pipe.state == "active"
        pipe.close()
        outcome = await ended(pipe)
        more.set()
    assert isinstance(outcome, PipeAborted)
    assert "closed" in str(outcome)
    assert len(sink.data) < 64 * MiB
    (result,) = results
    assert isinstance(result, httpx.HTTPError) or (
        isinstance(result, httpx.Response) and result.status_code == 404
    )


async def test_failing_sink_answers_500(served: Served, http: httpx.AsyncClient) -> None:
    """A sink that raises stops the transfer: the sender gets 500, the pipe keeps the cause."""
    pipe = served.registry.pipe_out(Collect(fail_after=MiB))
    response = await put_body(http, served.url(pipe), Body(64 * MiB))
    assert response.status_code == 500
    outcome = await ended(pipe)
    assert isinstance(outcome, PipeAborted)
    assert isinstance(outcome.__cause__, OSError)


async def test_registry_close_and_statistics(served: Served, http: httpx.AsyncClient) -> None:
    """statistics() counts pipes and bytes; registry.close() closes every pipe."""
    registry = served.registry
    done = registry.pipe_in(source_of(1000))
    await http.get(served.url(done))
    assert await ended(done) == 1000
    out = registry.pipe_out(Collect())
    await http.put(served.url(out), content=b"12345")
    assert await ended(out) == 5
    left = [registry.pipe_in(source_of(1)), registry.pipe_out(Collect())]
    stats = registry.statistics()
    assert (stats.open, stats.active, stats.done, stats.aborted) == (2, 0, 2, 0)
    assert (stats.bytes_served, stats.bytes_received) == (1000, 5)
    registry.close()
    assert len(registry) == 0
    for pipe in left:
        assert isinstance(await ended(pipe), PipeClosed)


async def test_routes_mount_into_another_app(nursery: trio.Nursery) -> None:
    """routes() serves the pipes from a daemon's own app, beside its other routes."""
    registry = PipeRegistry("daemon")

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hello")

    app = Starlette(routes=[*registry.routes(), Route("/hello", hello)])
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    binds = await nursery.start(partial(hypercorn_serve, cast(Any, app), config))
    base = str(binds[0])
    pipe = registry.pipe_in(source_of(100))
    async with httpx.AsyncClient(timeout=WAIT) as client:
        assert (await client.get(base + "/hello")).text == "hello"
        assert (await client.get(base + "/whoami")).json() == {"backend_id": "daemon"}
        assert (await client.get(pipe.url(base))).content == pattern(100)


# -- the runner streaming through pipes ----------------------------------------------


async def stream_through_cat(jobs_dir: Path, served: Served, size: int) -> None:
    """``size`` bytes: in-pipe, ``cat``, out-pipe; checks the bytes and the memory growth."""
    runner = make_runner(jobs_dir, {"cat": ("cat",)})
    me = psutil.Process()
    sent_digest = hashlib.sha256()
    digest = hashlib.sha256()
    received = 0
    peak_growth = 0
    baseline = me.memory_info().rss

    async def sink(chunk: bytes) -> None:
        nonlocal received, peak_growth
        digest.update(chunk)
        received += len(chunk)
        if received % (8 * MiB) < len(chunk):  # sampled as the bytes flow, no timer
            peak_growth = max(peak_growth, me.memory_info().rss - baseline)

    async def source() -> AsyncIterator[bytes]:
        async for chunk in source_of(size):
            sent_digest.update(chunk)
            yield chunk

    in_pipe = served.registry.pipe_in(source())
    out_pipe = served.registry.pipe_out(sink)
    began = time.perf_counter()
    with trio.fail_after(max(WAIT, size / MiB)):  # generous: at least 1 MiB/s
        receipt = await runner.run(
            JobRequest(
                job_id="big",
                service="cat",
                job={"stdin_url": served.url(in_pipe), "stdout_url": served.url(out_pipe)},
            ),
            JobControl(),
        )
    elapsed = time.perf_counter() - began
    peak_growth = max(peak_growth, me.memory_info().rss - baseline)
    print(
        f"\n{size / MiB:.0f} MiB through cat: {size / MiB / elapsed:.1f} MiB/s, "
        f"RSS growth {peak_growth / MiB:.1f} MiB"
    )
    assert (receipt.status, receipt.error) == ("ok", None)
    assert (receipt.stdin_bytes, receipt.stdout_bytes) == (size, size)
    assert await ended(in_pipe) == size
    assert await ended(out_pipe) == size
    assert digest.hexdigest() == sent_digest.hexdigest()
    assert peak_growth < 64 * MiB


async def test_cat_streams_256_mib_in_bounded_memory(jobs_dir: Path, served: Served) -> None:
    """256 MiB go in-pipe -> cat -> out-pipe intact while this process grows by under 64 MiB."""
    await stream_through_cat(jobs_dir, served, 256 * MiB)


@pytest.mark.soak
async def test_cat_streams_1_gib_in_bounded_memory(jobs_dir: Path, served: Served) -> None:
    """1 GiB goes in-pipe -> cat -> out-pipe intact while this process grows by under 64 MiB."""
    await stream_through_cat(jobs_dir, served, 1024 * MiB)


async def test_small_output_of_an_ok_command_arrives_in_one_put(
    jobs_dir: Path, served: Served
) -> None:
    """Output that never outgrew 4000 bytes reaches the out-pipe whole once the command ended ok."""
    runner = make_runner(
        jobs_dir,
        {
            "hello": ("printf", "hello"),
            "exact": (PY, "-c", "import sys; sys.stdout.write('é' * 2000)"),
            "none": ("true",),
        },
    )
    for service, expected in [("hello", b"hello"), ("exact", "é".encode() * 2000), ("none", b"")]:
        sink = Collect()
        with served.registry.pipe_out(sink) as pipe:
            receipt = await run_job(runner, service, stdout_url=served.url(pipe))
            assert (receipt.status, receipt.error) == ("ok", None)
            assert await ended(pipe) == len(expected)
        assert bytes(sink.data) == expected
        assert receipt.stdout_bytes == len(expected)
        assert receipt.stdout_prefix == expected.decode()


@pytest.mark.parametrize("size", [100, STDOUT_PREFIX_BYTES])
async def test_failing_command_with_small_output_never_opens_the_out_pipe(
    jobs_dir: Path, served: Served, size: int
) -> None:
    """A command exiting 1 with at most 4000 bytes: no PUT; the receipt carries its output."""
    error = '{"error": "unsupported format", "code": 17}'
    script = 'printf "%s" "$1"; head -c "$2" /dev/zero | tr "\\0" " "; echo "bad input" >&2; exit 1'
    runner = make_runner(
        jobs_dir, {"convert": ("sh", "-c", script, "sh", literal(error), str(size - len(error)))}
    )
    pipe = served.registry.pipe_out(Collect())
    receipt = await run_job(runner, "convert", stdout_url=served.url(pipe))
    assert (receipt.status, receipt.exit_code, receipt.error) == ("failed", 1, "exit status 1")
    assert receipt.stdout_prefix == error + " " * (size - len(error))
    assert receipt.stdout_bytes == size
    assert receipt.stderr_line == "bad input"
    assert pipe.state == "open"  # never requested
    pipe.close()
    assert isinstance(await ended(pipe), PipeClosed)


async def test_failing_command_past_4000_bytes_aborts_the_put(
    jobs_dir: Path, served: Served
) -> None:
    """One byte past the buffer opens the PUT; the failure then cuts it off before its end."""
    runner = make_runner(jobs_dir, {"convert": ("sh", "-c", "head -c 4001 /dev/zero; exit 2")})
    sink = Collect()
    pipe = served.registry.pipe_out(sink)
    receipt = await run_job(runner, "convert", stdout_url=served.url(pipe))
    assert receipt.status == "failed"
    assert receipt.error == "exit status 2; the output stream was aborted after 4001 bytes"
    outcome = await ended(pipe)
    assert isinstance(outcome, PipeAborted)
    assert "incomplete" in str(outcome)
    assert receipt.stdout_prefix == "<4001 bytes of binary output>"  # NULs are no text


async def test_command_dying_after_10_mb_aborts_the_out_pipe(
    jobs_dir: Path, served: Served
) -> None:
    """A command killed after 10 MB of output: the sink sees a cut-off stream, the receipt why."""
    runner = make_runner(
        jobs_dir, {"render": ("sh", "-c", "head -c 10000000 /dev/zero; kill -9 $$")}
    )
    sink = Collect()
    pipe = served.registry.pipe_out(sink)
    receipt = await run_job(runner, "render", stdout_url=served.url(pipe))
    assert (receipt.status, receipt.exit_code) == ("failed", -9)
    assert receipt.error == (
        "killed by signal 9; the output stream was aborted after 10000000 bytes"
    )
    assert receipt.stdout_bytes == 10_000_000
    assert receipt.stdout_prefix == "<10000000 bytes of binary output>"
    outcome = await ended(pipe)
    assert isinstance(outcome, PipeAborted)
    assert "incomplete" in str(outcome)
    assert 4000 < len(sink.data) <= 10_000_000
    assert not any(sink.data)


async def test_an_unreachable_input_runs_nothing_and_stops_the_job(
    jobs_dir: Path, served: Served
) -> None:
    """An in-pipe that answers 404, refuses the connection or names no known host: nothing
    runs and the job ends stopped (the network's fault, run again later), naming the cause."""
    runner = make_runner(jobs_dir, {"cat": ("cat",)})
    unknown = served.base + "/pipe/" + "B" * 22
    receipt = await run_job(runner, "cat", stdin_url=unknown)
    assert receipt.status == "stopped"
    assert receipt.error == (
        f"the in-pipe at {served.base} answered 404: it is not the pipe's owner, or the owner"
        " gave the job up"
    )
    assert (receipt.exit_code, receipt.peak_memory, receipt.stdin_bytes) == (None, None, 0)
    with trio.socket.socket() as closed:  # bound but not listening: connections are refused
        await closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        receipt = await run_job(runner, "cat", stdin_url=f"http://127.0.0.1:{port}/pipe/x")
    assert receipt.status == "stopped"
    assert receipt.error is not None
    assert receipt.error.startswith(
        f"the in-pipe at http://127.0.0.1:{port} could not be reached (connection refused):"
        " ConnectError"
    )
    assert "/pipe/" not in receipt.error  # the id is a credential: never in a receipt
    assert receipt.exit_code is None
    # .invalid never resolves (RFC 6761)
    receipt = await run_job(runner, "cat", stdin_url="http://no-such-host.invalid:81/pipe/x")
    assert receipt.status == "stopped"
    assert (receipt.error or "").startswith(
        "the in-pipe at http://no-such-host.invalid:81 could not be reached (DNS failure):"
    )


async def test_an_in_pipe_whose_tls_fails_stops_the_job(jobs_dir: Path, served: Served) -> None:
    """An https in-pipe on a plain listener: the handshake fails, a TLS failure, stopped."""
    runner = make_runner(jobs_dir, {"cat": ("cat",)})
    url = served.base.replace("http://", "https://") + "/pipe/" + "C" * 22
    receipt = await run_job(runner, "cat", stdin_url=url)
    assert receipt.status == "stopped"
    host_port = served.base.removeprefix("http://")
    assert (receipt.error or "").startswith(
        f"the in-pipe at https://{host_port} could not be reached (TLS failure):"
    )


async def test_input_breaking_mid_stream_stops_the_job(jobs_dir: Path, served: Served) -> None:
    """An in-pipe cut off mid-body stops the job: cat never sees an end of file, nor exits ok."""
    runner = make_runner(jobs_dir, {"cat": ("cat",)})
    in_pipe = served.registry.pipe_in(source_of(8 * MiB, fail_after=MiB))
    out_pipe = served.registry.pipe_out(Collect())
    receipt = await run_job(
        runner, "cat", stdin_url=served.url(in_pipe), stdout_url=served.url(out_pipe)
    )
    assert receipt.status == "stopped"
    assert receipt.error is not None
    assert receipt.error.startswith(f"the input stream broke after {MiB} bytes: ")
    assert "the output stream was aborted after" in receipt.error
    assert receipt.exit_code == -15  # SIGTERM: it was still waiting for input
    assert receipt.stdin_bytes == MiB
    assert isinstance(await ended(in_pipe), PipeAborted)
    assert isinstance(await ended(out_pipe), PipeAborted)


async def test_command_not_reading_its_input_is_not_a_failure(
    jobs_dir: Path, served: Served
) -> None:
    """A command that ignores most of its stdin ends ok; the in-pipe sees its reader leave."""
    runner = make_runner(jobs_dir, {"head": ("head", "-c", "10")})
    in_pipe = served.registry.pipe_in(source_of(64 * MiB))
    out = Collect()
    out_pipe = served.registry.pipe_out(out)
    receipt = await run_job(
        runner, "head", stdin_url=served.url(in_pipe), stdout_url=served.url(out_pipe)
    )
    assert (receipt.status, receipt.error) == ("ok", None)
    assert 10 <= receipt.stdin_bytes < 64 * MiB
    assert bytes(out.data) == pattern(10)
    assert isinstance(await ended(in_pipe), PipeAborted)


async def test_out_pipe_refused_mid_stream_stops_the_command(
    jobs_dir: Path, served: Served
) -> None:
    """A PUT answered 404 stops a command with endless output; the receipt says so."""
    runner = make_runner(jobs_dir, {"endless": ("cat", "/dev/zero")})
    receipt = await run_job(runner, "endless", stdout_url=served.base + "/pipe/" + "C" * 22)
    assert receipt.status == "stopped"
    assert receipt.error is not None
    assert receipt.error.startswith("the output stream broke: ")
    assert served.base in receipt.error
    assert "C" * 22 not in receipt.error
    assert receipt.exit_code == -15


async def test_small_output_refused_after_an_ok_end_is_not_ok(
    jobs_dir: Path, served: Served
) -> None:
    """An ok command whose small output the out-pipe refused is stopped, not ok."""
    runner = make_runner(jobs_dir, {"hello": ("printf", "hello")})
    receipt = await run_job(runner, "hello", stdout_url=served.base + "/pipe/" + "D" * 22)
    assert (receipt.status, receipt.exit_code) == ("stopped", 0)
    assert receipt.error == f"the output stream broke: the out-pipe at {served.base} answered 404"
    assert receipt.stdout_prefix == "hello"


async def test_failing_sink_stops_the_command(jobs_dir: Path, served: Served) -> None:
    """A client sink that fails mid-stream stops the command; the out-pipe keeps the cause."""
    runner = make_runner(jobs_dir, {"endless": ("cat", "/dev/zero")})
    pipe = served.registry.pipe_out(Collect(fail_after=MiB))
    receipt = await run_job(runner, "endless", stdout_url=served.url(pipe))
    assert receipt.status == "stopped"
    assert receipt.error is not None
    assert receipt.error.startswith("the output stream broke: ")
    outcome = await ended(pipe)
    assert isinstance(outcome, PipeAborted)
    assert isinstance(outcome.__cause__, OSError)


async def test_cancel_mid_stream_aborts_the_out_pipe(jobs_dir: Path, served: Served) -> None:
    """CANCEL while streaming ends the job cancelled and cuts the PUT off."""
    runner = make_runner(jobs_dir, {"endless": ("cat", "/dev/zero")})
    sink = Collect()
    pipe = served.registry.pipe_out(sink)
    control = JobControl()
    receipts: list[Receipt] = []

    async def job() -> None:
        receipts.append(await run_job(runner, "endless", control, stdout_url=served.url(pipe)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(job)
        await sink.wait_for(MiB)
        control.abort("cancelled", "cancelled by the client")
    (receipt,) = receipts
    assert receipt.status == "cancelled"
    assert receipt.error is not None
    assert receipt.error.startswith("cancelled by the client; the output stream was aborted after ")
    assert isinstance(await ended(pipe), PipeAborted)


async def test_runner_cancellation_cuts_both_pipes_off(jobs_dir: Path, served: Served) -> None:
    """Cancelling run() mid-stream (the execserver stops) leaves both pipes aborted."""
    runner = make_runner(jobs_dir, {"cat": ("cat",)})
    sink = Collect()
    in_pipe = served.registry.pipe_in(source_of(1024 * MiB))
    out_pipe = served.registry.pipe_out(sink)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            partial(
                run_job,
                runner,
                "cat",
                stdin_url=served.url(in_pipe),
                stdout_url=served.url(out_pipe),
            )
        )
        await sink.wait_for(MiB)
        nursery.cancel_scope.cancel()
    assert isinstance(await ended(in_pipe), PipeAborted)
    assert isinstance(await ended(out_pipe), PipeAborted)
    assert runner.statistics().running == ()


@pytest.mark.parametrize(
    "value",
    [
        42,
        "ftp://host/x",
        "not a url",
        "http:///no-host",
        "http://host:99999/x",  # no such port: the job object refuses it
        "http://1.2.3.999/x",  # no such address: the HTTP client refuses it
    ],
)
@pytest.mark.parametrize("name", ["stdin_url", "stdout_url"])
async def test_bad_pipe_urls_are_error_receipts(jobs_dir: Path, name: str, value: Any) -> None:
    """A pipe URL that is not a usable http(s) URL gives an error receipt and runs nothing."""
    runner = make_runner(jobs_dir, {"cat": ("cat",)})
    with trio.fail_after(WAIT):
        receipt = await runner.run(
            JobRequest(job_id="j", service="cat", job={name: value}), JobControl()
        )
    assert (receipt.status, receipt.error) == ("error", f"{name} must be an http or https URL")
    assert receipt.exit_code is None


# -- through a real execserver --------------------------------------------------------


async def test_execserver_answers_a_bad_job_object_with_an_error_receipt(
    nursery: trio.Nursery,
) -> None:
    """A JOB whose object is malformed is redeemed and ends DONE with status error, no ERROR."""
    handle = await start_execserver(nursery, services={"cat": {"argv": ["cat"]}})
    async with connect(handle) as peer:
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("params", {"params": [1]}, "params must be an object"),
            ("url", {"stdout_url": "ftp://x/y"}, "stdout_url must be an http or https URL"),
        ]
        for job_id, job, error in cases:
            offer = await peer.want(job_id, "cat")
            assert isinstance(offer, p.Offer)
            await peer.send(
                p.Job(job_id=job_id, token=offer.token, service="cat", subject=None, job=job)
            )
            done = await peer.done(job_id)
            assert (done.receipt.status, done.receipt.error) == ("error", error)
            assert (done.receipt.exit_code, done.receipt.peak_memory) == (None, None)


async def test_execserver_runs_a_body_mode_job(nursery: trio.Nursery, served: Served) -> None:
    """JOB's stdin_url/stdout_url reach the runner: bytes go through, DONE counts them."""
    handle = await start_execserver(nursery, services={"cat": {"argv": ["cat"]}})
    sink = Collect()
    in_pipe = served.registry.pipe_in(source_of(5 * MiB + 3))
    out_pipe = served.registry.pipe_out(sink)
    async with connect(handle) as peer:
        offer = await peer.want("body", "cat")
        assert isinstance(offer, p.Offer)
        job = {"stdin_url": served.url(in_pipe), "stdout_url": served.url(out_pipe)}
        await peer.send(
            p.Job(job_id="body", token=offer.token, service="cat", subject=None, job=job)
        )
        done = await peer.done("body")
    assert (done.receipt.status, done.receipt.error) == ("ok", None)
    assert done.receipt.stdin_bytes == done.receipt.stdout_bytes == 5 * MiB + 3
    assert await ended(out_pipe) == 5 * MiB + 3
    assert bytes(sink.data) == pattern(5 * MiB + 3)


async def test_execserver_receipt_carries_a_small_failure(
    nursery: trio.Nursery, served: Served
) -> None:
    """A command writing 100 bytes of JSON error and exiting 1: no PUT; DONE has the output."""
    error = ('{"error": "' + "x" * 86 + '"}\n').encode()
    assert len(error) == 100
    handle = await start_execserver(
        nursery,
        services={
            "fail": {
                "argv": ["sh", "-c", 'printf "%s" "$1"; exit 1', "sh", literal(error.decode())]
            }
        },
    )
    pipe = served.registry.pipe_out(Collect())
    async with connect(handle) as peer:
        offer = await peer.want("small", "fail")
        assert isinstance(offer, p.Offer)
        job = {"stdout_url": served.url(pipe)}
        await peer.send(
            p.Job(job_id="small", token=offer.token, service="fail", subject=None, job=job)
        )
        done = await peer.done("small")
    assert (done.receipt.status, done.receipt.error) == ("failed", "exit status 1")
    assert done.receipt.stdout_prefix == error.decode()
    assert done.receipt.stdout_bytes == 100
    assert pipe.state == "open"
    pipe.close()


# A stray that escapes the job's process tree entirely: out of its session, away
# from its parent (a double fork) and without the job's tag (a clean environment),
# holding the job's stdout. Only a cgroup would still hold it.
STRAY = (
    "import os, sys\n"
    "sys.stdout.buffer.write(b'x' * 10000); sys.stdout.flush()\n"
    "reader, writer = os.pipe()\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    child = os.fork()\n"
    "    if child == 0:\n"
    "        os.execve('/bin/sleep', ['sleep', '300'], dict())\n"
    "    os.write(writer, str(child).encode())\n"
    "    os._exit(0)\n"
    "os.close(writer)\n"
    "open(sys.argv[1], 'w').write(os.read(reader, 100).decode())\n"
)


async def test_stdout_held_open_by_a_stray_aborts_the_put(
    jobs_dir: Path, served: Served, tmp_path: Path
) -> None:
    """An escaped process holds stdout open: the PUT is cut off, the receipt says why."""
    pid_file = tmp_path / "stray.pid"
    runner = make_runner(jobs_dir, {"stray": (PY, "-c", STRAY, str(pid_file))})
    pipe = served.registry.pipe_out(Collect())
    try:
        receipt = await run_job(runner, "stray", stdout_url=served.url(pipe))
    finally:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert (receipt.status, receipt.exit_code) == ("stopped", 0)
    assert receipt.error == (
        "stdout stayed open after the command ended; the output stream was aborted"
    )
    assert receipt.stdout_bytes == 10000
    assert isinstance(await ended(pipe), PipeAborted)


async def test_slow_client_after_the_command_ended_gets_everything(
    jobs_dir: Path,
    nursery: trio.Nursery,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mock_clock: trio.testing.MockClock,
) -> None:
    """Output still on its way to a slow client when the command exits is waited for, not cut off.

    The out-pipe is a small HTTP server (h11 on a socket with a tiny receive
    buffer) that reads no body until released, so the runner is stuck sending
    when the command exits. The release comes after five of the runner's
    windows for a silent stdout (shortened here) have passed: a rule that gave
    stdout that window, busy or not, would have cut the PUT off by then.
    """
    mock_clock.rate = 1.0  # real speed, plus the jumps below
    monkeypatch.setattr(pipe_io, "_OUTPUT_DRAIN_TIMEOUT", 0.2)
    draining = trio.Event()  # the runner waits for the end of the output
    wait_output_end = command_module._CommandJob.wait_output_end

    async def watched(job: command_module._CommandJob) -> None:
        draining.set()
        await wait_output_end(job)

    monkeypatch.setattr(command_module._CommandJob, "wait_output_end", watched)
    size = 120 * 1024  # the runner takes 64 KiB, the pipe holds the rest: the command can exit
    release = trio.Event()
    received: list[int] = []

    async def serve(stream: trio.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER)
        body = 0
        async with stream:
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    if connection.their_state is h11.SEND_BODY:
                        await release.wait()
                    connection.receive_data(await stream.receive_some(CHUNK))
                elif isinstance(event, h11.Data):
                    body += len(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    received.append(-body)  # cut off
                    return
            received.append(body)
            await stream.send_all(connection.send(h11.Response(status_code=204, headers=[])))
            await stream.send_all(connection.send(h11.EndOfMessage()))

    listener = trio.socket.socket()
    listener.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    nursery.start_soon(trio.serve_listeners, serve, [trio.SocketListener(listener)])
    code = (
        "import os, sys; open(sys.argv[1], 'w').write(str(os.getpid()) + chr(10)); "
        f"sys.stdout.buffer.write(b'y' * {size})"
    )
    runner = make_runner(jobs_dir, {"burst": (PY, "-c", code, "{fifo}")})
    receipts: list[Receipt] = []

    async def job() -> None:
        with trio.fail_after(WAIT):
            receipts.append(
                await runner.run(
                    JobRequest(
                        job_id="slow",
                        service="burst",
                        job={
                            "params": {"fifo": str(fifo_path)},
                            "stdout_url": f"http://127.0.0.1:{port}/pipe/slow",
                        },
                    ),
                    JobControl(),
                )
            )

    fifo_path = tmp_path / "pid"
    async with open_fifo(fifo_path) as fifo, trio.open_nursery() as jobs:
        jobs.start_soon(job)
        pid = int(await read_line(fifo))
        pidfd = procgroup.open_pidfd(pid)
        if pidfd is not None:  # None: it is gone already
            try:
                with trio.fail_after(WAIT):
                    await trio.lowlevel.wait_readable(pidfd)  # readable once it exited
            finally:
                trio.lowlevel.notify_closing(pidfd)
                os.close(pidfd)
        with trio.fail_after(WAIT):
            await draining.wait()
        # Let five shortened windows pass while the client takes nothing: jump the
        # clock in steps, letting every task run to its next wait in between.
        for _ in range(5):
            mock_clock.jump(0.2)
            await trio.testing.wait_all_tasks_blocked()
        release.set()
    (receipt,) = receipts
    assert (receipt.status, receipt.error) == ("ok", None)
    assert received == [size]
