"""The chaos soak's remote sources: a file server on loopback that answers badly on purpose.

The samples the workload registers by URL (``PUT /eas/rput``: copied in, or
left on their remote) are served by :func:`open_remote_files`, a real HTTP
server on ``127.0.0.1`` (:mod:`tests.support.remote`), which the fylrs'
configuration lets through the blocklist. Each request for a sample is
answered, by a draw from the run's seed in the order the requests arrive:

- ``503`` with ``Retry-After: 1`` (:data:`UNAVAILABLE` of them);
- a dropped connection, or a body cut in the middle (:data:`BROKEN`);
- else the sample's bytes.

Every fault is temporary for the fylr, so every file still ends as promised;
the figures say how often the server was unkind (:class:`RemoteFigures`).
"""

from __future__ import annotations

import collections
import contextlib
import random
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Final, Literal

import attrs
import trio

from tests.chaos.samples import Sample
from tests.support.remote import RemoteServer, Reply, answer, open_listener, serve_remote

__all__ = ["BROKEN", "UNAVAILABLE", "RemoteFigures", "RemoteFiles", "open_remote_files"]

UNAVAILABLE: Final = 0.2
"""The share of requests answered 503."""
BROKEN: Final = 0.15
"""The share of requests whose connection is dropped or cut."""


@attrs.define
class RemoteFigures:
    """What the remote server did, by kind of answer (``file``, ``503``, ``drop``, ``cut``)."""

    answers: collections.Counter[str] = attrs.field(factory=collections.Counter)

    def describe(self) -> str:
        """``120 requests: 80 files, 22 × 503, 10 dropped, 8 cut``."""
        a = self.answers
        return (
            f"{sum(a.values())} requests: {a['file']} files, {a['503']} × 503,"
            f" {a['drop']} dropped, {a['cut']} cut"
        )


@attrs.frozen
class RemoteFiles:
    """The running server: where each sample is, and its figures."""

    base: str
    figures: RemoteFigures

    def url(self, sample: Sample) -> str:
        """The URL the sample is registered with."""
        return f"{self.base}/samples/{urllib.parse.quote(sample.name)}"


def _chooser(
    samples: Sequence[Sample], rng: random.Random, figures: RemoteFigures
) -> Callable[[str], Reply | None]:
    files = {f"/samples/{urllib.parse.quote(s.name)}": s.data for s in samples}

    def choose(path: str) -> Reply | None:
        data = files.get(path)
        if data is None:
            return None  # not a sample: 404
        roll = rng.random()
        if roll < UNAVAILABLE:
            figures.answers["503"] += 1
            return answer(b"busy\n", 503, retry_after="1")
        if roll < UNAVAILABLE + BROKEN:
            fault: Literal["drop", "cut"] = "drop" if rng.random() < 0.5 else "cut"
            figures.answers[fault] += 1
            return Reply(body=data, fault=fault)
        figures.answers["file"] += 1
        return answer(data)

    return choose


@contextlib.asynccontextmanager
async def open_remote_files(samples: Sequence[Sample], seed: int) -> AsyncIterator[RemoteFiles]:
    """Serve ``samples`` on ``127.0.0.1`` with the faults of the module docstring."""
    figures = RemoteFigures()
    server = RemoteServer(chooser=_chooser(samples, random.Random(f"chaos-remote-{seed}"), figures))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_remote, await open_listener("127.0.0.1"), server)
        try:
            yield RemoteFiles(base=f"http://127.0.0.1:{port}", figures=figures)
        finally:
            nursery.cancel_scope.cancel()
