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
(``unknown_token``, ``token_mismatch``, ``draining``) is parked again. A ``WANT``
refused with ``too_many_wants`` (the connection's cap) is sent there again a
``retry_tick`` later while the job still waits.

Balancers and mixed fleets. An address is *balanced* (it fronts a fleet) once a
connection's ``HELLO.addr`` differed from the socket's peer address given to
:meth:`~ClientCore.connected` (a host name that leads straight to one execserver
is not balanced). A job whose service no ready connection announced *probes*:
while some balanced address is below ``pool_max``, it waits and makes the pool
grow at once; the first connection that announces the service gets its
``WANT``. Without such an address (none is balanced, or all are full),
:meth:`~ClientCore.submit` answers at once, and probing jobs fail so.

Several clients behind one balancer (the rule; ``docs/PROTOCOL.md``, "Several
clients behind one balancer"). Other clients' dials move where ours land, so a
pool that circled back to a replica it knows has not seen the fleet, and a
count of attempts says nothing of how long it looked. Hence:

* *keep looking*: while a job probes, a covered balanced address keeps
  growing, after a back-off that doubles from ``pool_grow_interval`` with each
  connection that lands on a known instance up to a quarter of
  ``pool_reprobe_interval``, jittered, and resets on a new instance;
* *searches*: the pool remembers per service since when it looks for it (from
  the first job that found no connection announcing it to the first ready
  connection that announces it). A submitted job that probes waits at least
  until its search is ``pool_reprobe_interval`` old (its deadline moves there
  if ``connect_timeout`` is shorter); a waiting job whose connections to its
  service went probes again with its own deadline;
* *the verdict, by time*: a probing job at its deadline, or one answered at
  once, fails ``unknown_service`` (try again later) while its search is younger
  than ``pool_reprobe_interval``, ``service_not_offered`` (for good) once it is
  as old. A job that probes after its search ended starts a new one. So
  ``unknown_service`` never becomes permanent before one full re-probe, whatever
  a caller counts; callers follow the verdict (the fylr counts nothing).

Give-ups. A job with no slot after ``connect_timeout`` is unwanted everywhere
and fails with ``no_slot``. The deadline is ``connect_timeout`` after
:meth:`~ClientCore.submit` and moves only later, to the end of the search of a
job submitted while it probes: a refused ``JOB`` (the job waits again) keeps
it, so a job refused past its deadline fails at once.
:meth:`~ClientCore.submit` fails at once with ``no_execserver`` when no
connection is ready (or all drain), and every waiting job fails so at once
when the last ready, non-draining connection goes: its
caller can requeue it rather than wait out ``connect_timeout``. A job whose
connection dropped after its ``JOB`` was sent fails with ``lost``: the execserver
stopped it and its receipt will never come.

Pool growth (replicas behind one address). When a job has waited a whole
``retry_tick`` without an offer anywhere (or at once while a job probes), each
address that is not *covered* opens one more connection, at most one every
``pool_grow_interval``, at most ``pool_max`` in all. A new connection whose
``HELLO.instance_id`` a ready connection already reaches, through this address
or another, is closed at once and marks its address covered, which stops growth
(while no job probes) until a re-probe ``pool_reprobe_interval`` later clears
the mark (and dials an address left with no connection). So one execserver
configured under two addresses counts this client once.

Cost. Every input is O(1) or O(log n) in the jobs in flight, apart from the
work it does for the jobs it concerns (a new connection gets the ``WANT`` of
each waiting job of its services); each job's ``connect_timeout`` timer is
cancelled when it gets a slot.

Where the parts live. This module takes the inputs and sends the frames; the jobs
in flight are a ``JobTable`` (``core/_client_jobs.py``), the connections and the
pool's rules a ``ConnectionPool`` (``core/_client_pool.py``), the configuration and
the effects are in :mod:`trio_broker.core.client_values`.

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
from typing import Any, Final, Literal, TypeAlias, assert_never

from trio_broker.core import protocol as p
from trio_broker.core._client_jobs import JobRecord, JobTable
from trio_broker.core._client_pool import AddressRecord, ConnectionPool, ConnRecord
from trio_broker.core.client_values import (
    Accepted,
    ClientConfig,
    ClientEffect,
    Close,
    ConnId,
    Dial,
    Failed,
    FailReason,
    Finished,
    PeerError,
    PositionReport,
)
from trio_broker.core.errors import ClientUsageError, ErrorCode
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

_TimerKind: TypeAlias = Literal["deadline", "redial", "grow", "reprobe", "ping", "dead", "repark"]

_JOB_REFUSED: Final[frozenset[ErrorCode]] = frozenset(
    {"draining", "unknown_service", "unknown_token", "token_mismatch"}
)
"""The ``ERROR`` codes that refuse a ``JOB``: the job holds no slot and waits again."""

_WANT_GONE: Final[frozenset[ErrorCode]] = frozenset(
    {"draining", "unknown_service", "duplicate_job", "offer_expired", "too_many_wants"}
)
"""The ``ERROR`` codes after which a job's ``WANT`` is no longer parked there."""


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
        self._pool = ConnectionPool(config)
        self._conns = self._pool.conns  # the pool's own dict: read here, changed there
        self._jobs = JobTable()
        self._fleet_changed = False  # a connection came, went or changed: settle jobs
        self._grow_timer: tuple[float, int] | None = None  # (when, handle) while armed
        self.surplus_offers = 0
        """Offers declined because the job already had a slot (or was withdrawn)."""
        self._watching = False
        for address in self._pool.addresses.values():
            self._dial(address)

    # -- transport inputs ---------------------------------------------------------------

    def connected(
        self,
        conn_id: ConnId,
        *,
        local_addr: str | None = None,
        peer_addr: str | None = None,
        now: float,
    ) -> None:
        """The dial of :class:`Dial` succeeded; sends ``REGISTER``.

        ``peer_addr`` is the ``host:port`` the socket is connected to: an
        execserver whose ``HELLO.addr`` names another address is reached through
        a balancer. Without it the configured address is compared instead.

        Raises:
            ClientUsageError: the connection is not one being dialled (never
                issued, already connected, or closed), or ``local_addr`` is
                missing while ``callback_port`` needs it; nothing changed.
        """
        conn = self._pool.find(conn_id)
        if conn is None or conn.state != "dialing":
            state = "closed" if conn is None else "already connected"
            raise ClientUsageError(f"connection {conn_id} is {state}")
        if local_addr is None and self.config.callback_port is not None:
            raise ClientUsageError("callback_port needs the local_addr of every connection")
        self._enter(now)
        conn.state = "open"
        conn.local_addr = local_addr
        conn.peer_addr = peer_addr
        conn.last_recv = now
        config = self.config
        self._send(
            conn,
            p.Register(
                backend_id=config.backend_id,
                name=config.name,
                version=config.version,
                callback_url=conn.callback_base(self.config),
            ),
        )
        self._watch(conn)
        self._leave()

    def dial_failed(self, conn_id: ConnId, *, now: float) -> None:
        """The dial of :class:`Dial` failed; the address is dialled again later.

        Raises:
            ClientUsageError: the core never issued ``conn_id``; nothing changed.
        """
        self._pool.find(conn_id)
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
        conn = self._pool.find(conn_id)
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
        traceparent: str | None = None,
        now: float,
    ) -> None:
        """Ask for a slot for this job; the outcome arrives as an effect.

        ``traceparent`` (the caller's W3C trace context) travels in the ``JOB`` frame.

        ``pipes`` maps members of the job object to paths on the client's own
        listener (``{"stdin_url": "/pipe/<id>"}``); the URLs are completed with
        the callback base of the connection whose offer wins, when ``JOB`` goes
        out. It fails at once with ``no_execserver`` when no connection is ready
        (or every ready one drains), and with ``unknown_service`` (or, once the
        service was looked for ``pool_reprobe_interval``, ``service_not_offered``)
        when no ready execserver announced the service and no balanced address
        can grow to find one that does (see the module docstring).

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
        refusal = self._pool.refusal(service, now)
        if refusal is not None:
            self._effects.append(Failed(job_id=job_id, reason=refusal[0], detail=refusal[1]))
            self._leave()
            return
        deadline = now + self.config.connect_timeout
        record = JobRecord(job_id, service, priority, subject, job, deadline=deadline, pipes=pipes)
        record.traceparent = traceparent
        self._jobs.add(record)
        self._start_waiting(record)
        self._park_everywhere(record)
        if not record.parked_on:
            self._probe(record, extend=True)
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
                self._forget(job)
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

    def _ask_stats(self, conn: ConnRecord) -> None:
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
        return conn.callback_base(self.config) if conn else None

    def pool(self, address: str) -> list[ConnId]:
        """The connections (any state) of one configured address."""
        return sorted(self._pool.addresses[address].conns)

    def covered(self, address: str) -> bool:
        return self._pool.addresses[address].covered

    def balanced(self, address: str) -> bool:
        """Whether the address fronts a fleet: a ``HELLO.addr`` through it differed
        from the socket's peer address (it stays so once seen)."""
        return self._pool.addresses[address].balanced

    def waiting(self) -> list[str]:
        """Job ids that wait for a slot (O(jobs): use :meth:`waiting_count` to count)."""
        return [job.job_id for job in self._jobs.waiting()]

    def waiting_count(self) -> int:
        """How many jobs wait for a slot. O(1)."""
        return self._jobs.waiting_count

    def running_count(self) -> int:
        """How many jobs hold a slot (their ``JOB`` went out). O(1)."""
        return self._jobs.accepted_count

    def state_of(self, job_id: str) -> Literal["waiting", "accepted"] | None:
        """``waiting``, ``accepted`` (holds a slot) or None (unknown or ended). O(1)."""
        job = self._jobs.get(job_id)
        return None if job is None or job.state == "ended" else job.state

    def jobs(self) -> Iterator[tuple[str, str, ConnId | None]]:
        """(job_id, state, connection) for every job in flight."""
        for job in self._jobs:
            yield job.job_id, job.state, job.conn

    def parked_on(self, job_id: str) -> frozenset[ConnId]:
        job = self._jobs.get(job_id)
        return frozenset(job.parked_on) if job else frozenset()

    # -- frames ----------------------------------------------------------------------------

    def _dispatch(self, conn: ConnRecord, message: p.Message) -> None:
        match message:
            case p.Ping():
                self._send(conn, p.Pong(nonce=message.nonce))
            case p.Hello():
                self._on_hello(conn, message)
            case p.Offer():
                self._on_offer(conn, message)
            case p.Done():
                job = self._jobs.get(message.job_id)
                if job is not None and job.state == "accepted" and job.conn == conn.id:
                    conn.accepted.discard(job.job_id)
                    self._forget(job)
                    self._effects.append(Finished(job_id=job.job_id, receipt=message.receipt))
            case p.Error():
                self._on_error(conn, message)
            case p.Position():
                self._effects.append(
                    PositionReport(job_id=message.job_id, conn=conn.id, position=message)
                )
            case p.Stats():
                if conn.watch == "asked":
                    conn.stats = message
            case p.Queued() | p.Pong():
                pass  # news that needs nothing: the want is parked, the peer is alive
            case (
                p.Register()
                | p.Want()
                | p.Unwant()
                | p.Job()
                | p.Decline()
                | p.Cancel()
                | p.Query()
                | p.Subscribe()
                | p.Unsubscribe()
            ):
                pass  # a client's own frames: receive_text's codec turns them away
            case _:
                assert_never(message)

    def _on_hello(self, conn: ConnRecord, hello: p.Hello) -> None:
        before = conn.hello
        conn.hello = hello
        if conn.state != "ready":
            if self._duplicate(conn, hello):
                return
            conn.state = "ready"
            self._pool.addresses[conn.address].reached(hello, conn, self.config)
            self._ask_stats(conn)
        elif (
            before is not None
            and before.draining == hello.draining
            and before.services.keys() == hello.services.keys()
        ):
            return  # only the figures changed: nothing to park or settle
        self._fleet_changed = True
        if hello.draining:
            # The execserver emptied its book: nothing of ours is parked there.
            for job_id in conn.parked:
                self._jobs[job_id].parked_on.discard(conn.id)
            conn.parked.clear()
            return
        self._pool.found(hello.services)
        for service in hello.services:
            for job in self._jobs.waiting_for(service):
                self._park(job, conn)
                self._jobs.probing.pop(job.job_id, None)

    def _duplicate(self, conn: ConnRecord, hello: p.Hello) -> bool:
        """Close a new connection to an instance some ready connection already reaches.

        Through the same address the balancer circled back to a known replica:
        the address is covered (growth stops until the re-probe). Through another
        address one execserver was configured twice: the duplicate is closed as
        well, so the execserver counts this client once.
        """
        other = self._pool.reaching(conn, hello.instance_id)
        if other is None:
            return False
        address = self._pool.addresses[conn.address]
        address.circled_back(self.config, self._random)
        self._push_timer(self._now + self.config.pool_reprobe_interval, "reprobe", address.address)
        self._effects.append(Close(conn=conn.id, code=p.CLOSE_NORMAL, reason="duplicate instance"))
        self._lose(conn.id, redial=False)
        if not address.conns:
            address.shadowed_by = other.id
        return True

    def _on_offer(self, conn: ConnRecord, offer: p.Offer) -> None:
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
        self._disarm(job)
        self._jobs.accept(job, conn.id)
        conn.accepted.add(job.job_id)
        body = job.job
        if job.pipes:
            base = conn.callback_base(self.config)
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
                traceparent=job.traceparent,
            ),
        )
        self._effects.append(Accepted(job_id=job.job_id, conn=conn.id))

    def _on_error(self, conn: ConnRecord, error: p.Error) -> None:
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
        if job.state == "accepted" and job.conn == conn.id and code in _JOB_REFUSED:
            # Our JOB was refused: the job holds no slot; wait again everywhere.
            conn.accepted.discard(job.job_id)
            self._start_waiting(job)
            self._park_everywhere(job)
            return
        if job.job_id in conn.parked and code in _WANT_GONE:
            conn.parked.discard(job.job_id)
            job.parked_on.discard(conn.id)
            if code == "offer_expired" and job.state == "waiting":
                self._park(job, conn)
            elif code == "too_many_wants" and job.state == "waiting":
                # the connection's cap: try there again later (the job still waits)
                key = (job.job_id, conn.id)
                self._push_timer(self._now + self.config.retry_tick, "repark", key)

    # -- wants -----------------------------------------------------------------------------

    def _start_waiting(self, job: JobRecord) -> None:
        """The job waits for a slot (submitted, or its ``JOB`` was refused) until its deadline."""
        self._jobs.wait(job, now=self._now)
        job.timer = self._push_timer(job.deadline, "deadline", job.job_id)

    def _disarm(self, job: JobRecord) -> None:
        """Cancel the job's deadline timer, if armed (it stops waiting)."""
        if job.timer is not None:
            self._cancel_timer(job.timer)
            job.timer = None

    def _forget(self, job: JobRecord) -> None:
        self._disarm(job)
        self._jobs.forget(job)

    def _fail_waiting(self, jobs: list[JobRecord], reason: FailReason, detail: str) -> None:
        for job in jobs:
            self._unpark(job)
            self._forget(job)
            self._effects.append(Failed(job_id=job.job_id, reason=reason, detail=detail))

    def _settle(self) -> None:
        """After a connection came, went or changed: fail the waiting jobs that can
        no longer get a slot (every execserver gone, or no address can grow to look
        for their service), and make the jobs whose service no connection announces
        any longer probe. O(connections x services waited for) unless jobs fail."""
        jobs = self._jobs
        pool = self._pool
        if not jobs.waiting_count:
            return
        if not pool.live():
            self._fail_waiting(jobs.waiting(), "no_execserver", "every execserver disappeared")
            return
        if not pool.can_probe():
            for job in list(jobs.probing.values()):
                pool.search(job.service, self._now, fresh=False)
                reason, detail = pool.verdict(job.service, self._now)
                self._fail_waiting([job], reason, detail)
            return
        for service in jobs.services():
            if not pool.offered(service):
                for job in list(jobs.waiting_for(service)):
                    if job.job_id not in jobs.probing:
                        self._probe(job, extend=False)

    def _probe(self, job: JobRecord, *, extend: bool) -> None:
        """The job waits for a service no ready connection announced: the pool looks
        for it. A job submitted so (``extend``) waits at least until the search ends,
        for its verdict; one that lost the connections it was parked on keeps its
        deadline (and the verdict then)."""
        end = self._pool.search(job.service, self._now, fresh=True)
        self._jobs.probing[job.job_id] = job
        if extend and job.deadline < end:
            job.deadline = end
            self._disarm(job)
            job.timer = self._push_timer(end, "deadline", job.job_id)

    def _park(self, job: JobRecord, conn: ConnRecord) -> None:
        if (
            conn.offers(job.service)
            and job.job_id not in conn.parked
            and job.job_id not in conn.accepted
        ):
            conn.parked.add(job.job_id)
            job.parked_on.add(conn.id)
            self._send(conn, p.Want(job_id=job.job_id, service=job.service, priority=job.priority))

    def _park_everywhere(self, job: JobRecord) -> None:
        for conn in self._conns.values():
            self._park(job, conn)

    def _unpark(self, job: JobRecord) -> None:
        for conn_id in sorted(job.parked_on):
            conn = self._conns[conn_id]
            conn.parked.discard(job.job_id)
            self._send(conn, p.Unwant(job_id=job.job_id))
        job.parked_on.clear()

    # -- connections -------------------------------------------------------------------------

    def _receiving(self, conn_id: ConnId) -> ConnRecord | None:
        """The connection of a frame (None: forgotten); one still dialling is misuse."""
        conn = self._pool.find(conn_id)
        if conn is not None and conn.state == "dialing":
            raise ClientUsageError(f"connection {conn_id} received a frame before connected()")
        return conn

    def _dial(self, address: AddressRecord) -> None:
        conn = self._pool.add(address, self._now)
        self._effects.append(Dial(conn=conn.id, address=address.address))

    def _lose(self, conn_id: ConnId, *, redial: bool) -> None:
        conn = self._pool.remove(conn_id)
        if conn is None:
            return
        self._fleet_changed = True
        for job_id in conn.parked:
            self._jobs[job_id].parked_on.discard(conn_id)
        for job_id in sorted(conn.accepted):
            self._forget(self._jobs[job_id])
            self._effects.append(
                Failed(
                    job_id=job_id,
                    reason="lost",
                    detail=f"the connection to {conn.address} closed while the job held its slot",
                )
            )
        if redial:
            self._redial_later(self._pool.addresses[conn.address])
        for address in self._pool.unshadow(conn_id):
            self._redial_later(address)  # the connection that made it a duplicate is gone

    def _redial_later(self, address: AddressRecord) -> None:
        delay = address.redial_delay(self._random, self.config.reconnect_max)
        self._push_timer(self._now + delay, "redial", address.address)

    # -- timers ------------------------------------------------------------------------------

    def _fire(self, kind: _TimerKind, key: Any, now: float) -> None:
        config = self.config
        if kind == "deadline":
            job = self._jobs.get(key)
            if job is not None and job.state == "waiting" and job.deadline <= now:
                job.timer = None  # it fired
                probing = job.job_id in self._jobs.probing
                self._unpark(job)
                self._forget(job)
                if probing:  # its search ended with it: not found
                    reason, detail = self._pool.verdict(job.service, now)
                else:
                    reason = "no_slot"
                    detail = f"no slot within connect_timeout ({config.connect_timeout:g}s)"
                self._effects.append(Failed(job_id=key, reason=reason, detail=detail))
        elif kind == "redial":
            address = self._pool.addresses[key]
            if not address.conns or len(address.conns) < config.pool_max:
                self._dial(address)
        elif kind == "reprobe":
            address = self._pool.addresses[key]
            address.covered = False
            if not address.conns:
                self._dial(address)  # a duplicate of another address: look again
        elif kind == "grow":
            self._grow_timer = None
        elif kind == "repark":
            job_id, conn_id = key
            job = self._jobs.get(job_id)
            conn = self._conns.get(conn_id)
            if job is not None and job.state == "waiting" and conn is not None:
                self._park(job, conn)
        elif kind == "ping" or kind == "dead":
            conn = self._conns.get(key)
            if conn is not None and self._liveness_timer(kind, conn, now):
                self._effects.append(
                    Close(conn=conn.id, code=p.CLOSE_GOING_AWAY, reason=self._liveness.reason)
                )
                self._lose(conn.id, redial=True)

    def _consider_growth(self) -> None:
        """Open one more connection per address while jobs see no offer at all."""
        now = self._now
        oldest = self._jobs.oldest_wait()
        if oldest is None:
            self._arm_growth(None)
            return
        # A job no connection offers its service to cannot get an offer: no need
        # to wait a retry tick before growing.
        due = now if self._jobs.probing else oldest + self.config.retry_tick
        if due > now:
            self._arm_growth(due)
            return
        chosen, wake = self._pool.grow(now, probing=bool(self._jobs.probing))
        for address in chosen:
            self._dial(address)
        self._arm_growth(wake)

    def _arm_growth(self, wake: float | None) -> None:
        """Keep exactly one growth timer, at ``wake`` (None: none)."""
        armed = self._grow_timer
        if armed is not None and armed[0] == wake:
            return
        if armed is not None:
            self._cancel_timer(armed[1])
        self._grow_timer = None if wake is None else (wake, self._push_timer(wake, "grow", None))

    # -- plumbing ------------------------------------------------------------------------------

    def _leave(self) -> None:
        if self._fleet_changed:
            self._fleet_changed = False
            self._settle()
        self._consider_growth()

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with itself."""
        self._pool.check_invariants()
        for conn in self._conns.values():
            for job_id in conn.parked:
                job = self._jobs[job_id]
                assert job.state == "waiting"
                assert conn.id in job.parked_on
            for job_id in conn.accepted:
                assert self._jobs[job_id].conn == conn.id
        for job in self._jobs:
            if job.state == "accepted":
                assert not job.parked_on, f"{job.job_id} holds a slot and is still parked"
                assert job.conn in self._conns
            for conn_id in job.parked_on:
                assert job.job_id in self._conns[conn_id].parked
        self._jobs.check_invariants()
        for job in self._jobs.waiting():
            assert job.timer is not None, f"{job.job_id} waits without a deadline"
