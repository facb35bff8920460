"""A fylr that knows only a balancer in front of a mixed fleet (real HAProxy, real PostgreSQL).

The first execserver in the balancer's rotation offers only the metadata service; the
second offers everything. The fylr is configured with the balancer's address alone.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import httpx
import trio
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.fylr.config import FylrConfig

from tests.daemons.test_fylr import (
    SERVICES,
    TEXT_CLASS,
    download,
    ended,
    execserver_config,
    fylr_mapping,
    put,
    running_fylr,
)
from tests.support.haproxy import open_haproxy
from trio_broker.trio.execserver import ExecserverHandle


async def test_a_fylr_behind_one_balancer_gets_every_version_of_every_file(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Files whose metadata step lands on the metadata-only replica and whose versions
    need the other one: every file ends done with all its versions, and the fylr's pool
    reaches both replicas through the one address."""
    async with trio.open_nursery() as nursery:
        meta: ExecserverHandle = await nursery.start(
            serve_from_config, execserver_config(mime=SERVICES["mime"])
        )
        full: ExecserverHandle = await nursery.start(serve_from_config, execserver_config())
        async with open_haproxy([(meta.host, meta.port), (full.host, full.port)]) as proxy:
            mapping = fylr_mapping(
                pg_dsn,
                tmp_path / "state",
                proxy.address,
                {"text": TEXT_CLASS},
                pool_grow_interval="0.1s",
            )
            async with (
                running_fylr(FylrConfig.from_mapping(mapping)) as fylr,
                httpx.AsyncClient(base_url=fylr.url, timeout=60) as http,
            ):
                texts = [f"file {i}\n".encode() * (i + 1) for i in range(2)]
                created = [await put(http, f"f{i}.txt", text) for i, text in enumerate(texts)]
                for document, text in zip(created, texts, strict=True):
                    done = await ended(http, document["id"])
                    assert done["status"] == "done", done
                    assert {n: v["status"] for n, v in done["versions"].items()} == {
                        "gz": "done",
                        "sha256": "done",
                        "gz_sha256": "done",
                    }
                    compressed = await download(http, document["id"], "gz")
                    assert gzip.decompress(compressed) == text
                stats = fylr.statistics().client
                assert stats is not None
                (address,) = stats.addresses
                assert address.balanced
                assert set(address.instances) == {
                    meta.broker.config.instance_id,
                    full.broker.config.instance_id,
                }
        nursery.cancel_scope.cancel()
