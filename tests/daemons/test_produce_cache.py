"""The execserver's produce cache, on real daemons: a fylr asking on-demand renditions
of an execserver whose services declare a cache (real commands, real PostgreSQL).

Every cached command appends a line to a ``runs`` file when it starts, so a test
counts the commands that really ran; the cache folder is read to see the entries.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.daemons.test_renditions import ORIGINAL, custom, daemons, uploaded
from trio_broker.trio.execserver import ExecserverHandle

WAIT = 60.0
COUNTED = 'echo run >> "$0"; '

CACHED_SERVICES: dict[str, Any] = {
    "counted": {
        "argv": ["sh", "-c", COUNTED + "gzip -c -n -9", "{runs}"],
        "cache": {"key": [], "max_size": 10_000_000},
    },
    "gated": {
        # the first run waits for the gate file, so that a second job meets it running
        "argv": [
            "sh",
            "-c",
            COUNTED + 'while [ ! -e "$1" ]; do sleep 0.05; done; tr a-z A-Z',
            "{runs}",
            "{gate}",
        ],
        "cache": {"key": [], "max_size": 10_000_000},
    },
    "dying": {
        # the first run is killed in the middle of its output, later ones finish
        "argv": [
            "sh",
            "-c",
            COUNTED + 'cat >/dev/null; head -c 200000 /dev/zero | tr "\\0" a;'
            ' if [ ! -e "$0.died" ]; then touch "$0.died"; kill -9 $$; fi;'
            ' head -c 1000 /dev/zero | tr "\\0" b',
            "{runs}",
        ],
        "cache": {"key": [], "max_size": 10_000_000},
    },
    "sized": {
        "argv": ["sh", "-c", COUNTED + 'cat >/dev/null; head -c "$1" /dev/zero', "{runs}", "{n}"],
        "cache": {"key": ["n"], "max_size": 100_000},
    },
}


def runs(tmp_path: Path, service: str) -> int:
    path = tmp_path / f"{service}.runs"
    return len(path.read_text().splitlines()) if path.exists() else 0


def entries(tmp_path: Path, service: str) -> list[Path]:
    folder = tmp_path / "exec" / "produce-cache" / service
    return sorted(p for p in folder.iterdir() if not p.name.endswith(".lock"))


def setup(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "exec").mkdir()
    presets = {
        name: {"service": name, "params": {"runs": str(tmp_path / f"{name}.runs")}}
        for name in ("counted", "dying")
    }
    presets["gated"] = {
        "service": "gated",
        "params": {"runs": str(tmp_path / "gated.runs"), "gate": str(tmp_path / "gate")},
    }
    classes = {
        "text": {
            "extensions": ["txt"],
            "custom_versions": {
                "sized": {
                    "params": {
                        "runs": [str(tmp_path / "sized.runs")],
                        "n": [30000, 50000, 60000, 200000],
                    }
                }
            },
        }
    }
    return {
        "exec_extra": {
            "ping_interval": "0.5s",  # wait_until re-checks the runner's figures this often
            "ping_timeout": "5s",
            "temp_dir": str(tmp_path / "exec"),
            "services": CACHED_SERVICES,
        },
        "classes": classes,
        "custom_version_presets": presets,
    }


async def figures(execserver: ExecserverHandle, service: str) -> dict[str, int]:
    async with httpx.AsyncClient(timeout=WAIT) as http:
        url = f"http://{execserver.host}:{execserver.port}/inspect/system/execserver"
        document = (await http.get(url)).json()
    return dict(document["caches"][service])


async def test_a_hit_runs_no_command(pg_dsn: str, tmp_path: Path) -> None:
    """The first request runs the command and keeps its output; the second is served
    from the cache, byte for byte, and no command runs. The figures show it."""
    async with daemons(pg_dsn, tmp_path, **setup(tmp_path)) as (_, execserver, http):
        assert execserver is not None
        file_id = await uploaded(http)
        first = await http.get(custom(file_id), params={"preset": "counted"})
        assert first.status_code == 200, first.text
        assert gzip.decompress(first.content) == ORIGINAL
        assert runs(tmp_path, "counted") == 1
        assert len(entries(tmp_path, "counted")) == 1
        second = await http.get(custom(file_id), params={"preset": "counted"})
        assert second.status_code == 200, second.text
        assert second.content == first.content
        assert runs(tmp_path, "counted") == 1  # served from the cache
        shown = await figures(execserver, "counted")
        assert shown == {
            "entries": 1,
            "bytes": len(first.content),
            "max_size": 10_000_000,
            "hits": 1,
            "misses": 1,
        }
        hit = execserver.statistics().broker.recent[-1].receipt
        assert (hit.status, hit.exit_code, hit.stdout_bytes) == ("ok", None, len(first.content))


async def test_two_requests_for_one_key_run_one_command(pg_dsn: str, tmp_path: Path) -> None:
    """Two concurrent requests for one key: both hold a slot, one command runs, the
    other waits on the key's lock and then reads the cached file."""
    async with daemons(pg_dsn, tmp_path, **setup(tmp_path)) as (_, execserver, http):
        assert execserver is not None
        file_id = await uploaded(http)
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await http.get(custom(file_id), params={"preset": "gated"}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            nursery.start_soon(ask)

            def one_runs_one_waits() -> bool:
                stats = execserver.statistics()
                assert stats.runner is not None
                processes = [job for job in stats.runner.running if job.pid is not None]
                return stats.broker.busy == 2 and len(processes) == 1

            with trio.fail_after(WAIT):
                await execserver.wait_until(one_runs_one_waits)
            (tmp_path / "gate").touch()
        assert [a.status_code for a in answers] == [200, 200]
        assert answers[0].content == answers[1].content == ORIGINAL.upper()
        assert runs(tmp_path, "gated") == 1
        shown = await figures(execserver, "gated")
        assert (shown["hits"], shown["misses"], shown["entries"]) == (1, 1, 1)


async def test_a_producer_killed_mid_write_leaves_no_entry(pg_dsn: str, tmp_path: Path) -> None:
    """A command killed in the middle of its output: the client sees a broken transfer,
    the cache keeps nothing (no entry, no temporary file), the next request runs the
    command again and the one after is a hit."""
    async with daemons(pg_dsn, tmp_path, **setup(tmp_path)) as (_, _e, http):
        file_id = await uploaded(http)
        received: list[int] = []

        async def read_all(response: httpx.Response) -> None:
            async for chunk in response.aiter_raw():
                received.append(len(chunk))

        async with http.stream("GET", custom(file_id), params={"preset": "dying"}) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                await read_all(response)
        assert entries(tmp_path, "dying") == []  # nor a temporary file
        expected = b"a" * 200000 + b"b" * 1000
        again = await http.get(custom(file_id), params={"preset": "dying"})
        assert (again.status_code, again.content) == (200, expected)
        assert runs(tmp_path, "dying") == 2
        hit = await http.get(custom(file_id), params={"preset": "dying"})
        assert (hit.status_code, hit.content) == (200, expected)
        assert runs(tmp_path, "dying") == 2
        assert len(entries(tmp_path, "dying")) == 1


async def test_the_cache_keeps_within_its_size(pg_dsn: str, tmp_path: Path) -> None:
    """Entries beyond max_size go least recently used first; an output larger than the
    whole cache is not kept."""
    async with daemons(pg_dsn, tmp_path, **setup(tmp_path)) as (_, execserver, http):
        assert execserver is not None
        file_id = await uploaded(http)
        runs_param = str(tmp_path / "sized.runs")

        async def sized(n: int) -> None:
            params = {"service": "sized", "runs": runs_param, "n": str(n)}
            response = await http.get(custom(file_id), params=params)
            assert (response.status_code, len(response.content)) == (200, n), response.text

        await sized(60000)
        await sized(30000)
        await sized(60000)  # a hit: 60000 is now the most recent
        assert runs(tmp_path, "sized") == 2
        await sized(50000)  # 140 000 > 100 000: the least recent (30000) goes
        sizes = sorted(p.stat().st_size for p in entries(tmp_path, "sized"))
        assert sizes == [50000]  # 60000 + 50000 is over too: 60000 went next
        await sized(200000)  # larger than the cache: served, not kept
        assert sorted(p.stat().st_size for p in entries(tmp_path, "sized")) == [50000]
        await sized(50000)
        assert runs(tmp_path, "sized") == 4  # 60000, 30000, 50000, 200000
        shown = await figures(execserver, "sized")
        assert (shown["entries"], shown["bytes"], shown["hits"]) == (1, 50000, 2)
