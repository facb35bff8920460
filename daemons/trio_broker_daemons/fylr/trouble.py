"""What the topology flags: addresses not reached, replicas gone, a queue that waits.

Theory of operation
===================

The topology document (:mod:`trio_broker_daemons.fylr.topology`) draws what
the fylrs see. Three things would stay invisible in a drawing of what is
connected, so this module adds them, and then says what needs an operator:

- **Every configured address**, reached or not. Each fylr publishes, per
  address it dials, the broker client's state of it
  (:class:`~trio_broker.trio.client.AddressState`): ``connected``,
  ``draining``, ``connecting``, or ``unreachable`` with the latest dial's error
  and since when every dial failed. An address a fylr does not reach is drawn
  as a node of its own (``addr:<address>``), so an installation whose only
  execserver is down shows that execserver's address, in red, instead of
  nothing.
- **Replicas that went away** (:class:`Sightings`). Each fylr remembers the
  execserver instances its connections reached, with the last time it saw each
  (its ``HELLO``, the address it came through). An instance none of its
  connections reaches any more is published as lost, for :data:`LOST_FOR`
  seconds, then forgotten. The merge draws it as lost unless another live fylr
  still reaches it: a killed replica behind a balancer stays on the page, marked,
  instead of simply disappearing.
- **The queue** of the installation (:func:`queue_member`): one read of
  :meth:`Store.figures <trio_broker.trio.store.Store.figures>` per document
  (one statement): ready steps per priority with the oldest one's age,
  claimed, delayed with the soonest ``start_after``, failed.

**Health** (:func:`health`): a level for the header's dot and one line per
problem, by these rules:

============================================  =========
what                                          level
============================================  =========
an address a fylr cannot reach                ``error``
a callback check that did not pass            ``error``
a replica lost                                ``warning``
a ready step older than ``connect_timeout``   ``warning``
an address still connecting                   ``warning``
a fylr's own warning (its callback base)      ``warning``
============================================  =========

The level is the worst problem's, ``ok`` without any. ``connect_timeout`` (the
serving fylr's) is how long a step may wait for a slot before it is requeued:
a step ready for longer than that waits for more than a slot.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from trio_broker.trio.inspection import iso_time
from trio_broker.trio.store import QueueFigures
from trio_broker_daemons.commands.upload import PRIORITY_BANDS

__all__ = [
    "LEVELS",
    "LOST_FOR",
    "Sightings",
    "band_name",
    "health",
    "problem",
    "queue_member",
]

LOST_FOR: Final = 600.0
"""Seconds a replica no connection reaches any more stays drawn as lost."""
LEVELS: Final = ("ok", "warning", "error")
"""The health levels, from the best to the worst."""

_BAND_OF: Final = {priority: name for name, priority in PRIORITY_BANDS.items()}


def band_name(priority: int) -> str:
    """A priority's band (``normal``), its high variant (``normal+1``), or the number."""
    if priority in _BAND_OF:
        return _BAND_OF[priority]
    if priority - 1 in _BAND_OF:
        return f"{_BAND_OF[priority - 1]}+1"
    return str(priority)


class Sightings:
    """The execserver instances one fylr's connections reached, and when each was last seen.

    Args:
        keep_for: seconds an instance no connection reaches stays lost before it
            is forgotten.
    """

    def __init__(self, *, keep_for: float = LOST_FOR) -> None:
        self.keep_for = keep_for
        self._seen: dict[str, tuple[float, Mapping[str, Any]]] = {}

    def update(self, links: Sequence[Mapping[str, Any]], *, now: float) -> list[dict[str, Any]]:
        """Record the instances ``links`` reach now; return those lost (published form).

        Args:
            links: the fylr's published links (each ``instance_id``, ``address``,
                ``hello``).
            now: the wall clock (UNIX time).

        Returns:
            Per instance seen within ``keep_for`` that no link reaches now:
            ``instance_id``, ``address`` (as dialled), ``hello`` (its last) and
            ``lost_since`` (when it was last seen, ISO 8601), by instance id.
        """
        reached = set()
        for link in links:
            reached.add(link["instance_id"])
            self._seen[link["instance_id"]] = (now, link)
        lost = []
        for instance, (seen, link) in sorted(self._seen.items()):
            if instance in reached:
                continue
            if now - seen > self.keep_for:
                del self._seen[instance]
                continue
            lost.append(
                {
                    "instance_id": instance,
                    "address": link["address"],
                    "hello": link["hello"],
                    "lost_since": iso_time(seen),
                }
            )
        return lost


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _iso(value: datetime.datetime | None) -> str | None:
    return None if value is None else iso_time(value.timestamp())


def queue_member(figures: QueueFigures | None, *, wait_limit: float) -> dict[str, Any] | None:
    """The document's ``queue``: the installation's queue rows (``None`` when unread).

    Args:
        figures: :meth:`Store.figures <trio_broker.trio.store.Store.figures>`.
        wait_limit: how long a step may be ready before it counts as waiting too
            long (the serving fylr's ``connect_timeout``).
    """
    if figures is None:
        return None
    counts = figures.counts
    return {
        "ready": counts.ready,
        "oldest_ready_s": _seconds(figures.oldest_ready_s),
        "claimed": counts.claimed,
        "delayed": counts.delayed,
        "next_start_after": _iso(figures.next_start_after),
        "failed": counts.failed,
        "wait_limit_s": wait_limit,
        "bands": [
            {
                "priority": priority,
                "band": band_name(priority),
                "ready": band.ready,
                "oldest_ready_s": _seconds(figures.oldest_ready.get(priority)),
                "claimed": band.claimed,
                "delayed": band.delayed,
                "failed": band.failed,
            }
            for priority, band in figures.by_priority.items()
        ],
    }


def problem(level: str, kind: str, text: str, node: str | None = None) -> dict[str, Any]:
    """One line of the document's ``health.problems``."""
    return {"level": level, "kind": kind, "text": text, "node": node}


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _address_problems(document: Mapping[str, Any], names: Mapping[str, str]) -> Iterable[Any]:
    for address in document["addresses"]:
        fylr = names.get(address["fylr"], address["fylr"])
        if address["state"] == "unreachable":
            yield problem(
                "error",
                "unreachable",
                f"{fylr} cannot reach {address['address']} since"
                f" {address['unreachable_since']}: {address['last_error']}",
                address["node"],
            )
        elif address["state"] == "connecting":
            yield problem(
                "warning",
                "connecting",
                f"{fylr} is connecting to {address['address']}",
                address["node"],
            )


def _node_problems(document: Mapping[str, Any], names: Mapping[str, str]) -> Iterable[Any]:
    for execserver in document["execservers"]:
        if execserver["state"] == "lost":
            yield problem(
                "warning",
                "lost",
                f"{execserver['name']} ({execserver['instance_id']}) is gone: no connection"
                f" reaches it since {execserver['lost_since']}",
                execserver["id"],
            )
    exec_names = {e["id"]: e["name"] for e in document["execservers"]}
    for connection in document["connections"]:
        if connection["callback_ok"] is False:
            fylr = names.get(connection["fylr"], connection["fylr"])
            execserver = exec_names.get(connection["execserver"], connection["execserver"])
            yield problem(
                "error",
                "callback",
                f"{fylr}: callback check {execserver}: {connection['callback_check']}",
                connection["fylr"],
            )
    for fylr in document["fylrs"]:
        for warning in fylr["warnings"]:
            yield problem("warning", "fylr", f"{fylr['name']}: {warning}", fylr["id"])


def _queue_problems(queue: Mapping[str, Any] | None) -> Iterable[Any]:
    if queue is None or queue["oldest_ready_s"] is None:
        return
    age, limit = queue["oldest_ready_s"], queue["wait_limit_s"]
    if age > limit:
        yield problem(
            "warning",
            "backlog",
            f"{queue['ready']} steps ready in the queue; the oldest waits for"
            f" {_duration(age)}, longer than connect_timeout ({_duration(limit)})",
            None,
        )


def health(document: Mapping[str, Any]) -> dict[str, Any]:
    """The document's ``health``: its ``level`` and its ``problems`` (the module's rules).

    Args:
        document: the merged document, ``queue`` included, without ``health``.
    """
    names = {f["id"]: f["name"] for f in document["fylrs"]}
    problems = [
        *_address_problems(document, names),
        *_node_problems(document, names),
        *_queue_problems(document.get("queue")),
    ]
    level = max((p["level"] for p in problems), key=LEVELS.index, default="ok")
    return {"level": level, "problems": problems}
