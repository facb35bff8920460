"""Every route of the fylr declares its role; one gate checks what every request brings.

Theory of operation
===================

The decisions are :mod:`trio_broker_daemons.fylr.access`'s; this module puts
them in front of the starlette application that
:func:`~trio_broker_daemons.fylr.api.build_app` builds.

**Declaring a route.** Every route is made by :func:`route` (HTTP) or
:func:`websocket_route`, which take its :class:`~trio_broker_daemons.fylr.access.Role`::

    route("/api/v1/eas/{file_id}/sync", api.resync, role=Role.OPERATOR, methods=("POST",))
    websocket_route("/inspect/system/topology/ws", stream, role=Role.OPERATOR, links=True)

``links=True`` lets a signed link (``?expires=…&signature=…``) stand in for the
token. Routes made elsewhere (the library's pipes) are wrapped with
:func:`guarded`. The result is a :class:`GuardedRoute`, which checks the
request's credentials against its role before the endpoint runs.
:func:`~trio_broker_daemons.fylr.api.build_app` refuses to build an
application with a route that declares no role (:func:`undeclared`), and
``tests/daemons/test_fylr_access.py`` walks the application's real routes with
no, a wrong, and each role's token.

**The gate** (:class:`FylrGate`, an ASGI middleware around the whole
application, unknown paths included) refuses, before any route:

- several ``Authorization`` headers (400), as the execserver does;
- a missing ``Host`` or one that names no name of this fylr (400, 421);
- on a state-changing request (any method but ``GET``, ``HEAD`` and
  ``OPTIONS``) and on a websocket upgrade, an ``Origin`` that is neither this
  fylr's own nor in ``allowed_origins`` (403);
- on a state-changing request, a form body (415): state changes come as JSON or
  binary bodies, never as what an HTML form can post to another site.
"""

import secrets
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from starlette.requests import Request
from starlette.routing import BaseRoute, Match, Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from trio_broker.trio.pages import SEVERAL_AUTHORIZATIONS, authorization_of, deny
from trio_broker_daemons.fylr.access import FORM_TYPES, Access, Refusal, Role
from trio_broker_daemons.fylr.config import FylrConfig

__all__ = [
    "SAFE_METHODS",
    "FylrGate",
    "GuardedRoute",
    "access_of",
    "access_of_request",
    "guarded",
    "route",
    "undeclared",
    "websocket_route",
]

SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
"""The methods that change nothing: every other one is a state-changing request."""


def access_of(config: FylrConfig) -> Access:
    """The decisions of a fylr configuration (a random link key when none is configured)."""
    key = config.link_key.encode() if config.link_key is not None else secrets.token_bytes(32)
    return Access(
        tokens=config.tokens,
        link_key=key,
        link_ttl=config.link_ttl,
        host_names=(*config.allowed_hosts, *_own_names(config)),
        origins=config.allowed_origins,
    )


def _own_names(config: FylrConfig) -> list[str]:
    """The names a fylr answers to without configuring them."""
    names = ["localhost", config.host, config.name]
    if config.callback_own_url is not None:
        host = urllib.parse.urlsplit(config.callback_own_url).hostname
        if host:
            names.append(host)
    return [name.lower() for name in names]


def access_of_request(request: Request) -> Access:
    """The :class:`Access` of the application serving ``request``."""
    access: Access = request.app.state.access
    return access


class GuardedRoute(BaseRoute):
    """A route with its role: it checks the request's credentials, then serves.

    Build it with :func:`route`, :func:`websocket_route` or :func:`guarded`.

    Attributes:
        route: the starlette route it guards.
        role: what a request needs.
        links: whether a signed link stands in for the token.
    """

    def __init__(self, inner: BaseRoute, *, role: Role, links: bool = False) -> None:
        if not isinstance(role, Role):
            raise TypeError(f"role: expected a Role, got {role!r}")
        self.route = inner
        self.role = role
        self.links = links

    @property
    def path(self) -> str:
        """The route's path template (``/api/v1/eas/{file_id}``)."""
        path: str = getattr(self.route, "path", "")
        return path

    @property
    def websocket(self) -> bool:
        """Whether it is a websocket route."""
        return isinstance(self.route, WebSocketRoute)

    @property
    def methods(self) -> frozenset[str]:
        """Its HTTP methods (empty for a websocket)."""
        return frozenset(getattr(self.route, "methods", None) or ())

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        return self.route.matches(scope)

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        return self.route.url_path_for(name, **path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        access: Access = scope["app"].state.access
        query = None
        if self.links:
            pairs = urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1"))
            query = dict(reversed(pairs))  # the first value of each name
        refusal = access.judge(
            self.role,
            authorization_of(scope["headers"]) or "",
            path=scope["path"],
            query=query,
            now=time.time(),
        )
        if refusal is not None:
            await deny(scope, receive, send, refusal.status, refusal.text + "\n", refusal.headers)
            return
        await self.route.handle(scope, receive, send)

    def __repr__(self) -> str:
        return f"GuardedRoute({self.route!r}, role={self.role.value})"


def route(
    path: str,
    endpoint: Callable[..., Any],
    *,
    role: Role,
    methods: Sequence[str] = ("GET",),
    links: bool = False,
) -> GuardedRoute:
    """An HTTP route and the role it needs (the one way the fylr's routes are made).

    Args:
        path: the path template.
        endpoint: the starlette endpoint (``async def f(request) -> Response``).
        role: what a request needs (:class:`~trio_broker_daemons.fylr.access.Role`).
        methods: the HTTP methods; a state-changing route uses ``POST``, ``PUT``
            or ``DELETE`` only, never ``GET``.
        links: a signed link may stand in for the token.
    """
    return GuardedRoute(Route(path, endpoint, methods=list(methods)), role=role, links=links)


def websocket_route(
    path: str, endpoint: Callable[..., Any], *, role: Role, links: bool = False
) -> GuardedRoute:
    """A websocket route and the role it needs (see :func:`route`)."""
    return GuardedRoute(WebSocketRoute(path, endpoint), role=role, links=links)


def guarded(routes: Iterable[BaseRoute], *, role: Role) -> list[GuardedRoute]:
    """Routes made elsewhere (the library's pipes), each with ``role``."""
    return [GuardedRoute(inner, role=role) for inner in routes]


def undeclared(routes: Iterable[BaseRoute]) -> list[str]:
    """The routes that declare no role (not made by :func:`route` and its kin)."""
    return [getattr(r, "path", None) or repr(r) for r in routes if not isinstance(r, GuardedRoute)]


class FylrGate:
    """The ASGI middleware in front of every route (see the module docstring).

    Args:
        app: the application.
        access: its decisions.
    """

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            refusal = self.refusal(scope)
            if refusal is not None:
                await deny(scope, receive, send, refusal.status, refusal.text + "\n")
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> Refusal | None:
        """Why the gate refuses a request (``None``: it passes to the routes)."""
        headers: dict[bytes, list[str]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.lower(), []).append(value.decode("latin-1"))
        if authorization_of(scope["headers"]) is None:
            return Refusal(400, SEVERAL_AUTHORIZATIONS.rstrip("\n"))
        hosts = headers.get(b"host", [])
        if len(hosts) != 1:
            return Refusal(400, "expected one Host header")
        (host,) = hosts
        if not self.access.host_allowed(host):
            return Refusal(421, f"Host {host!r} names no name of this fylr (allowed_hosts)")
        if scope["type"] == "http" and scope["method"] in SAFE_METHODS:
            return None
        origins = headers.get(b"origin", [])
        if origins and not (len(origins) == 1 and self.access.origin_allowed(origins[0], host)):
            shown = origins[0] if len(origins) == 1 else ", ".join(origins)
            return Refusal(
                403, f"Origin {shown!r} may not use this fylr (its own or allowed_origins)"
            )
        if scope["type"] == "http":
            kinds = headers.get(b"content-type", [])
            if any(kind.split(";")[0].strip().lower() in FORM_TYPES for kind in kinds):
                return Refusal(
                    415,
                    f"a form body ({kinds[0].split(';')[0].strip()}) is refused: send JSON"
                    " (application/json) or binary (application/octet-stream)",
                )
        return None
