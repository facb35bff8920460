"""What the chaos soak checks once everything has ended: each problem is one violation line.

The promises come from the fylr configuration (``examples/fylr.yml``): each
class's versions, each version's service, params and source. For every upload:

- at least one original row has its name (an upload whose answer was lost may
  have made two; each must be complete), and no row has a name never uploaded;
- the original is ``done`` with exactly its class's versions, none missing, none
  extra; a valid file's versions are all ``done``; a corrupt image's picture
  versions (and those made from them) are ``failed`` with the converter's error,
  its checksum ``done``; a valid image's metadata has its size, a corrupt one's
  error is the converter's;
- the original downloads byte-identical through every fylr (one left on its
  remote has no stored bytes: its recorded size and SHA-256 are the sample's,
  read from the remote at its sync); every ``done``
  version downloads with its recorded size and SHA-256 and is valid: an image
  decodes in the promised format and fits the promised box without being
  enlarged, keeping the aspect of its source (the EXIF orientation applied), a
  gzip decompresses to the source, a checksum is the source's;
- no two versions share a stored file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import httpx
from PIL import Image
from trio_broker_daemons.fylr.config import FylrConfig, VersionConfig

from tests.chaos.samples import Sample

__all__ = ["FileRecord", "check_file", "check_rows"]

CONVERTER_ERROR: Final = "convert_image: cannot read image"
"""How the example converter's refusal of an unreadable image starts."""
_FORMATS: Final = {"webp": "WEBP", "png": "PNG", "jpeg": "JPEG", "jpg": "JPEG"}
_PICTURE_SERVICES: Final = frozenset({"thumbnail", "preview"})
CLASS_OF_KIND: Final = {"image": "image", "corrupt": "image", "text": "text", "other": "other"}
"""The class of ``examples/fylr.yml`` each kind of sample belongs to."""


@attrs.frozen(kw_only=True)
class FileRecord:
    """One row of ``files`` as the checks need it."""

    id: int
    kind: str
    parent_id: int | None
    version: str | None
    source: str | None
    filename: str
    file_class: str | None
    status: str
    storage_key: str | None
    size: int | None
    sha256: str | None
    metadata: Mapping[str, Any]
    error: str | None


def check_rows(records: Sequence[FileRecord], samples: Sequence[Sample]) -> list[str]:
    """The violations visible in the rows alone: lost or unknown uploads, shared stored files."""
    violations = []
    names = {s.name for s in samples}
    originals = [r for r in records if r.kind == "original"]
    stored = {r.filename for r in originals}
    violations += [f"{name}: never stored (no original row)" for name in sorted(names - stored)]
    violations += [
        f"file {r.id}: an original named {r.filename!r}, which was never uploaded"
        for r in originals
        if r.filename not in names
    ]
    keys: dict[str, int] = {}
    for record in records:
        if record.kind == "version" and record.storage_key is not None:
            other = keys.setdefault(record.storage_key, record.id)
            if other != record.id:
                violations.append(
                    f"versions {other} and {record.id} share the stored file {record.storage_key}"
                )
    return violations


def _expected_status(sample: Sample, name: str, versions: Mapping[str, VersionConfig]) -> str:
    """``done`` or ``failed``: what the configuration promises for this version."""
    if sample.kind != "corrupt":
        return "done"
    version = versions[name]
    if version.source is not None:
        return _expected_status(sample, version.source, versions)
    return "failed" if version.service in _PICTURE_SERVICES else "done"


def _expected_error(sample: Sample, name: str, versions: Mapping[str, VersionConfig]) -> str:
    source = versions[name].source
    if source is not None and _expected_status(sample, source, versions) == "failed":
        return f"source version {source!r} failed"
    return CONVERTER_ERROR


def _original_problems(sample: Sample, row: FileRecord) -> list[str]:
    where = f"{sample.name} (file {row.id})"
    problems = []
    if row.status != "done":
        problems.append(f"{where}: ended {row.status!r} ({row.error}), expected 'done'")
    if sample.kind == "corrupt":
        if not (row.error or "").startswith(f"metadata: {CONVERTER_ERROR}"):
            problems.append(f"{where}: metadata error {row.error!r}, expected the converter's")
    elif row.error is not None:
        problems.append(f"{where}: error {row.error!r} on a valid file")
    elif sample.size is not None:
        seen = (row.metadata.get("width"), row.metadata.get("height"))
        if seen != sample.size:
            problems.append(f"{where}: metadata says {seen}, the image is {sample.size}")
    return problems


async def check_file(
    http: httpx.AsyncClient,
    urls: Sequence[str],
    sample: Sample,
    row: FileRecord,
    versions: Sequence[FileRecord],
    config: FylrConfig,
) -> list[str]:
    """Every violation of one original and its versions (downloads through ``urls``)."""
    where = f"{sample.name} (file {row.id})"
    problems = _original_problems(sample, row)
    if sample.way == "reference":
        problems += _reference_problems(sample, row)
    for url in urls if sample.way != "reference" else ():
        data, problem = await _download(http, url, row.id, "original", row)
        if problem:
            problems.append(f"{where}: original through {url}: {problem}")
        elif data != sample.data:
            problems.append(f"{where}: original through {url} differs from the upload")
    class_name = CLASS_OF_KIND[sample.kind]
    if row.file_class != class_name:
        problems.append(f"{where}: class {row.file_class!r}, expected {class_name!r}")
    promised = dict(config.classes[class_name].versions)
    by_name = {v.version: v for v in versions}
    if set(by_name) != set(promised):
        problems.append(
            f"{where}: versions {sorted(map(str, by_name))}, promised {sorted(promised)}"
        )
    contents: dict[str, bytes] = {"": sample.data}
    for index, name in enumerate(_in_source_order(promised)):
        version = by_name.get(name)
        if version is None:
            continue
        expected = _expected_status(sample, name, promised)
        status = "done" if version.status == "done" else "failed"
        if status != expected:
            problems.append(
                f"{where}: version {name} ended {version.status!r} ({version.error}),"
                f" expected {expected!r}"
            )
            continue
        if status == "failed":
            want = _expected_error(sample, name, promised)
            if not (version.error or "").startswith(want):
                problems.append(f"{where}: version {name} failed with {version.error!r}")
            continue
        url = urls[index % len(urls)]
        data, problem = await _download(http, url, row.id, name, version)
        if problem:
            problems.append(f"{where}: version {name} through {url}: {problem}")
            continue
        contents[name] = data
        recipe = promised[name]
        source = contents.get(recipe.source or "")
        if source is None:
            continue
        invalid = _invalid(recipe, data, source, sample)
        if invalid:
            problems.append(f"{where}: version {name} is invalid: {invalid}")
    return problems


def _reference_problems(sample: Sample, row: FileRecord) -> list[str]:
    """An original left on its remote: nothing stored, its bytes identified as the sample's."""
    where = f"{sample.name} (file {row.id})"
    problems = []
    if row.storage_key is not None:
        problems.append(f"{where}: left on its remote, but stored as {row.storage_key}")
    if (row.size, row.sha256) != (len(sample.data), hashlib.sha256(sample.data).hexdigest()):
        problems.append(f"{where}: identified as {row.size} bytes {row.sha256}, not the sample")
    return problems


def _in_source_order(versions: Mapping[str, VersionConfig]) -> list[str]:
    """Version names, every source before the versions made from it."""
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name in ordered:
            return
        source = versions[name].source
        if source is not None:
            visit(source)
        ordered.append(name)

    for name in sorted(versions):
        visit(name)
    return ordered


async def _download(
    http: httpx.AsyncClient, url: str, file_id: int, name: str, row: FileRecord
) -> tuple[bytes, str | None]:
    """The stored content of ``name`` of ``file_id``, and what is wrong with it, if anything."""
    try:
        response = await http.get(f"{url}/api/v1/eas/download/{file_id}/{name}")
    except httpx.HTTPError as exc:
        return b"", f"cannot download: {type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return b"", f"download answered {response.status_code}"
    data = response.content
    digest = hashlib.sha256(data).hexdigest()
    if row.size != len(data):
        return data, f"{len(data)} bytes downloaded, {row.size} recorded"
    if row.sha256 != digest or response.headers.get("x-content-sha256") != digest:
        return data, f"SHA-256 {digest} downloaded, {row.sha256} recorded"
    return data, None


def _invalid(recipe: VersionConfig, data: bytes, source: bytes, sample: Sample) -> str | None:
    """Why a rendition is not what its recipe promises for this source (None: it is)."""
    if recipe.service == "sha256":
        line = hashlib.sha256(source).hexdigest().encode() + b"  -\n"
        return None if data == line else f"{data[:80]!r} is not the source's checksum line"
    if recipe.service == "gzip":
        try:
            unpacked = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            return f"not gzip data: {exc}"
        return None if unpacked == source else "does not decompress to its source"
    if recipe.service in _PICTURE_SERVICES:
        return _invalid_picture(recipe, data, source, sample)
    return None


def _decoded_size(data: bytes, oriented: bool) -> tuple[str | None, tuple[int, int]]:
    image = Image.open(io.BytesIO(data))
    image.load()
    width, height = image.size
    if oriented and image.getexif().get(0x0112) in (5, 6, 7, 8):
        width, height = height, width
    return image.format, (width, height)


def _invalid_picture(
    recipe: VersionConfig, data: bytes, source: bytes, sample: Sample
) -> str | None:
    fmt = _FORMATS.get(str(recipe.params.get("format", "")).lower())
    box = tuple(int(n) for n in str(recipe.params.get("size", "0x0")).lower().split("x"))
    try:
        found, (width, height) = _decoded_size(data, oriented=False)
        _, (src_w, src_h) = _decoded_size(source, oriented=True)
    except Exception as exc:
        return f"does not decode: {type(exc).__name__}: {exc}"
    if fmt is not None and found != fmt:
        return f"{found} image, {fmt} promised"
    if len(box) != 2 or width > box[0] or height > box[1]:
        return f"{width}x{height} does not fit in {recipe.params.get('size')}"
    if width > src_w or height > src_h:
        return f"{width}x{height} is larger than its {src_w}x{src_h} source"
    if width != min(box[0], src_w) and height != min(box[1], src_h):
        return f"{width}x{height} fills neither side of the box for a {src_w}x{src_h} source"
    assert sample.shown is not None
    shown_w, shown_h = sample.shown
    # one rounding from the source, at most two from the original (a version of a version)
    for ref_w, ref_h, slack, what in (
        (src_w, src_h, 1, "source"),
        (shown_w, shown_h, 2, "upright original"),
    ):
        if abs(width * ref_h - height * ref_w) > slack * max(ref_w, ref_h):
            return f"{width}x{height} does not keep the aspect of its {ref_w}x{ref_h} {what}"
    return None
