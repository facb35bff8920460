"""The pure decisions of originals the fylr makes itself, manual versions and the local actions."""

from __future__ import annotations

import datetime
import subprocess
import sys
from typing import Any

import pytest
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.derived import (
    Modification,
    OwnProduce,
    ProduceRefused,
    manual_refusal,
    own_produce,
    parse_modification,
    priority_of,
    renamed,
)
from trio_broker_daemons.fylr.files import FileRow
from trio_broker_daemons.fylr.local_actions import (
    BYTES_MISSING,
    checksum_damage,
    integrity_members,
    location_of_key,
)

SHA_A = "a" * 64
SHA_B = "b" * 64

CONFIG = FylrConfig.from_mapping(
    {
        "execservers": [],
        "modify": {"service": "modify", "params": {"quality": 90}, "timeout": "2m"},
        "classes": {
            "scan": {
                "extensions": ["bmp", "tif"],
                "convert": {
                    "service": "to_png",
                    "params": {"format": "png"},
                    "extension": "png",
                    "mimetype": "image/png",
                },
            },
            "image": {
                "extensions": ["png", "jpg"],
                "metadata": {"service": "meta"},
                "versions": {"thumbnail": {"service": "thumb"}},
            },
            "raw": {"extensions": ["raw"]},
        },
    }
)


# -- modified originals ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"rotate": "90"}, Modification(rotate=90)),
        ({"rotate": "270", "format": "PNG"}, Modification(rotate=270, format="png")),
        ({"crop": "0,5,10,20"}, Modification(crop=(0, 5, 10, 20))),
        ({"format": ".webp", "source": "3"}, Modification(format="webp")),
        (
            {"rotate": "180", "crop": "1, 2, 3, 4", "format": "jpg"},
            Modification(rotate=180, crop=(1, 2, 3, 4), format="jpg"),
        ),
    ],
)
def test_a_modification_from_its_query(query: dict[str, str], expected: Modification) -> None:
    assert parse_modification(query) == expected
    assert Modification.from_document(expected.document()) == expected


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({}, "expected at least one of rotate, crop and format"),
        ({"source": "1"}, "expected at least one of rotate, crop and format"),
        ({"rotate": "45"}, "rotate: expected 90, 180 or 270, got '45'"),
        ({"rotate": "-90"}, "rotate: expected 90, 180 or 270, got '-90'"),
        ({"rotate": ""}, "rotate: expected 90, 180 or 270, got ''"),
        ({"crop": "1,2,3"}, "crop: expected x,y,w,h (integers, w and h at least 1), got '1,2,3'"),
        (
            {"crop": "1,2,0,4"},
            "crop: expected x,y,w,h (integers, w and h at least 1), got '1,2,0,4'",
        ),
        (
            {"crop": "-1,2,3,4"},
            "crop: expected x,y,w,h (integers, w and h at least 1), got '-1,2,3,4'",
        ),
        (
            {"crop": f"0,0,1,{2**31}"},
            f"crop: expected x,y,w,h (integers, w and h at least 1), got '0,0,1,{2**31}'",
        ),
        (
            {"format": "p n g"},
            "format: expected an extension of 1 to 10 letters and digits, got 'p n g'",
        ),
        ({"format": ""}, "format: expected an extension of 1 to 10 letters and digits, got ''"),
    ],
)
def test_a_bad_modification_names_its_parameter(query: dict[str, str], message: str) -> None:
    with pytest.raises(ProduceRefused) as info:
        parse_modification(query)
    assert (str(info.value), info.value.status) == (message, 400)


def test_job_params_fill_every_placeholder() -> None:
    """rotate, crop and format are always there, empty when not asked for."""
    assert Modification(rotate=90).params() == {"rotate": 90, "crop": "", "format": ""}
    assert Modification(crop=(1, 2, 3, 4), format="png").params() == {
        "rotate": 0,
        "crop": "1,2,3,4",
        "format": "png",
    }


@pytest.mark.parametrize(
    ("name", "extension", "expected"),
    [
        ("sunset.jpg", "png", "sunset.png"),
        ("a.tar.gz", "png", "a.tar.png"),
        ("README", "png", "README.png"),
        (".bashrc", "png", ".bashrc.png"),
        ("dir.v2/scan", "png", "dir.v2/scan.png"),
        ("sunset.jpg", None, "sunset.jpg"),
    ],
)
def test_renamed(name: str, extension: str | None, expected: str) -> None:
    assert renamed(name, extension) == expected


def test_a_modified_originals_step() -> None:
    """The modify service with the configured params and the asked ones laid over them."""
    derivation = Modification(rotate=90, format="png").document()
    assert own_produce(CONFIG, filename="sunset.png", derivation=derivation) == OwnProduce(
        service="modify",
        params={"quality": 90, "rotate": 90, "crop": "", "format": "png"},
        limits={"timeout": "120s"},
        filename="sunset.png",
        file_class="image",
        mimetype=None,
        metadata_step=True,
        delivered=False,
    )
    plain = FylrConfig.from_mapping({"execservers": []})
    assert own_produce(plain, filename="a.png", derivation=derivation) == (
        "modified originals are not configured (modify) any more"
    )


def test_a_produce_first_uploads_step() -> None:
    """The class's conversion; the original is renamed and classified by its new extension."""
    step = own_produce(CONFIG, filename="scan.tif", derivation=None)
    assert step == OwnProduce(
        service="to_png",
        params={"format": "png"},
        limits={},
        filename="scan.png",
        file_class="image",
        mimetype="image/png",
        metadata_step=True,
        delivered=True,
    )
    assert own_produce(CONFIG, filename="notes.raw", derivation=None) == (
        "class 'raw' converts its uploads no more (convert)"
    )


@pytest.mark.parametrize(
    ("name", "status", "converted", "expected"),
    [
        ("cover", "done", False, None),
        ("cover", "error", False, None),
        ("thumbnail", "done", False, (409, "version 'thumbnail' is made by class 'image' itself")),
        ("delivered", "done", True, (409, "version 'delivered' keeps the upload this original")),
        ("delivered", "done", False, None),
        ("cover", "pending_produce", False, (409, "the original is not produced yet")),
        ("original", "done", False, (400, "version: the name 'original' is the uploaded file's")),
        ("a b", "done", False, (400, "version: expected 1 to 200 letters, digits")),
        ("", "done", False, (400, "version: expected 1 to 200 letters, digits")),
        ("x" * 201, "done", False, (400, "version: expected 1 to 200 letters, digits")),
    ],
)
def test_manual_refusal(
    name: str, status: str, converted: bool, expected: tuple[int, str] | None
) -> None:
    refused = manual_refusal(
        CONFIG,
        name=name,
        original_filename="photo.jpg",
        original_status=status,
        converted=converted,
    )
    if expected is None:
        assert refused is None
    else:
        assert refused is not None
        assert refused.status == expected[0]
        assert str(refused).startswith(expected[1])


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("2", (2, None)),
        ("-3", (-3, None)),
        ("x", (0, "priority: expected an integer, got 'x'")),
        (str(2**31), (2**31, f"priority: expected a 32-bit signed integer, got {2**31}")),
    ],
)
def test_priority_of(raw: str, expected: tuple[int, str | None]) -> None:
    assert priority_of(raw) == expected


# -- the local actions ----------------------------------------------------------------


def test_checksum_damage() -> None:
    assert checksum_damage(10, SHA_A, 10, SHA_A) is None
    assert checksum_damage(None, None, 10, SHA_A) is None  # nothing recorded to compare
    assert checksum_damage(10, SHA_A, 10, SHA_B) == (
        f"checksum mismatch: the stored bytes hash to sha256 {SHA_B}, recorded {SHA_A}"
    )
    assert checksum_damage(10, SHA_A, 9, SHA_B) == (
        f"checksum mismatch: the stored bytes hash to sha256 {SHA_B}, recorded {SHA_A}"
        " (9 bytes, recorded 10)"
    )
    assert BYTES_MISSING == "its stored bytes are missing"


def test_location_of_key() -> None:
    assert location_of_key("originals/ab/ab0123456789abcdef0123456789abcd") == "default"
    assert location_of_key("archive:originals/ab/ab0123456789abcdef0123456789abcd") == "archive"
    assert location_of_key(None) is None


def row(**changes: Any) -> FileRow:
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    values: dict[str, Any] = {
        "id": 7,
        "kind": "original",
        "parent_id": None,
        "version": None,
        "source": None,
        "filename": "a.png",
        "file_class": "image",
        "status": "done",
        "priority": 0,
        "storage_key": "archive:originals/ab/ab0123456789abcdef0123456789abcd",
        "size": 3,
        "sha256": SHA_A,
        "mimetype": "image/png",
        "metadata": {},
        "produce_hash": None,
        "error": None,
        "created_at": now,
        "updated_at": now,
    }
    return FileRow(**{**values, **changes})


def test_integrity_members() -> None:
    """Where the bytes are, the last checksum, damage, manual, a modified original's source."""
    checked = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    derivation = Modification(rotate=90).document()
    assert integrity_members(row(derived_from=3, derivation=derivation, checked_at=checked)) == {
        "location": "archive",
        "checked": {"at": "2026-01-02T03:04:05+00:00"},
        "damage": None,
        "manual": False,
        "derived_from": {"id": 3, "rotate": 90, "crop": None, "format": None},
    }
    version = row(kind="version", parent_id=3, version="cover", manual=True, storage_key=None)
    assert integrity_members(version) == {
        "location": None,
        "checked": None,
        "damage": None,
        "manual": True,
    }


def test_the_decisions_are_pure() -> None:
    """Importing the decisions pulls in no trio, sockets or database I/O layer."""
    code = (
        "import sys; import trio_broker_daemons.fylr.derived;"
        "layers = ('trio', 'httpx', 'hypercorn', 'psycopg_pool');"
        "print(sorted(m for m in layers if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
