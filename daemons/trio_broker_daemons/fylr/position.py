"""Queue positions for the file API: "3 running, 7 waiting, you are number 11".

Theory of operation
===================

While a file's exec-bound step (``metadata`` of an original, ``produce`` of a
version) waits for a slot, :func:`add_queue_positions` gives the step's part of
``GET /api/v1/eas/<id>`` a ``queue`` member; a step that runs, or has ended,
has ``queue: null``. The figures come from where the step is:

- **Parked at execservers by this fylr** (its row is claimed here and the job
  waits in this process's broker client, under the job id
  :func:`step_job_id`): ``QUERY``/``POSITION`` on every connection where the
  want is parked; the best answer counts (``basis: "execserver"``), exact by
  the grant rule.
- **Not parked yet** (the row is unclaimed), or parked by another fylr (whose
  broker connections this process cannot ask): from the execservers' latest
  ``STATS`` (``basis: "figures"``), every want waiting there at the step's
  priority or above is ahead of it. For a step parked elsewhere that count
  includes the step's own want, so it is at most one too high.

Either is merged with the queue's book
(:func:`~trio_broker.core.figures.queue_position`), which the store counts in
its own claim order in one statement (:meth:`Store.positions
<trio_broker.trio.store.Store.positions>`, rows of exec-bound actions only):
the claimed rows ahead of the step that hold no slot count when they are more
than the execservers' wants ahead (a dispatcher holds claimed rows it has not
offered yet, which no execserver sees: counting only the execservers' book made
"1 waiting, you are number 41" and estimates ten times too short), and the
unclaimed rows ahead of it (only rows whose ``start_after`` has passed) come on
top. ``running`` and ``capacity`` add up over the execservers that answered, and
``waiting`` is never below ``position``.
``position`` is the hard number; ``eta_s`` is a hint, marked as such by every
client that shows it ("roughly").

Why a step waits. A step the dispatcher requeued (no slot within
``connect_timeout``, no connected execserver offering its service, an
execserver that drained under its job) carries the reason from that moment on:
its row's ``waits_because`` (:class:`~trio_broker.trio.store.QueueItem`),
written with the requeue. Its ``queue`` member then has ``waits_because``,
``retry_at`` and ``retry_in_s`` (when it is tried again) beside the position,
or alone when no position can be had; ``trio-broker position`` and
``upload --wait`` print them at once.

Asking keeps the execservers' figures coming for :data:`POSITION_LEASE`
seconds (the topology's subscription, :meth:`Topology.lease
<trio_broker_daemons.fylr.topology.Topology.lease>`), so a client following
its upload keeps them fresh, and nobody asking costs nothing.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

from trio_broker.core.errors import StoreUnavailable
from trio_broker.core.figures import (
    Answer,
    QueuePosition,
    answer_from_position,
    answer_from_stats,
    queue_position,
)
from trio_broker.trio.store import ItemPosition, QueueItem
from trio_broker_daemons.fylr.derived import own_produce
from trio_broker_daemons.fylr.files import ACTION_METADATA, ACTION_PRODUCE, FileRow
from trio_broker_daemons.fylr.state import FylrState
from trio_broker_daemons.fylr.topology import topology_of

__all__ = ["POSITION_LEASE", "add_queue_positions", "step_job_id"]

log = logging.getLogger("trio_broker_daemons.fylr.position")

POSITION_LEASE: Final = 30.0
"""Seconds the execservers' figures keep coming after a position was asked for."""
QUERY_TIMEOUT: Final = 2.0
"""Seconds to wait for the execservers' ``POSITION`` answers."""
EXEC_ACTIONS: Final = (ACTION_METADATA, ACTION_PRODUCE)


def step_job_id(item: QueueItem) -> str:
    """The broker job id of one claim of a step: the row and its attempt (unique per claim)."""
    return f"q{item.id}.{item.attempts}"


def _may_wait(row: FileRow) -> bool:
    """Whether the row's state allows an exec-bound step of it in the queue (read none else)."""
    if row.kind == "original":
        return row.status in ("pending_produce", "new", "metadata")
    return row.status in ("new", "produce")


def service_of(state: FylrState, row: FileRow) -> str | None:
    """The service a file's exec-bound step runs (None: its class has none any more)."""
    if row.kind == "original" and row.status == "pending_produce":  # its own produce step
        own = own_produce(state.config, filename=row.filename, derivation=row.derivation)
        return None if isinstance(own, str) else own.service
    if row.kind == "original":
        file_class = state.file_class(row.file_class)
        step = None if file_class is None else file_class.metadata
        return None if step is None else step.service
    file_class = state.file_class(row.file_class)
    if file_class is None or row.version is None or row.version not in file_class.versions:
        return None
    return file_class.versions[row.version].service


async def _position(state: FylrState, step: ItemPosition, service: str) -> dict[str, Any] | None:
    client = state.client
    if client is None:
        return None
    item = step.item
    links = {link.conn: link for link in client.links()}
    answers: list[Answer] = []
    basis = "figures"
    if item.status == "claimed" and item.claimed_by == state.backend_id:
        job_id = step_job_id(item)
        if client.is_running(job_id):
            return None  # it holds a slot: not waiting any more
        for conn, answer in await client.position_answers(job_id, timeout=QUERY_TIMEOUT):
            link = links.get(conn)
            instance = link.hello.instance_id if link else str(conn)
            answers.append(
                answer_from_position(instance, answer, link.stats if link else None, service)
            )
        basis = "execserver"
    if not answers:
        basis = "figures"
        seen: set[str] = set()
        for link in links.values():
            if link.stats is not None and link.stats.instance_id not in seen:
                seen.add(link.stats.instance_id)
                found = answer_from_stats(link.stats, service, item.priority)
                if found is not None:
                    answers.append(found)
    position = queue_position(
        answers,
        rows_ahead=step.ahead,
        claimed_ahead=step.claimed_ahead,
        ready_rows=step.ready,
        claimed_rows=step.claimed,
    )
    return None if position is None else _document(position, item, basis)


def _document(position: QueuePosition, item: QueueItem, basis: str) -> dict[str, Any]:
    return {
        "action": item.action,
        "item": item.id,
        "priority": item.priority,
        "basis": basis,
        "running": position.running,
        "waiting": position.waiting,
        "position": position.position,
        "capacity": position.capacity,
        "eta_s": position.eta_s,
        "rows_ahead": position.rows_ahead,
        "held_ahead": position.held_ahead,
        "instance_id": position.instance_id,
    }


async def add_queue_positions(
    state: FylrState, document: dict[str, Any], row: FileRow, versions: Sequence[FileRow]
) -> None:
    """Give each waiting exec-bound step of ``document`` its ``queue`` member (in place).

    The original's (or the version's) own step goes to ``document["queue"]``,
    each version's to ``document["versions"][name]["queue"]``; ``null`` where a
    step does not wait. Never raises for an unreachable database: the
    positions are then left ``null``.
    """
    rows: Mapping[int, FileRow] = {r.id: r for r in (row, *versions)}
    targets: dict[int, dict[str, Any]] = {row.id: document}
    for version in versions:
        name = version.version
        if name is not None and name in document.get("versions", {}):
            targets[version.id] = document["versions"][name]
    for target in targets.values():
        target["queue"] = None
    if row.finished or state.client is None or not any(map(_may_wait, rows.values())):
        return
    try:
        refs = [str(file_id) for file_id in rows]
        steps = await state.store.positions(refs, actions=EXEC_ACTIONS)
    except StoreUnavailable as exc:
        log.info("queue positions unavailable: %s", exc)
        return
    if not steps:
        return
    topology = topology_of(state)
    topology.lease(POSITION_LEASE)
    await topology.wait_for_figures()
    for step in steps:
        file_row = rows.get(int(step.item.file_ref))
        service = None if file_row is None else service_of(state, file_row)
        if file_row is not None and service is not None:
            found = await _position(state, step, service)
            targets[file_row.id]["queue"] = _with_reason(found, step.item)


def _with_reason(position: dict[str, Any] | None, item: QueueItem) -> dict[str, Any] | None:
    """Say why a requeued step waits (its row's ``waits_because``) and when it is tried
    again, beside its position (or alone, when no position could be had)."""
    if item.status != "new" or not item.waits_because:
        return position
    document = position or {
        "action": item.action,
        "item": item.id,
        "priority": item.priority,
        "basis": None,
        "running": None,
        "waiting": None,
        "position": None,
        "capacity": None,
        "eta_s": None,
        "rows_ahead": None,
        "held_ahead": None,
        "instance_id": None,
    }
    retry_in = None
    if item.start_after is not None:
        now = datetime.datetime.now(datetime.UTC)
        retry_in = max(0.0, (item.start_after - now).total_seconds())
    return {
        **document,
        "waits_because": item.waits_because,
        "retry_at": None if item.start_after is None else item.start_after.isoformat(),
        "retry_in_s": retry_in,
    }
