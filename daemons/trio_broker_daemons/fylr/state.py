"""What the parts of one fylr process share: its resources, counters and change events.

Theory of operation
===================

One :class:`FylrState` per process is made by :func:`~trio_broker_daemons.fylr.app.serve_fylr`
once the database is open, and handed to the three parts that work with it: the
HTTP API (:mod:`~trio_broker_daemons.fylr.api`), the queue worker
(:mod:`~trio_broker_daemons.fylr.worker`) and the inspection pages
(:mod:`~trio_broker_daemons.fylr.metrics`). It owns no task and does no I/O of
its own; it holds:

- the resources: the configuration, the queue store and the ``files`` table on
  it, the stored files and their sweeper, the remote sources (``remote``), the
  one-time pipes, and (once started) the broker client and the dispatcher;
- the counters the HTTP side and the steps keep (:meth:`FylrState.count`,
  :meth:`FylrState.step`), read as a frozen :class:`FylrStatistics`;
- change notification without polling: :meth:`FylrState.changed` wakes whoever
  :meth:`~FylrState.watch`\\ es one original (``GET /api/v1/eas/<id>?wait=S``) and
  every :meth:`~FylrState.wait_changed` waiter (``FylrHandle.wait_until``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Final

import attrs
import trio

from trio_broker.trio.client import BrokerClient, ClientStatistics
from trio_broker.trio.dispatcher import Dispatcher, DispatcherStatistics
from trio_broker.trio.inspection import DURATION_BUCKETS, OUTCOMES, Buckets, Histogram
from trio_broker.trio.pipes import PipeRegistry, PipeStatistics
from trio_broker.trio.store import Store
from trio_broker_daemons.fylr.config import FileClass, FylrConfig
from trio_broker_daemons.fylr.files import FileStore
from trio_broker_daemons.fylr.remote_files import RemoteSources
from trio_broker_daemons.fylr.storage import Storage
from trio_broker_daemons.fylr.sweep import StorageSweeper

__all__ = ["STEP_OUTCOMES", "FileCounts", "FylrState", "FylrStatistics"]

COUNTERS = (
    "uploads",
    "uploads_refused",
    "uploads_aborted",
    "uploads_failed",
    "bytes_uploaded",
    "downloads",
    "results_retried",
)
"""The HTTP side's counters (and the worker's ``results_retried``), by name."""

STEP_OUTCOMES: Final[tuple[str, ...]] = (*OUTCOMES, "requeued", "replayed", "resync")
"""How a step ends, the one vocabulary of the fylr's step counts.

The receipt's statuses first, the words of the execserver's ``jobs_total``
(:data:`trio_broker.trio.inspection.OUTCOMES`): ``ok`` the step did its work
(a local step too); a job that ended otherwise gives its receipt's status
(``failed``, ``timed_out``, ``stalled``, ``out_of_memory``, …); ``error`` the
step failed for good without its command's verdict, like a receipt's ``error``
(a service nobody offers, a bad job object, a failed source version). Then the
ends without a verdict: ``requeued`` (it runs again later), ``replayed``
(nothing was left to do: a second run) and ``resync`` (the configuration
changed under a produce; a sync replaces it).
"""


@attrs.frozen(kw_only=True)
class FylrStatistics:
    """A snapshot of one fylr process (``FylrHandle.statistics()``).

    Attributes:
        backend_id: this process's backend id.
        uploads: uploads stored and recorded.
        uploads_refused: uploads refused before storing (bad request, too large).
        uploads_aborted: uploads whose sender went away before the end (nothing kept).
        uploads_failed: uploads the storage folder failed to keep (answered 503).
        bytes_uploaded: bytes of the recorded uploads.
        downloads: downloads started.
        results_retried: records of a finished job's result tried again because
            the database was unavailable (the job is never run again for that).
        steps: step ends by ``"<action>.<outcome>"``, the outcome one of
            :data:`STEP_OUTCOMES` (``produce.ok``, ``produce.failed``,
            ``metadata.timed_out``, ``sync.ok``, ``produce.requeued`` …).
        dispatcher: the dispatcher's snapshot (``None`` before it started).
        client: the broker client's snapshot (``None`` without execservers).
        pipes: the one-time pipes' counts and bytes.
        step_durations: seconds from a step's start to the dispatcher's decision,
            by ``(action, service, outcome)`` (:mod:`~trio_broker_daemons.fylr.timing`).
    """

    backend_id: str
    uploads: int
    uploads_refused: int
    uploads_aborted: int
    uploads_failed: int
    bytes_uploaded: int
    downloads: int
    results_retried: int
    steps: Mapping[str, int]
    dispatcher: DispatcherStatistics | None
    client: ClientStatistics | None
    pipes: PipeStatistics
    step_durations: Mapping[tuple[str, str, str], Histogram] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class FileCounts:
    """The ``files`` rows per ``(kind, status)`` as last counted (:meth:`FylrState.file_counts`).

    Attributes:
        counts: ``(kind, status)`` → rows.
        counted_at: when they were counted (UNIX time).
        age: seconds since then, when they were handed out.
    """

    counts: Mapping[tuple[str, str], int]
    counted_at: float
    age: float


class FylrState:
    """The state of one fylr process: what the API, the worker and the pages share.

    Args:
        config: the fylr configuration.
        backend_id: this process's backend id.
        store: the opened queue store (the ``files`` table lives beside the queue).
        storage: the stored files.
        database: how to describe the database in logs and pages.
    """

    def __init__(
        self,
        config: FylrConfig,
        *,
        backend_id: str,
        store: Store,
        storage: Storage,
        database: str,
    ) -> None:
        self.config = config
        self.backend_id = backend_id
        self.store = store
        self.files = FileStore(store)
        self.storage = storage
        self.remote = RemoteSources(config, store, storage)
        self.sweeper = StorageSweeper(storage, store, stale_after=config.stale_after)
        self.database = database
        self.pipes = PipeRegistry(backend_id)
        self.client: BrokerClient | None = None
        self.dispatcher: Dispatcher | None = None
        self.callback_warnings: Callable[[], list[str]] = list
        """The callback check's warnings (see ``brokercheck.CallbackCheck``)."""
        self.base_url = ""
        self.stopping = False
        self.stop_requested = trio.Event()
        self.closed = trio.Event()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.steps: dict[str, int] = {}
        self._step_durations: dict[tuple[str, str, str], Buckets] = {}
        self._watchers: dict[int, trio.Event] = {}
        self._watching: dict[int, int] = {}
        self._changed = trio.Event()
        self._counts: tuple[dict[tuple[str, str], int], float, float] | None = None
        self._counting = trio.Lock()

    # -- notifications ---------------------------------------------------------------------

    def changed(self, *file_ids: int | None) -> None:
        """Wake whoever waits for these originals, and every statistics waiter."""
        for file_id in file_ids:
            if file_id is not None:
                event = self._watchers.pop(file_id, None)
                if event is not None:
                    event.set()
        self._changed.set()
        self._changed = trio.Event()

    @contextlib.contextmanager
    def watch(self, file_id: int) -> Iterator[trio.Event]:
        """An event set at this process's next change of the original ``file_id``."""
        event = self._watchers.get(file_id)
        if event is None:
            event = self._watchers[file_id] = trio.Event()
        self._watching[file_id] = self._watching.get(file_id, 0) + 1
        try:
            yield event
        finally:
            left = self._watching.pop(file_id) - 1
            if left:
                self._watching[file_id] = left
            elif self._watchers.get(file_id) is event:
                del self._watchers[file_id]

    async def wait_changed(self) -> None:
        """Wait for the next :meth:`changed`."""
        await self._changed.wait()

    # -- counters --------------------------------------------------------------------------

    def count(self, counter: str, amount: int = 1) -> None:
        """Add ``amount`` to one of the :data:`COUNTERS`."""
        self.counters[counter] += amount
        self.changed()

    def step(self, action: str, outcome: str) -> None:
        """Count one step's end as ``<action>.<outcome>`` (``outcome`` of :data:`STEP_OUTCOMES`)."""
        if outcome not in STEP_OUTCOMES:
            raise ValueError(f"unknown step outcome {outcome!r}")
        key = f"{action}.{outcome}"
        self.steps[key] = self.steps.get(key, 0) + 1
        self.changed()

    def observe_step(self, action: str, service: str, outcome: str, seconds: float) -> None:
        """Count one step's duration (its start to its decision) by action, service and
        the decision's outcome."""
        key = (action, service, outcome)
        buckets = self._step_durations.get(key)
        if buckets is None:
            buckets = self._step_durations[key] = Buckets(DURATION_BUCKETS)
        buckets.observe(max(0.0, seconds))

    def statistics(self) -> FylrStatistics:
        """A frozen snapshot of the counters, the dispatcher, the client and the pipes."""
        c = self.counters
        return FylrStatistics(
            backend_id=self.backend_id,
            uploads=c["uploads"],
            uploads_refused=c["uploads_refused"],
            uploads_aborted=c["uploads_aborted"],
            uploads_failed=c["uploads_failed"],
            bytes_uploaded=c["bytes_uploaded"],
            downloads=c["downloads"],
            results_retried=c["results_retried"],
            steps=dict(self.steps),
            dispatcher=self.dispatcher.statistics() if self.dispatcher else None,
            client=self.client.statistics() if self.client else None,
            pipes=self.pipes.statistics(),
            step_durations={k: b.snapshot() for k, b in sorted(self._step_durations.items())},
        )

    async def file_counts(self) -> FileCounts:
        """The ``files`` counts, counted again at most once per ``counts_interval``.

        A full count reads every row; the pages and metrics that show them
        reuse the last one until it is ``counts_interval`` old, and scrapes that
        arrive together share one count.

        Raises:
            StoreUnavailable: a count was due and the database could not be read.
        """
        async with self._counting:
            now = trio.current_time()
            kept = self._counts
            if kept is None or now - kept[1] >= self.config.counts_interval:
                counts = await self.files.counts()
                kept = self._counts = (counts, now, time.time())
        counts, taken, wall = kept
        return FileCounts(counts=counts, counted_at=wall, age=max(0.0, now - taken))

    # -- configuration lookups -------------------------------------------------------------

    def file_class(self, name: str | None) -> FileClass | None:
        """The configured class of this name (``None`` for no class or an unknown one)."""
        return None if name is None else self.config.classes.get(name)

    def wake_dispatcher(self) -> None:
        """Claim now (new work was queued), when the dispatcher runs."""
        if self.dispatcher is not None:
            self.dispatcher.wake()
