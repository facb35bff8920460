"""CommandRunner with real subprocesses: receipts, supervision, process groups, cleanup."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
import trio.testing

from trio_broker.core.argv import TemplateError
from trio_broker.core.protocol import Receipt
from trio_broker.trio.command import CommandRunner, CommandSpec
from trio_broker.trio.procgroup import TAG_ENV, JobTag, process_start
from trio_broker.trio.runner import JobControl, JobRequest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the runner reads /proc")

PY = sys.executable
MB = 1_000_000
WAIT = 30  # seconds: the bound on every wait; these 2-core machines are noisy

# A program that grows to 300 MB in 5 MB steps, then idles.
GROW_300_MB = """
import select, signal
chunks = []
for _ in range(60):
    chunks.append(b"x" * 5_000_000)
    select.select([], [], [], 0.005)
signal.pause()
"""


@pytest.fixture
def jobs_dir(tmp_path: Path) -> Iterator[Path]:
    """The runner's temp_dir; every work directory must be gone when the test ends."""
    path = tmp_path / "jobs"
    path.mkdir()
    yield path
    assert list(path.iterdir()) == []


def make_runner(
    jobs_dir: Path, services: Mapping[str, CommandSpec], **kwargs: Any
) -> CommandRunner:
    options: dict[str, Any] = {
        "temp_dir": str(jobs_dir),
        "instance_id": "inst-1",
        "sample_interval": 0.1,
        "kill_grace": 1.0,
    }
    options.update(kwargs)
    return CommandRunner(services, **options)


async def run(
    runner: CommandRunner,
    service: str = "svc",
    params: Mapping[str, Any] | None = None,
    control: JobControl | None = None,
) -> Receipt:
    job = {} if params is None else {"params": dict(params)}
    with trio.fail_after(WAIT):
        return await runner.run(
            JobRequest(job_id="job-1", service=service, job=job), control or JobControl()
        )


async def run_argv(
    jobs_dir: Path, *argv: str, params: Mapping[str, Any] | None = None, **spec: Any
) -> Receipt:
    runner = make_runner(jobs_dir, {"svc": CommandSpec(argv=argv, **spec)})
    return await run(runner, params=params)


@asynccontextmanager
async def open_fifo(path: Path) -> AsyncIterator[trio.lowlevel.FdStream]:
    """A named pipe the command writes to, read without polling.

    Opened read-write so that reads block until a writer sends data, instead of
    seeing end-of-file while no writer has opened it yet.
    """
    os.mkfifo(path)
    stream = trio.lowlevel.FdStream(os.open(path, os.O_RDWR | os.O_NONBLOCK))
    try:
        yield stream
    finally:
        await stream.aclose()


async def read_line(stream: trio.lowlevel.FdStream) -> str:
    data = b""
    with trio.fail_after(WAIT):
        while not data.endswith(b"\n"):
            data += await stream.receive_some(1024)
    return data.decode()


def is_gone(pid: int) -> bool:
    """True when the process no longer runs (a zombie left for init counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- plain outcomes ---------------------------------------------------------------


async def test_ok_receipt(jobs_dir: Path) -> None:
    """Exit 0 is ok, with stdout's prefix and byte count, the runner's instance id, no error."""
    receipt = await run_argv(jobs_dir, "sh", "-c", "printf 'hello\\nworld\\n'")
    assert receipt.status == "ok"
    assert receipt.exit_code == 0
    assert receipt.error is None
    assert receipt.stdout_prefix == "hello\nworld\n"
    assert receipt.stdout_bytes == 12
    assert receipt.stdin_bytes == 0
    assert receipt.stderr_line is None
    assert receipt.instance_id == "inst-1"
    assert receipt.peak_memory is not None
    assert 0 <= receipt.duration_s < WAIT


async def test_no_output_is_an_empty_prefix(jobs_dir: Path) -> None:
    """A command that prints nothing has stdout_prefix "" and stdout_bytes 0."""
    receipt = await run_argv(jobs_dir, "true")
    assert (receipt.status, receipt.stdout_prefix, receipt.stdout_bytes) == ("ok", "", 0)


async def test_failed_with_exit_status_and_last_stderr_line(jobs_dir: Path) -> None:
    """A non-zero exit is failed, with the exit code and the last non-empty stderr line."""
    script = "echo first >&2; printf '  last words  \\n\\n  \\n' >&2; exit 3"
    receipt = await run_argv(jobs_dir, "sh", "-c", script)
    assert receipt.status == "failed"
    assert receipt.exit_code == 3
    assert receipt.error == "exit status 3"
    assert receipt.stderr_line == "last words"


async def test_stderr_line_without_newline_and_carriage_returns(jobs_dir: Path) -> None:
    """A progress line ended by \\r counts as a line, and so does an unterminated last line."""
    receipt = await run_argv(jobs_dir, "sh", "-c", "printf 'frame 1\\rframe 2\\rdone' >&2")
    assert receipt.stderr_line == "done"
    receipt = await run_argv(jobs_dir, "sh", "-c", "printf 'frame 1\\rframe 2\\r' >&2")
    assert receipt.stderr_line == "frame 2"


async def test_long_stderr_line_is_bounded(jobs_dir: Path) -> None:
    """stderr_line keeps the last 1000 characters of a huge line."""
    code = "import sys; sys.stderr.write('é' * 100000 + 'END')"
    receipt = await run_argv(jobs_dir, PY, "-c", code)
    assert receipt.stderr_line == "é" * 997 + "END"


async def test_killed_by_signal(jobs_dir: Path) -> None:
    """A command killed by a signal fails with a negative exit code."""
    receipt = await run_argv(jobs_dir, "sh", "-c", "kill -9 $$")
    assert receipt.status == "failed"
    assert receipt.exit_code == -9
    assert receipt.error == "killed by signal 9"


@pytest.mark.parametrize(
    ("output", "prefix"),
    [
        (b"a" * 3999 + "é".encode() + b"b" * 10, "a" * 3999),  # é is bytes 3999-4000
        (b"a" * 3998 + "é".encode() + b"b" * 10, "a" * 3998 + "é"),  # é ends at byte 4000
        (b"a" * 3998 + "€".encode(), "a" * 3998),  # 3-byte char straddling
        (b"a" * 3997 + "𝄞".encode(), "a" * 3997),  # 4-byte char straddling
        (b"a" * 3000 + b"\xff" + b"z", "<3002 bytes of binary output>"),  # not UTF-8: binary
    ],
    ids=["2-byte-straddle", "2-byte-fits", "3-byte-straddle", "4-byte-straddle", "invalid"],
)
async def test_stdout_prefix_is_cut_at_a_character_boundary(
    jobs_dir: Path, output: bytes, prefix: str
) -> None:
    """The prefix is at most 4000 bytes, never ends inside a character, and counts all bytes."""
    write = "import sys; sys.stdout.buffer.write(bytes.fromhex(sys.argv[1]))"
    receipt = await run_argv(jobs_dir, PY, "-c", write, "{data}", params={"data": output.hex()})
    assert receipt.status == "ok"
    assert receipt.stdout_prefix == prefix
    assert receipt.stdout_bytes == len(output)


async def test_big_output_is_counted_and_cut(jobs_dir: Path) -> None:
    """Megabytes of output are all read and counted; the receipt keeps 4000 bytes."""
    code = "import sys; sys.stdout.write('x' * 3_000_000); sys.stdout.flush()"
    receipt = await run_argv(jobs_dir, PY, "-c", code)
    assert receipt.status == "ok"
    assert receipt.stdout_prefix == "x" * 4000
    assert receipt.stdout_bytes == 3_000_000


# -- starting -----------------------------------------------------------------------


async def test_unknown_service(jobs_dir: Path) -> None:
    """A service the runner does not know gives an error receipt, no process."""
    runner = make_runner(jobs_dir, {})
    receipt = await run(runner, service="x")
    assert receipt.status == "error"
    assert receipt.error == "unknown service 'x'"
    assert receipt.exit_code is None
    assert receipt.peak_memory is None


@pytest.mark.parametrize(
    ("params", "error"),
    [
        (None, "missing parameter 'text'"),
        ({}, "missing parameter 'text'"),
        ({"text": {"a": 1}}, "parameter 'text' must be a string, number or boolean"),
        ({"text": [1]}, "parameter 'text' must be a string, number or boolean"),
        ({"text": None}, "parameter 'text' must be a string, number or boolean"),
        ({"text": "a\0b"}, "parameter 'text' must not contain a NUL character"),
    ],
)
async def test_bad_parameters_are_error_receipts(
    jobs_dir: Path, params: dict[str, Any] | None, error: str
) -> None:
    """Parameters that cannot fill the template give status error and run nothing."""
    receipt = await run_argv(jobs_dir, "echo", "{text}", params=params)
    assert receipt.status == "error"
    assert receipt.error == error
    assert receipt.exit_code is None
    assert receipt.peak_memory is None


async def test_params_must_be_an_object(jobs_dir: Path) -> None:
    """A job whose params member is not an object gives an error receipt."""
    runner = make_runner(jobs_dir, {"svc": CommandSpec(argv=("true",))})
    with trio.fail_after(WAIT):
        receipt = await runner.run(
            JobRequest(job_id="j", service="svc", job={"params": [1, 2]}), JobControl()
        )
    assert (receipt.status, receipt.error) == ("error", "params must be an object")


async def test_command_not_found(jobs_dir: Path) -> None:
    """A missing executable is an error receipt naming argv[0] and the OS reason."""
    receipt = await run_argv(jobs_dir, "/nonexistent/trio-broker-prog", "x")
    assert receipt.status == "error"
    assert receipt.error == "cannot run '/nonexistent/trio-broker-prog': No such file or directory"
    assert receipt.exit_code is None
    assert receipt.peak_memory is None


async def test_command_not_executable(jobs_dir: Path, tmp_path: Path) -> None:
    """A file without execute permission is an error receipt with the OS reason."""
    program = tmp_path / "not-executable"
    program.write_text("#!/bin/sh\n")
    receipt = await run_argv(jobs_dir, str(program))
    assert receipt.status == "error"
    assert receipt.error == f"cannot run '{program}': Permission denied"


async def test_placeholders_are_filled_without_a_shell(jobs_dir: Path) -> None:
    """Numbers print as JSON, booleans as true/false, {{ }} are literal, nothing is shell syntax."""
    params = {"n": 3, "f": 2.5, "big": 1e21, "yes": True, "no": False, "s": "a b; $(rm -rf /)"}
    argv = ("printf", "%s|", "{n}", "{f}", "{big}", "{yes}", "{no}", "{{lit}}", "x{s}y", "{n}{n}")
    receipt = await run_argv(jobs_dir, *argv, params=params)
    assert receipt.status == "ok"
    assert receipt.stdout_prefix == "3|2.5|1e+21|true|false|{lit}|xa b; $(rm -rf /)y|33|"


def test_spec_validation() -> None:
    """A CommandSpec parses its template once and refuses malformed ones and bad limits."""
    spec = CommandSpec(argv=["prog", "a{x}b", "{{}}"])
    assert spec.argv is not None
    assert spec.argv.placeholders == {"x"}
    assert spec.argv.fill({"x": -1}) == ("prog", "a-1b", "{}")
    for bad, reason in [
        ("{", "a single '{'"),
        ("}", "a single '}'"),
        ("a{}b", "invalid placeholder"),
        ("{x", "a single '{'"),
        ("{x:}", "invalid placeholder"),
        ("{x.y}", "invalid placeholder"),
    ]:
        with pytest.raises(TemplateError, match=rf"^argv\[1\]: .*{re.escape(reason)}"):
            CommandSpec(argv=("prog", bad))
    with pytest.raises(TemplateError, match=r"^argv\[0\]: expected the program"):
        CommandSpec(argv=("{tool}", "x"))
    with pytest.raises(ValueError, match="exactly one"):
        CommandSpec(argv=("x",), builtin="noop")
    with pytest.raises(ValueError, match="exactly one"):
        CommandSpec()
    with pytest.raises(ValueError, match="threads"):
        CommandSpec(builtin="noop", threads=0)
    with pytest.raises(ValueError, match="timeout"):
        CommandSpec(builtin="noop", timeout=0)


async def test_environment(
    jobs_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child sees runner env, then spec env, and the two supervision variables win."""
    script = 'echo "$FYLR_EXEC_SUPERVISED $FYLR_CONVERT_THREADS $A $B"'
    with caplog.at_level(logging.WARNING, logger="trio_broker.trio.command"):
        runner = make_runner(
            jobs_dir,
            {
                "svc": CommandSpec(
                    argv=("sh", "-c", script),
                    threads=3,
                    env={"B": "spec", "FYLR_CONVERT_THREADS": "99"},
                )
            },
            env={"A": "runner", "B": "runner", "FYLR_EXEC_SUPERVISED": "0"},
        )
    receipt = await run(runner)
    assert receipt.stdout_prefix == "1 3 runner spec\n"
    warnings = [record.getMessage() for record in caplog.records]
    assert any("runner env sets FYLR_EXEC_SUPERVISED" in w for w in warnings)
    assert any("service 'svc' env sets FYLR_CONVERT_THREADS" in w for w in warnings)


async def test_the_job_environment_holds_nothing_of_the_runners_but_the_fixed_set(
    jobs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's environment is PATH, HOME, LANG, TMPDIR, the FYLR_* pair, its tag and the env."""
    monkeypatch.setenv("TRIO_BROKER_TEST_SECRET", "the daemon's own")
    monkeypatch.setenv("FYLR_SOMETHING_ELSE", "not configured either")
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.delenv("TMPDIR", raising=False)
    runner = make_runner(
        jobs_dir, {"svc": CommandSpec(argv=("env",), env={"S": "spec"})}, env={"R": "runner"}
    )
    receipt = await run(runner)
    assert receipt.status == "ok", receipt
    seen = dict(line.split("=", 1) for line in receipt.stdout_prefix.splitlines())
    expected = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
    expected |= {"R": "runner", "S": "spec", "FYLR_EXEC_SUPERVISED": "1"}
    expected |= {"FYLR_CONVERT_THREADS": "1"}
    tag = JobTag.parse(seen.pop(TAG_ENV))
    assert tag is not None
    assert (tag.owner_pid, tag.owner_start) == (os.getpid(), process_start(os.getpid()))
    assert seen == expected


async def test_work_directory_is_fresh_and_removed(jobs_dir: Path) -> None:
    """The command runs in a new directory under temp_dir, removed afterwards with its files."""
    receipt = await run_argv(jobs_dir, "sh", "-c", "pwd; ls -A | wc -l; mkdir d; echo x > d/f")
    workdir, entries = receipt.stdout_prefix.split()
    assert Path(workdir).parent == jobs_dir
    assert Path(workdir).name.startswith("trio-broker-work-")
    assert entries == "0"
    assert not await trio.Path(workdir).exists()


# -- supervision --------------------------------------------------------------------


async def test_timeout(jobs_dir: Path) -> None:
    """A command past its wall-clock timeout is timed_out; SIGTERM ended it."""
    receipt = await run_argv(jobs_dir, "sleep", "30", timeout=0.5, stall_timeout=None)
    assert receipt.status == "timed_out"
    assert receipt.error == "timed out after 0.5s"
    assert receipt.exit_code == -signal.SIGTERM
    assert 0.5 <= receipt.duration_s < WAIT


async def test_stall(jobs_dir: Path) -> None:
    """A command that neither computes nor writes is stalled after stall_timeout."""
    receipt = await run_argv(jobs_dir, "sleep", "30", stall_timeout=0.5, timeout=WAIT)
    assert receipt.status == "stalled"
    assert receipt.error == "stalled: no progress for 0.5s"
    assert receipt.exit_code == -signal.SIGTERM


@pytest.mark.parametrize(
    "code",
    [
        "while True: pass",
        "import time\nwhile True:\n    print('x', flush=True)\n    time.sleep(0.05)",
        "import time\nwith open('out', 'wb', 0) as f:\n"
        "    while True:\n        f.write(b'x' * 100)\n        time.sleep(0.05)",
    ],
    ids=["cpu", "output", "files"],
)
async def test_progress_is_not_a_stall(jobs_dir: Path, code: str) -> None:
    """Busy CPU, steady output or a growing file keep a job alive past a short stall timeout."""
    receipt = await run_argv(jobs_dir, PY, "-c", code, stall_timeout=0.5, timeout=2.0)
    assert receipt.status == "timed_out", receipt.error


async def test_own_memory_ceiling(jobs_dir: Path) -> None:
    """A command growing past its memory_limit is out_of_memory with a sentence naming both."""
    receipt = await run_argv(
        jobs_dir, PY, "-c", GROW_300_MB, memory_limit=100 * MB, timeout=WAIT, stall_timeout=None
    )
    assert receipt.status == "out_of_memory"
    assert receipt.error is not None
    assert receipt.error.startswith("out of memory: ")
    assert receipt.error.endswith(" exceeds the job's ceiling of 100 MB")
    assert receipt.peak_memory is not None
    assert receipt.peak_memory > 100 * MB
    assert receipt.exit_code == -signal.SIGTERM


async def test_shared_memory_budget_ends_the_largest_job(jobs_dir: Path, tmp_path: Path) -> None:
    """Over the shared budget, the largest job is out_of_memory and a small neighbour lives on."""
    runner = make_runner(
        jobs_dir,
        {
            "big": CommandSpec(argv=(PY, "-c", GROW_300_MB), timeout=WAIT, stall_timeout=None),
            "small": CommandSpec(
                argv=("sh", "-c", 'echo started > "$1"; exec sleep 300', "sh", "{fifo}"),
                stall_timeout=None,
            ),
        },
        memory_budget=150 * MB,
    )
    small_control = JobControl()
    receipts: dict[str, Receipt] = {}

    async def small() -> None:
        receipts["small"] = await run(runner, "small", {"fifo": str(fifo_path)}, small_control)

    fifo_path = tmp_path / "fifo"
    async with open_fifo(fifo_path) as fifo, trio.open_nursery() as nursery:
        nursery.start_soon(small)
        await read_line(fifo)
        receipts["big"] = await run(runner, "big")
        small_control.abort("cancelled", "cancelled by the client")
    big = receipts["big"]
    assert big.status == "out_of_memory"
    assert big.error is not None
    assert "exceeds the shared budget of 150 MB, and this job holds the most" in big.error
    assert receipts["small"].status == "cancelled"
    assert runner.statistics().memory_used == 0


# -- ending the process group -------------------------------------------------------


GRANDCHILD = 'sleep 300 & echo "$!" > "$1"; wait'
TERM_PROOF_GRANDCHILD = '(trap "" TERM; exec sleep 300) & echo "$$ $!" > "$1"; wait'


async def test_abort_kills_the_whole_group(jobs_dir: Path, tmp_path: Path) -> None:
    """abort('cancelled') ends the leader and a grandchild that ignores SIGTERM, then reports."""
    runner = make_runner(
        jobs_dir, {"svc": CommandSpec(argv=("sh", "-c", TERM_PROOF_GRANDCHILD, "sh", "{fifo}"))}
    )
    control = JobControl()
    receipts: list[Receipt] = []

    async def job() -> None:
        receipts.append(await run(runner, params={"fifo": str(fifo_path)}, control=control))

    fifo_path = tmp_path / "fifo"
    async with open_fifo(fifo_path) as fifo, trio.open_nursery() as nursery:
        nursery.start_soon(job)
        leader, grandchild = map(int, (await read_line(fifo)).split())
        assert not is_gone(grandchild)
        assert os.getpgid(grandchild) == os.getpgid(leader) == leader
        (running,) = runner.statistics().running  # registered before the spawn
        assert (running.job_id, running.service) == ("job-1", "svc")
        assert running.pid in (None, leader)
        control.abort("cancelled", "cancelled by the client")
        control.abort("stopped", "ignored: the first abort wins")
    (receipt,) = receipts
    assert receipt.status == "cancelled"
    assert receipt.error == "cancelled by the client"
    assert receipt.exit_code == -signal.SIGTERM  # the leader obeyed SIGTERM
    assert is_gone(grandchild)  # SIGKILLed with the group although it ignored SIGTERM
    assert is_gone(leader)
    assert runner.statistics().running == ()


async def test_leader_ignoring_sigterm_gets_sigkill_after_the_grace(
    jobs_dir: Path, tmp_path: Path
) -> None:
    """A group that ignores SIGTERM is SIGKILLed after kill_grace; the receipt keeps -9."""
    script = 'trap "" TERM; echo ready > "$1"; sleep 300'
    runner = make_runner(
        jobs_dir, {"svc": CommandSpec(argv=("sh", "-c", script, "sh", "{fifo}"))}, kill_grace=0.3
    )
    control = JobControl()
    receipts: list[Receipt] = []

    async def job() -> None:
        receipts.append(await run(runner, params={"fifo": str(fifo_path)}, control=control))

    fifo_path = tmp_path / "fifo"
    async with open_fifo(fifo_path) as fifo, trio.open_nursery() as nursery:
        nursery.start_soon(job)
        await read_line(fifo)
        control.abort("stopped", "the execserver is shutting down")
    (receipt,) = receipts
    assert (receipt.status, receipt.exit_code) == ("stopped", -signal.SIGKILL)
    assert receipt.error == "the execserver is shutting down"


async def test_stray_helpers_are_killed_after_a_normal_exit(jobs_dir: Path) -> None:
    """When the leader exits on its own, helpers it left in the group are killed too."""
    receipt = await run_argv(jobs_dir, "sh", "-c", 'sleep 300 & echo "$!"')
    assert receipt.status == "ok"
    assert is_gone(int(receipt.stdout_prefix))


async def test_trio_cancellation_kills_the_group_and_propagates(
    jobs_dir: Path, tmp_path: Path
) -> None:
    """Cancelling the task in run() kills the group, removes the work dir, re-raises Cancelled."""
    runner = make_runner(
        jobs_dir, {"svc": CommandSpec(argv=("sh", "-c", GRANDCHILD, "sh", "{fifo}"))}
    )
    raised: list[BaseException] = []

    async def job() -> None:
        try:
            await run(runner, params={"fifo": str(fifo_path)})
        except BaseException as exc:
            raised.append(exc)
            raise

    fifo_path = tmp_path / "fifo"
    async with open_fifo(fifo_path) as fifo, trio.open_nursery() as nursery:
        nursery.start_soon(job)
        grandchild = int(await read_line(fifo))
        leader = os.getpgid(grandchild)
        nursery.cancel_scope.cancel()
    (exc,) = raised
    assert isinstance(exc, trio.Cancelled)
    assert is_gone(grandchild)
    assert is_gone(leader)
    assert runner.statistics().running == ()
    # the jobs_dir fixture checks that the work directory is gone


async def test_abort_before_start_runs_nothing(jobs_dir: Path) -> None:
    """A job aborted before run() starts gets the abort's receipt and no process."""
    control = JobControl()
    control.abort("cancelled", "cancelled by the client")
    receipt = await run(
        make_runner(jobs_dir, {"svc": CommandSpec(argv=("true",))}), control=control
    )
    assert (receipt.status, receipt.exit_code, receipt.peak_memory) == ("cancelled", None, None)


def test_abort_status_is_checked() -> None:
    """JobControl.abort refuses a status other than cancelled or stopped."""
    control = JobControl()
    with pytest.raises(ValueError, match="abort status"):
        control.abort("ok", "nope")  # type: ignore[arg-type]
    assert not control.aborted


# -- builtins -----------------------------------------------------------------------


async def test_builtin_noop(jobs_dir: Path) -> None:
    """builtin noop is ok at once, with null exit_code and peak_memory."""
    receipt = await run(make_runner(jobs_dir, {"svc": CommandSpec(builtin="noop")}))
    assert (receipt.status, receipt.exit_code, receipt.peak_memory) == ("ok", None, None)
    assert (receipt.stdout_prefix, receipt.stdout_bytes) == ("", 0)


async def test_builtin_sleep(jobs_dir: Path, autojump_clock: trio.testing.MockClock) -> None:
    """builtin sleep holds for params.seconds (on the trio clock)."""
    runner = make_runner(jobs_dir, {"svc": CommandSpec(builtin="sleep")})
    receipt = await run(runner, params={"seconds": 20})
    assert receipt.status == "ok"
    assert receipt.duration_s == pytest.approx(20)


async def test_builtin_sleep_ends_early_on_abort(
    jobs_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """An aborted sleep ends at once with the abort's status and reason."""
    runner = make_runner(jobs_dir, {"svc": CommandSpec(builtin="sleep")})
    control = JobControl()
    receipts: list[Receipt] = []

    async def job() -> None:
        receipts.append(await run(runner, params={"seconds": 25}, control=control))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(job)
        await trio.sleep(5)
        (running,) = runner.statistics().running
        assert running.pid is None
        control.abort("stopped", "draining")
    (receipt,) = receipts
    assert (receipt.status, receipt.error) == ("stopped", "draining")
    assert receipt.duration_s == pytest.approx(5)


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({}, "missing parameter 'seconds'"),
        ({"seconds": -1}, "parameter 'seconds' must be a non-negative number"),
        ({"seconds": "1"}, "parameter 'seconds' must be a non-negative number"),
        ({"seconds": True}, "parameter 'seconds' must be a non-negative number"),
    ],
)
async def test_builtin_sleep_bad_seconds(
    jobs_dir: Path, params: dict[str, Any], error: str
) -> None:
    """A missing or invalid seconds parameter is an error receipt."""
    runner = make_runner(jobs_dir, {"svc": CommandSpec(builtin="sleep")})
    receipt = await run(runner, params=params)
    assert (receipt.status, receipt.error) == ("error", error)


async def test_builtin_refuses_a_bad_job_object(jobs_dir: Path) -> None:
    """A builtin job whose object is malformed (a pipe URL that is no URL) is an error too."""
    runner = make_runner(jobs_dir, {"svc": CommandSpec(builtin="noop")})
    with trio.fail_after(WAIT):
        receipt = await runner.run(
            JobRequest(job_id="j", service="svc", job={"stdin_url": "not a url"}), JobControl()
        )
    assert (receipt.status, receipt.error) == ("error", "stdin_url must be an http or https URL")
