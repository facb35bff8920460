"""Fake ``/proc`` and ``/sys`` trees for the host-probe and configuration tests."""

from __future__ import annotations

import os
from pathlib import Path


def fake_tree(root: Path, files: dict[str, str]) -> Path:
    """Create files under ``root`` (a fake ``/``) and return ``root``."""
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    return root


def v2_tree(root: Path, own: str, files: dict[str, str]) -> Path:
    """A fake cgroup v2 host whose process sits in cgroup ``own``."""
    fs = {
        "proc/self/cgroup": f"0::{own}\n",
        "sys/fs/cgroup/cgroup.controllers": "cpu memory pids\n",
    }
    fs.update({f"sys/fs/cgroup/{name}": text for name, text in files.items()})
    return fake_tree(root, fs)


def affinity() -> int:
    """The CPUs of this process's affinity mask."""
    return len(os.sched_getaffinity(0))
