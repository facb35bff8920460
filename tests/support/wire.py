"""A small protocol client for tests: real websockets, typed frames, bounded waits."""

from __future__ import annotations

import os
import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_websocket import WebSocketConnection, open_websocket_url

from trio_broker.core import protocol as p
from trio_broker.trio.execserver import ExecserverHandle

M = TypeVar("M", bound=p.Message)

WAIT = 30.0
"""Generous bound for anything a test waits on (2-core machines are noisy)."""


class Peer:
    """One broker connection as a client sees it."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.hellos: list[p.Hello] = []

    async def send(self, message: p.Message | str | bytes) -> None:
        if isinstance(message, str | bytes):
            await self.ws.send_message(message)
        else:
            await self.ws.send_message(p.encode(message))

    async def recv(self, *, skip_hello: bool = True, within: float = WAIT) -> p.Message:
        """The next frame; PINGs are answered and HELLOs recorded on the way."""
        with trio.fail_after(within):
            while True:
                message = p.decode(await self.ws.get_message(), accept=p.EXEC_TO_CLIENT)
                if isinstance(message, p.Ping):
                    await self.send(p.Pong(nonce=message.nonce))
                    continue
                if isinstance(message, p.Hello):
                    self.hellos.append(message)
                    if skip_hello:
                        continue
                return message

    async def expect(self, cls: type[M], *, within: float = WAIT) -> M:
        message = await self.recv(within=within)
        assert isinstance(message, cls), f"expected {cls.__name__}, got {message!r}"
        return message

    async def expect_error(self, code: str, job_id: str | None = None) -> p.Error:
        error = await self.expect(p.Error)
        assert (error.code, error.job_id) == (code, job_id), error
        return error

    async def register(self, backend_id: str = "test", callback_url: str | None = None) -> None:
        await self.send(
            p.Register(backend_id=backend_id, name="tests", version="1", callback_url=callback_url)
        )

    async def want(self, job_id: str, service: str, priority: int = 0) -> p.Offer | p.Queued:
        await self.send(p.Want(job_id=job_id, service=service, priority=priority))
        answer = await self.recv()
        assert isinstance(answer, p.Offer | p.Queued), answer
        assert answer.job_id == job_id
        return answer

    async def run(
        self, offer: p.Offer, service: str, params: Mapping[str, Any] | None = None
    ) -> None:
        await self.send(
            p.Job(
                job_id=offer.job_id,
                token=offer.token,
                service=service,
                subject="test",
                job={"params": dict(params or {})},
            )
        )

    async def done(self, job_id: str | None = None) -> p.Done:
        done = await self.expect(p.Done)
        if job_id is not None:
            assert done.job_id == job_id, done
        return done


@asynccontextmanager
async def connect(
    target: ExecserverHandle | str,
    *,
    register: bool = True,
    headers: list[tuple[str, str]] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    path: str = "/broker",
) -> AsyncIterator[Peer]:
    """A registered (by default) connection to an execserver's ``/broker``, HELLO read."""
    url = (target if isinstance(target, str) else target.url).replace("/broker", path)
    extra = [(k.encode(), v.encode()) for k, v in headers] if headers else None
    async with open_websocket_url(
        url, extra_headers=extra, ssl_context=ssl_context, message_queue_size=0
    ) as ws:
        try:
            peer = Peer(ws)
            hello = await peer.recv(skip_hello=False)
            assert isinstance(hello, p.Hello), hello
            if register:
                await peer.register()
            yield peer
        finally:
            # trio-websocket 0.12 leaves the TCP stream open when the server closed
            # first (aclose() returns early): close it, or it leaks a socket.
            await ws.aclose()
            await ws._stream.aclose()


def execserver_config(**overrides: Any) -> ExecserverConfig:
    """A test execserver on a free loopback port with a few handy services.

    Its jobs run as the session's ``TRIO_BROKER_JOB_USER`` (tests/conftest.py: root
    when the tests run as root): they talk to the tests through files in the
    tests' own folders.
    """
    data: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "name": "test-exec",
        "job_user": os.environ.get("TRIO_BROKER_JOB_USER"),
        "slots": 2,
        "fast_reserve": 0,
        "unknown_share": 1.0,
        "memory_budget": "auto",
        "services": {
            "noop": {"builtin": "noop"},
            "hold": {"builtin": "sleep"},
            "echo": {"argv": ["echo", "{text}"]},
        },
    }
    data.update(overrides)
    return ExecserverConfig.from_mapping(data)


async def start_execserver(
    nursery: trio.Nursery, config: ExecserverConfig | None = None, **overrides: Any
) -> ExecserverHandle:
    handle: ExecserverHandle = await nursery.start(
        serve_from_config, config or execserver_config(**overrides)
    )
    return handle
