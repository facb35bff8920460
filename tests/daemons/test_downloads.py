"""Ranged and conditional downloads, and exports, on a real fylr and PostgreSQL.

The HTTP rules themselves (which range, which tag) are tried without a server at the
end, through :func:`~trio_broker_daemons.fylr.ranges.plan_download`.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
from trio_broker_daemons.fylr.ranges import plan_download

from tests.daemons.test_fylr import ended, put
from tests.daemons.test_renditions import daemons

DATA = bytes(range(256)) * 40  # 10 240 bytes
SHA = hashlib.sha256(DATA).hexdigest()


async def test_range_and_if_none_match_on_a_stored_file(pg_dsn: str, tmp_path: Path) -> None:
    """One range is 206 with its Content-Range, a range past the end 416, the stored
    hash is the ETag and If-None-Match with it 304 without a body."""
    async with daemons(pg_dsn, tmp_path, execserver=False) as (_, _e, http):
        document = await put(http, "bytes.bin", DATA)
        url = f"/api/v1/eas/download/{document['id']}/original"
        whole = await http.get(url)
        assert (whole.status_code, whole.content) == (200, DATA)
        assert whole.headers["etag"] == f'"{SHA}"'
        assert whole.headers["accept-ranges"] == "bytes"

        part = await http.get(url, headers={"range": "bytes=100-199"})
        assert (part.status_code, part.content) == (206, DATA[100:200])
        assert part.headers["content-range"] == f"bytes 100-199/{len(DATA)}"
        tail = await http.get(url, headers={"range": "bytes=-10"})
        assert (tail.status_code, tail.content) == (206, DATA[-10:])
        rest = await http.get(url, headers={"range": f"bytes={len(DATA) - 5}-"})
        assert (rest.status_code, rest.content) == (206, DATA[-5:])

        beyond = await http.get(url, headers={"range": f"bytes={len(DATA)}-"})
        assert beyond.status_code == 416
        assert beyond.headers["content-range"] == f"bytes */{len(DATA)}"
        assert beyond.content == b""

        same = await http.get(url, headers={"if-none-match": f'"{SHA}"'})
        assert (same.status_code, same.content) == (304, b"")
        assert same.headers["etag"] == f'"{SHA}"'
        other = await http.get(url, headers={"if-none-match": '"something-else"'})
        assert (other.status_code, other.content) == (200, DATA)


async def test_export_is_refused_before_sync_and_carries_the_document(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A file whose metadata step has not run (no execserver) is 409 with its state; a
    file that is done exports its document and its original in one tar stream."""
    async with daemons(pg_dsn, tmp_path, execserver=False) as (_, _e, http):
        waiting = await put(http, "a.notes", b"some notes\n")  # its metadata step waits
        refused = await http.get(f"/api/v1/eas/export/{waiting['id']}")
        assert refused.status_code == 409
        assert refused.json()["state"] == "new"
        assert "it can be exported in sync, produce or done" in refused.json()["error"]

        plain = await put(http, "folder/data.bin", DATA)  # no class: done at once
        assert (await ended(http, plain["id"]))["status"] == "done"
        exported = await http.get(f"/api/v1/eas/export/{plain['id']}")
        assert exported.status_code == 200, exported.text
        assert exported.headers["content-type"] == "application/x-tar"
        with tarfile.open(fileobj=io.BytesIO(exported.content)) as archive:
            names = archive.getnames()
            assert names == [f"{plain['id']}/document.json", f"{plain['id']}/data.bin"]
            document = json.load(archive.extractfile(names[0]))  # type: ignore[arg-type]
            original = archive.extractfile(names[1])
            assert original is not None
            assert original.read() == DATA
        assert document["id"] == plain["id"]
        assert document["hash"] == {"sha256": SHA}
        assert (await http.get(f"/api/v1/eas/export/{plain['id'] + 1000}")).status_code == 404


@pytest.mark.parametrize(
    ("headers", "status", "start", "length"),
    [
        ({}, 200, 0, 100),
        ({"range": "bytes=0-0"}, 206, 0, 1),
        ({"range": "bytes=90-500"}, 206, 90, 10),
        ({"range": "bytes=-500"}, 206, 0, 100),
        ({"range": "bytes=100-"}, 416, 0, 0),
        ({"range": "bytes=-0"}, 416, 0, 0),
        ({"range": "bytes=5-1"}, 200, 0, 100),  # invalid: ignored
        ({"range": "bytes=0-1,5-6"}, 200, 0, 100),  # several ranges: the whole file
        ({"range": "items=0-1"}, 200, 0, 100),
        ({"range": "bytes=0-1", "if-range": '"other"'}, 200, 0, 100),
        ({"range": "bytes=0-1", "if-range": f'"{SHA}"'}, 206, 0, 2),
        ({"if-none-match": f'W/"{SHA}", "x"'}, 304, 0, 0),
        ({"if-none-match": "*"}, 304, 0, 0),
    ],
)
def test_plan_download(headers: dict[str, str], status: int, start: int, length: int) -> None:
    """Which answer each Range / If-None-Match / If-Range gets, for a 100-byte file."""
    plan = plan_download(100, SHA, headers)
    assert (plan.status, plan.start, plan.length) == (status, start, length)


def test_without_a_hash_there_is_no_etag_and_no_304() -> None:
    plan = plan_download(100, None, {"if-none-match": "*", "range": "bytes=0-1", "if-range": "x"})
    assert plan.status == 200
    assert "etag" not in plan.headers
