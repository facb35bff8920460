"""The execserver daemon as a real process: nothing outlives it, none of its secrets reach a job.

Each test starts ``trio-broker execserver`` as a subprocess, runs a job over a
real websocket, and looks at the job's processes in ``/proc``: every process of
a job carries a mark in its environment (the configuration's ``env``), so a scan
finds them wherever they went (except the one that cleared its environment,
whose pid the job reports).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio
import yaml

from tests.support.processes import DaemonProcess, open_execserver_process
from tests.support.wire import WAIT, Peer, connect
from tests.trio.test_containment import DETACH
from tests.trio.test_runner import open_fifo, read_line
from trio_broker.core import protocol as p
from trio_broker.trio import cgroup, procgroup
from trio_broker.trio.workdir import PREFIX

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="containment is Linux's")

MARK = "CONTAINMENT_TEST_MARK"
HOLD = 'echo kept > kept; pwd > "$1"; exec sleep 600'


def cgroup_usable() -> bool:
    """Whether this process may make cgroups below its own (as the daemon will)."""
    parent = cgroup.own_cgroup()
    if parent is None:
        return False
    probe = parent / f"test-probe-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    usable = (probe / "cgroup.kill").exists()
    probe.rmdir()
    return usable


MODES = [
    pytest.param(
        "cgroup",
        marks=pytest.mark.skipif(not cgroup_usable(), reason="no cgroup v2 to write here"),
    ),
    "process_tree",
]


def config(temp_dir: Path, mark: str, mode: str = "process_tree", **extra: Any) -> str:
    """YAML text: the `detach` and `hold` services, jobs marked by `mark`."""
    document = {
        "listen": "127.0.0.1:0",
        "slots": 2,
        "fast_reserve": 0,
        "unknown_share": 1.0,
        "temp_dir": str(temp_dir),
        "cgroup": "auto" if mode == "cgroup" else "off",
        "env": {MARK: mark},
        "services": {
            "detach": {"argv": [sys.executable, "-c", DETACH, "{kinds}", "{fifo}"]},
            "hold": {"argv": ["sh", "-c", HOLD, "sh", "{fifo}"]},
        },
        **extra,
    }
    return yaml.safe_dump(document)


@pytest.fixture
def mark() -> str:
    return secrets.token_hex(8)


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "jobs"
    path.mkdir()
    yield path
    assert list(path.iterdir()) == []


def marked(mark: str) -> set[int]:
    """The live processes carrying ``mark``."""
    return {
        pid
        for pid, info in procgroup.scan_processes().items()
        if not info.zombie and procgroup.read_environ_value(pid, MARK) == mark
    }


async def work_folders(jobs: Path) -> list[Path]:
    return [Path(path) for path in await trio.Path(jobs).glob(f"{PREFIX}*")]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def wait_gone(pids: set[int]) -> None:
    """Return once none of ``pids`` runs (their pidfds become readable)."""
    fds = [fd for fd in map(procgroup.open_pidfd, pids) if fd is not None]
    try:
        async with trio.open_nursery() as nursery:
            for fd in fds:
                nursery.start_soon(trio.lowlevel.wait_readable, fd)
    finally:
        for fd in fds:
            trio.lowlevel.notify_closing(fd)
            os.close(fd)


async def containment(daemon: DaemonProcess, token: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=WAIT) as http:
        answer = await http.get("/inspect/system/execserver", headers=headers)
    answer.raise_for_status()
    page: dict[str, Any] = answer.json()
    return page


async def start_job(peer: Peer, job_id: str, service: str, params: dict[str, str]) -> None:
    offer = await peer.want(job_id, service)
    assert isinstance(offer, p.Offer)
    await peer.run(offer, service, params)


@asynccontextmanager
async def detached_job(
    daemon: DaemonProcess, fifo_path: Path, kinds: str
) -> AsyncIterator[tuple[Peer, list[int]]]:
    """A running `detach` job: the connection and the pids it detached."""
    async with open_fifo(fifo_path) as fifo, connect(daemon.url) as peer:
        await start_job(peer, "detach", "detach", {"kinds": kinds, "fifo": str(fifo_path)})
        pids = [int(word) for word in (await read_line(fifo)).split()]
        yield peer, pids


# -- nothing outlives its execserver -------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_kill_9_of_the_execserver_ends_every_process_of_its_jobs(
    mode: str, jobs: Path, mark: str, tmp_path: Path
) -> None:
    """kill -9 mid-job: the leader, setsid and double-forked children all die; the folder goes."""
    kinds = "setsid,double,double_setsid" + (",clean" if mode == "cgroup" else "")
    async with open_execserver_process(config(jobs, mark, mode), log_level="info") as daemon:
        page = (await containment(daemon))["containment"]
        assert (page["mode"], page["subreaper"], page["dumpable"]) == (mode, True, False)
        keeper = page["keeper_pid"]
        async with detached_job(daemon, tmp_path / "fifo", kinds) as (_, detached):
            job = marked(mark) | set(detached)
            assert len(job) == len(kinds.split(",")) + 1  # and the leader
            assert all(running(pid) for pid in job)
            assert len(await work_folders(jobs)) == 1
            instance = page["cgroup"]
            before = trio.current_time()
            daemon.process.send_signal(signal.SIGKILL)
            with trio.fail_after(WAIT):
                await wait_gone(job)
            after = trio.current_time()
            with trio.fail_after(WAIT):
                await wait_gone({keeper})
        assert marked(mark) == set()
        if instance is not None:
            assert not await trio.Path(instance).exists()
    print(f"\n{mode}: the last job process was gone {after - before:.3f}s after kill -9")


@pytest.mark.parametrize("mode", MODES)
async def test_a_restart_removes_what_a_dead_execserver_and_its_keeper_left(
    mode: str, jobs: Path, mark: str, tmp_path: Path
) -> None:
    """Both killed: the leader dies of its parent-death signal; the next start ends the rest."""
    text = config(jobs, mark, mode)
    async with open_execserver_process(text) as first:
        page = await containment(first)
        keeper = page["containment"]["keeper_pid"]
        async with detached_job(first, tmp_path / "fifo", "setsid,double_setsid") as (_, detached):
            (running_job,) = (await containment(first))["running"]
            leader = running_job["pid"]
            os.kill(keeper, signal.SIGKILL)
            first.process.send_signal(signal.SIGKILL)
            with trio.fail_after(WAIT):
                await wait_gone({keeper, leader})
            # nobody is left to end the rest: they wait for the next execserver
            assert all(running(pid) for pid in detached)
            assert len(await work_folders(jobs)) == 1
    async with open_execserver_process(text, log_level="info") as second:
        assert not any(running(pid) for pid in detached)
        assert marked(mark) == set()
        assert await work_folders(jobs) == []
        if mode == "cgroup":
            assert not await trio.Path(page["containment"]["cgroup"]).exists()
        assert (await containment(second))["containment"]["mode"] == mode


async def test_execservers_sharing_a_temp_dir_leave_each_others_folders_alone(
    jobs: Path, mark: str, tmp_path: Path
) -> None:
    """B starts and dies beside A's running job: A's folder and its file stay; A ends it."""
    text = config(jobs, mark)
    fifo_path = tmp_path / "fifo"
    async with (
        open_execserver_process(text) as a,
        open_fifo(fifo_path) as fifo,
        connect(a.url) as peer,
    ):
        await start_job(peer, "held", "hold", {"fifo": str(fifo_path)})
        folder = Path((await read_line(fifo)).strip())
        async with open_execserver_process(text) as b:  # its start sweeps temp_dir
            assert (folder / "kept").read_text() == "kept\n"
            keeper = (await containment(b))["containment"]["keeper_pid"]
            b.process.send_signal(signal.SIGKILL)
            with trio.fail_after(WAIT):
                await wait_gone({keeper})  # it swept temp_dir once more
        assert (folder / "kept").read_text() == "kept\n"
        await peer.send(p.Cancel(job_id="held"))
        done = await peer.done("held")
        assert done.receipt.status == "cancelled"
        assert not await trio.Path(folder).exists()


@pytest.mark.parametrize("mode", MODES)
async def test_what_a_job_detached_is_killed_and_reaped_when_it_ends(
    mode: str, jobs: Path, mark: str
) -> None:
    """A job that exits leaving detached processes: they are killed, and none stays a zombie."""
    async with (
        open_execserver_process(config(jobs, mark, mode)) as daemon,
        connect(daemon.url) as peer,
    ):
        await start_job(peer, "d", "detach", {"kinds": "setsid,double,double_setsid", "fifo": ""})
        done = await peer.done("d")
        assert done.receipt.status == "failed"  # it cannot open the FIFO "": it exits 1
        assert marked(mark) == set()
        zombies = [
            pid
            for pid, info in procgroup.scan_processes().items()
            if info.ppid == daemon.process.pid and info.zombie
        ]
        assert zombies == []


# -- secrets stay with the daemon ---------------------------------------------------------------

READ_SECRETS = (
    'for f in "/proc/$PPID/environ" "/proc/$1/environ" "$2"; do'
    ' if cat "$f" > /dev/null 2>&1; then echo "read $f"; else echo "denied $f"; fi;'
    " done; id -u; grep CapEff /proc/self/status"
)
DAEMON_UID = 4242
"""An unprivileged user without a name, for the daemon of the last two cases."""
CAPABILITIES = "+setuid,+setgid,+chown,+kill,+dac_override"
"""What a daemon that is not root needs to run jobs as another user."""
# Python lives where only root may look (root's home); for a daemon without
# capabilities, a private mount namespace shows it the interpreter's folder.
SHOW_PYTHON = (
    "set -e; hold=$(mktemp -d); mount --bind /root/.pyenv $hold;"
    " mount -t tmpfs -o mode=0755 none /root; mkdir /root/.pyenv; mount --move $hold /root/.pyenv;"
    ' exec "$@"'
)


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder anyone may enter (under /tmp, not the tests' own closed one)."""
    path = Path(tempfile.mkdtemp(prefix="trio-broker-secrets-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _prefix(case: str) -> list[str]:
    setpriv = ["setpriv", f"--reuid={DAEMON_UID}", f"--regid={DAEMON_UID}", "--clear-groups"]
    if case == "unprivileged daemon, capabilities":
        return [*setpriv, f"--inh-caps={CAPABILITIES}", f"--ambient-caps={CAPABILITIES}", "--"]
    if case == "unprivileged daemon, its own user":
        if not os.path.realpath(sys.executable).startswith("/root/.pyenv/"):
            pytest.skip("the mount trick is for an interpreter under /root/.pyenv")
        unshare = ["unshare", "--mount", "--propagation", "private", "--"]
        return [*unshare, "sh", "-c", SHOW_PYTHON, "sh", *setpriv, "--"]
    return []


@pytest.mark.skipif(os.geteuid() != 0, reason="the cases need root to start the daemon as each")
@pytest.mark.parametrize(
    ("case", "job_user", "readable"),
    [
        ("root daemon", None, ()),
        ("root daemon, jobs as root", "root", ("ppid", "pid", "file")),
        ("unprivileged daemon, capabilities", "nobody", ()),
        ("unprivileged daemon, its own user", None, ("file",)),
    ],
)
async def test_a_job_cannot_read_the_daemons_secrets(
    case: str, job_user: str | None, readable: tuple[str, ...], open_folder: Path
) -> None:
    """/proc/$PPID/environ, /proc/<daemon>/environ, the 0600 token file: what a job may read.

    The daemon's environment holds a password and the path of its token file
    (0600, in a folder anyone may enter). Jobs of a root daemon run as nobody;
    a daemon that is not root but may switch users runs them as nobody too;
    neither kind reads anything, and the job has no capabilities. A daemon
    without privileges runs jobs as itself: its cleared dumpable flag still
    hides its environment, but a file of its own user is the job's to read (as
    daemons/README.md says). Jobs run as root read everything: the reason for
    job_user.
    """
    owner = DAEMON_UID if case.startswith("unprivileged") else 0
    token = secrets.token_hex(16)
    password = secrets.token_hex(16)
    token_file = open_folder / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    jobs = open_folder / "jobs"
    jobs.mkdir()
    os.chown(token_file, owner, owner)
    os.chown(jobs, owner, owner)
    text = yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "temp_dir": str(jobs),
            "cgroup": "off",
            "services": {"read": {"argv": ["sh", "-c", READ_SECRETS, "sh", "{pid}", "{file}"]}},
            **({} if job_user is None else {"job_user": job_user}),
        }
    )
    env = {"DATABASE_PASSWORD": password, "TRIO_BROKER_BROKER_TOKEN_FILE": str(token_file)}
    async with open_execserver_process(
        text, job_user=None, env=env, prefix=_prefix(case)
    ) as daemon:
        auth = [("Authorization", f"Bearer {token}")]
        async with connect(daemon.url, headers=auth) as peer:
            params = {"pid": str(daemon.process.pid), "file": str(token_file)}
            await start_job(peer, "secrets", "read", params)
            done = await peer.done("secrets")
    assert done.receipt.status == "ok", done.receipt
    *reads, uid, caps = done.receipt.stdout_prefix.splitlines()
    paths = [f"/proc/{daemon.process.pid}/environ"] * 2 + [str(token_file)]  # $PPID: the daemon
    expected = [
        f"{'read' if name in readable else 'denied'} {path}"
        for name, path in zip(("ppid", "pid", "file"), paths, strict=True)
    ]
    assert reads == expected
    assert password not in done.receipt.stdout_prefix
    assert token not in done.receipt.stdout_prefix
    expected_uid = {"root": 0, "nobody": 65534, None: owner or 65534}[job_user]
    assert int(uid) == expected_uid
    if job_user != "root":
        assert caps.split() == ["CapEff:", "0000000000000000"]
