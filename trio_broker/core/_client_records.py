"""The client core's records of connections, addresses and jobs (private).

:mod:`trio_broker.core.client` keeps one of each per connection it dialled, per
configured address and per job in flight; this module only holds their fields.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

from trio_broker.core import protocol as p

ConnId: TypeAlias = int


def _bare(address: str) -> str:
    """``host:port`` without the brackets of an IPv6 host, for comparisons."""
    return address.replace("[", "").replace("]", "")


class _Conn:
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
        self.parked: set[str] = set()  # job ids with a WANT here, not withdrawn
        self.accepted: set[str] = set()  # job ids whose JOB went out here
        self.last_sent = now
        self.last_recv = now
        self.local_addr: str | None = None
        self.peer_addr: str | None = None
        # STATS: not asked for, asked for (SUBSCRIBE sent), or refused (unknown_type)
        self.watch: Literal["no", "asked", "refused"] = "no"
        self.stats: p.Stats | None = None

    def offers(self, service: str) -> bool:
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


class _Address:
    __slots__ = ("address", "backoff", "balanced", "conns", "covered", "last_grow", "shadowed_by")

    def __init__(self, address: str, backoff: float) -> None:
        self.address = address
        self.conns: set[ConnId] = set()
        self.covered = False
        self.balanced = False  # some HELLO.addr differed from the socket's peer address
        self.last_grow = float("-inf")
        self.backoff = backoff
        # the connection (of another address) that reaches the instance this
        # address's last connection landed on, while this address has none
        self.shadowed_by: ConnId | None = None


class _Job:
    __slots__ = (
        "conn",
        "deadline",
        "job",
        "job_id",
        "parked_on",
        "pipes",
        "priority",
        "service",
        "state",
        "subject",
        "timer",
        "waiting_since",
        "waits",
    )

    def __init__(
        self,
        job_id: str,
        service: str,
        priority: int,
        subject: str | None,
        job: dict[str, Any],
        now: float,
        deadline: float,
    ) -> None:
        self.job_id = job_id
        self.service = service
        self.priority = priority
        self.subject = subject
        self.job = job
        self.state: Literal["waiting", "accepted", "ended"] = "waiting"
        self.parked_on: set[ConnId] = set()
        self.pipes: dict[str, str] | None = None
        self.conn: ConnId | None = None
        self.waiting_since = now
        self.deadline = deadline
        self.timer: int | None = None  # the handle of the armed deadline timer
        self.waits = 0  # how many times the job started waiting (stale queue entries)
