"""Containment: nothing a job starts outlives its job or its execserver; no job reads its secrets.

:class:`~trio_broker.trio.command.CommandRunner` ends the processes of each job
by itself (:mod:`trio_broker.trio.procgroup`: its session, group, descendants and
tag). What only a whole process can do is set up here, by :func:`serve_containment`,
a service that a process dedicated to running jobs (the execserver daemon)
starts before its runner:

* **Subreaper** (``PR_SET_CHILD_SUBREAPER``): a job's orphans (``setsid``, a
  double fork) are re-parented to the execserver, not to init; they stay in its
  tree and it reaps them (:func:`reap_adopted`, on every ``SIGCHLD``).
* **Not dumpable** (``PR_SET_DUMPABLE`` 0): ``/proc/<pid>/environ``, ``mem`` and
  friends of the execserver belong to root, so a job cannot read its environment
  or memory, even one running as the same user.
* **A delegated cgroup** where there is one (:mod:`trio_broker.trio.cgroup`):
  each job in a cgroup of its own, killed whole, its memory read from its
  counters.
* **The keeper** (:mod:`trio_broker.trio.keeper`): a small process that waits
  for the execserver to end (the end of a pipe only the execserver holds) and
  then kills what its jobs left (their cgroups, their tagged processes) and
  removes their work folders. A job leader also gets ``SIGKILL`` from the kernel
  when the execserver dies (its parent-death signal, :mod:`trio_broker.trio.spawn`),
  but the processes a job detached from it need the keeper.
* **At start**, what dead predecessors left is removed: processes tagged by an
  execserver that no longer runs, stale instance cgroups, unlocked work folders
  (:mod:`trio_broker.trio.workdir`).

:class:`JobUser` is the user a runner's jobs run as (``job_user``); the runner
switches to it in each job's child before exec.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import signal
import subprocess
import sys
from pathlib import Path
from typing import Final, Literal

import attrs
import trio

from trio_broker.trio import cgroup, procgroup, spawn, workdir
from trio_broker.trio.cgroup import Delegation

__all__ = [
    "Containment",
    "JobUser",
    "JobUserError",
    "Leftovers",
    "reap_adopted",
    "remove_leftovers",
    "serve_containment",
]

logger = logging.getLogger(__name__)

_KEEPER_STOP_TIMEOUT: Final = 10.0
_CAP_CHOWN: Final = 0
_CAP_DAC_OVERRIDE: Final = 1
_CAP_KILL: Final = 5
_CAP_SETGID: Final = 6
_CAP_SETUID: Final = 7
_SWITCH_CAPABILITIES: Final = {
    _CAP_SETUID: "CAP_SETUID",
    _CAP_SETGID: "CAP_SETGID",
    _CAP_CHOWN: "CAP_CHOWN",
    _CAP_KILL: "CAP_KILL",
    _CAP_DAC_OVERRIDE: "CAP_DAC_OVERRIDE",
}
"""What a process needs to run jobs as another user: switch to it, give it the work
folder, signal its processes, remove what it wrote."""


# -- the jobs' user ---------------------------------------------------------------------


class JobUserError(ValueError):
    """A ``job_user`` that does not exist, or that this process cannot switch to."""


def _effective_capabilities() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as file:
            for line in file:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


@attrs.frozen(kw_only=True)
class JobUser:
    """The user (and groups) jobs run as.

    Attributes:
        name: as configured or found (a number for a user without a name).
        uid, gid: the ids the job gets.
        groups: its supplementary groups.
        home: its home folder when it has one that exists, else ``None`` (the
            runner then gives a job its work folder as ``HOME``).
    """

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    home: str | None = None

    @classmethod
    def named(cls, name: str) -> JobUser:
        """A user by name, or by number (``"65534"``; ``"UID:GID"`` for one without a name).

        Raises:
            JobUserError: no such user on this host.
        """
        uid_text, _, gid_text = name.partition(":")
        try:
            entry = pwd.getpwuid(int(uid_text)) if uid_text.isdigit() else pwd.getpwnam(uid_text)
        except KeyError:
            if uid_text.isdigit() and gid_text.isdigit():
                return cls(name=name, uid=int(uid_text), gid=int(gid_text))
            raise JobUserError(
                f"no user {name!r} on this host (a name, a number, or UID:GID)"
            ) from None
        gid = int(gid_text) if gid_text.isdigit() else entry.pw_gid
        return cls(
            name=name,
            uid=entry.pw_uid,
            gid=gid,
            groups=tuple(sorted(set(os.getgrouplist(entry.pw_name, gid)))),
            home=entry.pw_dir if os.path.isdir(entry.pw_dir) else None,
        )

    @classmethod
    def default(cls) -> JobUser:
        """This process's user when it is not root, else ``nobody``."""
        uid = os.geteuid()
        if uid != 0:
            return cls.current()
        return cls.named("nobody")

    @classmethod
    def current(cls) -> JobUser:
        """This process's own user and groups."""
        uid, gid = os.geteuid(), os.getegid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        return cls(
            name=name,
            uid=uid,
            gid=gid,
            groups=tuple(sorted(set(os.getgroups()))),
            home=os.environ.get("HOME"),
        )

    @property
    def is_current(self) -> bool:
        """Whether jobs run as this process's own user and group (nothing to switch)."""
        return (self.uid, self.gid) == (os.geteuid(), os.getegid())

    def switch_problem(self) -> str | None:
        """Why this process cannot run jobs as this user, or ``None``.

        Running jobs as another user needs root or the capabilities to switch to
        it (``CAP_SETUID``, ``CAP_SETGID``), give it the work folder
        (``CAP_CHOWN``), signal its processes (``CAP_KILL``) and remove what it
        wrote (``CAP_DAC_OVERRIDE``).
        """
        if self.is_current:
            return None
        capabilities = _effective_capabilities()
        missing = [
            name for bit, name in _SWITCH_CAPABILITIES.items() if not capabilities >> bit & 1
        ]
        if not missing:
            return None
        return (
            f"cannot run jobs as {self.name!r} (uid {self.uid}): this process runs as uid"
            f" {os.geteuid()} without {', '.join(missing)}; start it as root, or set"
            f" job_user to its own user"
        )

    def switch(self) -> None:
        """Become this user (in a job's child, between fork and exec)."""
        os.setgroups(list(self.groups))
        os.setgid(self.gid)
        os.setuid(self.uid)


# -- the containment ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Leftovers:
    """What :func:`remove_leftovers` removed."""

    processes: int = 0
    """Processes of jobs whose execserver is gone."""
    cgroups: tuple[str, ...] = ()
    """Instance cgroups of dead execservers."""
    folders: tuple[str, ...] = ()
    """Work folders no live process held."""

    def describe(self) -> str | None:
        """``"2 processes, 1 cgroup, 3 work folders"``, or ``None`` for nothing."""
        counts = [
            (self.processes, "process", "processes"),
            (len(self.cgroups), "cgroup", "cgroups"),
            (len(self.folders), "work folder", "work folders"),
        ]
        words = [f"{n} {one if n == 1 else many}" for n, one, many in counts if n]
        return ", ".join(words) or None


@attrs.frozen(kw_only=True)
class Containment:
    """How this process contains its jobs (given by :func:`serve_containment`).

    Attributes:
        cgroup: the delegated cgroup the jobs' cgroups are made in, or ``None``.
        reason: why there is no cgroup, when there is none.
        subreaper: whether this process adopts its jobs' orphans.
        dumpable: whether this process's ``/proc`` files are readable by its user.
        keeper_pid: the keeper process, or ``None`` when it could not start.
        leftovers: what dead predecessors left, removed at start.
    """

    cgroup: Delegation | None
    reason: str | None = None
    subreaper: bool = False
    dumpable: bool = True
    keeper_pid: int | None = None
    leftovers: Leftovers = Leftovers()

    @property
    def mode(self) -> Literal["cgroup", "process_tree"]:
        """``cgroup`` (a cgroup per job) or ``process_tree`` (session, tree, tags)."""
        return "process_tree" if self.cgroup is None else "cgroup"

    def describe(self) -> str:
        """One line for the log: the mode and what it rests on."""
        if self.cgroup is not None:
            memory = (
                "the memory controller"
                if self.cgroup.memory
                else f"each process's RSS ({self.cgroup.note})"
            )
            where = f"cgroup {self.cgroup.instance}, memory from {memory}"
        else:
            where = f"process trees ({self.reason})"
        removed = self.leftovers.describe()
        return (
            f"jobs are contained by {where}; subreaper {'on' if self.subreaper else 'off'},"
            f" keeper {self.keeper_pid or 'not running'}"
            + ("" if removed is None else f"; removed what dead execservers left: {removed}")
        )


def reap_adopted() -> list[int]:
    """Reap the zombies among this process's children that nobody waits for (blocking).

    A subreaper adopts its jobs' orphans, and each becomes a zombie child of it
    when it dies. Children of :func:`~trio_broker.trio.spawn.spawn` are left to
    their :class:`~trio_broker.trio.spawn.Child`.

    Returns:
        The pids reaped.
    """
    me = os.getpid()
    reaped = []
    with spawn.reaping_lock():
        for pid, info in procgroup.scan_processes().items():
            if info.ppid == me and info.zombie and not spawn.is_spawned(pid):
                with contextlib.suppress(ChildProcessError):
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        reaped.append(pid)
    return reaped


def remove_leftovers(temp_dir: str | None, parent_cgroup: str | None = None) -> Leftovers:
    """Remove what dead execservers left: their jobs' processes, cgroups and folders (blocking).

    Args:
        temp_dir: where the work folders are (``None``: the system's temporary folder).
        parent_cgroup: the cgroup folder holding the instance cgroups, if any.

    Returns:
        What was removed.
    """
    processes = procgroup.kill_tagged(procgroup.orphaned)
    cgroups = () if parent_cgroup is None else cgroup.sweep_stale(Path(parent_cgroup))
    folders = workdir.remove_stale(temp_dir)
    for path in (*cgroups, *folders):
        logger.debug("removed what a dead execserver left: %s", path)
    return Leftovers(processes=processes, cgroups=tuple(map(str, cgroups)), folders=tuple(folders))


def _start_keeper(temp_dir: str | None, delegation: Delegation | None) -> subprocess.Popen[bytes]:
    me = os.getpid()
    argv = [
        sys.executable,
        "-m",
        "trio_broker.trio.keeper",
        f"--owner={me}:{procgroup.process_start(me)}",
    ]
    if temp_dir is not None:
        argv += ["--temp-dir", temp_dir]
    if delegation is not None:
        argv += ["--cgroup", str(delegation.instance)]
        if delegation.memory:
            argv.append("--memory")
    env = {name: os.environ[name] for name in ("PATH", "LANG", "PYTHONPATH") if name in os.environ}
    with spawn.reaping_lock():
        keeper = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            cwd="/",
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C is for the execserver, not for it
            close_fds=True,
        )
        spawn.track(keeper.pid)
    return keeper


def _stop_keeper(keeper: subprocess.Popen[bytes]) -> None:
    assert keeper.stdin is not None
    keeper.stdin.close()  # the end of its pipe: it cleans up and exits
    try:
        keeper.wait(_KEEPER_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        keeper.kill()
        keeper.wait()
    spawn.untrack(keeper.pid)


def _set_up(use_cgroup: bool, instance: str) -> tuple[Delegation | None, str | None, bool, bool]:
    """prctl and the cgroup; each failure is logged and leaves a weaker containment."""
    subreaper = dumpable = True
    try:
        procgroup.set_child_subreaper()
    except OSError as exc:
        subreaper = False
        logger.warning("cannot become a subreaper: %s", exc)
    try:
        procgroup.set_dumpable(False)
        dumpable = False
    except OSError as exc:
        logger.warning("cannot clear the dumpable flag: %s", exc)
    if not use_cgroup:
        return None, "cgroup: off in the configuration", subreaper, dumpable
    found = cgroup.delegate(instance)
    if isinstance(found, str):
        return None, found, subreaper, dumpable
    return found, None, subreaper, dumpable


async def _reap_on_sigchld() -> None:
    """Reap adopted orphans whenever a child ends (main thread only), else never."""
    try:
        receiver = trio.open_signal_receiver(signal.SIGCHLD)
    except RuntimeError:  # not the main thread: the orphans stay zombies until we exit
        logger.warning("not in the main thread: adopted orphans are not reaped")
        await trio.sleep_forever()
    with receiver as signals:
        await trio.to_thread.run_sync(reap_adopted)
        async for _ in signals:
            await trio.to_thread.run_sync(reap_adopted)


async def serve_containment(
    *,
    temp_dir: str | None,
    instance: str,
    use_cgroup: bool = True,
    task_status: trio.TaskStatus[Containment] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Contain this process's jobs until cancelled (see the module docstring).

    Call it once per process, from the thread that runs trio (the main thread:
    it reaps on ``SIGCHLD``), before starting the runner, and only in a process
    that owns all its children (it reaps the ones nobody waits for). It removes
    what dead predecessors left in ``temp_dir`` and beside its cgroup, starts
    the keeper, then reports the :class:`Containment` through ``task_status``
    (:meth:`Containment.describe` says in one line what was set up).
    When cancelled it lets the keeper clean up, waits for it and leaves its
    cgroup (shielded, bounded).

    Args:
        temp_dir: where the runner makes its work folders (``None``: the system's).
        instance: names this process's cgroup folder (letters, digits, ``-``, ``_``).
        use_cgroup: whether to look for a delegated cgroup at all.
    """
    delegation, reason, subreaper, dumpable = await trio.to_thread.run_sync(
        _set_up, use_cgroup, instance
    )
    parent = None if delegation is None else str(delegation.parent)
    leftovers = await trio.to_thread.run_sync(remove_leftovers, temp_dir, parent)
    try:
        keeper: subprocess.Popen[bytes] | None = await trio.to_thread.run_sync(
            _start_keeper, temp_dir, delegation
        )
    except OSError as exc:
        logger.warning("cannot start the keeper: %s", exc)
        keeper = None
    containment = Containment(
        cgroup=delegation,
        reason=reason,
        subreaper=subreaper,
        dumpable=dumpable,
        keeper_pid=None if keeper is None else keeper.pid,
        leftovers=leftovers,
    )
    try:
        task_status.started(containment)
        if subreaper:
            await _reap_on_sigchld()
        else:
            await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            if keeper is not None:
                await trio.to_thread.run_sync(_stop_keeper, keeper)
            if delegation is not None:
                await trio.to_thread.run_sync(cgroup.remove_instance, delegation)
