"""The execserver's broker: the whole protocol as a sans-IO state machine.

Theory of operation
===================

A :class:`Broker` is the decision logic of one execserver and nothing else. It
never touches a socket, a process or a clock. The code around it (the trio layer,
or a test) feeds it *inputs* and drains its *outputs*:

inputs (each takes ``now``, a monotonic time in seconds; it never goes backwards)
    :meth:`~Broker.open_connection`, :meth:`~Broker.receive_text` /
    :meth:`~Broker.receive`, :meth:`~Broker.close_connection`,
    :meth:`~Broker.job_ended`, :meth:`~Broker.callback_checked`,
    :meth:`~Broker.tick`, :meth:`~Broker.drain`, :meth:`~Broker.stop`.

outputs (drain after every input)
    :meth:`~Broker.frames_to_send`: ``(connection, message)`` pairs, in order;
    :meth:`~Broker.effects`: what the runner and the transport must do:
    :class:`StartJob`, :class:`AbortJob`, :class:`CloseConnection`,
    :class:`CheckCallback`, :class:`Drained`.

timers
    :meth:`~Broker.next_deadline` says when :meth:`~Broker.tick` is due next (or
    None). Offer expiry, the one-second ``HELLO`` window, the per-second ``idle``
    figure, liveness pings, the ``ping_timeout``, the drain timeout and the
    once-a-second look of a ``STATS`` subscription (:mod:`trio_broker.core.figures`)
    all live here, so a test drives every one of them with plain numbers.

The life of a slot
------------------

``WANT`` parks a want in the :class:`~trio_broker.core.book.WantBook`. Whenever a slot
may have become usable (a want arrived, a job ended, an offer was declined,
withdrawn or expired, a connection closed), the broker runs the *grant loop*:
while the :class:`~trio_broker.core.pool.SlotPool` has services that fit, the book
picks the next want by the grant rule and the broker sends it an ``OFFER`` with a
fresh single-use token; the slot is busy from that moment. ``JOB`` redeems the
token and the broker emits :class:`StartJob`; :meth:`~Broker.job_ended` frees the
slot, teaches the pool the service's runtime and memory, and sends ``DONE``.

Invariants (:meth:`Broker.check_invariants`)
--------------------------------------------

* busy slots = outstanding offers + running jobs, within every pool limit;
* *work-conserving*: after every input no free slot coexists with a parked want
  whose service fits (the grant loop runs to exhaustion);
* each job_id is live at most once per connection: parked, offered or running;
* a closed connection leaves no want, offer or token behind; its running jobs are
  being stopped and their receipts are not delivered.

Refusals
--------

A decoded frame is first held against :data:`REFUSALS`, an ordered table whose
rows each name the frames they look at, a rule (a question about the broker and
the connection that changes nothing) and the ``ERROR`` code and message sent when
the rule is broken. The first broken row answers and the frame is otherwise
ignored; a frame that breaks no row is taken. The rows follow the precedence of
``PROTOCOL.md`` (section 8, :data:`~trio_broker.core.errors.ErrorCode` order):
the codec decided ``bad_frame``, ``unknown_type`` and ``bad_field`` before the
frame got here (the table repeats ``unknown_type`` for messages handed to
:meth:`~Broker.receive` already decoded), then ``not_registered``,
``already_registered``, ``draining``, ``unknown_service``, ``duplicate_job``,
``unknown_token``, ``token_mismatch``, ``unknown_job`` and ``too_many_wants``
(last: only a ``WANT`` breaks it, after every other rule a ``WANT`` can break). So a ``JOB`` from an
unregistered connection while draining is ``not_registered``, and a ``JOB`` naming
a service not offered here with a stale token is ``unknown_service``.

HELLO rounds
------------

A connection's first ``HELLO`` goes out when it opens. Later changes of what
every connection is told (services and their kinds, the pool, ``idle``,
``clients``) only mark the broker *changed* and arm one *round* at the end of the
current whole second (the seconds ``idle`` is cut into). The round tells each
connection that is behind and was last told at least :data:`HELLO_INTERVAL`
earlier; a connection told more recently (a newcomer) is passed over to the next
round. So a change costs O(1) whatever the number of connections, a round costs
O(connections) at most once a second, and a burst of arrivals within one second
costs each open connection one ``HELLO``, not one per arrival. The draining
``HELLO`` goes out at once, outside the rounds.

Limits
------

A peer cannot make the broker keep more than it bounds: at most
``max_wants_per_connection`` wants parked or offered per connection (one more
``WANT`` is refused with ``too_many_wants``, and nothing changes); the strings of
``REGISTER`` are bounded by the codec (``bad_field`` beyond); a ``JOB.subject`` is
kept, logged and shown cut to :data:`~trio_broker.core.protocol.MAX_SUBJECT_CHARS`
(:func:`~trio_broker.core.protocol.clip_subject`); frames and the frames queued
per connection are bounded by the driver.

Liveness after a stall
----------------------

Silence is judged by what a peer sent, not by when this process got round to
reading it: time during which the code driving the broker could not run (the
process was stopped, or starved) does not count as the peer's silence. The driver
says so through :meth:`~Broker.tick`'s ``due`` (see
:class:`~trio_broker.core.sansio.SansIOCore`).

Errors by blame
---------------

The exception tree is drawn in :mod:`trio_broker.core.errors`. A peer's bad
frame never raises: it becomes an ``ERROR`` frame with the protocol's code and
changes nothing else (remote). A caller's misuse (a connection id this broker
never issued, a run id that is not running, time going backwards) raises
:class:`~trio_broker.core.errors.BrokerUsageError` *before* anything changes,
the clock included (local).

A connection id the broker issued and has since closed is not misuse: a reader
may have had a frame in hand when the close happened, and the transport reports
every close, even one the broker asked for. Inputs naming such a connection
are taken (the time advances) and otherwise ignored.
"""

from __future__ import annotations

import itertools
import math
import secrets
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Final, Literal, TypeAlias, assert_never

import attrs

from trio_broker.core import protocol as p
from trio_broker.core.book import ParkedWant, WantBook
from trio_broker.core.errors import BrokerUsageError
from trio_broker.core.figures import STATS_INTERVAL, JobFigures, Subscriptions, service_figures
from trio_broker.core.liveness import Liveness
from trio_broker.core.pool import PoolConfig, SlotPool
from trio_broker.core.sansio import SansIOCore

__all__ = [
    "REFUSALS",
    "AbortJob",
    "Broker",
    "BrokerConfig",
    "BrokerUsageError",
    "CheckCallback",
    "CloseConnection",
    "Drained",
    "Effect",
    "Refusal",
    "StartJob",
    "new_token",
]

ConnId: TypeAlias = int
RunId: TypeAlias = int

HELLO_INTERVAL: Final = 1.0
"""Re-sent ``HELLO`` frames on one connection are at least this far apart, and
HELLO rounds happen at the end of the broker's whole seconds."""


def new_token() -> str:
    """A fresh offer token: 128 random bits, URL-safe, 22 characters."""
    return secrets.token_urlsafe(16)


def _name_of(function: Callable[..., Any]) -> str:
    """A function's name, as code that pastes back where the name is known."""
    return getattr(function, "__qualname__", None) or repr(function)


# -- configuration and outputs --------------------------------------------------


@attrs.frozen(kw_only=True)
class BrokerConfig:
    """Everything the broker decides with. Durations are seconds.

    Attributes:
        instance_id: random per process; lets clients tell replicas apart.
        name: the host name shown to clients.
        pool: the slot pool's limits and offered services.
        offer_ttl: how long an offer waits for its ``JOB``.
        ping_interval: send ``PING`` after sending nothing for this long.
        ping_timeout: close a connection that sent nothing for this long.
        drain_timeout: how long running jobs may finish after :meth:`Broker.drain`.
        turn_hold: how long a slot freed by a connection that is owed the next turn
            waits for that connection's next ``WANT`` (0 = never held); see
            *Turn hold* in :mod:`trio_broker.core.book`.
        max_wants_per_connection: how many wants one connection may have parked or
            offered at once; a ``WANT`` beyond it is refused with ``too_many_wants``
            (see *Limits* in the module docstring).
        recent_receipts: how many finished jobs :meth:`Broker.statistics` keeps.
        token_factory: makes offer tokens (tests pass a deterministic one).
    """

    instance_id: str
    name: str
    pool: PoolConfig
    offer_ttl: float = 10.0
    ping_interval: float = 5.0
    ping_timeout: float = 15.0
    drain_timeout: float = 60.0
    turn_hold: float = 0.05
    max_wants_per_connection: int = 10_000
    recent_receipts: int = 100
    token_factory: Callable[[], str] = attrs.field(default=new_token, repr=_name_of)

    def __attrs_post_init__(self) -> None:
        for name in ("offer_ttl", "ping_interval", "ping_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("drain_timeout", "turn_hold"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_wants_per_connection < 1:
            raise ValueError(
                f"max_wants_per_connection must be at least 1, got {self.max_wants_per_connection}"
            )


@attrs.frozen(kw_only=True)
class StartJob:
    """Start a job in the slot its offer reserved; report its end with job_ended."""

    run_id: RunId
    conn: ConnId
    job_id: str
    service: str
    subject: str | None
    job: dict[str, Any]
    traceparent: str | None = None  # JOB.traceparent, passed through


@attrs.frozen(kw_only=True)
class AbortJob:
    """End a running job now; its receipt still comes through job_ended."""

    run_id: RunId
    status: Literal["cancelled", "stopped"]
    reason: str


@attrs.frozen(kw_only=True)
class CloseConnection:
    """Close this connection's websocket with this close code."""

    conn: ConnId
    code: int
    reason: str


@attrs.frozen(kw_only=True)
class CheckCallback:
    """Fetch ``<url>/whoami`` and report with callback_checked."""

    conn: ConnId
    url: str
    backend_id: str


@attrs.frozen(kw_only=True)
class Drained:
    """Draining is complete: no job runs; close every connection (1001) and exit."""


Effect: TypeAlias = StartJob | AbortJob | CloseConnection | CheckCallback | Drained


# -- statistics snapshots ---------------------------------------------------------


@attrs.frozen(kw_only=True)
class ServiceSnapshot:
    name: str
    kind: p.Kind
    max_slots: int
    capacity: int
    running: int
    offered: int
    parked: int
    completed: int
    mean_runtime: float | None
    peak_memory: int | None
    footprint: int | None


@attrs.frozen(kw_only=True)
class ConnectionSnapshot:
    conn: ConnId
    addr: str
    opened_at: float
    register: p.Register | None
    callback_check: str | None
    parked: int
    offered: int
    running: int


@attrs.frozen(kw_only=True)
class FinishedJob:
    """One ended job (:meth:`Broker.job_ended` returns it; ``recent`` keeps the last).

    ``wait_s`` is the time from its ``WANT`` here to its ``JOB`` (the slot wait
    plus the client's answer to the offer); ``client`` the ``REGISTER.name`` of
    the connection that sent the job.
    """

    job_id: str
    service: str
    subject: str | None
    conn: ConnId
    backend_id: str | None
    delivered: bool
    receipt: p.Receipt
    wait_s: float = 0.0
    client: str | None = None


@attrs.frozen(kw_only=True)
class BrokerStatistics:
    """A frozen snapshot for inspection pages and metrics."""

    instance_id: str
    name: str
    slots: int
    fast_reserve: int
    unknown_cap: int
    memory_budget: int | None
    memory_reserved: int
    busy: int
    idle: int
    draining: bool
    services: tuple[ServiceSnapshot, ...]
    connections: tuple[ConnectionSnapshot, ...]
    recent: tuple[FinishedJob, ...]
    counters: dict[str, int]


# -- internal records ---------------------------------------------------------------


class _Offer:
    __slots__ = (
        "conn",
        "expires_at",
        "job_id",
        "priority",
        "reserved",
        "service",
        "timer",
        "token",
    )

    def __init__(
        self,
        token: str,
        conn: ConnId,
        job_id: str,
        service: str,
        priority: int,
        expires_at: float,
        reserved: int,
    ) -> None:
        self.token = token
        self.conn = conn
        self.job_id = job_id
        self.service = service
        self.priority = priority
        self.expires_at = expires_at
        self.reserved = reserved
        self.timer: int | None = None  # the handle of its expiry timer while armed


class _Hold:
    """A freed slot kept for the connection owed the next turn at ``priority``."""

    __slots__ = ("conn", "expires_at", "priority", "reserved", "service")

    def __init__(
        self, conn: ConnId, service: str, priority: int, reserved: int, expires_at: float
    ) -> None:
        self.conn = conn
        self.service = service
        self.priority = priority
        self.reserved = reserved
        self.expires_at = expires_at


class _Run:
    __slots__ = (
        "aborting",
        "client",
        "conn",
        "job_id",
        "priority",
        "reserved",
        "run_id",
        "service",
        "subject",
        "wait_s",
    )

    def __init__(
        self,
        run_id: RunId,
        conn: ConnId,
        job_id: str,
        service: str,
        subject: str | None,
        reserved: int,
        *,
        wait_s: float,
        client: str | None,
        priority: int,
    ) -> None:
        self.run_id = run_id
        self.conn = conn
        self.job_id = job_id
        self.service = service
        self.subject = subject
        self.reserved = reserved
        self.wait_s = wait_s
        self.client = client
        self.priority = priority
        self.aborting: str | None = None


class _Conn:
    __slots__ = (
        "addr",
        "callback_check",
        "hello_sent_at",
        "hello_told",
        "id",
        "last_recv",
        "last_sent",
        "offers",
        "opened_at",
        "register",
        "runs",
        "wanted_at",
    )

    def __init__(self, conn_id: ConnId, addr: str, now: float) -> None:
        self.id = conn_id
        self.addr = addr
        self.opened_at = now
        self.register: p.Register | None = None
        self.callback_check: str | None = None
        self.last_recv = now
        self.last_sent = now
        self.hello_told: Hashable = None
        self.hello_sent_at = now
        self.offers: dict[str, _Offer] = {}
        self.runs: dict[str, _Run] = {}
        # when each parked or offered job's WANT arrived (statistics: the wait)
        self.wanted_at: dict[str, float] = {}


_TimerKind: TypeAlias = Literal[
    "offer", "ping", "dead", "hello", "second", "drain", "stats", "hold"
]


# -- refusals --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Refusal:
    """One row of :data:`REFUSALS`: a rule some frames must keep, and its ``ERROR``.

    Each rule reads on its own (it does not count on the rows before it), so a
    frame may break several; the table's order says which one answers.

    Attributes:
        code: the ``ERROR.code`` sent when the rule is broken.
        frames: the wire types of the frames the rule looks at.
        broken: whether the frame breaks the rule, asked of the broker and the
            frame's connection (it changes nothing).
        text: the ``ERROR.message`` of a broken rule (for people, not stable).
    """

    code: p.ErrorCode
    frames: tuple[str, ...]
    broken: Callable[[Broker, _Conn, Any], bool] = attrs.field(repr=False)
    text: Callable[[Broker, _Conn, Any], str] = attrs.field(repr=False)


_ANY_TIME: Final = frozenset({"REGISTER", "PING", "PONG"})
"""The frames a connection may send before its ``REGISTER``."""


def _offer_here(broker: Broker, conn: _Conn, token: str) -> _Offer | None:
    """The outstanding offer of this connection that ``token`` names, if any."""
    offer = broker._offers.get(token)
    return offer if offer is not None and offer.conn == conn.id else None


def _mismatched(broker: Broker, conn: _Conn, job: p.Job) -> bool:
    """Whether the ``JOB`` names an offer of this connection made for another job."""
    offer = _offer_here(broker, conn, job.token)
    return offer is not None and (offer.job_id, offer.service) != (job.job_id, job.service)


REFUSALS: Final[tuple[Refusal, ...]] = (
    Refusal(
        code="unknown_type",
        frames=tuple(sorted(set(p.MESSAGE_TYPES) - p.CLIENT_TO_EXEC)),
        broken=lambda broker, conn, m: True,
        text=lambda broker, conn, m: f"type {m.TYPE!r} is not accepted here",
    ),
    Refusal(
        code="not_registered",
        frames=tuple(sorted(p.CLIENT_TO_EXEC - _ANY_TIME)),
        broken=lambda broker, conn, m: conn.register is None,
        text=lambda broker, conn, m: f"send REGISTER before {m.TYPE}",
    ),
    Refusal(
        code="already_registered",
        frames=("REGISTER",),
        broken=lambda broker, conn, m: conn.register is not None,
        text=lambda broker, conn, m: "this connection already registered",
    ),
    Refusal(
        code="draining",
        frames=("JOB", "WANT"),
        broken=lambda broker, conn, m: broker.draining,
        text=lambda broker, conn, m: "this execserver is draining",
    ),
    Refusal(
        code="unknown_service",
        frames=("JOB", "WANT"),
        broken=lambda broker, conn, m: not broker.pool.offers(m.service),
        text=lambda broker, conn, m: f"service {m.service!r} is not offered here",
    ),
    Refusal(
        code="duplicate_job",
        frames=("WANT",),
        broken=lambda broker, conn, m: broker._is_live(conn, m.job_id),
        text=lambda broker, conn, m: f"job_id {m.job_id!r} is already live",
    ),
    Refusal(
        code="unknown_token",
        frames=("JOB",),
        broken=lambda broker, conn, m: _offer_here(broker, conn, m.token) is None,
        text=lambda broker, conn, m: (
            "the token is expired, used, or was never offered on this connection"
        ),
    ),
    Refusal(
        code="token_mismatch",
        frames=("JOB",),
        broken=_mismatched,
        text=lambda broker, conn, m: (
            f"the token was offered for job {broker._offers[m.token].job_id!r} "
            f"of service {broker._offers[m.token].service!r}"
        ),
    ),
    Refusal(
        code="unknown_job",
        frames=("CANCEL", "QUERY"),
        broken=lambda broker, conn, m: not broker._is_live(conn, m.job_id),
        text=lambda broker, conn, m: f"job_id {m.job_id!r} is not live",
    ),
    Refusal(
        code="too_many_wants",
        frames=("WANT",),
        # wanted_at holds exactly the connection's parked and offered wants: O(1)
        broken=lambda broker, conn, m: (
            len(conn.wanted_at) >= broker.config.max_wants_per_connection
        ),
        text=lambda broker, conn, m: (
            f"this connection already has {len(conn.wanted_at)} wants parked or offered "
            f"(max_wants_per_connection); send it again once one is served or withdrawn"
        ),
    ),
)
"""The broker's refusals, first broken row first (see *Refusals* in the module docstring)."""

_REFUSALS_BY_TYPE: Final[dict[str, tuple[Refusal, ...]]] = {
    kind: tuple(row for row in REFUSALS if kind in row.frames) for kind in p.MESSAGE_TYPES
}
"""Each wire type's rows of :data:`REFUSALS`, in the table's order."""


# -- the broker ------------------------------------------------------------------------


class Broker(SansIOCore[Effect, _TimerKind]):
    """The execserver side of the protocol. See the module docstring.

    Outputs are drained with :meth:`frames_to_send` and :meth:`effects`;
    :meth:`next_deadline` says when :meth:`tick` is due.
    """

    usage_error = BrokerUsageError

    def __init__(self, config: BrokerConfig, *, now: float) -> None:
        super().__init__(now=now, liveness=Liveness(config.ping_interval, config.ping_timeout))
        self.config: BrokerConfig = config
        self.pool: SlotPool = SlotPool(config.pool)
        self.book: WantBook[ConnId] = WantBook(aging=config.pool.priority_aging)
        self._now = now
        self._conns: dict[ConnId, _Conn] = {}
        self._last_conn_id: ConnId = 0  # ids 1..this were issued
        self._run_ids = itertools.count(1)
        self._offers: dict[str, _Offer] = {}
        self._runs: dict[RunId, _Run] = {}
        # turn holds: connection -> the slot kept for its next WANT
        self._holds: dict[ConnId, _Hold] = {}
        self._recent: deque[FinishedJob] = deque(maxlen=config.recent_receipts)
        # STATS: the figures of ended jobs, and the connections that subscribed
        self.figures = JobFigures()
        self._subscriptions = Subscriptions()
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "wants",
                "offers",
                "offers_redeemed",
                "offers_declined",
                "offers_expired",
                "offers_withdrawn",
                "jobs_started",
                "jobs_ended",
                "errors_sent",
                "connections_opened",
                "connections_closed",
            ),
            0,
        )
        self.draining: bool = False
        self._drained_sent = False
        # idle: the smallest free count of each second, minus the fast reserve
        self._idle = 0
        self._second_end = now + 1.0
        self._min_free = self.pool.free
        self._second_scheduled = False
        self._hello_shared: Hashable = None
        self._hello_shared = self._shared_hello()
        # HELLO rounds (see *HELLO* in the module docstring): whether the shared
        # members changed since the last round, the connections a round passed over
        # because their window was still open, and the armed round's time
        self._hello_changed = False
        self._hello_deferred: list[_Conn] = []
        self._hello_round_at: float | None = None
        self._schedule_second()

    # -- inputs -----------------------------------------------------------------------

    def open_connection(self, addr: str, *, now: float) -> ConnId:
        """A websocket was accepted on local address ``addr`` (``host:port``).

        Sends the first ``HELLO`` at once. Drain frames afterwards.
        """
        self._enter(now)
        self._last_conn_id += 1
        conn = _Conn(self._last_conn_id, addr, now)
        self._conns[conn.id] = conn
        self.counters["connections_opened"] += 1
        self._send_hello(conn)
        self._watch(conn)
        self._leave()
        return conn.id

    def close_connection(self, conn_id: ConnId, *, now: float) -> None:
        """The connection is gone (closed by the peer, the network or us).

        Its parked wants leave the book, its offers are released and its running
        jobs are stopped (:class:`AbortJob`); their receipts will not be delivered.
        An already closed connection is ignored (the broker may have closed it
        itself, with :class:`CloseConnection`). Drain frames and effects.

        Raises:
            BrokerUsageError: the broker never issued ``conn_id``; nothing changed.
        """
        conn = self._open_or_closed(conn_id)
        self._enter(now)
        if conn is not None:
            self._drop_connection(conn_id)
        self._leave()

    def receive_text(self, conn_id: ConnId, text: str | bytes, *, now: float) -> None:
        """A frame arrived (``bytes`` = a binary frame). Decodes, then :meth:`receive`.

        Raises:
            BrokerUsageError: the broker never issued ``conn_id``; nothing changed.
        """
        try:
            message = p.decode(text, accept=p.CLIENT_TO_EXEC)
        except p.ProtocolError as exc:
            conn = self._open_or_closed(conn_id)
            self._enter(now)
            if conn is not None:
                conn.last_recv = now
                self._error(conn, exc.code, exc.message, exc.job_id)
            self._leave()
            return
        self.receive(conn_id, message, now=now)

    def receive(self, conn_id: ConnId, message: p.Message, *, now: float) -> None:
        """A decoded frame arrived on a connection. Drain frames and effects.

        Frames for a connection that is already closed are ignored (the reader may
        have had one in hand when the close happened).

        Raises:
            BrokerUsageError: the broker never issued ``conn_id``; nothing changed.
        """
        conn = self._open_or_closed(conn_id)
        self._enter(now)
        if conn is not None:
            conn.last_recv = now
            self._dispatch(conn, message)
        self._leave()

    def job_ended(self, run_id: RunId, receipt: p.Receipt, *, now: float) -> FinishedJob:
        """The runner finished a job started by :class:`StartJob`.

        Frees its slot, updates the service's statistics, offers the slot to the
        next want, then sends ``DONE`` when the connection is still open (in that
        order, so a waiting client can redeem at once). Drain frames and effects.

        Returns:
            The job's record, as kept in the statistics' ``recent`` (for a log line).

        Raises:
            BrokerUsageError: the run id is not running; nothing changed.
        """
        if run_id not in self._runs:
            raise BrokerUsageError(f"run {run_id} is not running")
        self._enter(now)
        run = self._runs.pop(run_id)
        receipt = attrs.evolve(receipt, instance_id=self.config.instance_id)
        self.pool.release(run.service, run.reserved)
        self.pool.record(run.service, receipt)
        self.figures.record(receipt, now=now)
        self.counters["jobs_ended"] += 1
        conn = self._conns.get(run.conn)
        delivered = conn is not None and conn.runs.get(run.job_id) is run
        if delivered:
            assert conn is not None
            del conn.runs[run.job_id]
            self._maybe_hold(conn, run)
        # The freed slot is offered before DONE goes out: the next job's client
        # can answer with JOB without first reading the receipt.
        self._grant()
        backend_id = None
        if delivered:
            assert conn is not None
            self._send(conn, p.Done(job_id=run.job_id, receipt=receipt))
            backend_id = conn.register.backend_id if conn.register else None
        finished = FinishedJob(
            job_id=run.job_id,
            service=run.service,
            subject=run.subject,
            conn=run.conn,
            backend_id=backend_id,
            delivered=delivered,
            receipt=receipt,
            wait_s=run.wait_s,
            client=run.client,
        )
        self._recent.append(finished)
        self._leave()
        return finished

    def callback_checked(self, conn_id: ConnId, result: str, *, now: float) -> None:
        """Record the outcome of a :class:`CheckCallback` ("ok" or what went wrong).

        A connection closed meanwhile is ignored.

        Raises:
            BrokerUsageError: the broker never issued ``conn_id``; nothing changed.
        """
        conn = self._open_or_closed(conn_id)
        self._enter(now)
        if conn is not None:
            conn.callback_check = result
        self._leave()

    def drain(self, *, now: float) -> None:
        """Begin draining (SIGTERM): stop taking work, let running jobs finish.

        Sends a draining ``HELLO`` on every connection at once, empties the book,
        withdraws outstanding offers, and stops running jobs still running after
        ``drain_timeout``. :class:`Drained` follows when no job runs any more.
        Calling it again has no effect.
        """
        self._enter(now)
        if not self.draining:
            self.draining = True
            self.book.clear()
            for conn in self._conns.values():
                conn.wanted_at.clear()
            for offer in list(self._offers.values()):
                self._release_offer(offer)
                self.counters["offers_withdrawn"] += 1
            for conn_id in list(self._holds):
                self._release_hold(conn_id)
            # A draining HELLO goes out at once, whatever the one-second window.
            self._hello_shared = self._shared_hello()
            for conn in self._conns.values():
                self._send_hello(conn)
            self._push_timer(now + self.config.drain_timeout, "drain", None)
        self._leave()

    def stop(self, *, now: float) -> None:
        """Stop at once (a second signal): drain, and stop every running job now."""
        self.drain(now=now)
        self._enter(now)
        self._stop_runs("the execserver is stopping")
        self._leave()

    # -- queries ----------------------------------------------------------------------------

    @property
    def drained(self) -> bool:
        """True once draining is complete (no job runs any more)."""
        return self.draining and not self._runs

    def connections(self) -> list[ConnId]:
        return list(self._conns)

    def running(self) -> int:
        """How many jobs run (started and not ended), orphans included."""
        return len(self._runs)

    def idle(self) -> int:
        """The ``idle`` figure of the last full second."""
        return 0 if self.draining else self._idle

    def hello_for(self, conn_id: ConnId) -> p.Hello:
        """The ``HELLO`` this connection would be sent now.

        Raises:
            BrokerUsageError: the connection is not open.
        """
        conn = self._conns.get(conn_id)
        if conn is None:
            raise BrokerUsageError(f"connection {conn_id} is not open")
        return self._hello(conn)

    def statistics(self) -> BrokerStatistics:
        """A frozen snapshot of the pool, the services, connections and receipts."""
        pool = self.pool
        parked_by_service: dict[str, int] = {}
        for want in self.book.wants():
            parked_by_service[want.service] = parked_by_service.get(want.service, 0) + 1
        offered_by_service: dict[str, int] = {}
        for offer in self._offers.values():
            offered_by_service[offer.service] = offered_by_service.get(offer.service, 0) + 1
        services = tuple(
            ServiceSnapshot(
                name=name,
                kind=pool.kind(name),
                max_slots=pool.config.max_slots[name],
                capacity=pool.capacity(name),
                running=stats.busy
                - offered_by_service.get(name, 0)
                - sum(1 for h in self._holds.values() if h.service == name),
                offered=offered_by_service.get(name, 0),
                parked=parked_by_service.get(name, 0),
                completed=stats.completed,
                mean_runtime=stats.mean_runtime,
                peak_memory=stats.peak_memory,
                footprint=stats.footprint,
            )
            for name, stats in pool.services.items()
        )
        connections = tuple(
            ConnectionSnapshot(
                conn=conn.id,
                addr=conn.addr,
                opened_at=conn.opened_at,
                register=conn.register,
                callback_check=conn.callback_check,
                parked=len(self.book.connection_wants(conn.id)),
                offered=len(conn.offers),
                running=len(conn.runs),
            )
            for conn in self._conns.values()
        )
        return BrokerStatistics(
            instance_id=self.config.instance_id,
            name=self.config.name,
            slots=pool.size,
            fast_reserve=pool.config.fast_reserve,
            unknown_cap=pool.config.unknown_cap,
            memory_budget=pool.config.memory_budget,
            memory_reserved=pool.memory_reserved,
            busy=pool.busy,
            idle=self.idle(),
            draining=self.draining,
            services=services,
            connections=connections,
            recent=tuple(self._recent),
            counters=dict(self.counters),
        )

    # -- frame handling -------------------------------------------------------------------

    def _refusal(self, conn: _Conn, message: p.Message) -> Refusal | None:
        """The first row of :data:`REFUSALS` the frame breaks; None when it is taken."""
        for row in _REFUSALS_BY_TYPE[message.TYPE]:
            if row.broken(self, conn, message):
                return row
        return None

    def _dispatch(self, conn: _Conn, message: p.Message) -> None:
        refusal = self._refusal(conn, message)
        if refusal is not None:
            text = refusal.text(self, conn, message)
            self._error(conn, refusal.code, text, getattr(message, "job_id", None))
            return
        match message:
            case p.Ping():
                self._send(conn, p.Pong(nonce=message.nonce))
            case p.Pong():
                pass  # its arrival already counts for liveness
            case p.Register():
                self._on_register(conn, message)
            case p.Want():
                self._on_want(conn, message)
            case p.Job():
                self._on_job(conn, message)
            case p.Unwant():
                self._withdraw(conn, message.job_id)
            case p.Decline():
                offer = self._offers.get(message.token)
                if offer is not None and offer.conn == conn.id:
                    self._release_offer(offer)
                    self.counters["offers_declined"] += 1
            case p.Cancel():
                self._on_cancel(conn, message.job_id)
            case p.Query():
                self._on_query(conn, message.job_id)
            case p.Subscribe() | p.Unsubscribe():
                self._on_subscription(conn, message)
            case (
                p.Hello() | p.Queued() | p.Offer() | p.Done() | p.Position() | p.Error() | p.Stats()
            ):
                raise AssertionError(f"{message.TYPE} passed the unknown_type refusal")
            case _:
                assert_never(message)

    def _on_register(self, conn: _Conn, register: p.Register) -> None:
        conn.register = register
        if register.callback_url is not None:
            self._effects.append(
                CheckCallback(
                    conn=conn.id, url=register.callback_url, backend_id=register.backend_id
                )
            )

    def _on_want(self, conn: _Conn, want: p.Want) -> None:
        job_id = want.job_id
        self.counters["wants"] += 1
        conn.wanted_at[job_id] = self._now
        self.book.add(conn.id, job_id, want.service, want.priority, now=self._now)
        hold = self._holds.pop(conn.id, None)
        if hold is not None:
            # The connection kept its turn: its want takes the slot first when
            # it is of the held priority or above and fits.
            self.pool.release(hold.service, hold.reserved)
            if want.priority >= hold.priority and self.pool.fits(want.service):
                self._offer(self.book.grant(conn.id, job_id))
        self._grant()
        if (conn.id, job_id) in self.book:
            self._send(conn, p.Queued(job_id=job_id))

    def _on_job(self, conn: _Conn, job: p.Job) -> None:
        job_id = job.job_id
        offer = self._offers[job.token]  # the refusals made sure: ours, for this job
        subject = p.clip_subject(job.subject)  # kept, logged and shown: bounded
        self._forget_offer(offer)
        del conn.offers[offer.job_id]
        run = _Run(
            next(self._run_ids),
            conn.id,
            job_id,
            offer.service,
            subject,
            offer.reserved,
            wait_s=self._now - conn.wanted_at.pop(job_id, self._now),
            client=conn.register.name if conn.register else None,
            priority=offer.priority,
        )
        self._runs[run.run_id] = run
        conn.runs[job_id] = run
        self.counters["offers_redeemed"] += 1
        self.counters["jobs_started"] += 1
        self._effects.append(
            StartJob(
                run_id=run.run_id,
                conn=conn.id,
                job_id=job_id,
                service=offer.service,
                subject=subject,
                job=job.job,
                traceparent=job.traceparent,
            )
        )

    def _withdraw(self, conn: _Conn, job_id: str) -> None:
        """UNWANT semantics: remove a parked want or release its offer (else nothing)."""
        if self.book.remove(conn.id, job_id) is not None:
            conn.wanted_at.pop(job_id, None)
            return
        offer = conn.offers.get(job_id)
        if offer is not None:
            self._release_offer(offer)
            self.counters["offers_declined"] += 1

    def _on_cancel(self, conn: _Conn, job_id: str) -> None:
        run = conn.runs.get(job_id)
        if run is not None:
            if run.aborting is None:
                run.aborting = "cancelled"
                self._effects.append(
                    AbortJob(
                        run_id=run.run_id, status="cancelled", reason="cancelled by the client"
                    )
                )
        else:
            self._withdraw(conn, job_id)

    def _on_query(self, conn: _Conn, job_id: str) -> None:
        want = self.book.get(conn.id, job_id)
        if want is not None:
            service = want.service
            ahead = self.book.ahead_of(want)
        elif job_id in conn.offers:
            service, ahead = conn.offers[job_id].service, 0
        else:
            service, ahead = conn.runs[job_id].service, 0
        capacity = self.pool.capacity(service)
        mean = self.pool.mean_runtime(service)
        eta: float | None
        if want is None:
            eta = 0.0
        elif mean is None or capacity == 0:
            eta = None
        else:
            eta = mean * (ahead // capacity + 1)
        self._send(
            conn,
            p.Position(
                job_id=job_id, running=self.pool.busy, ahead=ahead, capacity=capacity, eta_s=eta
            ),
        )

    # -- slots ---------------------------------------------------------------------------

    def _grant(self) -> None:
        """The grant loop: offer free slots to wants until nothing fits."""
        if self.draining:
            return
        pool, book = self.pool, self.book
        if self._holds:
            self._release_outranked_holds()
        while len(book):
            fitting = pool.fitting()
            if not fitting:
                return
            want = book.pick(fitting)
            if want is None:
                return
            self._offer(want)

    def _offer(self, want: ParkedWant[ConnId]) -> None:
        """Send the OFFER for a want the book just granted; its slot is busy now."""
        pool = self.pool
        conn = self._conns[want.conn]
        token = self.config.token_factory()
        if token in self._offers:  # pragma: no cover - 128 random bits
            raise BrokerUsageError("token_factory returned a token that is still live")
        reserved = pool.acquire(want.service)
        offer = _Offer(
            token,
            conn.id,
            want.job_id,
            want.service,
            want.priority,
            self._now + self.config.offer_ttl,
            reserved,
        )
        self._offers[token] = offer
        conn.offers[want.job_id] = offer
        self.counters["offers"] += 1
        offer.timer = self._push_timer(offer.expires_at, "offer", token)
        self._send(conn, p.Offer(job_id=want.job_id, token=token))

    def _maybe_hold(self, conn: _Conn, run: _Run) -> None:
        """Keep the slot a job just freed for its connection when it is owed the turn.

        See *Turn hold* in :mod:`trio_broker.core.book`: the connection has no
        want parked at the job's priority, no want above it is parked, a want at
        or below it would take the slot now, and every connection with wants at
        that priority was served there after the connection's latest grant there
        (not this job's: a connection served again since is not owed the turn).
        """
        hold_for = self.config.turn_hold
        if not hold_for or self.draining or conn.id in self._holds:
            return
        pool, book = self.pool, self.book
        priority, service = run.priority, run.service
        highest = book.highest()
        if highest is None or highest > priority or not pool.fits(service):
            return
        granted_at = book.fitting_priority(pool.fitting())
        if granted_at is None or not book.turn_comes_first(conn.id, priority):
            return
        hold = _Hold(conn.id, service, priority, pool.acquire(service), self._now + hold_for)
        self._holds[conn.id] = hold
        self._push_timer(hold.expires_at, "hold", conn.id)

    def _release_hold(self, conn_id: ConnId) -> None:
        hold = self._holds.pop(conn_id, None)
        if hold is not None:
            self.pool.release(hold.service, hold.reserved)

    def _release_outranked_holds(self) -> None:
        """A want parked above a held priority ends that hold (no inversion), and so
        does a want of the holder itself at that priority (lifted there by aging)."""
        book = self.book
        highest = book.highest()
        if highest is None:
            return
        for conn_id, hold in list(self._holds.items()):
            if hold.priority < highest or book.has_wants(conn_id, hold.priority):
                self._release_hold(conn_id)

    def _forget_offer(self, offer: _Offer) -> None:
        """Drop an offer and disarm its expiry timer (a stale one never wakes the driver)."""
        del self._offers[offer.token]
        if offer.timer is not None:
            self._cancel_timer(offer.timer)
            offer.timer = None

    def _release_offer(self, offer: _Offer) -> None:
        self._forget_offer(offer)
        conn = self._conns.get(offer.conn)
        if conn is not None:
            del conn.offers[offer.job_id]
            conn.wanted_at.pop(offer.job_id, None)
        self.pool.release(offer.service, offer.reserved)

    def _is_live(self, conn: _Conn, job_id: str) -> bool:
        return (conn.id, job_id) in self.book or job_id in conn.offers or job_id in conn.runs

    def _stop_runs(self, reason: str) -> None:
        for run in self._runs.values():
            if run.aborting != "stopped":
                run.aborting = "stopped"
                self._effects.append(AbortJob(run_id=run.run_id, status="stopped", reason=reason))

    def _drop_connection(self, conn_id: ConnId) -> None:
        conn = self._conns.pop(conn_id)
        self.counters["connections_closed"] += 1
        self._subscriptions.discard(conn_id)
        self.book.remove_connection(conn_id)
        self._release_hold(conn_id)
        for offer in list(conn.offers.values()):
            self._release_offer(offer)
        for run in conn.runs.values():
            if run.aborting != "stopped":
                run.aborting = "stopped"
                self._effects.append(
                    AbortJob(
                        run_id=run.run_id, status="stopped", reason="the client connection closed"
                    )
                )
        conn.runs.clear()

    # -- timers ----------------------------------------------------------------------------

    def _fire(self, kind: _TimerKind, key: Any, now: float) -> None:
        config = self.config
        conn: _Conn | None
        if kind == "offer":
            offer = self._offers.get(key)
            if offer is not None and offer.expires_at <= now:
                offer.timer = None  # it fired: nothing to disarm
                self._release_offer(offer)
                self.counters["offers_expired"] += 1
                self._error(
                    self._conns[offer.conn],
                    "offer_expired",
                    f"the offer for {offer.job_id!r} expired unredeemed; park a new WANT",
                    offer.job_id,
                )
        elif kind == "ping" or kind == "dead":
            conn = self._conns.get(key)
            if conn is not None and self._liveness_timer(kind, conn, now):
                self._effects.append(
                    CloseConnection(
                        conn=conn.id, code=p.CLOSE_GOING_AWAY, reason=self._liveness.reason
                    )
                )
                self._drop_connection(conn.id)
        elif kind == "hello":
            self._hello_round_at = None
            self._hello_round(now)
        elif kind == "hold":
            hold = self._holds.get(key)
            if hold is not None and hold.expires_at <= now:
                self._release_hold(key)
        elif kind == "second":
            self._second_scheduled = False
            self._hello_round(now)  # the second closed: a changed idle goes out now
        elif kind == "drain":
            self._stop_runs(f"drain_timeout of {config.drain_timeout:g}s expired")
        elif kind == "stats":
            conn_id, generation = key
            conn = self._conns.get(conn_id)
            if conn is not None and self._subscriptions.current(conn_id, generation):
                self._tell_stats(conn)
                self._push_timer(now + STATS_INTERVAL, "stats", key)

    # -- STATS -------------------------------------------------------------------------------

    def _on_subscription(self, conn: _Conn, message: p.Subscribe | p.Unsubscribe) -> None:
        """SUBSCRIBE: the first STATS at once, then one look a second (again: nothing).

        UNSUBSCRIBE: no more STATS (silent, subscribed or not).
        """
        if isinstance(message, p.Unsubscribe):
            self._subscriptions.discard(conn.id)
            return
        generation = self._subscriptions.add(conn.id)
        if generation is not None:
            self._tell_stats(conn)
            self._push_timer(self._now + STATS_INTERVAL, "stats", (conn.id, generation))

    def _tell_stats(self, conn: _Conn) -> None:
        stats = self.stats_for(conn.id)
        if self._subscriptions.changed(conn.id, stats):
            self._send(conn, stats)

    def stats_for(self, conn_id: ConnId) -> p.Stats:
        """The ``STATS`` frame this connection would be sent now.

        Raises:
            BrokerUsageError: the connection is not open.
        """
        conn = self._conns.get(conn_id)
        if conn is None:
            raise BrokerUsageError(f"connection {conn_id} is not open")
        pool = self.pool
        waiting: dict[str, int] = {}
        by_priority: dict[int, int] = {}
        for want in self.book.wants():
            waiting[want.service] = waiting.get(want.service, 0) + 1
            by_priority[want.priority] = by_priority.get(want.priority, 0) + 1
        running: dict[str, int] = {}
        for run in self._runs.values():
            running[run.service] = running.get(run.service, 0) + 1
        kinds = dict(pool.kinds())
        return p.Stats(
            instance_id=self.config.instance_id,
            name=self.config.name,
            slots=pool.size,
            fast_reserve=pool.config.fast_reserve,
            running=len(self._runs),
            offered=len(self._offers),
            waiting=len(self.book),
            finished=self.figures.finished,
            failed=self.figures.failed,
            per_minute=self.figures.per_minute(now=self._now),
            bytes_in=self.figures.bytes_in,
            bytes_out=self.figures.bytes_out,
            clients=len(self._conns),
            draining=self.draining,
            callback_check=conn.callback_check,
            services=service_figures(
                kinds,
                {name: pool.capacity(name) for name in kinds},
                {name: pool.mean_runtime(name) for name in kinds},
                running,
                waiting,
            ),
            waiting_by_priority=tuple(
                p.PriorityCount(priority=priority, waiting=count)
                for priority, count in sorted(by_priority.items(), reverse=True)
            ),
        )

    # -- HELLO and idle ----------------------------------------------------------------------

    def _shared_hello(self) -> Hashable:
        """The HELLO members every connection shares (all but addr)."""
        if self.draining:  # no services, no processes, idle 0: only the client count
            return ("draining", len(self._conns))
        return (self.pool.kinds(), self.pool.size, self._idle, len(self._conns))

    def _hello(self, conn: _Conn) -> p.Hello:
        if self.draining:
            services: dict[str, p.ServiceInfo] = {}
        else:
            max_slots = self.pool.config.max_slots
            services = {
                name: p.ServiceInfo(max_slots=max_slots[name], kind=kind)
                for name, kind in self.pool.kinds()
            }
        return p.Hello(
            protocol=p.PROTOCOL_VERSION,
            instance_id=self.config.instance_id,
            name=self.config.name,
            services=services,
            processes=0 if self.draining else self.pool.size,
            idle=self.idle(),
            clients=len(self._conns),
            draining=self.draining,
            addr=conn.addr,
        )

    def _send_hello(self, conn: _Conn, hello: p.Hello | None = None) -> None:
        conn.hello_told = self._shared_hello()
        conn.hello_sent_at = self._now
        self._send(conn, hello if hello is not None else self._hello(conn))

    def _arm_hello_round(self) -> None:
        """A HELLO round at the end of this whole second, unless one is armed."""
        if self._hello_round_at is None:
            self._hello_round_at = self._second_end
            self._push_timer(self._second_end, "hello", None)

    def _hello_round(self, now: float) -> None:
        """Tell every connection that is behind and whose window closed; O(connections)
        after a change, O(passed over) otherwise, and at most once a second."""
        shared = self._shared_hello()
        if shared != self._hello_shared:  # the second that just closed changed idle
            self._hello_shared = shared
            self._hello_changed = True
        candidates = list(self._conns.values()) if self._hello_changed else self._hello_deferred
        self._hello_changed = False
        deferred: list[_Conn] = []
        conns = self._conns
        # one HELLO value per local address (they differ in addr only): the driver
        # encodes a value it sees again in a row once
        hellos: dict[str, p.Hello] = {}
        for conn in candidates:
            if conn.hello_told == shared or conns.get(conn.id) is not conn:
                continue
            if conn.hello_sent_at + HELLO_INTERVAL <= now:
                hello = hellos.get(conn.addr)
                if hello is None:
                    hello = hellos[conn.addr] = self._hello(conn)
                self._send_hello(conn, hello)
            else:
                deferred.append(conn)  # told less than a second ago: the next round
        self._hello_deferred = deferred
        if deferred:
            self._arm_hello_round()

    def _schedule_second(self) -> None:
        """Wake at the end of this second only if the idle figure may change then."""
        if self._second_scheduled or self.draining:
            return
        reserve = self.pool.config.fast_reserve
        if max(0, self._min_free - reserve) != self._idle or (
            max(0, self.pool.free - reserve) != self._idle
        ):
            self._second_scheduled = True
            self._push_timer(self._second_end, "second", None)

    def _roll_seconds(self, now: float) -> None:
        """Close every second that ended by ``now`` and compute its idle figure."""
        if now < self._second_end:
            return
        reserve = self.pool.config.fast_reserve
        self._idle = max(0, self._min_free - reserve)
        elapsed = math.floor(now - self._second_end) + 1
        if elapsed > 1:
            # Whole seconds passed without any input: the free count was constant.
            self._idle = max(0, self.pool.free - reserve)
        self._second_end += elapsed
        self._min_free = self.pool.free

    # -- plumbing -----------------------------------------------------------------------------

    def _open_or_closed(self, conn_id: ConnId) -> _Conn | None:
        """The open connection, ``None`` for one that closed; raise for one never issued."""
        conn = self._conns.get(conn_id)
        if conn is None and not 1 <= conn_id <= self._last_conn_id:
            raise BrokerUsageError(f"connection {conn_id} was never opened")
        return conn

    def _enter(self, now: float) -> None:
        self._advance(now)
        self._roll_seconds(now)
        if self.book.aging is not None and self.book.age(now) and self._holds:
            # a lift above a held priority, or of the holder's own want to it,
            # ends the hold before the input runs (Turn hold, core/book.py)
            self._release_outranked_holds()

    def _leave(self) -> None:
        """After every input: grant, track idle, spread HELLO changes."""
        self._grant()
        free = self.pool.free
        if free < self._min_free:
            self._min_free = free
        self._schedule_second()
        shared = self._shared_hello()
        if shared != self._hello_shared:
            # Something every connection was told changed: they hear of it in the
            # round at the end of this second (O(1) now, whatever the connections).
            self._hello_shared = shared
            self._hello_changed = True
            self._arm_hello_round()
        if self.draining and not self._runs and not self._drained_sent:
            self._drained_sent = True
            self._effects.append(Drained())

    def _error(
        self, conn: _Conn, code: p.ErrorCode, message: str, job_id: str | None = None
    ) -> None:
        self.counters["errors_sent"] += 1
        self._send(conn, p.Error(code=code, message=message, job_id=job_id))

    # -- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if any invariant of the module docstring is broken."""
        pool = self.pool
        pool.check_invariants()
        self.book.check_invariants()
        holds = self._holds.values()
        assert pool.busy == len(self._offers) + len(self._runs) + len(holds), (
            "busy != offers + runs + holds"
        )
        assert pool.memory_reserved == sum(o.reserved for o in self._offers.values()) + sum(
            r.reserved for r in self._runs.values()
        ) + sum(h.reserved for h in holds)
        highest = self.book.highest()
        for conn_id, hold in self._holds.items():
            assert conn_id in self._conns, "hold of a closed connection"
            assert highest is None or highest <= hold.priority, "a hold outranked"
            assert not self.book.has_wants(conn_id, hold.priority), "a hold beside its wants"
            assert not self.draining
        for service, stats in pool.services.items():
            held = (
                sum(1 for o in self._offers.values() if o.service == service)
                + sum(1 for r in self._runs.values() if r.service == service)
                + sum(1 for h in holds if h.service == service)
            )
            assert stats.busy == held, f"{service}: busy {stats.busy} != held {held}"
        if not self.draining and len(self.book):
            fitting = set(pool.fitting())
            for want in self.book.wants():
                assert want.service not in fitting, f"work not conserved: {want} fits"
        for conn in self._conns.values():
            for job_id, offer in conn.offers.items():
                assert self._offers[offer.token] is offer
                assert offer.job_id == job_id
                assert (conn.id, job_id) not in self.book
                assert job_id not in conn.runs
            for job_id, run in conn.runs.items():
                assert self._runs[run.run_id] is run
                assert run.job_id == job_id
                assert (conn.id, job_id) not in self.book
            parked = {w.job_id for w in self.book.connection_wants(conn.id)}
            assert set(conn.wanted_at) == parked | set(conn.offers), "wanted_at out of step"
        for offer in self._offers.values():
            assert offer.conn in self._conns, "offer of a closed connection"
        for want in self.book.wants():
            assert want.conn in self._conns, "want of a closed connection"
        if self.draining:
            assert not self._offers
            assert not len(self.book)
