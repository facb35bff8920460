"""The client core's values: its configuration and the effects it asks of its transport.

:class:`ClientConfig` is what a :class:`~trio_broker.core.client.ClientCore` decides
with; the effect classes (:data:`ClientEffect`) are what it hands its transport
through ``effects()``: dial or close a connection, and a job's acceptance, end,
failure, position or the peer's error. They are re-exported by
:mod:`trio_broker.core.client`, their usual import.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import attrs

from trio_broker.core import protocol as p

__all__ = [
    "Accepted",
    "ClientConfig",
    "ClientEffect",
    "Close",
    "ConnId",
    "Dial",
    "FailReason",
    "Failed",
    "Finished",
    "PeerError",
    "PositionReport",
]

ConnId: TypeAlias = int
"""A connection of the client core (the id its :class:`Dial` carried)."""

FailReason: TypeAlias = Literal[
    "no_slot", "no_execserver", "unknown_service", "service_not_offered", "lost", "cancelled"
]


DEFAULT_CONNECT_TIMEOUT = 60.0


def _connect_timeout(value: float | None) -> float:
    """``connect_timeout`` unset (None) or 0 means the default."""
    if value is None or value == 0:
        return DEFAULT_CONNECT_TIMEOUT
    if value < 0:
        raise ValueError(f"connect_timeout must not be negative, got {value}")
    return float(value)


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
        connect_timeout: how long a job waits for a slot before it fails
            (0 or None: the default, 60 s).
        retry_tick: how long a job waits without any offer before the pool grows.
        pool_grow_interval: at most one new connection per address this often.
        pool_max: at most this many connections per address.
        pool_reprobe_interval: how long "covered" stops growth while no job
            probes, and how long the pool looks for a service no connection
            announced before a job of it fails ``service_not_offered`` (a full
            re-probe; before that it is ``unknown_service``, to try again).
        ping_interval, ping_timeout: liveness, as on the execserver.
        reconnect_min, reconnect_max: the back-off range for dialling again.
    """

    backend_id: str
    name: str
    version: str
    callback_url: str | None = None
    callback_port: int | None = None
    addresses: tuple[str, ...]
    connect_timeout: float = attrs.field(default=60.0, converter=_connect_timeout)
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
