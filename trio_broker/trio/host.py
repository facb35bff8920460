"""What this host gives a process: CPUs and memory, cgroup limits included.

The execserver sizes its slot pool and memory budget from these figures and the
dispatcher its local-work semaphore; :func:`probe_host` reads them once into one
frozen :class:`HostResources` value, so that every consumer sees the same figures
and tests can build one by hand. Reading ``/proc`` and ``/sys`` is I/O, so this
module belongs to the trio layer, not to the core, although it uses no trio.

``root`` arguments say where ``/proc`` and ``/sys`` are found (tests point them
at a folder of their own).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Final

import attrs
import psutil

__all__ = [
    "HostResources",
    "cgroup_cpu_limit",
    "cgroup_memory_limit",
    "cpu_count",
    "detect_memory_budget",
    "probe_host",
]

_CGROUP_UNLIMITED: Final = 2**60
"""cgroup limits at or above this are "no limit" (v1 writes 2**63 - 4096)."""


def _positive_int(_: object, attribute: attrs.Attribute[int], value: object) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen(kw_only=True)
class HostResources:
    """The CPUs and memory a process of this host may use.

    Attributes:
        cpus: CPUs of the affinity mask, lowered to a cgroup v2 quota (rounded up).
        memory: host RAM, lowered to the tightest cgroup memory limit, in bytes.

    Raises:
        ValueError: ``cpus`` or ``memory`` is not a positive integer.
    """

    cpus: int = attrs.field(validator=_positive_int)
    memory: int = attrs.field(validator=_positive_int)


def probe_host(*, root: str | os.PathLike[str] = "/") -> HostResources:
    """Read the host's CPUs and memory (with their cgroup limits) once.

    Args:
        root: where ``/proc`` and ``/sys`` are found (tests point it elsewhere).

    Returns:
        :func:`cpu_count` and :func:`detect_memory_budget`, read now.
    """
    return HostResources(cpus=cpu_count(root=root), memory=detect_memory_budget(root=root))


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _own_cgroups(root: Path) -> dict[str, str]:
    """Controller → cgroup path from ``/proc/self/cgroup`` (``""`` is cgroup v2)."""
    result: dict[str, str] = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                result.setdefault(controller, parts[2])
    return result


def _cgroup_dirs(mount: Path, own: str | None) -> list[Path]:
    """The process's cgroup directory and its ancestors up to the mount, inclusive."""
    dirs = [mount]
    if own is not None:
        here = mount / own.lstrip("/")
        if here != mount and here.is_dir():
            dirs = [here, *(p for p in here.parents if p.is_relative_to(mount))]
    return dirs


def _cgroup_v2_mount(root: Path) -> Path | None:
    mount = root / "sys/fs/cgroup"
    return mount if (mount / "cgroup.controllers").is_file() else None


def cgroup_memory_limit(*, root: str | os.PathLike[str] = "/") -> int | None:
    """The tightest cgroup memory limit on this process, in bytes.

    Reads cgroup v2 ``memory.max`` (mounted at ``/sys/fs/cgroup``) or else v1
    ``memory.limit_in_bytes`` (at ``/sys/fs/cgroup/memory``), in the process's own
    cgroup (from ``/proc/self/cgroup``) and every ancestor. ``max``, unparsable,
    non-positive and absurd (>= 2**60) values count as no limit.

    Args:
        root: where ``/proc`` and ``/sys`` are found (tests point it elsewhere).

    Returns:
        The lowest limit found, or ``None`` when there is none.
    """
    base = Path(root)
    own = _own_cgroups(base)
    v2 = _cgroup_v2_mount(base)
    if v2 is not None:
        dirs, filename = _cgroup_dirs(v2, own.get("")), "memory.max"
    else:
        dirs, filename = (
            _cgroup_dirs(base / "sys/fs/cgroup/memory", own.get("memory")),
            ("memory.limit_in_bytes"),
        )
    limits = []
    for directory in dirs:
        text = _read(directory / filename)
        if text is not None and text.isdigit() and 0 < int(text) < _CGROUP_UNLIMITED:
            limits.append(int(text))
    return min(limits, default=None)


def cgroup_cpu_limit(*, root: str | os.PathLike[str] = "/") -> float | None:
    """The tightest cgroup v2 CPU quota on this process, in CPUs.

    Reads ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``) in the
    process's own cgroup and every ancestor. cgroup v1 quotas are not read.

    Args:
        root: where ``/proc`` and ``/sys`` are found (tests point it elsewhere).

    Returns:
        ``quota / period`` of the tightest limit, or ``None`` when there is none.
    """
    base = Path(root)
    v2 = _cgroup_v2_mount(base)
    if v2 is None:
        return None
    limits = []
    for directory in _cgroup_dirs(v2, _own_cgroups(base).get("")):
        fields = (_read(directory / "cpu.max") or "").split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            quota, period = int(fields[0]), int(fields[1])
            if quota > 0 and period > 0:
                limits.append(quota / period)
    return min(limits, default=None)


def cpu_count(*, root: str | os.PathLike[str] = "/") -> int:
    """The CPUs this process may use.

    The CPUs of its affinity mask (``os.sched_getaffinity``; ``os.cpu_count()``
    where that does not exist), lowered to a cgroup v2 quota rounded up (1.5 CPUs of
    quota keep 2 jobs busy).

    Args:
        root: where ``/proc`` and ``/sys`` are found (tests point it elsewhere).

    Returns:
        The CPU count, at least 1.
    """
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_limit(root=root)
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)


def detect_memory_budget(*, root: str | os.PathLike[str] = "/") -> int:
    """The memory jobs may use together: host RAM or the lower cgroup limit.

    Args:
        root: where ``/proc`` and ``/sys`` are found (tests point it elsewhere);
            host RAM always comes from psutil.

    Returns:
        The budget in bytes.
    """
    total = int(psutil.virtual_memory().total)
    limit = cgroup_memory_limit(root=root)
    return total if limit is None else min(total, limit)
