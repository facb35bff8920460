"""An in-memory network between one client core and several execserver cores.

:class:`Network` joins a :class:`~trio_broker.core.client.ClientCore` to
:class:`~trio_broker.core.broker.Broker` cores with links that hold every frame until
the test releases it, so a test (or a state machine) decides the interleaving:
which queue delivers next, when a dial completes or fails, when a connection
breaks, when a run ends, when time passes. Each address maps to a *fleet* of
brokers: a dial to it lands on the next one in turn, as a round-robin balancer
would. The client learns the socket's peer address of each connection: the
execserver's own for a direct address, the balancer's (``balancer_addr``) for an
address in ``balancers`` (by default, every fleet of more than one broker).
Nothing here imports trio.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from trio_broker.core import protocol as p
from trio_broker.core.broker import Broker, CloseConnection, StartJob
from trio_broker.core.client import ClientCore, ClientEffect, Close, Dial
from trio_broker.testing.values import receipt

__all__ = ["Link", "Network"]


class Link:
    """One broker connection: both sides' ids and a FIFO queue each way."""

    def __init__(self, client_conn: int, server: int, server_conn: int) -> None:
        self.client_conn = client_conn
        self.server = server
        self.server_conn = server_conn
        self.to_server: deque[p.Message] = deque()
        self.to_client: deque[p.Message] = deque()


class Network:
    """One client and its execservers, with every frame held until released.

    Attributes:
        client: the client core.
        brokers: every execserver core, each once, in the order the fleets name them.
        dials: client connections being dialled -> the address dialled.
        links: client connection -> its :class:`Link`, while it is up.
        running: ``(broker index, run_id)`` -> the :class:`StartJob` of a run
            that has not ended yet.
        client_effects: every client effect but :class:`Dial` and :class:`Close`,
            which the network carries out itself.
        lost_in_flight: True once a broken connection dropped frames in flight.
        on_client_effect, on_start: optional hooks, called as the effects happen.
    """

    def __init__(
        self,
        client: ClientCore,
        fleets: Mapping[str, Sequence[Broker]],
        *,
        now: float = 0.0,
        server_addr: str = "10.0.0.1:7000",
        client_addr: str = "10.0.0.2:40000",
        balancer_addr: str = "10.0.0.3:80",
        balancers: Collection[str] | None = None,
    ) -> None:
        self.now = now
        self.client = client
        self.brokers: list[Broker] = []
        self._fleets: dict[str, list[int]] = {}
        for address, fleet in fleets.items():
            indexes = []
            for broker in fleet:
                if broker not in self.brokers:
                    self.brokers.append(broker)
                indexes.append(self.brokers.index(broker))
            self._fleets[address] = indexes
        self._turn = dict.fromkeys(fleets, 0)
        self._server_addr = server_addr
        self._client_addr = client_addr
        self._balancer_addr = balancer_addr
        self._balancers = (
            frozenset(balancers)
            if balancers is not None
            else frozenset(a for a, fleet in fleets.items() if len(fleet) > 1)
        )
        self.dials: dict[int, str] = {}
        self.links: dict[int, Link] = {}
        self._by_server: dict[tuple[int, int], Link] = {}
        self.running: dict[tuple[int, int], StartJob] = {}
        self.client_effects: list[ClientEffect] = []
        self.lost_in_flight = False
        self.on_client_effect: Callable[[ClientEffect], None] | None = None
        self.on_start: Callable[[int, StartJob, Link], None] | None = None
        self.route()

    # -- moving outputs ---------------------------------------------------------------

    def route(self) -> None:
        """Move every output of every core onto the network until all is quiet."""
        moved = True
        while moved:
            moved = False
            for conn, message in self.client.frames_to_send():
                moved = True
                link = self.links.get(conn)
                if link is not None:
                    link.to_server.append(message)
            for effect in self.client.effects():
                moved = True
                self._client_effect(effect)
            for index, broker in enumerate(self.brokers):
                for server_conn, message in broker.frames_to_send():
                    moved = True
                    link = self._by_server.get((index, server_conn))
                    if link is not None:
                        link.to_client.append(message)
                for server_effect in broker.effects():
                    moved = True
                    self._server_effect(index, server_effect)

    def _client_effect(self, effect: ClientEffect) -> None:
        if isinstance(effect, Dial):
            self.dials[effect.conn] = effect.address
        elif isinstance(effect, Close):
            self._cut(effect.conn, tell_client=False)
        else:
            self.client_effects.append(effect)
            if self.on_client_effect is not None:
                self.on_client_effect(effect)

    def _server_effect(self, index: int, effect: Any) -> None:
        if isinstance(effect, StartJob):
            self.running[(index, effect.run_id)] = effect
            if self.on_start is not None:
                self.on_start(index, effect, self._by_server[(index, effect.conn)])
        elif isinstance(effect, CloseConnection):
            closing = self._by_server.get((index, effect.conn))
            if closing is not None:
                self._cut(closing.client_conn, tell_client=True)
        # AbortJob and Drained: a run ends through end_run like any other

    # -- events the test releases ---------------------------------------------------------

    def dial(self, conn: int, *, fail: bool = False) -> None:
        """Complete a pending dial, on the fleet's next broker (or make it fail)."""
        address = self.dials.pop(conn)
        if fail:
            self.client.dial_failed(conn, now=self.now)
        else:
            fleet = self._fleets[address]
            server = fleet[self._turn[address] % len(fleet)]
            self._turn[address] += 1
            server_conn = self.brokers[server].open_connection(self._server_addr, now=self.now)
            link = Link(conn, server, server_conn)
            self.links[conn] = link
            self._by_server[(server, server_conn)] = link
            peer = self._balancer_addr if address in self._balancers else self._server_addr
            self.client.connected(conn, local_addr=self._client_addr, peer_addr=peer, now=self.now)
        self.route()

    def dial_all(self) -> None:
        """Complete every pending dial (and those the completions start)."""
        while self.dials:
            self.dial(min(self.dials))

    def cut(self, conn: int) -> None:
        """The connection breaks: frames in flight are lost; both sides hear of it."""
        self._cut(conn, tell_client=True)
        self.route()

    def _cut(self, conn: int, *, tell_client: bool) -> None:
        self.dials.pop(conn, None)
        link = self.links.pop(conn, None)
        if link is not None:
            del self._by_server[(link.server, link.server_conn)]
            self.brokers[link.server].close_connection(link.server_conn, now=self.now)
            if link.to_server or link.to_client:
                self.lost_in_flight = True
        if tell_client:
            self.client.connection_closed(conn, now=self.now)

    def deliver_to_server(self, conn: int) -> p.Message:
        """Deliver the oldest frame in flight from the client on this connection."""
        link = self.links[conn]
        message = link.to_server.popleft()
        self.brokers[link.server].receive(link.server_conn, message, now=self.now)
        self.route()
        return message

    def deliver_to_client(self, conn: int) -> p.Message:
        """Deliver the oldest frame in flight to the client on this connection."""
        message = self.links[conn].to_client.popleft()
        self.client.receive(conn, message, now=self.now)
        self.route()
        return message

    def flush(self) -> None:
        """Deliver everything in flight, both ways, until the network is quiet."""
        while any(link.to_server or link.to_client for link in self.links.values()):
            for conn in list(self.links):
                while conn in self.links and self.links[conn].to_server:
                    self.deliver_to_server(conn)
                while conn in self.links and self.links[conn].to_client:
                    self.deliver_to_client(conn)

    def end_run(self, server: int, run_id: int, ended: p.Receipt | None = None) -> None:
        """The runner finished a run (with an ``ok`` receipt unless one is given)."""
        del self.running[(server, run_id)]
        self.brokers[server].job_ended(run_id, ended or receipt(started_at=self.now), now=self.now)
        self.route()

    def at(self, now: float) -> None:
        """Time passes: every core runs its due timers."""
        self.now = now
        self.client.tick(now=now)
        for broker in self.brokers:
            broker.tick(now=now)
        self.route()
