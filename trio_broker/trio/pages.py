"""The HTTP pages beside a daemon's websocket: health, lifecycle, a route index, a token gate.

A daemon's listener serves a few plain HTTP pages next to its websocket. This
module builds them as starlette routes, so the execserver (and any other
service, the reference fylr included) serves the same health contract:

``GET /livez``
    200 while the process works, draining included: ``{"status": "serving"}``
    or ``{"status": "draining"}``. A liveness probe restarts the process only
    when this fails (the process is wedged or gone), never because it drains.
``GET /readyz``
    200 ``{"status": "serving"}`` while it takes new work, 503
    ``{"status": "draining"}`` once it drains: a readiness probe (or a
    balancer's health check) stops sending it new connections.
``GET /healthz``
    The same as ``/readyz`` (kept for existing checks).
``GET /``
    The route index: ``{"routes": [{"path", "methods", "kind", "auth", "what"}]}``.

:func:`bearer_required` wraps a page so that it answers 401 (with
``WWW-Authenticate: Bearer``) unless the request carries the token; the check
is the caller's own constant-time comparison, the same one as the websocket's.

**One ``Authorization`` header.** A request that carries several is refused
with 400 (:data:`SEVERAL_AUTHORIZATIONS`), whatever the route, the token
configured or not: two values must never be judged one way by one route and
another way by the next. :func:`one_authorization` applies the rule to a whole
ASGI application (websocket upgrades included); :func:`authorization_of`
reads the header of a raw head for a route served outside ASGI.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Final

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = [
    "SEVERAL_AUTHORIZATIONS",
    "Page",
    "authorization_of",
    "bearer_matches",
    "bearer_required",
    "deny",
    "health_pages",
    "index_route",
    "one_authorization",
    "routes_of",
]

Endpoint = Callable[[Request], Awaitable[Response]]

SEVERAL_AUTHORIZATIONS: Final = "several Authorization headers: send one\n"
"""The body of the 400 answer to a request with more than one ``Authorization``."""


def authorization_of(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The value of the one ``Authorization`` header of a raw head.

    Args:
        headers: the head's ``(name, value)`` pairs, names in any case (ASGI's
            ``scope["headers"]``, h11's ``Request.headers``).

    Returns:
        The value (``""`` when there is none), or ``None`` when there are several:
        answer 400 (:data:`SEVERAL_AUTHORIZATIONS`).
    """
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if len(values) > 1:
        return None
    return values[0].decode("latin-1") if values else ""


async def deny(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    text: str,
    headers: Sequence[tuple[str, str]] = (),
) -> None:
    """Answer a request (or refuse a websocket upgrade) with a short text, before any route.

    A websocket upgrade gets the HTTP answer through the ASGI denial response
    (after its ``websocket.connect``); a server without it closes the upgrade
    (1008) instead.
    """
    raw = [
        (b"content-type", b"text/plain; charset=utf-8"),
        *((name.encode("latin-1"), value.encode("latin-1")) for name, value in headers),
    ]
    body = text.encode()
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})
        return
    if (await receive())["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": raw})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})


def one_authorization(app: ASGIApp) -> ASGIApp:
    """``app``, refusing with 400 any request or upgrade with several ``Authorization`` headers."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and authorization_of(scope["headers"]) is None:
            await deny(scope, receive, send, 400, SEVERAL_AUTHORIZATIONS)
            return
        await app(scope, receive, send)

    return guarded


def bearer_matches(authorization: str, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (constant time).

    Args:
        authorization: the header's value (``""`` when absent).
        token: the expected token; ``None`` lets every request through.
    """
    if token is None:
        return True
    return hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def bearer_required(endpoint: Endpoint, authorized: Callable[[str], bool]) -> Endpoint:
    """``endpoint``, answering 401 to a request that ``authorized`` refuses.

    Args:
        endpoint: the page.
        authorized: takes the value of the request's ``Authorization`` header
            (``""`` when absent). A request with several gets 400.
    """

    async def guarded(request: Request) -> Response:
        authorization = authorization_of(request.scope["headers"])
        if authorization is None:
            return PlainTextResponse(SEVERAL_AUTHORIZATIONS, status_code=400)
        if not authorized(authorization):
            return PlainTextResponse(
                "a broker token is required\n",
                status_code=401,
                headers={"www-authenticate": "Bearer"},
            )
        return await endpoint(request)

    return guarded


@attrs.frozen(kw_only=True)
class Page:
    """One route of a listener, with what the index says about it.

    Attributes:
        path: the route's path.
        what: one sentence for the index.
        endpoint: the page; ``None`` for a route served elsewhere (a websocket).
        methods: the HTTP methods.
        kind: ``"http"`` or ``"websocket"``.
        auth: ``"bearer"`` when it needs the token, else ``"none"``.
    """

    path: str
    what: str
    endpoint: Endpoint | None = None
    methods: tuple[str, ...] = ("GET",)
    kind: str = "http"
    auth: str = "none"


def health_pages(draining: Callable[[], bool]) -> list[Page]:
    """``/livez``, ``/readyz`` and ``/healthz`` for a service that can drain.

    Args:
        draining: whether the service drains now (it then still lives, but is
            not ready).
    """

    def state() -> dict[str, str]:
        return {"status": "draining" if draining() else "serving"}

    async def livez(request: Request) -> Response:
        return JSONResponse(state())

    async def readyz(request: Request) -> Response:
        body = state()
        return JSONResponse(body, status_code=503 if body["status"] == "draining" else 200)

    return [
        Page(path="/livez", endpoint=livez, what="200 while the process works, draining too"),
        Page(path="/readyz", endpoint=readyz, what="200 serving, 503 draining (takes no work)"),
        Page(path="/healthz", endpoint=readyz, what="the same as /readyz"),
    ]


def index_route(pages: Sequence[Page]) -> Route:
    """``GET /``: the JSON list of ``pages`` (and of itself)."""
    listed = [*pages, Page(path="/", what="this list of routes")]
    body = {
        "routes": [
            {
                "path": page.path,
                "methods": list(page.methods),
                "kind": page.kind,
                "auth": page.auth,
                "what": page.what,
            }
            for page in listed
        ]
    }

    async def index(request: Request) -> Response:
        return JSONResponse(body)

    return Route("/", index, methods=["GET"])


def routes_of(pages: Sequence[Page]) -> list[Route]:
    """The starlette routes of the pages that have an endpoint, and the index."""
    routes = [
        Route(page.path, page.endpoint, methods=list(page.methods))
        for page in pages
        if page.endpoint is not None
    ]
    return [*routes, index_route(pages)]
