"""``make demo``'s script, run once the way the Makefile runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import trio

REPOSITORY = Path(__file__).resolve().parents[2]
DEMO = REPOSITORY / "examples" / "demo.py"


async def test_the_demo_runs_to_the_end_and_exits_0(tmp_path: Path) -> None:
    """The demo starts its daemons, gets every sample to its promised versions and exits 0."""
    with trio.fail_after(240):
        result = await trio.run_process(
            [sys.executable, str(DEMO)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=tmp_path,  # it must not depend on the working directory
        )
    output = result.stdout.decode("utf-8", "replace") + result.stderr.decode("utf-8", "replace")
    assert result.returncode == 0, output
    assert "every file ended with the versions the example configuration promises" in output
    assert "UNEXPECTED" not in output
    assert "/inspect/system/fylr" in output
    assert "/metrics" in output
    assert "broken.png (priority 0): done" in output
    assert "modified original of sunset.jpg (rotate 90, format png)" in output
    assert "sunset.png: done, derived from" in output
    # one file registered by its URL, served on loopback by the demo, copied in
    assert "remote-sunset.jpg: copied in from http://127.0.0.1:" in output
    assert "remote-sunset.jpg (priority 2): done" in output
    assert "done, exit status 0" in output
    # the state folder is gone
    line = next(line for line in output.splitlines() if "state folder" in line)
    folder = trio.Path(line.split("state folder ", 1)[1].split(":", 1)[0])
    assert not await folder.exists()
