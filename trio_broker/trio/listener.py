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

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

__all__ = ["ListenerSettings", "listener_config", "serve_app"]


@attrs.frozen(kw_only=True)
class ListenerSettings:
    """Where a service listens, and with which TLS files.

    Attributes:
        listen: ``host:port`` (``[::1]:7000`` for IPv6; port 0 picks a free one).
        certfile, keyfile: PEM files; when set the listener serves https/wss.
    """

    listen: str = "127.0.0.1:0"
    certfile: str | None = None
    keyfile: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("certfile and keyfile go together: give both or neither")


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
