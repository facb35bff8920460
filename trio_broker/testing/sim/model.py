"""The simulated world's parts: pods, clients, links, balancers, work items.

Plain records the engine (:mod:`trio_broker.testing.sim.world`) changes and the
checks (:mod:`trio_broker.testing.sim.checks`) and the report read. The real
cores sit inside them: a :class:`Pod` holds a
:class:`~trio_broker.core.broker.Broker` while its process is up, a
:class:`Client` a :class:`~trio_broker.core.client.ClientCore` (and, for a
dispatcher, a :class:`~trio_broker.core.dispatch.DispatchCore`) while its
process is up. A crash drops the core and all it held (volatile state, as in
the real daemons); a restart builds a new one, a new *incarnation*.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeAlias

import attrs

from trio_broker.core.admission import InstanceLoad
from trio_broker.core.broker import Broker
from trio_broker.core.client import ClientCore
from trio_broker.testing.sim.queue import QueueModel, Row
from trio_broker.testing.sim.scenario import BalancerSpec, ClientSpec, PodSpec, Scenario
from trio_broker.testing.sim.trace import Choices, JobInput

__all__ = [
    "Balancer",
    "Client",
    "Engine",
    "Item",
    "Link",
    "Pod",
    "Run",
    "Violation",
]

Toward: TypeAlias = Literal["s", "c"]
"""A link's direction: toward the server (the pod) or toward the client."""
PacketKind: TypeAlias = Literal["open", "frames", "close"]


@attrs.frozen(kw_only=True)
class Violation:
    """A broken invariant or liveness property: what, where, when.

    Attributes:
        kind: a short stable name (``exactly_once``, ``slot_leak``,
            ``priority``, ``round_robin``, ``admission``, ``core_invariant``,
            ``liveness``, ``pool``...), what a shrunk trace must still break.
        where: the pod, client or item concerned.
        at: the virtual time.
        message: what was seen.
    """

    kind: str
    where: str
    at: float
    message: str

    def __str__(self) -> str:
        return f"t={self.at:.3f} {self.kind} at {self.where}: {self.message}"


class Item:
    """One job of the workload, from its arrival to its end.

    A queue item has its :class:`~trio_broker.testing.sim.queue.Row`; a direct
    one is held by its caller in a direct client.
    """

    __slots__ = (
        "attempts",
        "done_by",
        "ended",
        "ended_at",
        "failure",
        "index",
        "job",
        "ok_runs",
        "result_runs",
        "row",
        "start_of_done",
        "starts",
    )

    def __init__(self, index: int, job: JobInput) -> None:
        self.index = index
        self.job = job
        self.row: Row | None = None
        self.attempts = 0  # direct items: submissions so far
        self.ended: Literal["done", "failed", "abandoned"] | None = None
        self.failure: str | None = None
        self.starts = 0  # runs started on pods
        self.ok_runs = 0  # runs that ended ok
        self.result_runs = 0  # runs whose receipt reached a live client
        self.start_of_done: float | None = None  # when the run that counted started
        self.done_by: str | None = None  # the client whose job counted
        self.ended_at: float | None = None


class Run:
    """A job running on a pod: its slot, until it ends or is stopped."""

    __slots__ = ("aborting", "conn", "end_at", "item", "job_id", "run_id", "service", "started")

    def __init__(
        self, run_id: int, conn: int, job_id: str, item: Item | None, service: str, now: float
    ) -> None:
        self.run_id = run_id
        self.conn = conn
        self.job_id = job_id
        self.item = item
        self.service = service
        self.started = now
        self.end_at = now
        self.aborting: str | None = None


class Pod:
    """An execserver pod: its spec, its process (a broker core while up), its runs."""

    def __init__(self, name: str, spec: PodSpec, index: int) -> None:
        self.name = name
        self.spec = spec
        self.index = index
        self.addr = f"{name}:7000"
        self.broker: Broker | None = None
        self.incarnation = 0
        self.state: Literal["new", "up", "draining", "down", "removed"] = "new"
        self.cut = False
        self.links: dict[int, Link] = {}  # server connection id -> link
        self.runs: dict[int, Run] = {}
        self.timer_at: float | None = None
        self.tokens = 0
        self.busy_time: dict[str, float] = {}  # service -> slot-seconds of runs
        self.up_time = 0.0
        self.up_since: float | None = None
        self.jobs_done = 0
        # checks: the time each accepted WANT was parked, per (conn, job)
        self.parked_at: dict[tuple[int, str], tuple[float, int]] = {}

    def healthy(self) -> bool:
        """What the balancers' health checks see: serving and reachable."""
        return self.state == "up" and not self.cut

    def next_token(self) -> str:
        self.tokens += 1
        return f"{self.name}.{self.incarnation}.{self.tokens}"


class Balancer:
    """A balancer: its pods and what its health checks think of them."""

    def __init__(self, spec: BalancerSpec, pods: list[Pod]) -> None:
        self.spec = spec
        self.name = spec.name
        self.addr = f"{spec.name}:80"
        self.pods = pods
        self.in_rotation: dict[str, bool] = {pod.name: False for pod in pods}
        self.turn = 0
        self.pinned: dict[str, str] = {}  # client name -> pod name (sticky)
        self.dials = 0


class Client:
    """A client process: its spec, its cores while up, its links and jobs."""

    def __init__(self, name: str, spec: ClientSpec, index: int) -> None:
        self.name = name
        self.spec = spec
        self.index = index
        self.core: ClientCore | None = None
        self.incarnation = 0
        self.alive = False
        self.cut = False
        self.db_cut = False
        self.links: dict[int, Link] = {}  # client connection id -> link
        self.dialing: dict[int, float] = {}  # conn -> when its dial started
        self.timer_at: float | None = None
        self.driver: Any = None  # its Dispatcher or DirectCaller (holds(), job_ended())
        self.ports = 40000
        self.accepted: dict[str, int] = {}  # job id -> connection its JOB went out on
        self.jobs_done = 0
        self.reached: set[str] = set()  # pods its connections reached (ever)
        self.probed: dict[str, float] = {}  # service -> when a job first waited unannounced
        self.loads: list[InstanceLoad] | None = None  # its instance loads (None: to compute)

    @property
    def backend_id(self) -> str:
        return f"{self.name}#{self.incarnation}"


class Link:
    """One broker connection: both ends, and a FIFO each way (TCP: no reordering)."""

    __slots__ = (
        "client",
        "client_inc",
        "conn",
        "held",
        "id",
        "local",
        "pod",
        "pod_inc",
        "server_conn",
        "state_c",
        "state_s",
        "t_c",
        "t_s",
        "via",
        "via_addr",
    )

    def __init__(
        self,
        link_id: int,
        client: Client,
        conn: int,
        pod: Pod,
        server_conn: int,
        *,
        via: str,
        via_addr: str,
        local: str,
    ) -> None:
        self.id = link_id
        self.client = client
        self.client_inc = client.incarnation
        self.conn = conn
        self.pod = pod
        self.pod_inc = pod.incarnation
        self.server_conn = server_conn
        self.via = via  # the configured address it was dialled through
        self.via_addr = via_addr  # the socket's peer address: the pod's, or the balancer's
        self.local = local  # the client's end, host:port
        self.state_c: Literal["dialing", "open", "closed"] = "dialing"
        self.state_s: Literal["open", "closed"] = "open"
        self.t_c = 0.0  # when the last packet toward the client arrives
        self.t_s = 0.0
        self.held: list[tuple[Toward, PacketKind, Any]] = []  # sent while cut

    def cut(self) -> bool:
        return self.client.cut or self.pod.cut

    def __repr__(self) -> str:
        return f"Link({self.client.name}:{self.conn} -> {self.pod.name}:{self.server_conn})"


class Engine(Protocol):
    """What the client drivers (dispatcher, direct caller) use of the engine."""

    scenario: Scenario
    now: float
    queue: QueueModel
    items: list[Item]
    job_items: dict[str, Item]
    choices: Choices

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None: ...

    def database(
        self,
        client: Client,
        statement: Callable[[float], Any],
        reply: Callable[[Any], None],
        failed: Callable[[], None],
    ) -> None: ...

    def route_client(self, client: Client) -> None: ...

    def log(self, text: str, *args: Any) -> None: ...

    def violation(self, kind: str, where: str, message: str) -> None: ...

    def item_ended(self, item: Item) -> None: ...
