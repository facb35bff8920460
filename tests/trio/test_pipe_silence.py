"""A pipe that goes silent is that stream's failure (``stopped``), not a stall of the command.

Real commands run by a real :class:`CommandRunner`, their pipes served over real
HTTP on 127.0.0.1 by the client's registry. The client side goes silent here by
its source or its sink waiting for ever: to the execserver that is the same as a
network that moves nothing (a read that gets no bytes, a write that is not taken);
tests/network/test_faults.py cuts a real network between two hosts.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.trio.test_pipes import (  # the shared fixtures and helpers of the pipe tests
    Collect,
    MiB,
    Served,
    jobs_dir,
    pattern,
    run_job,
    served,
    source_of,
)
from trio_broker.trio.command import CommandRunner, CommandSpec

__all__ = ["jobs_dir", "served"]  # fixtures, imported for pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the runner reads /proc")

STALL = 0.5


def stalling_runner(jobs_dir: Path, argv: tuple[str, ...]) -> CommandRunner:
    return CommandRunner(
        {"svc": CommandSpec(argv=argv, stall_timeout=STALL, timeout=30.0)},
        temp_dir=str(jobs_dir),
        instance_id="inst-1",
        sample_interval=0.1,
        kill_grace=1.0,
    )


async def silent_after(size: int) -> AsyncIterator[bytes]:
    """``size`` bytes, then nothing ever again (the body stays open)."""
    yield pattern(size)
    await trio.sleep_forever()


class SilentSink(Collect):
    """A sink that takes ``size`` bytes and then never returns."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    async def __call__(self, chunk: bytes) -> None:
        if len(self.data) >= self.size:
            await trio.sleep_forever()
        await super().__call__(chunk)


async def test_a_silent_in_pipe_stops_the_job_naming_the_stream(
    jobs_dir: Path, served: Served
) -> None:
    """cat waits for input the in-pipe never gets: the job ends stopped, not stalled, and the
    sentence names the input stream, its listener and how long it moved nothing."""
    runner = stalling_runner(jobs_dir, ("cat",))
    in_pipe = served.registry.pipe_in(silent_after(MiB))
    out_pipe = served.registry.pipe_out(Collect())
    try:
        receipt = await run_job(
            runner, "svc", stdin_url=served.url(in_pipe), stdout_url=served.url(out_pipe)
        )
    finally:
        in_pipe.close()
        out_pipe.close()
    assert receipt.status == "stopped", receipt
    assert receipt.error is not None
    assert receipt.error.startswith(f"the input stream from {served.base} moved no bytes for "), (
        receipt.error
    )
    assert f"s after {MiB} bytes: the network or the client went silent" in receipt.error
    assert receipt.stdin_bytes == MiB


async def test_a_silent_out_pipe_stops_the_job_naming_the_stream(
    jobs_dir: Path, served: Served
) -> None:
    """A client that stops taking the output blocks the command's stdout: the job ends
    stopped, and the sentence names the output stream."""
    runner = stalling_runner(jobs_dir, ("cat", "/dev/zero"))
    out_pipe = served.registry.pipe_out(SilentSink(MiB))
    try:
        receipt = await run_job(runner, "svc", stdout_url=served.url(out_pipe))
    finally:
        out_pipe.close()
    assert receipt.status == "stopped", receipt
    assert receipt.error is not None
    assert receipt.error.startswith(f"the output stream to {served.base} took no bytes for ")
    assert "the network or the client went silent" in receipt.error


async def test_a_command_stalling_with_its_pipes_full_is_still_stalled(
    jobs_dir: Path, served: Served
) -> None:
    """A command that reads none of the input waiting for it stalls by itself: the in-pipe
    waits on the command, not on the network, so the verdict stays stalled."""
    runner = stalling_runner(jobs_dir, ("sleep", "30"))
    in_pipe = served.registry.pipe_in(source_of(64 * MiB))
    try:
        receipt = await run_job(runner, "svc", stdin_url=served.url(in_pipe))
    finally:
        in_pipe.close()
    assert (receipt.status, receipt.error) == ("stalled", f"stalled: no progress for {STALL}s")
