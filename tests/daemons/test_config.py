"""The execserver configuration: loading, defaults, pinned error lines, resolution rules."""

from __future__ import annotations

import math
import os
import socket
import textwrap
from decimal import Decimal
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from trio_broker_daemons.config import values as c
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.execserver.config import ExecserverConfig, ServiceConfig, TlsConfig

from tests.support.hosts import v2_tree
from trio_broker.core.argv import ArgvTemplate, TemplateError
from trio_broker.trio.host import HostResources, cpu_count, probe_host

DESIGN_EXAMPLE = """\
listen: 127.0.0.1:7000       # host:port of the one HTTP listener
name: exec-a                 # default: the host name
broker_token: null           # when set, /broker requires "Authorization: Bearer <token>"
tls: null                    # {cert: PATH, key: PATH} serves https/wss
slots: 0                     # 0 = CPU count
fast_reserve: -1             # -1 = a quarter of the pool, at least 1; 0 = none
heavy_threshold: 10s         # rolling-mean runtime at or above which a service is heavy
unknown_share: 0.5           # unmeasured services together hold at most this share (>= 1 slot)
memory_budget: auto          # bytes, or auto (cgroup limit or host RAM)
offer_ttl: 10s
ping_interval: 5s
ping_timeout: 15s
drain_timeout: 60s
stall_timeout: 10m
temp_dir: null               # default: the system temp dir
max_frame_bytes: 1048576
env: {}                      # added to every command's environment
services:
  thumbnail:
    argv: [convert, "{input}", -thumbnail, "{size}", "{output}"]   # "{name}" from job.params
    max_slots: 0             # 0 = no cap beyond the pool
    threads: 0               # FYLR_CONVERT_THREADS: 0 all CPUs, N, -N, N%, -N%
    timeout: "30m"           # "0" = none
    stall_timeout: null      # default: the top-level one
    env: {}
  probe: {builtin: noop}     # in-process, ends at once (tests, benchmarks)
  hold: {builtin: sleep}     # in-process, holds its slot params.seconds
"""

MINIMAL = {"services": {"probe": {"builtin": "noop"}}}
HOST = HostResources(cpus=4, memory=8 << 30)
"""A host built by hand: what the loader resolves against."""


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    """Write a configuration file and return its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def load(tmp_path: Path, text: str) -> ExecserverConfig:
    """Load YAML text through a real file."""
    return ExecserverConfig.from_yaml(write(tmp_path, text))


def yaml_error(tmp_path: Path, text: str) -> str:
    """The one-line ConfigError that loading this YAML text raises."""
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    message = str(info.value)
    assert "\n" not in message
    return message


def mapping_error(data: object) -> str:
    """The one-line ConfigError that from_mapping raises for this data."""
    with pytest.raises(ConfigError) as info:
        ExecserverConfig.from_mapping(data)
    message = str(info.value)
    assert "\n" not in message
    return message


def with_services(**services: Any) -> dict[str, Any]:
    """A top-level mapping holding just these services."""
    return {"services": services}


def service(data: dict[str, Any]) -> ServiceConfig:
    """One service ``s`` loaded through a full configuration."""
    return ExecserverConfig.from_mapping(with_services(s=data)).services["s"]


# -- the documented example and defaults ----------------------------------------------


def test_design_example_loads(tmp_path: Path) -> None:
    """The YAML block of DESIGN.md loads with the values it spells out."""
    config = load(tmp_path, DESIGN_EXAMPLE)
    assert (config.host, config.port, config.name) == ("127.0.0.1", 7000, "exec-a")
    assert config.broker_token is None
    assert config.tls is None
    assert config.temp_dir is None
    assert (config.slots, config.fast_reserve, config.unknown_share) == (0, -1, 0.5)
    assert config.memory_budget == "auto"
    assert (config.heavy_threshold, config.offer_ttl, config.ping_interval) == (10, 10, 5)
    assert (config.ping_timeout, config.drain_timeout, config.stall_timeout) == (15, 60, 600)
    assert config.max_frame_bytes == 1048576
    assert config.env == {}
    assert list(config.services) == ["thumbnail", "probe", "hold"]
    thumbnail = config.services["thumbnail"]
    assert thumbnail.argv is not None
    assert thumbnail.argv.source == ("convert", "{input}", "-thumbnail", "{size}", "{output}")
    assert thumbnail.builtin is None
    assert thumbnail.placeholders == {"input", "size", "output"}
    assert (thumbnail.max_slots, thumbnail.threads, thumbnail.timeout) == (0, 0, 1800.0)
    assert thumbnail.stall_timeout == 600.0
    assert config.services["probe"].builtin == "noop"
    assert config.services["hold"].builtin == "sleep"


def test_every_default(tmp_path: Path) -> None:
    """A file with one builtin service gets every documented default."""
    config = load(tmp_path, "services: {probe: {builtin: noop}}")
    assert config == ExecserverConfig(
        listen="127.0.0.1:7000",
        name=socket.gethostname(),
        broker_token=None,
        tls=None,
        slots=0,
        fast_reserve=-1,
        heavy_threshold=10.0,
        unknown_share=0.5,
        memory_budget="auto",
        offer_ttl=10.0,
        ping_interval=5.0,
        ping_timeout=15.0,
        drain_timeout=60.0,
        stall_timeout=600.0,
        temp_dir=None,
        max_frame_bytes=1048576,
        env={},
        services={
            "probe": ServiceConfig(
                argv=None,
                builtin="noop",
                max_slots=0,
                threads=0,
                timeout=None,
                timeout_sec=None,
                stall_timeout=600.0,
                memory_limit=None,
                env={},
            )
        },
    )


def test_full_configuration(tmp_path: Path) -> None:
    """Every key set to a non-default value is read into the right type."""
    config = load(
        tmp_path,
        """
        listen: "[::1]:0"
        name: exec-b
        broker_token: s3cret
        tls: {cert: certs/a.pem, key: /etc/k.pem}
        slots: 6
        fast_reserve: 2
        heavy_threshold: 1.5
        unknown_share: 1
        memory_budget: 2G
        offer_ttl: 500ms
        ping_interval: 1s
        ping_timeout: 1m30s
        drain_timeout: "0"
        stall_timeout: "0"
        temp_dir: /var/tmp/jobs
        max_frame_bytes: 1024
        env: {LANG: C.UTF-8, EMPTY: ""}
        services:
          ffmpeg:
            argv: [ffmpeg, -i, "{input}", "{{literal}}", "{output}"]
            max_slots: 2
            threads: "-25%"
            timeout: 12h
            stall_timeout: 2m
            memory_limit: 1.5GiB
            env: {X: "1"}
        """,
    )
    assert (config.host, config.port) == ("::1", 0)
    assert (config.name, config.broker_token) == ("exec-b", "s3cret")
    # a relative path is relative to the file's folder, an absolute one is kept
    assert config.tls == TlsConfig(cert=tmp_path / "certs/a.pem", key=Path("/etc/k.pem"))
    assert (config.slots, config.fast_reserve, config.heavy_threshold) == (6, 2, 1.5)
    assert config.unknown_share == 1.0
    assert type(config.unknown_share) is float
    assert config.memory_budget == 2 * 1024**3
    assert (config.offer_ttl, config.ping_interval, config.ping_timeout) == (0.5, 1.0, 90.0)
    assert (config.drain_timeout, config.stall_timeout) == (0.0, None)
    assert (config.temp_dir, config.max_frame_bytes) == (Path("/var/tmp/jobs"), 1024)
    assert config.env == {"LANG": "C.UTF-8", "EMPTY": ""}
    ffmpeg = config.services["ffmpeg"]
    assert ffmpeg.placeholders == {"input", "output"}
    assert (ffmpeg.max_slots, ffmpeg.threads, ffmpeg.timeout) == (2, "-25%", 43200.0)
    assert (ffmpeg.stall_timeout, ffmpeg.memory_limit) == (120.0, 1610612736)
    assert ffmpeg.env == {"X": "1"}


def test_values_are_frozen_tuples() -> None:
    """Configurations are frozen values and argv is stored parsed, reading as a tuple."""
    config = ExecserverConfig.from_mapping(with_services(s={"argv": ["true", "{x}"]}))
    argv = config.services["s"].argv
    assert isinstance(argv, ArgvTemplate)
    assert argv.source == tuple(argv) == ("true", "{x}")
    assert argv[:1] == ("true",)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.slots = 3  # type: ignore[misc]


def test_from_mapping_accepts_any_mapping() -> None:
    """from_mapping takes read-only mappings and tuples, not only dicts and lists."""
    from types import MappingProxyType

    data = MappingProxyType({"services": MappingProxyType({"s": {"argv": ("a", "b")}})})
    assert ExecserverConfig.from_mapping(data).services["s"].argv == ArgvTemplate.parse(("a", "b"))


@pytest.mark.parametrize(
    ("listen", "host", "port"),
    [
        ("127.0.0.1:7000", "127.0.0.1", 7000),
        ("[::1]:7000", "::1", 7000),
        ("[fe80::1%eth0]:80", "fe80::1%eth0", 80),
        ("localhost:0", "localhost", 0),
        ("0.0.0.0:65535", "0.0.0.0", 65535),
        ("exec-a.example.org:443", "exec-a.example.org", 443),
    ],
)
def test_listen_forms(listen: str, host: str, port: int) -> None:
    """listen accepts host:port and [IPv6]:port and exposes the parsed parts."""
    config = ExecserverConfig.from_mapping({**MINIMAL, "listen": listen})
    assert (config.host, config.port) == (host, port)


LISTEN_HINT = 'listen: expected host:port (e.g. "127.0.0.1:7000" or "[::1]:7000"), got '


@pytest.mark.parametrize(
    ("listen", "message"),
    [
        (7000, LISTEN_HINT + "7000"),
        ("localhost", LISTEN_HINT + "'localhost'"),
        (":7000", LISTEN_HINT + "':7000'"),
        ("host:", LISTEN_HINT + "'host:'"),
        ("host:http", LISTEN_HINT + "'host:http'"),
        ("host:-1", LISTEN_HINT + "'host:-1'"),
        ("[nope]:80", LISTEN_HINT + "'[nope]:80'"),
        ("::1:7000", LISTEN_HINT + "'::1:7000' (write an IPv6 address in brackets)"),
        ("a b:80", LISTEN_HINT + "'a b:80'"),
        ("host:70000", "listen: expected a port from 0 to 65535, got 'host:70000'"),
    ],
)
def test_bad_listen(listen: object, message: str) -> None:
    """A listen value that is not host:port is refused with the expected form."""
    assert mapping_error({**MINIMAL, "listen": listen}) == message


# -- pinned error lines ---------------------------------------------------------

DURATION_HINT = '(use e.g. "10s", "30m", "12h" or a number of seconds)'
SIZE_HINT = 'an integer or a string like "512M", "2G", "1.5GiB"'
NOOP = "  probe: {builtin: noop}\n"

ERROR_CASES = [
    # unknown keys, nested and top-level
    (
        "services:\n  thumb:\n    argvv: [convert]\n",
        "services.thumb.argvv: unknown key (did you mean 'argv'?)",
    ),
    ("slot: 4\nservices:\n" + NOOP, "slot: unknown key (did you mean 'slots'?)"),
    ("colour: red\nservices:\n" + NOOP, "colour: unknown key"),
    ("tls: {cert: a, key: b, ca: c}\nservices:\n" + NOOP, "tls.ca: unknown key"),
    (
        "servics:\n" + NOOP,
        "servics: unknown key (did you mean 'services'?)",
    ),
    # wrong types: strict primitives
    (
        "services:\n  ffmpeg: {argv: [ffmpeg], max_slots: two}\n",
        "services.ffmpeg.max_slots: expected an integer, got 'two'",
    ),
    ("slots: '2'\nservices:\n" + NOOP, "slots: expected an integer, got '2'"),
    ("slots: true\nservices:\n" + NOOP, "slots: expected an integer, got true"),
    ("slots: 2.5\nservices:\n" + NOOP, "slots: expected an integer, got 2.5"),
    ("slots: null\nservices:\n" + NOOP, "slots: expected an integer, got null"),
    ("name: 42\nservices:\n" + NOOP, "name: expected a string, got 42 (quote it)"),
    ("name: ''\nservices:\n" + NOOP, "name: expected a non-empty string, got ''"),
    ("broker_token: [a]\nservices:\n" + NOOP, "broker_token: expected a string, got a list"),
    ("unknown_share: half\nservices:\n" + NOOP, "unknown_share: expected a number, got 'half'"),
    ("tls: true\nservices:\n" + NOOP, "tls: expected a mapping, got true"),
    ("tls: {cert: a.pem}\nservices:\n" + NOOP, "tls.key: required key is missing"),
    ("temp_dir: 5\nservices:\n" + NOOP, "temp_dir: expected a string, got 5 (quote it)"),
    ("env: {A: 1}\nservices:\n" + NOOP, "env.A: expected a string, got 1 (quote it)"),
    ("env: {A: yes}\nservices:\n" + NOOP, "env.A: expected a string, got true (quote it)"),
    ("env: [A]\nservices:\n" + NOOP, "env: expected a mapping of strings, got a list"),
    (
        "env: {A=B: x}\nservices:\n" + NOOP,
        "env: expected a variable name (a non-empty string without '='), got 'A=B'",
    ),
    (
        "services:\n  s: {builtin: noop, env: {X: [1]}}\n",
        "services.s.env.X: expected a string, got a list",
    ),
    # durations
    (
        "offer_ttl: ten seconds\nservices:\n" + NOOP,
        f"offer_ttl: invalid duration 'ten seconds' {DURATION_HINT}",
    ),
    ("offer_ttl: -5\nservices:\n" + NOOP, f"offer_ttl: invalid duration -5 {DURATION_HINT}"),
    ("offer_ttl: .inf\nservices:\n" + NOOP, f"offer_ttl: invalid duration inf {DURATION_HINT}"),
    ("offer_ttl: true\nservices:\n" + NOOP, "offer_ttl: expected a duration, got true"),
    ("stall_timeout: null\nservices:\n" + NOOP, "stall_timeout: expected a duration, got null"),
    (
        "services:\n  s: {builtin: noop, timeout: 30 minutes}\n",
        f"services.s.timeout: invalid duration '30 minutes' {DURATION_HINT}",
    ),
    # out of range
    ("slots: -1\nservices:\n" + NOOP, "slots: expected an integer >= 0, got -1"),
    ("fast_reserve: -2\nservices:\n" + NOOP, "fast_reserve: expected an integer >= -1, got -2"),
    (
        "max_frame_bytes: 1000\nservices:\n" + NOOP,
        "max_frame_bytes: expected an integer >= 1024, got 1000",
    ),
    (
        "max_wants_per_connection: 0\nservices:\n" + NOOP,
        "max_wants_per_connection: expected an integer >= 1, got 0",
    ),
    (
        "max_wants_per_connection: many\nservices:\n" + NOOP,
        "max_wants_per_connection: expected an integer, got 'many'",
    ),
    (
        "unknown_share: 0\nservices:\n" + NOOP,
        "unknown_share: expected a number greater than 0 and at most 1, got 0",
    ),
    (
        "unknown_share: 1.5\nservices:\n" + NOOP,
        "unknown_share: expected a number greater than 0 and at most 1, got 1.5",
    ),
    (
        "heavy_threshold: 0\nservices:\n" + NOOP,
        "heavy_threshold: expected a duration greater than 0, got 0",
    ),
    (
        "offer_ttl: '0'\nservices:\n" + NOOP,
        "offer_ttl: expected a duration greater than 0, got '0'",
    ),
    (
        "ping_interval: 0s\nservices:\n" + NOOP,
        "ping_interval: expected a duration greater than 0, got '0s'",
    ),
    (
        "services:\n  s: {builtin: noop, max_slots: -1}\n",
        "services.s.max_slots: expected an integer >= 0, got -1",
    ),
    (
        "services:\n  s: {builtin: noop, timeout_sec: 1.5}\n",
        "services.s.timeout_sec: expected an integer, got 1.5",
    ),
    # sizes
    (
        "memory_budget: lots\nservices:\n" + NOOP,
        f"memory_budget: expected \"auto\" or a size ({SIZE_HINT}), got 'lots'",
    ),
    (
        "memory_budget: 0\nservices:\n" + NOOP,
        "memory_budget: expected a size greater than 0, got 0",
    ),
    (
        "services:\n  s: {builtin: noop, memory_limit: 2.5}\n",
        f"services.s.memory_limit: expected a size ({SIZE_HINT}), got 2.5",
    ),
    # threads
    (
        "services:\n  s: {builtin: noop, threads: many}\n",
        'services.s.threads: expected an integer, or a string "N", "-N", "N%" or "-N%",'
        " got 'many'",
    ),
    (
        "services:\n  s: {builtin: noop, threads: 1.5}\n",
        'services.s.threads: expected an integer, or a string "N", "-N", "N%" or "-N%", got 1.5',
    ),
    (
        "services:\n  s: {builtin: noop, threads: 150%}\n",
        "services.s.threads: expected a percentage from 1 to 100, got '150%'",
    ),
    (
        "services:\n  s: {builtin: noop, threads: 0%}\n",
        "services.s.threads: expected a percentage from 1 to 100, got '0%'",
    ),
    # argv / builtin
    (
        "services:\n  s: {argv: [a], builtin: noop}\n",
        "services.s: expected exactly one of argv and builtin, got both",
    ),
    (
        "services:\n  s: {max_slots: 1}\n",
        "services.s: expected exactly one of argv and builtin, got neither",
    ),
    ("services:\n  s: {}\n", "services.s: expected exactly one of argv and builtin, got neither"),
    (
        "services:\n  s: {builtin: shell}\n",
        "services.s.builtin: expected one of noop, sleep, got 'shell'",
    ),
    (
        "services:\n  s: {argv: convert}\n",
        "services.s.argv: expected a list of strings, got 'convert'",
    ),
    (
        "services:\n  s: {argv: []}\n",
        "services.s.argv: expected a non-empty list of strings, got an empty list",
    ),
    (
        "services:\n  s: {argv: [sleep, 5]}\n",
        "services.s.argv[1]: expected a string, got 5 (quote it)",
    ),
    (
        "services:\n  s: {argv: [a, '{input']}\n",
        "services.s.argv[1]: invalid template '{input': a single '{'"
        " (write {{ and }} for literal braces)",
    ),
    (
        "services:\n  s: {argv: [a, 'x}']}\n",
        "services.s.argv[1]: invalid template 'x}': a single '}'"
        " (write {{ and }} for literal braces)",
    ),
    (
        "services:\n  s: {argv: [a, '{0}']}\n",
        "services.s.argv[1]: invalid placeholder in '{0}': expected {name} with an"
        " identifier name, got {0}",
    ),
    (
        "services:\n  s: {argv: [a, '{}']}\n",
        "services.s.argv[1]: invalid placeholder in '{}': expected {name} with an"
        " identifier name, got {}",
    ),
    (
        "services:\n  s: {argv: [a, '{x.y}']}\n",
        "services.s.argv[1]: invalid placeholder in '{x.y}': expected {name} with an"
        " identifier name, got {x.y}",
    ),
    (
        "services:\n  s: {argv: [a, '{x!r:>5}']}\n",
        "services.s.argv[1]: invalid placeholder in '{x!r:>5}': expected {name} with an"
        " identifier name, got {x!r:>5}",
    ),
    (  # str.format reads {x:} as {x}; the runner would have looked up "x:"
        "services:\n  s: {argv: [a, '{x:}']}\n",
        "services.s.argv[1]: invalid placeholder in '{x:}': expected {name} with an"
        " identifier name, got {x:}",
    ),
    (
        "services:\n  s: {argv: [a, '{a{b}}']}\n",
        "services.s.argv[1]: invalid template '{a{b}}': a single '{'"
        " (write {{ and }} for literal braces)",
    ),
    (  # no argument can hold a NUL: refused at load, not when the runner is built
        'services:\n  s: {argv: [a, "x\\0y"]}\n',
        "services.s.argv[1]: invalid template 'x\\x00y': it holds a NUL character",
    ),
    (
        "services:\n  s: {argv: ['{tool}', x]}\n",
        "services.s.argv[0]: expected the program as a non-empty string without"
        " placeholders, got '{tool}'",
    ),
    (
        "services:\n  s: {argv: ['', x]}\n",
        "services.s.argv[0]: expected the program as a non-empty string without"
        " placeholders, got ''",
    ),
    # cross-field rules
    (
        "ping_interval: 5s\nping_timeout: 5s\nservices:\n" + NOOP,
        "ping_timeout: expected a duration greater than ping_interval (5s), got 5s",
    ),
    (
        "ping_interval: 20s\nservices:\n" + NOOP,
        "ping_timeout: expected a duration greater than ping_interval (20s), got 15s",
    ),
    # the jobs' user and cgroup
    ("job_user: ''\nservices:\n" + NOOP, "job_user: expected a non-empty string, got ''"),
    (
        "job_user: 'a b'\nservices:\n" + NOOP,
        "job_user: expected a user name or number, got 'a b'",
    ),
    ("job_user: -1\nservices:\n" + NOOP, "job_user: expected a string, got -1 (quote it)"),
    ("job_user: [x]\nservices:\n" + NOOP, "job_user: expected a string, got a list"),
    ("cgroup: on\nservices:\n" + NOOP, "cgroup: expected one of auto, off, got true"),
    ("cgroup: 'no'\nservices:\n" + NOOP, "cgroup: expected one of auto, off, got 'no'"),
    # services
    ("services: {}\n", "services: expected at least one service, got an empty mapping"),
    ("listen: 127.0.0.1:7000\n", "services: required key is missing"),
    (
        "services: [a, b]\n",
        "services: expected a mapping of service names to services, got a list",
    ),
    ("services:\n  probe: noop\n", "services.probe: expected a mapping, got 'noop'"),
    (
        "services:\n  1: {builtin: noop}\n",
        "services: expected service names of 1 to 200 characters, got 1",
    ),
    (
        f"services:\n  {'x' * 201}: {{builtin: noop}}\n",
        f"services: expected service names of 1 to 200 characters, got '{'x' * 37}...'",
    ),
    (
        "services:\n  my svc: {builtin: noop, max_slots: x}\n",
        "services['my svc'].max_slots: expected an integer, got 'x'",
    ),
]


@pytest.mark.parametrize(("text", "message"), ERROR_CASES)
def test_error_lines(tmp_path: Path, text: str, message: str) -> None:
    """Each kind of mistake gives its one pinned line, starting with the key path."""
    assert yaml_error(tmp_path, text) == message


def test_only_the_first_problem_is_reported(tmp_path: Path) -> None:
    """Several mistakes give one line: the first in key order, unknown keys first."""
    text = "slots: x\nfast_reserve: y\nservices:\n" + NOOP
    assert yaml_error(tmp_path, text) == "slots: expected an integer, got 'x'"
    text = "slots: x\nextra: 1\nservices:\n" + NOOP
    assert yaml_error(tmp_path, text) == "extra: unknown key"


def test_config_error_attributes() -> None:
    """ConfigError is a ValueError that keeps the key path and the reason apart."""
    with pytest.raises(ConfigError) as info:
        ExecserverConfig.from_mapping(with_services(s={"argv": ["a", 5]}))
    error = info.value
    assert isinstance(error, ValueError)
    assert error.keys == ("services", "s", "argv", 1)
    assert error.path == "services.s.argv[1]"
    assert error.reason == "expected a string, got 5 (quote it)"
    assert error.file is None


def test_direct_construction_checks_cross_field_rules() -> None:
    """Built by hand, the classes still refuse bad templates, argv+builtin mixes and bad pings."""
    with pytest.raises(
        ConfigError, match=r"^expected exactly one of argv and builtin, got neither$"
    ):
        ServiceConfig()
    with pytest.raises(ConfigError, match=r"^argv\[1\]: invalid placeholder in '\{0\}'"):
        ServiceConfig(argv=("prog", "{0}"))
    assert ServiceConfig(argv=("prog", "{x}")).placeholders == {"x"}
    probe = {"p": ServiceConfig(builtin="noop")}
    with pytest.raises(ConfigError, match=r"^ping_timeout: expected a duration greater"):
        ExecserverConfig(ping_interval=5.0, ping_timeout=1.0, services=probe)
    with pytest.raises(ConfigError, match=r"^services: expected at least one service"):
        ExecserverConfig(services={})


# -- file errors -------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    """A missing file is one line naming the file."""
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        ExecserverConfig.from_yaml(path)
    assert str(info.value) == f"{path}: no such file"
    assert info.value.file == str(path)


def test_unreadable_file_directory(tmp_path: Path) -> None:
    """A path that cannot be read as a file is one line naming it and why."""
    with pytest.raises(ConfigError) as info:
        ExecserverConfig.from_yaml(tmp_path)
    assert str(info.value) == f"{tmp_path}: cannot read: Is a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_permissions(tmp_path: Path) -> None:
    """A file without read permission is one line naming it and why."""
    path = write(tmp_path, "services: {p: {builtin: noop}}")
    path.chmod(0)
    with pytest.raises(ConfigError) as info:
        ExecserverConfig.from_yaml(path)
    assert str(info.value) == f"{path}: cannot read: Permission denied"


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are reported, not a traceback."""
    path = tmp_path / "config.yaml"
    path.write_bytes(b"name: \xff\n")
    with pytest.raises(ConfigError) as info:
        ExecserverConfig.from_yaml(path)
    assert str(info.value) == f"{path}: cannot read: not UTF-8 text (invalid start byte)"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "services:\n  s: {builtin: noop\nslots: 2\n",
            "invalid YAML at line 3, column 6: while parsing a flow mapping"
            " expected ',' or '}', but got ':'",
        ),
        (
            "slots: 1\n  bad: indent\n",
            "invalid YAML at line 2, column 6: mapping values are not allowed here",
        ),
        (
            "services:\n  s: {builtin: noop}\n  s: {builtin: sleep}\n",
            "invalid YAML at line 3, column 3: duplicate key 's'",
        ),
        (
            "a: 1\n---\nb: 2\n",
            "invalid YAML at line 2, column 1: expected a single document in the stream but found"
            " another document",
        ),
        ("- a\n- b\n", "expected a mapping at the top level, got a list"),
        ("just text\n", "expected a mapping at the top level, got 'just text'"),
        ("", "expected a mapping at the top level, got an empty file"),
        ("# only a comment\n", "expected a mapping at the top level, got an empty file"),
    ],
)
def test_file_level_errors(tmp_path: Path, text: str, message: str) -> None:
    """YAML syntax errors (with line), duplicate keys and non-mappings name the file."""
    path = write(tmp_path, text)
    assert yaml_error(tmp_path, text) == f"{path}: {message}"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (["a"], "expected a mapping at the top level, got a list"),
        (None, "expected a mapping at the top level, got null"),
        ("x", "expected a mapping at the top level, got 'x'"),
    ],
)
def test_from_mapping_refuses_non_mappings(data: object, message: str) -> None:
    """from_mapping refuses a document that is not a mapping."""
    assert mapping_error(data) == message


# -- durations -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("10s", 10.0),
        ("30m", 1800.0),
        ("12h", 43200.0),
        ("2d", 172800.0),
        ("500ms", 0.5),
        ("1h30m", 5400.0),
        ("30m1h", 5400.0),
        ("1m1s1ms", 61.001),
        ("1.5s", 1.5),
        ("0.25h", 900.0),
        ("0", 0.0),
        ("0s", 0.0),
        (0, 0.0),
        (7, 7.0),
        (2.5, 2.5),
    ],
)
def test_parse_duration_valid(value: object, seconds: float) -> None:
    """Duration strings and plain numbers become float seconds."""
    result = c.parse_duration(value)
    assert type(result) is float
    assert math.isclose(result, seconds)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "10",
        "s",
        "ten seconds",
        "10 s",
        " 10s",
        "10S",
        "1.s",
        ".5s",
        "-5s",
        "1h 30m",
        "10sec",
        "1e3s",
        "10y",
        -1,
        float("nan"),
        float("inf"),
    ],
)
def test_parse_duration_invalid(value: object) -> None:
    """Malformed duration strings and negative or non-finite numbers are refused."""
    with pytest.raises(ConfigError) as info:
        c.parse_duration(value)
    assert str(info.value) == f"invalid duration {value!r} {DURATION_HINT}"


@pytest.mark.parametrize("value", [True, False, None, [1], {"s": 1}])
def test_parse_duration_wrong_type(value: object) -> None:
    """Booleans, null and containers are not durations at all."""
    with pytest.raises(ConfigError, match=r"^expected a duration, got "):
        c.parse_duration(value)


_UNITS = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600)}
_UNITS["d"] = Decimal(86400)
_numbers = st.one_of(
    st.integers(0, 10**6).map(str),
    st.tuples(st.integers(0, 10**4), st.integers(0, 999)).map(lambda p: f"{p[0]}.{p[1]}"),
)


@given(st.lists(st.tuples(_numbers, st.sampled_from(sorted(_UNITS))), min_size=1, max_size=6))
def test_duration_is_the_sum_of_its_parts(parts: list[tuple[str, str]]) -> None:
    """Any string of valid <number><unit> parts parses to the sum of the parts."""
    text = "".join(number + unit for number, unit in parts)
    expected = sum(Decimal(number) * _UNITS[unit] for number, unit in parts)
    assert math.isclose(c.parse_duration(text), float(expected), rel_tol=1e-12, abs_tol=1e-9)


def test_zero_durations_per_key() -> None:
    """Zero means none for timeouts and stall, at once for drain, and is refused elsewhere."""
    config = ExecserverConfig.from_mapping(
        {
            "drain_timeout": "0",
            "stall_timeout": 0,
            "services": {"s": {"builtin": "noop", "timeout": "0s", "stall_timeout": "0"}},
        }
    )
    assert config.drain_timeout == 0.0
    assert config.stall_timeout is None
    assert config.services["s"].timeout is None
    assert config.services["s"].stall_timeout is None


def test_stall_timeout_inheritance() -> None:
    """A service's null or absent stall_timeout takes the top-level one; its own wins."""
    config = ExecserverConfig.from_mapping(
        {
            "stall_timeout": "5m",
            "services": {
                "absent": {"builtin": "noop"},
                "null": {"builtin": "noop", "stall_timeout": None},
                "own": {"builtin": "noop", "stall_timeout": "1m"},
                "none": {"builtin": "noop", "stall_timeout": "0"},
            },
        }
    )
    stalls = {name: s.stall_timeout for name, s in config.services.items()}
    assert stalls == {"absent": 300.0, "null": 300.0, "own": 60.0, "none": None}
    off = ExecserverConfig.from_mapping({"stall_timeout": "0", **with_services(s={"argv": ["a"]})})
    assert off.services["s"].stall_timeout is None


@pytest.mark.parametrize(
    ("keys", "timeout"),
    [
        ({}, None),
        ({"timeout": None}, None),
        ({"timeout_sec": 30}, 30.0),
        ({"timeout_sec": 0}, None),
        ({"timeout": None, "timeout_sec": 30}, 30.0),
        ({"timeout": "1m", "timeout_sec": 30}, 60.0),
        ({"timeout": "0", "timeout_sec": 30}, None),
    ],
)
def test_legacy_timeout_sec(keys: dict[str, Any], timeout: float | None) -> None:
    """timeout_sec is integer seconds, used only when timeout is absent or null."""
    loaded = service({"argv": ["a"], **keys})
    assert loaded.timeout == timeout
    assert loaded.timeout_sec == keys.get("timeout_sec")


# -- sizes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "size"),
    [
        (1, 1),
        (4096, 4096),
        ("4096", 4096),
        ("100B", 100),
        ("1K", 1024),
        ("1k", 1024),
        ("1KiB", 1024),
        ("1KB", 1000),
        ("1kb", 1000),
        ("512M", 512 * 1024**2),
        ("512m", 512 * 1024**2),
        ("2G", 2 * 1024**3),
        ("2GB", 2 * 1000**3),
        ("1.5GiB", 1610612736),
        ("1.5 GiB", 1610612736),
        ("1T", 1024**4),
        ("1P", 1024**5),
        ("1.7K", 1740),
    ],
)
def test_parse_size_valid(value: object, size: int) -> None:
    """Sizes are bytes: K..P and KiB..PiB are powers of 1024, KB..PB powers of 1000."""
    assert c.parse_size(value) == size


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("lots", f"expected a size ({SIZE_HINT}), got 'lots'"),
        ("2X", f"expected a size ({SIZE_HINT}), got '2X'"),
        ("G", f"expected a size ({SIZE_HINT}), got 'G'"),
        ("1iB", f"expected a size ({SIZE_HINT}), got '1iB'"),
        ("-1G", f"expected a size ({SIZE_HINT}), got '-1G'"),
        ("2  G", f"expected a size ({SIZE_HINT}), got '2  G'"),
        (1.5, f"expected a size ({SIZE_HINT}), got 1.5"),
        (True, f"expected a size ({SIZE_HINT}), got true"),
        (None, f"expected a size ({SIZE_HINT}), got null"),
        (0, "expected a size greater than 0, got 0"),
        (-5, "expected a size greater than 0, got -5"),
        ("0M", "expected a size greater than 0, got '0M'"),
        ("0.1B", "expected a size greater than 0, got '0.1B'"),
    ],
)
def test_parse_size_invalid(value: object, message: str) -> None:
    """Malformed, fractional-number, boolean and non-positive sizes are refused."""
    with pytest.raises(ConfigError) as info:
        c.parse_size(value)
    assert str(info.value) == message


def test_memory_keys() -> None:
    """memory_budget takes auto or a size; a service's memory_limit a size or null."""
    config = ExecserverConfig.from_mapping(
        {
            "memory_budget": 1 << 30,
            "services": {
                "a": {"builtin": "noop", "memory_limit": "256M"},
                "b": {"builtin": "noop", "memory_limit": None},
            },
        }
    )
    assert config.memory_budget == 1 << 30
    assert config.resolved_memory_budget(HOST) == 1 << 30
    assert ExecserverConfig.from_mapping(MINIMAL).resolved_memory_budget(HOST) == HOST.memory
    assert config.services["a"].memory_limit == 256 << 20
    assert config.services["b"].memory_limit is None


# -- threads ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "stored"),
    [(0, 0), (4, 4), (-2, -2), ("4", 4), ("-2", -2), ("50%", "50%"), ("-25%", "-25%")],
)
def test_threads_are_normalised_at_load(raw: object, stored: int | str) -> None:
    """threads "N" and "-N" strings become ints; percentages stay strings."""
    assert service({"builtin": "noop", "threads": raw}).threads == stored


@pytest.mark.parametrize(
    ("spec", "cpus", "threads"),
    [
        (0, 8, 8),
        (0, 1, 1),
        (3, 8, 3),
        (16, 8, 16),
        (-2, 8, 6),
        (-8, 8, 1),
        (-20, 8, 1),
        ("4", 8, 4),
        ("-1", 4, 3),
        ("50%", 8, 4),
        ("50%", 3, 1),
        ("25%", 2, 1),
        ("100%", 6, 6),
        ("-25%", 8, 6),
        ("-25%", 3, 2),
        ("-50%", 1, 1),
        ("-100%", 8, 1),
    ],
)
def test_resolve_threads(spec: int | str, cpus: int, threads: int) -> None:
    """threads resolves per DESIGN.md: 0 all, N, -N all but N, N%, -N%, at least 1."""
    assert c.resolve_threads(spec, cpus) == threads


@pytest.mark.parametrize(("spec", "cpus"), [("x", 4), ("0%", 4), ("1.5", 4), (True, 4), (1, 0)])
def test_resolve_threads_refuses_invalid(spec: Any, cpus: int) -> None:
    """A spec the loader refuses, or a CPU count below 1, raises ValueError."""
    with pytest.raises(ValueError, match=r"threads spec|cpu_count"):
        c.resolve_threads(spec, cpus)


@given(st.lists(st.text(st.sampled_from("ab{}:.0 \0"), max_size=6), min_size=1, max_size=4))
def test_the_loader_and_the_core_agree_on_argv(argv: list[str]) -> None:
    """A template loads exactly when the core's grammar parses it, with the same reason."""
    refusal: TemplateError | None = None
    try:
        template = ArgvTemplate.parse(argv)
    except TemplateError as exc:
        refusal = exc
    if refusal is None:
        loaded = service({"argv": argv})
        assert loaded.argv == template
        assert loaded.placeholders == template.placeholders
    else:
        with pytest.raises(ConfigError) as info:
            service({"argv": argv})
        assert info.value.reason == refusal.reason
        assert info.value.keys == ("services", "s", "argv", refusal.index)


def test_literal_braces_are_not_placeholders() -> None:
    """{{ and }} are literal braces; only {name} counts as a placeholder."""
    loaded = service({"argv": ["printf", "{{%s}}", "{{{value}}}", "{a}{b}"]})
    assert loaded.placeholders == {"value", "a", "b"}
    assert service({"builtin": "sleep"}).placeholders == frozenset()


# -- pool and reserve ---------------------------------------------------------

RESERVE_TABLE = [
    (1, -1, 0),
    (2, -1, 1),
    (4, -1, 1),
    (8, -1, 2),
    (9, -1, 2),
    (1, 0, 0),
    (2, 0, 0),
    (4, 0, 0),
    (8, 0, 0),
    (9, 0, 0),
    (1, 3, 0),
    (2, 3, 1),
    (4, 3, 3),
    (8, 3, 3),
    (9, 3, 3),
]


@pytest.mark.parametrize(("slots", "reserve", "resolved"), RESERVE_TABLE)
def test_fast_reserve_rule(slots: int, reserve: int, resolved: int) -> None:
    """-1 is a quarter of the pool (at least 1), 0 none, N N; never the whole pool."""
    config = ExecserverConfig.from_mapping({**MINIMAL, "slots": slots, "fast_reserve": reserve})
    assert config.pool_size(HOST) == slots
    assert config.resolved_fast_reserve(HOST) == resolved


def test_pool_size_zero_is_the_hosts_cpus(tmp_path: Path) -> None:
    """slots: 0 sizes the pool by the host's CPUs, which a cgroup quota lowers."""
    config = ExecserverConfig.from_mapping(MINIMAL)
    assert config.pool_size(HostResources(cpus=6, memory=1)) == 6
    assert config.resolved_fast_reserve(HostResources(cpus=6, memory=1)) == 1
    assert config.pool_size(probe_host()) == cpu_count() >= 1
    root = v2_tree(tmp_path, "/", {"cpu.max": "100000 100000\n"})
    assert config.pool_size(probe_host(root=root)) == 1
    assert config.resolved_fast_reserve(probe_host(root=root)) == 0


def test_turn_hold_and_priority_aging_keys(tmp_path: Path) -> None:
    """turn_hold (0.05 s, "0" = off) and priority_aging (null = strict) load as durations."""
    services = "services:\n  probe: {builtin: noop}\n"
    default = load(tmp_path, services)
    assert (default.turn_hold, default.priority_aging) == (0.05, None)
    config = load(tmp_path, "turn_hold: 200ms\npriority_aging: 5m\n" + services)
    assert (config.turn_hold, config.priority_aging) == (0.2, 300.0)
    off = load(tmp_path, 'turn_hold: "0"\npriority_aging: "0"\n' + services)
    assert (off.turn_hold, off.priority_aging) == (0.0, None)
    assert "priority_aging" in yaml_error(tmp_path, "priority_aging: soon\n" + services)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("job_user: nobody\n", "nobody"),
        ("job_user: 65534\n", "65534"),
        ("job_user: '4242:4242'\n", "4242:4242"),
    ],
)
def test_job_user_values(tmp_path: Path, text: str, expected: str | None) -> None:
    """A name, a number (also written as a YAML integer), UID:GID, or null."""
    assert load(tmp_path, text + "services:\n" + NOOP).job_user == expected


def test_cgroup_values(tmp_path: Path) -> None:
    assert load(tmp_path, "services:\n" + NOOP).cgroup == "auto"
    assert load(tmp_path, "cgroup: 'off'\nservices:\n" + NOOP).cgroup == "off"
    assert load(tmp_path, "cgroup: off\nservices:\n" + NOOP).cgroup == "off"  # YAML's false
