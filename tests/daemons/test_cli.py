"""The trio-broker command line, run as real subprocesses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from trio_broker import __version__


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def test_version_console_script() -> None:
    """The installed console script prints the package version."""
    script = Path(sys.executable).parent / "trio-broker"
    result = run(str(script), "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"trio-broker {__version__}"


def test_module_help() -> None:
    """``python -m trio_broker --help`` works and describes the tool."""
    result = run(sys.executable, "-m", "trio_broker_daemons", "--help")
    assert result.returncode == 0
    assert "usage: trio-broker" in result.stdout


def test_no_command_prints_help_and_exits_2() -> None:
    result = run(sys.executable, "-m", "trio_broker_daemons")
    assert result.returncode == 2
    assert "usage: trio-broker" in result.stdout
