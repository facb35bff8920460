"""The host probes: CPUs and memory from the affinity mask, cgroups and RAM."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tests.support.hosts import affinity, fake_tree, v2_tree
from trio_broker.trio import host


def test_memory_limit_v2_own_cgroup(tmp_path: Path) -> None:
    """cgroup v2: memory.max of the process's own cgroup is the limit."""
    root = v2_tree(
        tmp_path, "/job.slice/exec.scope", {"job.slice/exec.scope/memory.max": "268435456\n"}
    )
    assert host.cgroup_memory_limit(root=root) == 268435456


def test_memory_limit_v2_ancestor(tmp_path: Path) -> None:
    """cgroup v2: a lower limit on an ancestor cgroup wins over "max" below it."""
    root = v2_tree(
        tmp_path,
        "/job.slice/exec.scope",
        {
            "job.slice/exec.scope/memory.max": "max\n",
            "job.slice/memory.max": "1073741824\n",
            "memory.max": "2147483648\n",
        },
    )
    assert host.cgroup_memory_limit(root=root) == 1 << 30


def test_memory_limit_v2_unlimited(tmp_path: Path) -> None:
    """cgroup v2: "max" everywhere, or no memory.max file, is no limit."""
    root = v2_tree(tmp_path / "a", "/x", {"x/memory.max": "max\n", "memory.max": "max\n"})
    assert host.cgroup_memory_limit(root=root) is None
    assert host.cgroup_memory_limit(root=v2_tree(tmp_path / "b", "/", {})) is None


def test_memory_limit_v2_container_root(tmp_path: Path) -> None:
    """cgroup v2 in a container: "0::/" reads memory.max at the mount itself."""
    root = v2_tree(tmp_path, "/", {"memory.max": "536870912\n"})
    assert host.cgroup_memory_limit(root=root) == 512 << 20


def test_memory_limit_v2_missing_own_dir(tmp_path: Path) -> None:
    """cgroup v2: an own cgroup not visible under the mount falls back to the mount."""
    root = v2_tree(tmp_path, "/docker/abc", {"memory.max": "536870912\n"})
    assert host.cgroup_memory_limit(root=root) == 512 << 20


def test_memory_limit_v1(tmp_path: Path) -> None:
    """cgroup v1: memory.limit_in_bytes of the memory controller's cgroup is read."""
    root = fake_tree(
        tmp_path,
        {
            "proc/self/cgroup": "5:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n",
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "805306368\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
        },
    )
    assert host.cgroup_memory_limit(root=root) == 768 << 20


def test_memory_limit_v1_absurd_is_unlimited(tmp_path: Path) -> None:
    """cgroup v1: the "unlimited" page-counter maximum counts as no limit."""
    root = fake_tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
        },
    )
    assert host.cgroup_memory_limit(root=root) is None


def test_no_cgroups_at_all(tmp_path: Path) -> None:
    """An empty root (no /proc, no /sys) means no limits, not an error."""
    assert host.cgroup_memory_limit(root=tmp_path) is None
    assert host.cgroup_cpu_limit(root=tmp_path) is None
    assert host.cpu_count(root=tmp_path) == affinity()
    assert host.detect_memory_budget(root=tmp_path) == psutil.virtual_memory().total


def test_detect_memory_budget_takes_the_lower(tmp_path: Path) -> None:
    """The budget is the cgroup limit when it is below host RAM."""
    root = v2_tree(tmp_path, "/", {"memory.max": "268435456\n"})
    assert host.detect_memory_budget(root=root) == min(psutil.virtual_memory().total, 256 << 20)


def test_detect_memory_budget_ignores_huge_limits(tmp_path: Path) -> None:
    """A cgroup limit above host RAM leaves host RAM as the budget."""
    total = psutil.virtual_memory().total
    root = v2_tree(tmp_path, "/", {"memory.max": f"{total * 4}\n"})
    assert host.detect_memory_budget(root=root) == total


@pytest.mark.parametrize(
    ("cpu_max", "quota"),
    [
        ("max 100000\n", None),
        ("200000 100000\n", 2.0),
        ("150000 100000\n", 1.5),
        ("50000 100000\n", 0.5),
        ("garbage\n", None),
        ("0 100000\n", None),
    ],
)
def test_cgroup_cpu_limit(tmp_path: Path, cpu_max: str, quota: float | None) -> None:
    """cpu.max "<quota> <period>" is read as CPUs; "max" or junk is no limit."""
    root = v2_tree(tmp_path, "/", {"cpu.max": cpu_max})
    assert host.cgroup_cpu_limit(root=root) == quota


def test_cgroup_cpu_limit_tightest_ancestor(tmp_path: Path) -> None:
    """The tightest cpu.max among the own cgroup and its ancestors wins."""
    root = v2_tree(
        tmp_path,
        "/a/b",
        {"a/b/cpu.max": "max 100000\n", "a/cpu.max": "300000 100000\n", "cpu.max": "800000 100000"},
    )
    assert host.cgroup_cpu_limit(root=root) == 3.0


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("max 100000\n", None), ("50000 100000\n", 1), ("150000 100000\n", 2), ("1 1\n", 1)],
)
def test_cpu_count(tmp_path: Path, cpu_max: str, expected: int | None) -> None:
    """cpu_count is the affinity mask lowered to the quota rounded up, at least 1."""
    root = v2_tree(tmp_path, "/", {"cpu.max": cpu_max})
    want = affinity() if expected is None else min(affinity(), expected)
    assert host.cpu_count(root=root) == want


def test_probe_host_reads_both_figures_once(tmp_path: Path) -> None:
    """probe_host is cpu_count and detect_memory_budget of the same root, in one value."""
    root = v2_tree(tmp_path, "/", {"cpu.max": "100000 100000\n", "memory.max": "268435456\n"})
    total = psutil.virtual_memory().total
    assert host.probe_host(root=root) == host.HostResources(cpus=1, memory=min(total, 1 << 28))


@pytest.mark.parametrize(("cpus", "memory"), [(0, 1), (1, 0), (-1, 1), (1.5, 1), (True, 1)])
def test_host_resources_built_by_hand_are_checked(cpus: object, memory: object) -> None:
    """A hand-built HostResources refuses CPUs or memory that are not positive integers."""
    with pytest.raises(ValueError, match="must be a positive integer"):
        host.HostResources(cpus=cpus, memory=memory)  # type: ignore[arg-type]
