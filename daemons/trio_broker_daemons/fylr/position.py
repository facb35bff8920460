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

To either, the unclaimed rows of exec-bound actions that the dispatchers would
claim before the step's row (priority descending, then id; only rows whose
``start_after`` has passed) are added: :func:`~trio_broker.core.figures.queue_position`.
``position`` is the hard number; ``eta_s`` is a hint, marked as such by every
client that shows it ("roughly").

Asking keeps the execservers' figures coming for :data:`POSITION_LEASE`
seconds (the topology's subscription, :meth:`Topology.lease
<trio_broker_daemons.fylr.topology.Topology.lease>`), so a client following
its upload keeps them fresh, and nobody asking costs nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import psycopg
from psycopg.rows import TupleRow

from trio_broker.core.errors import StoreUnavailable
from trio_broker.core.figures import (
    Answer,
    QueuePosition,
    answer_from_position,
    answer_from_stats,
    queue_position,
)
from trio_broker.trio.store import QueueItem
from trio_broker_daemons.fylr.files import ACTION_METADATA, ACTION_PRODUCE, FileRow
from trio_broker_daemons.fylr.state import FylrState
from trio_broker_daemons.fylr.topology import topology_of

__all__ = ["POSITION_LEASE", "StepRow", "add_queue_positions", "step_job_id"]

log = logging.getLogger("trio_broker_daemons.fylr.position")

POSITION_LEASE: Final = 30.0
"""Seconds the execservers' figures keep coming after a position was asked for."""
QUERY_TIMEOUT: Final = 2.0
"""Seconds to wait for the execservers' ``POSITION`` answers."""
EXEC_ACTIONS: Final = (ACTION_METADATA, ACTION_PRODUCE)

Connection = psycopg.Connection[TupleRow]

_STEPS = """
SELECT q.id, q.file_ref, q.action, q.priority, q.status, q.claimed_by, q.attempts,
       (SELECT count(*) FROM file_queue r
         WHERE r.status = 'new' AND r.start_after <= now()
           AND r.action = ANY(%(actions)s::text[])
           AND (r.priority > q.priority OR (r.priority = q.priority AND r.id < q.id)))
  FROM file_queue q
 WHERE q.file_ref = ANY(%(refs)s::text[]) AND q.action = ANY(%(actions)s::text[])
   AND q.status IN ('new', 'claimed')
 ORDER BY q.id
"""


def step_job_id(item: QueueItem) -> str:
    """The broker job id of one claim of a step: the row and its attempt (unique per claim)."""
    return f"q{item.id}.{item.attempts}"


@attrs.frozen(kw_only=True)
class StepRow:
    """A waiting exec-bound step's queue row and the unclaimed rows ahead of it."""

    item: QueueItem
    rows_ahead: int


async def waiting_steps(state: FylrState, file_ids: Sequence[int]) -> list[StepRow]:
    """The queue rows of exec-bound steps of these files that are new or claimed.

    Raises:
        StoreUnavailable: the database could not be read.
    """

    def run(conn: Connection) -> list[StepRow]:
        found = []
        params = {"refs": [str(i) for i in file_ids], "actions": list(EXEC_ACTIONS)}
        for row in conn.execute(_STEPS, params):
            item = QueueItem(
                id=row[0],
                file_ref=row[1],
                action=row[2],
                priority=row[3],
                status=row[4],
                claimed_by=row[5],
                attempts=row[6],
            )
            found.append(StepRow(item=item, rows_ahead=row[7]))
        return found

    return await state.store.call(run, kind="queue_positions")


def _may_wait(row: FileRow) -> bool:
    """Whether the row's state allows an exec-bound step of it in the queue (read none else)."""
    if row.kind == "original":
        return row.status in ("new", "metadata")
    return row.status in ("new", "produce")


def _service_of(state: FylrState, row: FileRow) -> str | None:
    """The service a file's exec-bound step runs (None: its class has none any more)."""
    if row.kind == "original":
        file_class = state.file_class(row.file_class)
        step = None if file_class is None else file_class.metadata
        return None if step is None else step.service
    file_class = state.file_class(row.file_class)
    if file_class is None or row.version is None or row.version not in file_class.versions:
        return None
    return file_class.versions[row.version].service


async def _position(state: FylrState, step: StepRow, service: str) -> dict[str, Any] | None:
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
    position = queue_position(answers, rows_ahead=step.rows_ahead)
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
        steps = await waiting_steps(state, list(rows))
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
        service = None if file_row is None else _service_of(state, file_row)
        if file_row is not None and service is not None:
            targets[file_row.id]["queue"] = await _position(state, step, service)
