"""The fylr's further ways in and its local actions, against real parts.

Produce-first originals, modified originals (made by the example converter),
manual versions, the ``checksum``, ``copy_move`` and ``sync_check`` actions, and
an API-only fylr beside a working one: each on a real PostgreSQL (a database of
its own), real execservers running real commands, real sockets on 127.0.0.1;
the ``copy_move`` that a ``kill -9`` interrupts runs the fylr as a subprocess.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
import trio
import yaml
from PIL import Image
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.fylr.app import FylrHandle
from trio_broker_daemons.fylr.config import FylrConfig

from tests.daemons.test_fylr import (
    SERVICES,
    TEXT,
    TEXT_CLASS,
    WAIT,
    download,
    ended,
    execserver_config,
    fylr_mapping,
    put,
    rows,
    running_fylr,
    stored_files,
)
from tests.support.processes import open_fylr_process
from trio_broker.trio.execserver import ExecserverHandle

REPOSITORY = Path(__file__).resolve().parents[2]
CONVERTER = REPOSITORY / "examples" / "convert_image.py"

ENTRY_SERVICES: dict[str, Any] = {
    **SERVICES,
    "upper": {"argv": ["tr", "a-z", "A-Z"]},
    "modify": {
        "argv": [sys.executable, str(CONVERTER), "modify", "--rotate", "{rotate}",
                 "--crop", "{crop}", "--format", "{format}"],
    },
    "image_metadata": {"argv": [sys.executable, str(CONVERTER), "metadata"]},
    "thumbnail": {
        "argv": [sys.executable, str(CONVERTER), "thumbnail", "--size", "{size}",
                 "--format", "{format}"],
    },
}  # fmt: skip

IMAGE_CLASS: dict[str, Any] = {
    "extensions": ["jpg", "png"],
    "metadata": {"service": "image_metadata"},
    "versions": {
        "thumbnail": {
            "service": "thumbnail",
            "params": {"size": "64x64", "format": "png"},
            "mimetype": "image/png",
        }
    },
}
RAW_CLASS: dict[str, Any] = {
    "extensions": ["raw"],
    "convert": {"service": "upper", "extension": "txt", "mimetype": "text/plain"},
}
BROKEN_CLASS: dict[str, Any] = {
    "extensions": ["bad"],
    "convert": {
        "service": "fail",
        "params": {"message": "codec: no such format"},
        "extension": "txt",
    },
}


@asynccontextmanager
async def entry_fylr(
    pg_dsn: str, tmp_path: Path, classes: Mapping[str, Any], **extra: Any
) -> AsyncIterator[tuple[FylrHandle, httpx.AsyncClient]]:
    """A fylr beside an execserver offering :data:`ENTRY_SERVICES`."""
    async with trio.open_nursery() as nursery:
        execserver: ExecserverHandle = await nursery.start(
            serve_from_config, execserver_config(**ENTRY_SERVICES)
        )
        address = f"{execserver.host}:{execserver.port}"
        mapping = fylr_mapping(pg_dsn, tmp_path / "state", address, classes, **extra)
        async with (
            running_fylr(FylrConfig.from_mapping(mapping)) as fylr,
            httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
        ):
            yield fylr, http
        nursery.cancel_scope.cancel()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def picture() -> bytes:
    """A 400x200 JPEG: its left half red, its right half blue."""
    image = Image.new("RGB", (400, 200), "red")
    image.paste(Image.new("RGB", (200, 200), "blue"), (200, 0))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=95)
    return out.getvalue()


def near(pixel: object, color: tuple[int, int, int]) -> bool:
    assert isinstance(pixel, tuple)
    return all(abs(a - b) <= 40 for a, b in zip(pixel, color, strict=True))


async def steps(fylr: FylrHandle, name: str, count: int) -> None:
    """Wait until this fylr has counted ``count`` step ends ``name`` (``checksum.ok``)."""
    with trio.fail_after(WAIT):
        await fylr.wait_until(lambda s: s.steps.get(name, 0) >= count)


def storage_key(dsn: str, file_id: int) -> str:
    ((key,),) = rows(dsn, f"SELECT storage_key FROM files WHERE id = {int(file_id)}")
    assert isinstance(key, str)
    return key


# -- produce-first originals -----------------------------------------------------------------


async def test_a_produce_first_class_converts_then_makes_metadata_and_versions(
    pg_dsn: str, tmp_path: Path
) -> None:
    """An upload of a class with convert starts in pending_produce; converted, it is an
    original of its new extension's class (metadata, versions made from the converted
    bytes), and the upload is kept as its manual version ``delivered``."""
    classes = {"text": TEXT_CLASS, "raw": RAW_CLASS}
    async with entry_fylr(pg_dsn, tmp_path, classes) as (fylr, http):
        created = await put(http, "notes.raw", TEXT)
        assert (created["status"], created["state"]) == ("processing", "pending_produce")
        assert (created["filename"], created["class"]) == ("notes.raw", "raw")
        document = await ended(http, created["id"])
        converted = TEXT.upper()
        assert document["status"] == "done"
        assert (document["filename"], document["class"]) == ("notes.txt", "text")
        assert document["hash"] == {"sha256": sha256(converted)}
        assert document["mimetype"] == "text/plain"
        assert document["metadata"] == {"mimetype": "text/plain"}
        versions = document["versions"]
        assert {name: v["status"] for name, v in versions.items()} == {
            "delivered": "done",
            "gz": "done",
            "sha256": "done",
            "gz_sha256": "done",
        }
        assert versions["delivered"]["manual"] is True
        assert versions["gz"]["manual"] is False
        assert versions["delivered"]["hash"] == {"sha256": sha256(TEXT)}
        assert await download(http, created["id"], "original") == converted
        assert await download(http, created["id"], "delivered") == TEXT
        assert gzip.decompress(await download(http, created["id"], "gz")) == converted
        # its own produce step, then the metadata step, then one produce per version
        stats = fylr.statistics().steps
        assert (stats["produce.ok"], stats["metadata.ok"], stats["sync.ok"]) == (4, 1, 1)
        # synced again, the upload as delivered stays (a sync never touches it)
        assert (await http.post(f"/api/v1/eas/{created['id']}/sync")).status_code == 202
        again = await ended(http, created["id"])
        assert set(again["versions"]) == set(versions)


async def test_a_failed_conversion_fails_the_original_until_it_is_requeued(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A conversion that fails ends the original failed with the converter's line, its
    queue row failed; requeued, the original goes back to pending_produce and runs again."""
    async with entry_fylr(pg_dsn, tmp_path, {"broken": BROKEN_CLASS}) as (fylr, http):
        created = await put(http, "scan.bad", b"not a scan")
        document = await ended(http, created["id"])
        assert (document["status"], document["state"]) == ("failed", "error")
        assert document["error"] == "produce: codec: no such format"
        assert document["versions"] == {}
        page = (await http.get("/inspect/system/fylr")).json()
        (failed,) = page["failed"]
        assert (failed["action"], failed["file"]["state"]) == ("produce", "error")
        assert (await http.post("/inspect/system/fylr/requeue")).json()["requeued"]
        await steps(fylr, "produce.failed", 2)
        document = await ended(http, created["id"])
        assert document["error"] == "produce: codec: no such format"


# -- modified originals ------------------------------------------------------------------


async def test_a_modified_original_is_an_original_of_its_own(pg_dsn: str, tmp_path: Path) -> None:
    """POST /eas/produce makes a rotated, cropped PNG of a JPEG: a new original with its own
    metadata and versions, linked to its source, which stays as it was."""
    data = picture()
    async with entry_fylr(
        pg_dsn, tmp_path, {"image": IMAGE_CLASS}, modify={"service": "modify"}
    ) as (_, http):
        source = await ended(http, (await put(http, "sunset.jpg", data))["id"])
        assert source["status"] == "done"
        response = await http.post(
            "/eas/produce",
            params={"source": source["id"], "rotate": 90, "crop": "0,0,300,200", "format": "png"},
        )
        assert response.status_code == 201, response.text
        created = response.json()
        assert (created["status"], created["state"]) == ("processing", "pending_produce")
        assert (created["filename"], created["class"], created["url"]) == (
            "sunset.png",
            "image",
            None,
        )
        assert created["derived_from"] == {
            "id": source["id"],
            "rotate": 90,
            "crop": [0, 0, 300, 200],
            "format": "png",
        }
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        assert (document["metadata"]["width"], document["metadata"]["height"]) == (200, 300)
        assert document["mimetype"] == "image/png"
        assert document["versions"]["thumbnail"]["status"] == "done"
        image = Image.open(io.BytesIO(await download(http, created["id"], "original")))
        assert (image.format, image.size) == ("PNG", (200, 300))
        # turned clockwise: the red top left of the crop is now its top right
        assert near(image.convert("RGB").getpixel((199, 0)), (255, 0, 0))
        assert near(image.convert("RGB").getpixel((0, 299)), (0, 0, 255))
        thumbnail = Image.open(io.BytesIO(await download(http, created["id"], "thumbnail")))
        assert thumbnail.size == (43, 64)
        unchanged = (await http.get(f"/api/v1/eas/{source['id']}")).json()
        assert unchanged["updated_at"] == source["updated_at"]
        assert await download(http, source["id"], "original") == data
        version_id = source["versions"]["thumbnail"]["id"]
        refused = {
            "rotate=45": ({"source": source["id"], "rotate": 45}, 400),
            "no change": ({"source": source["id"]}, 400),
            "no source": ({"rotate": 90}, 400),
            "unknown": ({"source": 10**9, "rotate": 90}, 404),
            "a version": ({"source": version_id, "rotate": 90}, 400),
        }
        answers = {
            what: (await http.post("/eas/produce", params=params))
            for what, (params, _) in refused.items()
        }
        assert {what: a.status_code for what, a in answers.items()} == {
            what: status for what, (_, status) in refused.items()
        }
        assert answers["rotate=45"].json()["error"] == "rotate: expected 90, 180 or 270, got '45'"
        assert answers["no source"].json()["error"] == "source: expected a file id, got None"
        assert answers["unknown"].json()["error"] == "source: no file 1000000000"
        assert answers["a version"].json()["error"] == (
            f"source: file {version_id} is a version (of original {source['id']}), not an original"
        )


async def test_a_source_without_stored_bytes_is_refused(pg_dsn: str, tmp_path: Path) -> None:
    """A modified original of an original still waiting for its conversion: 409, nothing kept."""
    waiting = {"extensions": ["raw"], "convert": {"service": "nowhere", "extension": "txt"}}
    async with entry_fylr(
        pg_dsn,
        tmp_path,
        {"raw": waiting, "text": {"extensions": ["txt"]}},
        modify={"service": "modify"},
    ) as (_, http):
        created = await put(http, "scan.raw", b"raw bytes")
        response = await http.post("/eas/produce", params={"source": created["id"], "rotate": 90})
        assert response.status_code == 409
        assert response.json()["error"] == (
            f"source: original {created['id']} has no stored bytes yet (state pending_produce):"
            " make it once it is processing or done"
        )
        assert rows(pg_dsn, "SELECT count(*) FROM files") == [(1,)]


# -- manual versions -------------------------------------------------------------------------


async def test_a_manual_version_is_stored_kept_and_replaced(pg_dsn: str, tmp_path: Path) -> None:
    """PUT /eas/put?original=ID&version=NAME stores a done, manual version; a sync keeps it; a
    second PUT replaces it (its old bytes deleted); the class's own versions are a 409."""
    async with entry_fylr(pg_dsn, tmp_path, {"text": TEXT_CLASS}) as (_, http):
        original = await ended(http, (await put(http, "notes.txt", TEXT))["id"])
        file_id = original["id"]
        response = await http.put(
            "/eas/put",
            params={"original": file_id, "version": "cover"},
            content=b"a cover",
            headers={"content-type": "image/webp"},
        )
        assert response.status_code == 201, response.text
        cover = response.json()
        assert (cover["kind"], cover["version"], cover["original"]) == ("version", "cover", file_id)
        assert (cover["status"], cover["manual"], cover["mimetype"]) == ("done", True, "image/webp")
        assert cover["hash"] == {"sha256": sha256(b"a cover")}
        assert await download(http, file_id, "cover") == b"a cover"
        assert (await http.post(f"/api/v1/eas/{file_id}/sync")).status_code == 202
        document = await ended(http, file_id)
        assert document["versions"]["cover"]["id"] == cover["id"]
        first_key = storage_key(pg_dsn, cover["id"])
        again = await http.put(
            "/eas/put", params={"original": file_id, "version": "cover"}, content=b"a new cover"
        )
        assert again.status_code == 201
        assert again.json()["id"] == cover["id"]
        assert await download(http, file_id, "cover") == b"a new cover"
        assert not (tmp_path / "state" / "files" / first_key).exists()
        made = await http.put(
            "/eas/put", params={"original": file_id, "version": "gz"}, content=b"x"
        )
        assert made.status_code == 409
        assert made.json()["error"] == (
            "version 'gz' is made by class 'text' itself: a manual one would be replaced at its"
            " next sync"
        )
        assert gzip.decompress(await download(http, file_id, "gz")) == TEXT
        refusals = {
            "original": ({"original": file_id, "version": "original"}, 400),
            "bad name": ({"original": file_id, "version": "a b"}, 400),
            "unknown": ({"original": 10**9, "version": "cover"}, 404),
            "a version": ({"original": cover["id"], "version": "cover"}, 400),
            "no id": ({"original": "x", "version": "cover"}, 400),
        }
        for what, (params, status) in refusals.items():
            refused = await http.put("/eas/put", params=params, content=b"y")
            assert refused.status_code == status, (what, refused.text)
    # the refused uploads kept nothing: the original, its three versions and the cover
    files = [p for p in stored_files(tmp_path / "state") if not p.name.startswith(".tmp-")]
    assert len(files) == 5


# -- checksum and sync_check -----------------------------------------------------------------


async def test_checksum_catches_a_flipped_byte_and_sync_check_makes_it_again(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A checksum run of every file marks exactly the file whose stored bytes lost a bit, and
    a missing file; sync_check makes the damaged and the missing version again."""
    async with entry_fylr(pg_dsn, tmp_path, {"text": TEXT_CLASS}) as (fylr, http):
        first = await ended(http, (await put(http, "a.txt", TEXT))["id"])
        second = await ended(http, (await put(http, "b.txt", b"other text\n" * 100))["id"])
        gz_id = first["versions"]["gz"]["id"]
        sha_id = first["versions"]["sha256"]["id"]
        root = tmp_path / "state" / "files"
        flipped = root / storage_key(pg_dsn, second["id"])
        content = bytearray(flipped.read_bytes())
        content[len(content) // 2] ^= 0x01
        flipped.write_bytes(bytes(content))
        gz = root / storage_key(pg_dsn, gz_id)
        gz_bytes = gz.read_bytes()
        gz.write_bytes(gz_bytes[:-1] + bytes([gz_bytes[-1] ^ 0x80]))
        (root / storage_key(pg_dsn, sha_id)).unlink()
        response = await http.post("/inspect/system/fylr/checksum")
        assert response.status_code == 202
        every = [first["id"], second["id"]]
        every += [v["id"] for document in (first, second) for v in document["versions"].values()]
        assert response.json() == {
            "action": "checksum",
            "queued": 8,
            "running": 0,
            "files": sorted(every),
        }
        await steps(fylr, "checksum.ok", 8)
        a = (await http.get(f"/api/v1/eas/{first['id']}")).json()
        b = (await http.get(f"/api/v1/eas/{second['id']}")).json()
        assert b["damage"] == (
            f"checksum mismatch: the stored bytes hash to sha256 {sha256(bytes(content))},"
            f" recorded {b['hash']['sha256']}"
        )
        assert a["damage"] is None
        assert a["checked"] is not None
        assert b["checked"] is not None
        assert a["versions"]["gz"]["damage"].startswith("checksum mismatch")
        assert a["versions"]["sha256"]["damage"] == "its stored bytes are missing"
        assert a["versions"]["gz_sha256"]["damage"] is None
        assert all(v["damage"] is None for v in b["versions"].values())
        # sync_check makes the two versions again, from the original's bytes
        response = await http.post("/inspect/system/fylr/sync_check", params={"file": first["id"]})
        assert response.json()["files"] == [first["id"]]
        await steps(fylr, "sync_check.ok", 1)
        remade = await ended(http, first["id"])
        assert remade["status"] == "done"
        assert all(
            v["status"] == "done" and v["damage"] is None for v in remade["versions"].values()
        )
        assert gzip.decompress(await download(http, first["id"], "gz")) == TEXT
        assert await download(http, first["id"], "sha256") == sha256(TEXT).encode() + b"  -\n"
        assert fylr.statistics().steps["produce.ok"] == 6 + 2
        # a second sync_check of every original finds nothing to make
        await http.post("/inspect/system/fylr/sync_check")
        await steps(fylr, "sync_check.ok", 3)
        assert fylr.statistics().steps["produce.ok"] == 8


# -- copy_move -------------------------------------------------------------------------------


async def test_copy_move_moves_and_resumes_what_a_crash_left(pg_dsn: str, tmp_path: Path) -> None:
    """copy_move moves a file to another location (no copy left behind), finishes a move a
    crash left at either point (a copy made, or the row switched), refuses to move damaged
    bytes, and an unknown location is a 400."""
    archive = tmp_path / "archive"
    async with entry_fylr(
        pg_dsn,
        tmp_path,
        {"text": {"extensions": ["txt"]}},
        storage_locations={"archive": str(archive)},
    ) as (fylr, http):
        ids = [(await put(http, f"{n}.txt", f"file {n}\n".encode() * 1000))["id"] for n in range(4)]
        for file_id in ids:
            await ended(http, file_id)
        root = tmp_path / "state" / "files"
        keys = {file_id: storage_key(pg_dsn, file_id) for file_id in ids}
        # a crash after the copy, before the row changed: the copy is there already
        (archive / keys[ids[1]]).parent.mkdir(parents=True, exist_ok=True)
        (archive / keys[ids[1]]).write_bytes((root / keys[ids[1]]).read_bytes())
        # a crash after the row changed, before the old copy was deleted
        (archive / keys[ids[2]]).parent.mkdir(parents=True, exist_ok=True)
        (archive / keys[ids[2]]).write_bytes((root / keys[ids[2]]).read_bytes())
        switch = (
            "UPDATE files SET storage_key = 'archive:' || storage_key WHERE id = {} RETURNING id"
        )
        rows(pg_dsn, switch.format(ids[2]))
        # damaged bytes are not moved
        damaged = root / keys[ids[3]]
        damaged.write_bytes(b"X" + damaged.read_bytes()[1:])
        for file_id in ids:
            response = await http.post(
                "/inspect/system/fylr/copy_move", params={"file": file_id, "location": "archive"}
            )
            assert response.status_code == 202
        with trio.fail_after(WAIT):
            await fylr.wait_until(
                lambda s: (
                    s.steps.get("copy_move.ok", 0) + s.steps.get("copy_move.replayed", 0) == 3
                    and s.steps.get("copy_move.error", 0) == 1
                )
            )
        for n, file_id in enumerate(ids[:3]):
            document = (await http.get(f"/api/v1/eas/{file_id}")).json()
            assert document["location"] == "archive"
            assert await download(http, file_id, "original") == f"file {n}\n".encode() * 1000
            name = keys[file_id].split(":")[-1]
            assert not (root / name).exists()
            assert (archive / name).is_file()
        bad = (await http.get(f"/api/v1/eas/{ids[3]}")).json()
        assert bad["location"] == "default"
        assert bad["damage"].startswith("checksum mismatch")
        (failed,) = (await http.get("/inspect/system/fylr")).json()["failed"]
        assert failed["action"] == "copy_move"
        assert failed["reason"].startswith("DamagedBytes: not moved: checksum mismatch")
        assert not (archive / keys[ids[3]]).exists()
        unknown = await http.post(
            "/inspect/system/fylr/copy_move", params={"file": ids[0], "location": "attic"}
        )
        assert unknown.status_code == 400
        assert unknown.json()["error"] == (
            "location: expected a storage location of this fylr (archive, default), got 'attic'"
        )


MIB = 1 << 20


async def test_copy_move_killed_mid_copy_resumes_with_no_loss(pg_dsn: str, tmp_path: Path) -> None:
    """kill -9 of the fylr while copy_move copies a file (its source read slowly: a FIFO the
    test feeds) leaves the row and the old copy as they were; the restarted fylr takes the
    step up again and finishes the move, and the sweep removes the half copy."""
    archive = tmp_path / "archive"
    mapping = fylr_mapping(
        pg_dsn, tmp_path / "state", "127.0.0.1:9", {}, execservers=[],
        storage_locations={"archive": str(archive)},
    )  # fmt: skip
    text = yaml.safe_dump(mapping)
    data = os.urandom(3 * MIB)
    async with open_fylr_process(text) as first:
        async with httpx.AsyncClient(base_url=first.http_url, timeout=WAIT) as http:
            moving = await ended(http, (await put(http, "big.bin", data))["id"])
            staying = await ended(http, (await put(http, "small.bin", b"small"))["id"])
            key = storage_key(pg_dsn, moving["id"])
            source = tmp_path / "state" / "files" / key
            source.unlink()
            os.mkfifo(source)  # the stored bytes, read as slowly as the test feeds them
            queued = await http.post(
                "/inspect/system/fylr/copy_move",
                params={"file": moving["id"], "location": "archive"},
            )
            assert queued.json()["queued"] == 1

            def feed() -> IO[bytes]:
                fifo = open(source, "wb", buffering=0)  # noqa: SIM115 - closed after the kill
                # written once the mover has read all but a pipe's buffer: the first two of
                # its 1 MiB reads are in its temporary file
                part = memoryview(data)[: 5 * MIB // 2]
                while part:
                    part = part[fifo.write(part) or 0 :]
                return fifo

            with trio.fail_after(WAIT):
                fifo = await trio.to_thread.run_sync(feed)
        (half,) = list(archive.rglob(".tmp-*"))
        assert half.stat().st_size >= 2 * MIB
        assert storage_key(pg_dsn, moving["id"]) == key  # the row still names the old copy
        first.process.send_signal(signal.SIGKILL)
        assert await first.process.wait() == -signal.SIGKILL
        fifo.close()
    source.unlink()
    source.write_bytes(data)  # the slow disk is back
    async with (
        running_fylr(FylrConfig.from_mapping(mapping)) as second,
        httpx.AsyncClient(base_url=second.url, timeout=WAIT) as http,
    ):
        await steps(second, "copy_move.ok", 1)  # the killed fylr's step, back after stale_after
        assert storage_key(pg_dsn, moving["id"]) == f"archive:{key}"
        response = await http.get(f"/api/v1/eas/download/{moving['id']}/original")
        assert response.content == data
        assert response.headers["x-content-sha256"] == sha256(data)
        assert await download(http, staying["id"], "original") == b"small"
        assert not source.exists()
        assert (archive / key).read_bytes() == data
        for path in archive.rglob(".tmp-*"):
            os.utime(path, (time.time() - 3600,) * 2)
        assert (await http.post("/inspect/system/fylr/sweep")).status_code == 200
        assert not list(archive.rglob(".tmp-*"))
        page = (await http.get("/inspect/system/fylr")).json()
        assert page["failed"] == []


# -- an API-only node --------------------------------------------------------------------------


async def test_an_api_only_fylr_serves_while_another_one_works(pg_dsn: str, tmp_path: Path) -> None:
    """parallel: 0 runs no dispatcher and dials no execserver: an upload to it is processed by
    the working fylr on the same database and folder, and read back through it; it keeps its
    own heartbeat."""
    async with trio.open_nursery() as nursery:
        execserver: ExecserverHandle = await nursery.start(
            serve_from_config, execserver_config(**ENTRY_SERVICES)
        )
        address = f"{execserver.host}:{execserver.port}"

        def config(name: str, **extra: Any) -> FylrConfig:
            mapping = fylr_mapping(
                pg_dsn, tmp_path / "state", address, {"text": TEXT_CLASS}, name=name, **extra
            )
            return FylrConfig.from_mapping(mapping)

        async with (
            running_fylr(config("api-only", parallel=0)) as api_only,
            running_fylr(config("worker")) as worker,
            httpx.AsyncClient(base_url=api_only.url, timeout=WAIT) as http,
        ):
            created = await put(http, "notes.txt", TEXT)
            document = await ended(http, created["id"])
            assert document["status"] == "done"
            assert gzip.decompress(await download(http, created["id"], "gz")) == TEXT
            alone = api_only.statistics()
            assert (alone.dispatcher, alone.client, alone.steps) == (None, None, {})
            assert alone.uploads == 1
            assert worker.statistics().steps["produce.ok"] == 3
            page = (await http.get("/inspect/system/fylr")).json()
            assert page["dispatcher"] is None
            refused = await http.post(
                "/eas/produce", params={"source": created["id"], "rotate": 90}
            )
            assert refused.status_code == 501
            with trio.fail_after(WAIT):  # it beats, as a dispatcher would: a live backend
                await api_only.wait_until(
                    lambda _: api_only.store.statistics().calls.get("heartbeat", 0) >= 2
                )
            sql = "SELECT heartbeat > started FROM broker_backends WHERE backend_id = '{}'"
            assert rows(pg_dsn, sql.format(api_only.backend_id)) == [(True,)]
        assert rows(pg_dsn, sql.format(api_only.backend_id)) == []  # unregistered when it stopped
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("value", [1, 8])
def test_parallel_other_than_zero_is_refused(value: int) -> None:
    """The seed's other parallel values configure nothing here: refused, saying why."""
    with pytest.raises(ConfigError, match="expected 0 \\(an API-only node"):
        FylrConfig.from_mapping({"execservers": [], "parallel": value})


# -- the operator's command ------------------------------------------------------------------


async def storage_command(*args: str) -> tuple[int, str]:
    result = await trio.run_process(
        [sys.executable, "-m", "trio_broker_daemons", "storage", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return result.returncode, (result.stdout + result.stderr).decode()


async def test_the_storage_command_queues_local_actions(pg_dsn: str, tmp_path: Path) -> None:
    """trio-broker storage asks the fylr with the operator token and says what was queued;
    without the token it says which one to give; a bad command line is exit 2."""
    token = "operator-secret-of-this-test"
    async with entry_fylr(pg_dsn, tmp_path, {"text": TEXT_CLASS}, tokens={"operator": token}) as (
        fylr,
        http,
    ):
        document = await ended(http, (await put(http, "a.txt", TEXT))["id"])
        server = ["--server", fylr.url]
        with trio.fail_after(WAIT):
            status, output = await storage_command(
                "checksum", "--file", str(document["id"]), *server
            )
            assert (status, output) == (
                1,
                f"checksum of file {document['id']}: the fylr answered 401: a token is required:"
                " the operator token (give the fylr's token: --token-file FILE or"
                " $TRIO_BROKER_FYLR_TOKEN; this command needs the operator token)\n",
            )
            status, output = await storage_command(
                "checksum", "--file", str(document["id"]), "--token", token, *server
            )
            assert (status, output) == (
                0,
                f"checksum of file {document['id']}: 4 files queued, 0 running\n",
            )
            await steps(fylr, "checksum.ok", 4)
            status, output = await storage_command(
                "copy-move", "--all", "--location", "attic", "--token", token, *server
            )
            assert status == 1
            assert "location: expected a storage location of this fylr (default)" in output
            status, output = await storage_command("sync-check", "--all", "--token", token, *server)
            assert (status, output) == (
                0,
                "sync_check of every file: 1 file queued, 0 running\n",
            )
            status, output = await storage_command("checksum", *server)
            assert status == 2
            assert "one of the arguments --file --all is required" in output
            status, output = await storage_command("checksum", "--all", "--location", "x", *server)
            assert (status, output) == (
                2,
                "trio-broker storage: --location is for copy-move only\n",
            )
