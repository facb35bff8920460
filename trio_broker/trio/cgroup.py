"""cgroup v2: a delegated cgroup where each job runs in a cgroup of its own.

An execserver given a cgroup it may write (systemd's ``Delegate=yes``, a
container's own cgroup, any cgroup v2 folder writable by its user) runs each job
in a child cgroup. Membership is then exact (a process cannot leave its cgroup
without write access to another one), the whole job ends with one write to
``cgroup.kill`` (no process of it can escape by ``setsid``, a double fork or a
clean environment), and its memory comes from the memory controller's counters
of the job's cgroup instead of from a scan of every process on the host.
Synchronous and blocking, like :mod:`trio_broker.trio.procgroup`; the keeper
process uses it too.

Layout, below the execserver's own cgroup ``D`` (the ``0::`` line of
``/proc/self/cgroup``, under the cgroup2 mount found in ``/proc/self/mountinfo``)::

    D/trio-broker-<instance>/          the instance
    D/trio-broker-<instance>/daemon    the execserver and its keeper
    D/trio-broker-<instance>/job-<n>   one job each

Why the execserver leaves ``D``: cgroup v2's rule of no internal processes. A
cgroup that hands a controller (``memory``) down to its children may hold no
process itself (the root excepted), so the execserver moves into a leaf of its
own before it enables the memory controller for the jobs. Several execservers may
share ``D``: each has an instance folder of its own.

Detection (:func:`delegate`), in order, each step's failure being the reason the
execserver runs without a cgroup (it says which in its log and inspection page):
a cgroup2 mount; the process's cgroup on it; the instance folder can be made
there; the kernel has ``cgroup.kill`` (Linux 5.14); the process can move itself
into its ``daemon`` leaf. The memory controller is used when ``D`` offers it
(``cgroup.controllers``) and enabling it for the children succeeds (it cannot
while another process stays in ``D``); without it, a job's memory is the RSS of
the processes in its cgroup (still no scan of the host).

Memory read from the controller is ``anon + file_mapped`` of ``memory.stat``:
what RSS counts, but each page once. ``memory.current`` (and ``memory.peak``)
also count the page cache of the files a job reads and writes, which the kernel
reclaims at will: a converter writing a large output file is not a large job.

A stale instance (:func:`sweep_stale`): one whose ``daemon`` leaf holds no
process has lost its execserver and its keeper. Its jobs are killed and its
folders removed by the next execserver that starts beside it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import attrs

from trio_broker.trio.procgroup import wait_pids_gone

__all__ = [
    "INSTANCE_PREFIX",
    "Delegation",
    "JobCgroup",
    "delegate",
    "own_cgroup",
    "remove_instance",
    "sweep_stale",
]

INSTANCE_PREFIX: Final = "trio-broker-"
"""The name of every instance folder starts with this."""
_DAEMON: Final = "daemon"
_JOB_PREFIX: Final = "job-"
_GONE_TIMEOUT: Final = 5.0  # for killed processes to leave their cgroups


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _write(path: Path, text: str) -> None:
    with open(path, "w", encoding="ascii") as file:
        file.write(text)


def _cgroup2_mount(root: Path) -> Path | None:
    """Where cgroup v2 is mounted, from ``mountinfo`` (``/sys/fs/cgroup``, or ``…/unified``)."""
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if len(fields) >= 5 and kind and kind[0] == "cgroup2":
            return root / fields[4].lstrip("/")
    return None


def _own_cgroup2(root: Path) -> str | None:
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def own_cgroup(*, root: str | os.PathLike[str] = "/") -> Path | None:
    """This process's cgroup v2 folder (``D``), or ``None`` without cgroup v2.

    Args:
        root: where ``/proc`` and ``/sys`` are found.
    """
    base = Path(root)
    mount = _cgroup2_mount(base)
    own = _own_cgroup2(base)
    return None if mount is None or own is None else mount / own.lstrip("/")


def _pids(folder: Path) -> tuple[int, ...]:
    text = _read(folder / "cgroup.procs") or ""
    return tuple(int(word) for word in text.split() if word.isdigit())


def _populated(folder: Path) -> bool:
    """Whether a process lives in ``folder`` or below (``cgroup.events``)."""
    for line in (_read(folder / "cgroup.events") or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "populated":
            return value.strip() == "1"
    return bool(_pids(folder))


def _subfolders(folder: Path) -> list[Path]:
    try:
        return [entry for entry in folder.iterdir() if entry.is_dir()]
    except OSError:
        return []


@attrs.frozen(kw_only=True)
class Delegation:
    """A delegated cgroup in use: where the jobs' cgroups are made.

    Attributes:
        instance: this execserver's instance folder (``D/trio-broker-<id>``).
        memory: whether the jobs' cgroups have the memory controller.
        note: why the memory controller is not used, when it is not.
    """

    instance: Path
    memory: bool
    note: str | None = None

    @property
    def parent(self) -> Path:
        """The execserver's cgroup at start (``D``)."""
        return self.instance.parent

    def job(self, name: str) -> JobCgroup:
        """Make the cgroup of one job.

        Raises:
            OSError: it cannot be made.
        """
        path = self.instance / f"{_JOB_PREFIX}{name}"
        path.mkdir()
        return JobCgroup(path=path, memory=self.memory)

    def jobs(self) -> list[JobCgroup]:
        """The job cgroups of this instance."""
        return [
            JobCgroup(path=path, memory=self.memory)
            for path in _subfolders(self.instance)
            if path.name.startswith(_JOB_PREFIX)
        ]


@attrs.frozen(kw_only=True)
class JobCgroup:
    """The cgroup of one job."""

    path: Path
    memory: bool

    def open_procs(self) -> int:
        """A descriptor of ``cgroup.procs``: a child writes ``0`` to it to move in."""
        return os.open(self.path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

    def pids(self) -> tuple[int, ...]:
        """The processes in the cgroup now (exited ones are not listed)."""
        return _pids(self.path)

    def kill(self) -> None:
        """SIGKILL every process in the cgroup, at once (``cgroup.kill``)."""
        with contextlib.suppress(FileNotFoundError):
            _write(self.path / "cgroup.kill", "1")

    def memory_bytes(self) -> int | None:
        """``anon + file_mapped`` of ``memory.stat``; ``None`` without the controller."""
        if not self.memory:
            return None
        values: dict[str, int] = {}
        for line in (_read(self.path / "memory.stat") or "").splitlines():
            key, _, value = line.partition(" ")
            if key in ("anon", "file_mapped") and value.strip().isdigit():
                values[key] = int(value)
        if len(values) != 2:
            return None
        return values["anon"] + values["file_mapped"]

    def cpu_seconds(self) -> float | None:
        """CPU time the cgroup's processes used (``usage_usec`` of ``cpu.stat``)."""
        for line in (_read(self.path / "cpu.stat") or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec" and value.strip().isdigit():
                return int(value) / 1e6
        return None

    def remove(self, timeout: float = _GONE_TIMEOUT) -> bool:
        """Kill what is left, wait (bounded) for it to leave, remove the folder.

        Returns:
            Whether the folder is gone.
        """
        return _remove_tree(self.path, timeout)


def _remove_tree(folder: Path, timeout: float) -> bool:
    """Kill everything in ``folder`` and below, wait, remove the folders bottom-up."""
    if not folder.is_dir():
        return True
    with contextlib.suppress(OSError):
        _write(folder / "cgroup.kill", "1")
    wait_pids_gone([pid for path in _walk(folder) for pid in _pids(path)], timeout)
    for path in reversed(list(_walk(folder))):
        with contextlib.suppress(FileNotFoundError):
            try:
                path.rmdir()
            except OSError:
                return False
    return True


def _walk(folder: Path) -> Iterator[Path]:
    """``folder`` and every cgroup below it, parents first."""
    yield folder
    for sub in _subfolders(folder):
        yield from _walk(sub)


def _enable_memory(folder: Path) -> str | None:
    """Enable the memory controller for ``folder``'s children; why not, or ``None``."""
    if "memory" in (_read(folder / "cgroup.subtree_control") or "").split():
        return None
    if "memory" not in (_read(folder / "cgroup.controllers") or "").split():
        return f"the memory controller is not delegated to {folder}"
    try:
        _write(folder / "cgroup.subtree_control", "+memory")
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            return f"{folder} holds other processes, so it cannot hand the memory controller down"
        return f"cannot enable the memory controller in {folder}: {exc.strerror or exc}"
    return None


def delegate(instance: str, *, root: str | os.PathLike[str] = "/") -> Delegation | str:
    """Take the process's own cgroup for the jobs, if it can be used.

    Moves this process into ``D/trio-broker-<instance>/daemon`` (see the module
    docstring), so call it before starting the processes that should stay with
    it (the keeper) and never from two threads.

    Args:
        instance: names this execserver's folder (``[A-Za-z0-9_-]``).
        root: where ``/proc`` and ``/sys`` are found.

    Returns:
        The delegation, or one sentence saying why there is none.
    """
    base = Path(root)
    if _cgroup2_mount(base) is None:
        return "no cgroup v2 is mounted"
    parent = own_cgroup(root=root)
    if parent is None:
        return "this process has no cgroup v2 (/proc/self/cgroup)"
    folder = parent / f"{INSTANCE_PREFIX}{instance}"
    try:
        folder.mkdir()
        (folder / _DAEMON).mkdir()
    except OSError as exc:
        return f"cannot create a cgroup in {parent}: {exc.strerror or exc}"
    if not (folder / _DAEMON / "cgroup.kill").exists():
        _remove_tree(folder, 0)
        return "the kernel has no cgroup.kill (Linux 5.14 or later)"
    try:
        _write(folder / _DAEMON / "cgroup.procs", str(os.getpid()))
    except OSError as exc:
        _remove_tree(folder, 0)
        return f"cannot move into {folder / _DAEMON}: {exc.strerror or exc}"
    note = _enable_memory(parent)
    if note is None:
        note = _enable_memory(folder)
    return Delegation(instance=folder, memory=note is None, note=note)


def sweep_stale(parent: Path, *, timeout: float = _GONE_TIMEOUT) -> list[Path]:
    """Kill and remove the instances below ``parent`` whose execserver and keeper are gone.

    An instance is stale when its ``daemon`` leaf holds no process. Its job
    cgroups are killed, then its folders removed.

    Returns:
        The instance folders removed.
    """
    removed = []
    for folder in _subfolders(parent):
        if not folder.name.startswith(INSTANCE_PREFIX) or _populated(folder / _DAEMON):
            continue
        if _remove_tree(folder, timeout):
            removed.append(folder)
    return removed


def remove_instance(delegation: Delegation, *, timeout: float = _GONE_TIMEOUT) -> bool:
    """End an instance: kill its jobs, leave it, remove it.

    The calling process (the execserver at its end, or its keeper) moves itself
    to the parent cgroup first, when the parent may hold processes (the root, or
    a parent without controllers handed down); otherwise the ``daemon`` leaf
    stays until the process is gone (systemd or the next execserver removes it).

    Returns:
        Whether the instance folder is gone.
    """
    for job in delegation.jobs():
        job.remove(timeout)
    with contextlib.suppress(OSError):
        _write(delegation.parent / "cgroup.procs", str(os.getpid()))
    daemon = delegation.instance / _DAEMON
    if _pids(daemon):
        return False
    return _remove_tree(delegation.instance, timeout)
