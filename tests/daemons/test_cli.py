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


# A finder that makes the daemons' extra look uninstalled, then runs the CLI.
WITHOUT_EXTRA = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("yaml", "rich", "psycopg", "psycopg_pool"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocker())
from trio_broker_daemons.commands.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_without_the_daemons_extra_one_line_names_it(tmp_path: Path) -> None:
    """A library-only install runs the CLI into one line naming the extra, exit 2."""
    config = tmp_path / "exec.yml"
    config.write_text("services: {noop: {builtin: noop}}\n")
    result = run(sys.executable, "-c", WITHOUT_EXTRA, "execserver", "--config", str(config))
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "pip install 'trio_broker[daemons]'" in line
    assert "yaml" in line


def test_fylr_requeue_needs_failed_and_a_database(tmp_path: Path) -> None:
    """``fylr requeue`` without --failed, --failed without requeue, and a configuration on
    the private cluster (no 'database') are refused with one line, exit 2."""
    config = tmp_path / "fylr.yml"
    config.write_text('state_dir: state\nexecservers: ["127.0.0.1:7000"]\n')
    module = (sys.executable, "-m", "trio_broker_daemons", "fylr")
    for args, said in (
        (("requeue", "--config", str(config)), "requeue needs --failed"),
        (("--failed", "--config", str(config)), "--failed and --id need requeue"),
        (("requeue", "--failed", "--config", str(config)), "POST /inspect/system/fylr/requeue"),
    ):
        result = run(*module, *args)
        assert result.returncode == 2, (args, result.stderr)
        (line,) = result.stderr.splitlines()
        assert said in line
