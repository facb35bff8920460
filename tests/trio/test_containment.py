"""Containment with real processes: detached children, job cgroups, locked folders, job users.

The runner here runs in the test process, which is neither a subreaper nor in a
cgroup of its own; the daemon's process-wide set-up (subreaper, keeper, kill -9)
is tested in tests/daemons/test_containment.py.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from tests.trio.test_runner import open_fifo, read_line
from trio_broker.core.protocol import Receipt
from trio_broker.trio import cgroup, procgroup, spawn, workdir
from trio_broker.trio.cgroup import Delegation, JobCgroup
from trio_broker.trio.command import CommandRunner, CommandSpec
from trio_broker.trio.containment import Containment, JobUser, JobUserError, Leftovers
from trio_broker.trio.runner import JobControl, JobRequest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="containment is Linux's")

PY = sys.executable
WAIT = 30
ROOT = os.geteuid() == 0
as_root = pytest.mark.skipif(not ROOT, reason="switching users needs root")

# A job that leaves processes behind, one per kind in argv[1] (comma-separated),
# and prints their pids: "setsid" (its own session), "double" (a double fork: an
# orphan of the job's session), "double_setsid" (both), "clean" (both, and an
# empty environment: no tag). Each is a `sleep 600` holding the job's stdout.
# Then it prints its own cgroup, or, given a FIFO as argv[2], writes the pids
# there too and becomes a `sleep 600` itself.
DETACH = """
import os, sys
def start(kind):
    reader, writer = os.pipe()
    first = os.fork()
    if first == 0:
        os.close(reader)
        if kind != "setsid" and os.fork():
            os._exit(0)
        if kind != "double":
            os.setsid()
        os.write(writer, str(os.getpid()).encode())
        os.execve("/bin/sleep", ["sleep", "600"], dict() if kind == "clean" else os.environ)
    os.close(writer)
    pid = int(os.read(reader, 32))
    if kind != "setsid":
        os.waitpid(first, 0)
    return pid
pids = " ".join(str(start(kind)) for kind in sys.argv[1].split(","))
print(pids, flush=True)
if len(sys.argv) == 2:
    print(open("/proc/self/cgroup").read().splitlines()[-1], flush=True)
else:
    open(sys.argv[2], "w").write(pids + "\\n")
    os.execvp("sleep", ["sleep", "600"])
"""


@pytest.fixture
def jobs_dir(tmp_path: Path) -> Iterator[Path]:
    """The runner's temp_dir; every work folder must be gone when the test ends."""
    path = tmp_path / "jobs"
    path.mkdir()
    yield path
    assert list(path.iterdir()) == []


def make_runner(
    jobs_dir: Path, services: Mapping[str, CommandSpec], **kwargs: Any
) -> CommandRunner:
    options: dict[str, Any] = {"temp_dir": str(jobs_dir), "sample_interval": 0.1, "kill_grace": 1.0}
    options.update(kwargs)
    return CommandRunner(services, **options)


async def run(
    runner: CommandRunner,
    params: Mapping[str, Any] | None = None,
    control: JobControl | None = None,
) -> Receipt:
    job = {"params": dict(params or {})}
    with trio.fail_after(WAIT):
        return await runner.run(
            JobRequest(job_id="job-1", service="svc", job=job), control or JobControl()
        )


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_all(pids: list[int]) -> None:
    procgroup.signal_pids([pid for pid in pids if running(pid)], signal.SIGKILL)


@pytest.fixture
def test_cgroup() -> Iterator[Path]:
    """A cgroup v2 folder of this test's own, below the test process's cgroup.

    The test process stays where it is; only the jobs' processes move, into
    cgroups made below this one. Skipped where there is no cgroup v2 to write.
    """
    parent = cgroup.own_cgroup()
    if parent is None:
        pytest.skip("no cgroup v2 here")
    folder = parent / f"test-containment-{secrets.token_hex(4)}"
    try:
        folder.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup in {parent}: {exc}")
    if not (folder / "cgroup.kill").exists():
        folder.rmdir()
        pytest.skip("no cgroup.kill on this kernel (Linux 5.14)")
    yield folder
    assert [path.name for path in folder.iterdir() if path.is_dir()] == []  # no job cgroup left
    folder.rmdir()


# -- a job's processes without a cgroup ----------------------------------------------------


async def test_processes_a_job_detached_die_with_it(jobs_dir: Path) -> None:
    """setsid, a double fork, and both: every `sleep 600` the job left is killed when it ends."""
    kinds = "setsid,double,double_setsid"
    runner = make_runner(jobs_dir, {"svc": CommandSpec(argv=(PY, "-c", DETACH, kinds))})
    receipt = await run(runner)
    pids = [int(word) for word in receipt.stdout_prefix.splitlines()[0].split()]
    try:
        assert receipt.status == "ok", receipt
        assert len(pids) == 3
        assert [pid for pid in pids if running(pid)] == []
    finally:
        kill_all(pids)


async def test_a_job_killed_midway_takes_its_detached_processes_along(
    jobs_dir: Path, tmp_path: Path
) -> None:
    """An aborted job's setsid and double-forked processes die with it, not only its group."""
    runner = make_runner(
        jobs_dir, {"svc": CommandSpec(argv=(PY, "-c", DETACH, "setsid,double_setsid", "{fifo}"))}
    )
    control = JobControl()
    receipts: list[Receipt] = []

    async def job() -> None:
        receipts.append(await run(runner, {"fifo": str(fifo_path)}, control))

    fifo_path = tmp_path / "fifo"
    async with open_fifo(fifo_path) as fifo, trio.open_nursery() as nursery:
        nursery.start_soon(job)
        await read_line(fifo)
        (entry,) = runner.statistics().running
        assert entry.pid is not None
        tagged = procgroup.tagged(procgroup.scan_processes(), lambda tag: True)
        ours = sorted(pid for pid, tag in tagged.items() if tag.owner_pid == os.getpid())
        assert len(ours) == 3  # the leader and the two it detached
        control.abort("cancelled", "cancelled by the client")
    (receipt,) = receipts
    assert receipt.status == "cancelled"
    assert [pid for pid in ours if running(pid)] == []


# -- a job's processes in a cgroup ----------------------------------------------------------


async def test_a_job_cgroup_holds_what_escapes_the_tree(jobs_dir: Path, test_cgroup: Path) -> None:
    """In its own cgroup, even a double-forked, setsid, tag-less process dies with the job."""
    containment = Containment(cgroup=Delegation(instance=test_cgroup, memory=False))
    kinds = "setsid,double,double_setsid,clean"
    runner = make_runner(
        jobs_dir, {"svc": CommandSpec(argv=(PY, "-c", DETACH, kinds))}, containment=containment
    )
    assert runner.containment().mode == "cgroup"
    receipt = await run(runner)
    first, cgroup_line = receipt.stdout_prefix.splitlines()
    pids = [int(word) for word in first.split()]
    try:
        assert receipt.status == "ok", receipt
        assert len(pids) == 4
        assert cgroup_line.startswith("0::")
        assert f"/{test_cgroup.name}/job-" in cgroup_line  # the leader ran in its job's cgroup
        assert [pid for pid in pids if running(pid)] == []
    finally:
        kill_all(pids)


async def test_the_job_cgroup_is_what_is_sampled(test_cgroup: Path) -> None:
    """The members of a job cgroup are its processes: their RSS and the cgroup's CPU time."""
    job = Delegation(instance=test_cgroup, memory=False).job("sampled")
    fd = job.open_procs()

    def enter() -> None:
        os.write(fd, b"0")

    try:
        child = await spawn.spawn(["sleep", "600"], cwd="/", env={}, stdin=False, setup=enter)
    finally:
        os.close(fd)
    try:
        assert job.pids() == (child.pid,)
        assert job.memory_bytes() is None  # no memory controller asked for
        cpu = job.cpu_seconds()
        assert cpu is not None
        assert cpu >= 0
    finally:
        job.kill()
        assert await child.wait() == -signal.SIGKILL
        child.close()
        for stream in (child.stdout, child.stderr):
            await stream.aclose()
        assert job.remove()


def test_memory_comes_from_memory_stat(tmp_path: Path) -> None:
    """With the memory controller, a job's memory is anon + file_mapped, not memory.current."""
    (tmp_path / "memory.stat").write_text("anon 1000\nfile 900000\nfile_mapped 24\nshmem 0\n")
    (tmp_path / "memory.current").write_text("901024\n")
    assert JobCgroup(path=tmp_path, memory=True).memory_bytes() == 1024
    assert JobCgroup(path=tmp_path, memory=False).memory_bytes() is None


# -- work folders -------------------------------------------------------------------------


async def test_a_sweep_spares_the_folder_of_a_running_job(jobs_dir: Path, tmp_path: Path) -> None:
    """remove_stale takes an unlocked folder and leaves a running job's, files and all."""
    script = 'echo kept > kept; pwd > "$1"; exec sleep 600'
    runner = make_runner(jobs_dir, {"svc": CommandSpec(argv=("sh", "-c", script, "sh", "{fifo}"))})
    stale = jobs_dir / f"{workdir.PREFIX}left-by-a-dead-one"
    (stale / "sub").mkdir(parents=True)
    older = jobs_dir / "trio-broker-job-of-an-older-version"
    older.mkdir()
    control = JobControl()
    receipts: list[Receipt] = []

    async def job() -> None:
        receipts.append(await run(runner, {"fifo": str(fifo_path)}, control))

    fifo_path = tmp_path / "fifo"
    async with open_fifo(fifo_path) as fifo, trio.open_nursery() as nursery:
        nursery.start_soon(job)
        folder = Path((await read_line(fifo)).strip())
        removed = await trio.to_thread.run_sync(workdir.remove_stale, str(jobs_dir))
        assert removed == [str(stale)]
        assert (folder / "kept").read_text() == "kept\n"
        assert older.is_dir()  # no lock to ask: an older execserver may be using it
        control.abort("cancelled", "cancelled by the client")
    assert receipts[0].status == "cancelled"
    assert not await trio.Path(folder).exists()
    older.rmdir()


def test_the_folder_of_a_killed_process_is_swept(jobs_dir: Path) -> None:
    """A folder stays locked while its process lives and is swept once it was killed."""
    code = (
        "import sys, time\n"
        "from trio_broker.trio.workdir import WorkDir\n"
        "print(WorkDir.create(sys.argv[1]).path, flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [PY, "-c", code, str(jobs_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None
            folder = holder.stdout.readline().strip()
            assert workdir.remove_stale(str(jobs_dir)) == []
            assert os.path.isdir(folder)
        finally:
            holder.kill()
            holder.wait()
    assert workdir.remove_stale(str(jobs_dir)) == [folder]


# -- the job user -----------------------------------------------------------------------------


def test_job_users_are_looked_up() -> None:
    """Names, numbers and UID:GID; an unknown name is a clear error."""
    nobody = JobUser.named("nobody")
    assert (nobody.uid, JobUser.named(str(nobody.uid)).uid) == (nobody.uid, nobody.uid)
    assert JobUser.named("4242:4343") == JobUser(name="4242:4343", uid=4242, gid=4343)
    with pytest.raises(JobUserError, match="no user 'no-such-user-here' on this host"):
        JobUser.named("no-such-user-here")
    assert JobUser.default() == (JobUser.named("nobody") if ROOT else JobUser.current())
    assert JobUser.current().is_current


@as_root
async def test_a_job_runs_as_the_job_user_in_a_folder_it_owns(jobs_dir: Path) -> None:
    """As nobody: its ids, a work folder of its own as HOME, no capabilities; cleaned up after."""
    script = (
        'id -u; id -g; stat -c %u .; echo "$HOME"; pwd; touch made; grep CapEff /proc/self/status'
    )
    nobody = JobUser.named("nobody")
    runner = make_runner(jobs_dir, {"svc": CommandSpec(argv=("sh", "-c", script))}, job_user=nobody)
    assert runner.containment().job_user == "nobody"
    receipt = await run(runner)
    assert receipt.status == "ok", receipt
    uid, gid, owner, home, cwd, caps = receipt.stdout_prefix.splitlines()
    assert (int(uid), int(gid), int(owner)) == (nobody.uid, nobody.gid, nobody.uid)
    assert home == cwd == home  # nobody has no home folder here: its work folder is HOME
    assert Path(cwd).parent == jobs_dir
    assert caps.split() == ["CapEff:", "0000000000000000"]


def test_a_runner_refuses_a_user_it_cannot_become() -> None:
    """Not root and without the capabilities: constructing the runner names what is missing."""
    other = JobUser(name="someone-else", uid=os.geteuid() + 1, gid=os.getegid() + 1)
    problem = other.switch_problem()
    if ROOT:
        assert problem is None
        return
    assert problem is not None
    assert "CAP_SETUID" in problem
    with pytest.raises(JobUserError, match="cannot run jobs as 'someone-else'"):
        CommandRunner({"svc": CommandSpec(builtin="noop")}, job_user=other)


# -- the spawning thread -----------------------------------------------------------------------


async def test_leaders_are_children_of_the_long_lived_spawning_thread(jobs_dir: Path) -> None:
    """The leader's parent thread is the spawning thread, which never ends (its death signal)."""
    child = await spawn.spawn(["sleep", "600"], cwd="/", env={}, stdin=False)
    try:
        parents = [
            int(task.name)
            for task in await trio.Path(f"/proc/{os.getpid()}/task").iterdir()
            if str(child.pid) in (await (task / "children").read_text()).split()
        ]
        assert spawn._thread is not None
        assert spawn._thread.daemon
        assert parents == [spawn._thread.native_id]
    finally:
        child.send_signal(signal.SIGKILL)
        await child.wait()
        child.close()
        for stream in (child.stdout, child.stderr):
            await stream.aclose()


def test_leftovers_are_described() -> None:
    """The start-up line counts what was removed, in words."""
    assert Leftovers().describe() is None
    assert Leftovers(processes=1, folders=("a", "b")).describe() == "1 process, 2 work folders"
    assert Leftovers(processes=2, cgroups=("c",)).describe() == "2 processes, 1 cgroup"
