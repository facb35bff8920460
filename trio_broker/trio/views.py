"""Backend views: each client process's picture of the installation, shared in the database.

Theory of operation
===================

Every backend (a process that drains the queue: the reference fylr) knows
what it reaches (its execservers, the balancers in front of them, its callback
checks) and what it does. A page that shows the whole installation must draw
every backend, not only the one that serves it, and must not address the
others: they may sit behind a balancer of their own. So each backend
*publishes* its view into its row of ``broker_backends`` (queue migration
``002_backend_view.sql``: a ``jsonb`` column and the time it was written), and
any backend reads all of them back. The two statements are
:data:`~trio_broker.trio.queue_sql.PUBLISH_VIEW` and
:data:`~trio_broker.trio.queue_sql.READ_VIEWS`, beside the queue's others.

- :func:`publish_view` writes one backend's view (the row must exist: the
  dispatcher registers it; a backend swept as stale publishes nothing until it
  registers again) and, in the same borrowed connection, reads every backend's
  row, so one round trip both tells and learns.
- :func:`read_views` only reads (a page asked for the picture).

A view is any JSON object; its meaning is the application's. The database's
clock stamps it (``view_at``), and every row comes back with the database's
``now()``, so ages are measured on one clock whatever the backends' clocks say.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import psycopg
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb

from trio_broker.trio import queue_sql
from trio_broker.trio.store import Store

__all__ = ["BackendView", "publish_view", "read_views"]

Connection = psycopg.Connection[TupleRow]


@attrs.frozen(kw_only=True)
class BackendView:
    """One row of ``broker_backends`` with its published view.

    Attributes:
        backend_id, name: the backend.
        started: when it registered.
        heartbeat_age: seconds since its last heartbeat, on the database's clock.
        view: what it published last (None: nothing yet).
        view_age: seconds since it published it (None: nothing yet).
    """

    backend_id: str
    name: str
    started: datetime.datetime
    heartbeat_age: float
    view: Mapping[str, Any] | None
    view_age: float | None


def _views(conn: Connection) -> list[BackendView]:
    found = []
    for backend_id, name, started, heartbeat, view, view_at, now in conn.execute(
        queue_sql.READ_VIEWS
    ):
        found.append(
            BackendView(
                backend_id=backend_id,
                name=name,
                started=started,
                heartbeat_age=max(0.0, (now - heartbeat).total_seconds()),
                view=view if isinstance(view, dict) else None,
                view_age=None if view_at is None else max(0.0, (now - view_at).total_seconds()),
            )
        )
    return found


async def publish_view(
    store: Store, backend_id: str, view: Mapping[str, Any]
) -> tuple[bool, Sequence[BackendView]]:
    """Write this backend's view and read everyone's, in one call.

    Args:
        store: the queue database.
        backend_id: whose view it is.
        view: a JSON object.

    Returns:
        Whether the backend's row existed (False: nothing was written; it is not
        registered, or was swept as stale), and every backend's row afterwards.

    Raises:
        StoreUnavailable: the database could not be reached.
    """
    body = Jsonb(dict(view))

    def run(conn: Connection) -> tuple[bool, list[BackendView]]:
        written = conn.execute(queue_sql.PUBLISH_VIEW, (body, backend_id)).rowcount
        return written == 1, _views(conn)

    return await store.call(run, kind="publish_view")


async def read_views(store: Store) -> list[BackendView]:
    """Every backend's row and published view, oldest registration first.

    Raises:
        StoreUnavailable: the database could not be reached.
    """
    return await store.call(_views, kind="read_views")
