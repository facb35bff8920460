"""A model check of the client core's timers: job deadlines and pool growth.

:func:`client_timers_machine` drives a :class:`~trio_broker.core.client.ClientCore`
behind one balanced address (a balancer in front of a fleet of pods, two of
which offer a service the others do not: its jobs probe) and plays
every execserver: dials land on a pod or fail, connections are lost, pods offer
slots, refuse the ``JOB`` (``unknown_token``, ``token_mismatch``, ``draining``)
or finish it, jobs are submitted and time moves by less than every interval and
by more. The core is woken exactly at each instant it asks for. Checked against
a model kept from the inputs alone, from the rules written in the headers of
:mod:`trio_broker.core.client` and :mod:`trio_broker.core._client_pool`:

* *deadlines*: a job fails with ``no_slot`` at the first wake at or after
  ``submit + connect_timeout`` while it waits, never before; a refused ``JOB``
  does not move the deadline (the job waits again with the one it had);
* *growth*: the dials that grow the pool (every dial after the core's first)
  are at least ``pool_grow_interval`` apart, whatever became of the earlier
  ones (failed, lost); the back-off is set far beyond the run, so no dial is a
  redial;
* *wakes*: the core never asks to be woken again at the instant it was just
  woken at without something having happened (a timer that fires and does
  nothing spins a clock that jumps to it)::

    from trio_broker.testing.client_timers import client_timers_machine

    TestTimers = client_timers_machine(connect_timeout=6.0, grow_interval=2.0).TestCase
"""

from __future__ import annotations

import itertools
from typing import ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from trio_broker.core import protocol as p
from trio_broker.core.client import ClientConfig, ClientCore, Dial, Failed, Finished
from trio_broker.testing.values import receipt

__all__ = ["ClientTimersMachine", "client_timers_machine"]

_ADDRESS = "lb:80"
_PODS = ("pod-a", "pod-b", "pod-c", "pod-d")
_PROBED = ("pod-c", "pod-d")  # the only pods offering service "p": its jobs probe
_REFUSALS: tuple[p.ErrorCode, ...] = ("unknown_token", "token_mismatch", "draining")


def _hello(instance: str) -> p.Hello:
    return p.Hello(
        protocol=1,
        instance_id=instance,
        name=instance,
        services={
            service: p.ServiceInfo(max_slots=0, kind="light")
            for service in ("s", "p")
            if service == "s" or instance in _PROBED
        },
        processes=2,
        idle=0,
        clients=1,
        draining=False,
        addr=f"{instance}:7000",
    )


class ClientTimersMachine(RuleBasedStateMachine):
    """See the module docstring; configure it with :func:`client_timers_machine`."""

    connect_timeout: ClassVar[float] = 6.0
    grow_interval: ClassVar[float] = 2.0
    retry_tick: ClassVar[float] = 1.0
    steps: ClassVar[tuple[float, ...]] = (0.001, 0.1, 0.5, 1.0, 1.9, 2.0, 3.0)

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.core = ClientCore(
            ClientConfig(
                backend_id="c",
                name="c",
                version="1",
                addresses=(_ADDRESS,),
                connect_timeout=self.connect_timeout,
                retry_tick=self.retry_tick,
                pool_grow_interval=self.grow_interval,
                pool_max=4,
                # a job that probes waits for its search, at most its connect_timeout
                pool_reprobe_interval=self.connect_timeout,
                ping_interval=1e6,
                ping_timeout=2e6,
                reconnect_min=1e6,
                reconnect_max=1e6,
            ),
            now=0.0,
        )
        self.dials: list[float] = []  # when each dial to the address was asked for
        self.dialing: list[int] = []
        self.open: list[int] = []  # connected, HELLO sent
        self.deadlines: dict[str, float] = {}  # job_id -> submit + connect_timeout
        self.offered: dict[str, tuple[int, str]] = {}  # job_id -> conn, token (JOB sent)
        self.jobs = itertools.count()
        self.tokens = itertools.count()
        self._outputs()

    # -- plumbing ------------------------------------------------------------------------

    def _outputs(self) -> None:
        """Take the core's effects and frames, checking what they say against the model."""
        for effect in self.core.effects():
            if isinstance(effect, Dial):
                self._dialled(effect.conn)
            elif isinstance(effect, Failed):
                deadline = self.deadlines.pop(effect.job_id)
                self.offered.pop(effect.job_id, None)
                if effect.reason == "no_slot":
                    assert self.now >= deadline, f"{effect.job_id} failed before {deadline}"
            elif isinstance(effect, Finished):
                self.deadlines.pop(effect.job_id)
        for conn, message in self.core.frames_to_send():
            if isinstance(message, p.Job):
                self.offered[message.job_id] = (conn, message.token)

    def _dialled(self, conn: int) -> None:
        # the first dial is the core's own start, every later one growth
        if len(self.dials) > 1:  # (the sum, as the rule compares: never a difference)
            allowed = self.dials[-1] + self.grow_interval
            assert self.now >= allowed, f"growth dial at {self.now!r} before {allowed!r}"
        self.dials.append(self.now)
        self.dialing.append(conn)

    def _wake(self, until: float) -> None:
        """Wake the core at every instant it asks for up to ``until``, then move there."""
        self._outputs()
        same = 0
        while (due := self.core.next_deadline()) is not None and due <= until:
            self.now = max(self.now, due)
            self.core.tick(now=self.now)
            self._outputs()
            again = self.core.next_deadline()
            same = same + 1 if again == due else 0
            assert same < 3, f"woken at {due!r}, the core asks for {due!r} again and again"
        self.now = until

    def _lose(self, conn: int) -> None:
        self.open.remove(conn)
        self.core.connection_closed(conn, now=self.now)
        self.offered = {j: o for j, o in self.offered.items() if o[0] != conn}
        self._wake(self.now)

    # -- rules ---------------------------------------------------------------------------

    @initialize(data=st.data(), jobs=st.integers(0, 2))
    def start(self, data: st.DataObject, jobs: int) -> None:
        """The first dial lands a moment after the start; a few jobs come."""
        self._wake(self.now + data.draw(st.sampled_from(self.steps), label="dt"))
        (conn,) = self.dialing
        self.dialing.remove(conn)
        self.core.connected(conn, peer_addr=_ADDRESS, now=self.now)
        self.core.receive(conn, _hello(_PODS[0]), now=self.now)
        self.open.append(conn)
        self._wake(self.now)
        if jobs:
            self.submit(jobs)

    @rule(count=st.integers(1, 2), service=st.sampled_from(["s", "p"]))
    def submit(self, count: int, service: str = "s") -> None:
        """Jobs come: of a service every pod offers, or of one only some do (it probes:
        the pool grows at once)."""
        for _ in range(count):
            job_id = f"j{next(self.jobs)}"
            self.deadlines[job_id] = self.now + self.connect_timeout
            self.core.submit(job_id, service, {}, now=self.now)
            self._wake(self.now)

    @precondition(lambda self: self.dialing)
    @rule(data=st.data(), lands=st.booleans())
    def dial_outcome(self, data: st.DataObject, lands: bool) -> None:
        """A dial lands on a pod (a new one or one already reached), or fails."""
        conn = data.draw(st.sampled_from(self.dialing), label="conn")
        self.dialing.remove(conn)
        if not lands:
            self.core.dial_failed(conn, now=self.now)
            self._wake(self.now)
            return
        self.core.connected(conn, peer_addr=_ADDRESS, now=self.now)
        self.open.append(conn)
        pod = data.draw(st.sampled_from(_PODS), label="pod")
        self.core.receive(conn, _hello(pod), now=self.now)
        if conn not in self.core.ready_connections():  # a duplicate pod: closed at once
            self.open.remove(conn)
            self.core.connection_closed(conn, now=self.now)
        self._wake(self.now)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        self._lose(data.draw(st.sampled_from(self.open), label="conn"))

    @precondition(lambda self: self.open and self.core.waiting_count())
    @rule(data=st.data())
    def offer(self, data: st.DataObject) -> None:
        """A pod offers a slot to a job parked on it (the core answers with JOB)."""
        job_id = data.draw(st.sampled_from(sorted(self.core.waiting())), label="job")
        on = sorted(self.core.parked_on(job_id))
        if not on:
            return
        conn = data.draw(st.sampled_from(on), label="conn")
        token = f"t{next(self.tokens)}"
        self.core.receive(conn, p.Offer(job_id=job_id, token=token), now=self.now)
        self._wake(self.now)

    @precondition(lambda self: self.offered)
    @rule(data=st.data(), code=st.sampled_from(_REFUSALS), done=st.booleans())
    def answer(self, data: st.DataObject, code: p.ErrorCode, done: bool) -> None:
        """The pod refuses the JOB (the job waits again, same deadline) or finishes it."""
        job_id = data.draw(st.sampled_from(sorted(self.offered)), label="job")
        conn, _ = self.offered.pop(job_id)
        message: p.Message = (
            p.Done(job_id=job_id, receipt=receipt("ok"))
            if done
            else p.Error(code=code, message="refused", job_id=job_id)
        )
        self.core.receive(conn, message, now=self.now)
        self._wake(self.now)

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """Time passes: a millisecond (instants whose sums round), or up to seconds."""
        self._wake(self.now + data.draw(st.sampled_from(self.steps), label="dt"))

    @invariant()
    def consistent(self) -> None:
        self.core.check_invariants()
        # every job still waiting is within its deadline (woken at it, it fails)
        for job_id in self.core.waiting():
            note(f"{job_id} waits at {self.now}, deadline {self.deadlines[job_id]}")
            assert self.now < self.deadlines[job_id], f"{job_id} waits past its deadline"


def client_timers_machine(
    *, connect_timeout: float = 6.0, grow_interval: float = 2.0, retry_tick: float = 1.0
) -> type[ClientTimersMachine]:
    """A :class:`ClientTimersMachine` with these intervals (seconds)."""
    return type(
        "ConfiguredClientTimersMachine",
        (ClientTimersMachine,),
        {
            "connect_timeout": connect_timeout,
            "grow_interval": grow_interval,
            "retry_tick": retry_tick,
        },
    )
