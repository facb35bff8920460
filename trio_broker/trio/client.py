"""The client's trio layer: :class:`BrokerClient` runs jobs on a fleet of execservers.

Theory of operation
===================

Every decision is made by the sans-IO :class:`~trio_broker.core.client.ClientCore`;
the shared :class:`~trio_broker.trio.driver.CoreDriver` feeds it frames and timer
ticks and writes what it emits, exactly as on the execserver. This module adds
what only a client does:

- one task per broker connection (``Dial`` effect): it opens the TCP (and TLS)
  stream, upgrades to the websocket at ``/broker``, reports
  :meth:`~ClientCore.connected` with the socket's local address, then hands the
  connection to the driver until it ends (one reader, one writer, an outbox of
  :data:`~trio_broker.trio.driver.OUTBOX_FRAMES` frames besides the ``WANT``,
  ``UNWANT``, ``CANCEL`` and ``QUERY`` frames of its own callers, which may all be
  queued at once: a peer that does not read is closed with 1008);
- :meth:`BrokerClient.run` submits a job and waits for its effect
  (``Finished``/``Failed``; the exception a ``Failed`` raises is the core's,
  :func:`~trio_broker.core.endings.run_failure`); a cancelled caller withdraws the
  want or ``CANCEL``\\ s the running job;
- :meth:`BrokerClient.wait_capacity_changed` wakes whoever plans with the
  execservers' capacity (a dispatcher) when it changes.

After every input the driver drains the core's frames and effects at once, so
the order of frames on each connection is exactly the order the core decided
them in.

Use :func:`open_broker_client`; everything runs inside its nursery and stops
when the ``async with`` block ends. An exception raised in the block comes out
of it as itself, not inside an exception group.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import random
import secrets
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Mapping
from typing import Any, Final, assert_never

import attrs
import trio

from trio_broker.core import protocol as p
from trio_broker.core.admission import InstanceLoad, capacity
from trio_broker.core.client import (
    Accepted,
    ClientConfig,
    ClientCore,
    ClientEffect,
    Close,
    Dial,
    Failed,
    Finished,
    PeerError,
    PositionReport,
)
from trio_broker.core.endings import run_failure
from trio_broker.core.errors import (
    BrokerError,
    ClientClosed,
    NoExecserver,
    NoSlot,
    ServiceNotOffered,
    UnknownService,
)
from trio_broker.trio import tracing
from trio_broker.trio.attempt_note import note_receipt
from trio_broker.trio.driver import CLOSE_TIMEOUT, MAX_FRAME_BYTES, CoreDriver
from trio_broker.trio.inspection import WAIT_BUCKETS, Buckets, Histogram
from trio_broker.trio.pipes import InPipe, OutPipe, PipeRegistry, Sink, serve_pipes
from trio_broker.trio.websocket import HandshakeRefused
from trio_broker.trio.websocket import connect as websocket_connect

__all__ = [
    "AddressState",
    "BrokerClient",
    "ClientStatistics",
    "LinkState",
    "open_broker_client",
]

log = logging.getLogger("trio_broker.trio.client")

DIAL_TIMEOUT = 10.0
"""Seconds a TCP connect plus websocket upgrade may take before the dial fails."""


@attrs.frozen(kw_only=True)
class AddressState:
    """What the client knows about one configured address (inspection).

    Attributes:
        address: the dialled ``host:port``.
        connections: open broker connections to it (ready or not).
        instances: the distinct execserver ``instance_id``\\ s reached through it.
        covered: the pool found a duplicate instance and stopped growing.
        balanced: the address fronts a fleet: an execserver's ``HELLO.addr``
            differed from the address the socket was connected to (a balancer
            or a forwarding in between; a host name alone is not one).
        names: the execservers' names, by instance id.
        state: ``connected`` (an execserver answered that takes work),
            ``draining`` (every execserver reached drains), ``unreachable`` (no
            connection, and the latest dial failed) or ``connecting`` (no
            connection yet, a dial under way or due).
        last_error: why the latest dial failed, while it is unreachable.
        unreachable_since: since when (UNIX time) every dial failed, while it is
            unreachable.
    """

    address: str
    connections: int
    instances: tuple[str, ...]
    covered: bool
    balanced: bool
    names: Mapping[str, str]
    state: str = "connecting"
    last_error: str | None = None
    unreachable_since: float | None = None


@attrs.frozen(kw_only=True)
class ClientStatistics:
    """A snapshot of one client (``BrokerClient.statistics()``).

    Attributes:
        addresses: one :class:`AddressState` per configured address.
        waiting: jobs waiting for a slot.
        running: jobs holding a slot (their ``JOB`` went out).
        finished, failed: jobs ended since the client started (receipts of any
            status count as finished; ``failed`` counts the exceptions raised).
        surplus_offers: offers declined because another execserver was faster.
        slot_waits: seconds from :meth:`BrokerClient.run` asking for a slot to the
            offer it took (``offer``) or to its failure (``no_slot``,
            ``no_execserver``, ``unknown_service``, ``closed``, ``cancelled``:
            the caller gave up), by ``(service, outcome)``.
    """

    addresses: tuple[AddressState, ...]
    waiting: int
    running: int
    finished: int
    failed: int
    surplus_offers: int
    slot_waits: Mapping[tuple[str, str], Histogram] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class LinkState:
    """One ready broker connection and what its execserver last told (``BrokerClient.links()``).

    Attributes:
        conn: the connection's id in the client core.
        address: the configured address it was dialled through.
        hello: the execserver's latest ``HELLO``.
        local_addr: this side's ``host:port`` of the connection.
        callback_base: the callback base this connection registered, if any.
        stats: the latest ``STATS`` (None: not subscribed, or none came yet).
        stats_refused: the execserver is older than ``SUBSCRIBE`` (no figures).
    """

    conn: int
    address: str
    hello: p.Hello
    local_addr: str | None
    callback_base: str | None
    stats: p.Stats | None
    stats_refused: bool


class _Waiter:
    __slots__ = ("asked", "done", "error", "receipt", "service", "slot_span")

    def __init__(self, service: str) -> None:
        self.done = trio.Event()
        self.receipt: p.Receipt | None = None
        self.error: BrokerError | ServiceNotOffered | None = None
        self.service = service
        self.asked: float | None = trio.current_time()  # None once the slot wait is counted
        self.slot_span: tracing.Span = None  # trio_broker.slot_wait, until an offer is taken


_WAIT_OUTCOMES: Final[dict[type[BrokerError | ServiceNotOffered], str]] = {
    NoSlot: "no_slot",
    NoExecserver: "no_execserver",
    UnknownService: "unknown_service",
    ServiceNotOffered: "service_not_offered",
    ClientClosed: "closed",
}


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"an execserver address is host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _dial_error(exc: BaseException) -> str:
    """A failed dial in one line: what failed, and how (``ConnectionRefusedError:
    Connection refused``; trio's "all attempts … failed" gives its attempts' reasons)."""
    if isinstance(exc, trio.TooSlowError):
        return f"no answer within {DIAL_TIMEOUT:g} s"
    if isinstance(exc.__cause__, BaseExceptionGroup):
        reasons = [_dial_error(leaf) for leaf in exc.__cause__.exceptions]
        return "; ".join(dict.fromkeys(reasons))
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    text = " ".join(text.split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _format_address(sockname: Any) -> str:
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class BrokerClient:
    """Runs jobs on the best free slot of a fleet of execservers.

    Create it with :func:`open_broker_client`. All methods are for the trio
    thread that opened it.
    """

    def __init__(
        self,
        config: ClientConfig,
        nursery: trio.Nursery,
        *,
        broker_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        local_host: str | None = None,
        pipes: PipeRegistry | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self.config = config
        self._max_frame_bytes = max_frame_bytes
        self.pipes = pipes if pipes is not None else PipeRegistry(config.backend_id)
        """The one-time pipes this client's listener serves (see :meth:`pipe_in`)."""
        self._nursery = nursery
        self._token = broker_token
        self._ssl = ssl_context
        self._local_host = local_host
        self._core = ClientCore(config, now=trio.current_time(), random=random.Random())
        self._driver = CoreDriver[ClientEffect](
            self._core,
            self._apply,
            closed=self._core.connection_closed,
            max_frame_bytes=max_frame_bytes,
            own_frames=("WANT", "UNWANT", "CANCEL", "QUERY"),
            default_close=(p.CLOSE_NORMAL, "client closing"),
        )
        self._waiters: dict[str, _Waiter] = {}
        self._positions: dict[str, tuple[trio.MemorySendChannel[tuple[int, p.Position]], int]] = {}
        self._ids = itertools.count(1)
        self._id_prefix = secrets.token_hex(4)
        self._finished = 0
        self._failed = 0
        self._closed = False
        # addresses whose latest dial failed: why, and since when (UNIX time) they fail
        self._dial_failures: dict[str, tuple[str, float]] = {}
        self._connection_tasks = 0
        self._no_connection_tasks = trio.Event()
        self._watchers = 0
        self._slot_waits: dict[tuple[str, str], Buckets] = {}

    # -- public API --------------------------------------------------------------------------

    async def run(
        self,
        service: str,
        job: Mapping[str, Any],
        *,
        priority: int = 0,
        subject: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (a per-job limit the caller sets)
        job_id: str | None = None,
        stdin: InPipe | None = None,
        stdout: OutPipe | None = None,
        pipes: Mapping[str, str] | None = None,
    ) -> p.Receipt:
        """Get one job run on the first free slot of the fleet and return its receipt.

        The want is parked on every connection whose execserver announced the
        service; the first ``OFFER`` wins, later ones are declined, the other
        wants withdrawn. A receipt of any status is returned (check
        ``receipt.status``); only a job that could not run to a known end raises.

        Args:
            service: the service name, as the execservers announce it.
            job: the ``JOB`` object (``{"params": {...}}`` for the reference runner).
            priority: higher wins (32-bit signed).
            subject: a free label shown by the execserver's inspection pages.
            timeout: seconds for the whole call (waiting and running); on expiry
                the job is withdrawn or cancelled and :class:`trio.TooSlowError`
                is raised. ``None``: only ``connect_timeout`` bounds the wait.
            job_id: the wire job id; by default a fresh unique one.
            stdin: a pipe from :meth:`pipe_in`: the job reads its stdin from it
                (``job.stdin_url``). Closed when the call ends.
            stdout: a pipe from :meth:`pipe_out`: the job streams its stdout into
                it (``job.stdout_url``). Closed when the call ends; await
                ``stdout.wait()`` or read ``stdout.outcome()`` to learn whether
                the whole stream arrived.
            pipes: more job object members to fill with pipe URLs, as paths on
                this client's listener; see :meth:`~ClientCore.submit`.

        Raises:
            NoSlot: no slot within ``connect_timeout``.
            NoExecserver: no execserver is connected (or all drain).
            ClientClosed: the client was closed before the job ended.
            UnknownService: no connected execserver offers ``service`` (yet: try
                again later).
            ServiceNotOffered: the pool looked for ``service`` a whole
                ``pool_reprobe_interval`` and found no execserver offering it.
            JobLost: the connection holding the job's slot closed before its end.
            trio.TooSlowError: ``timeout`` expired.
        """
        if self._closed:
            raise ClientClosed("this BrokerClient is closed")
        if job_id is None:
            job_id = f"{self._id_prefix}-{next(self._ids)}"
        members = dict(pipes or {})
        if stdin is not None:
            members["stdin_url"] = stdin.path
        if stdout is not None:
            members["stdout_url"] = stdout.path
        waiter = _Waiter(service)
        self._waiters[job_id] = waiter
        ended = False
        waiter.slot_span = tracing.start_span(
            "trio_broker.slot_wait",
            attributes={"trio_broker.service": service, "trio_broker.priority": priority},
        )
        try:
            self._core.submit(
                job_id,
                service,
                dict(job),
                priority=priority,
                subject=subject,
                pipes=members or None,
                traceparent=tracing.current_traceparent(),
                now=trio.current_time(),
            )
            self._driver.flush()
            with trio.fail_after(math.inf if timeout is None else timeout):
                await waiter.done.wait()
            ended = True
        finally:
            del self._waiters[job_id]
            outcome = None
            if waiter.error is not None:
                outcome = _WAIT_OUTCOMES.get(type(waiter.error), "failed")
            elif not ended:
                outcome = "cancelled"
            if outcome is not None:
                self._waited(waiter, outcome)
                tracing.end_span(
                    waiter.slot_span,
                    error=str(waiter.error or "the caller gave up waiting"),
                    **{"trio_broker.outcome": outcome},
                )
            if not ended and not self._closed:
                # Cancelled or timed out: withdraw the want, or CANCEL the job.
                self._core.cancel(job_id, now=trio.current_time())
                self._driver.flush()
            for pipe in (stdin, stdout):
                if pipe is not None:
                    pipe.close()
        if waiter.error is not None:
            self._failed += 1
            raise waiter.error
        assert waiter.receipt is not None
        self._finished += 1
        note_receipt(waiter.receipt)
        return waiter.receipt

    def pipe_in(self, source: AsyncIterable[bytes]) -> InPipe:
        """A one-time stdin pipe for one job; pass it as ``run(..., stdin=pipe)``.

        The execserver that runs the job fetches ``source`` from this client's
        listener, at the address it reached this client from.
        """
        return self.pipes.pipe_in(source)

    def pipe_out(self, sink: Sink) -> OutPipe:
        """A one-time stdout pipe for one job; pass it as ``run(..., stdout=pipe)``.

        ``sink`` is awaited once per chunk as the job's output arrives, with
        back-pressure. A command that fails with at most 4000 bytes of output never
        opens it (the receipt's ``stdout_prefix`` has the output).
        """
        return self.pipes.pipe_out(sink)

    async def position(
        self,
        job_id: str,
        *,
        timeout: float = 5.0,  # noqa: ASYNC109 (answers that come later are not waited for)
    ) -> list[p.Position]:
        """Ask every execserver where the job waits (or runs) for its position.

        Returns the answers that came within ``timeout`` seconds, one per
        execserver where the job is parked (one when it runs); ``[]`` for a job
        this client does not know.
        """
        return [answer for _, answer in await self.position_answers(job_id, timeout=timeout)]

    async def position_answers(
        self,
        job_id: str,
        *,
        timeout: float = 5.0,  # noqa: ASYNC109 (answers that come later are not waited for)
    ) -> list[tuple[int, p.Position]]:
        """:meth:`position`, each answer with the connection it came on (see :meth:`links`)."""
        targets = len(self._core.parked_on(job_id))
        if targets == 0 and self.is_running(job_id):
            targets = 1
        if targets == 0 or job_id in self._positions:
            return []
        send, receive = trio.open_memory_channel[tuple[int, p.Position]](math.inf)
        self._positions[job_id] = (send, targets)
        answers: list[tuple[int, p.Position]] = []
        try:
            self._core.query(job_id, now=trio.current_time())
            self._driver.flush()
            with trio.move_on_after(timeout):
                while len(answers) < targets:
                    answers.append(await receive.receive())
        finally:
            del self._positions[job_id]
        return answers

    def instance_loads(self) -> list[InstanceLoad]:
        """One load per reachable, non-draining execserver instance (admission input)."""
        seen: dict[str, InstanceLoad] = {}
        for conn_id in self._core.ready_connections():
            hello = self._core.hello(conn_id)
            if hello is None or hello.draining or hello.instance_id in seen:
                continue
            seen[hello.instance_id] = InstanceLoad(
                instance_id=hello.instance_id,
                processes=hello.processes,
                clients=hello.clients,
                idle=hello.idle,
            )
        return list(seen.values())

    def waiting(self) -> int:
        """How many of this client's jobs wait for a slot right now."""
        return self._core.waiting_count()

    async def wait_capacity_changed(self) -> None:
        """Return once the execservers' capacity differs from what it is now.

        Capacity is :func:`~trio_broker.core.admission.capacity` of
        :meth:`instance_loads`: which execservers are reachable and not draining,
        their slots and their clients (not their idle slots, which move with
        every job). It is re-checked after every input.
        """
        seen = capacity(self.instance_loads())
        await self._driver.wait_until(lambda: capacity(self.instance_loads()) != seen)

    def is_running(self, job_id: str) -> bool:
        """Whether the job holds a slot (its ``JOB`` went out and it has not ended)."""
        return self._core.state_of(job_id) == "accepted"

    def offers(self, service: str) -> bool:
        """Whether some connected, non-draining execserver announced ``service``."""
        for conn_id in self._core.ready_connections():
            hello = self._core.hello(conn_id)
            if hello is not None and not hello.draining and service in hello.services:
                return True
        return False

    def statistics(self) -> ClientStatistics:
        """A frozen snapshot of the pools and the jobs in flight."""
        core = self._core
        addresses = []
        for address in self.config.addresses:
            conns = core.pool(address)
            hellos = [h for h in (core.hello(c) for c in conns) if h is not None]
            failure = self._dial_failures.get(address) if not hellos else None
            if hellos:
                state = "draining" if all(h.draining for h in hellos) else "connected"
            else:
                state = "connecting" if failure is None else "unreachable"
            addresses.append(
                AddressState(
                    address=address,
                    connections=len(conns),
                    instances=tuple(sorted({h.instance_id for h in hellos})),
                    covered=core.covered(address),
                    balanced=core.balanced(address),
                    names={h.instance_id: h.name for h in hellos},
                    state=state,
                    last_error=None if failure is None else failure[0],
                    unreachable_since=None if failure is None else failure[1],
                )
            )
        return ClientStatistics(
            addresses=tuple(addresses),
            waiting=core.waiting_count(),
            running=core.running_count(),
            finished=self._finished,
            failed=self._failed,
            surplus_offers=core.surplus_offers,
            slot_waits={key: b.snapshot() for key, b in sorted(self._slot_waits.items())},
        )

    def callback_base(self, conn_id: int) -> str | None:
        """The callback base one connection registered (``None`` when unset)."""
        return self._core.callback_base(conn_id)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Keep every execserver's figures coming (``SUBSCRIBE``) while the block runs.

        Blocks may nest and overlap (one per viewer); the client subscribes when
        the first starts and unsubscribes when the last ends, so nobody watching
        costs no frame. The figures are read with :meth:`links`.
        """
        self._watchers += 1
        if self._watchers == 1 and not self._closed:
            self._core.subscribe(now=trio.current_time())
            self._driver.flush()
        try:
            yield
        finally:
            self._watchers -= 1
            if self._watchers == 0 and not self._closed:
                self._core.unsubscribe(now=trio.current_time())
                self._driver.flush()

    def links(self) -> tuple[LinkState, ...]:
        """Every ready connection with its execserver's latest ``HELLO`` and ``STATS``."""
        core = self._core
        found = []
        for conn_id in core.ready_connections():
            hello = core.hello(conn_id)
            address = core.address_of(conn_id)
            if hello is None or address is None:
                continue
            found.append(
                LinkState(
                    conn=conn_id,
                    address=address,
                    hello=hello,
                    local_addr=core.local_addr(conn_id),
                    callback_base=core.callback_base(conn_id),
                    stats=core.stats(conn_id),
                    stats_refused=core.stats_refused(conn_id),
                )
            )
        return tuple(found)

    async def wait_until(
        self,
        predicate: Callable[[], bool],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (tests and tools bound their waits)
    ) -> None:
        """Return once ``predicate()`` is true; it is re-checked after every input.

        Raises:
            trio.TooSlowError: ``timeout`` seconds passed first.
        """
        with trio.fail_after(math.inf if timeout is None else timeout):
            await self._driver.wait_until(predicate)

    async def aclose(self) -> None:
        """Close the client: fail the jobs in flight, close every connection.

        Jobs still waiting or running raise :class:`ClientClosed`; every broker
        connection is closed (1000) after the frames already queued for it, each
        closing handshake bounded. Later :meth:`run` calls raise
        :class:`ClientClosed`. Calling it again does nothing;
        :func:`open_broker_client` calls it when its block ends.
        """
        if self._closed:
            return
        self._closed = True
        for job_id, waiter in self._waiters.items():
            if not waiter.done.is_set():
                waiter.error = ClientClosed(f"job {job_id}: the broker client closed")
                waiter.done.set()
        driver = self._driver
        for conn_id in driver.connections:
            driver.close(conn_id, p.CLOSE_NORMAL, "client closing")
        # Let every connection finish its closing handshake (bounded) while
        # the connections' reader tasks still run; cancelling them first would
        # make each close wait out the whole close timeout.
        if self._connection_tasks:
            with trio.move_on_after(CLOSE_TIMEOUT + 1):
                await self._no_connection_tasks.wait()

    # -- the core's effects ----------------------------------------------------------------

    def _apply(self, effect: ClientEffect) -> None:
        match effect:
            case Finished():
                waiter = self._waiters.get(effect.job_id)
                if waiter is not None:
                    waiter.receipt = effect.receipt
                    waiter.done.set()
            case Failed():
                waiter = self._waiters.get(effect.job_id)
                error = run_failure(effect)
                if waiter is not None and error is not None:
                    waiter.error = error
                    waiter.done.set()
            case Accepted():
                # The caller of run() waits for the job's end, not for its slot, and
                # the core already counts the job as running: only the log and the
                # slot wait's span hear of it.
                waiter = self._waiters.get(effect.job_id)
                if waiter is not None:
                    self._waited(waiter, "offer")
                    tracing.end_span(waiter.slot_span, **{"trio_broker.outcome": "offer"})
                log.debug(
                    "job %r holds a slot on connection %d (%s)",
                    effect.job_id,
                    effect.conn,
                    self._core.address_of(effect.conn),
                )
            case Dial():
                if not self._closed:
                    self._nursery.start_soon(self._connection, effect.conn, effect.address)
            case Close():
                self._driver.close(effect.conn, effect.code, effect.reason)
            case PositionReport():
                entry = self._positions.get(effect.job_id)
                if entry is not None:
                    entry[0].send_nowait((effect.conn, effect.position))
            case PeerError():
                self._log_peer_error(effect)
            case _:
                assert_never(effect)

    def _waited(self, waiter: _Waiter, outcome: str) -> None:
        """Count a run's slot wait once, by its service and how it ended."""
        if waiter.asked is None:
            return
        buckets = self._slot_waits.get((waiter.service, outcome))
        if buckets is None:
            buckets = self._slot_waits[waiter.service, outcome] = Buckets(WAIT_BUCKETS)
        buckets.observe(max(0.0, trio.current_time() - waiter.asked))
        waiter.asked = None

    def _log_peer_error(self, effect: PeerError) -> None:
        if effect.error.code == "offer_expired":
            log.info("an offer for job %r expired", effect.error.job_id)
        elif effect.error.code == "unknown_type" and effect.error.job_id == p.STATS_TAG:
            log.info("connection %d: the execserver has no figures to send", effect.conn)
        else:
            log.warning(
                "execserver refused a frame on connection %d: %s: %s (job %r)",
                effect.conn,
                effect.error.code,
                effect.error.message,
                effect.error.job_id,
            )

    # -- tasks -------------------------------------------------------------------------------

    async def _connection(self, conn_id: int, address: str) -> None:
        """Dial one broker connection and feed it to the core until it ends."""
        self._connection_tasks += 1
        try:
            await self._dial_and_serve(conn_id, address)
        finally:
            self._connection_tasks -= 1
            if self._connection_tasks == 0:
                self._no_connection_tasks.set()
                self._no_connection_tasks = trio.Event()

    async def _dial_and_serve(self, conn_id: int, address: str) -> None:
        core = self._core
        try:
            host, port = _split_address(address)
            with trio.fail_after(DIAL_TIMEOUT):
                stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
                tcp = await trio.open_tcp_stream(host, port, local_address=self._local_host)
                local_addr = _format_address(tcp.socket.getsockname())
                peer_addr = _format_address(tcp.socket.getpeername())
                stream = tcp
                if self._ssl is not None:
                    stream = trio.SSLStream(tcp, self._ssl, server_hostname=host)
                headers = []
                if self._token is not None:
                    headers.append((b"authorization", f"Bearer {self._token}".encode()))
                try:
                    # the driver's transport: wsproto on the stream (trio_broker.trio.websocket)
                    transport = await websocket_connect(
                        stream,
                        f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                        "/broker",
                        headers=headers,
                        max_message_bytes=self._max_frame_bytes,
                    )
                except BaseException:
                    with trio.CancelScope(shield=True):
                        await stream.aclose()
                    raise
        except (
            OSError,
            ValueError,
            trio.TooSlowError,
            trio.BrokenResourceError,
            HandshakeRefused,
        ) as exc:
            log.info("dialling %s failed: %r", address, exc)
            since = self._dial_failures.get(address, ("", time.time()))[1]
            self._dial_failures[address] = (_dial_error(exc), since)
            core.dial_failed(conn_id, now=trio.current_time())
            self._driver.flush()
            return
        self._dial_failures.pop(address, None)
        if self._closed:  # closed while this dial was under way
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                await transport.close(p.CLOSE_NORMAL, "client closing")
            return
        core.connected(conn_id, local_addr=local_addr, peer_addr=peer_addr, now=trio.current_time())
        await self._driver.serve(conn_id, transport)


@contextlib.asynccontextmanager
async def open_broker_client(
    config: ClientConfig,
    *,
    broker_token: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    local_host: str | None = None,
    pipes: PipeRegistry | None = None,
    listen: str | None = None,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    wait_connected: float | None = 10.0,
) -> AsyncIterator[BrokerClient]:
    """Open a :class:`BrokerClient` that keeps connections to ``config.addresses``.

    Args:
        config: addresses, identity, timeouts and pool limits.
        broker_token: sent as ``Authorization: Bearer`` when the execservers need it.
        ssl_context: dial ``wss://`` with this context (``None``: plain ``ws://``).
        local_host: the local address to dial from (for example ``127.0.0.2``);
            by default the system picks it.
        pipes: the registry whose pipes :meth:`BrokerClient.pipe_in`/``pipe_out``
            create, when you serve it yourself (mount ``pipes.routes()`` in your
            app and set ``config.callback_port`` to its port).
        listen: serve the pipes and ``/whoami`` on a listener of this client at
            this host (port chosen by the system; ``"0.0.0.0"`` for every
            address) and set ``callback_port`` to it.
        max_frame_bytes: a larger incoming message closes its connection (1009).
        wait_connected: wait up to this many seconds until every configured
            address has answered a first dial, with a ``HELLO`` or a failure
            (``None`` or ``0``: do not wait). Unreachable addresses keep being
            dialled in the background; the client is usable either way.

    Raises:
        Whatever the ``async with`` block raised, as itself. The client's own
        tasks run in a nursery around the block; an exception of the block is
        raised again once that nursery has closed, so it is never wrapped in an
        exception group (one of the client's tasks failing still raises the
        nursery's group).
    """
    raised: BaseException | None = None
    async with trio.open_nursery() as nursery:
        registry = pipes if pipes is not None else PipeRegistry(config.backend_id)
        if listen is not None:
            port: int = await nursery.start(serve_pipes, registry, listen, 0)
            config = attrs.evolve(config, callback_port=port)
        client = BrokerClient(
            config,
            nursery,
            broker_token=broker_token,
            ssl_context=ssl_context,
            local_host=local_host,
            pipes=registry,
            max_frame_bytes=max_frame_bytes,
        )
        nursery.start_soon(client._driver.run_timers)
        client._driver.flush()  # the initial Dial effects
        if wait_connected:
            with trio.move_on_after(wait_connected):
                await client.wait_until(
                    lambda: all(
                        a.instances or a.address in client._dial_failures
                        for a in client.statistics().addresses
                    )
                )
        try:
            yield client
        except BaseException as exc:
            raised = exc  # raised again outside the nursery, which would wrap it
        finally:
            await client.aclose()
            registry.close()
            nursery.cancel_scope.cancel()
    if raised is not None:
        raise raised
