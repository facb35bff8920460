"""Pipes through BrokerClient: URLs from each connection's own address, the callback check."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from tests.support.haproxy import open_haproxy
from tests.support.wire import WAIT, start_execserver
from tests.trio.test_client import client_config
from trio_broker.trio.client import open_broker_client
from trio_broker.trio.pipes import PipeAborted, PipeRegistry, serve_pipes

SERVICES = {
    "cat": {"argv": ["cat"]},
    # \173 and \175 are braces (a literal brace would be a template placeholder).
    "fail": {"argv": ["sh", "-c", r"""printf '\173"error": "bad input"\175'; exit 1"""]},
    "spew": {"argv": ["sh", "-c", "head -c 10000000 /dev/zero; echo broke >&2; kill -9 $$"]},
}


async def chunks(data: bytes, size: int = 65536) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


class Collect:
    def __init__(self) -> None:
        self.data = bytearray()

    async def __call__(self, chunk: bytes) -> None:
        self.data += chunk


async def test_a_job_streams_stdin_and_stdout_through_the_clients_pipes() -> None:
    """A cat job reads its stdin from the client's in-pipe and writes stdout to its out-pipe."""
    payload = bytes(range(256)) * 4096  # 1 MiB, more than the 4000-byte hold-back
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, services=SERVICES)
        async with open_broker_client(client_config(handle), listen="127.0.0.1") as client:
            sink = Collect()
            stdout = client.pipe_out(sink)
            receipt = await client.run(
                "cat", {}, stdin=client.pipe_in(chunks(payload)), stdout=stdout
            )
            assert receipt.status == "ok"
            assert (receipt.stdin_bytes, receipt.stdout_bytes) == (len(payload), len(payload))
            assert stdout.outcome() == len(payload)
            assert bytes(sink.data) == payload
            assert len(client.pipes) == 0  # both pipes ended with the job
        nursery.cancel_scope.cancel()


async def test_a_failing_command_with_small_output_never_opens_the_out_pipe() -> None:
    """100 bytes of error on stdout and exit 1: no PUT; the receipt carries the output."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, services=SERVICES)
        async with open_broker_client(client_config(handle), listen="127.0.0.1") as client:
            sink = Collect()
            stdout = client.pipe_out(sink)
            receipt = await client.run("fail", {}, stdout=stdout)
            assert receipt.status == "failed"
            assert receipt.stdout_prefix == '{"error": "bad input"}'
            assert sink.data == b""
            assert stdout.state == "closed"  # never used by any request
        nursery.cancel_scope.cancel()


async def test_a_command_dying_mid_stream_aborts_the_out_pipe() -> None:
    """A command killed after 10 MB of output: the sink sees an aborted stream, the receipt why."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, services=SERVICES)
        async with open_broker_client(client_config(handle), listen="127.0.0.1") as client:
            sink = Collect()
            stdout = client.pipe_out(sink)
            receipt = await client.run("spew", {}, stdout=stdout)
            assert receipt.status == "failed"
            assert receipt.error
            assert receipt.stderr_line == "broke"
            # the receipt may arrive before the client's handler has seen the cut body
            with trio.fail_after(WAIT), pytest.raises(PipeAborted):
                await stdout.wait()
            assert len(sink.data) <= 10_000_000
        nursery.cancel_scope.cancel()


async def test_two_clients_on_loopback_aliases_get_their_own_pipe_urls() -> None:
    """Clients on 127.0.0.2 and 127.0.0.3 listening only there: each job's pipes are fetched
    from its own client's address (any other address would be refused)."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, services=SERVICES, listen="127.0.0.1:0")
        async with (
            open_broker_client(
                client_config(handle, backend_id="two"), local_host="127.0.0.2", listen="127.0.0.2"
            ) as two,
            open_broker_client(
                client_config(handle, backend_id="three"),
                local_host="127.0.0.3",
                listen="127.0.0.3",
            ) as three,
        ):
            for client, text in ((two, b"from two\n"), (three, b"from three\n")):
                sink = Collect()
                receipt = await client.run(
                    "cat", {}, stdin=client.pipe_in(chunks(text)), stdout=client.pipe_out(sink)
                )
                assert receipt.status == "ok"
                assert bytes(sink.data) == text
            checks = {
                c.register.backend_id: (c.register.callback_url, c.callback_check)
                for c in handle.broker.statistics().connections
                if c.register is not None
            }
            assert checks["two"][0].startswith("http://127.0.0.2:")  # type: ignore[union-attr]
            assert checks["three"][0].startswith("http://127.0.0.3:")  # type: ignore[union-attr]
            await handle.wait_until(
                lambda: all(
                    c.callback_check == "ok" for c in handle.broker.statistics().connections
                )
            )
        nursery.cancel_scope.cancel()


async def test_two_client_replicas_behind_one_balancer_callback_are_reported() -> None:
    """Client replicas r1 and r2 register one balanced callback URL: of r1's two checks
    (one per execserver, made before r2 connects) the balancer sends one to r2, and that
    execserver reports the mismatch."""
    async with trio.open_nursery() as nursery:
        a = await start_execserver(nursery, services=SERVICES)
        b = await start_execserver(nursery, services=SERVICES)
        registries = [PipeRegistry("r1"), PipeRegistry("r2")]
        ports = [await nursery.start(serve_pipes, r, "127.0.0.1", 0) for r in registries]
        async with open_haproxy(
            [("127.0.0.1", port) for port in ports], mode="http", health_path="/whoami"
        ) as proxy:
            shared = {"callback_url": proxy.http_url}

            def checks() -> list[str]:
                return [
                    c.callback_check
                    for h in (a, b)
                    for c in h.broker.statistics().connections
                    if c.callback_check is not None
                ]

            async with open_broker_client(
                client_config(a, b, backend_id="r1", **shared), pipes=registries[0]
            ):
                with trio.fail_after(WAIT):
                    await a.wait_until(lambda: len(checks()) == 2)
                    await b.wait_until(lambda: len(checks()) == 2)
                async with open_broker_client(
                    client_config(a, backend_id="r2", **shared), pipes=registries[1]
                ):
                    with trio.fail_after(WAIT):
                        await a.wait_until(lambda: len(checks()) == 3)
                    mismatches = [c for c in checks() if c.startswith("mismatch")]
                    assert mismatches, checks()
                    assert any("answered backend_id 'r2', not 'r1'" in m for m in mismatches)
        nursery.cancel_scope.cancel()
