"""Linux process trees through ``/proc``: who belongs to a job, its memory and CPU; ``prctl``.

Synchronous, blocking helpers for the runner (which calls the scanning ones in a
worker thread), the containment set-up and the keeper process
(:mod:`trio_broker.trio.keeper`, which imports nothing but this and the standard
library). Linux only.

Who belongs to a job
--------------------

A job's command runs as the leader of a new session, so its session and
process-group ids are the leader's pid. Where the job has a cgroup of its own
(:mod:`trio_broker.trio.cgroup`) its members are simply the cgroup's; without
one, they are found here, in one pass over ``/proc`` (:func:`scan_processes`):

* every process of the leader's session or process group (a grandchild whose
  parent exited is re-parented to init or to a subreaper but stays in both);
* every descendant of a member, by parent links (a child that called
  ``setsid`` left the session but is still its parent's child);
* every process that was a member at an earlier reading (``known``: pid and
  start time, so that a reused pid is never taken for the old process);
* when the job ends, every process whose environment carries the job's tag
  (:data:`TAG_ENV`, :class:`JobTag`): a process that left the session *and*
  lost its parent (``setsid`` after a double fork) is found by the tag it
  inherited. Only a process that also cleared its environment escapes all four;
  a cgroup holds even that one.

A pid cannot be reused while a process still uses it as its session or group id,
so a session or group that matches is the job's own.

The tag also names the process that runs the job (its pid and start time): a
tagged process whose owner is gone was left behind by a dead execserver, and
:func:`orphaned_tagged` finds every such process on the host.

``/proc`` quirks handled here
-----------------------------

* The command name in ``stat`` is in parentheses and may itself contain spaces
  and parentheses, so fields are split after the *last* ``)``.
* A process can vanish between listing ``/proc`` and reading its files
  (``ENOENT`` or ``ESRCH``): it is skipped. Another user's ``environ`` cannot be
  read without privileges: it has no tag as far as we know.
* A zombie (state ``Z``) still has a ``stat`` with its CPU times but no memory;
  it is a member but not *live*. Orphaned zombies are reaped by init (or by the
  subreaper), which in some containers never happens, so "the job is gone"
  means "no live member".
* CPU time is ``utime + stime + cutime + cstime``: a member's children that exit
  and are reaped inside the job move their time into the reaper's ``c*time``,
  so the total does not drop when short-lived helpers come and go.
* RSS is the ``rss`` field (pages) summed over members; shared pages (libraries)
  are counted once per process, so this over-estimates a little, like ``ps``.

``prctl``
---------

:func:`set_child_subreaper`, :func:`set_dumpable`, :func:`set_parent_death_signal`
and :func:`clear_ambient_capabilities` call ``prctl(2)`` through ``ctypes``; each
raises ``OSError`` when the kernel refuses. The C library is loaded at import, so
that a forked child calling them between fork and exec loads nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Final

import attrs

__all__ = [
    "TAG_ENV",
    "GroupSample",
    "JobTag",
    "ProcessInfo",
    "clear_ambient_capabilities",
    "directory_bytes",
    "job_members",
    "kill_tagged",
    "open_pidfd",
    "orphaned",
    "process_start",
    "read_environ_value",
    "read_pids",
    "read_process",
    "sample_pids",
    "scan_processes",
    "set_child_subreaper",
    "set_dumpable",
    "set_parent_death_signal",
    "signal_group",
    "signal_pids",
    "tagged",
    "wait_pids_gone",
]

_PAGE_SIZE = os.sysconf("SC_PAGESIZE")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# Indexes into the fields after the ")" that closes the command name: field N of
# proc(5) (1-based, counting pid and comm) is index N - 3 here.
_STATE = 0  # field 3
_PPID = 1  # field 4
_PGRP = 2  # field 5
_SESSION = 3  # field 6
_UTIME = 11  # field 14; stime, cutime, cstime follow
_START = 19  # field 22: start time after boot, in clock ticks
_RSS = 21  # field 24

TAG_ENV: Final = "TRIO_BROKER_JOB_TAG"
"""The variable that tags every process of a job (see :class:`JobTag`)."""


# -- one reading of /proc ------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ProcessInfo:
    """What ``/proc/[pid]/stat`` says of one process."""

    pid: int
    ppid: int
    pgrp: int
    session: int
    zombie: bool
    rss_pages: int
    ticks: int
    """CPU time of the process and its reaped children, in clock ticks."""
    start: int
    """Start time after boot in clock ticks: with the pid, it names the process."""


def _stat_fields(pid: str | int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            raw = file.read()
    except OSError:  # vanished (ENOENT, ESRCH) or not ours to read
        return None
    _, _, rest = raw.rpartition(b")")
    fields = rest.decode("ascii", "replace").split()
    return fields if len(fields) > _RSS else None


def _info(pid: int, fields: list[str]) -> ProcessInfo:
    return ProcessInfo(
        pid=pid,
        ppid=int(fields[_PPID]),
        pgrp=int(fields[_PGRP]),
        session=int(fields[_SESSION]),
        zombie=fields[_STATE] in ("Z", "X"),
        rss_pages=max(int(fields[_RSS]), 0),  # zero for a zombie: its memory is freed
        ticks=sum(int(value) for value in fields[_UTIME : _UTIME + 4]),
        start=int(fields[_START]),
    )


def read_process(pid: int) -> ProcessInfo | None:
    """One process's ``stat``, or ``None`` if it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else _info(pid, fields)


def scan_processes() -> dict[int, ProcessInfo]:
    """Every process of the host (of this pid namespace), by pid."""
    table: dict[int, ProcessInfo] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(name)
            if fields is not None:
                table[int(name)] = _info(int(name), fields)
    return table


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks after boot), ``None`` if it is gone."""
    info = read_process(pid)
    return None if info is None or info.zombie else info.start


# -- who belongs to a job -------------------------------------------------------------


def _descendants(table: Mapping[int, ProcessInfo], roots: set[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found = set(roots)
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def job_members(
    table: Mapping[int, ProcessInfo],
    leader: int,
    *,
    known: Mapping[int, int] | None = None,
    extra: Iterable[int] = (),
) -> set[int]:
    """The members of the job led by ``leader`` in one reading (see the module docstring).

    Args:
        table: a reading of ``/proc`` (:func:`scan_processes`).
        leader: the job's leader, whose pid is its session and process-group id.
        known: pid → start time of processes found earlier; each that still
            runs with the same start time is a member.
        extra: more pids taken as members (the tagged ones), with their descendants.

    Returns:
        The members' pids, zombies included.
    """
    roots = {
        pid for pid, info in table.items() if leader in (info.session, info.pgrp) or pid == leader
    }
    for pid, start in (known or {}).items():
        info = table.get(pid)
        if info is not None and info.start == start:
            roots.add(pid)
    roots.update(pid for pid in extra if pid in table)
    return _descendants(table, roots)


@attrs.frozen(kw_only=True)
class GroupSample:
    """One reading of a job's processes."""

    pids: tuple[int, ...]
    """Every member, zombies included."""
    live_pids: tuple[int, ...]
    """The members that are not zombies."""
    rss: int
    """Resident memory of the members in bytes."""
    cpu_seconds: float
    """User and system CPU time of the members and their reaped children."""


def sample_pids(table: Mapping[int, ProcessInfo], pids: Iterable[int]) -> GroupSample:
    """Sum up the members ``pids`` of a reading (pids not in it are skipped)."""
    members = sorted(pid for pid in set(pids) if pid in table)
    return GroupSample(
        pids=tuple(members),
        live_pids=tuple(pid for pid in members if not table[pid].zombie),
        rss=sum(table[pid].rss_pages for pid in members) * _PAGE_SIZE,
        cpu_seconds=sum(table[pid].ticks for pid in members) / _CLOCK_TICKS,
    )


def read_pids(pids: Iterable[int]) -> dict[int, ProcessInfo]:
    """A reading of just these processes (the ones that are gone are left out)."""
    table: dict[int, ProcessInfo] = {}
    for pid in pids:
        info = read_process(pid)
        if info is not None:
            table[pid] = info
    return table


# -- the tag ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class JobTag:
    """The value of :data:`TAG_ENV` in a job's environment: ``OWNER_PID:OWNER_START:JOB``.

    ``OWNER_PID`` and ``OWNER_START`` name the process that runs the job (its pid
    and start time); ``JOB`` tells its jobs apart.
    """

    owner_pid: int
    owner_start: int
    job: str

    @classmethod
    def of_this_process(cls, job: str) -> JobTag:
        """The tag of a job run by this process."""
        pid = os.getpid()
        start = process_start(pid)
        assert start is not None  # this process runs
        return cls(owner_pid=pid, owner_start=start, job=job)

    @classmethod
    def parse(cls, text: str) -> JobTag | None:
        """A tag read from an environment, or ``None`` when it is not one."""
        parts = text.split(":", 2)
        if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
            return None
        return cls(owner_pid=int(parts[0]), owner_start=int(parts[1]), job=parts[2])

    def __str__(self) -> str:
        return f"{self.owner_pid}:{self.owner_start}:{self.job}"

    def owner_alive(self) -> bool:
        """Whether the process that ran the job still runs."""
        return process_start(self.owner_pid) == self.owner_start


def read_environ_value(pid: int, name: str) -> str | None:
    """The value of ``name`` in the environment ``pid`` started with, if it can be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            raw = file.read()
    except OSError:  # gone, or another user's
        return None
    prefix = name.encode() + b"="
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode("utf-8", "replace")
    return None


def tagged(table: Mapping[int, ProcessInfo], wanted: Callable[[JobTag], bool]) -> dict[int, JobTag]:
    """The live processes of a reading whose tag satisfies ``wanted``."""
    found: dict[int, JobTag] = {}
    for pid, info in table.items():
        if info.zombie:
            continue
        text = read_environ_value(pid, TAG_ENV)
        tag = None if text is None else JobTag.parse(text)
        if tag is not None and wanted(tag):
            found[pid] = tag
    return found


def orphaned(tag: JobTag) -> bool:
    """Whether the tag's owner (the process that ran the job) is gone."""
    return not tag.owner_alive()


_KILL_ROUNDS: Final = 20
_KILL_WAIT: Final = 5.0


def kill_tagged(wanted: Callable[[JobTag], bool]) -> int:
    """SIGKILL every process whose tag satisfies ``wanted``, until a scan finds none.

    Kill, wait for them to die, look again: a process forked while a scan ran is
    found by the next one (a killed process cannot fork). At most 20 rounds.

    Returns:
        How many processes were killed.
    """
    killed = 0
    for _ in range(_KILL_ROUNDS):
        found = tagged(scan_processes(), wanted)
        if not found:
            break
        signal_pids(found, signal.SIGKILL)
        killed += len(found)
        wait_pids_gone(found, _KILL_WAIT)
    return killed


# -- work folders -------------------------------------------------------------------------


def _regular_file_sizes(path: str) -> Iterator[int]:
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                yield from _regular_file_sizes(entry.path)
            elif entry.is_file(follow_symlinks=False):
                yield entry.stat(follow_symlinks=False).st_size
        except OSError:  # vanished while we looked
            continue


def directory_bytes(path: str) -> int:
    """The total size of the regular files below ``path`` (symlinks not followed)."""
    return sum(_regular_file_sizes(path))


# -- signals and waiting ------------------------------------------------------------------


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to every member of the group; ``False`` if none could be signalled."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_pids(pids: Iterable[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each of ``pids``; the ones that are gone (or not ours) are skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (readable once it exits, without reaping it), or ``None``.

    ``None`` when it is gone, on kernels before 5.3 or in sandboxes that forbid
    ``pidfd_open``.
    """
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


_GONE_POLL: Final = 0.02


def wait_pids_gone(pids: Iterable[int], timeout: float) -> bool:
    """Block until none of ``pids`` runs (zombies count as gone), at most ``timeout`` s.

    Event-driven where pidfds exist (one ``poll`` on all of them); it looks again
    every 20 ms only where they do not.

    Returns:
        Whether they are all gone.
    """
    deadline = time.monotonic() + timeout
    remaining = set(pids)
    while remaining:
        remaining = {pid for pid in remaining if process_start(pid) is not None}
        if not remaining:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        fds = [fd for fd in map(open_pidfd, remaining) if fd is not None]
        try:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            wait = left if len(fds) == len(remaining) else min(left, _GONE_POLL)
            poller.poll(wait * 1000)
        finally:
            for fd in fds:
                os.close(fd)
    return True


# -- prctl --------------------------------------------------------------------------------

_PR_SET_PDEATHSIG: Final = 1
_PR_SET_DUMPABLE: Final = 4
_PR_SET_CHILD_SUBREAPER: Final = 36
_PR_CAP_AMBIENT: Final = 47
_PR_CAP_AMBIENT_CLEAR_ALL: Final = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
_libc.prctl.restype = ctypes.c_int


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"prctl({option}): {os.strerror(number)}")


def set_child_subreaper(on: bool = True) -> None:
    """Adopt the orphaned descendants of this process (``PR_SET_CHILD_SUBREAPER``).

    A descendant whose parent exits is re-parented to this process instead of
    init: it stays in this process's tree, and this process must reap it.
    """
    _prctl(_PR_SET_CHILD_SUBREAPER, int(on))


def set_dumpable(on: bool) -> None:
    """Set this process's dumpable flag (``PR_SET_DUMPABLE``).

    Not dumpable, its ``/proc/[pid]`` files (``environ``, ``mem``, ``fd``…) belong
    to root and no process of its own user may read them or attach to it.
    """
    _prctl(_PR_SET_DUMPABLE, int(on))


def set_parent_death_signal(sig: signal.Signals | int) -> None:
    """Have the kernel send ``sig`` to this process when its parent *thread* ends.

    Meant for a child between fork and exec. The kernel clears it when the
    process changes its user, so set it after that.
    """
    _prctl(_PR_SET_PDEATHSIG, int(sig))


def clear_ambient_capabilities() -> None:
    """Drop this process's ambient capabilities, so that a program it execs gets none.

    A process that is not root but was given capabilities (to switch users, say)
    keeps them across a change between two users that are not root, and passes
    its ambient ones on through exec: a job must not inherit them.
    """
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
