"""Several fylrs behind one HAProxy in front of a mixed fleet (real processes, real PostgreSQL).

Two execserver replicas behind one round-robin HAProxy: the first in rotation offers
only the metadata service (``mime``), the second every service. Two, then three fylr
processes know only the balancer and share one database and one storage folder, so
each one's dials move where the others' land: a fylr's second connection may meet the
replica it already knows while another fylr's took the other one. Every step must end
done: the pool keeps looking while a step waits for a service none of its connections
announced, and a step fails "not offered" only after a whole re-probe of looking.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml

from tests.daemons.test_fylr import SERVICES, TEXT_CLASS, WAIT, ended, fylr_mapping, put, rows
from tests.support.haproxy import open_haproxy
from tests.support.processes import open_execserver_process, open_fylr_process

FILES_PER_FYLR = 12


def _execserver(services: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "slots": 3,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "services": services,
        }
    )


@pytest.mark.parametrize("fylrs", [2, 3])
async def test_several_fylrs_behind_one_balancer_do_every_step(
    pg_dsn: str, tmp_path: Path, fylrs: int
) -> None:
    """Each fylr uploads its files; every file ends done with every version, and no
    queue row failed."""
    async with (
        open_execserver_process(_execserver({"mime": SERVICES["mime"]})) as meta,
        open_execserver_process(_execserver(SERVICES)) as full,
        open_haproxy([(meta.host, meta.port), (full.host, full.port)]) as proxy,
        AsyncExitStack() as stack,
    ):
        daemons = []
        for index in range(fylrs):
            config = tmp_path / f"fylr-{index}.yml"
            mapping = fylr_mapping(
                pg_dsn,
                tmp_path / "state",  # one storage folder: any fylr runs any step
                proxy.address,
                {"text": TEXT_CLASS},
                name=f"fylr-{index}",
                pool_grow_interval="0.5s",
            )
            config.write_text(yaml.safe_dump(mapping))
            daemons.append(await stack.enter_async_context(open_fylr_process(config)))
        created: list[tuple[int, int, bytes]] = []  # (fylr, file id, content)

        async def upload(index: int) -> None:
            async with httpx.AsyncClient(base_url=daemons[index].http_url, timeout=WAIT) as http:
                for n in range(FILES_PER_FYLR):
                    text = f"fylr {index} file {n}\n".encode() * (n + 1)
                    document = await put(http, f"f{index}-{n}.txt", text)
                    created.append((index, document["id"], text))

        async with trio.open_nursery() as nursery:
            for index in range(fylrs):
                nursery.start_soon(upload, index)
        assert len(created) == fylrs * FILES_PER_FYLR
        async with httpx.AsyncClient(base_url=daemons[0].http_url, timeout=WAIT) as http:
            for _, file_id, _ in created:
                done = await ended(http, file_id)
                assert done["status"] == "done", done
                assert {n: v["status"] for n, v in done["versions"].items()} == {
                    "gz": "done",
                    "sha256": "done",
                    "gz_sha256": "done",
                }, done
        assert (
            rows(pg_dsn, "SELECT action, last_error FROM broker_queue WHERE status = 'failed'")
            == []
        )
