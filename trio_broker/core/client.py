"""The client side of the protocol as a sans-IO state machine.

Theory of operation
===================

A :class:`ClientCore` is what a client process (the reference ``fylr`` daemon,
or your own service) decides; the trio layer dials, reads and writes for it.

Connections. Every configured address (an execserver, or a balancer in front of
several) starts with one connection. The core asks for connections with
:class:`Dial`; the transport answers :meth:`~ClientCore.connected` or
:meth:`~ClientCore.dial_failed`. On connect the core sends ``REGISTER`` at once;
the connection becomes *ready* with its first ``HELLO``. A dropped connection is
dialled again after a back-off that doubles from ``reconnect_min`` to
``reconnect_max`` (each wait jittered between half and all of it) and resets on
the next ``HELLO``.

Wants. :meth:`~ClientCore.submit` parks a job's ``WANT`` on every ready
connection whose ``HELLO`` announced the service. The first ``OFFER`` wins: the
core sends ``JOB`` on that connection, ``UNWANT`` on every other connection where
the job is parked, and ``DECLINE`` for any offer that arrives later (offers and
``UNWANT`` cross on the wire by design). ``DONE`` finishes the job. A want whose
offer expired (``ERROR offer_expired``) or whose ``JOB`` was refused
(``unknown_token``, ``token_mismatch``, ``draining``) is parked again. A job
parked nowhere yet (no connection offers the service) waits too: growing the
pool may find an execserver that offers it.

Give-ups. A job with no slot after ``connect_timeout`` is unwanted everywhere
and fails with ``no_slot``. :meth:`~ClientCore.submit` fails at once with
``no_execserver`` when no connection is ready. A job whose connection dropped
after its ``JOB`` was sent fails with ``lost``: the execserver stopped it and its
receipt will never come.

Pool growth (replicas behind one address). When a job has waited a whole
``retry_tick`` without an offer anywhere, each address that is not *covered*
opens one more connection, at most one every ``pool_grow_interval``, at most
``pool_max`` in all. A new connection whose ``HELLO.instance_id`` is already in
that address's pool is closed at once and marks the address covered, which
stops growth until a re-probe ``pool_reprobe_interval`` later clears the mark.

Liveness. Like the execserver, the core sends ``PING`` after sending nothing
for ``ping_interval`` and closes a connection that sent nothing for
``ping_timeout``.

Invariants (:meth:`ClientCore.check_invariants`): a job is parked on a
connection exactly when that connection lists it; a job that holds a slot (its
``JOB`` sent) is parked nowhere; a connection never has two live uses of one
job id.

Errors by blame (the tree is in :mod:`trio_broker.core.errors`). An
execserver's bad frame never raises: it becomes a :class:`PeerError` effect for
the log. The driving code's misuse raises
:class:`~trio_broker.core.errors.ClientUsageError` before anything changes, the
clock included: a connection id the core never issued, ``connected`` twice,
a frame on a connection not yet connected, a job id submitted twice. A
connection the core issued and has since forgotten (it lost it, or closed a
duplicate) is not misuse: its late frames and its close report are taken (the
time advances) and otherwise ignored. Unknown job ids in :meth:`~ClientCore.cancel`
and :meth:`~ClientCore.query` are ignored too: a caller's cancel races with the
job's end by design.
"""

from __future__ import annotations

import random as _random
from collections.abc import Iterator
from typing import Any, Literal, TypeAlias

import attrs

from trio_broker.core import protocol as p
from trio_broker.core.errors import ClientUsageError
from trio_broker.core.job import with_pipe_urls
from trio_broker.core.liveness import Liveness
from trio_broker.core.sansio import SansIOCore

__all__ = [
    "Accepted",
    "ClientConfig",
    "ClientCore",
    "ClientEffect",
    "ClientUsageError",
    "Close",
    "Dial",
    "Failed",
    "Finished",
    "PeerError",
    "PositionReport",
]

ConnId: TypeAlias = int
FailReason: TypeAlias = Literal["no_slot", "no_execserver", "unknown_service", "lost", "cancelled"]


@attrs.frozen(kw_only=True)
class ClientConfig:
    """What the client core decides with. Durations are seconds.

    Attributes:
        backend_id, name, version: sent in ``REGISTER``.
        callback_url: the callback base sent in ``REGISTER`` and used for pipe
            URLs, verbatim (``callback_own_url``: set it behind NAT). When it is
            None and ``callback_port`` is set, each connection's base is
            ``http://<local address of that connection>:<callback_port>``: the
            address the execserver reached us from, never a shared hostname.
        callback_port: the port of the client's own HTTP listener (pipes, /whoami).
        addresses: every execserver (or balancer) address to keep connections to.
        connect_timeout: how long a job waits for a slot before it fails.
        retry_tick: how long a job waits without any offer before the pool grows.
        pool_grow_interval: at most one new connection per address this often.
        pool_max: at most this many connections per address.
        pool_reprobe_interval: how long "covered" stops growth.
        ping_interval, ping_timeout: liveness, as on the execserver.
        reconnect_min, reconnect_max: the back-off range for dialling again.
    """

    backend_id: str
    name: str
    version: str
    callback_url: str | None = None
    callback_port: int | None = None
    addresses: tuple[str, ...]
    connect_timeout: float = 60.0
    retry_tick: float = 1.0
    pool_grow_interval: float = 2.0
    pool_max: int = 16
    pool_reprobe_interval: float = 60.0
    ping_interval: float = 5.0
    ping_timeout: float = 15.0
    reconnect_min: float = 0.1
    reconnect_max: float = 5.0

    def __attrs_post_init__(self) -> None:
        if not self.addresses:
            raise ValueError("addresses must name at least one execserver")
        if self.pool_max < 1:
            raise ValueError(f"pool_max must be at least 1, got {self.pool_max}")


# -- effects ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Dial:
    """Open a broker connection to this address; report connected/dial_failed."""

    conn: ConnId
    address: str


@attrs.frozen(kw_only=True)
class Close:
    """Close this connection (then report connection_closed)."""

    conn: ConnId
    code: int
    reason: str


@attrs.frozen(kw_only=True)
class Accepted:
    """The job's ``JOB`` went out on this connection: it holds a slot there."""

    job_id: str
    conn: ConnId


@attrs.frozen(kw_only=True)
class Finished:
    """The job ended; here is its receipt."""

    job_id: str
    receipt: p.Receipt


@attrs.frozen(kw_only=True)
class Failed:
    """The job will not run (or its end will never be known)."""

    job_id: str
    reason: FailReason
    detail: str


@attrs.frozen(kw_only=True)
class PositionReport:
    """An execserver's answer to :meth:`ClientCore.query`."""

    job_id: str
    conn: ConnId
    position: p.Position


@attrs.frozen(kw_only=True)
class PeerError:
    """An execserver refused a frame (for the log; the core already reacted)."""

    conn: ConnId
    error: p.Error


ClientEffect: TypeAlias = Dial | Close | Accepted | Finished | Failed | PositionReport | PeerError


# -- internal records ----------------------------------------------------------------


class _Conn:
    __slots__ = (
        "accepted",
        "address",
        "hello",
        "id",
        "last_recv",
        "last_sent",
        "local_addr",
        "parked",
        "state",
        "stats",
        "watch",
    )

    def __init__(self, conn_id: ConnId, address: str, now: float) -> None:
        self.id = conn_id
        self.address = address
        self.state: Literal["dialing", "open", "ready"] = "dialing"
        self.hello: p.Hello | None = None
        self.parked: set[str] = set()  # job ids with a WANT here, not withdrawn
        self.accepted: set[str] = set()  # job ids whose JOB went out here
        self.last_sent = now
        self.last_recv = now
        self.local_addr: str | None = None
        # STATS: not asked for, asked for (SUBSCRIBE sent), or refused (unknown_type)
        self.watch: Literal["no", "asked", "refused"] = "no"
        self.stats: p.Stats | None = None

    def offers(self, service: str) -> bool:
        hello = self.hello
        return (
            self.state == "ready"
            and hello is not None
            and not hello.draining
            and service in hello.services
        )


class _Address:
    __slots__ = ("address", "backoff", "conns", "covered", "last_grow")

    def __init__(self, address: str, backoff: float) -> None:
        self.address = address
        self.conns: set[ConnId] = set()
        self.covered = False
        self.last_grow = float("-inf")
        self.backoff = backoff


class _Job:
    __slots__ = (
        "conn",
        "deadline",
        "job",
        "job_id",
        "parked_on",
        "pipes",
        "priority",
        "service",
        "state",
        "subject",
        "waiting_since",
    )

    def __init__(
        self,
        job_id: str,
        service: str,
        priority: int,
        subject: str | None,
        job: dict[str, Any],
        now: float,
        deadline: float,
    ) -> None:
        self.job_id = job_id
        self.service = service
        self.priority = priority
        self.subject = subject
        self.job = job
        self.state: Literal["waiting", "accepted"] = "waiting"
        self.parked_on: set[ConnId] = set()
        self.pipes: dict[str, str] | None = None
        self.conn: ConnId | None = None
        self.waiting_since = now
        self.deadline = deadline


_TimerKind: TypeAlias = Literal["deadline", "redial", "grow", "reprobe", "ping", "dead"]


class ClientCore(SansIOCore[ClientEffect, _TimerKind]):
    """The client side of the protocol. See the module docstring.

    Outputs are drained with :meth:`frames_to_send` and :meth:`effects`;
    :meth:`next_deadline` says when :meth:`tick` is due.
    """

    usage_error = ClientUsageError

    def __init__(
        self, config: ClientConfig, *, now: float, random: _random.Random | None = None
    ) -> None:
        """Args:
        config: what to connect to and the limits.
        now: the current time (seconds, any epoch; the same clock as every input).
        random: the source of the reconnect jitter; by default one seeded from
            ``config.backend_id``, so a run is reproducible.
        """
        super().__init__(now=now, liveness=Liveness(config.ping_interval, config.ping_timeout))
        self.config = config
        self._random = random if random is not None else _random.Random(config.backend_id)
        self._last_conn_id: ConnId = 0  # ids 1..this were issued
        self._conns: dict[ConnId, _Conn] = {}
        self._addresses = {a: _Address(a, config.reconnect_min) for a in config.addresses}
        self._jobs: dict[str, _Job] = {}
        self._grow_timer_at: float | None = None
        self.surplus_offers = 0
        """Offers declined because the job already had a slot (or was withdrawn)."""
        self._watching = False
        for address in self._addresses.values():
            self._dial(address)

    # -- transport inputs ---------------------------------------------------------------

    def connected(self, conn_id: ConnId, *, local_addr: str | None = None, now: float) -> None:
        """The dial of :class:`Dial` succeeded; sends ``REGISTER``.

        Raises:
            ClientUsageError: the connection is not one being dialled (never
                issued, already connected, or closed), or ``local_addr`` is
                missing while ``callback_port`` needs it; nothing changed.
        """
        conn = self._open_or_closed(conn_id)
        if conn is None or conn.state != "dialing":
            state = "closed" if conn is None else "already connected"
            raise ClientUsageError(f"connection {conn_id} is {state}")
        if local_addr is None and self.config.callback_port is not None:
            raise ClientUsageError("callback_port needs the local_addr of every connection")
        self._enter(now)
        conn.state = "open"
        conn.local_addr = local_addr
        conn.last_recv = now
        config = self.config
        self._send(
            conn,
            p.Register(
                backend_id=config.backend_id,
                name=config.name,
                version=config.version,
                callback_url=self._callback_base(conn),
            ),
        )
        self._watch(conn)
        self._leave()

    def dial_failed(self, conn_id: ConnId, *, now: float) -> None:
        """The dial of :class:`Dial` failed; the address is dialled again later.

        Raises:
            ClientUsageError: the core never issued ``conn_id``; nothing changed.
        """
        self._open_or_closed(conn_id)
        self._enter(now)
        self._lose(conn_id, redial=True)
        self._leave()

    def connection_closed(self, conn_id: ConnId, *, now: float) -> None:
        """The connection is gone, for whatever reason.

        One the core already forgot (it closed a duplicate with :class:`Close`)
        is ignored.

        Raises:
            ClientUsageError: the core never issued ``conn_id``; nothing changed.
        """
        conn = self._open_or_closed(conn_id)
        self._enter(now)
        if conn is not None:
            self._lose(conn_id, redial=True)
        self._leave()

    def receive_text(self, conn_id: ConnId, text: str | bytes, *, now: float) -> None:
        """A frame arrived; bad frames become a :class:`PeerError` for the log.

        Raises:
            ClientUsageError: as :meth:`receive`; nothing changed.
        """
        try:
            message = p.decode(text, accept=p.EXEC_TO_CLIENT)
        except p.ProtocolError as exc:
            conn = self._receiving(conn_id)
            self._enter(now)
            if conn is not None:
                conn.last_recv = now
                self._effects.append(
                    PeerError(
                        conn=conn_id,
                        error=p.Error(code=exc.code, message=exc.message, job_id=exc.job_id),
                    )
                )
            self._leave()
            return
        self.receive(conn_id, message, now=now)

    def receive(self, conn_id: ConnId, message: p.Message, *, now: float) -> None:
        """A decoded frame arrived. Frames of closed connections are ignored.

        Raises:
            ClientUsageError: the core never issued ``conn_id``, or the connection
                is not connected yet; nothing changed.
        """
        conn = self._receiving(conn_id)
        self._enter(now)
        if conn is not None:
            conn.last_recv = now
            self._dispatch(conn, message)
        self._leave()

    # -- caller inputs ----------------------------------------------------------------

    def submit(
        self,
        job_id: str,
        service: str,
        job: dict[str, Any],
        *,
        priority: int = 0,
        subject: str | None = None,
        pipes: dict[str, str] | None = None,
        now: float,
    ) -> None:
        """Ask for a slot for this job; the outcome arrives as an effect.

        ``pipes`` maps members of the job object to paths on the client's own
        listener (``{"stdin_url": "/pipe/<id>"}``); the URLs are completed with
        the callback base of the connection whose offer wins, when ``JOB`` goes
        out. It fails at once with ``no_execserver`` when no connection is ready
        (or every ready one drains), and with ``unknown_service`` when no ready
        execserver announced the service.

        Raises:
            ClientUsageError: the job id is already in use by this client, or the
                job has pipes and the config has no callback base; nothing changed.
        """
        if job_id in self._jobs:
            raise ClientUsageError(f"job_id {job_id!r} is already submitted")
        if pipes and self.config.callback_url is None and self.config.callback_port is None:
            raise ClientUsageError(
                "a job with pipes needs callback_url or callback_port in the ClientConfig"
            )
        self._enter(now)
        ready = [c for c in self._conns.values() if c.state == "ready"]
        refusal: tuple[FailReason, str] | None = None
        if not ready:
            refusal = ("no_execserver", "no execserver is connected")
        elif all(c.hello is not None and c.hello.draining for c in ready):
            refusal = ("no_execserver", "every connected execserver is draining")
        elif not any(c.offers(service) for c in ready):
            refusal = ("unknown_service", f"no connected execserver offers {service!r}")
        if refusal is not None:
            self._effects.append(Failed(job_id=job_id, reason=refusal[0], detail=refusal[1]))
            self._leave()
            return
        record = _Job(
            job_id, service, priority, subject, job, now, now + self.config.connect_timeout
        )
        record.pipes = pipes
        self._jobs[job_id] = record
        self._push_timer(record.deadline, "deadline", job_id)
        self._park_everywhere(record)
        self._leave()

    def cancel(self, job_id: str, *, now: float) -> None:
        """The caller gave up: withdraw a waiting job, or CANCEL a running one.

        A waiting job ends at once with ``Failed(cancelled)``; a running one ends
        with the ``DONE`` the execserver sends (status ``cancelled``). Unknown ids
        are ignored.
        """
        self._enter(now)
        job = self._jobs.get(job_id)
        if job is not None:
            if job.state == "waiting":
                self._unpark(job)
                del self._jobs[job_id]
                self._effects.append(
                    Failed(job_id=job_id, reason="cancelled", detail="cancelled by the caller")
                )
            else:
                assert job.conn is not None
                self._send(self._conns[job.conn], p.Cancel(job_id=job_id))
        self._leave()

    def query(self, job_id: str, *, now: float) -> None:
        """Ask every execserver where the job waits (or runs) for its position."""
        self._enter(now)
        job = self._jobs.get(job_id)
        if job is not None:
            targets = job.parked_on if job.state == "waiting" else {job.conn}
            for conn_id in sorted(c for c in targets if c is not None):
                self._send(self._conns[conn_id], p.Query(job_id=job_id))
        self._leave()

    def subscribe(self, *, now: float) -> None:
        """Ask every ready execserver for its figures (``SUBSCRIBE``), and each new one.

        The latest ``STATS`` of each connection is then kept (:meth:`stats`). An
        execserver that answers ``unknown_type`` is older: it is not asked again.
        Calling it again while subscribed does nothing.
        """
        self._enter(now)
        if not self._watching:
            self._watching = True
            for conn in self._conns.values():
                self._ask_stats(conn)
        self._leave()

    def unsubscribe(self, *, now: float) -> None:
        """Stop the figures everywhere (``UNSUBSCRIBE``); the kept ``STATS`` are dropped."""
        self._enter(now)
        if self._watching:
            self._watching = False
            for conn in self._conns.values():
                if conn.watch == "asked":
                    conn.watch = "no"
                    conn.stats = None
                    self._send(conn, p.Unsubscribe(job_id=p.STATS_TAG))
        self._leave()

    def _ask_stats(self, conn: _Conn) -> None:
        if self._watching and conn.state == "ready" and conn.watch == "no":
            conn.watch = "asked"
            self._send(conn, p.Subscribe(job_id=p.STATS_TAG))

    # -- queries ------------------------------------------------------------------------

    @property
    def subscribed(self) -> bool:
        """Whether :meth:`subscribe` is in force."""
        return self._watching

    def stats(self, conn_id: ConnId) -> p.Stats | None:
        """The latest ``STATS`` of a connection (None: none came, or not subscribed)."""
        conn = self._conns.get(conn_id)
        return conn.stats if conn else None

    def stats_refused(self, conn_id: ConnId) -> bool:
        """Whether the connection's execserver refused ``SUBSCRIBE`` (an older one)."""
        conn = self._conns.get(conn_id)
        return conn is not None and conn.watch == "refused"

    def local_addr(self, conn_id: ConnId) -> str | None:
        """The local ``host:port`` of a connection (as given to :meth:`connected`)."""
        conn = self._conns.get(conn_id)
        return conn.local_addr if conn else None

    def address_of(self, conn_id: ConnId) -> str | None:
        """The configured address a connection was dialled through."""
        conn = self._conns.get(conn_id)
        return conn.address if conn else None

    def ready_connections(self) -> list[ConnId]:
        return [c.id for c in self._conns.values() if c.state == "ready"]

    def hello(self, conn_id: ConnId) -> p.Hello | None:
        conn = self._conns.get(conn_id)
        return conn.hello if conn else None

    def callback_base(self, conn_id: ConnId) -> str | None:
        """The callback base this connection registered (pipes are served under it)."""
        conn = self._conns.get(conn_id)
        return self._callback_base(conn) if conn else None

    def _callback_base(self, conn: _Conn) -> str | None:
        config = self.config
        if config.callback_url is not None:
            return config.callback_url
        if config.callback_port is None or conn.local_addr is None:
            return None
        host = conn.local_addr.rsplit(":", 1)[0]
        return f"http://{host}:{config.callback_port}"

    def pool(self, address: str) -> list[ConnId]:
        """The connections (any state) of one configured address."""
        return sorted(self._addresses[address].conns)

    def covered(self, address: str) -> bool:
        return self._addresses[address].covered

    def waiting(self) -> list[str]:
        """Job ids that wait for a slot."""
        return [j.job_id for j in self._jobs.values() if j.state == "waiting"]

    def jobs(self) -> Iterator[tuple[str, str, ConnId | None]]:
        """(job_id, state, connection) for every job in flight."""
        for job in self._jobs.values():
            yield job.job_id, job.state, job.conn

    def parked_on(self, job_id: str) -> frozenset[ConnId]:
        job = self._jobs.get(job_id)
        return frozenset(job.parked_on) if job else frozenset()

    # -- frames ----------------------------------------------------------------------------

    def _dispatch(self, conn: _Conn, message: p.Message) -> None:
        if isinstance(message, p.Ping):
            self._send(conn, p.Pong(nonce=message.nonce))
        elif isinstance(message, p.Hello):
            self._on_hello(conn, message)
        elif isinstance(message, p.Offer):
            self._on_offer(conn, message)
        elif isinstance(message, p.Done):
            job = self._jobs.get(message.job_id)
            if job is not None and job.state == "accepted" and job.conn == conn.id:
                conn.accepted.discard(job.job_id)
                del self._jobs[job.job_id]
                self._effects.append(Finished(job_id=job.job_id, receipt=message.receipt))
        elif isinstance(message, p.Error):
            self._on_error(conn, message)
        elif isinstance(message, p.Position):
            self._effects.append(
                PositionReport(job_id=message.job_id, conn=conn.id, position=message)
            )
        elif isinstance(message, p.Stats) and conn.watch == "asked":
            conn.stats = message
        # QUEUED and PONG need nothing

    def _on_hello(self, conn: _Conn, hello: p.Hello) -> None:
        first = conn.state != "ready"
        conn.hello = hello
        if first:
            address = self._addresses[conn.address]
            for other_id in address.conns:
                other = self._conns[other_id]
                if (
                    other_id != conn.id
                    and other.hello is not None
                    and other.hello.instance_id == hello.instance_id
                ):
                    # The balancer put this connection on a replica we already
                    # reach: close it, and stop growing until the next re-probe.
                    address.covered = True
                    self._push_timer(
                        self._now + self.config.pool_reprobe_interval, "reprobe", address.address
                    )
                    self._effects.append(
                        Close(conn=conn.id, code=p.CLOSE_NORMAL, reason="duplicate instance")
                    )
                    self._lose(conn.id, redial=False)
                    return
            conn.state = "ready"
            address.backoff = self.config.reconnect_min
            self._ask_stats(conn)
        if hello.draining:
            # The execserver emptied its book: nothing of ours is parked there.
            for job_id in conn.parked:
                self._jobs[job_id].parked_on.discard(conn.id)
            conn.parked.clear()
        for job in self._jobs.values():
            if job.state == "waiting":
                self._park(job, conn)

    def _on_offer(self, conn: _Conn, offer: p.Offer) -> None:
        job = self._jobs.get(offer.job_id)
        if job is None or job.state != "waiting" or offer.job_id not in conn.parked:
            # Surplus: another execserver was faster, or the want was withdrawn.
            self.surplus_offers += 1
            conn.parked.discard(offer.job_id)
            if job is not None:
                job.parked_on.discard(conn.id)
            self._send(conn, p.Decline(token=offer.token))
            return
        conn.parked.discard(job.job_id)
        job.parked_on.discard(conn.id)
        self._unpark(job)
        job.state = "accepted"
        job.conn = conn.id
        conn.accepted.add(job.job_id)
        body = job.job
        if job.pipes:
            base = self._callback_base(conn)
            assert base is not None  # submit() and connected() made sure
            body = with_pipe_urls(body, base, job.pipes)
        self._send(
            conn,
            p.Job(
                job_id=job.job_id,
                token=offer.token,
                service=job.service,
                subject=job.subject,
                job=body,
            ),
        )
        self._effects.append(Accepted(job_id=job.job_id, conn=conn.id))

    def _on_error(self, conn: _Conn, error: p.Error) -> None:
        self._effects.append(PeerError(conn=conn.id, error=error))
        job_id = error.job_id
        if error.code == "unknown_type" and job_id == p.STATS_TAG:
            # an execserver older than SUBSCRIBE: carry on without its figures
            conn.watch = "refused"
            conn.stats = None
            return
        job = self._jobs.get(job_id) if job_id is not None else None
        if job is None:
            return
        code = error.code
        if (
            job.state == "accepted"
            and job.conn == conn.id
            and code
            in (
                "unknown_token",
                "token_mismatch",
                "draining",
                "unknown_service",
            )
        ):
            # Our JOB was refused: the job holds no slot; wait again everywhere.
            conn.accepted.discard(job.job_id)
            job.state = "waiting"
            job.conn = None
            job.waiting_since = self._now
            self._park_everywhere(job)
            return
        if job.job_id in conn.parked and code in (
            "offer_expired",
            "draining",
            "unknown_service",
            "duplicate_job",
        ):
            conn.parked.discard(job.job_id)
            job.parked_on.discard(conn.id)
            if code == "offer_expired" and job.state == "waiting":
                self._park(job, conn)

    # -- wants -----------------------------------------------------------------------------

    def _park(self, job: _Job, conn: _Conn) -> None:
        if (
            conn.offers(job.service)
            and job.job_id not in conn.parked
            and job.job_id not in conn.accepted
        ):
            conn.parked.add(job.job_id)
            job.parked_on.add(conn.id)
            self._send(conn, p.Want(job_id=job.job_id, service=job.service, priority=job.priority))

    def _park_everywhere(self, job: _Job) -> None:
        for conn in self._conns.values():
            self._park(job, conn)

    def _unpark(self, job: _Job) -> None:
        for conn_id in sorted(job.parked_on):
            conn = self._conns[conn_id]
            conn.parked.discard(job.job_id)
            self._send(conn, p.Unwant(job_id=job.job_id))
        job.parked_on.clear()

    # -- connections -------------------------------------------------------------------------

    def _open_or_closed(self, conn_id: ConnId) -> _Conn | None:
        """The known connection, ``None`` for one forgotten; raise for one never issued."""
        conn = self._conns.get(conn_id)
        if conn is None and not 1 <= conn_id <= self._last_conn_id:
            raise ClientUsageError(f"connection {conn_id} was never dialled")
        return conn

    def _receiving(self, conn_id: ConnId) -> _Conn | None:
        """:meth:`_open_or_closed` for a frame: a connection still dialling is misuse."""
        conn = self._open_or_closed(conn_id)
        if conn is not None and conn.state == "dialing":
            raise ClientUsageError(f"connection {conn_id} received a frame before connected()")
        return conn

    def _dial(self, address: _Address) -> None:
        self._last_conn_id += 1
        conn = _Conn(self._last_conn_id, address.address, self._now)
        self._conns[conn.id] = conn
        address.conns.add(conn.id)
        self._effects.append(Dial(conn=conn.id, address=address.address))

    def _lose(self, conn_id: ConnId, *, redial: bool) -> None:
        conn = self._conns.pop(conn_id, None)
        if conn is None:
            return
        address = self._addresses[conn.address]
        address.conns.discard(conn_id)
        for job_id in conn.parked:
            self._jobs[job_id].parked_on.discard(conn_id)
        for job_id in sorted(conn.accepted):
            del self._jobs[job_id]
            self._effects.append(
                Failed(
                    job_id=job_id,
                    reason="lost",
                    detail=f"the connection to {conn.address} closed while the job held its slot",
                )
            )
        if redial:
            # Jitter (half to all of the back-off) keeps many clients that lost
            # one execserver from dialling it again in lockstep.
            delay = address.backoff * (0.5 + 0.5 * self._random.random())
            self._push_timer(self._now + delay, "redial", address.address)
            address.backoff = min(address.backoff * 2, self.config.reconnect_max)

    # -- timers ------------------------------------------------------------------------------

    def _fire(self, kind: _TimerKind, key: Any, now: float) -> None:
        config = self.config
        if kind == "deadline":
            job = self._jobs.get(key)
            if job is not None and job.state == "waiting" and job.deadline <= now:
                self._unpark(job)
                del self._jobs[key]
                self._effects.append(
                    Failed(
                        job_id=key,
                        reason="no_slot",
                        detail=f"no slot within connect_timeout ({config.connect_timeout:g}s)",
                    )
                )
        elif kind == "redial":
            address = self._addresses[key]
            if not address.conns or len(address.conns) < config.pool_max:
                self._dial(address)
        elif kind == "reprobe":
            self._addresses[key].covered = False
        elif kind == "grow":
            self._grow_timer_at = None
        elif kind == "ping" or kind == "dead":
            conn = self._conns.get(key)
            if conn is not None and self._liveness_timer(kind, conn, now):
                self._effects.append(
                    Close(conn=conn.id, code=p.CLOSE_GOING_AWAY, reason=self._liveness.reason)
                )
                self._lose(conn.id, redial=True)

    def _consider_growth(self) -> None:
        """Open one more connection per address while jobs see no offer at all."""
        config = self.config
        now = self._now
        waiting = [j.waiting_since for j in self._jobs.values() if j.state == "waiting"]
        if not waiting:
            return
        due = min(waiting) + config.retry_tick
        wake: float | None = due if due > now else None
        if due <= now:
            for address in self._addresses.values():
                if address.covered or len(address.conns) >= config.pool_max:
                    continue
                if any(self._conns[c].state != "ready" for c in address.conns):
                    continue  # a dial is in progress: let it land first
                if now - address.last_grow < config.pool_grow_interval:
                    later = address.last_grow + config.pool_grow_interval
                    wake = later if wake is None else min(wake, later)
                    continue
                address.last_grow = now
                self._dial(address)
        if wake is not None and (self._grow_timer_at is None or wake < self._grow_timer_at):
            self._grow_timer_at = wake
            self._push_timer(wake, "grow", None)

    # -- plumbing ------------------------------------------------------------------------------

    def _leave(self) -> None:
        self._consider_growth()

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with itself."""
        for conn in self._conns.values():
            assert conn.id in self._addresses[conn.address].conns
            assert not conn.parked & conn.accepted
            for job_id in conn.parked:
                job = self._jobs[job_id]
                assert job.state == "waiting"
                assert conn.id in job.parked_on
            for job_id in conn.accepted:
                assert self._jobs[job_id].conn == conn.id
        for job in self._jobs.values():
            if job.state == "accepted":
                assert not job.parked_on, f"{job.job_id} holds a slot and is still parked"
                assert job.conn in self._conns
            for conn_id in job.parked_on:
                assert job.job_id in self._conns[conn_id].parked
        for address in self._addresses.values():
            assert len(address.conns) <= self.config.pool_max
