"""One HTTP listener per process: an ASGI app on hypercorn's trio worker.

The execserver, the fylr and a library client's pipe endpoints all serve this
way; :func:`listener_config` holds the settings they share and :func:`serve_app`
runs the app and reports the address it bound.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

__all__ = ["listener_config", "serve_app"]


def listener_config(listen: str, *, logger: str = "trio_broker.http") -> HypercornConfig:
    """Hypercorn settings for one listener on ``listen`` (``host:port``, port 0: any).

    No access log; hypercorn's own messages go to ``logger`` (our handlers, our
    level); a short graceful stop; idle keep-alive connections kept 75 s.
    """
    hyper = HypercornConfig()
    hyper.bind = [listen]
    hyper.accesslog = None
    hyper.errorlog = logging.getLogger(logger)
    hyper.graceful_timeout = 1.0
    hyper.keep_alive_timeout = 75.0
    return hyper


async def serve_app(
    app: object,
    hyper: HypercornConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled or until ``shutdown_trigger`` returns.

    Binds first, then reports ``(host, port)`` through ``task_status.started()``
    (an IPv6 host without brackets).
    """
    serve = functools.partial(
        hypercorn_serve, cast(Any, app), hyper, shutdown_trigger=shutdown_trigger
    )
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(serve)
        host, _, port = binds[0].split("://", 1)[1].rpartition(":")
        task_status.started((host.strip("[]"), int(port)))
