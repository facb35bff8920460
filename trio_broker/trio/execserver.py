"""The execserver on trio: the broker core on a websocket, a runner for its jobs.

:func:`serve_execserver` runs one HTTP listener (hypercorn, trio worker) with a
small starlette app:

``GET /broker``
    the broker websocket of the protocol, carried by the shared
    :class:`~trio_broker.trio.driver.CoreDriver` (one reader and one writer per
    connection, a bounded outbox). The listener hands the upgrade's raw stream
    to :meth:`_Service.broker_websocket` (wsproto on the trio stream, frames that
    leave together written at once: see :mod:`trio_broker.trio.listener`); an
    upgrade that reaches the ASGI app all the same (a second request on a
    kept-alive connection) is served through :class:`_AsgiWebsocket`.
``GET /livez``, ``GET /readyz``, ``GET /healthz``, ``GET /``
    liveness (200 while it works, draining too), readiness (503 while it
    drains; ``/healthz`` is the same) and the route index
    (:mod:`trio_broker.trio.pages`).
``GET /inspect/system/execserver``
    JSON: the pool, the reserve, each service, each connection, recent receipts
    (:func:`~trio_broker.trio.inspection.execserver_document`).
``GET /metrics``
    the same figures as Prometheus text
    (:func:`~trio_broker.trio.inspection.execserver_metrics`).

With a broker token, ``/broker``, ``/inspect/system/execserver`` and
``/metrics`` need ``Authorization: Bearer <token>``; the health pages and the
index never do (probes carry no secrets). A request or upgrade with several
``Authorization`` headers is refused with 400 on every route, token or not
(:func:`~trio_broker.trio.pages.one_authorization`).

Every ended job is logged as one line (``job ended``) with structured fields
(``extra``): ``service``, ``job_id``, ``subject``, ``client`` (the connection's
``REGISTER.name``), ``status``, ``wait_s``, ``duration_s``, ``peak_memory`` and
``delivered``; a formatter that shows record attributes (the daemons' logfmt
and JSON) prints them.

Everything that decides lives in the core. This module feeds it the inputs the
driver does not (a job's end, a callback check's result, draining) with
``now = trio.current_time()`` (so a ``MockClock`` drives every timeout), and
carries out its effects: :class:`~trio_broker.core.broker.StartJob` and
:class:`~trio_broker.core.broker.AbortJob` on the runner, closing connections,
checking callbacks, and closing every connection once drained.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import assert_never

import h11
import httpx
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from trio_broker.core import protocol as p
from trio_broker.core.broker import (
    AbortJob,
    Broker,
    BrokerConfig,
    CheckCallback,
    CloseConnection,
    Drained,
    Effect,
    StartJob,
)
from trio_broker.core.job import error_receipt
from trio_broker.trio import tracing
from trio_broker.trio.driver import CLOSE_TIMEOUT, MAX_FRAME_BYTES, CoreDriver
from trio_broker.trio.inspection import (
    METRICS_CONTENT_TYPE,
    ExecserverStatistics,
    JobFigures,
    execserver_document,
    execserver_metrics,
)
from trio_broker.trio.listener import ListenerSettings, listener_config, serve_app
from trio_broker.trio.pages import (
    SEVERAL_AUTHORIZATIONS,
    Page,
    authorization_of,
    bearer_matches,
    bearer_required,
    deny,
    health_pages,
    one_authorization,
    routes_of,
)
from trio_broker.trio.runner import (
    JobControl,
    JobRequest,
    ReportingRunner,
    Runner,
)
from trio_broker.trio.websocket import accept, refuse

CALLBACK_CHECK_TIMEOUT = 5.0
"""Seconds the whole callback check (connect, request, answer) may take."""

__all__ = [
    "ExecserverHandle",
    "serve_execserver",
]

log = logging.getLogger("trio_broker.trio.execserver")

DEFAULT_MAX_FRAME_BYTES = MAX_FRAME_BYTES


class _AsgiWebsocket:
    """The ``/broker`` websocket as a driver :class:`~trio_broker.trio.driver.Transport`.

    It talks ASGI directly rather than through starlette's ``WebSocket``: every
    frame of every connection goes through here, and the wrappers cost more
    than the broker core itself.
    """

    __slots__ = ("_closed", "_receive", "_send")

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        self._closed = False

    async def send_texts(self, texts: Sequence[str]) -> None:
        try:
            for text in texts:  # ASGI has no way to send several at once
                await self._send({"type": "websocket.send", "text": text})
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise trio.BrokenResourceError("the peer is gone") from exc

    async def receive(self) -> str | bytes | None:
        message = await self._receive()
        if message["type"] != "websocket.receive":
            self._closed = True  # websocket.disconnect: nothing may be sent any more
            return None
        text: str | None = message.get("text")
        if text is not None:
            return text
        data: bytes = message.get("bytes") or b""
        return data

    async def close(self, code: int, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        # the peer may already be gone, or the socket already closing
        with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            await self._send({"type": "websocket.close", "code": code, "reason": reason})


class ExecserverHandle:
    """What :func:`serve_execserver` hands to ``task_status.started()``.

    Attributes:
        host, port: where the listener is bound (the real port when 0 was asked).
        url: ``ws://host:port/broker`` (``wss://`` with TLS).
        http_url: ``http://host:port`` (``https://`` with TLS).
    """

    def __init__(self, service: _Service, host: str, port: int, secure: bool) -> None:
        self._service = service
        self.host = host
        self.port = port
        scheme = "wss" if secure else "ws"
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{scheme}://{shown}:{port}/broker"
        self.http_url = f"{'https' if secure else 'http'}://{shown}:{port}"

    @property
    def broker(self) -> Broker:
        """The core (read-only use: its state, its statistics)."""
        return self._service.core

    def drain(self) -> None:
        """Begin draining (what SIGTERM does): finish running jobs, then exit."""
        self._service.drain()

    def stop(self) -> None:
        """Stop now (a second signal): running jobs end with status ``stopped``."""
        self._service.stop()

    def statistics(self) -> ExecserverStatistics:
        """A frozen snapshot of the broker core and, when it keeps them, the runner.

        :func:`~trio_broker.trio.inspection.execserver_document` turns it into the
        ``/inspect/system/execserver`` document.
        """
        return self._service.statistics()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; it is re-checked after every core input."""
        await self._service.driver.wait_until(predicate)

    async def wait_closed(self) -> None:
        """Wait until draining finished and every connection was closed."""
        await self._service.closed.wait()


class _Service:
    """The trio side of one execserver: connections (through the driver), jobs."""

    def __init__(
        self,
        core: Broker,
        runner: Runner,
        *,
        broker_token: str | None,
        max_frame_bytes: int,
        http: httpx.AsyncClient,
        nursery: trio.Nursery,
    ) -> None:
        self.core = core
        self.runner = runner
        self.broker_token = broker_token
        self.max_frame_bytes = max_frame_bytes
        self.http = http
        self.nursery = nursery
        self.driver = CoreDriver[Effect](
            core, self._apply, closed=core.close_connection, max_frame_bytes=max_frame_bytes
        )
        self.controls: dict[int, JobControl] = {}
        self.figures = JobFigures()
        self.drained = trio.Event()
        self.closed = trio.Event()

    # -- the core's effects -------------------------------------------------------------

    def _apply(self, effect: Effect) -> None:
        match effect:
            case StartJob():
                self.controls[effect.run_id] = JobControl()
                self.nursery.start_soon(self._run_job, effect)
            case AbortJob():
                control = self.controls.get(effect.run_id)
                if control is not None:
                    control.abort(effect.status, effect.reason)
            case CloseConnection():
                log.info("closing connection %d: %s", effect.conn, effect.reason)
                self.driver.close(effect.conn, effect.code, effect.reason)
            case CheckCallback():
                self.nursery.start_soon(self._check_callback, effect)
            case Drained():
                connections = self.driver.connections
                log.info("drained: closing %d connections", len(connections))
                for conn_id in connections:
                    self.driver.close(
                        conn_id, p.CLOSE_GOING_AWAY, "the execserver is shutting down"
                    )
                self.drained.set()
            case _:
                assert_never(effect)

    def drain(self) -> None:
        log.info("draining")
        self.core.drain(now=trio.current_time())
        self.driver.flush()

    def stop(self) -> None:
        log.info("stopping: running jobs end now")
        self.core.stop(now=trio.current_time())
        self.driver.flush()

    def statistics(self) -> ExecserverStatistics:
        runner = self.runner
        return ExecserverStatistics(
            broker=self.core.statistics(),
            runner=runner.statistics() if isinstance(runner, ReportingRunner) else None,
            jobs=self.figures.statistics(),
        )

    # -- tasks ----------------------------------------------------------------------

    async def _run_job(self, effect: StartJob) -> None:
        attributes = {
            "trio_broker.service": effect.service,
            "trio_broker.job_id": effect.job_id,
            "trio_broker.subject": effect.subject,
            "trio_broker.instance": self.core.config.name,
        }
        # the job's span joins the caller's trace through JOB.traceparent
        with tracing.span(
            "trio_broker.job",
            traceparent=effect.traceparent,
            remote=True,
            kind="server",
            attributes=attributes,
        ) as opened:
            receipt = await self._run_runner(effect)
            tracing.set_attributes(
                opened,
                {
                    "trio_broker.status": receipt.status,
                    "trio_broker.exit_code": receipt.exit_code,
                    "trio_broker.duration_s": receipt.duration_s,
                },
            )
            if receipt.status != "ok":
                tracing.set_error(opened, receipt.error or receipt.status)
        self._job_ended(effect, receipt)

    async def _run_runner(self, effect: StartJob) -> p.Receipt:
        control = self.controls[effect.run_id]
        request = JobRequest(
            job_id=effect.job_id, service=effect.service, subject=effect.subject, job=effect.job
        )
        started = trio.current_time()
        try:
            return await self.runner.run(request, control)
        except Exception as exc:
            log.exception("the runner failed on job %r", effect.job_id)
            return error_receipt(
                f"the runner failed: {type(exc).__name__}: {exc}",
                started_at=0.0,
                duration_s=trio.current_time() - started,
                instance_id="",
            )
        finally:
            del self.controls[effect.run_id]

    def _job_ended(self, effect: StartJob, receipt: p.Receipt) -> None:
        finished = self.core.job_ended(effect.run_id, receipt, now=trio.current_time())
        self.driver.flush()
        self.figures.record(finished)
        log.info(
            "job %s (%s) ended %s",
            finished.job_id,
            finished.service,
            receipt.status,
            extra={
                "service": finished.service,
                "job_id": finished.job_id,
                "subject": finished.subject,
                "client": finished.client,
                "status": receipt.status,
                "wait_s": round(finished.wait_s, 6),
                "duration_s": round(receipt.duration_s, 6),
                "peak_memory": receipt.peak_memory,
                "delivered": finished.delivered,
            },
        )

    async def _check_callback(self, effect: CheckCallback) -> None:
        url = effect.url.rstrip("/") + "/whoami"
        result = f"failed: {url}: no answer within {CALLBACK_CHECK_TIMEOUT:g}s"
        # one bound on the whole check (httpx's timeout applies to each phase)
        with trio.move_on_after(CALLBACK_CHECK_TIMEOUT):
            result = await self._whoami(url, effect.backend_id)
        if result != "ok":
            log.warning("callback check of connection %d: %s", effect.conn, result)
        self.core.callback_checked(effect.conn, result, now=trio.current_time())
        self.driver.flush()

    async def _whoami(self, url: str, backend_id: str) -> str:
        """``ok``, or what is wrong with the answer of ``url`` (never raises)."""
        try:
            response = await self.http.get(url)
            response.raise_for_status()
            answer = response.json()
        # InvalidURL is not an HTTPError: a callback_url the client made up must not
        # escape this task, which would stop the execserver
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
            return f"failed: {url}: {type(exc).__name__}: {exc}"
        seen = answer.get("backend_id") if isinstance(answer, dict) else None
        if seen == backend_id:
            return "ok"
        return (
            f"mismatch: {url} answered backend_id {seen!r}, "
            f"not {backend_id!r} (a balancer in front of several clients?)"
        )

    # -- the websocket endpoint ----------------------------------------------------------

    def authorized(self, authorization: str) -> bool:
        """Whether an ``Authorization`` value carries the broker token (constant time)."""
        return bearer_matches(authorization, self.broker_token)

    async def broker_websocket(
        self, stream: trio.abc.Stream, head: bytes, request: h11.Request
    ) -> None:
        """The ``/broker`` websocket on the raw stream the listener hands over."""
        authorization = authorization_of(request.headers)
        if authorization is None:
            await refuse(stream, head, 400, SEVERAL_AUTHORIZATIONS.encode(), [])
            return
        if not self.authorized(authorization):
            await refuse(
                stream,
                head,
                401,
                b"a broker token is required\n",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        ws = await accept(stream, head, max_message_bytes=self.max_frame_bytes)
        if ws is None:
            return
        try:
            transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
            assert isinstance(transport, trio.SocketStream)
            host, port = transport.socket.getsockname()[:2]
            addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            conn_id = self.core.open_connection(addr, now=trio.current_time())
            await self.driver.serve(conn_id, ws)
        finally:
            # a connection that ended without a close the core asked for (the peer
            # left, or the execserver is stopping): nothing, or 1001
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                await ws.close(p.CLOSE_GOING_AWAY, "the execserver is shutting down")

    async def broker_endpoint(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ``/broker`` websocket, as a plain ASGI application."""
        # one Authorization header: the application's one_authorization saw to it
        if not self.authorized(authorization_of(scope["headers"]) or ""):
            await deny(
                scope,
                receive,
                send,
                401,
                "a broker token is required\n",
                [("www-authenticate", "Bearer")],
            )
            return
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        host, port = scope.get("server") or ("", 0)
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        conn_id = self.core.open_connection(addr, now=trio.current_time())
        await self.driver.serve(conn_id, _AsgiWebsocket(receive, send))


def _make_app(service: _Service) -> ASGIApp:
    async def inspect(request: Request) -> Response:
        return JSONResponse(execserver_document(service.statistics()))

    async def metrics(request: Request) -> Response:
        return Response(execserver_metrics(service.statistics()), media_type=METRICS_CONTENT_TYPE)

    async def not_found(websocket: WebSocket) -> None:
        await websocket.send_denial_response(PlainTextResponse("not found\n", status_code=404))

    auth = "bearer" if service.broker_token is not None else "none"
    pages = [
        Page(path="/broker", kind="websocket", auth=auth, what="the broker websocket"),
        *health_pages(lambda: service.core.draining),
        Page(
            path="/inspect/system/execserver",
            endpoint=bearer_required(inspect, service.authorized),
            auth=auth,
            what="JSON: pool, services, connections, running jobs, recent receipts",
        ),
        Page(
            path="/metrics",
            endpoint=bearer_required(metrics, service.authorized),
            auth=auth,
            what="Prometheus text exposition of the same figures",
        ),
    ]
    app_pages = Starlette(routes=[*routes_of(pages), WebSocketRoute("/{path:path}", not_found)])

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and scope["path"] == "/broker":
            await service.broker_endpoint(scope, receive, send)
        else:
            await app_pages(scope, receive, send)

    return one_authorization(app)


async def serve_execserver(
    config: BrokerConfig,
    runner: Runner,
    *,
    listener: ListenerSettings | None = None,
    broker_token: str | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    task_status: trio.TaskStatus[ExecserverHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an execserver until it has drained (or the caller cancels it).

    Binds the listener (port 0 picks a free port), then calls
    ``task_status.started()`` with an :class:`ExecserverHandle`. Returns once
    :meth:`ExecserverHandle.drain` has finished draining and every connection is
    closed. Cancelling it stops at once: running jobs are killed.

    Args:
        config: the broker core's configuration (instance id, name, pool, timers).
        runner: runs the jobs (the reference
            :class:`~trio_broker.trio.runner.CommandRunner`, or your own).
        listener: where to listen, and the TLS files for ``wss://``; by default
            ``127.0.0.1`` on a free port.
        broker_token: when set, ``/broker``, ``/inspect/system/execserver`` and
            ``/metrics`` need ``Authorization: Bearer <token>``.
        max_frame_bytes: a larger incoming frame closes its connection (1009).
    """
    listener = listener or ListenerSettings()
    core = Broker(config, now=trio.current_time())
    hyper = listener_config(listener.listen)
    hyper.websocket_max_message_size = max_frame_bytes
    secure = listener.certfile is not None
    if listener.certfile is not None:
        hyper.certfile = listener.certfile
        hyper.keyfile = listener.keyfile
        hyper.ciphers = "ECDHE+AESGCM:ECDHE+CHACHA20"
    async with httpx.AsyncClient(timeout=5.0) as http, trio.open_nursery() as nursery:
        service = _Service(
            core,
            runner,
            broker_token=broker_token,
            max_frame_bytes=max_frame_bytes,
            http=http,
            nursery=nursery,
        )
        driver = service.driver
        nursery.start_soon(driver.run_timers)
        host, port = await nursery.start(
            functools.partial(
                serve_app,
                _make_app(service),
                hyper,
                shutdown_trigger=service.drained.wait,
                websockets={"/broker": service.broker_websocket},
            )
        )
        handle = ExecserverHandle(service, host, port, secure)
        log.info("execserver %s (%s) serving %s", config.name, config.instance_id, handle.url)
        task_status.started(handle)
        await service.drained.wait()
        # every connection was told to close (1001); give them a moment to go
        with trio.move_on_after(hyper.graceful_timeout + 1.0):
            await driver.wait_until(lambda: not driver.connections)
        service.closed.set()
        nursery.cancel_scope.cancel()
