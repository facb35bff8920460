"""What the topology flags, on made-up views: unreached addresses, lost replicas, the queue.

The same rules are driven over real processes and a real Chromium by
tests/daemons/test_topology_page.py; here each rule is pinned on its own,
with the clock passed in.
"""

from __future__ import annotations

import datetime
import io
from typing import Any

from rich.console import Console
from trio_broker_daemons.commands import top
from trio_broker_daemons.fylr.topology import topology_document
from trio_broker_daemons.fylr.trouble import Sightings, band_name, health, queue_member

from tests.daemons.test_topology import Document, backend, link, validate, view
from trio_broker.trio.store import QueueCounts, QueueFigures


def counts(ready: int = 0, delayed: int = 0, claimed: int = 0, failed: int = 0) -> QueueCounts:
    return QueueCounts(ready=ready, delayed=delayed, claimed=claimed, failed=failed)


def with_addresses(document: Document, *addresses: Document, lost: Any = ()) -> Document:
    document["addresses"] = [*document["addresses"], *addresses]
    document["lost"] = list(lost)
    return document


def unreachable(address: str, since: str = "2026-01-01T00:00:00.000Z") -> Document:
    return {
        "address": address,
        "balanced": False,
        "instances": [],
        "state": "unreachable",
        "connections": 0,
        "last_error": "ConnectionRefusedError: Connection refused",
        "unreachable_since": since,
    }


def test_sightings_keep_a_replica_gone_as_lost_for_a_while_then_forget_it() -> None:
    """An instance reached once and gone now is lost (since it was last seen) for
    keep_for seconds; back again it is not lost; past keep_for it is forgotten."""
    sightings = Sightings(keep_for=60.0)
    a, b = link("lb:1", "i1"), link("lb:1", "i2")
    assert sightings.update([a, b], now=1000.0) == []
    (lost,) = sightings.update([a], now=1010.0)
    assert lost == {
        "instance_id": "i2",
        "address": "lb:1",
        "hello": b["hello"],
        "lost_since": "1970-01-01T00:16:40.000Z",  # when it was last seen: 1000
    }
    assert [x["instance_id"] for x in sightings.update([a], now=1060.0)] == ["i2"]
    assert sightings.update([a], now=1060.5) == []  # 60.5 s after it was last seen
    assert sightings.update([a, b], now=1061.0) == []  # seen again: known again
    assert [x["instance_id"] for x in sightings.update([], now=1062.0)] == ["i1", "i2"]


def test_an_unreachable_address_is_a_red_node_linked_from_each_fylr_that_dials_it() -> None:
    """Two fylrs fail to reach one address: one node, both fylrs, the earliest since,
    a red link from each, one error problem per fylr; the level is error."""
    views = [
        backend(
            "f1",
            with_addresses(
                view("f1", [link("a:1", "i1")]), unreachable("dead:2", "2026-01-01T00:00:09.000Z")
            ),
        ),
        backend(
            "f2",
            with_addresses(view("f2", []), unreachable("dead:2", "2026-01-01T00:00:05.000Z")),
        ),
    ]
    document = topology_document(views, now=1.0)
    validate(document)
    (node,) = document["unreached"]
    assert node["id"] == "addr:dead:2"
    assert node["fylrs"] == ["fylr:f1", "fylr:f2"]
    assert node["unreachable_since"] == "2026-01-01T00:00:05.000Z"
    assert node["last_error"] == "ConnectionRefusedError: Connection refused"
    states = {(ln["from"], ln["to"]): ln["state"] for ln in document["links"]}
    assert states[("fylr:f1", "addr:dead:2")] == states[("fylr:f2", "addr:dead:2")] == "unreachable"
    assert states[("fylr:f1", "exec:i1")] == "connected"
    assert document["health"]["level"] == "error"
    kinds = [(p["kind"], p["node"]) for p in document["health"]["problems"]]
    assert kinds == [("unreachable", "addr:dead:2")] * 2


def test_an_address_with_connections_is_reached_even_in_an_older_view() -> None:
    """A view without address states (an older fylr's) is read from its links: no node
    of its own for an address it reaches, and no problem."""
    document = topology_document([backend("f1", view("f1", [link("a:1", "i1")]))], now=1.0)
    validate(document)
    assert document["unreached"] == []
    assert [(a["state"], a["node"]) for a in document["addresses"]] == [("connected", "exec:i1")]
    assert document["health"] == {"level": "ok", "problems": []}


def test_a_lost_replica_is_drawn_lost_unless_another_fylr_still_reaches_it() -> None:
    """f1 lost i2 and i3 behind lb:1; f2 still reaches i3: only i2 is lost, behind the
    balancer, with a lost link; one warning."""
    gone = [
        {
            "instance_id": i,
            "address": "lb:1",
            "hello": link("lb:1", i)["hello"],
            "lost_since": "2026-01-01T00:00:00.000Z",
        }
        for i in ("i2", "i3")
    ]
    views = [
        backend(
            "f1",
            with_addresses(view("f1", [link("lb:1", "i1")], ("lb:1",)), lost=gone),
        ),
        backend("f2", view("f2", [link("lb:1", "i3")], ("lb:1",))),
    ]
    document = topology_document(views, now=1.0)
    validate(document)
    states = {e["instance_id"]: e["state"] for e in document["execservers"]}
    assert states == {"i1": "connected", "i2": "lost", "i3": "connected"}
    (lost,) = [e for e in document["execservers"] if e["state"] == "lost"]
    assert lost["lost_since"] == "2026-01-01T00:00:00.000Z"
    assert lost["seen_by"] == ["fylr:f1"]
    assert document["balancers"][0]["instances"] == ["i1", "i3", "i2"]
    assert {"from": "lb:lb:1", "to": "exec:i2", "state": "lost", "warnings": []} in document[
        "links"
    ]
    assert document["health"]["level"] == "warning"
    assert [p["kind"] for p in document["health"]["problems"]] == ["lost"]


def test_the_queue_flags_a_step_ready_for_longer_than_connect_timeout() -> None:
    """The queue member carries each band and the oldest ready age; a step ready for
    longer than the wait limit is a warning, one within it none."""
    later = datetime.datetime(2026, 1, 1, 0, 5, tzinfo=datetime.UTC)
    figures = QueueFigures(
        counts=counts(ready=3, delayed=1, claimed=1, failed=2),
        by_priority={2: counts(ready=1), 0: counts(ready=2, claimed=1, delayed=1, failed=2)},
        oldest_ready={2: 4.04, 0: 31.0},
        next_start_after=later,
    )
    queue = queue_member(figures, wait_limit=30.0)
    assert queue is not None
    assert queue["oldest_ready_s"] == 31.0
    assert queue["next_start_after"] == "2026-01-01T00:05:00.000Z"
    assert [(b["band"], b["ready"], b["oldest_ready_s"]) for b in queue["bands"]] == [
        ("interactive", 1, 4.0),
        ("normal", 2, 31.0),
    ]
    document = topology_document([backend("f1", view("f1", []))], now=1.0, queue=queue)
    validate(document)
    (problem,) = document["health"]["problems"]
    assert problem["kind"] == "backlog"
    assert problem["text"] == (
        "3 steps ready in the queue; the oldest waits for 31 s, longer than connect_timeout (30 s)"
    )
    calm = queue_member(figures, wait_limit=60.0)
    assert health({**document, "queue": calm}) == {"level": "ok", "problems": []}
    assert queue_member(None, wait_limit=30.0) is None


def test_band_names() -> None:
    assert [band_name(p) for p in (-2, -1, 0, 1, 2, 3, 4, 5, 7)] == [
        "background",
        "background+1",
        "normal",
        "normal+1",
        "interactive",
        "interactive+1",
        "synchronous",
        "synchronous+1",
        "7",
    ]


def test_top_shows_the_health_the_unreached_the_lost_and_the_queue() -> None:
    """`top` draws what the page draws: the level, each problem, the address not
    reached, the lost replica, the queue per band."""
    gone = {
        "instance_id": "i2",
        "address": "a:2",
        "hello": link("a:2", "i2")["hello"],
        "lost_since": "2026-01-01T00:00:07.000Z",
    }
    figures = QueueFigures(
        counts=counts(ready=2, failed=1),
        by_priority={0: counts(ready=2, failed=1)},
        oldest_ready={0: 45.0},
    )
    document = topology_document(
        [
            backend(
                "f1",
                with_addresses(
                    view("f1", [link("a:1", "i1")]),
                    unreachable("dead:3", "2026-01-01T00:00:03.000Z"),
                    lost=[gone],
                ),
            )
        ],
        now=10.0,
        queue=queue_member(figures, wait_limit=30.0),
    )
    out = io.StringIO()
    Console(file=out, width=200).print(top.render(document))
    drawn = out.getvalue()
    assert "error: 1 fylr, 0 balancer, 1 execserver" in drawn
    assert "⚠ f1 cannot reach dead:3 since 2026-01-01T00:00:03.000Z" in drawn
    assert "⚠ name-i2 (i2) is gone" in drawn
    assert "⚠ 2 steps ready in the queue; the oldest waits for 45 s" in drawn
    assert "unreachable since 00:00:03 UTC" in drawn
    assert "lost since 00:00:07 UTC" in drawn
    assert "normal (0)" in drawn
    assert "45 s" in drawn
