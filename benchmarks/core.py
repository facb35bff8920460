"""Grant decisions per second of the sans-IO core, by size of the want-book.

Run: ``.venv/bin/python benchmarks/core.py`` (``--quick`` for a short run).

The scenario: 1,000 connections, 8 services with mixed limits (two capped by
``max_slots``, two heavy that may not take the fast reserve, three light, one not
yet measured and held to ``unknown_share``), priorities spread over five levels,
and a full pool of 32 slots. For each book size (1k, 10k, 100k parked wants) it
measures two figures, each over many *cycles* in steady state:

decision
    a slot has freed: ``SlotPool.fitting()`` says which services fit, the grant
    rule (``WantBook.pick``) picks the next want, and the pool takes the slot for
    it. Only this is timed.
cycle
    a whole steady-state step around it: the pool releases a random busy slot,
    the decision(s), and a new want parked per grant so the book keeps its size.
protocol
    the same through the :class:`~trio_broker.core.broker.Broker` inputs a real
    execserver feeds: ``job_ended`` (its ``DONE`` frame), the grant loop and its
    ``OFFER``, the client's ``JOB`` redeeming the token, and a fresh ``WANT``
    (parked, answered ``QUEUED``). Message values, no JSON (the codec has its own
    benchmark).

The baseline measured in the same run is a plain ``dict`` insert + pop per cycle,
the cheapest possible "queue": it shows how noisy the machine is right now.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import time
from collections.abc import Callable

from trio_broker.core import protocol as p
from trio_broker.core.book import WantBook
from trio_broker.core.broker import Broker, BrokerConfig, StartJob
from trio_broker.core.pool import PoolConfig, SlotPool
from trio_broker.testing.values import receipt

SERVICES = {
    "ffmpeg": 2,  # capped
    "libreoffice": 4,  # capped
    "video": 0,  # heavy
    "pdf": 0,  # heavy
    "exif": 0,  # light
    "thumb": 0,  # light
    "meta": 0,  # light
    "plugin": 0,  # unknown
}
HEAVY = ("video", "pdf")
LIGHT = ("ffmpeg", "libreoffice", "exif", "thumb", "meta")
PRIORITIES = (-2, 0, 0, 2, 4)
CONNECTIONS = 1000
POOL = PoolConfig(
    size=32, fast_reserve=8, heavy_threshold=10.0, unknown_share=0.25, max_slots=SERVICES
)


def _classify(pool: SlotPool) -> None:
    for name in HEAVY:
        pool.record(name, receipt(duration=60.0))
    for name in LIGHT:
        pool.record(name, receipt(duration=0.5))


def decision_rate(wants: int, cycles: int, rng: random.Random) -> tuple[float, float]:
    """Decisions per second, and whole cycles per second, on SlotPool and WantBook.

    A cycle releases one busy slot, makes the grant decision(s) — ``fitting()``,
    ``pick()``, ``acquire()`` — and parks a new want per grant to keep the book's
    size. Only the decisions are timed for the first figure.
    """
    pool = SlotPool(POOL)
    _classify(pool)
    book: WantBook[int] = WantBook()
    names = list(SERVICES)
    counter = itertools.count()
    for _ in range(wants):
        book.add(rng.randrange(CONNECTIONS), f"w{next(counter)}", rng.choice(names),
                 rng.choice(PRIORITIES))  # fmt: skip
    busy: list[tuple[str, int]] = []
    while True:
        fitting = pool.fitting()
        want = book.pick(fitting) if fitting else None
        if want is None:
            break
        busy.append((want.service, pool.acquire(want.service)))
        book.add(want.conn, f"w{next(counter)}", want.service, want.priority)
    picks = [rng.randrange(10**9) for _ in range(cycles)]
    new = [(rng.randrange(CONNECTIONS), rng.choice(names), rng.choice(PRIORITIES))
           for _ in range(cycles)]  # fmt: skip
    clock = time.perf_counter_ns
    deciding = 0
    decisions = 0
    start = time.perf_counter()
    for i in range(cycles):
        service, reserved = busy.pop(picks[i] % len(busy))
        pool.release(service, reserved)
        while True:
            began = clock()
            fitting = pool.fitting()
            want = book.pick(fitting) if fitting else None
            if want is not None:
                busy.append((want.service, pool.acquire(want.service)))
            deciding += clock() - began
            if want is None:
                break
            decisions += 1
            conn, name, priority = new[i]
            book.add(conn, f"w{next(counter)}", name, priority)
    elapsed = time.perf_counter() - start
    assert len(book) == wants, (len(book), wants)
    return decisions / (deciding / 1e9), cycles / elapsed


def protocol_rate(wants: int, cycles: int, rng: random.Random) -> float:
    """Cycles per second through the Broker's inputs (job end, OFFER, JOB, WANT)."""
    now = 0.0
    broker = Broker(
        BrokerConfig(instance_id="bench", name="bench", pool=POOL, offer_ttl=1e9,
                     ping_interval=1e9, ping_timeout=1e9),
        now=now,
    )  # fmt: skip
    _classify(broker.pool)
    conns = [broker.open_connection("127.0.0.1:7000", now=now) for _ in range(CONNECTIONS)]
    for conn in conns:
        broker.receive(conn, p.Register(backend_id="b", name="n", version="1"), now=now)
    broker.frames_to_send()
    names = list(SERVICES)
    counter = itertools.count()
    running: list[int] = []

    def settle() -> None:
        """Redeem every offer at once, as a prompt client would."""
        for conn, message in broker.frames_to_send():
            if isinstance(message, p.Offer):
                job = p.Job(
                    job_id=message.job_id,
                    token=message.token,
                    service=service_of[message.job_id],
                    subject=None,
                    job={},
                )
                broker.receive(conn, job, now=now)
        for effect in broker.effects():
            if isinstance(effect, StartJob):
                running.append(effect.run_id)

    service_of: dict[str, str] = {}
    for _ in range(wants):
        job_id = f"w{next(counter)}"
        service_of[job_id] = rng.choice(names)
        broker.receive(
            conns[rng.randrange(CONNECTIONS)],
            p.Want(job_id=job_id, service=service_of[job_id], priority=rng.choice(PRIORITIES)),
            now=now,
        )
        settle()
    parked = len(broker.book)
    light_receipt = receipt(duration=0.5)
    heavy_receipt = receipt(duration=60.0)
    plan = [(rng.randrange(10**9), rng.randrange(CONNECTIONS), rng.choice(names),
             rng.choice(PRIORITIES)) for _ in range(cycles)]  # fmt: skip
    start = time.perf_counter()
    for pick, conn_index, name, priority in plan:
        run_id = running.pop(pick % len(running))
        broker.job_ended(run_id, light_receipt if pick % 7 else heavy_receipt, now=now)
        settle()
        job_id = f"w{next(counter)}"
        service_of[job_id] = name
        broker.receive(conns[conn_index], p.Want(job_id=job_id, service=name, priority=priority),
                       now=now)  # fmt: skip
        settle()
    elapsed = time.perf_counter() - start
    assert abs(len(broker.book) - parked) <= POOL.size
    return cycles / elapsed


def baseline_rate(cycles: int) -> float:
    """dict insert + pop per cycle: the floor of any want-book."""
    book: dict[int, int] = {}
    start = time.perf_counter()
    for i in range(cycles):
        book[i] = i
        book.pop(i)
    return cycles / (time.perf_counter() - start)


def best_of(runs: int, fn: Callable[[], float]) -> float:
    return max(fn() for _ in range(runs))


def best_pair(runs: int, fn: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    results = [fn() for _ in range(runs)]
    return max(r[0] for r in results), max(r[1] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cycles and runs")
    args = parser.parse_args()
    cycles = 5_000 if args.quick else 40_000
    runs = 1 if args.quick else 3
    rng = random.Random(20261130)
    print(f"baseline dict insert+pop: {best_of(runs, lambda: baseline_rate(cycles * 10)):,.0f}/s")
    print(f"{'parked wants':>12} {'decisions/s':>12} {'cycles/s':>10} {'protocol cycles/s':>18}")
    rates: dict[int, tuple[float, float, float]] = {}
    for wants in (1_000, 10_000, 100_000):
        decision, cycle = best_pair(runs, functools.partial(decision_rate, wants, cycles, rng))
        protocol = best_of(runs, functools.partial(protocol_rate, wants, cycles // 4, rng))
        rates[wants] = (decision, cycle, protocol)
        print(f"{wants:>12,} {decision:>12,.0f} {cycle:>10,.0f} {protocol:>18,.0f}")
    small, large = rates[1_000], rates[100_000]
    print(
        f"slowdown 100k vs 1k: decisions {small[0] / large[0]:.2f}x, "
        f"cycles {small[1] / large[1]:.2f}x, protocol {small[2] / large[2]:.2f}x"
    )


if __name__ == "__main__":
    main()
