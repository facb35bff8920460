"""Linux process groups through ``/proc``: who is in a group, its memory and CPU.

Synchronous, blocking helpers for the runner (which calls the scanning ones in a
worker thread). Linux only.

A job's command runs as the leader of a new session, so its process-group id is
the leader's pid. Membership is read from the ``pgrp`` field of every
``/proc/[pid]/stat``, not from the parent/child tree: a grandchild whose parent
exited is re-parented to init (or a subreaper) but stays in the group, and is
still counted and killed.

``/proc`` quirks handled here:

* The command name in ``stat`` is in parentheses and may itself contain spaces
  and parentheses, so fields are split after the *last* ``)``.
* A process can vanish between listing ``/proc`` and reading its ``stat``
  (``ENOENT`` or ``ESRCH``): it is skipped.
* A zombie (state ``Z``) still has a ``stat`` with its CPU times but no memory;
  it is a member but not *live*. Orphaned zombies are reaped by init, which in
  some containers never happens, so "the group is gone" means "no live member".
* CPU time is ``utime + stime + cutime + cstime``: a member's children that exit
  and are reaped inside the group move their time into the reaper's ``c*time``,
  so the group total does not drop when short-lived helpers come and go.
* RSS is the ``rss`` field (pages) summed over members; shared pages (libraries)
  are counted once per process, so this over-estimates a little, like ``ps``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import attrs

__all__ = [
    "GroupSample",
    "directory_bytes",
    "open_pidfd",
    "sample_group",
    "signal_group",
]

_PAGE_SIZE = os.sysconf("SC_PAGESIZE")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# Indexes into the fields after the ")" that closes the command name: field N of
# proc(5) (1-based, counting pid and comm) is index N - 3 here.
_STATE = 0  # field 3
_PGRP = 2  # field 5
_UTIME = 11  # field 14; stime, cutime, cstime follow
_RSS = 21  # field 24


@attrs.frozen(kw_only=True)
class GroupSample:
    """One reading of a process group."""

    pids: tuple[int, ...]
    """Every member, zombies included."""
    live_pids: tuple[int, ...]
    """The members that are not zombies."""
    rss: int
    """Resident memory of the members in bytes."""
    cpu_seconds: float
    """User and system CPU time of the members and their reaped children."""


def _stat_fields(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            raw = file.read()
    except OSError:  # vanished (ENOENT, ESRCH) or not ours to read
        return None
    _, _, rest = raw.rpartition(b")")
    return rest.decode("ascii", "replace").split()


def sample_group(pgid: int) -> GroupSample:
    """Scan ``/proc`` for the members of process group ``pgid`` and sum them up."""
    wanted = str(pgid)
    pids: list[int] = []
    live: list[int] = []
    pages = 0
    ticks = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(name)
        if fields is None or len(fields) <= _RSS or fields[_PGRP] != wanted:
            continue
        pids.append(int(name))
        ticks += sum(int(value) for value in fields[_UTIME : _UTIME + 4])
        pages += max(int(fields[_RSS]), 0)  # zero for a zombie: its memory is freed
        if fields[_STATE] not in ("Z", "X"):
            live.append(int(name))
    return GroupSample(
        pids=tuple(sorted(pids)),
        live_pids=tuple(sorted(live)),
        rss=pages * _PAGE_SIZE,
        cpu_seconds=ticks / _CLOCK_TICKS,
    )


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


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to every member of the group; ``False`` if none could be signalled."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (readable once it exits, without reaping it), or ``None``.

    ``None`` on kernels before 5.3 or sandboxes that forbid ``pidfd_open``.
    """
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
