"""The execserver daemon's wiring: its configuration resolved against one host reading."""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import pytest
import trio
from trio_broker_daemons.execserver.app import (
    broker_config_from,
    command_runner_from,
    serve_from_config,
)
from trio_broker_daemons.execserver.config import ExecserverConfig

from tests.support.wire import WAIT, connect
from trio_broker.core import protocol as p
from trio_broker.trio.execserver import ExecserverHandle
from trio_broker.trio.host import HostResources
from trio_broker.trio.runner import JobControl, JobRequest

HOST = HostResources(cpus=8, memory=2 << 30)
"""A host built by hand: 8 CPUs and 2 GiB, whatever this machine has."""


def config(**top: object) -> ExecserverConfig:
    return ExecserverConfig.from_mapping(
        {
            "listen": "127.0.0.1:0",
            "name": "wired",
            "services": {
                "threads": {"argv": ["sh", "-c", "echo $FYLR_CONVERT_THREADS"], "threads": "50%"},
                "capped": {"builtin": "noop", "max_slots": 3},
            },
            **top,
        }
    )


def test_broker_config_takes_the_host_for_auto_values() -> None:
    """slots: 0, fast_reserve: -1 and memory_budget: auto resolve against the given host."""
    pool = broker_config_from(config(), HOST, instance_id="i-1").pool
    assert (pool.size, pool.fast_reserve, pool.memory_budget) == (8, 2, 2 << 30)
    assert pool.max_slots == {"threads": 0, "capped": 3}
    explicit = broker_config_from(config(slots=3, memory_budget="1G"), HOST).pool
    assert (explicit.size, explicit.fast_reserve, explicit.memory_budget) == (3, 1, 1 << 30)


def test_broker_config_takes_the_turn_hold_and_priority_aging() -> None:
    """turn_hold reaches the broker, priority_aging the pool (the want-book's aging)."""
    wired = broker_config_from(config(turn_hold="10ms", priority_aging="2m"), HOST)
    assert (wired.turn_hold, wired.pool.priority_aging) == (0.01, 120.0)
    default = broker_config_from(config(), HOST)
    assert (default.turn_hold, default.pool.priority_aging) == (0.05, None)


def test_broker_config_takes_max_wants_per_connection() -> None:
    """max_wants_per_connection (default 10000) reaches the broker core."""
    assert broker_config_from(config(), HOST).max_wants_per_connection == 10_000
    wired = broker_config_from(config(max_wants_per_connection=25), HOST)
    assert wired.max_wants_per_connection == 25


@pytest.mark.skipif(sys.platform != "linux", reason="the runner reads /proc")
async def test_command_runner_takes_threads_and_budget_from_the_host(tmp_path: Path) -> None:
    """A service's threads: 50% of the host's 8 CPUs reach the command as 4; the budget is 2 GiB."""
    runner = command_runner_from(config(temp_dir=str(tmp_path)), HOST, instance_id="i-2")
    assert runner.statistics().memory_budget == 2 << 30
    with trio.fail_after(WAIT):
        receipt = await runner.run(JobRequest(job_id="t", service="threads"), JobControl())
    assert (receipt.status, receipt.stdout_prefix, receipt.instance_id) == ("ok", "4\n", "i-2")


async def test_serve_from_config_announces_the_hosts_cpus(nursery: trio.Nursery) -> None:
    """An execserver served with a host built by hand announces that many slots."""
    small = HostResources(cpus=3, memory=1 << 30)
    handle: ExecserverHandle = await nursery.start(partial(serve_from_config, config(), host=small))
    async with connect(handle) as peer:
        assert peer.hellos[0].processes == 3


async def test_a_glued_dash_parameter_is_refused_and_an_allowed_one_runs(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Over a real execserver and real commands: ``level: -help`` in gzip's ``-{level}``
    ends ``error`` naming the parameter and the rule (gzip never runs: its help is no
    ``ok`` output), ``level: 1`` compresses, and a service that allows its pattern to
    begin with a dash runs ``grep -e -v``."""
    wired = ExecserverConfig.from_mapping(
        {
            "listen": "127.0.0.1:0",
            "name": "guarded",
            "job_user": os.environ.get("TRIO_BROKER_JOB_USER"),  # grep reads tmp_path
            "slots": 1,
            "fast_reserve": 0,
            "temp_dir": str(tmp_path),
            "services": {
                "gzip": {"argv": ["gzip", "-c", "-n", "-{level}"]},
                "grep_dash": {
                    "argv": ["grep", "-c", "-e", "{pattern}", "{file}"],
                    "allow_leading_dash": ["pattern"],
                },
            },
        }
    )
    (tmp_path / "lines.txt").write_text("a\n-v\n-v\n")
    handle: ExecserverHandle = await nursery.start(serve_from_config, wired)
    async with connect(handle) as peer:

        async def run(job_id: str, service: str, params: dict[str, object]) -> p.Receipt:
            offer = await peer.want(job_id, service)
            assert isinstance(offer, p.Offer), offer
            await peer.run(offer, service, params)
            return (await peer.done(job_id)).receipt

        refused = await run("help", "gzip", {"level": "-help"})
        assert (refused.status, refused.exit_code) == ("error", None)
        assert refused.error == (
            "parameter 'level' must not begin with '-' where an option can start"
            " (argv[3] '-{level}', got '-help'); the service may allow it with allow_leading_dash"
        )
        assert refused.stdout_prefix == ""
        assert (await run("fast", "gzip", {"level": 1})).status == "ok"
        allowed = await run(
            "dash", "grep_dash", {"pattern": "-v", "file": str(tmp_path / "lines.txt")}
        )
        assert (allowed.status, allowed.stdout_prefix) == ("ok", "2\n")
        still_guarded = await run("file", "grep_dash", {"pattern": "a", "file": "-r"})
        assert still_guarded.error is not None
        assert still_guarded.error.startswith("parameter 'file' must not begin with '-'")


def test_allow_leading_dash_names_placeholders_of_argv() -> None:
    """A name that is no placeholder, or an allowance on a builtin, is a configuration error
    naming the key; a loaded allowance reaches the template the runner fills."""
    from trio_broker_daemons.config.values import ConfigError

    def load(service: dict[str, object]) -> ExecserverConfig:
        return ExecserverConfig.from_mapping({"services": {"s": service}})

    with pytest.raises(ConfigError) as info:
        load({"argv": ["grep", "-e", "{pattern}"], "allow_leading_dash": ["patern"]})
    assert str(info.value) == (
        "services.s.allow_leading_dash[0]: expected a placeholder of argv (pattern), got 'patern'"
    )
    with pytest.raises(ConfigError) as info:
        load({"builtin": "noop", "allow_leading_dash": ["x"]})
    assert str(info.value) == (
        "services.s.allow_leading_dash: expected no parameters: a builtin has no argv"
    )
    with pytest.raises(ConfigError) as info:
        load({"argv": ["grep", "{pattern}"], "allow_leading_dash": "pattern"})
    assert str(info.value) == (
        "services.s.allow_leading_dash: expected a list of parameter names, got 'pattern'"
    )
    loaded = load({"argv": ["grep", "-e", "{pattern}"], "allow_leading_dash": ["pattern"]})
    template = loaded.services["s"].argv
    assert template is not None
    assert template.allow_leading_dash == {"pattern"}
    runner = command_runner_from(loaded, HOST)
    assert runner is not None


def test_a_cache_names_placeholders_and_a_size(tmp_path: Path) -> None:
    """A cache key names placeholders of argv, its size is above 0, a builtin has none;
    a loaded cache puts the runner behind a produce cache."""
    from trio_broker_daemons.config.values import ConfigError

    from trio_broker.trio.produce_cache import CachingRunner

    def load(service: dict[str, object]) -> ExecserverConfig:
        return ExecserverConfig.from_mapping({"services": {"s": service}})

    problems: list[tuple[dict[str, object], str]] = [
        (
            {"argv": ["convert", "{size}"], "cache": {"key": ["sise"], "max_size": "1G"}},
            "services.s.cache.key[0]: expected a placeholder of argv (size), got 'sise'",
        ),
        (
            {"argv": ["convert"], "cache": {"key": [], "max_size": 0}},
            "services.s.cache.max_size: expected a size greater than 0, got 0",
        ),
        (
            {"builtin": "noop", "cache": {"max_size": "1G"}},
            "services.s.cache: expected null: a builtin has no output",
        ),
    ]
    for service, message in problems:
        with pytest.raises(ConfigError) as info:
            load(service)
        assert str(info.value) == message
    loaded = ExecserverConfig.from_mapping(
        {
            "temp_dir": str(tmp_path),
            "services": {
                "s": {"argv": ["c", "{size}"], "cache": {"key": ["size"], "max_size": "2G"}}
            },
        }
    )
    assert isinstance(command_runner_from(loaded, HOST), CachingRunner)
    assert (tmp_path / "produce-cache" / "s").is_dir()
