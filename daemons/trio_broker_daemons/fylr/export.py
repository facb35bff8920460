"""Exporting a file: its original and its metadata document, as one tar stream.

``GET /api/v1/eas/export/<id>`` answers an uncompressed POSIX tar archive of two
members, streamed (nothing is assembled in memory or on disk):

* ``<id>/document.json``: the file's document, as ``GET /api/v1/eas/<id>`` has it;
* ``<id>/<file name>``: the stored original (the uploaded name without folders).

A file may be exported once its metadata is known: in the states
:data:`EXPORTABLE_STATES` (``sync``, ``produce``: the API's ``sync``, and
``done``). Before that (``new``, ``metadata``) or after a failure (``error``) the
answer is 409 with the file's state. The published file worker also names a
``pending_checksum`` state here; this fylr has none, since it hashes an upload
while storing it.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

from trio_broker_daemons.fylr.files import FileRow
from trio_broker_daemons.fylr.produce import FileState
from trio_broker_daemons.fylr.storage import FileReader

__all__ = ["EXPORTABLE_STATES", "export_name", "export_refusal", "tar_stream"]

EXPORTABLE_STATES: Final[frozenset[FileState]] = frozenset({"sync", "produce", "done"})
"""The internal states in which an original may be exported."""
_BLOCK: Final = 512


def export_refusal(row: FileRow) -> dict[str, Any] | None:
    """The 409 body for a file that may not be exported yet, ``None`` when it may."""
    if row.status in EXPORTABLE_STATES:
        return None
    allowed = "sync, produce or done"
    return {
        "error": f"the file is in state {row.status}; it can be exported in {allowed}",
        "state": row.status,
    }


def export_name(row: FileRow) -> str:
    """The archive member name of the original: the uploaded name without folders."""
    name = posixpath.basename(row.filename.replace("\\", "/"))
    return name if name not in ("", ".", "..", "document.json") else "original"


def _header(name: str, size: int, mtime: float) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = int(mtime)
    info.mode = 0o644
    return info.tobuf(format=tarfile.PAX_FORMAT)


def _padding(size: int) -> bytes:
    return b"\0" * (-size % _BLOCK)


async def tar_stream(
    row: FileRow, document: Mapping[str, Any], reader: FileReader
) -> AsyncIterator[bytes]:
    """The archive, chunk by chunk; the original is read from ``reader`` (closed at the end).

    Raises:
        OSError: the original shrank while it was read (the archive would lie).
    """
    mtime = row.updated_at.timestamp()
    body = json.dumps(document, indent=2, sort_keys=True).encode() + b"\n"
    yield _header(f"{row.id}/document.json", len(body), mtime) + body + _padding(len(body))
    yield _header(f"{row.id}/{export_name(row)}", reader.size, mtime)
    sent = 0
    async with reader:
        async for chunk in reader:
            sent += len(chunk)
            yield chunk
    if sent != reader.size:
        raise OSError(f"the original changed while it was exported ({sent} of {reader.size} bytes)")
    yield _padding(sent) + b"\0" * (2 * _BLOCK)
