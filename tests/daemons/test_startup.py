"""The first minute of a daemon: warnings at load, one-line start-up failures, log formats.

Each daemon runs as a real subprocess of the command line; what it prints on
stderr is counted line by line.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
import yaml
from trio_broker_daemons.execserver.app import config_warnings, tls_problem
from trio_broker_daemons.execserver.config import ExecserverConfig


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_broker_daemons", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port some other socket listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def write(tmp_path: Path, document: dict[str, object], name: str = "exec.yml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document))
    return path


NOOP = {"probe": {"builtin": "noop"}}


# -- start-up failures ----------------------------------------------------------------


def test_execserver_on_a_port_in_use_says_so_in_one_line(tmp_path: Path, busy_port: int) -> None:
    """A port in use: one line naming the address, exit 1 (not an exception group)."""
    config = write(tmp_path, {"listen": f"127.0.0.1:{busy_port}", "services": NOOP})
    result = run_cli("execserver", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"trio-broker execserver: cannot listen on 127.0.0.1:{busy_port}: address already in use"
    ]


def test_fylr_on_a_port_in_use_says_so_in_one_line(
    tmp_path: Path, busy_port: int, pg_dsn: str
) -> None:
    """The fylr's start-up path is the same: one line, exit 1."""
    config = write(
        tmp_path,
        {
            "listen": f"127.0.0.1:{busy_port}",
            "state_dir": str(tmp_path / "state"),
            "database": pg_dsn,
            "database_pool": 2,
            "execservers": [],
        },
        name="fylr.yml",
    )
    result = run_cli("--log-level", "error", "fylr", "--config", str(config))
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"trio-broker fylr: cannot listen on 127.0.0.1:{busy_port}: address already in use"
    ]


def test_a_missing_tls_file_is_one_line_naming_key_and_file(tmp_path: Path) -> None:
    """tls.cert that does not exist: one line with the key and the resolved path, exit 1."""
    (tmp_path / "k.pem").write_text("")
    config = write(
        tmp_path,
        {"listen": "127.0.0.1:0", "tls": {"cert": "c.pem", "key": "k.pem"}, "services": NOOP},
    )
    result = run_cli("execserver", "--config", str(config))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"trio-broker execserver: tls.cert: cannot read '{tmp_path / 'c.pem'}':"
        " No such file or directory"
    ]


def test_tls_files_that_are_not_a_key_pair_are_one_problem(tmp_path: Path) -> None:
    """A certificate with another certificate's key: one problem naming both files."""
    authority = trustme.CA()
    cert = authority.issue_cert("localhost")
    other = authority.issue_cert("localhost")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "c.pem"))
    other.private_key_pem.write_to_path(str(tmp_path / "k.pem"))
    good = ExecserverConfig.from_mapping(
        {"tls": {"cert": str(tmp_path / "c.pem"), "key": str(tmp_path / "c.pem")}, "services": NOOP}
    )
    bad = ExecserverConfig.from_mapping(
        {"tls": {"cert": str(tmp_path / "c.pem"), "key": str(tmp_path / "k.pem")}, "services": NOOP}
    )
    problem = tls_problem(bad)
    assert problem is not None
    assert problem.startswith(f"tls: cannot use '{tmp_path / 'c.pem'}' with '{tmp_path / 'k.pem'}'")
    assert tls_problem(good) is not None  # a certificate is no key either
    cert.private_key_pem.write_to_path(str(tmp_path / "k.pem"))
    assert tls_problem(bad) is None


# -- warnings at load --------------------------------------------------------------------


def test_a_missing_program_and_an_exposed_listener_are_one_warning_each(tmp_path: Path) -> None:
    """Each missing program names its service; a listener beyond loopback without a token warns."""
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o644)
    config = ExecserverConfig.from_mapping(
        {
            "listen": "0.0.0.0:7000",
            "services": {
                "ok": {"argv": ["sh", "-c", "true"]},
                "gone": {"argv": ["no-such-program-anywhere"]},
                "relative": {"argv": ["bin/run"]},
                "mode": {"argv": [str(tool)]},
                "own-path": {"argv": ["sh"], "env": {"PATH": str(tmp_path)}},
                "builtin": {"builtin": "noop"},
            },
        }
    )
    warnings = config_warnings(config)
    assert [(w.fields.get("service"), w.text) for w in warnings] == [
        ("gone", "service 'gone': program 'no-such-program-anywhere' is not found on the PATH"),
        (
            "relative",
            "service 'relative': program 'bin/run' is a relative path, but commands run in a"
            " fresh work folder of their own (write {config_dir}/… or an absolute path)",
        ),
        ("mode", f"service 'mode': program '{tool}' is not executable"),
        ("own-path", "service 'own-path': program 'sh' is not found on the PATH"),
        (
            None,
            "listening on 0.0.0.0:7000 without a broker_token: anyone who can reach it can run"
            " jobs and read its inspection (set broker_token or broker_token_file, or listen on"
            " 127.0.0.1)",
        ),
    ]
    for listen, token in [("127.0.0.1:7000", None), ("[::1]:7000", None), ("0.0.0.0:1", "t")]:
        quiet = ExecserverConfig.from_mapping(
            {"listen": listen, "broker_token": token, "services": NOOP}
        )
        assert config_warnings(quiet) == []


def test_warnings_are_log_lines_in_the_chosen_format(tmp_path: Path) -> None:
    """--log-format json after the subcommand: the warning is one JSON line, then the failure."""
    config = write(
        tmp_path,
        {
            "listen": "127.0.0.1:0",
            "tls": {"cert": "missing.pem", "key": "missing.pem"},
            "services": {"gone": {"argv": ["no-such-program-anywhere"]}},
        },
    )
    result = run_cli("execserver", "--config", str(config), "--log-format", "json")
    assert result.returncode == 1
    warning, failure = result.stderr.splitlines()
    record = json.loads(warning)
    assert record["level"] == "warning"
    assert (record["service"], record["program"]) == ("gone", "no-such-program-anywhere")
    assert record["ts"].endswith("Z")
    assert failure.startswith("trio-broker execserver: tls.cert: cannot read")


@pytest.mark.parametrize(
    "args",
    [
        ["--log-format", "json", "--log-level", "warning", "execserver", "--config", "CONFIG"],
        ["execserver", "--config", "CONFIG", "--log-level", "warning", "--log-format", "json"],
        ["--log-format", "logfmt", "execserver", "--log-format", "json", "--config", "CONFIG"],
    ],
    ids=["before", "after", "after-wins"],
)
def test_global_options_before_or_after_the_subcommand(tmp_path: Path, args: list[str]) -> None:
    """--log-level and --log-format work on either side of the subcommand."""
    config = write(
        tmp_path,
        {
            "listen": "127.0.0.1:0",
            "tls": {"cert": "missing.pem", "key": "missing.pem"},
            "services": {"gone": {"argv": ["no-such-program-anywhere"]}},
        },
    )
    result = run_cli(*[str(config) if arg == "CONFIG" else arg for arg in args])
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stderr.splitlines()[0])["level"] == "warning"


def test_a_config_error_from_the_environment_exits_2_naming_the_variable(tmp_path: Path) -> None:
    """A bad TRIO_BROKER_ variable is a configuration problem: one line, exit 2."""
    config = write(tmp_path, {"listen": "127.0.0.1:0", "services": NOOP})
    result = run_cli(
        "execserver", "--config", str(config), env={"TRIO_BROKER_SLOTS": "many", "PATH": ""}
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"trio-broker execserver: {config}: slots: expected an integer, got 'many'"
        " (from TRIO_BROKER_SLOTS)"
    ]


def test_a_bad_max_wants_per_connection_exits_2_naming_the_key(tmp_path: Path) -> None:
    """max_wants_per_connection below 1: one line naming the key path, exit 2."""
    config = write(
        tmp_path, {"listen": "127.0.0.1:0", "max_wants_per_connection": 0, "services": NOOP}
    )
    result = run_cli("execserver", "--config", str(config), env={"PATH": ""})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"trio-broker execserver: {config}: max_wants_per_connection: expected an integer"
        " >= 1, got 0"
    ]
