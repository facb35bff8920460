"""Errors by blame: the exception tree, and misuse that leaves a core exactly as it was.

A misuse test drives two cores through the same inputs, gives one of them the
misuse (which must raise), then feeds both the same continuation; the two must
emit the same frames and effects and end with the same statistics. The
continuation starts with an input at a time *between* the last good input and
the misuse, so a core whose clock the misuse moved would refuse it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from trio_broker.core import broker as broker_module
from trio_broker.core import client as client_module
from trio_broker.core import errors
from trio_broker.core import protocol as p
from trio_broker.core.broker import Broker, BrokerConfig, StartJob
from trio_broker.core.client import ClientConfig, ClientCore, Dial
from trio_broker.core.pool import PoolConfig
from trio_broker.testing.values import receipt

# -- the tree --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "base"),
    [
        (errors.ProtocolError, Exception),
        (errors.UsageError, RuntimeError),
        (errors.BrokerUsageError, errors.UsageError),
        (errors.ClientUsageError, errors.UsageError),
        (errors.DispatchUsageError, errors.UsageError),
        (errors.NoSlot, errors.BrokerError),
        (errors.NoExecserver, errors.BrokerError),
        (errors.UnknownService, errors.BrokerError),
        (errors.JobLost, errors.BrokerError),
        (errors.ClientClosed, errors.BrokerError),
        (errors.JobStopped, errors.BrokerError),
        (errors.StoreUnavailable, errors.BrokerError),
        (errors.RetryLater, errors.BrokerError),
    ],
)
def test_each_exception_sits_on_its_branch(cls: type[Exception], base: type[Exception]) -> None:
    """Every exception of the library derives from the base of its blame."""
    assert cls.__mro__[1] is base


def test_the_tree_in_the_docstring_names_every_exception() -> None:
    """The module docstring draws every exception class the module exports."""
    doc = errors.__doc__ or ""
    exported = [name for name in errors.__all__ if isinstance(getattr(errors, name), type)]
    assert len(exported) == 16  # with WorkFailed and ServiceNotOffered
    for name in exported:
        assert f"── {name}" in doc, name


def test_the_old_homes_re_export_the_same_classes() -> None:
    """protocol, broker and client (and the trio store) hand out the tree's own classes."""
    from trio_broker.trio import dispatcher, store

    assert p.ProtocolError is errors.ProtocolError
    assert broker_module.BrokerUsageError is errors.BrokerUsageError
    assert client_module.ClientUsageError is errors.ClientUsageError
    assert store.StoreUnavailable is errors.StoreUnavailable
    assert dispatcher.RetryLater is errors.RetryLater
    with pytest.raises(errors.ProtocolError, match="bad_frame"):
        p.decode("not json", accept=p.CLIENT_TO_EXEC)


def test_describe_names_the_type_and_flattens_groups() -> None:
    """describe() gives "Type: text", the reason of a RetryLater, and a group's members."""
    assert errors.describe(errors.NoSlot("no slot within 60 s")) == "NoSlot: no slot within 60 s"
    assert errors.describe(errors.JobLost()) == "JobLost"
    assert errors.describe(errors.RetryLater(5, "drained")) == "drained"
    group = ExceptionGroup("outer", [ValueError("a"), ExceptionGroup("inner", [KeyError("b")])])
    assert errors.describe(group) == "ValueError: a; KeyError: 'b'"


# -- the broker ------------------------------------------------------------------------------

T0 = 100.0
LATER = 105.0  # the misuse's time
BETWEEN = 101.0  # the continuation's first input: before LATER


def broker_at_t0() -> tuple[Broker, int, int]:
    """A one-slot broker at T0: connection a runs run 1, connection b waits for the slot."""
    tokens = itertools.count()
    config = BrokerConfig(
        instance_id="inst",
        name="exec",
        pool=PoolConfig(size=1, unknown_share=1.0, max_slots={"s": 0}),
        token_factory=lambda: f"token-{next(tokens):016d}",
    )
    broker = Broker(config, now=T0)
    a = broker.open_connection("127.0.0.1:7000", now=T0)
    b = broker.open_connection("127.0.0.1:7000", now=T0)
    for conn, name in ((a, "a"), (b, "b")):
        broker.receive(conn, p.Register(backend_id=name, name=name, version="1"), now=T0)
    broker.receive(a, p.Want(job_id="j1", service="s", priority=0), now=T0)
    (offer,) = [m for _, m in broker.frames_to_send() if isinstance(m, p.Offer)]
    broker.receive(a, p.Job(job_id="j1", token=offer.token, service="s", job={}), now=T0)
    broker.receive(b, p.Want(job_id="j2", service="s", priority=0), now=T0)
    (start,) = [e for e in broker.effects() if isinstance(e, StartJob)]
    assert start.run_id == 1
    broker.frames_to_send()
    return broker, a, b


def broker_continuation(broker: Broker, a: int, b: int) -> list[Any]:
    """The same inputs for both twins; everything they emit, and their last statistics."""
    seen: list[Any] = []

    def drain() -> None:
        seen.append((broker.frames_to_send(), broker.effects(), broker.next_deadline()))

    broker.tick(now=BETWEEN)
    drain()
    broker.job_ended(1, receipt(duration=1.0), now=BETWEEN + 1)
    drain()
    broker.receive(b, p.Query(job_id="j2"), now=BETWEEN + 2)
    drain()
    broker.tick(now=BETWEEN + 30)  # b's offer expires
    drain()
    broker.close_connection(a, now=BETWEEN + 31)
    drain()
    seen.append(broker.statistics())
    return seen


BROKER_MISUSES: dict[str, Callable[[Broker], object]] = {
    "job_ended of a run that is not running": lambda br: br.job_ended(99, receipt(), now=LATER),
    "a frame on a connection never opened": lambda br: br.receive(99, p.Ping(nonce="1"), now=LATER),
    "a bad frame on a connection never opened": lambda br: br.receive_text(
        99, "not json", now=LATER
    ),
    "a good text frame on a connection never opened": lambda br: br.receive_text(
        0, '{"type": "PING", "nonce": "1"}', now=LATER
    ),
    "closing a connection never opened": lambda br: br.close_connection(7, now=LATER),
    "a callback check of a connection never opened": lambda br: br.callback_checked(
        -1, "ok", now=LATER
    ),
    "time going backwards": lambda br: br.tick(now=T0 - 1),
    "the HELLO of a connection never opened": lambda br: br.hello_for(99),
}


@pytest.mark.parametrize("name", sorted(BROKER_MISUSES))
def test_broker_misuse_raises_and_changes_nothing(name: str) -> None:
    """Each misuse of the broker raises BrokerUsageError and leaves it exactly as it was."""
    misused, a, b = broker_at_t0()
    twin, _, _ = broker_at_t0()
    with pytest.raises(errors.BrokerUsageError):
        BROKER_MISUSES[name](misused)
    assert broker_continuation(misused, a, b) == broker_continuation(twin, a, b)


def test_broker_inputs_for_a_closed_connection_are_ignored() -> None:
    """A closed connection's late frame, close report and callback result change nothing."""
    broker, a, _ = broker_at_t0()
    broker.close_connection(a, now=T0)
    broker.frames_to_send()
    broker.effects()
    before = broker.statistics()
    broker.receive(a, p.Want(job_id="late", service="s", priority=0), now=T0 + 1)
    broker.receive_text(a, "not json", now=T0 + 1)
    broker.close_connection(a, now=T0 + 1)
    broker.callback_checked(a, "ok", now=T0 + 1)
    assert (broker.frames_to_send(), broker.effects()) == ([], [])
    assert broker.statistics() == before
    with pytest.raises(errors.BrokerUsageError, match="not open"):
        broker.hello_for(a)


# -- the client core -------------------------------------------------------------------------

HELLO = p.Hello(
    protocol=1, instance_id="i", name="n", services={"s": p.ServiceInfo(max_slots=0, kind="light")},
    processes=1, idle=0, clients=1, draining=False, addr="A",
)  # fmt: skip
C_LATER = 5.0
C_BETWEEN = 1.0


def client_at_start() -> tuple[ClientCore, int, int]:
    """A client at t=0.5: connection 1 (to A) ready with job j1 parked, connection 2 dialling."""
    config = ClientConfig(
        backend_id="me", name="client", version="1", addresses=("A", "B"),
        ping_interval=1e6, ping_timeout=2e6, connect_timeout=3.0,
    )  # fmt: skip
    core = ClientCore(config, now=0.0)
    first, second = (e.conn for e in core.effects() if isinstance(e, Dial))
    core.connected(first, local_addr="10.0.0.2:5000", now=0.1)
    core.receive(first, HELLO, now=0.2)
    core.submit("j1", "s", {"n": 1}, now=0.5)
    core.frames_to_send()
    core.effects()
    return core, first, second


def client_continuation(core: ClientCore, first: int, second: int) -> list[Any]:
    """The same inputs for both twins; everything they emit, and their jobs."""
    seen: list[Any] = []

    def drain() -> None:
        seen.append((core.frames_to_send(), core.effects(), core.next_deadline()))

    core.tick(now=C_BETWEEN)
    drain()
    core.connected(second, local_addr="10.0.0.2:5001", now=C_BETWEEN + 0.1)
    drain()
    core.receive(first, p.Offer(job_id="j1", token="t" * 22), now=C_BETWEEN + 0.2)
    drain()
    core.submit("j2", "s", {}, now=C_BETWEEN + 0.3)
    drain()
    core.tick(now=C_BETWEEN + 10)  # j2 gives up: no slot
    drain()
    seen.append(sorted(core.jobs()))
    return seen


CLIENT_MISUSES: dict[str, Callable[[ClientCore, int, int], None]] = {
    "submitting a job id twice": lambda c, f, s: c.submit("j1", "s", {}, now=C_LATER),
    "a job with pipes and no callback base": lambda c, f, s: c.submit(
        "j9", "s", {}, pipes={"stdin_url": "/pipe/x"}, now=C_LATER
    ),
    "connected twice": lambda c, f, s: c.connected(f, local_addr="x:1", now=C_LATER),
    "connected for a connection never dialled": lambda c, f, s: c.connected(99, now=C_LATER),
    "a frame on a connection never dialled": lambda c, f, s: c.receive(99, HELLO, now=C_LATER),
    "a text frame on a connection never dialled": lambda c, f, s: c.receive_text(
        99, "not json", now=C_LATER
    ),
    "a frame before connected": lambda c, f, s: c.receive(s, HELLO, now=C_LATER),
    "a bad frame before connected": lambda c, f, s: c.receive_text(s, "[]", now=C_LATER),
    "closing a connection never dialled": lambda c, f, s: c.connection_closed(0, now=C_LATER),
    "a failed dial never asked for": lambda c, f, s: c.dial_failed(42, now=C_LATER),
    "time going backwards": lambda c, f, s: c.tick(now=0.4),
}


@pytest.mark.parametrize("name", sorted(CLIENT_MISUSES))
def test_client_misuse_raises_and_changes_nothing(name: str) -> None:
    """Each misuse of the client core raises ClientUsageError and leaves it exactly as it was."""
    misused, first, second = client_at_start()
    twin, _, _ = client_at_start()
    with pytest.raises(errors.ClientUsageError):
        CLIENT_MISUSES[name](misused, first, second)
    assert client_continuation(misused, first, second) == client_continuation(twin, first, second)


def test_client_inputs_for_a_forgotten_connection_are_ignored() -> None:
    """After a connection closed, its late frames and a second close report change nothing."""
    core, first, _ = client_at_start()
    core.connection_closed(first, now=1.0)
    core.frames_to_send()
    core.effects()
    deadline = core.next_deadline()
    core.receive(first, p.Offer(job_id="j1", token="t" * 22), now=1.1)
    core.receive_text(first, "not json", now=1.1)
    core.connection_closed(first, now=1.2)
    assert (core.frames_to_send(), core.effects()) == ([], [])
    assert core.next_deadline() == deadline
    assert sorted(core.jobs()) == []  # j1 failed (no_execserver) when its only execserver went
