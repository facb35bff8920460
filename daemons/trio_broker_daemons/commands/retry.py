"""How the client commands repeat a request the fylr could not answer now.

A fylr answers 503 while its database is unavailable (or it is stopping, or its
storage failed), and it cannot be reached at all while it restarts (connection
refused, a connection dropped before its answer). Either way the request is
repeated, at most :data:`RETRIES` times in a row, after the answer's
``Retry-After`` (at most :data:`RETRY_AFTER_MAX` seconds) or else an exponential
back-off (:func:`retry_delay`): ``trio-broker upload --wait`` and ``trio-broker
position`` follow a file through a fylr restart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import httpx
import trio

__all__ = [
    "BACKOFF_FIRST",
    "RETRIES",
    "RETRY_AFTER_MAX",
    "RETRY_STATUSES",
    "get_retrying",
    "retry_delay",
]

RETRIES: Final = 8
"""How often one request is repeated after a 503 answer or a connection error."""
RETRY_AFTER_MAX: Final = 60.0
"""The longest wait before a repeat, whatever ``Retry-After`` asks."""
BACKOFF_FIRST: Final = 0.5
"""The first back-off without ``Retry-After``, doubled for every further attempt."""
RETRY_STATUSES: Final = frozenset({503})


def retry_delay(attempt: int, retry_after: str | None) -> float:
    """Seconds to wait before repeating a request that was answered 503 (or not at all).

    Args:
        attempt: how many repeats were made before this one (0 for the first).
        retry_after: the answer's ``Retry-After`` header, if any (seconds; an
            HTTP date or anything else unreadable is ignored).

    Returns:
        ``Retry-After`` when given, else ``BACKOFF_FIRST × 2^attempt``; never
        more than :data:`RETRY_AFTER_MAX`.
    """
    if retry_after is not None and retry_after.strip().isdigit():
        return min(float(retry_after.strip()), RETRY_AFTER_MAX)
    return min(BACKOFF_FIRST * 2.0 ** max(0, attempt), RETRY_AFTER_MAX)


async def get_retrying(
    http: httpx.AsyncClient,
    url: str,
    *,
    params: Mapping[str, str] | None = None,
    timeout: float,  # noqa: ASYNC109 (the request's own timeout, passed to httpx)
    retries: int = RETRIES,
) -> httpx.Response:
    """``GET url``, repeated after a 503 answer or a connection error (module docstring).

    Returns:
        The first answer that is not 503, or the last 503 once ``retries`` repeats
        were made.

    Raises:
        httpx.TransportError: the fylr could still not be reached after ``retries``
            repeats.
    """
    attempt = 0
    while True:
        try:
            response = await http.get(url, params=params, timeout=timeout)
        except httpx.TransportError:
            if attempt >= retries:
                raise
            await trio.sleep(retry_delay(attempt, None))
        else:
            if response.status_code not in RETRY_STATUSES or attempt >= retries:
                return response
            await trio.sleep(retry_delay(attempt, response.headers.get("retry-after")))
        attempt += 1
