"""Hypothesis state machines that model-check the broker core.

Use them against your own pool configuration::

    from trio_broker.core.pool import PoolConfig
    from trio_broker.testing.machines import broker_machine, round_robin_machine

    TestMyPool = broker_machine(
        PoolConfig(size=8, fast_reserve=2, max_slots={"ffmpeg": 2, "exiftool": 0}),
    ).TestCase
    TestMyFairness = round_robin_machine(size=3, connections=4).TestCase

:func:`broker_machine` drives a real :class:`~trio_broker.core.broker.Broker` and the
naive :class:`~trio_broker.testing.reference.ReferenceBroker` with the same random
inputs — connections opening and closing, wants, redemptions (right, stale,
mismatched and foreign tokens), declines, unwants, cancels, queries, job ends with
runtimes and memory peaks that reclassify services, time passing, malformed
frames, draining — and after every step checks that:

1. busy slots (offers + running jobs) stay within the pool, each service's
   ``max_slots``, ``unknown_share`` for unmeasured services, and that no heavy
   service is granted one of the last ``fast_reserve`` slots;
2. the broker is work-conserving: no free slot coexists with a fitting want;
3. no offer goes to a want while a fitting want of higher priority is parked;
4. round-robin follows the rotation of the protocol (the reference keeps it);
5. FIFO among the fitting wants: every pick (checked on the real want-book by
   :func:`check_pick`) takes the highest fitting priority, the first connection
   of its rotation with a fitting want, and that connection's oldest *fitting*
   want there, even when its oldest want does not fit (a ``want_burst`` parks
   several services, capped ones first, from one connection at one priority);
6. every token is redeemed at most once, and expiry, DECLINE, UNWANT, CANCEL and
   close never leak or double-count a slot;
7. a closed connection leaves no want, offer or token behind;
8. each service's reported capacity (``POSITION``, ``STATS``) is the number of
   its slots the reference admits into an idle pool, so a fractional
   ``unknown_share`` rounds the same way in what is said and what is done;

and that both implementations sent exactly the same frames and effects (ignoring
``HELLO``, ``PING`` and ``PONG`` timing and ``ERROR`` wording). The reference
also models the turn hold and ``priority_aging``, so pools that age are checked
the same way: every grant at the lifted priority, FIFO by arrival at it, every
hold (for whom, at which priority, until when) frame for frame.

:func:`round_robin_machine` checks the fairness promise itself on a trace:
among connections continuously backlogged at one priority, grant counts over any
window differ by at most one.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Collection
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from trio_broker.core import protocol as p
from trio_broker.core.book import ParkedWant, WantBook
from trio_broker.core.broker import (
    AbortJob,
    Broker,
    BrokerConfig,
    Effect,
    StartJob,
)
from trio_broker.core.pool import PoolConfig
from trio_broker.testing.reference import ReferenceBroker
from trio_broker.testing.values import receipt as make_receipt

__all__ = [
    "BrokerMachine",
    "DifferentialMachine",
    "RoundRobinMachine",
    "TurnHoldMachine",
    "broker_machine",
    "check_pick",
    "round_robin_machine",
    "turn_hold_machine",
    "watch_picks",
]

_NEVER = 1e12  # liveness is out of scope here; it has explicit-clock tests of its own

_BAD_FRAMES = (
    b"binary",
    "not json",
    "[]",
    '{"no":"type"}',
    '{"type":"OFFER","job_id":"a","token":"t"}',
    '{"type":"WANT","job_id":"a","service":"s"}',
    '{"type":"WANT","job_id":"","service":"s","priority":1}',
    '{"type":"CANCEL","job_id":7}',
)

_STATUSES: tuple[p.Status, ...] = (
    "ok",
    "failed",
    "timed_out",
    "stalled",
    "out_of_memory",
    "cancelled",
    "stopped",
    "error",
)


def registered_broker(
    name: str, pool: PoolConfig, connections: int, **settings: Any
) -> tuple[Broker, list[int]]:
    """A broker at time 0 whose offers never expire and which never pings, with
    ``connections`` registered client connections (their first frames read)."""
    broker = Broker(
        BrokerConfig(
            instance_id=name,
            name=name,
            pool=pool,
            offer_ttl=_NEVER,
            ping_interval=_NEVER,
            ping_timeout=_NEVER,
            **settings,
        ),
        now=0.0,
    )
    conns = [broker.open_connection("127.0.0.1:1", now=0.0) for _ in range(connections)]
    for conn in conns:
        broker.receive(conn, p.Register(backend_id="b", name="n", version="1"), now=0.0)
    broker.frames_to_send()
    return broker, conns


def check_pick(
    wants: list[tuple[int, str, str, int, int]],
    rotations: dict[int, list[Any]],
    fitting: Collection[str],
    chosen: tuple[Any, str, str, int, int] | None,
) -> None:
    """Assert that one grant followed the rule, from the book as it was just before.

    ``wants`` are ``(conn, job_id, service, priority, seq)`` of every parked want,
    ``rotations`` each priority's rotation, ``fitting`` the services that fit,
    ``chosen`` the picked want (same shape) or None. The rule: the highest
    fitting priority, the first connection of its rotation with a fitting want
    there, and that connection's *oldest fitting* want at that priority.
    """
    candidates = [w for w in wants if w[2] in fitting]
    if not candidates:
        assert chosen is None, f"{chosen} picked while nothing fits"
        return
    assert chosen is not None, f"nothing picked while {candidates} fit"
    top = max(w[3] for w in candidates)
    assert chosen[3] == top, f"{chosen} picked below priority {top}"
    at_top = [w for w in candidates if w[3] == top]
    first = next(c for c in rotations[top] if any(w[0] == c for w in at_top))
    assert chosen[0] == first, f"{chosen} picked before the turn of {first!r}"
    oldest = min((w for w in at_top if w[0] == first), key=lambda w: w[4])
    assert chosen == oldest, f"FIFO among fitting wants broken: {chosen} before {oldest}"


def watch_picks(book: WantBook[Any]) -> None:
    """Check every :meth:`WantBook.pick` of this book with :func:`check_pick`."""
    pick = book.pick

    def checked(fitting: Collection[str]) -> ParkedWant[Any] | None:
        wants = [(w.conn, w.job_id, w.service, w.priority, w.seq) for w in book.wants()]
        rotations = {prio: book.rotation(prio) for prio in {w[3] for w in wants}}
        chosen = pick(fitting)
        check_pick(
            wants,
            rotations,
            fitting,
            None
            if chosen is None
            else (chosen.conn, chosen.job_id, chosen.service, chosen.priority, chosen.seq),
        )
        return chosen

    setattr(book, "pick", checked)  # noqa: B010 - shadows the method on this instance


def _comparable(
    frames: list[tuple[int, p.Message]], effects: list[Effect]
) -> tuple[list[Any], list[Any]]:
    """Frames and effects with timing-only frames and free-text wording removed."""
    kept: list[Any] = []
    for conn, message in frames:
        if isinstance(message, p.Hello | p.Ping):
            continue
        if isinstance(message, p.Error):
            kept.append((conn, "ERROR", message.code, message.job_id))
        else:
            kept.append((conn, message))
    normal: list[Any] = []
    for effect in effects:
        if isinstance(effect, AbortJob):
            normal.append(("abort", effect.run_id, effect.status))
        else:
            normal.append(effect)
    return kept, normal


class DifferentialMachine(RuleBasedStateMachine):
    """The real broker and the reference driven alike, compared after every step.

    Rules come from subclasses: :class:`BrokerMachine`, :class:`TurnHoldMachine`.
    """

    pool_config: ClassVar[PoolConfig] = PoolConfig(
        size=3, fast_reserve=1, heavy_threshold=10.0, max_slots={"light": 0, "heavy": 2}
    )
    priorities: ClassVar[tuple[int, ...]] = (-1, 0, 2)
    job_ids: ClassVar[tuple[str, ...]] = ("a", "b", "c", "d")
    offer_ttl: ClassVar[float] = 5.0
    drain_timeout: ClassVar[float] = 20.0
    turn_hold: ClassVar[float] = 0.25
    durations: ClassVar[tuple[float, ...]] = (0.5, 30.0)
    peaks: ClassVar[tuple[int | None, ...]] = (None, 100, 600)
    time_steps: ClassVar[tuple[float, ...]] = (0.0, 0.5, 1.0, 3.0, 6.0)

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        tokens = itertools.count()
        self.ref = ReferenceBroker(
            pool=self.pool_config,
            offer_ttl=self.offer_ttl,
            drain_timeout=self.drain_timeout,
            turn_hold=self.turn_hold,
        )
        self.real = Broker(
            BrokerConfig(
                instance_id="reference",
                name="model",
                pool=self.pool_config,
                offer_ttl=self.offer_ttl,
                ping_interval=_NEVER,
                ping_timeout=_NEVER,
                drain_timeout=self.drain_timeout,
                turn_hold=self.turn_hold,
                token_factory=lambda: self.ref.token(next(tokens)),
            ),
            now=self.now,
        )
        watch_picks(self.real.book)
        self.open: list[int] = []
        # what the machine knows from the real broker's outputs
        self.offers: dict[str, tuple[int, str, str]] = {}  # token -> conn, job_id, service
        self.used_tokens: set[str] = set()
        self.runs: dict[int, tuple[int, str]] = {}  # run_id -> conn, job_id
        self.parked: dict[tuple[int, str], tuple[str, int]] = {}  # (conn, job) -> service, prio
        self.services = (*self.pool_config.max_slots, "unoffered")

    # -- plumbing -----------------------------------------------------------------

    def step(self, real: Any, ref: Any) -> None:
        """Apply one input to both, then compare and check what came out."""
        real()
        ref()
        frames, effects = self.real.frames_to_send(), self.real.effects()
        ref_frames, self.ref.frames = self.ref.frames, []
        ref_effects, self.ref.effects = self.ref.effects, []
        got = _comparable(frames, effects)
        expected = _comparable(ref_frames, ref_effects)
        note(f"frames {got[0]} effects {got[1]}")
        assert got == expected, f"real {got} != reference {expected}"
        self.observe(frames, effects)

    def observe(
        self,
        frames: list[tuple[int, p.Message]],
        effects: list[Effect],
    ) -> None:
        for conn, message in frames:
            if isinstance(message, p.Offer):
                key = (conn, message.job_id)
                service, _ = self.parked.pop(key)
                # (3) and (5), checked on what the real broker did: among wants of
                # the same service (which fit or not together), none of higher
                # priority and none older on this connection and priority waits.
                # Priorities and arrivals are the reference's: aging lifts a want
                # and makes it a new arrival at its new priority.
                granted = next(w for w in reversed(self.ref.grants) if (w.conn, w.job_id) == key)
                for other in self.ref.book:
                    if other.service != service:
                        continue
                    assert other.priority <= granted.priority, (
                        f"{key} offered at {granted.priority} over {other}"
                    )
                    if other.conn == conn and other.priority == granted.priority:
                        assert other.seq > granted.seq, f"FIFO broken: {key} offered before {other}"
                assert message.token not in self.offers
                assert message.token not in self.used_tokens, "token issued twice"
                self.offers[message.token] = (conn, message.job_id, service)
            elif isinstance(message, p.Error) and message.code == "offer_expired":
                self.offers = {
                    t: o for t, o in self.offers.items() if o[:2] != (conn, message.job_id)
                }
            elif isinstance(message, p.Hello) and message.draining:
                self.parked.clear()
                self.offers.clear()
        for effect in effects:
            if isinstance(effect, StartJob):
                self.runs[effect.run_id] = (effect.conn, effect.job_id)
                # (6) the redeemed token is spent: redeeming it again must fail
                spent = [t for t, o in self.offers.items() if o[:2] == (effect.conn, effect.job_id)]
                assert len(spent) == 1, f"StartJob without exactly one offer: {spent}"
                del self.offers[spent[0]]
                self.used_tokens.add(spent[0])

    def pick(self, data: st.DataObject, items: list[Any]) -> Any:
        return data.draw(st.sampled_from(items))

    # -- helpers shared by the rules ----------------------------------------------------

    def _receive(self, conn: int, message: p.Message) -> None:
        self.step(
            lambda: self.real.receive(conn, message, now=self.now),
            lambda: self.ref.receive(conn, message, self.now),
        )

    def _open(self, *, register: bool, callback: bool) -> int:
        holder: list[int] = []
        self.step(
            lambda: holder.append(self.real.open_connection("127.0.0.1:7000", now=self.now)),
            lambda: holder.append(self.ref.open_connection(self.now)),
        )
        assert holder[0] == holder[1]
        conn = holder[0]
        self.open.append(conn)
        if register:
            url = "http://127.0.0.1:1" if callback else None
            self._receive(
                conn,
                p.Register(backend_id=f"b{conn}", name="client", version="1", callback_url=url),
            )
        return conn

    def _want(self, conn: int, job_id: str, service: str, priority: int) -> None:
        key = (conn, job_id)
        tentative = key not in self.parked
        if tentative:
            # parked before the step so that an immediate OFFER finds it
            self.parked[key] = (service, priority)
        self._receive(conn, p.Want(job_id=job_id, service=service, priority=priority))
        if tentative and key in self.parked and self.real.book.get(conn, job_id) is None:
            del self.parked[key]  # refused: duplicate, unknown service, draining...

    def _forget(self, conn: int, job_id: str) -> None:
        key = (conn, job_id)
        self.parked.pop(key, None)
        self.offers = {t: o for t, o in self.offers.items() if o[:2] != key}

    def _end(self, run_id: int, status: p.Status, duration: float, peak: int | None) -> None:
        receipt = make_receipt(status, duration=duration, peak_memory=peak)
        del self.runs[run_id]
        self.step(
            lambda: self.real.job_ended(run_id, receipt, now=self.now),
            lambda: self.ref.job_ended(run_id, receipt, self.now),
        )

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.real.check_invariants()
        self.ref.check()
        assert self.real.pool.busy == len(self.ref.busy())
        assert len(self.real.book) == len(self.ref.book)
        # what the broker reports (POSITION, STATS) is what it admits
        for snapshot in self.real.statistics().services:
            admitted = self.ref.admitted(snapshot.name)
            assert snapshot.capacity == admitted, f"{snapshot} reported, {admitted} admitted"


class BrokerMachine(DifferentialMachine):
    """The differential model check; subclass via :func:`broker_machine`."""

    # -- rules ------------------------------------------------------------------------

    @initialize(
        data=st.data(),
        history=st.lists(st.sampled_from(["light", "heavy", "none"]), min_size=4, max_size=4),
    )
    def start(self, data: st.DataObject, history: list[str]) -> None:
        """One registered connection, and services classified by a first run or not."""
        self.real.frames_to_send()
        self.real.effects()
        conn = self._open(register=True, callback=False)
        threshold = self.pool_config.heavy_threshold
        for service, kind in zip(self.pool_config.max_slots, history, strict=False):
            if kind == "none":
                continue
            self._want(conn, "warmup", service, 0)
            token = next((t for t, o in self.offers.items() if o[:2] == (conn, "warmup")), None)
            if token is None:
                self._receive(conn, p.Unwant(job_id="warmup"))
                self._forget(conn, "warmup")
                continue
            self._receive(
                conn, p.Job(job_id="warmup", token=token, service=service, subject=None, job={})
            )
            run_id = max(self.runs)
            duration = threshold * 3 if kind == "heavy" else threshold / 10
            self._end(run_id, "ok", duration, data.draw(st.sampled_from(self.peaks)))

    @rule(register=st.integers(0, 5), callback=st.booleans())
    def open_connection(self, register: int, callback: bool) -> None:
        self._open(register=register > 0, callback=callback)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def close_connection(self, data: st.DataObject) -> None:
        conn = self.pick(data, self.open)
        self.open.remove(conn)
        # its wants and offers are gone before anything else happens
        self.parked = {k: v for k, v in self.parked.items() if k[0] != conn}
        self.offers = {t: o for t, o in self.offers.items() if o[0] != conn}
        self.step(
            lambda: self.real.close_connection(conn, now=self.now),
            lambda: self.ref.close_connection(conn, self.now),
        )
        # (7) nothing of it remains
        assert conn not in self.real.connections()
        assert not any(w.conn == conn for w in self.real.book.wants())
        assert not any(o[0] == conn for o in self.offers.values())

    @precondition(lambda self: self.open)
    @rule(data=st.data(), count=st.integers(1, 4))
    def want(self, data: st.DataObject, count: int) -> None:
        """A few WANTs from random connections (duplicates and unknown services too)."""
        for _ in range(count):
            self._want(
                self.pick(data, self.open),
                self.pick(data, list(self.job_ids)),
                self.pick(data, list(self.services)),
                self.pick(data, list(self.priorities)),
            )

    @precondition(lambda self: self.open)
    @rule(data=st.data(), count=st.integers(2, 4))
    def want_burst(self, data: st.DataObject, count: int) -> None:
        """Several services from one connection at one priority, capped ones first.

        A capped service often does not fit, so the connection's oldest want is
        often not the one to offer: FIFO among the fitting wants is what counts.
        """
        conn = self.pick(data, self.open)
        priority = self.pick(data, list(self.priorities))
        offered = list(self.pool_config.max_slots)
        capped = sorted(offered, key=lambda s: self.pool_config.max_slots[s] or 1 << 30)
        for n in range(count):
            service = capped[0] if n == 0 else self.pick(data, offered)
            self._want(conn, self.pick(data, list(self.job_ids)), service, priority)

    @precondition(lambda self: self.open)
    @rule(data=st.data(), kind=st.sampled_from(["UNWANT", "CANCEL", "QUERY", "PING", "REGISTER"]))
    def send(self, data: st.DataObject, kind: str) -> None:
        """Any other client frame from one open connection."""
        conn = self.pick(data, self.open)
        job_id = self.pick(data, list(self.job_ids))
        message: p.Message
        if kind == "UNWANT":
            message = p.Unwant(job_id=job_id)
        elif kind == "CANCEL":
            message = p.Cancel(job_id=job_id)
        elif kind == "QUERY":
            message = p.Query(job_id=job_id)
        elif kind == "PING":
            message = p.Ping(nonce=job_id)
        else:
            message = p.Register(backend_id="again", name="n", version="1")
        self._receive(conn, message)
        if isinstance(message, p.Unwant | p.Cancel):
            self._forget(conn, job_id)

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def query_parked(self, data: st.DataObject) -> None:
        """QUERY a parked want: its position must match the model's replay."""
        conn, job_id = self.pick(data, sorted(self.parked))
        self._receive(conn, p.Query(job_id=job_id))

    @precondition(lambda self: self.offers)
    @rule(data=st.data(), every=st.booleans())
    def redeem(self, data: st.DataObject, every: bool) -> None:
        """JOB with outstanding tokens, as the client should."""
        tokens = sorted(self.offers) if every else [self.pick(data, sorted(self.offers))]
        for token in tokens:
            if token in self.offers:
                conn, job_id, service = self.offers[token]
                self._receive(
                    conn, p.Job(job_id=job_id, token=token, service=service, subject="s", job={})
                )

    @precondition(lambda self: self.open and (self.offers or self.used_tokens))
    @rule(data=st.data(), how=st.sampled_from(["stale", "mismatch", "service", "foreign"]))
    def misredeem(self, data: st.DataObject, how: str) -> None:
        """JOB with a spent token, another job's token, or another connection's."""
        if how == "stale" or not self.offers:
            if not self.used_tokens:
                return
            token = self.pick(data, sorted(self.used_tokens))
            conn, job_id, service = self.pick(data, self.open), "a", self.services[0]
        else:
            token = self.pick(data, sorted(self.offers))
            conn, job_id, service = self.offers[token]
            if how == "mismatch":
                job_id += "x"
            elif how == "service":
                service = self.pick(data, list(self.services))
            else:
                conn = self.pick(data, self.open)
        self._receive(
            conn, p.Job(job_id=job_id, token=token, service=service, subject=None, job={})
        )

    @precondition(lambda self: self.open and self.offers)
    @rule(data=st.data(), own=st.booleans())
    def decline(self, data: st.DataObject, own: bool) -> None:
        token = self.pick(data, sorted(self.offers))
        conn = self.offers[token][0] if own else self.pick(data, self.open)
        self._receive(conn, p.Decline(token=token))
        if self.offers[token][0] == conn:
            del self.offers[token]

    @precondition(lambda self: self.runs)
    @rule(
        data=st.data(),
        every=st.booleans(),
        status=st.sampled_from(_STATUSES),
        heavy=st.booleans(),
    )
    def end_jobs(self, data: st.DataObject, every: bool, status: p.Status, heavy: bool) -> None:
        runs = sorted(self.runs) if every else [self.pick(data, sorted(self.runs))]
        duration = self.durations[-1] if heavy else self.durations[0]
        for run_id in runs:
            self._end(run_id, status, duration, data.draw(st.sampled_from(self.peaks)))

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        self.now += data.draw(st.sampled_from(self.time_steps), label="dt")
        self.step(lambda: self.real.tick(now=self.now), lambda: self.ref.tick(self.now))

    @precondition(lambda self: self.open)
    @rule(data=st.data(), text=st.sampled_from(_BAD_FRAMES))
    def bad_frame(self, data: st.DataObject, text: str | bytes) -> None:
        conn = self.pick(data, self.open)
        self.step(
            lambda: self.real.receive_text(conn, text, now=self.now),
            lambda: self.ref.receive_text(conn, text, self.now),
        )

    @precondition(lambda self: not self.real.draining)
    @rule(weight=st.integers(0, 19))
    def drain(self, weight: int) -> None:
        if weight:  # rare: draining ends most of the interesting behaviour
            return
        self.step(lambda: self.real.drain(now=self.now), lambda: self.ref.drain(self.now))

    @precondition(lambda self: self.real.draining)
    @rule()
    def stop(self) -> None:
        self.step(lambda: self.real.stop(now=self.now), lambda: self.ref.stop(self.now))


def broker_machine(
    pool: PoolConfig,
    *,
    priorities: tuple[int, ...] = (-1, 0, 2),
    job_ids: tuple[str, ...] = ("a", "b", "c", "d"),
    offer_ttl: float = 5.0,
    durations: tuple[float, ...] | None = None,
    peaks: tuple[int | None, ...] | None = None,
    turn_hold: float = 0.25,
    time_steps: tuple[float, ...] = (0.0, 0.5, 1.0, 3.0, 6.0),
) -> type[BrokerMachine]:
    """A :class:`BrokerMachine` for this pool configuration.

    Args:
        pool: the pool to check (services are its ``max_slots`` keys).
        priorities: the priorities wants are drawn from.
        job_ids: the job ids wants are drawn from (few, so duplicates happen).
        offer_ttl: offer lifetime in model seconds (time advances 0 to 6 s a step).
        durations: job runtimes to draw from; by default one light and one heavy.
        peaks: memory peaks to draw from; by default None and two sizes around
            the memory budget when one is set.
        turn_hold: the broker's ``turn_hold`` (0: none).
        time_steps: how far the clock may move in one step. With
            ``priority_aging`` set, steps shorter than ``turn_hold`` let a lift
            fall due while a slot is held.

    Returns:
        A state machine class; run it with ``.TestCase`` under pytest/unittest.
    """
    threshold = pool.heavy_threshold
    budget = pool.memory_budget
    attributes: dict[str, Any] = {
        "pool_config": pool,
        "priorities": priorities,
        "job_ids": job_ids,
        "offer_ttl": offer_ttl,
        "turn_hold": turn_hold,
        "time_steps": time_steps,
        "durations": durations or (threshold / 10, threshold * 3),
        "peaks": peaks or ((None, budget // 3, budget // 2 + 1) if budget else (None, 100)),
    }
    return type("ConfiguredBrokerMachine", (BrokerMachine,), attributes)


# -- the turn hold across priorities and with aging ------------------------------------


class TurnHoldMachine(DifferentialMachine):
    """The turn hold as clients meet it, against the reference, frame for frame.

    Connections behave as the library's clients do: every ``OFFER`` is
    redeemed at once, and when a job ends its connection often parks its next
    want of the same service and priority at once (a client with jobs in
    flight). Connections park several wants at several priorities, so they
    hold several slots at once and are served by the rotation while older jobs
    still run; jobs end in any order; time moves by less than the hold and by
    more, and, with ``priority_aging``, lifts fall due while slots are held.
    So the reference decides every hold (for whom, at which priority, until
    when, and what ends it) and every grant at the lifted priority, and the
    real broker must agree with each.
    """

    connection_count: ClassVar[int] = 3
    time_steps: ClassVar[tuple[float, ...]] = (0.0, 0.1, 0.3, 1.0)

    def __init__(self) -> None:
        super().__init__()
        self.jobs = itertools.count()
        self.kinds: dict[tuple[int, str], tuple[str, int]] = {}  # (conn, job) -> service, base

    def _redeem_all(self) -> None:
        for token in sorted(self.offers):
            if token in self.offers:
                conn, job_id, service = self.offers[token]
                self._receive(
                    conn, p.Job(job_id=job_id, token=token, service=service, subject=None, job={})
                )

    def _next(self, conn: int, service: str, priority: int) -> None:
        job_id = f"j{next(self.jobs)}"
        self.kinds[(conn, job_id)] = (service, priority)
        self._want(conn, job_id, service, priority)

    @initialize()
    def start(self) -> None:
        self.real.frames_to_send()
        self.real.effects()
        for _ in range(self.connection_count):
            self._open(register=True, callback=False)

    @rule(data=st.data(), count=st.integers(1, 3))
    def want(self, data: st.DataObject, count: int) -> None:
        conn = self.pick(data, self.open)
        service = self.pick(data, list(self.pool_config.max_slots))
        priority = self.pick(data, list(self.priorities))
        for _ in range(count):
            self._next(conn, service, priority)
        self._redeem_all()

    @precondition(lambda self: self.runs)
    @rule(data=st.data(), refill=st.booleans())
    def end(self, data: st.DataObject, refill: bool) -> None:
        """A job ends (any of them); its connection may park its next want at once."""
        run_id = self.pick(data, sorted(self.runs))
        conn, job_id = self.runs[run_id]
        self._end(run_id, "ok", self.durations[0], None)
        if refill and conn in self.open:
            self._next(conn, *self.kinds[(conn, job_id)])
        self._redeem_all()

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def unwant(self, data: st.DataObject) -> None:
        conn, job_id = self.pick(data, sorted(self.parked))
        self._receive(conn, p.Unwant(job_id=job_id))
        self._forget(conn, job_id)
        self._redeem_all()

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """Time passes; the broker is woken only when it asks to be (aging arms no
        timer, so a lift may fall due with no input until the next WANT or end)."""
        self.now += data.draw(st.sampled_from(self.time_steps), label="dt")
        due = self.real.next_deadline()
        if due is not None and due <= self.now:
            self.step(lambda: self.real.tick(now=self.now), lambda: self.ref.tick(self.now))
        self._redeem_all()


def turn_hold_machine(
    pool: PoolConfig,
    *,
    connections: int = 3,
    priorities: tuple[int, ...] = (0, 2),
    turn_hold: float = 0.25,
    time_steps: tuple[float, ...] = (0.0, 0.1, 0.3, 1.0),
) -> type[TurnHoldMachine]:
    """A :class:`TurnHoldMachine` for this pool (services are its ``max_slots`` keys).

    Raises:
        ValueError: fewer than two connections or no turn hold (nothing to check).
    """
    if connections < 2 or not turn_hold > 0:
        raise ValueError("turn_hold_machine needs two connections and a positive turn_hold")
    attributes: dict[str, Any] = {
        "pool_config": pool,
        "connection_count": connections,
        "priorities": priorities,
        "turn_hold": turn_hold,
        "time_steps": time_steps,
        "durations": (pool.heavy_threshold / 10,),
    }
    return type("ConfiguredTurnHoldMachine", (TurnHoldMachine,), attributes)


# -- round-robin fairness on a trace ----------------------------------------------------


class RoundRobinMachine(RuleBasedStateMachine):
    """Fairness as the protocol promises it, observed on grants only.

    One light service and no other limit, so every parked want fits whenever a
    slot is free. Connections park wants at random priorities, unwant some,
    decline offers or run them, and jobs end at random; every grant is recorded.
    Checked:

    * for each pair of connections continuously backlogged at a priority, their
      grant counts over the common stretch differ by at most one;
    * a connection that empties and refills at once (its job ends and it parks
      its next want before anything else happens, as a client with one job in
      flight does) keeps its turn when it is owed it: when no want above the
      job's priority is parked and every connection waiting at that priority
      was offered a slot there after the ended job was (and since it joined),
      the refill is offered the freed slot at once (the turn hold).
    """

    size: ClassVar[int] = 2
    connection_count: ClassVar[int] = 3
    priorities: ClassVar[tuple[int, ...]] = (0, 1)
    turn_hold: ClassVar[float] = 0.25

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        pool = PoolConfig(size=self.size, fast_reserve=0, unknown_share=1.0, max_slots={"s": 0})
        self.broker, self.conns = registered_broker(
            "rr", pool, self.connection_count, turn_hold=self.turn_hold
        )
        watch_picks(self.broker.book)
        self.job_counter = itertools.count()
        self.parked: dict[tuple[int, int], int] = {}  # (conn, priority) -> parked count
        self.wants: dict[tuple[int, str], int] = {}  # (conn, job) -> priority
        # (conn, job_id, token, priority, grant index)
        self.offers: list[tuple[int, str, str, int, int]] = []
        self.grants: dict[int, list[tuple[int, int]]] = {}  # priority -> (index, conn)
        self.grant_count = 0
        # (conn, priority) -> index of the first grant of its current backlog streak
        self.streaks: dict[tuple[int, int], int] = {}
        # (conn, priority) -> index of its last grant there
        self.last_grant: dict[tuple[int, int], int] = {}
        # run_id -> (conn, priority, grant index)
        self.running: dict[int, tuple[int, int, int]] = {}
        self.started: dict[tuple[int, str], tuple[int, int]] = {}
        # connections whose job ended without a refill since their last WANT: the
        # broker may hold a slot for them, which this model does not follow
        self.maybe_held: set[int] = set()

    def _drain_frames(self) -> list[tuple[int, str]]:
        """Record what the broker sent; returns the (conn, job_id) offered."""
        offered = []
        for conn, message in self.broker.frames_to_send():
            if isinstance(message, p.Offer):
                priority = self.wants.pop((conn, message.job_id))
                self.parked[(conn, priority)] -= 1
                index = self.grant_count
                self.grant_count += 1
                self.grants.setdefault(priority, []).append((index, conn))
                self.last_grant[(conn, priority)] = index
                self.offers.append((conn, message.job_id, message.token, priority, index))
                offered.append((conn, message.job_id))
                self._check(priority)
                if self.parked[(conn, priority)] == 0:
                    self.streaks.pop((conn, priority), None)
        for effect in self.broker.effects():
            if isinstance(effect, StartJob):
                priority, index = self.started.pop((effect.conn, effect.job_id))
                self.running[effect.run_id] = (effect.conn, priority, index)
        return offered

    def _owed(self, conn: int, priority: int, granted: int) -> bool:
        """The turn hold's condition, from the grants this model saw.

        ``granted`` is the grant of the job that ended; a connection served
        again at that priority since then counts from its latest grant there.
        """
        granted = max(granted, self.last_grant.get((conn, priority), granted))
        parked = [(c, prio) for (c, prio), n in self.parked.items() if n > 0]
        if any(prio > priority for _, prio in parked) or (conn, priority) in parked:
            return False
        if not any(prio == priority for _, prio in parked):
            return False
        return all(
            self.last_grant.get((c, prio), -1) >= self.streaks[(c, prio)]
            and self.last_grant[(c, prio)] > granted
            for c, prio in parked
            if prio == priority
        )

    def _check(self, priority: int) -> None:
        grants = self.grants[priority]
        members = [(c, s) for (c, prio), s in self.streaks.items() if prio == priority]
        for (a, sa), (b, sb) in itertools.combinations(members, 2):
            start = max(sa, sb)
            window = grants[bisect_left(grants, (start, -1)) :]
            count_a = sum(1 for _, c in window if c == a)
            count_b = sum(1 for _, c in window if c == b)
            assert abs(count_a - count_b) <= 1, (
                f"priority {priority}: connection {a} got {count_a}, {b} got {count_b} "
                f"while both were backlogged"
            )

    @rule(data=st.data(), count=st.integers(1, 4))
    def want(self, data: st.DataObject, count: int) -> None:
        conn = data.draw(st.sampled_from(self.conns))
        priority = data.draw(st.sampled_from(self.priorities))
        for _ in range(count):
            self._park(conn, priority)

    def _park(self, conn: int, priority: int) -> list[tuple[int, str]]:
        job_id = f"j{next(self.job_counter)}"
        self.wants[(conn, job_id)] = priority
        key = (conn, priority)
        if self.parked.get(key, 0) == 0:
            self.streaks[key] = self.grant_count
        self.parked[key] = self.parked.get(key, 0) + 1
        self.maybe_held.discard(conn)
        self.broker.receive(
            conn, p.Want(job_id=job_id, service="s", priority=priority), now=self.now
        )
        offered = self._drain_frames()
        return [o for o in offered if o == (conn, job_id)]

    @precondition(lambda self: self.wants)
    @rule(data=st.data())
    def unwant(self, data: st.DataObject) -> None:
        conn, job_id = data.draw(st.sampled_from(sorted(self.wants)))
        priority = self.wants.pop((conn, job_id))
        self.parked[(conn, priority)] -= 1
        if self.parked[(conn, priority)] == 0:
            self.streaks.pop((conn, priority), None)
        self.broker.receive(conn, p.Unwant(job_id=job_id), now=self.now)
        self._drain_frames()

    @precondition(lambda self: self.offers)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """An offer is declined: the slot frees at once."""
        offer = data.draw(st.sampled_from(self.offers))
        self.offers.remove(offer)
        self.broker.receive(offer[0], p.Decline(token=offer[2]), now=self.now)
        self._drain_frames()

    @precondition(lambda self: self.offers)
    @rule(data=st.data())
    def redeem(self, data: st.DataObject) -> None:
        """An offer is taken: its job runs."""
        conn, job_id, token, priority, index = data.draw(st.sampled_from(self.offers))
        self.offers.remove((conn, job_id, token, priority, index))
        self.started[(conn, job_id)] = (priority, index)
        job = p.Job(job_id=job_id, token=token, service="s", subject=None, job={})
        self.broker.receive(conn, job, now=self.now)
        self._drain_frames()

    @precondition(lambda self: self.running)
    @rule(data=st.data(), refill=st.booleans())
    def end(self, data: st.DataObject, refill: bool) -> None:
        """A job ends; with ``refill`` its connection parks its next want at once."""
        run_id = data.draw(st.sampled_from(sorted(self.running)))
        conn, priority, index = self.running.pop(run_id)
        owed = self._owed(conn, priority, index) and conn not in self.maybe_held
        self.broker.job_ended(run_id, make_receipt("ok"), now=self.now)
        self._drain_frames()
        if not refill:
            self.maybe_held.add(conn)
            return
        offered = self._park(conn, priority)
        note(f"refill of {conn} at {priority}: owed {owed}, offered {offered}")
        if owed:
            assert offered, f"connection {conn} refilled at once but lost the turn it was owed"

    @rule()
    def advance(self) -> None:
        """Time passes beyond every turn hold."""
        self.now += self.turn_hold + 1.0
        self.broker.tick(now=self.now)
        self.maybe_held.clear()
        self._drain_frames()

    @invariant()
    def consistent(self) -> None:
        self.broker.check_invariants()


def round_robin_machine(
    *,
    size: int = 2,
    connections: int = 3,
    priorities: tuple[int, ...] = (0, 1),
    turn_hold: float = 0.25,
) -> type[RoundRobinMachine]:
    """A :class:`RoundRobinMachine` with this many slots, connections and priorities."""
    return type(
        "ConfiguredRoundRobinMachine",
        (RoundRobinMachine,),
        {
            "size": size,
            "connection_count": connections,
            "priorities": priorities,
            "turn_hold": turn_hold,
        },
    )
