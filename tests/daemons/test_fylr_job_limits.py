"""A fylr recipe's own ``timeout``/``stall_timeout`` reach the execserver and win there."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_broker_daemons.fylr.config import FylrConfig, VersionConfig, job_limits

from tests.daemons.test_fylr import WAIT, ended, fylr_mapping, put, running_fylr
from trio_broker.trio.execserver import ExecserverHandle

# a service that needs a second and whose own ceiling is 0.4s
SLOW = {"argv": ["sh", "-c", "sleep 1; sha256sum"], "timeout": "0.4s", "stall_timeout": "0"}


async def test_recipe_limits_take_precedence_over_the_services(pg_dsn: str, tmp_path: Path) -> None:
    """A recipe's "0" lets its job outlive the service's timeout; a recipe's short timeout
    times out a job the service would let run; no recipe limit keeps the service's."""
    classes = {
        "text": {
            "extensions": ["txt"],
            "versions": {
                "unlimited": {"service": "slow", "timeout": "0"},
                "service": {"service": "slow"},
                "short": {"service": "quick", "timeout": "200ms"},
            },
        }
    }
    services = {"slow": SLOW, "quick": {"argv": ["sh", "-c", "sleep 5; sha256sum"]}}
    exec_config = ExecserverConfig.from_mapping(
        {"listen": "127.0.0.1:0", "slots": 3, "fast_reserve": 0, "services": services}
    )
    async with trio.open_nursery() as nursery:
        handle: ExecserverHandle = await nursery.start(serve_from_config, exec_config)
        mapping = fylr_mapping(pg_dsn, tmp_path / "state", f"127.0.0.1:{handle.port}", classes)
        async with (
            running_fylr(FylrConfig.from_mapping(mapping)) as fylr,
            httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
        ):
            created = await put(http, "a.txt", b"some text\n")
            document = await ended(http, created["id"])
        nursery.cancel_scope.cancel()
    versions = document["versions"]
    assert versions["unlimited"]["status"] == "done", versions["unlimited"]
    assert versions["service"]["status"] == "failed"
    assert versions["service"]["metadata"]["produced"]["status"] == "timed_out"
    assert versions["service"]["error"] == "timed out after 0.4s"
    assert versions["short"]["status"] == "failed"
    assert versions["short"]["metadata"]["produced"]["status"] == "timed_out"
    assert versions["short"]["error"] == "timed out after 0.2s"


def test_recipe_limit_keys() -> None:
    """Durations with "0" for none; null (the default) leaves the service's; bad ones fail."""
    recipe = VersionConfig(service="s", timeout=1800.0, stall_timeout=0.0)
    assert job_limits(recipe) == {"timeout": "1800s", "stall_timeout": "0"}
    assert job_limits(VersionConfig(service="s")) == {}
    config = FylrConfig.from_mapping(
        {
            "execservers": [],
            "classes": {
                "t": {
                    "extensions": ["t"],
                    "metadata": {"service": "m", "stall_timeout": "20m"},
                    "versions": {"v": {"service": "s", "timeout": "12h"}},
                }
            },
        }
    )
    assert config.classes["t"].versions["v"].timeout == 43200.0
    metadata = config.classes["t"].metadata
    assert metadata is not None
    assert job_limits(metadata) == {"stall_timeout": "1200s"}
    with pytest.raises(ConfigError, match=r"classes\.t\.versions\.v\.timeout"):
        FylrConfig.from_mapping(
            {
                "execservers": [],
                "classes": {"t": {"extensions": ["t"], "versions": {"v": {"service": "s",
                                                                        "timeout": "soon"}}}},
            }
        )  # fmt: skip
