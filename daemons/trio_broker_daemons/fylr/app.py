"""The reference fylr daemon: files in over HTTP, metadata and versions made on execservers.

Theory of operation
===================

:func:`serve_fylr` wires one process together, in one trio nursery:

- **the store**: PostgreSQL, either the configured ``database`` or a private
  cluster in ``state_dir/pg`` (:mod:`trio_broker_daemons.fylr.pgcluster`); migrations are
  applied at start. ``files`` (:mod:`trio_broker_daemons.fylr.files`) sits beside
  ``broker_queue``;
- **the storage**: stored files in ``state_dir/files`` (:mod:`trio_broker_daemons.fylr.storage`),
  which several fylrs may share. The process registers its backend id in the
  database before it writes anything, so that the other fylrs' sweeps see it
  alive; leftovers of writers that are gone (:mod:`trio_broker_daemons.fylr.sweep`)
  are swept at start and then periodically, never a live writer's files;
- **one HTTP listener** (hypercorn, trio worker) serving the application of
  :mod:`trio_broker_daemons.fylr.api`: the file API, health, inspection and
  metrics (:mod:`trio_broker_daemons.fylr.metrics`), and the one-time pipes and
  ``/whoami`` of the broker client; every route checks the role it declares
  (:mod:`trio_broker_daemons.fylr.access`). The roles without a token are
  logged at start: one info line on loopback, one warning with
  ``insecure_open_api``;
- **a broker client** (:mod:`trio_broker.trio.client`) to every configured execserver;
  the pipe URLs it puts into jobs point back at this listener;
- **a dispatcher** (:mod:`trio_broker.trio.dispatcher`) that drains ``broker_queue``
  into the steps of the queue worker (:mod:`trio_broker_daemons.fylr.worker`;
  an original's own produce step: :mod:`~trio_broker_daemons.fylr.derived_worker`)
  and the local actions (:mod:`~trio_broker_daemons.fylr.local_actions`),
  settles each step's one decision through them, and claims at once when
  the broker client's capacity changes (it watches the client itself). With
  ``parallel: 0`` (an API-only node) there is neither dispatcher nor broker
  client: the process only beats its heartbeat, and another fylr on the same
  database does the work.

What these parts share (resources, counters, change events) is one
:class:`~trio_broker_daemons.fylr.state.FylrState`.

Shutdown (:meth:`FylrHandle.stop`, SIGTERM through the daemon): the dispatcher
stops and returns its claimed items to the queue at once (running jobs are
cancelled at the execservers), the broker connections close, the listener stops,
then the database pool and the private cluster.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final

import trio
from starlette.applications import Starlette

from trio_broker._version import __version__
from trio_broker.core.admission import AdmissionConfig
from trio_broker.core.client import ClientConfig
from trio_broker.trio.client import BrokerClient, open_broker_client
from trio_broker.trio.dispatcher import Action, Dispatcher, DispatcherConfig, serve_dispatcher
from trio_broker.trio.listener import listener_config, serve_app
from trio_broker.trio.store import Store, StoreUnavailable, describe_dsn, open_store
from trio_broker_daemons.fylr.api import build_app
from trio_broker_daemons.fylr.brokercheck import (
    CallbackCheck,
    broker_ssl_context,
    check_execservers,
)
from trio_broker_daemons.fylr.config import FylrConfig, new_backend_id
from trio_broker_daemons.fylr.derived_worker import OwnProduceStep
from trio_broker_daemons.fylr.files import fylr_migrations
from trio_broker_daemons.fylr.local_actions import LocalActions
from trio_broker_daemons.fylr.metrics import inspect_document
from trio_broker_daemons.fylr.pgcluster import open_pg_cluster
from trio_broker_daemons.fylr.remote_steps import CopyStep
from trio_broker_daemons.fylr.state import FylrState, FylrStatistics
from trio_broker_daemons.fylr.storage import Storage
from trio_broker_daemons.fylr.timing import timed
from trio_broker_daemons.fylr.topology import topology_of
from trio_broker_daemons.fylr.worker import FileWorker
from trio_broker_daemons.runtime.logfmt import fields

__all__ = [
    "EMBEDDED_DATABASE",
    "FylrHandle",
    "FylrStatistics",
    "client_config",
    "dispatcher_config",
    "serve_fylr",
]

log = logging.getLogger("trio_broker_daemons.fylr.app")

EMBEDDED_DATABASE: Final = "fylr"
"""The database the fylr uses in its private cluster."""
_SHUTDOWN_TIMEOUT: Final = 10.0


class FylrHandle:
    """What :func:`serve_fylr` hands to ``task_status.started()``.

    Attributes:
        host, port: where the listener is bound (the real port when 0 was asked).
        url: ``http://host:port``.
        app: the application the listener serves (its ``routes``, its
            ``state.access``).
        backend_id: this process's backend id.
        files: the ``files`` table (tests and tools read it).
        storage: the stored files.
        sweeper: the storage sweep (:meth:`StorageSweeper.sweep` sweeps now).
        store: the queue database.
    """

    def __init__(self, state: FylrState, host: str, port: int, app: Starlette) -> None:
        self._state = state
        self.host = host
        self.port = port
        self.app = app
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}"
        self.backend_id = state.backend_id
        self.files = state.files
        self.storage = state.storage
        self.sweeper = state.sweeper
        self.store = state.store

    @property
    def dispatcher(self) -> Dispatcher | None:
        """The dispatcher (``None`` until it has started); its ``wait_until`` is exact."""
        return self._state.dispatcher

    def statistics(self) -> FylrStatistics:
        """A frozen snapshot of this process's counters, dispatcher, client and pipes."""
        return self._state.statistics()

    async def inspect(self) -> dict[str, Any]:
        """The document of ``/inspect/system/fylr`` (reads the database)."""
        return await inspect_document(self._state)

    def stop(self) -> None:
        """Stop gracefully (what SIGTERM does): :func:`serve_fylr` returns when done."""
        self._state.stop_requested.set()

    async def wait_until(self, predicate: Callable[[FylrStatistics], bool]) -> None:
        """Wait until ``predicate(self.statistics())`` holds.

        It is re-checked after every change this process makes to a file or to its
        own counters, and at least once a second for the figures of the dispatcher
        and the broker client, which change without telling. Bound it with a
        cancel scope.
        """
        while not predicate(self.statistics()):
            with trio.move_on_after(1.0):  # dispatcher and client counters change silently
                await self._state.wait_changed()

    async def wait_closed(self) -> None:
        """Wait until :func:`serve_fylr` has stopped everything."""
        await self._state.closed.wait()


def client_config(config: FylrConfig, *, backend_id: str, callback_port: int) -> ClientConfig:
    """The broker client's configuration for a fylr configuration (with execservers)."""
    return ClientConfig(
        backend_id=backend_id,
        name=config.name,
        version=__version__,
        callback_url=config.callback_own_url,
        callback_port=callback_port,
        addresses=config.execserver_addresses,
        connect_timeout=config.connect_timeout,
        pool_grow_interval=config.pool_grow_interval,
        pool_max=config.pool_max,
        pool_reprobe_interval=config.pool_reprobe_interval,
        ping_interval=config.ping_interval,
        ping_timeout=config.ping_timeout,
    )


def dispatcher_config(config: FylrConfig, *, backend_id: str) -> DispatcherConfig:
    """The dispatcher's configuration for a fylr configuration."""
    return DispatcherConfig(
        backend_id=backend_id,
        name=config.name,
        tick_interval=config.claim_interval,
        heartbeat_interval=config.heartbeat_interval,
        stale_after=config.stale_after,
        local_workers=config.resolved_local_workers(),
        admission=AdmissionConfig(max_in_flight=config.max_in_flight),
        retry_delay=config.retry_delay,
        shutdown_timeout=_SHUTDOWN_TIMEOUT,
    )


@contextlib.asynccontextmanager
async def _open_database(config: FylrConfig) -> AsyncIterator[tuple[str, str]]:
    """The DSN to use and how to describe it: the configured one, or the private cluster's."""
    if config.database is not None:
        yield config.database, describe_dsn(config.database)
        return
    async with open_pg_cluster(config.pg_dir) as cluster:
        dsn = await trio.to_thread.run_sync(cluster.ensure_database, EMBEDDED_DATABASE)
        log.info(
            "private PostgreSQL cluster started",
            extra=fields(folder=str(config.pg_dir), port=cluster.port),
        )
        yield dsn, f"embedded cluster in {config.pg_dir} (port {cluster.port})"


@contextlib.asynccontextmanager
async def _maybe_client(
    config: FylrConfig, state: FylrState, port: int
) -> AsyncIterator[BrokerClient | None]:
    callbacks = CallbackCheck(config, state.backend_id)
    state.callback_warnings = lambda: callbacks.warnings
    if not config.execservers or config.api_only:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(callbacks.serve, None)
            yield None
            nursery.cancel_scope.cancel()
        return
    context = broker_ssl_context(config)
    async with (
        trio.open_nursery() as nursery,
        open_broker_client(
            client_config(config, backend_id=state.backend_id, callback_port=port),
            broker_token=config.broker_token,
            ssl_context=context,
            pipes=state.pipes,
            max_frame_bytes=config.max_frame_bytes,
            wait_connected=None,
        ) as client,
    ):
        # a wrong token or an untrusted certificate is one clear log line, not a silence
        nursery.start_soon(check_execservers, config, context)
        # a callback base that misses this fylr is one warning, not a silence
        nursery.start_soon(callbacks.serve, client)
        yield client
        nursery.cancel_scope.cancel()


async def serve_fylr(
    config: FylrConfig,
    *,
    task_status: trio.TaskStatus[FylrHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a fylr until :meth:`FylrHandle.stop` (or until cancelled).

    Starts (or connects to) the database, registers its backend id, sweeps the
    storage of what killed writers left, binds the listener
    of ``config.listen`` (port 0 picks a free port), dials the execservers and
    starts the dispatcher; then calls ``task_status.started()`` with a
    :class:`FylrHandle`. Routes of the listener:

    ``PUT /eas/put?filename=NAME&priority=N``
        the body is the file; 201 with the file's document (``id`` …), 400 for
        a bad query, 413 over ``max_upload_size``.
    ``PUT /eas/rput?url=URL&priority=N[&leave_on_remote=1][&filename=NAME]``
        a file at a remote URL, copied in (the ``copy`` step) or left there;
        201 with its document, 400 for a bad query or a refused URL.
    ``GET /api/v1/eas/<id>[?wait=S]``
        the file's document (:func:`file_document`); 404 for an unknown id.
    ``POST /api/v1/eas/<id>/sync``
        sync an original again (202); 409 while it waits for its metadata step.
    ``GET /api/v1/eas/download/<id>/<version>``
        the stored original (``original``) or a ``done`` version; 404 otherwise.
    ``GET /healthz``, ``GET /inspect/system/fylr``, ``GET /metrics``
        health, the inspection document (JSON), Prometheus text.
    ``POST /inspect/system/fylr/requeue[?id=N]``, ``POST /inspect/system/fylr/sweep``
        retry the failed queue rows; sweep the storage folder now.
    ``PUT /eas/put?original=ID&version=NAME``, ``POST /eas/produce?source=ID&…``
        a manual version; a modified original.
    ``POST /inspect/system/fylr/checksum|copy_move|sync_check[?file=ID]``
        queue a local action for one file or all.
    ``GET /inspect/system/fylr/files``, ``GET /inspect/system/fylr/steps[/ID]``,
    ``POST …/steps/ID/cancel|retry``, ``POST …/files/ID/retry``, ``DELETE …/files/ID``,
    ``GET /inspect/system/queues``
        the work an operator acts on (:mod:`trio_broker_daemons.fylr.work`).

    While the database is unavailable every route that needs it answers 503
    with ``Retry-After``.
    ``GET|PUT /pipe/<id>``, ``GET /whoami``
        the broker client's one-time pipes and callback check.

    Args:
        config: the fylr configuration (:class:`~trio_broker_daemons.fylr.config.FylrConfig`).

    Raises:
        PostgresNotFound, PgClusterError: the private cluster could not start.
        StoreUnavailable: the database could not be reached.
    """
    backend_id = config.backend_id or new_backend_id(config.name)
    storage = Storage(
        config.storage_dir,
        writer=backend_id,
        locations=config.storage_locations,
        current=config.storage_location,
    )
    state: FylrState | None = None
    try:
        async with (
            _open_database(config) as (dsn, database),
            open_store(
                dsn, pool_size=config.database_pool, migrations=fylr_migrations(), wait=30.0
            ) as store,
        ):
            state = FylrState(
                config, backend_id=backend_id, store=store, storage=storage, database=database
            )
            # alive in the database before the first write: other fylrs' sweeps keep our files
            await store.register_backend(backend_id, config.name)
            await state.sweeper.sweep(startup=True)
            http_stopped = trio.Event()
            app = build_app(state)
            async with trio.open_nursery() as http_nursery:
                host, port = await http_nursery.start(
                    functools.partial(
                        serve_app,
                        app,
                        listener_config(config.listen),
                        shutdown_trigger=http_stopped.wait,
                    )
                )
                handle = FylrHandle(state, host, port, app)
                _log_open_roles(config, handle.url)
                state.base_url = handle.url
                try:
                    async with _maybe_client(config, state, port) as client:
                        state.client = client
                        async with trio.open_nursery() as work:
                            if config.api_only:  # parallel: 0: another fylr does the work
                                work.start_soon(_heartbeat, state)
                            else:
                                state.dispatcher = await work.start(
                                    _dispatcher_task(
                                        store, _actions(state), config, backend_id, client
                                    )
                                )
                            work.start_soon(topology_of(state).serve)
                            work.start_soon(state.sweeper.serve)
                            log.info(
                                "fylr serving",
                                extra=fields(
                                    url=handle.url,
                                    backend_id=backend_id,
                                    database=database,
                                    execservers=",".join(config.execservers) or None,
                                    api_only=config.api_only,
                                ),
                            )
                            task_status.started(handle)
                            await state.stop_requested.wait()
                            log.info("stopping: returning claimed items to the queue")
                            state.stopping = True
                            work.cancel_scope.cancel()
                finally:
                    state.stopping = True
                    http_stopped.set()
    finally:
        if state is not None:
            state.closed.set()
            log.info("fylr stopped", extra=fields(backend_id=backend_id))


def _log_open_roles(config: FylrConfig, url: str) -> None:
    """One line naming the roles anyone may use (no token): info on loopback, else a warning."""
    if not config.open_roles:
        return
    roles = ", ".join(config.open_roles)
    if config.insecure_open_api:
        log.warning(
            f"insecure_open_api: anyone who can reach {url} may use {roles} without a token",
            extra=fields(open_roles=roles, listen=config.listen),
        )
    else:
        log.info(
            f"no token for {roles}: anyone on this host may use them (the listener is on"
            " loopback only)",
            extra=fields(open_roles=roles, listen=config.listen),
        )


def _actions(state: FylrState) -> list[Action]:
    """The dispatcher's actions: the file worker's steps (an original's own produce step
    handled before a version's), the local actions, and the copy of a remote source,
    each timed (:mod:`~trio_broker_daemons.fylr.timing`)."""
    worker = FileWorker(state)
    actions = [
        *OwnProduceStep(worker).wrap(worker.actions()),
        *LocalActions(worker).actions(),
        *CopyStep(state).actions(),
    ]
    return timed(state, actions)  # each step's duration by action, service and outcome


async def _heartbeat(state: FylrState) -> None:
    """An API-only node's heartbeat (a dispatcher beats otherwise): its uploads in
    progress belong to a live backend, which no sweep touches. Unregistered at the end."""
    config = state.config
    try:
        while True:
            await trio.sleep(config.heartbeat_interval)
            try:
                await state.store.heartbeat(state.backend_id, config.name)
            except StoreUnavailable as exc:
                log.info("heartbeat failed", extra=fields(error=str(exc)))
    finally:
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(_SHUTDOWN_TIMEOUT),
            contextlib.suppress(StoreUnavailable),
        ):
            await state.store.unregister_backend(state.backend_id)


def _dispatcher_task(
    store: Store,
    actions: Sequence[Action],
    config: FylrConfig,
    backend_id: str,
    client: BrokerClient | None,
) -> Callable[..., Any]:
    """``serve_dispatcher`` bound to a fylr's store, actions and configuration."""

    async def run(task_status: trio.TaskStatus[Dispatcher]) -> None:
        await serve_dispatcher(
            store,
            actions,
            dispatcher_config(config, backend_id=backend_id),
            exec_client=client,
            task_status=task_status,
        )

    return run
