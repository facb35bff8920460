"""`make test` and `make demo` install the system packages they need, or say in one
line what to install: shown by running the Makefile's own check with a PATH that
lacks the programs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make") or "/usr/bin/make"


def make_check(path: str, mode: str) -> subprocess.CompletedProcess[str]:
    """``make system-test`` with only ``path`` to search (no sbin folders added)."""
    env = {**os.environ, "PATH": path}
    return subprocess.run(
        [MAKE, "-s", "-C", str(ROOT), "system-test", "SBIN=", f"SYSTEM_PACKAGES={mode}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def fake_programs(folder: Path, *names: str) -> str:
    """A PATH whose only sbin-like programs are do-nothing stand-ins for ``names``."""
    for name in names:
        fake = folder / name
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
    return f"{folder}:/usr/bin:/bin"


OTHERS = ("nft", "ip")  # what make test needs beside haproxy and PostgreSQL


def lines_naming(text: str, word: str) -> list[str]:
    return [line for line in text.splitlines() if word in line]


def test_a_missing_haproxy_is_named_in_one_line(tmp_path: Path) -> None:
    """Without haproxy on PATH the check fails with one line naming the package."""
    result = make_check(fake_programs(tmp_path, *OTHERS), "check")
    assert result.returncode != 0
    (line,) = lines_naming(result.stderr, "missing system packages")
    assert "haproxy" in line
    assert "apt-get install haproxy" in line
    assert not lines_naming(result.stdout, "haproxy")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root installs with apt-get")
def test_as_root_the_missing_package_would_be_installed(tmp_path: Path) -> None:
    """As root the check installs what is missing: the dry run shows the apt-get call."""
    result = make_check(fake_programs(tmp_path, *OTHERS), "dry-run")
    assert result.returncode != 0
    assert lines_naming(result.stdout, "apt-get") == ["would run: apt-get install -y haproxy"]


def test_nothing_is_said_when_everything_is_there(tmp_path: Path) -> None:
    """With every program present the check is silent and succeeds."""
    result = make_check(fake_programs(tmp_path, "haproxy", *OTHERS), "check")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
