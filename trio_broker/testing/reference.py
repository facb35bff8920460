"""An obviously-correct execserver model, for differential testing.

:class:`ReferenceBroker` implements the same inputs as
:class:`trio_broker.core.broker.Broker` the simplest possible way: the book is a list
in arrival order, every limit is recounted from the lists of offers and running
jobs, every grant scans the whole book. It is slow on purpose and written
straight from the protocol text, so that a disagreement with the real broker
points at a bug in one of them.

It covers everything that decides who gets a slot: registration, WANT / QUEUED /
OFFER / JOB / DECLINE / UNWANT / CANCEL / QUERY, every ERROR code, offer expiry,
job ends with classification and memory footprints, the turn hold, priority
aging (each lift found by scanning every want), closing connections and
draining. It does not model ``HELLO`` timing or liveness (``PING``/``PONG`` and
``ping_timeout``): comparisons skip those frames, and the state machines that use
this model keep ``ping_timeout`` out of reach. Those rules have their own tests.

Each grant also re-checks the grant rule against the model's own state, so a
reference that drifted from the protocol would fail loudly rather than agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import attrs

from trio_broker.core import protocol as p
from trio_broker.core.broker import AbortJob, CheckCallback, Drained, Effect, StartJob
from trio_broker.core.pool import PoolConfig

__all__ = ["ReferenceBroker"]

# Written out again rather than imported: the model must not share a mistake.
_RAN = ("ok", "failed", "timed_out", "stalled", "out_of_memory")


@dataclass
class _Want:
    conn: int
    job_id: str
    service: str
    priority: int
    seq: int
    base: int = 0
    parked_at: float = 0.0


@dataclass
class _Held:
    """A busy slot: an outstanding offer (token set) or a running job (run_id set)."""

    conn: int
    job_id: str
    service: str
    kind_at_grant: str
    reserved: int
    token: str | None = None
    expires_at: float = 0.0
    run_id: int | None = None
    aborting: str | None = None
    orphan: bool = False
    priority: int = 0


@dataclass
class _Hold:
    """A freed slot kept for the connection owed the next turn at ``priority``."""

    conn: int
    service: str
    priority: int
    reserved: int
    expires_at: float


@dataclass
class _Conn:
    registered: bool = False
    open: bool = True


@dataclass
class ReferenceBroker:
    """The naive model. Every public method mirrors one Broker input."""

    pool: PoolConfig
    offer_ttl: float = 10.0
    drain_timeout: float = 60.0
    turn_hold: float = 0.0
    instance_id: str = "reference"
    frames: list[tuple[int, p.Message]] = field(default_factory=list)
    effects: list[Effect] = field(default_factory=list)
    conns: dict[int, _Conn] = field(default_factory=dict)
    book: list[_Want] = field(default_factory=list)
    rotation: dict[int, list[int]] = field(default_factory=dict)
    # priority -> connection -> number of the grant that put it where it is in
    # the rotation (connections that joined and were not served since: absent)
    served: dict[int, dict[int, int]] = field(default_factory=dict)
    # (connection, priority) -> the number of its latest grant there, until it closes
    last_grant: dict[tuple[int, int], int] = field(default_factory=dict)
    held: list[_Held] = field(default_factory=list)
    holds: list[_Hold] = field(default_factory=list)
    grant_count: int = 0
    runtimes: dict[str, list[float]] = field(default_factory=dict)
    peaks: dict[str, list[int]] = field(default_factory=dict)
    draining: bool = False
    drain_deadline: float | None = None
    drained_sent: bool = False
    grants: list[_Want] = field(default_factory=list)
    _seq: int = 0
    _next_conn: int = 1
    _next_run: int = 1
    _next_token: int = 0

    # -- the pool, recounted every time ----------------------------------------

    def token(self, n: int) -> str:
        """The n-th token: the machines give the real broker the same sequence."""
        return f"token-{n:06d}-padding-to-22"

    def mean(self, service: str) -> float | None:
        runs = self.runtimes.get(service, [])[-self.pool.window :]
        return sum(runs) / len(runs) if runs else None

    def kind(self, service: str) -> p.Kind:
        mean = self.mean(service)
        if mean is None:
            return "unknown"
        return "heavy" if mean >= self.pool.heavy_threshold else "light"

    def footprint(self, service: str) -> int | None:
        peaks = self.peaks.get(service, [])[-self.pool.window :]
        return max(peaks) if peaks else None

    def busy(self) -> list[_Held | _Hold]:
        """Every busy slot: offers, running jobs and turn holds."""
        return [*self.held, *self.holds]

    def fits(self, service: str, slots: list[Any] | None = None) -> bool:
        """Whether one more slot of ``service`` fits beside ``slots`` (the busy ones)."""
        pool = self.pool
        slots = self.busy() if slots is None else slots
        busy = len(slots)
        if busy >= pool.size:
            return False
        cap = pool.max_slots[service]
        if cap and sum(1 for h in slots if h.service == service) >= cap:
            return False
        kind = self.kind(service)
        if kind == "unknown":
            unknown_busy = sum(1 for h in slots if self.kind(h.service) == "unknown")
            if unknown_busy >= max(1, math.floor(pool.unknown_share * pool.size)):
                return False
        if kind == "heavy" and busy + 1 > pool.size - pool.fast_reserve:
            return False
        reserved = sum(h.reserved for h in slots)
        footprint = self.footprint(service)
        return not (
            pool.memory_budget is not None
            and reserved > 0
            and footprint is not None
            and reserved + footprint > pool.memory_budget
        )

    def admitted(self, service: str) -> int:
        """How many slots of ``service`` an idle pool admits, one after another, as
        classified now (memory aside: it is no static limit). ``capacity`` must say
        the same: the broker reports what it admits, rounding included."""
        slots: list[Any] = []
        while self.fits(service, slots):
            slots.append(_Hold(conn=0, service=service, priority=0, reserved=0, expires_at=0.0))
        return len(slots)

    def capacity(self, service: str) -> int:
        pool = self.pool
        limits = [pool.size]
        if pool.max_slots[service]:
            limits.append(pool.max_slots[service])
        kind = self.kind(service)
        if kind == "heavy":
            limits.append(pool.size - pool.fast_reserve)
        if kind == "unknown":
            limits.append(max(1, math.floor(pool.unknown_share * pool.size)))
        return min(limits)

    # -- aging, by scanning ---------------------------------------------------------

    def _enter(self, now: float) -> None:
        """The start of every input: time passes, due lifts apply, holds they outrank end."""
        self.now = now
        interval = self.pool.priority_aging
        if interval is None:
            return
        while True:
            # the next lift due by now: earliest due time, then earliest arrival
            due = [
                (w.parked_at + ((w.priority - w.base) // 2 + 1) * interval, w.seq, w)
                for w in self.book
                if w.priority < 4 + (w.base & 1)  # the top band, keeping the odd variant
            ]
            due = [entry for entry in due if entry[0] <= now]
            if not due:
                break
            _, _, want = min(due, key=lambda entry: entry[:2])
            self.unpark(want)
            self._seq += 1
            want.priority += 2
            want.seq = self._seq
            self.park(want)
        if self.book:
            top = max(w.priority for w in self.book)
            self.holds = [
                h
                for h in self.holds
                if h.priority >= top
                and not any(w.conn == h.conn and w.priority == h.priority for w in self.book)
            ]

    # -- the grant rule, by scanning --------------------------------------------

    def grant_all(self) -> None:
        if self.book and not self.draining:
            top = max(w.priority for w in self.book)
            self.holds = [h for h in self.holds if h.priority >= top]
        while not self.draining:
            eligible = [w for w in self.book if self.fits(w.service)]
            if not eligible:
                return
            top = max(w.priority for w in eligible)
            chosen = None
            for conn in self.rotation[top]:
                mine = [w for w in eligible if w.conn == conn and w.priority == top]
                if mine:
                    chosen = min(mine, key=lambda w: w.seq)
                    break
            assert chosen is not None, "a fitting want whose connection is not in rotation"
            # the rule, restated against the model's own state
            assert all(w.priority <= chosen.priority for w in eligible)
            assert all(
                w.seq >= chosen.seq
                for w in eligible
                if w.conn == chosen.conn and w.priority == chosen.priority
            )
            self.offer(chosen)

    def offer(self, chosen: _Want) -> None:
        """Grant a parked want: it leaves the book, its connection the rotation's place."""
        top = chosen.priority
        self.grant_count += 1
        self.last_grant[(chosen.conn, top)] = self.grant_count
        self.book.remove(chosen)
        rot = self.rotation[top]
        rot.remove(chosen.conn)
        self.served[top].pop(chosen.conn, None)
        if any(w.conn == chosen.conn and w.priority == top for w in self.book):
            rot.append(chosen.conn)
            self.served[top][chosen.conn] = self.grant_count
        if not rot:
            del self.rotation[top]
            del self.served[top]
        token = self.token(self._next_token)
        self._next_token += 1
        self.held.append(
            _Held(
                conn=chosen.conn,
                job_id=chosen.job_id,
                service=chosen.service,
                kind_at_grant=self.kind(chosen.service),
                reserved=self.footprint(chosen.service) or 0,
                token=token,
                expires_at=self.now + self.offer_ttl,
                priority=chosen.priority,
            )
        )
        self.grants.append(chosen)
        self.frames.append((chosen.conn, p.Offer(job_id=chosen.job_id, token=token)))

    def maybe_hold(self, ended: _Held) -> None:
        """The turn hold, restated: keep the freed slot for a connection owed the turn."""
        conn, priority = ended.conn, ended.priority
        if not self.turn_hold or self.draining or any(h.conn == conn for h in self.holds):
            return
        if not self.book or max(w.priority for w in self.book) > priority:
            return
        if not self.fits(ended.service) or not any(self.fits(w.service) for w in self.book):
            return
        waiting = self.rotation.get(priority, [])
        if not waiting or conn in waiting:
            return
        served = self.served.get(priority, {})
        # every connection waiting there was served there after the latest grant
        # to this one there (not only after the ended job's grant)
        latest = self.last_grant[(conn, priority)]
        if any(c not in served or served[c] <= latest for c in waiting):
            return
        self.holds.append(
            _Hold(
                conn=conn,
                service=ended.service,
                priority=priority,
                reserved=self.footprint(ended.service) or 0,
                expires_at=self.now + self.turn_hold,
            )
        )

    def unpark(self, want: _Want) -> None:
        self.book.remove(want)
        if not any(w.conn == want.conn and w.priority == want.priority for w in self.book):
            self.rotation[want.priority].remove(want.conn)
            self.served[want.priority].pop(want.conn, None)
            if not self.rotation[want.priority]:
                del self.rotation[want.priority]
                del self.served[want.priority]

    def park(self, want: _Want) -> None:
        if not any(w.conn == want.conn and w.priority == want.priority for w in self.book):
            self.rotation.setdefault(want.priority, []).append(want.conn)
            self.served.setdefault(want.priority, {})
        self.book.append(want)

    def ahead(self, want: _Want) -> int:
        """Replay the grant rule over a copy of the book as if every want fitted."""
        book = list(self.book)
        rotation = {prio: list(conns) for prio, conns in self.rotation.items()}
        count = 0
        while True:
            top = max(w.priority for w in book)
            conn = rotation[top][0]
            chosen = min(
                (w for w in book if w.conn == conn and w.priority == top), key=lambda w: w.seq
            )
            if chosen is want:
                return count
            count += 1
            book.remove(chosen)
            rotation[top].pop(0)
            if any(w.conn == conn and w.priority == top for w in book):
                rotation[top].append(conn)

    # -- inputs --------------------------------------------------------------------

    now: float = 0.0

    def open_connection(self, now: float) -> int:
        self._enter(now)
        conn = self._next_conn
        self._next_conn += 1
        self.conns[conn] = _Conn()
        self.finish()
        return conn

    def error(self, conn: int, code: p.ErrorCode, job_id: str | None = None) -> None:
        self.frames.append((conn, p.Error(code=code, message="", job_id=job_id)))

    def live(self, conn: int, job_id: str) -> bool:
        return any(w.conn == conn and w.job_id == job_id for w in self.book) or any(
            h.conn == conn and h.job_id == job_id and not h.orphan for h in self.held
        )

    def find_held(self, conn: int, job_id: str) -> _Held | None:
        for h in self.held:
            if h.conn == conn and h.job_id == job_id and not h.orphan:
                return h
        return None

    def receive_text(self, conn: int, text: str | bytes, now: float) -> None:
        self._enter(now)
        try:
            message = p.decode(text, accept=p.CLIENT_TO_EXEC)
        except p.ProtocolError as exc:
            if conn in self.conns:
                self.error(conn, exc.code, exc.job_id)
            self.finish()
            return
        self.receive(conn, message, now)

    def receive(self, conn: int, message: p.Message, now: float) -> None:
        self._enter(now)
        state = self.conns.get(conn)
        if state is None:
            self.finish()
            return
        job_id: Any = getattr(message, "job_id", None)
        if isinstance(message, p.Ping):
            self.frames.append((conn, p.Pong(nonce=message.nonce)))
        elif isinstance(message, p.Pong):
            pass
        elif isinstance(message, p.Register):
            self._on_register(conn, state, message, job_id)
        elif not state.registered:
            self.error(conn, "not_registered", job_id)
        else:
            handler = self._HANDLERS.get(type(message))
            if handler is not None:
                handler(self, conn, message, job_id)
        self.finish()

    def _on_register(self, conn: int, state: _Conn, message: p.Register, job_id: Any) -> None:
        if state.registered:
            self.error(conn, "already_registered")
        else:
            state.registered = True
            if message.callback_url is not None:
                self.effects.append(
                    CheckCallback(
                        conn=conn, url=message.callback_url, backend_id=message.backend_id
                    )
                )

    def _on_want(self, conn: int, message: p.Want, job_id: Any) -> None:
        if self.draining:
            self.error(conn, "draining", job_id)
        elif message.service not in self.pool.max_slots:
            self.error(conn, "unknown_service", job_id)
        elif self.live(conn, job_id):
            self.error(conn, "duplicate_job", job_id)
        else:
            self._seq += 1
            want = _Want(
                conn,
                message.job_id,
                message.service,
                message.priority,
                self._seq,
                base=message.priority,
                parked_at=self.now,
            )
            self.park(want)
            hold = next((h for h in self.holds if h.conn == conn), None)
            if hold is not None:
                # the connection kept its turn
                self.holds.remove(hold)
                if want.priority >= hold.priority and self.fits(want.service):
                    self.offer(want)
            self.grant_all()
            if want in self.book:
                self.frames.append((conn, p.Queued(job_id=job_id)))

    def _on_job(self, conn: int, message: p.Job, job_id: Any) -> None:
        offer = next((h for h in self.held if h.token == message.token), None)
        if self.draining:
            self.error(conn, "draining", job_id)
        elif message.service not in self.pool.max_slots:
            self.error(conn, "unknown_service", job_id)
        elif offer is None or offer.conn != conn:
            self.error(conn, "unknown_token", job_id)
        elif offer.job_id != message.job_id or offer.service != message.service:
            self.error(conn, "token_mismatch", job_id)
        else:
            offer.token = None
            offer.run_id = self._next_run
            self._next_run += 1
            self.effects.append(
                StartJob(
                    run_id=offer.run_id,
                    conn=conn,
                    job_id=message.job_id,
                    service=offer.service,
                    subject=message.subject,
                    job=message.job,
                )
            )

    def _on_unwant(self, conn: int, message: p.Unwant, job_id: Any) -> None:
        self.withdraw(conn, message.job_id)

    def _on_decline(self, conn: int, message: p.Decline, job_id: Any) -> None:
        for h in self.held:
            if h.token == message.token and h.conn == conn:
                self.held.remove(h)
                break

    def _on_cancel(self, conn: int, message: p.Cancel, job_id: Any) -> None:
        held = self.find_held(conn, message.job_id)
        if held is not None and held.run_id is not None:
            if held.aborting is None:
                held.aborting = "cancelled"
                self.effects.append(AbortJob(run_id=held.run_id, status="cancelled", reason=""))
        elif not self.withdraw(conn, message.job_id):
            self.error(conn, "unknown_job", job_id)

    def _on_query(self, conn: int, message: p.Query, job_id: Any) -> None:
        parked = next((w for w in self.book if w.conn == conn and w.job_id == job_id), None)
        held = self.find_held(conn, message.job_id)
        if parked is not None:
            ahead = self.ahead(parked)
            mean = self.mean(parked.service)
            capacity = self.capacity(parked.service)
            eta = None if mean is None or capacity == 0 else mean * (ahead // capacity + 1)
            self.frames.append(
                (
                    conn,
                    p.Position(
                        job_id=job_id,
                        running=len(self.busy()),
                        ahead=ahead,
                        capacity=capacity,
                        eta_s=eta,
                    ),
                )
            )
        elif held is not None:
            self.frames.append(
                (
                    conn,
                    p.Position(
                        job_id=job_id,
                        running=len(self.busy()),
                        ahead=0,
                        capacity=self.capacity(held.service),
                        eta_s=0.0,
                    ),
                )
            )
        else:
            self.error(conn, "unknown_job", job_id)

    _HANDLERS: ClassVar[dict[type[p.Message], Callable[..., None]]] = {
        p.Want: _on_want,
        p.Job: _on_job,
        p.Unwant: _on_unwant,
        p.Decline: _on_decline,
        p.Cancel: _on_cancel,
        p.Query: _on_query,
    }

    def withdraw(self, conn: int, job_id: str) -> bool:
        for w in self.book:
            if w.conn == conn and w.job_id == job_id:
                self.unpark(w)
                return True
        held = self.find_held(conn, job_id)
        if held is not None and held.token is not None:
            self.held.remove(held)
            return True
        return False

    def close_connection(self, conn: int, now: float) -> None:
        self._enter(now)
        if conn in self.conns:
            del self.conns[conn]
            self.holds = [h for h in self.holds if h.conn != conn]
            self.last_grant = {k: n for k, n in self.last_grant.items() if k[0] != conn}
            for w in [w for w in self.book if w.conn == conn]:
                self.unpark(w)
            for h in sorted(self.held, key=lambda h: h.run_id or 0):
                if h.conn != conn or h.orphan:
                    continue
                if h.token is not None:
                    self.held.remove(h)
                else:
                    h.orphan = True
                    if h.aborting != "stopped":
                        h.aborting = "stopped"
                        assert h.run_id is not None
                        self.effects.append(AbortJob(run_id=h.run_id, status="stopped", reason=""))
        self.finish()

    def job_ended(self, run_id: int, receipt: p.Receipt, now: float) -> None:
        self._enter(now)
        held = next(h for h in self.held if h.run_id == run_id)
        self.held.remove(held)
        if receipt.status in _RAN:
            self.runtimes.setdefault(held.service, []).append(receipt.duration_s)
            if receipt.peak_memory is not None:
                self.peaks.setdefault(held.service, []).append(receipt.peak_memory)
        if not held.orphan:
            self.maybe_hold(held)
        self.grant_all()  # the slot is offered before DONE goes out
        if not held.orphan:
            receipt = attrs.evolve(receipt, instance_id=self.instance_id)
            self.frames.append((held.conn, p.Done(job_id=held.job_id, receipt=receipt)))
        self.finish()

    def tick(self, now: float) -> None:
        self._enter(now)
        due = sorted(
            (h for h in self.held if h.token is not None and h.expires_at <= now),
            key=lambda h: h.expires_at,
        )
        for h in due:
            self.held.remove(h)
            self.error(h.conn, "offer_expired", h.job_id)
        self.holds = [h for h in self.holds if h.expires_at > now]
        if self.drain_deadline is not None and self.drain_deadline <= now:
            self.drain_deadline = None
            self.stop_runs()
        self.finish()

    def drain(self, now: float) -> None:
        self._enter(now)
        if not self.draining:
            self.draining = True
            self.book.clear()
            self.rotation.clear()
            self.served.clear()
            self.last_grant.clear()
            self.holds.clear()
            self.held = [h for h in self.held if h.token is None]
            self.drain_deadline = now + self.drain_timeout
        self.finish()

    def stop(self, now: float) -> None:
        self.drain(now)
        self.stop_runs()
        self.finish()

    def stop_runs(self) -> None:
        for h in sorted(self.held, key=lambda h: h.run_id or 0):
            if h.run_id is not None and h.aborting != "stopped":
                h.aborting = "stopped"
                self.effects.append(AbortJob(run_id=h.run_id, status="stopped", reason=""))

    def finish(self) -> None:
        """After every input: grant what fits; report Drained once."""
        self.grant_all()
        running = any(h.run_id is not None for h in self.held)
        if self.draining and not running and not self.drained_sent:
            self.drained_sent = True
            self.effects.append(Drained())

    # -- checks -------------------------------------------------------------------

    def check(self) -> None:
        """The model's own invariants: limits and work conservation."""
        pool = self.pool
        slots = self.busy()
        assert len(slots) <= pool.size
        for service, cap in pool.max_slots.items():
            assert not cap or sum(1 for h in slots if h.service == service) <= cap
        unknown = sum(1 for h in slots if self.kind(h.service) == "unknown")
        assert unknown <= max(1, math.floor(pool.unknown_share * pool.size))
        if not self.draining:
            assert not any(self.fits(w.service) for w in self.book), "work not conserved"
