"""The connection driver's timer task on trio's MockClock, with a real broker core.

No sockets here: connections are opened on the core alone, so their frames find no
outbox and are dropped, and only the timer logic is under test. The core records
every tick with the deadline that was due; the clock only moves when the test or
the autojump moves it, so a tick early, late or without a due timer shows.
"""

from __future__ import annotations

import trio
import trio.testing

from trio_broker.core import protocol as p
from trio_broker.core.broker import Broker, BrokerConfig, Effect
from trio_broker.core.pool import PoolConfig
from trio_broker.trio.driver import CoreDriver


class RecordingBroker(Broker):
    """A broker that records ``(now, the deadline that was due)`` at every tick.

    A tick with nothing due fails at once, inside the timer task: a driver that
    spins would otherwise keep the autojump clock from ever moving.
    """

    def __init__(self, config: BrokerConfig, *, now: float) -> None:
        super().__init__(config, now=now)
        self.ticks: list[tuple[float, float | None]] = []

    def tick(self, *, now: float, due: float | None = None) -> None:
        deadline = self.next_deadline()
        self.ticks.append((now, deadline))
        assert deadline is not None, f"ticked at {now} with no timer pending"
        assert deadline <= now, f"ticked at {now} with {deadline} due"
        super().tick(now=now, due=due)


def driven(
    *, offer_ttl: float = 10.0, ping_interval: float, ping_timeout: float
) -> tuple[RecordingBroker, CoreDriver[Effect]]:
    """A one-slot broker with service ``s`` and its driver (effects are not carried out)."""
    config = BrokerConfig(
        instance_id="inst",
        name="exec",
        pool=PoolConfig(size=1, max_slots={"s": 0}, unknown_share=1.0),
        offer_ttl=offer_ttl,
        ping_interval=ping_interval,
        ping_timeout=ping_timeout,
    )
    core = RecordingBroker(config, now=trio.current_time())
    return core, CoreDriver[Effect](core, lambda effect: None, closed=core.close_connection)


async def test_the_timer_ticks_at_each_deadline_and_sleeps_between(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """An idle connection's timers (PING, HELLO window, idle figure, ping_timeout) are ticked
    exactly when due and never in between, and the silent peer is dropped at ping_timeout."""
    core, driver = driven(ping_interval=5.0, ping_timeout=15.0)
    nursery.start_soon(driver.run_timers)
    opened = trio.current_time()
    conn = core.open_connection("127.0.0.1:7000", now=opened)
    driver.flush()
    with trio.fail_after(60):
        await driver.wait_until(lambda: conn not in core.connections())
    assert trio.current_time() == opened + 15.0
    assert len(core.ticks) >= 3  # two PINGs, then the ping_timeout
    assert all(now == due for now, due in core.ticks), core.ticks


async def test_an_earlier_deadline_wakes_the_timer_to_re_arm(
    mock_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """A timer task asleep until a later deadline is re-armed by an input that sets an earlier
    one (an offer expiring after offer_ttl), and ticks exactly then."""
    core, driver = driven(offer_ttl=0.25, ping_interval=5.0, ping_timeout=15.0)
    nursery.start_soon(driver.run_timers)
    conn = core.open_connection("127.0.0.1:7000", now=trio.current_time())
    core.receive(conn, p.Register(backend_id="b", name="n", version="1"), now=trio.current_time())
    driver.flush()
    await trio.testing.wait_all_tasks_blocked()
    asleep_until = core.next_deadline()
    assert asleep_until is not None
    offered = trio.current_time()
    assert offered + 0.25 < asleep_until
    core.receive(conn, p.Want(job_id="j", service="s", priority=0), now=offered)
    driver.flush()
    await trio.testing.wait_all_tasks_blocked()
    assert core.ticks == []  # woken to re-arm, not to tick: nothing was due
    mock_clock.jump(0.25)
    await trio.testing.wait_all_tasks_blocked()
    assert core.ticks == [(offered + 0.25, offered + 0.25)]
    assert core.statistics().counters["offers_expired"] == 1
