"""On-demand renditions: made at request time, streamed into the response, never stored.

``GET /api/v1/eas/download/<id>/custom?preset=NAME`` asks for the rendition a
preset of ``custom_version_presets`` describes; ``…/custom?service=NAME&P=V…``
asks for one with explicit parameters, limited to what the file's class lists
under ``custom_versions`` (:mod:`~trio_broker_daemons.fylr.config`). Either way
:func:`resolve` turns the request into a :class:`Rendition` (service, params,
``Content-Type``, file name, the recipe's limits) or refuses it with the reason
(400).

Theory of operation
===================

The job runs through the broker client as a produce step does (the original
on the in-pipe, the command's stdout on the out-pipe), at the ``synchronous``
priority (:data:`PRIORITY`, 4), with the original's SHA-256 as the job's
``input_hash`` (an execserver's produce cache keys on it). Its output goes to
the HTTP response and nowhere else: no storage key, no file row.

The caller waits, so the job is run under
:func:`~trio_broker.trio.dispatcher.run_on_demand`: what a queued step would
requeue is an answer at once. The response's status is decided as late as it
can be, which is what the *commit buffer* (:data:`COMMIT_BUFFER`) is for:

==========================================================  ====================================
what happened                                               the answer
==========================================================  ====================================
no slot within ``connect_timeout``                          503 with ``Retry-After``
no execserver, or none that offers the service              503 at once, with ``Retry-After``
the command failed before its output passed 4,000 bytes     502 with the receipt's decisive line
(the execserver holds that much back)
the whole output fitted in the commit buffer                200 with ``Content-Length``
the output outgrew the commit buffer                        200, chunked, streamed as it comes
the command failed after the response was committed         the transfer is cut off without its
                                                            final chunk: a broken download, never
                                                            a truncated success
the client went away                                        the job is cancelled (``CANCEL``)
==========================================================  ====================================

``Content-Type`` and ``Content-Disposition`` come from the preset (or the
class's ``custom_versions`` entry), their patterns filled by :func:`resolve`.
Memory per request is the commit buffer plus a chunk in flight: once
committed, each chunk goes to the socket before the next is taken from the
out-pipe, so a slow reader slows the command down.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, cast

import attrs
import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from trio_broker.core import protocol as p
from trio_broker.core.endings import decisive_line, receipt_failure
from trio_broker.trio.dispatcher import OnDemandFailed, run_on_demand
from trio_broker.trio.pipes import OutPipe, Sink
from trio_broker_daemons.fylr.config import (
    FylrConfig,
    ParamValue,
    VersionConfig,
    fill_pattern,
    job_limits,
)
from trio_broker_daemons.fylr.files import FileRow
from trio_broker_daemons.fylr.state import FylrState
from trio_broker_daemons.fylr.worker import FileWorker
from trio_broker_daemons.runtime.logfmt import fields

__all__ = [
    "COMMIT_BUFFER",
    "PRIORITY",
    "Rendition",
    "RenditionRefused",
    "RenditionResponse",
    "job_runner",
    "resolve",
]

log = logging.getLogger("trio_broker_daemons.fylr.renditions")

PRIORITY: Final = 4
"""The ``synchronous`` priority band: a caller waits for the job."""
COMMIT_BUFFER: Final = 64 * 1024
"""Output held back before the response is committed (status 200 sent): a rendition
this small is answered with its ``Content-Length``, and a failure before it with 502."""
_LINK_PARAMETERS: Final = frozenset({"expires", "signature"})
"""A signed link's own query parameters, which the rendition ignores."""
_OCTET_STREAM: Final = "application/octet-stream"


class RenditionRefused(Exception):
    """The request names no rendition this file may have; the text says why (400)."""


@attrs.frozen(kw_only=True)
class Rendition:
    """A rendition to make: the job and the response's labels."""

    name: str
    """The preset's name, or the service's for explicit parameters."""
    service: str
    params: Mapping[str, ParamValue]
    mimetype: str
    filename: str
    limits: Mapping[str, str]
    """The recipe's own ``timeout``/``stall_timeout`` job members."""


def _query_text(value: ParamValue) -> str:
    """How a configured value is written in a query (``true``, ``640x480``, ``90``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _names(row: FileRow) -> dict[str, object]:
    stem, dot, _ = row.filename.rpartition(".")
    return {"filename": row.filename, "stem": stem if dot and stem else row.filename, "id": row.id}


def _single(query: list[tuple[str, str]]) -> dict[str, str]:
    values: dict[str, str] = {}
    for name, value in query:
        if name in _LINK_PARAMETERS:
            continue
        if name in values:
            raise RenditionRefused(f"{name}: given more than once")
        values[name] = value
    return values


def _preset(config: FylrConfig, row: FileRow, query: dict[str, str]) -> Rendition:
    name = query.pop("preset")
    if query:
        raise RenditionRefused(f"unexpected parameters with a preset: {', '.join(sorted(query))}")
    preset = config.custom_version_presets.get(name)
    if preset is None:
        known = ", ".join(sorted(config.custom_version_presets)) or "none configured"
        raise RenditionRefused(f"preset: expected one of {known}, got {name!r}")
    if preset.classes and row.file_class not in preset.classes:
        raise RenditionRefused(
            f"preset: {name!r} is for files of class {', '.join(preset.classes)},"
            f" not {row.file_class!r}"
        )
    values = {**_names(row), "preset": name, **preset.params}
    recipe = VersionConfig(
        service=preset.service, timeout=preset.timeout, stall_timeout=preset.stall_timeout
    )
    return Rendition(
        name=name,
        service=preset.service,
        params=dict(preset.params),
        mimetype=fill_pattern(preset.mimetype or _OCTET_STREAM, values),
        filename=fill_pattern(preset.filename, values),
        limits=job_limits(recipe),
    )


def _explicit(config: FylrConfig, row: FileRow, query: dict[str, str]) -> Rendition:
    service = query.pop("service")
    file_class = config.classes.get(row.file_class or "")
    allowed = file_class.custom_versions if file_class is not None else {}
    custom = allowed.get(service)
    if custom is None:
        known = ", ".join(sorted(allowed)) or "none"
        raise RenditionRefused(
            f"service: files of class {row.file_class!r} allow custom versions of {known},"
            f" got {service!r}"
        )
    unknown = sorted(set(query) - set(custom.params))
    if unknown:
        raise RenditionRefused(
            f"unexpected parameters for {service!r}: {', '.join(unknown)}"
            f" (it takes {', '.join(sorted(custom.params))})"
        )
    params: dict[str, ParamValue] = {}
    for name, choices in custom.params.items():
        if name not in query:
            raise RenditionRefused(f"{name}: required for {service!r}")
        by_text = {_query_text(choice): choice for choice in choices}
        if query[name] not in by_text:
            raise RenditionRefused(
                f"{name}: expected one of {', '.join(by_text)}, got {query[name]!r}"
            )
        params[name] = by_text[query[name]]
    values = {**_names(row), "service": service, **params}
    recipe = VersionConfig(
        service=service, timeout=custom.timeout, stall_timeout=custom.stall_timeout
    )
    return Rendition(
        name=service,
        service=service,
        params=params,
        mimetype=fill_pattern(custom.mimetype or _OCTET_STREAM, values),
        filename=fill_pattern(custom.filename, values),
        limits=job_limits(recipe),
    )


def resolve(config: FylrConfig, row: FileRow, query: list[tuple[str, str]]) -> Rendition:
    """The rendition a request asks for, as this file's class and the presets allow.

    Args:
        config: the fylr's configuration (presets, the classes' ``custom_versions``).
        row: the original.
        query: the request's query parameters (a signed link's are ignored).

    Raises:
        RenditionRefused: neither ``preset`` nor ``service`` is given, or both; an
            unknown preset, one not for this file's class; a service the class
            allows no custom version of, a missing, unknown or repeated parameter,
            a value not listed.
    """
    values = _single(query)
    if "preset" in values and "service" in values:
        raise RenditionRefused("expected preset=NAME or service=NAME, not both")
    if "preset" in values:
        return _preset(config, row, values)
    if "service" in values:
        return _explicit(config, row, values)
    raise RenditionRefused("expected preset=NAME, or service=NAME and its parameters")


# -- the response ----------------------------------------------------------------------

RunJob = Callable[[Sink], Awaitable[tuple[p.Receipt, OutPipe]]]
"""Runs the rendition's job with its stdout into the sink; returns the receipt and
the out-pipe (a bound ``FileWorker.run_piped``)."""


def job_runner(state: FylrState, row: FileRow, rendition: Rendition) -> RunJob:
    """The job of a rendition of ``row``: its stored original in, stdout into the sink."""
    assert row.storage_key is not None

    async def run(sink: Sink) -> tuple[p.Receipt, OutPipe]:
        return await FileWorker(state).run_piped(
            rendition.service,
            rendition.params,
            limits={**rendition.limits, **({"input_hash": row.sha256} if row.sha256 else {})},
            source_key=cast(str, row.storage_key),
            sink=sink,
            priority=PRIORITY,
            subject=f"{row.filename} #{row.id} custom {rendition.name}",
        )

    return run


def _json_body(status: int, error: str, retry_after: float | None) -> tuple[int, list[Any], bytes]:
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(retry_after))).encode()))
    return status, headers, body


class RenditionResponse(Response):
    """The ASGI response of one on-demand rendition (the module docstring's table).

    Args:
        rendition: what to make and how to label it.
        run_job: runs the job (see :data:`RunJob`).
        retry_after: the ``Retry-After`` of a 503 without a hint of its own.
        commit_buffer: output held back before the status is committed.
    """

    def __init__(
        self,
        rendition: Rendition,
        run_job: RunJob,
        *,
        retry_after: float,
        commit_buffer: int = COMMIT_BUFFER,
    ) -> None:
        super().__init__()
        self.rendition = rendition
        self.run_job = run_job
        self.retry_after = retry_after
        self.commit_buffer = commit_buffer
        self.outcome: str | None = None
        """How the response ended (``ok``, ``aborted``, ``disconnected``, or the status)."""

    def _labels(self, length: int | None) -> list[tuple[bytes, bytes]]:
        quoted = urllib.parse.quote(self.rendition.filename, safe="")
        headers = [
            (b"content-type", self.rendition.mimetype.encode("latin-1", "replace")),
            (b"content-disposition", f"attachment; filename*=UTF-8''{quoted}".encode()),
            (b"cache-control", b"no-store"),
        ]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        return headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        send_chunk, chunks = trio.open_memory_channel[bytes](0)
        ended: list[tuple[p.Receipt, OutPipe] | OnDemandFailed] = []

        async def job() -> None:
            async with send_chunk:
                try:
                    ended.append(await run_on_demand(lambda: self.run_job(send_chunk.send)))
                except OnDemandFailed as exc:
                    ended.append(exc)

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.outcome = self.outcome or "disconnected"
            nursery.cancel_scope.cancel()  # the job's task is cancelled: the client CANCELs it

        async with chunks, trio.open_nursery() as nursery:
            nursery.start_soon(job)
            nursery.start_soon(watch_disconnect)
            await self._respond(chunks, ended, send)
            nursery.cancel_scope.cancel()
        log.info(
            "on-demand rendition",
            extra=fields(rendition=self.rendition.name, outcome=self.outcome),
        )

    async def _respond(
        self,
        chunks: trio.MemoryReceiveChannel[bytes],
        ended: list[tuple[p.Receipt, OutPipe] | OnDemandFailed],
        send: Send,
    ) -> None:
        held: list[bytes] = []
        size = 0
        committed = False
        async for chunk in chunks:
            if committed:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                continue
            held.append(chunk)
            size += len(chunk)
            if size > self.commit_buffer:
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self._labels(None)}
                )
                await send(
                    {"type": "http.response.body", "body": b"".join(held), "more_body": True}
                )
                held.clear()
                committed = True
        error = self._error(ended[0])
        if error is None:
            if committed:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                start = {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": self._labels(size),
                }
                await send(start)
                await send({"type": "http.response.body", "body": b"".join(held)})
            self.outcome = "ok"
        elif committed:
            self.outcome = "aborted"  # returning without the final chunk drops the connection
        else:
            status, headers, body = error
            self.outcome = str(status)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

    def _error(
        self, ended: tuple[p.Receipt, OutPipe] | OnDemandFailed
    ) -> tuple[int, list[Any], bytes] | None:
        if isinstance(ended, OnDemandFailed):
            answer = ended.answer
            if answer.status == 503:
                retry = answer.retry_after if answer.retry_after is not None else self.retry_after
                return _json_body(503, answer.error, retry)
            return _json_body(answer.status, answer.error, None)
        receipt, stdout = ended
        failure = receipt_failure(receipt, stdout=stdout.state, what="the rendition")
        if failure is None:
            return None
        line = decisive_line(receipt) if receipt.status != "ok" else str(failure)
        return _json_body(502, line, None)
