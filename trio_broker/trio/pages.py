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
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

__all__ = [
    "Page",
    "bearer_matches",
    "bearer_required",
    "health_pages",
    "index_route",
    "routes_of",
]

Endpoint = Callable[[Request], Awaitable[Response]]


def bearer_matches(authorization: str, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (constant time).

    Args:
        authorization: the header's value (``""`` when absent).
        token: the expected token; ``None`` lets every request through.
    """
    if token is None:
        return True
    return hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def bearer_required(
    endpoint: Endpoint, authorized: Callable[[Mapping[str, str]], bool]
) -> Endpoint:
    """``endpoint``, answering 401 to a request that ``authorized`` refuses.

    Args:
        endpoint: the page.
        authorized: takes the request's headers (lower-case names).
    """

    async def guarded(request: Request) -> Response:
        if not authorized(request.headers):
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
