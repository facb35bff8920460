"""The client core's connections and configured addresses, and the rules of its pool.

:class:`~trio_broker.core.client.ClientCore` keeps its connections in a
:class:`ConnectionPool`: one :class:`ConnRecord` per connection it dialled (by
the id the pool issued) and one :class:`AddressRecord` per configured address
(an execserver, or a balancer in front of several). The core sends the frames,
arms the timers and emits the effects; the pool keeps the records and answers
what its rules say:

Growth (:meth:`ConnectionPool.grow`). While jobs see no offer at all, each
address that is not *covered* and has no dial in progress opens one more
connection, at most one every ``pool_grow_interval``, at most ``pool_max`` in
all. While a job *probes* (waits for a service no connection announced), a
covered address grows too, after its back-off (:attr:`AddressRecord.gap`): it
doubles from ``pool_grow_interval`` with each connection that lands on a known
instance, up to :func:`probe_gap_max`, each wait jittered between half and all
of it (two clients looking through one round-robin balancer in lockstep would
keep landing on the pods they know), and is ``pool_grow_interval`` again once a
connection reaches a new one. An address that grew at ``t`` may grow again from ``t +
pool_grow_interval`` on, that sum being both the growth timer's instant and
what ``now`` is compared with (``now - t < pool_grow_interval`` can be true at
that very instant in floating point, and the timer would fire for ever without
growing). A dial that fails and a connection lost do not make the address grow
sooner: the interval counts from the last growth, whatever became of its dial
(the lost connection itself is dialled again by the back-off below).

Balanced and covered. An address is *balanced* (it fronts a fleet) once a
``HELLO.addr`` through it differed from the socket's peer address
(:meth:`AddressRecord.reached`); only a balanced, uncovered address below
``pool_max`` may still reach an execserver not seen yet
(:meth:`ConnectionPool.can_probe`). It is *covered* while a new connection
through it landed on an instance another ready connection already reaches
(:meth:`ConnectionPool.reaching`), until a re-probe clears the mark.

Searches (:meth:`ConnectionPool.search`, :meth:`ConnectionPool.verdict`). The
pool remembers, per service, since when it has been looking for a service no
ready connection announced; the record goes when a connection announces it. A
service looked for ``pool_reprobe_interval`` without being found is *not
offered*; before that it is only *unknown* (try again later).

Back-off (:meth:`AddressRecord.redial_delay`). A lost connection is dialled
again after a wait that doubles from ``reconnect_min`` to ``reconnect_max``,
each wait jittered between half and all of it, and resets on the next ``HELLO``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Literal

from trio_broker.core import protocol as p
from trio_broker.core.client_values import ClientConfig, ConnId, FailReason
from trio_broker.core.errors import ClientUsageError


def probe_gap_max(config: ClientConfig) -> float:
    """The longest back-off between two probing dials of one address: a quarter of
    ``pool_reprobe_interval`` (never less than ``pool_grow_interval``), so a search
    of ``pool_reprobe_interval`` dials every balanced address several times."""
    return max(config.pool_grow_interval, config.pool_reprobe_interval / 4)


def bare(address: str) -> str:
    """``host:port`` without the brackets of an IPv6 host, for comparisons."""
    return address.replace("[", "").replace("]", "")


class ConnRecord:
    """One broker connection: its state, its execserver's ``HELLO``, and its jobs.

    ``parked`` holds the job ids with a ``WANT`` here not withdrawn, ``accepted``
    those whose ``JOB`` went out here; ``watch`` whether ``STATS`` were asked for
    (``SUBSCRIBE`` sent) or refused (``unknown_type``), ``stats`` the latest.
    """

    __slots__ = (
        "accepted",
        "address",
        "hello",
        "id",
        "last_recv",
        "last_sent",
        "local_addr",
        "parked",
        "peer_addr",
        "state",
        "stats",
        "watch",
    )

    def __init__(self, conn_id: ConnId, address: str, now: float) -> None:
        self.id = conn_id
        self.address = address
        self.state: Literal["dialing", "open", "ready"] = "dialing"
        self.hello: p.Hello | None = None
        self.parked: set[str] = set()
        self.accepted: set[str] = set()
        self.last_sent = now
        self.last_recv = now
        self.local_addr: str | None = None
        self.peer_addr: str | None = None
        self.watch: Literal["no", "asked", "refused"] = "no"
        self.stats: p.Stats | None = None

    def __repr__(self) -> str:
        return (
            f"ConnRecord(id={self.id!r}, address={self.address!r}, state={self.state!r}, "
            f"parked={sorted(self.parked)!r}, accepted={sorted(self.accepted)!r})"
        )

    def callback_base(self, config: ClientConfig) -> str | None:
        """The callback base this connection registers: ``callback_url`` as it is, else
        ``http://<the connection's local host>:<callback_port>``, else None."""
        if config.callback_url is not None:
            return config.callback_url
        if config.callback_port is None or self.local_addr is None:
            return None
        host = self.local_addr.rsplit(":", 1)[0]
        return f"http://{host}:{config.callback_port}"

    def offers(self, service: str) -> bool:
        """Ready, not draining, and its execserver announced ``service``."""
        hello = self.hello
        return (
            self.state == "ready"
            and hello is not None
            and not hello.draining
            and service in hello.services
        )

    def live(self) -> bool:
        """Ready and not draining: wants may be parked here."""
        return self.state == "ready" and self.hello is not None and not self.hello.draining


class AddressRecord:
    """One configured address: its connections and what the pool learnt through it."""

    __slots__ = (
        "address",
        "backoff",
        "balanced",
        "conns",
        "covered",
        "gap",
        "last_grow",
        "shadowed_by",
        "wait",
    )

    def __init__(self, address: str, backoff: float, gap: float) -> None:
        self.address = address
        self.gap = gap
        """The back-off between two growths: ``pool_grow_interval``, doubled (up to
        :func:`probe_gap_max`) by each connection that lands on a known instance."""
        self.wait = gap
        """The wait before the next growth: the gap, jittered once it backs off."""
        self.conns: set[ConnId] = set()
        self.covered = False
        self.balanced = False  # some HELLO.addr differed from the socket's peer address
        self.last_grow = float("-inf")
        self.backoff = backoff
        # the connection (of another address) that reaches the instance this
        # address's last connection landed on, while this address has none
        self.shadowed_by: ConnId | None = None

    def __repr__(self) -> str:
        return (
            f"AddressRecord(address={self.address!r}, conns={sorted(self.conns)!r}, "
            f"covered={self.covered!r}, balanced={self.balanced!r})"
        )

    def reached(self, hello: p.Hello, conn: ConnRecord, config: ClientConfig) -> None:
        """A connection through this address became ready with its first ``HELLO``
        (an instance no other ready connection reaches)."""
        self.backoff = config.reconnect_min
        self.gap = self.wait = config.pool_grow_interval
        self.shadowed_by = None
        if bare(hello.addr) != bare(conn.peer_addr or conn.address):
            self.balanced = True

    def circled_back(self, config: ClientConfig, jitter: random.Random) -> None:
        """A connection through this address landed on a known instance: it is
        covered, and its next probing growth waits twice as long (jittered)."""
        self.covered = True
        self.gap = min(self.gap * 2, probe_gap_max(config))
        self.wait = self.gap * (0.5 + 0.5 * jitter.random())

    def redial_delay(self, jitter: random.Random, reconnect_max: float) -> float:
        """The wait before dialling again after a loss; the next one doubles.

        Jitter (half to all of the back-off) keeps many clients that lost one
        execserver from dialling it again in lockstep.
        """
        delay = self.backoff * (0.5 + 0.5 * jitter.random())
        self.backoff = min(self.backoff * 2, reconnect_max)
        return delay


class ConnectionPool:
    """Every connection of one client core by id, and every configured address.

    Connection ids are issued from 1 up and never reused, so an id the pool
    issued and has since forgotten tells a late report from a caller's mistake.
    """

    __slots__ = ("_issued", "addresses", "config", "conns", "searches")

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.conns: dict[ConnId, ConnRecord] = {}
        self.addresses = {
            a: AddressRecord(a, config.reconnect_min, config.pool_grow_interval)
            for a in config.addresses
        }
        self._issued: ConnId = 0  # ids 1..this were issued
        self.searches: dict[str, float] = {}
        """Service -> since when the pool looks for it (no ready connection announced it)."""

    def add(self, address: AddressRecord, now: float) -> ConnRecord:
        """A new connection to dial through ``address``, with a fresh id."""
        self._issued += 1
        conn = ConnRecord(self._issued, address.address, now)
        self.conns[conn.id] = conn
        address.conns.add(conn.id)
        return conn

    def find(self, conn_id: ConnId) -> ConnRecord | None:
        """The known connection, ``None`` for one forgotten.

        Raises:
            ClientUsageError: the pool never issued ``conn_id``.
        """
        conn = self.conns.get(conn_id)
        if conn is None and not 1 <= conn_id <= self._issued:
            raise ClientUsageError(f"connection {conn_id} was never dialled")
        return conn

    def remove(self, conn_id: ConnId) -> ConnRecord | None:
        """Forget a connection (None: it was forgotten already)."""
        conn = self.conns.pop(conn_id, None)
        if conn is not None:
            self.addresses[conn.address].conns.discard(conn_id)
        return conn

    def unshadow(self, conn_id: ConnId) -> list[AddressRecord]:
        """The addresses left without a connection because ``conn_id`` reached their
        instance: it is gone, so they are to be dialled again."""
        found = [a for a in self.addresses.values() if a.shadowed_by == conn_id]
        for address in found:
            address.shadowed_by = None
        return found

    def live(self) -> bool:
        """Whether some connection is ready and not draining."""
        return any(conn.live() for conn in self.conns.values())

    def refusal(self, service: str, now: float) -> tuple[FailReason, str] | None:
        """Why a job of this service cannot wait now, or None. O(connections)."""
        ready = [c for c in self.conns.values() if c.state == "ready"]
        if not ready:
            return ("no_execserver", "no execserver is connected")
        if not any(c.live() for c in ready):
            return ("no_execserver", "every connected execserver is draining")
        if not self.offered(service) and not self.can_probe():
            self.search(service, now, fresh=False)
            return self.verdict(service, now)
        return None

    def offered(self, service: str) -> bool:
        """Whether some ready, not draining connection announced ``service``."""
        return any(c.offers(service) for c in self.conns.values())

    def can_probe(self) -> bool:
        """Whether growth may still reach an execserver not seen yet: some address is
        balanced and below ``pool_max`` (covered or not: a covered one backs off)."""
        pool_max = self.config.pool_max
        return any(a.balanced and len(a.conns) < pool_max for a in self.addresses.values())

    def search(self, service: str, now: float, *, fresh: bool) -> float:
        """Look for ``service`` (no ready connection announced it): when the search
        ends, ``pool_reprobe_interval`` after it began.

        A search under way goes on. One that ended goes on too, unless ``fresh``
        (the pool can grow: a job that probes gets a whole search of its own).
        """
        since = self.searches.get(service)
        window = self.config.pool_reprobe_interval
        if since is None or (fresh and since + window <= now):
            since = self.searches[service] = now
        return since + window

    def found(self, services: Iterable[str]) -> None:
        """A ready connection announced these services: their searches end."""
        for service in services:
            self.searches.pop(service, None)

    def verdict(self, service: str, now: float) -> tuple[FailReason, str]:
        """Why a job of ``service`` fails when no connection offers it: ``unknown_service``
        (try again later) while the search is younger than ``pool_reprobe_interval``,
        then ``service_not_offered`` (the pool looked a whole re-probe: for good)."""
        window = self.config.pool_reprobe_interval
        since = self.searches.get(service, now)
        detail = f"no connected execserver offers {service!r}"
        if since + window <= now:
            return ("service_not_offered", f"{detail} (the pool looked for {now - since:g}s)")
        return ("unknown_service", detail)

    def reaching(self, conn: ConnRecord, instance_id: str) -> ConnRecord | None:
        """Another ready connection that reaches the execserver ``instance_id``, if any."""
        for other in self.conns.values():
            hello = other.hello
            if (
                other is not conn
                and other.state == "ready"
                and hello is not None
                and hello.instance_id == instance_id
            ):
                return other
        return None

    def grow(self, now: float, *, probing: bool) -> tuple[list[AddressRecord], float | None]:
        """The addresses that open one more connection now, and when one next may.

        Asked once growth is due (jobs see no offer). An address grows when it is
        below ``pool_max``, has no dial in progress, grew last at least its
        :attr:`~AddressRecord.gap` ago, and is not covered, or is balanced while a
        job ``probing`` waits for a service nobody announced; those chosen count
        as grown ``now``.

        Returns:
            The addresses to dial, and the earliest time one held back only by
            its gap may grow (None: none is).
        """
        config = self.config
        chosen: list[AddressRecord] = []
        wake: float | None = None
        for address in self.addresses.values():
            if len(address.conns) >= config.pool_max:
                continue
            if address.covered and not (probing and address.balanced):
                continue
            if any(self.conns[c].state != "ready" for c in address.conns):
                continue  # a dial is in progress: let it land first
            later = address.last_grow + address.wait
            if now < later:  # the instant the timer asks for, compared as that sum
                wake = later if wake is None else min(wake, later)
                continue
            address.last_grow = now
            chosen.append(address)
        return chosen, wake

    def check_invariants(self) -> None:
        """Raise AssertionError if connections and addresses disagree."""
        for conn in self.conns.values():
            assert conn.id in self.addresses[conn.address].conns
            assert not conn.parked & conn.accepted
        for address in self.addresses.values():
            assert len(address.conns) <= self.config.pool_max
            assert all(self.conns[c].address == address.address for c in address.conns)
