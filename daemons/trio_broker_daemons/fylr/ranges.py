"""Ranged and conditional downloads of stored files: ``Range``, ``ETag``, ``If-None-Match``.

Pure HTTP logic for the download routes, no I/O: the handler asks
:func:`plan_download` what to answer for a stored file of a known size and hash,
then opens and streams what the plan says.

* **ETag.** A stored file's tag is its content SHA-256 in quotes (a strong
  validator: the same bytes, the same tag, on every fylr). A file without a
  recorded hash has none, and is never answered 304 or 206-by-tag.
* **If-None-Match** (a list of tags, or ``*``) naming the file's tag: 304 with
  the tag and no body. Weak comparison, as RFC 9110 asks for this header.
* **Range.** One ``bytes=`` range (``first-last``, ``first-``, ``-suffix``) within
  the file: 206 with ``Content-Range``. A range wholly beyond the end: 416 with
  ``Content-Range: bytes */size``. Several ranges, another unit or a malformed
  header: the header is ignored and the whole file is sent (200), as RFC 9110
  allows. ``If-Range`` with a tag other than the file's sends the whole file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final, Literal

import attrs

__all__ = ["DownloadPlan", "etag_of", "plan_download"]

_RANGE: Final = re.compile(r"bytes=(\d*)-(\d*)")


def etag_of(sha256: str | None) -> str | None:
    """The strong ``ETag`` of a stored file: its SHA-256 in quotes; ``None`` without one."""
    return None if not sha256 else f'"{sha256}"'


@attrs.frozen(kw_only=True)
class DownloadPlan:
    """What to answer for a download request.

    Attributes:
        status: 200 (the whole file), 206 (a part), 304 (not modified), 416 (no such part).
        start, length: the bytes to send (the whole file for 200; none for 304/416).
        headers: ``ETag``, ``Accept-Ranges``, ``Content-Range``, ``Content-Length``.
    """

    status: Literal[200, 206, 304, 416]
    start: int = 0
    length: int = 0
    headers: Mapping[str, str] = attrs.field(factory=dict)


def _tags(header: str) -> set[str]:
    return {tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()}


def _one_range(header: str, size: int) -> tuple[int, int] | Literal["unsatisfiable"] | None:
    """``(start, length)`` of a single ``bytes=`` range; ``None`` to ignore the header."""
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if not first:
        if not last:
            return None
        suffix = int(last)
        if suffix == 0:
            return "unsatisfiable"
        return max(0, size - suffix), min(suffix, size)
    start = int(first)
    if last and int(last) < start:
        return None  # invalid: ignored
    if start >= size:
        return "unsatisfiable"
    end = size - 1 if not last else int(last)
    return start, min(end, size - 1) - start + 1


def plan_download(size: int, sha256: str | None, request: Mapping[str, str]) -> DownloadPlan:
    """What to answer for a download of a stored file.

    Args:
        size: the file's length in bytes.
        sha256: its content hash, if recorded (the ``ETag``).
        request: the request's headers (lower-case names).

    Returns:
        The plan (see :class:`DownloadPlan` and the module docstring).
    """
    tag = etag_of(sha256)
    base = {"accept-ranges": "bytes", **({"etag": tag} if tag else {})}
    if tag is not None and "if-none-match" in request:
        tags = _tags(request["if-none-match"])
        if "*" in tags or tag in tags:
            return DownloadPlan(status=304, headers=base)
    whole = DownloadPlan(status=200, length=size, headers={**base, "content-length": str(size)})
    header = request.get("range")
    if header is None:
        return whole
    if_range = request.get("if-range")
    if if_range is not None and (tag is None or if_range.strip() != tag):
        return whole
    found = _one_range(header, size)
    if found is None:
        return whole
    if found == "unsatisfiable":
        return DownloadPlan(status=416, headers={**base, "content-range": f"bytes */{size}"})
    start, length = found
    return DownloadPlan(
        status=206,
        start=start,
        length=length,
        headers={
            **base,
            "content-range": f"bytes {start}-{start + length - 1}/{size}",
            "content-length": str(length),
        },
    )
