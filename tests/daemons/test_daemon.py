"""The reference execserver daemon as a real process: config errors and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from trio_websocket import ConnectionClosed

from tests.support.processes import open_execserver_process
from tests.support.wire import WAIT, Peer, connect
from trio_broker.core import protocol as p


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_broker_daemons", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("services:\n  s: {builtin: noop, max_slots: two}\n", "services.s.max_slots: expected"),
        (
            "offer_ttl: ten seconds\nservices:\n  s: {builtin: noop}\n",
            "offer_ttl: invalid duration",
        ),
        ("slotz: 3\nservices:\n  s: {builtin: noop}\n", "slotz: unknown key"),
        ("services:\n  s: {argv: [echo], bultin: noop}\n", "services.s.bultin: unknown key"),
        ("services: {}\n", "services"),
        ("services: [\n", "line"),
        ("cgroup: yes please\nservices:\n  s: {builtin: noop}\n", "cgroup: expected one of"),
    ],
    ids=[
        "type",
        "duration",
        "unknown-key",
        "nested-unknown-key",
        "no-services",
        "yaml",
        "cgroup",
    ],
)
def test_bad_config_exits_2_naming_the_key(tmp_path: Path, text: str, line: str) -> None:
    config = tmp_path / "exec.yml"
    config.write_text(text)
    result = run_cli("execserver", "--config", str(config))
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert line in lines[0]
    assert lines[0].startswith("trio-broker execserver: ")


@pytest.mark.parametrize("where", ["file", "environment"])
def test_a_job_user_not_on_this_host_exits_2(tmp_path: Path, where: str) -> None:
    """An unknown job_user stops the start with one line naming the key, from either source."""
    environ = {k: v for k, v in os.environ.items() if k != "TRIO_BROKER_JOB_USER"}
    text = "services:\n  s: {builtin: noop}\n"
    if where == "file":
        text = "job_user: no-such-user-here\n" + text
    else:
        environ["TRIO_BROKER_JOB_USER"] = "no-such-user-here"
    config = tmp_path / "exec.yml"
    config.write_text(text)
    result = run_cli("execserver", "--config", str(config), env=environ)
    assert result.returncode == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert "job_user: no user 'no-such-user-here' on this host" in line


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = run_cli("execserver", "--config", str(tmp_path / "nope.yml"))
    assert result.returncode == 2
    assert "nope.yml" in result.stderr


@asynccontextmanager
async def daemon(extra: str = "") -> AsyncIterator[tuple[trio.Process, str]]:
    config = (
        "listen: 127.0.0.1:0\nslots: 2\nunknown_share: 1.0\nfast_reserve: 0\n"
        + extra
        + "services:\n  hold: {builtin: sleep}\n"
    )
    async with open_execserver_process(config, log_level="info", ready_within=WAIT) as running:
        yield running.process, running.url


async def _start_hold(peer: Peer, job_id: str, seconds: float) -> None:
    offer = await peer.want(job_id, "hold")
    assert isinstance(offer, p.Offer)
    await peer.run(offer, "hold", {"seconds": seconds})
    await peer.send(p.Query(job_id=job_id))
    position = await peer.expect(p.Position)
    assert position.ahead == 0  # running (or about to)


async def test_sigterm_drains_and_exits_0() -> None:
    """SIGTERM: HELLO draining at once, the running job finishes, 1001, exit 0."""
    async with daemon() as (process, url), connect(url) as peer:
        await _start_hold(peer, "finishing", 1.0)
        process.send_signal(signal.SIGTERM)
        hello = await peer.recv(skip_hello=False)
        assert isinstance(hello, p.Hello)
        assert hello.draining
        done = await peer.done("finishing")
        assert done.receipt.status == "ok"
        with pytest.raises(ConnectionClosed) as closed:
            await peer.recv()
        assert closed.value.reason is not None
        assert closed.value.reason.code == 1001
        with trio.fail_after(WAIT):
            assert await process.wait() == 0


async def test_second_signal_stops_at_once() -> None:
    """A second signal ends running jobs with receipts 'stopped', then exit 0."""
    async with daemon("drain_timeout: 10m\n") as (process, url), connect(url) as peer:
        await _start_hold(peer, "long", 600)
        process.send_signal(signal.SIGINT)
        hello = await peer.recv(skip_hello=False)
        assert isinstance(hello, p.Hello)
        assert hello.draining
        process.send_signal(signal.SIGINT)
        done = await peer.done("long")
        assert done.receipt.status == "stopped"
        with trio.fail_after(WAIT):
            assert await process.wait() == 0
