"""``trio-broker top``: the topology of the installation, live in a terminal.

It follows the same document as the fylr's topology page
(``/inspect/system/topology/ws``, which pushes a new document when something
changes, at most once a second) and redraws it with rich's Live display, which
refreshes each second: a table of the fylr servers, one of the execservers
(with the balancer each is reached through) and the callback warnings. While
it runs, the fylrs subscribe to the execservers' figures as for the page; when
it stops, they stop. ``--once`` prints the document of
``/inspect/system/topology/data`` once instead (for scripts and logs). A fylr
with tokens needs the ``operator`` token (``--token-file``), sent on the
websocket's upgrade as on the page request.

Exit status: 0 after a clean stop (Ctrl-C) or a printed view; 1 when the fylr
could not be reached or refused the token.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping
from typing import Any, Final

import httpx
import trio
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from trio_websocket import ConnectionRejected, HandshakeError, open_websocket_url

from trio_broker_daemons.commands.credentials import auth_headers, refusal_hint

__all__ = ["follow", "main", "render"]

REFRESH: Final = 1.0
"""Seconds between two redraws of the live display."""


def _bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - the loop always returns


def _fylr_table(document: Mapping[str, Any]) -> Table:
    table = Table(title="fylr servers", title_justify="left", expand=True)
    for column in ("name", "running", "waiting", "finished", "failed", "in flight", "heartbeat"):
        table.add_column(column, justify="left" if column == "name" else "right")
    for fylr in document["fylrs"]:
        jobs = fylr["jobs"] or {}
        dispatcher = fylr["dispatcher"] or {}
        in_flight = (
            f"{dispatcher['exec_in_flight']}/{dispatcher['exec_limit']}" if dispatcher else "-"
        )
        table.add_row(
            fylr["name"],
            str(jobs.get("running", "-")),
            str(jobs.get("waiting", "-")),
            str(jobs.get("finished", "-")),
            str(jobs.get("failed", "-")),
            in_flight,
            f"{fylr['heartbeat_age_s']:.0f} s ago",
        )
    return table


def _execserver_table(document: Mapping[str, Any]) -> Table:
    via: dict[str, str] = {}
    for balancer in document["balancers"]:
        for instance in balancer["instances"]:
            via[instance] = balancer["address"]
    table = Table(title="execservers", title_justify="left", expand=True)
    columns = ("name", "via", "slots", "running", "waiting", "finished", "failed", "/min", "pipes")
    for column in columns:
        table.add_column(column, justify="left" if column in ("name", "via") else "right")
    for execserver in document["execservers"]:
        figures = execserver["figures"]
        name = execserver["name"] + (" (draining)" if execserver["draining"] else "")
        if figures is None:
            row = ["-"] * 6
        else:
            row = [
                str(figures["running"]),
                str(figures["waiting"]),
                str(figures["finished"]),
                str(figures["failed"]),
                str(figures["per_minute"]),
                f"{_bytes(figures['bytes_in'])} in, {_bytes(figures['bytes_out'])} out",
            ]
        table.add_row(
            name, via.get(execserver["instance_id"], "direct"), str(execserver["slots"]), *row
        )
    return table


def render(document: Mapping[str, Any]) -> Group:
    """The terminal view of one topology document."""
    parts: list[Any] = [
        Text(
            f"{len(document['fylrs'])} fylr, {len(document['balancers'])} balancer, "
            f"{len(document['execservers'])} execserver (served by {document['served_by']})",
            style="bold",
        ),
        _fylr_table(document),
        _execserver_table(document),
    ]
    names = {f["id"]: f["name"] for f in document["fylrs"]}
    for link in document["links"]:
        for warning in link["warnings"]:
            parts.append(
                Text(f"⚠ {names.get(link['from'], link['from'])}: callback check {warning}", "red")
            )
    for fylr in document["fylrs"]:
        for warning in fylr["warnings"]:
            parts.append(Text(f"⚠ {fylr['name']}: {warning}", style="red"))
    return Group(*parts)


async def follow(
    server: str,
    on_document: Callable[[dict[str, Any]], None],
    *,
    updates: float = math.inf,
    token: str | None = None,
) -> None:
    """Call ``on_document`` with each document the fylr pushes (``updates`` of them at most).

    Args:
        server: the fylr's base URL.
        on_document: called with each document.
        updates: how many documents to take before returning.
        token: the fylr's ``operator`` token, if it has tokens.

    Raises:
        OSError, HandshakeError: the fylr could not be reached, or refused the
            upgrade (:class:`trio_websocket.ConnectionRejected`, its status).
    """
    url = server.rstrip("/").replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    headers = [(k.encode(), v.encode()) for k, v in auth_headers(token).items()]
    async with open_websocket_url(
        f"{url}/inspect/system/topology/ws", extra_headers=headers or None
    ) as ws:
        seen = 0
        while seen < updates:
            on_document(json.loads(await ws.get_message()))
            seen += 1


async def live(
    server: str, console: Console, *, updates: float = math.inf, token: str | None = None
) -> None:
    """The live display: redrawn each second, with the latest document pushed."""
    with Live(Text("connecting…"), console=console, refresh_per_second=1 / REFRESH) as display:

        def show(document: dict[str, Any]) -> None:
            display.update(render(document))

        await follow(server, show, updates=updates, token=token)


class Refused(Exception):
    """The fylr answered with an error status (a missing or narrower token, …)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"the fylr answered {status}: {text}{refusal_hint(status, 'operator')}")


async def _once(server: str, token: str | None) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30.0, headers=auth_headers(token)) as http:
        response = await http.get(f"{server.rstrip('/')}/inspect/system/topology/data")
    if response.status_code != 200:
        raise Refused(response.status_code, response.text.strip())
    document: dict[str, Any] = response.json()
    return document


def main(server: str, *, once: bool = False, token: str | None = None) -> int:
    """The ``trio-broker top`` command; returns the exit status.

    Args:
        server: the fylr's base URL.
        once: print the view once instead of following it.
        token: the fylr's ``operator`` token, if it has tokens.
    """
    console = Console()
    try:
        if once:
            console.print(render(trio.run(_once, server, token)))
        else:
            trio.run(functools.partial(live, server, console, token=token))
    except KeyboardInterrupt:
        return 0
    except ConnectionRejected as exc:
        refused = Refused(exc.status_code, (exc.body or b"").decode("utf-8", "replace").strip())
        console.print(f"trio-broker top: {server}: {refused}", markup=False, soft_wrap=True)
        return 1
    except Refused as exc:
        console.print(f"trio-broker top: {server}: {exc}", markup=False, soft_wrap=True)
        return 1
    except (OSError, HandshakeError, httpx.HTTPError) as exc:
        console.print(
            f"trio-broker top: cannot follow {server}: {type(exc).__name__}: {exc}",
            markup=False,
            soft_wrap=True,
        )
        return 1
    return 0
