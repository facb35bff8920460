"""The fylr reaches its execservers over ``wss://`` with a broker token (trustme certificates).

A real execserver serves TLS and requires a token; the fylr is loaded from a
YAML file the way the daemon loads it (the token from ``broker_token_file``, the
CA from ``broker_ca_file``) and produces a file's versions through it. A wrong
token, or a CA the fylr does not know, is one clear error line per address.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme
import yaml
from trio_broker_daemons.config.structure import load_config
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_broker_daemons.fylr.config import FylrConfig

from tests.daemons.test_fylr import (
    SERVICES,
    TEXT,
    TEXT_CLASS,
    WAIT,
    ended,
    fylr_mapping,
    put,
    running_fylr,
)
from trio_broker.trio.execserver import ExecserverHandle

TOKEN = "s3cret-broker-token"


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """A CA, the execserver's certificate for 127.0.0.1 and its key, as PEM files."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    with paths["cert"].open("wb") as chain:
        for blob in cert.cert_chain_pems:
            chain.write(blob.bytes())
    return paths


@asynccontextmanager
async def tls_execserver(pki: dict[str, Path]) -> AsyncIterator[ExecserverHandle]:
    config = ExecserverConfig.from_mapping(
        {
            "listen": "127.0.0.1:0",
            "slots": 2,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "broker_token": TOKEN,
            "tls": {"cert": str(pki["cert"]), "key": str(pki["key"])},
            "services": SERVICES,
        }
    )
    async with trio.open_nursery() as nursery:
        handle: ExecserverHandle = await nursery.start(serve_from_config, config)
        try:
            yield handle
        finally:
            nursery.cancel_scope.cancel()


def fylr_file(tmp_path: Path, pg_dsn: str, address: str, **extra: Any) -> FylrConfig:
    """A fylr configuration written to a file and loaded as the daemon loads it."""
    mapping = fylr_mapping(pg_dsn, tmp_path / "state", address, {"text": TEXT_CLASS}, **extra)
    path = tmp_path / "fylr.yml"
    path.write_text(yaml.safe_dump(mapping))
    return load_config(path, FylrConfig)


class Lines(logging.Handler):
    """Collects the fylr's log lines; wakes a waiter on each (all on the trio thread)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[int, str]] = []
        self.changed = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))
        self.changed.set()

    async def wait_for(self, text: str) -> tuple[int, str]:
        with trio.fail_after(WAIT):
            while True:
                found = [line for line in self.lines if text in line[1]]
                if found:
                    return found[0]
                self.changed = trio.Event()
                await self.changed.wait()


@contextmanager
def fylr_log() -> Iterator[Lines]:
    logger = logging.getLogger("trio_broker_daemons.fylr")
    lines = Lines()
    logger.addHandler(lines)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(old)


async def test_a_file_is_produced_over_wss_with_a_token_from_a_file(
    pg_dsn: str, tmp_path: Path, pki: dict[str, Path]
) -> None:
    """wss:// address, broker_token_file and broker_ca_file: every version is made."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    async with tls_execserver(pki) as execserver:
        config = fylr_file(
            tmp_path,
            pg_dsn,
            f"wss://127.0.0.1:{execserver.port}",
            broker_token_file="token",
            broker_ca_file=str(pki["ca"]),
        )
        assert config.broker_token == TOKEN
        assert config.broker_tls
        with fylr_log() as log:
            async with (
                running_fylr(config) as fylr,
                httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
            ):
                created = await put(http, "notes.txt", TEXT)
                document = await ended(http, created["id"])
        assert document["status"] == "done"
        assert {v["status"] for v in document["versions"].values()} == {"done"}
        assert not [line for level, line in log.lines if level >= logging.WARNING]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("wrong token", "the broker token was refused (HTTP 401); check broker_token"),
        ("no token", "it needs a broker token (HTTP 401); check broker_token"),
        ("unknown CA", "TLS certificate not trusted (unable to get local issuer certificate)"),
    ],
)
async def test_a_refusing_execserver_is_one_clear_error_line(
    pg_dsn: str, tmp_path: Path, pki: dict[str, Path], case: str, expected: str
) -> None:
    """A wrong or missing token, or a certificate from a CA the fylr does not trust, is
    logged as one error line naming the address, instead of a silent wait."""
    extra: dict[str, Any] = {"broker_ca_file": str(pki["ca"])}
    if case == "wrong token":
        extra["broker_token"] = "not-the-token"
    elif case == "unknown CA":
        extra = {"broker_token": TOKEN}
    async with tls_execserver(pki) as execserver:
        address = f"wss://127.0.0.1:{execserver.port}"
        config = fylr_file(tmp_path, pg_dsn, address, **extra)
        with fylr_log() as log:
            async with running_fylr(config):
                level, line = await log.wait_for(expected)
    assert level == logging.ERROR
    assert line.startswith(f"execserver {address}: ")
    assert "\n" not in line


def test_tls_keys_are_checked_at_load(tmp_path: Path, pki: dict[str, Path]) -> None:
    """Mixed schemes, a CA file without wss:// and an unreadable CA file are refused."""
    base: dict[str, Any] = {"execservers": ["wss://127.0.0.1:1"]}
    ok = FylrConfig.from_mapping({**base, "broker_ca_file": str(pki["ca"])})
    assert ok.execserver_addresses == ("127.0.0.1:1",)
    with pytest.raises(ConfigError, match="every address wss:// or none"):
        FylrConfig.from_mapping({"execservers": ["wss://127.0.0.1:1", "127.0.0.1:2"]})
    with pytest.raises(ConfigError, match="needs wss://"):
        FylrConfig.from_mapping({"execservers": ["127.0.0.1:1"], "broker_ca_file": str(pki["ca"])})
    with pytest.raises(ConfigError, match="cannot load CA certificates"):
        FylrConfig.from_mapping({**base, "broker_ca_file": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigError, match='"wss://host:port"'):
        FylrConfig.from_mapping({"execservers": ["https://127.0.0.1:1"]})
