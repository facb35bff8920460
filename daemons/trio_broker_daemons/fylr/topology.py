"""The topology of the installation: every fylr, every execserver, the balancers between.

Theory of operation
===================

Two things make a picture of the whole installation hard: a fylr only reaches
its own execservers, and an execserver behind a balancer cannot be addressed at
all. So the picture is assembled from what each fylr knows for itself:

- **Each fylr publishes its own view** (:meth:`Topology.own_view`) into its row
  of the shared ``broker_backends`` table (:mod:`trio_broker.trio.views`), from the task
  :meth:`Topology.serve`: who it is, what its broker client and dispatcher do,
  every address it dials (and whether that address fronts a fleet: the
  client's ``balanced``), every broker connection with the execserver instance
  behind it, that connection's callback check, and the execserver's figures.
- **Execserver figures come over the broker connections** (``SUBSCRIBE`` /
  ``STATS``, PROTOCOL.md section 21), only while someone watches: while a
  viewer is connected to this fylr's topology websocket, while a queue
  position was asked for recently (:meth:`Topology.lease`), or while another
  fylr's published view says it is watched (each fylr reads every view when it
  publishes its own). Nobody watching anywhere means no subscription, so the
  broker connections carry ``PING``/``PONG`` alone, and each fylr writes its
  view once per ``heartbeat_interval``. While watched, the views are written
  and read once a second.
- **Any fylr draws all of them** (:func:`topology_document`): the views of the
  live backends (heartbeat younger than ``stale_after``; this process's own
  view fresh from memory) merged into one document of nodes and links. An
  execserver seen by several fylrs is one node, with the freshest figures. An
  address whose connections land on execservers announcing another
  ``HELLO.addr`` is a balancer node between the fylrs and its replicas. A
  callback check that did not pass is marked on the connection it belongs to,
  as soon as the execserver reported it; a callback base that names one of the
  execserver addresses is flagged on the fylr when the view is made.

The document's schema is ``topology.schema.json`` beside this module
(documented in docs/TOPOLOGY.md); the page (``static/topology.html``, plain HTML
and a little JavaScript, nothing fetched from elsewhere) draws it and follows
the websocket.

Routes (:func:`routes`), for the ``operator`` role:

``GET /inspect/system/topology``
    the page, with the current document embedded, and a signed link to its
    websocket (a browser cannot give a websocket a token): a browser opens the
    page with the operator token as the password of its login prompt
    (``Basic``), and the page follows the websocket with the link; once the
    link has expired, the page reloads itself for a fresh one.
``GET /inspect/system/topology/data``
    the document as JSON.
``WS /inspect/system/topology/ws``
    one JSON document per change (at most one a second) while connected; the
    operator token or the page's signed link, and an ``Origin`` that is the
    fylr's own (or allowed).
"""

from __future__ import annotations

import contextlib
import html
import importlib.resources
import json
import logging
import math
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import trio
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from trio_broker._version import __version__
from trio_broker.core import protocol as p
from trio_broker.core.errors import StoreUnavailable
from trio_broker.trio.client import LinkState
from trio_broker.trio.inspection import iso_time
from trio_broker.trio.views import BackendView, publish_view, read_views
from trio_broker_daemons.fylr.access import Access, Role
from trio_broker_daemons.fylr.guard import GuardedRoute, route, websocket_route
from trio_broker_daemons.fylr.state import FylrState

__all__ = [
    "DOCUMENT_VERSION",
    "Topology",
    "routes",
    "schema",
    "topology_document",
    "topology_of",
]

log = logging.getLogger("trio_broker_daemons.fylr.topology")

DOCUMENT_VERSION: Final = 1
"""The ``version`` member of the topology document and of each published view."""
WATCHED_INTERVAL: Final = 1.0
"""Seconds between two publications (and two pushed documents) while watched."""
FIRST_FIGURES_WAIT: Final = 2.0
"""Seconds a new viewer waits for the execservers' first figures before it is answered."""
REQUEST_LEASE: Final = 10.0
"""Seconds the figures keep coming after a page or data request (its websocket follows)."""

_TOPOLOGIES: weakref.WeakKeyDictionary[FylrState, Topology] = weakref.WeakKeyDictionary()


def topology_of(state: FylrState) -> Topology:
    """The one :class:`Topology` of a fylr process (made on first use)."""
    topology = _TOPOLOGIES.get(state)
    if topology is None:
        topology = _TOPOLOGIES[state] = Topology(state)
    return topology


def schema() -> dict[str, Any]:
    """The JSON Schema of the topology document (``topology.schema.json``)."""
    text = importlib.resources.files(__package__).joinpath("topology.schema.json").read_text()
    loaded: dict[str, Any] = json.loads(text)
    return loaded


class Topology:
    """One fylr process's part of the topology: its viewers, its view, its publications.

    Args:
        state: the process's shared state (the store, the client, the dispatcher).
    """

    def __init__(self, state: FylrState) -> None:
        self.state = state
        self.viewers = 0
        self._lease_until = -math.inf
        self._published_watched = False
        self._elsewhere = False  # another live fylr says it is watched
        self._views: Sequence[BackendView] = ()
        self._wake = trio.Event()
        self._published = trio.Event()
        self._watching: contextlib.ExitStack | None = None

    # -- who watches -------------------------------------------------------------------

    @property
    def watched_here(self) -> bool:
        """A viewer is connected here, or a position was asked for within its lease."""
        return self.viewers > 0 or trio.current_time() < self._lease_until

    @property
    def watched(self) -> bool:
        """Whether the figures are wanted: watched here or by another live fylr."""
        return self.watched_here or self._elsewhere

    def lease(self, seconds: float) -> None:
        """Keep the figures coming for ``seconds`` more (a queue position was asked for)."""
        self._lease_until = max(self._lease_until, trio.current_time() + seconds)
        self._follow_watchers()

    @contextlib.contextmanager
    def viewer(self) -> Iterator[None]:
        """A viewer of the page or the websocket is here while the block runs."""
        self.viewers += 1
        self._follow_watchers()
        try:
            yield
        finally:
            self.viewers -= 1
            self._follow_watchers()

    def _follow_watchers(self) -> None:
        """Subscribe the broker client while watched, unsubscribe when not.

        The publishing task is woken when the watched state here changes (so the
        others learn it, and its pace follows), not at every lease renewed: a
        client following its uploads asks for positions every few seconds per file.
        """
        client = self.state.client
        if self.watched and self._watching is None and client is not None:
            self._watching = contextlib.ExitStack()
            self._watching.enter_context(client.watching())
        elif not self.watched and self._watching is not None:
            self._watching.close()
            self._watching = None
        here = self.watched_here
        if here != self._published_watched:
            self._wake.set()

    async def wait_for_figures(self, timeout: float = FIRST_FIGURES_WAIT) -> None:  # noqa: ASYNC109
        """Wait (bounded) until every execserver connection has sent its first figures."""
        client = self.state.client
        if client is None:
            return

        def arrived() -> bool:
            return all(link.stats is not None or link.stats_refused for link in client.links())

        with trio.move_on_after(timeout):
            await client.wait_until(arrived)

    # -- the published view ------------------------------------------------------------

    def own_view(self) -> dict[str, Any]:
        """This process's view, as it publishes it (see docs/TOPOLOGY.md, "views")."""
        state = self.state
        config = state.config
        stats = state.statistics()
        client = state.client
        view: dict[str, Any] = {
            "version": DOCUMENT_VERSION,
            "backend_id": state.backend_id,
            "name": config.name,
            "url": state.base_url,
            "software": __version__,
            "watched": self.watched_here,
            "published_at": iso_time(time.time()),
            "callback_own_url": config.callback_own_url,
            "jobs": None,
            "dispatcher": None,
            "pipes": {
                "bytes_served": stats.pipes.bytes_served,
                "bytes_received": stats.pipes.bytes_received,
            },
            "addresses": [],
            "links": [],
            "warnings": _callback_warnings(config.callback_own_url, config.execserver_addresses),
        }
        if stats.dispatcher is not None:
            d = stats.dispatcher
            view["dispatcher"] = {
                "exec_in_flight": d.exec_in_flight,
                "exec_limit": d.exec_limit,
                "claimed": d.claimed,
                "completed": d.completed,
                "requeued": d.requeued,
                "failed": d.failed,
            }
        if client is not None and stats.client is not None:
            c = stats.client
            view["jobs"] = {
                "waiting": c.waiting,
                "running": c.running,
                "finished": c.finished,
                "failed": c.failed,
            }
            view["addresses"] = [
                {"address": a.address, "balanced": a.balanced, "instances": list(a.instances)}
                for a in c.addresses
            ]
            view["links"] = [_link_view(link) for link in client.links()]
        return view

    # -- the task ----------------------------------------------------------------------

    async def serve(self) -> None:
        """Publish this view and learn the others', once a second while watched (run it
        in the fylr's nursery until cancelled)."""
        state = self.state
        try:
            while True:
                self._wake = trio.Event()
                view = self.own_view()
                self._published_watched = bool(view["watched"])
                try:
                    _, views = await publish_view(state.store, state.backend_id, view)
                except StoreUnavailable as exc:
                    log.debug("could not publish the topology view: %s", exc)
                else:
                    self._views = views
                    self._elsewhere = any(
                        v.backend_id != state.backend_id
                        and v.heartbeat_age <= state.config.stale_after
                        and bool((v.view or {}).get("watched"))
                        for v in views
                    )
                self._follow_watchers()
                self._wake = trio.Event()
                self._published.set()
                self._published = trio.Event()
                interval = WATCHED_INTERVAL if self.watched else state.config.heartbeat_interval
                with trio.move_on_after(interval):
                    await self._wake.wait()
        finally:
            if self._watching is not None:
                self._watching.close()
                self._watching = None

    async def next_publication(self) -> None:
        """Wait for the task's next round (views written and read)."""
        await self._published.wait()

    # -- the document ------------------------------------------------------------------

    async def document(self, *, fresh: bool = False) -> dict[str, Any]:
        """The topology document (reads the others' views from the database when ``fresh``
        or before the task published once).

        Raises:
            StoreUnavailable: the database could not be read.
        """
        if fresh or not self._views:
            self._views = await read_views(self.state.store)
        return topology_document(
            self._views,
            own=self.own_view(),
            stale_after=self.state.config.stale_after,
            served_by=self.state.backend_id,
        )


# -- views and the document ----------------------------------------------------------------


def _callback_warnings(callback_own_url: str | None, execservers: Sequence[str]) -> list[str]:
    """A configured callback base that names one of the execserver addresses."""
    if callback_own_url is None:
        return []
    host_port = callback_own_url.split("://", 1)[-1].split("/", 1)[0]
    if host_port in execservers:
        return [
            f"callback_own_url {callback_own_url} is the execserver address {host_port}: "
            "callback checks and pipes reach the execservers (or their balancer), not this fylr"
        ]
    return []


def _hello_view(hello: p.Hello) -> dict[str, Any]:
    return {
        "name": hello.name,
        "addr": hello.addr,
        "processes": hello.processes,
        "idle": hello.idle,
        "clients": hello.clients,
        "draining": hello.draining,
        "services": {name: info.kind for name, info in hello.services.items()},
    }


def _link_view(link: LinkState) -> dict[str, Any]:
    stats = link.stats
    return {
        "address": link.address,
        "instance_id": link.hello.instance_id,
        "local_addr": link.local_addr,
        "callback_base": link.callback_base,
        "callback_check": None if stats is None else stats.callback_check,
        "figures": "refused" if link.stats_refused else ("live" if stats else "none"),
        "hello": _hello_view(link.hello),
        "stats": None if stats is None else p.converter.unstructure(stats),
    }


def _execserver_node(instance_id: str, link: Mapping[str, Any], age: float) -> dict[str, Any]:
    hello = link["hello"]
    stats = link.get("stats")
    node: dict[str, Any] = {
        "id": f"exec:{instance_id}",
        "instance_id": instance_id,
        "name": hello["name"],
        "addr": hello["addr"],
        "slots": hello["processes"],
        "clients": hello["clients"],
        "idle": hello["idle"],
        "draining": hello["draining"],
        "live": stats is not None,
        "age_s": age,
        "figures": None,
        "services": {name: {"kind": kind} for name, kind in hello["services"].items()},
        "seen_by": [],
    }
    if stats is not None:
        node["slots"] = stats["slots"]
        node["clients"] = stats["clients"]
        node["draining"] = stats["draining"]
        node["figures"] = {
            key: stats[key]
            for key in (
                "fast_reserve",
                "running",
                "offered",
                "waiting",
                "finished",
                "failed",
                "per_minute",
                "bytes_in",
                "bytes_out",
            )
        }
        node["services"] = {
            name: {
                "kind": s["kind"],
                "capacity": s["capacity"],
                "mean_s": s["mean_s"],
                "running": s["running"],
                "waiting": s["waiting"],
            }
            for name, s in stats["services"].items()
        }
    return node


def _better(new: dict[str, Any], old: dict[str, Any] | None) -> bool:
    """Live figures beat HELLO-only ones; then the fresher view wins."""
    if old is None:
        return True
    return (new["live"], -new["age_s"]) > (old["live"], -old["age_s"])


def _fylr_node(backend: BackendView, view: Mapping[str, Any], age: float | None) -> dict[str, Any]:
    return {
        "id": f"fylr:{backend.backend_id}",
        "backend_id": backend.backend_id,
        "name": view.get("name", backend.name),
        "url": view.get("url"),
        "software": view.get("software"),
        "heartbeat_age_s": backend.heartbeat_age,
        "view_age_s": age,
        "watched": bool(view.get("watched")),
        "jobs": view.get("jobs"),
        "dispatcher": view.get("dispatcher"),
        "pipes": view.get("pipes"),
        "warnings": list(view.get("warnings", ())),
    }


def topology_document(
    views: Sequence[BackendView],
    *,
    own: Mapping[str, Any] | None = None,
    stale_after: float = math.inf,
    served_by: str = "",
    now: float | None = None,
) -> dict[str, Any]:
    """Merge the backends' views into one document (schema: ``topology.schema.json``).

    Args:
        views: every backend's row (:func:`~trio_broker.trio.views.read_views`).
        own: the serving process's fresh view, used instead of its published one.
        stale_after: backends whose heartbeat is older are left out.
        served_by: the backend id of the serving process.
        now: the document's ``generated_at`` (default: the wall clock).

    Returns:
        ``version``, ``generated_at``, ``served_by``, ``fylrs``, ``balancers``,
        ``execservers``, ``links`` and ``connections`` (docs/TOPOLOGY.md).
    """
    fylrs: list[dict[str, Any]] = []
    execservers: dict[str, dict[str, Any]] = {}
    balancers: dict[str, dict[str, Any]] = {}
    links: dict[tuple[str, str], dict[str, Any]] = {}
    connections: list[dict[str, Any]] = []
    for backend in views:
        if backend.heartbeat_age > stale_after:
            continue
        view: Mapping[str, Any] | None = backend.view
        age = backend.view_age if backend.view_age is not None else math.inf
        if own is not None and backend.backend_id == own.get("backend_id"):
            view, age = own, 0.0
        if view is None or view.get("version") != DOCUMENT_VERSION:
            view = {}
        fylr = _fylr_node(backend, view, age if math.isfinite(age) else None)
        fylrs.append(fylr)
        balanced = {a["address"] for a in view.get("addresses", ()) if a.get("balanced")}
        for link in view.get("links", ()):
            instance_id = link["instance_id"]
            node = _execserver_node(instance_id, link, age if math.isfinite(age) else 0.0)
            if _better(node, execservers.get(instance_id)):
                node["seen_by"] = execservers.get(instance_id, {}).get("seen_by", [])
                execservers[instance_id] = node
            seen = execservers[instance_id]["seen_by"]
            if fylr["id"] not in seen:
                seen.append(fylr["id"])
            via: str | None = None
            if link["address"] in balanced:
                via = f"lb:{link['address']}"
                balancer = balancers.setdefault(
                    via, {"id": via, "address": link["address"], "instances": []}
                )
                if instance_id not in balancer["instances"]:
                    balancer["instances"].append(instance_id)
                links.setdefault((fylr["id"], via), {"from": fylr["id"], "to": via})
                links.setdefault((via, node["id"]), {"from": via, "to": node["id"]})
            else:
                links.setdefault((fylr["id"], node["id"]), {"from": fylr["id"], "to": node["id"]})
            check = link.get("callback_check")
            connections.append(
                {
                    "fylr": fylr["id"],
                    "execserver": node["id"],
                    "via": via,
                    "address": link["address"],
                    "callback_base": link.get("callback_base"),
                    "callback_check": check,
                    "callback_ok": None if check is None else check == "ok",
                    "figures": link.get("figures", "none"),
                }
            )
    for connection in connections:
        if connection["callback_ok"] is False:
            first_hop = connection["via"] or connection["execserver"]
            link = links[(connection["fylr"], first_hop)]
            link.setdefault("warnings", []).append(
                f"{execservers[connection['execserver'][5:]]['name']}: "
                f"{connection['callback_check']}"
            )
    for link in links.values():
        link.setdefault("warnings", [])
    return {
        "version": DOCUMENT_VERSION,
        "generated_at": iso_time(time.time() if now is None else now),
        "served_by": served_by,
        "fylrs": fylrs,
        "balancers": list(balancers.values()),
        "execservers": sorted(execservers.values(), key=lambda e: (e["name"], e["instance_id"])),
        "links": list(links.values()),
        "connections": connections,
    }


# -- routes ----------------------------------------------------------------------------------


WEBSOCKET_PATH: Final = "/inspect/system/topology/ws"


def _page(document: Mapping[str, Any], websocket: str) -> str:
    template = importlib.resources.files(__package__).joinpath("static/topology.html").read_text()
    # </script> cannot appear inside the embedded JSON: json escapes "/" nowhere, so do it
    embedded = json.dumps(document).replace("</", "<\\/")
    return (
        template.replace("__TOPOLOGY_DOCUMENT__", embedded)
        .replace("__TOPOLOGY_WEBSOCKET__", json.dumps(websocket).replace("</", "<\\/"))
        .replace("__TITLE__", html.escape(f"topology: {document['served_by']}"))
    )


def routes(state: FylrState, access: Access) -> list[GuardedRoute]:
    """The page, the JSON document and the websocket of one fylr process (operator).

    Args:
        state: the process's shared state.
        access: signs the page's link to its websocket.
    """
    topology = topology_of(state)

    async def current() -> dict[str, Any] | Response:
        # a page's websocket follows at once: keep the figures coming meanwhile
        topology.lease(REQUEST_LEASE)
        await topology.wait_for_figures()
        try:
            return await topology.document(fresh=True)
        except StoreUnavailable as exc:
            return JSONResponse({"error": f"the database is unavailable: {exc}"}, 503)

    async def page(request: Request) -> Response:
        document = await current()
        if isinstance(document, Response):
            return document
        link = f"{WEBSOCKET_PATH}?{access.sign(WEBSOCKET_PATH, now=time.time())}"
        return HTMLResponse(_page(document, link), headers={"cache-control": "no-store"})

    async def data(request: Request) -> Response:
        document = await current()
        return document if isinstance(document, Response) else JSONResponse(document)

    async def stream(websocket: WebSocket) -> None:
        await websocket.accept()
        with topology.viewer():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_until_closed, websocket, nursery.cancel_scope)
                await topology.wait_for_figures()
                last: dict[str, Any] | None = None
                while True:
                    try:
                        document = await topology.document()
                    except StoreUnavailable:
                        document = None
                    if document is not None and _changed(document, last):
                        try:
                            await websocket.send_text(json.dumps(document))
                        except (WebSocketDisconnect, RuntimeError, OSError):
                            break  # the viewer went away
                        last = document
                    await topology.next_publication()

    return [
        route("/inspect/system/topology", page, role=Role.OPERATOR),
        route("/inspect/system/topology/data", data, role=Role.OPERATOR),
        websocket_route(WEBSOCKET_PATH, stream, role=Role.OPERATOR, links=True),
    ]


def _changed(document: Mapping[str, Any], last: Mapping[str, Any] | None) -> bool:
    """Whether a document differs from the last one sent, its ages and clock left aside."""
    if last is None:
        return True
    return _steady(document) != _steady(last)


def _steady(document: Mapping[str, Any]) -> dict[str, Any]:
    body = dict(document)
    body.pop("generated_at", None)
    body["fylrs"] = [
        {k: v for k, v in f.items() if k not in ("heartbeat_age_s", "view_age_s")}
        for f in document["fylrs"]
    ]
    body["execservers"] = [
        {k: v for k, v in e.items() if k != "age_s"} for e in document["execservers"]
    ]
    return body


async def _until_closed(websocket: WebSocket, scope: trio.CancelScope) -> None:
    """Read (and drop) what the viewer sends until it goes away; then end the stream."""
    with contextlib.suppress(WebSocketDisconnect):
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
    scope.cancel()
