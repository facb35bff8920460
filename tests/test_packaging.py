"""The wheel: the library and the daemons under their own names, typed, licensed,
with the daemons' dependencies behind an extra."""

from __future__ import annotations

import email.parser
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.test_daemons_layout import ROOMS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (path,) = out.glob("trio_broker-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_ships_both_packages_typed_with_their_data(wheel: zipfile.ZipFile) -> None:
    """Both packages, their py.typed markers, the migrations, the topology page and its
    schema, and the licence."""
    names = set(wheel.namelist())
    assert {name.split("/")[0] for name in names if "dist-info" not in name} == {
        "trio_broker",
        "trio_broker_daemons",
    }
    for needed in (
        "trio_broker/py.typed",
        "trio_broker_daemons/py.typed",
        "trio_broker/trio/migrations/001_queue.sql",
        "trio_broker_daemons/fylr/migrations/001_files.sql",
        "trio_broker/trio/migrations/002_backend_view.sql",
        "trio_broker_daemons/fylr/static/topology.html",
        "trio_broker_daemons/fylr/topology.schema.json",
    ):
        assert needed in names
    assert any(name.endswith("licenses/LICENSE") for name in names)


def test_the_library_alone_does_not_pull_the_daemons_stack(wheel: zipfile.ZipFile) -> None:
    """PyYAML, rich and psycopg come only with the extras."""
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    message = email.parser.Parser().parsestr(wheel.read(metadata).decode())
    requires = message.get_all("Requires-Dist") or []
    unconditional = {
        r.split(";")[0].split(">")[0].split("[")[0].strip().lower()
        for r in requires
        if "extra ==" not in r
    }
    assert "trio" in unconditional
    assert not unconditional & {"pyyaml", "rich", "psycopg", "psycopg-pool"}
    assert {"postgres", "daemons", "testing"} <= set(message.get_all("Provides-Extra") or [])


def test_the_wheel_ships_the_daemons_rooms_and_no_test_fixture(wheel: zipfile.ZipFile) -> None:
    """The daemons' package holds its rooms only: the test fixtures (HAProxy, the daemons
    as processes) stay in tests/support, and the command's entry point is in the wheel."""
    names = set(wheel.namelist())
    rooms = {name.split("/")[1] for name in names if name.startswith("trio_broker_daemons/")}
    assert rooms == ROOMS
    assert [name for name in names if name.endswith(("/haproxy.py", "/processes.py"))] == []
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = wheel.read(entry_points).decode()
    assert "trio-broker = trio_broker_daemons.commands.cli:main" in scripts
    assert "trio_broker_daemons/commands/cli.py" in names
