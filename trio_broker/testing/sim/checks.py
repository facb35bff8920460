"""What a simulated run must keep: safety after every event, liveness at the end.

Safety, checked as the events happen (the first violation stops the run):

- **core invariants**: after every event, each core it touched passes its own
  ``check_invariants()`` (the broker's: busy slots are offers plus runs plus
  holds, within every pool limit, work-conserving; the client core's: its
  pool within ``pool_max``, a job parked exactly where its connections list it;
  the dispatch core's; the queue model's). With ``checks: light`` only the
  simulator's own checks run;
- **no slot leak**: a pod's broker counts exactly the runs its pod runs;
- **exactly once**: a job id starts at most once on any pod, only on the
  connection its client sent ``JOB`` on, and only while its claim is still
  running (a claim that was decided never starts a job); a client core ends each
  job once, and reports a receipt only for a job that ran;
- **priority at every grant**: no ``OFFER`` goes to a want while a want of a
  higher (aged) priority is parked on that pod whose service would have fitted
  the slot (:func:`fits_without`);
- **round-robin** (full checks): between two grants to a connection X at one
  priority, the other connections get at most ``C - 1`` grants there of a
  service X had a want of at that priority, ``C`` the pod's open connections:
  the per-turn form of the aging bound of :mod:`trio_broker.core.book`;
- **admission** (in the dispatcher, at each claim): what is in flight stays
  within the limit plus the odd reserve, and within ``max_in_flight``.

Liveness, at the end (once every job ended and the world went quiet, or the
scenario's bound passed):

- every job ended, and none failed but by its own input or because no pod any
  client could reach offers its service; no job of a direct client was lost
  but with its client's crash;
- nothing is left running, waiting or holding a slot or a want on any pod;
- every client whose job waited for a service none of its connections
  announced found a pod offering it, when one was reachable through its
  addresses (a sticky balancer's pinned pod only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from trio_broker.core import protocol as p
from trio_broker.core.book import aging_ceiling
from trio_broker.core.broker import StartJob
from trio_broker.core.client import Failed, Finished
from trio_broker.core.pool import SlotPool
from trio_broker.testing.sim.model import Balancer, Client, Item, Link, Pod
from trio_broker.testing.sim.queue import QueueModel
from trio_broker.testing.sim.scenario import Scenario

__all__ = ["Checks", "fits_without"]


class _World(Protocol):
    scenario: Scenario
    now: float
    items: list[Item]
    queue: QueueModel
    pods: dict[str, Pod]
    clients: dict[str, Client]
    balancers: dict[str, Balancer]
    finished_at: float | None
    job_items: dict[str, Item]

    def violation(self, kind: str, where: str, message: str) -> None: ...


def fits_without(pool: SlotPool, service: str, freed: Iterable[str]) -> bool:
    """Whether one more slot of ``service`` would fit had the ``freed`` slots been free.

    A restatement of the pool's rule (:mod:`trio_broker.core.pool`), used to
    judge a grant after the fact: the slots the grant took are given back.
    """
    freed = list(freed)
    stats = pool.services[service]
    busy = pool.busy - len(freed)
    if busy >= pool.size:
        return False
    if stats.cap and stats.busy - freed.count(service) >= stats.cap:
        return False
    if stats.kind == "unknown":
        unknown = pool.unknown_busy() - sum(1 for s in freed if pool.kind(s) == "unknown")
        if unknown >= pool.config.unknown_cap:
            return False
    elif stats.kind == "heavy" and busy + 1 > pool.size - pool.config.fast_reserve:
        return False
    budget = pool.config.memory_budget
    reserved = pool.memory_reserved - sum(pool.services[s].footprint or 0 for s in freed)
    footprint = stats.footprint
    return budget is None or not reserved or footprint is None or reserved + footprint <= budget


class Checks:
    """The checks of one run (see the module docstring)."""

    def __init__(self, world: _World) -> None:
        self.world = world
        self.full = world.scenario.checks == "full"
        self.started: dict[str, str] = {}  # job id -> the pod it started on
        self.ended: set[tuple[str, str]] = set()  # (backend, job id)
        # (pod, incarnation, conn, priority) -> (grants passing it over, how many by holds)
        self.passed: dict[tuple[str, int, int, int], tuple[int, int]] = {}
        self.seen: dict[tuple[str, int, int, int], frozenset[str]] = {}
        self.arriving: tuple[str, int, str, float] | None = None  # the WANT being delivered

    # -- as it happens ---------------------------------------------------------------------

    def want_arrives(self, pod: Pod, conn: int, want: p.Want) -> None:
        """A ``WANT`` reaches a pod: it is parked now (unless refused)."""
        pod.parked_at[(conn, want.job_id)] = (self.world.now, want.priority)
        self.arriving = (pod.name, conn, want.job_id, self.world.now)

    def frames_sent(self, pod: Pod, frames: list[tuple[int, p.Message]]) -> None:
        offers = [(conn, m) for conn, m in frames if isinstance(m, p.Offer)]
        if not offers:
            return
        broker = pod.broker
        assert broker is not None
        highest = broker.book.highest()
        services = [self._offered(pod, conn, offer) for conn, offer in offers]
        for k, (conn, offer) in enumerate(offers):
            service, priority = services[k]
            if highest is not None and highest > priority:
                freed = [s for s, _ in services[k:]]
                self._inversion(pod, conn, offer, priority, freed)
            if self.full:
                held = self.arriving == (pod.name, conn, offer.job_id, self.world.now)
                self._round_robin(pod, conn, service, priority, held=held)

    def _offered(self, pod: Pod, conn: int, offer: p.Offer) -> tuple[str, int]:
        """The service and the (aged) priority of the want an offer went to."""
        now = self.world.now
        parked_at, base = pod.parked_at.pop((conn, offer.job_id), (now, 0))
        item = self.world.job_items.get(offer.job_id)
        service = item.job.service if item is not None else ""
        aging = pod.spec.priority_aging
        priority = base
        if aging is not None:
            ceiling = aging_ceiling(base)
            while priority < ceiling and parked_at + ((priority - base) // 2 + 1) * aging <= now:
                priority = min(priority + 2, ceiling)
        return service, priority

    def _inversion(
        self, pod: Pod, conn: int, offer: p.Offer, priority: int, freed: list[str]
    ) -> None:
        broker = pod.broker
        assert broker is not None
        for want in broker.book.wants():
            if want.priority > priority and fits_without(broker.pool, want.service, freed):
                self.world.violation(
                    "priority",
                    pod.name,
                    f"offer for {offer.job_id} (priority {priority}) on connection {conn} while "
                    f"{want.job_id} (priority {want.priority}, {want.service}) waits on "
                    f"connection {want.conn}",
                )
                return

    def _round_robin(self, pod: Pod, conn: int, service: str, priority: int, *, held: bool) -> None:
        """Count the grants that pass over each other connection with a want of this
        service at this priority; a connection's count restarts at its own grant, and
        when none of its wants there is one seen at the last count (it left the
        rotation and came back at its tail). ``held``: the grant went to the want
        whose arrival it answers, so the slot was held for it (a turn hold)."""
        broker = pod.broker
        assert broker is not None
        book = broker.book
        key = (pod.name, pod.incarnation)
        self.passed.pop((*key, conn, priority), None)
        self.seen.pop((*key, conn, priority), None)
        bound = len(pod.links) - 1
        for other in book.rotation(priority):
            if other == conn:
                continue
            wants = [w for w in book.connection_wants(other) if w.priority == priority]
            ids = frozenset(w.job_id for w in wants)
            at = (*key, other, priority)
            count, holds = self.passed.get(at, (0, 0))
            if not self.seen.get(at, frozenset()) & ids:
                count = holds = 0
            self.seen[at] = ids
            if any(w.service == service for w in wants):
                count, holds = count + 1, holds + held
            self.passed[at] = (count, holds)
            if count > bound:
                self.world.violation(
                    "round_robin",
                    pod.name,
                    f"connection {other} passed over {count} times at priority {priority} "
                    f"({service}) with {len(pod.links)} connections open; {holds} of those "
                    "grants by a turn hold",
                )
                return

    def run_starts(self, pod: Pod, link: Link | None, effect: StartJob, item: Item | None) -> None:
        world = self.world
        job_id = effect.job_id
        if job_id in self.started:
            world.violation(
                "exactly_once",
                pod.name,
                f"job {job_id} started again (first on {self.started[job_id]})",
            )
            return
        self.started[job_id] = pod.name
        if link is None:
            world.violation("exactly_once", pod.name, f"job {job_id} started on no connection")
            return
        client = link.client
        if not client.alive or client.incarnation != link.client_inc or link.state_c != "open":
            return  # the client's end is gone: the JOB was in flight; the run will be stopped
        if client.accepted.get(job_id) != link.conn:
            world.violation(
                "exactly_once",
                pod.name,
                f"job {job_id} started on {client.name}'s connection {link.conn}, where its "
                f"client sent no JOB (accepted on {client.accepted.get(job_id)})",
            )
            return
        if not client.driver.holds(job_id):
            world.violation(
                "exactly_once",
                pod.name,
                f"job {job_id} started after its claim was decided",
            )

    def job_outcome(self, client: Client, effect: Finished | Failed) -> None:
        world = self.world
        key = (client.backend_id, effect.job_id)
        if key in self.ended:
            world.violation("exactly_once", client.name, f"job {effect.job_id} ended twice")
            return
        self.ended.add(key)
        if isinstance(effect, Finished):
            if effect.job_id not in self.started:
                world.violation(
                    "exactly_once",
                    client.name,
                    f"a receipt for job {effect.job_id}, which never started",
                )
                return
            item = world.job_items.get(effect.job_id)
            if item is not None and effect.receipt.status == "ok":
                item.result_runs += 1

    def after_event(self, pods: Iterable[Pod], clients: Iterable[Client]) -> None:
        world = self.world
        for pod in pods:
            broker = pod.broker
            if broker is None:
                continue
            if broker.running() != len(pod.runs):
                world.violation(
                    "slot_leak",
                    pod.name,
                    f"the broker counts {broker.running()} runs, the pod runs {len(pod.runs)}",
                )
            if self.full:
                self._core(pod.name, broker.check_invariants)
        if not self.full:
            return
        for client in clients:
            if client.core is not None:
                self._core(client.name, client.core.check_invariants)
            core = getattr(client.driver, "core", None)
            if core is not None:
                self._core(client.name, core.check_invariants)

    def _core(self, where: str, check: Callable[[], None]) -> None:
        try:
            check()
        except AssertionError as exc:
            self.world.violation("core_invariant", where, str(exc) or repr(exc))

    # -- at the end ------------------------------------------------------------------------

    def at_the_end(self) -> None:
        world = self.world
        if self.full:
            self._core("queue", world.queue.check_invariants)
        reachable = {name: self._reachable(client) for name, client in world.clients.items()}
        anywhere = set().union(*reachable.values()) if reachable else set()
        offered = self._offered_by(anywhere)
        for item in world.items:
            self._item_ended(item, offered)
        if world.finished_at is not None:
            self._quiet()
        for client in world.clients.values():
            self._pool_found(client, reachable[client.name])

    def _item_ended(self, item: Item, offered: set[str]) -> None:
        world = self.world
        job = item.job
        what = f"item {item.index} ({job.service}, priority {job.priority}, arrived {job.at:g}s)"
        if item.ended is None:
            row = item.row
            state = "" if row is None else f": row {row.id} {row.status}, {row.attempts} claims"
            world.violation("liveness", what, f"never ended{state}")
        elif item.ended == "failed" and not job.fails and job.service in offered:
            world.violation("liveness", what, f"failed for good: {item.failure}")
        elif item.ended == "abandoned" and not item.failure:
            world.violation("liveness", what, "abandoned")
        if item.result_runs > 1 and (item.row is None or not item.row.swept):
            world.violation(
                "exactly_once", what, f"ran to completion {item.result_runs} times, never swept"
            )

    def _quiet(self) -> None:
        world = self.world
        for pod in world.pods.values():
            broker = pod.broker
            if broker is None:
                continue
            if broker.pool.busy or broker.running():
                world.violation("slot_leak", pod.name, f"{broker.pool.busy} slots busy at the end")
            if len(broker.book):
                world.violation("slot_leak", pod.name, f"{len(broker.book)} wants left parked")

    def _reachable(self, client: Client) -> set[str]:
        """The pods a client's dials can land on (a sticky balancer: its pinned pod)."""
        world = self.world
        pods: set[str] = set()
        for name in client.spec.addresses:
            balancer = world.balancers.get(name)
            if balancer is None:
                pods.add(name)
            elif balancer.spec.sticky and client.name in balancer.pinned:
                pods.add(balancer.pinned[client.name])
            else:
                pods.update(pod.name for pod in balancer.pods)
        return {name for name in pods if world.pods[name].state in ("up", "draining", "down")}

    def _offered_by(self, pods: set[str]) -> set[str]:
        world = self.world
        return {s for name in pods for s in world.pods[name].spec.services}

    def _pool_found(self, client: Client, reachable: set[str]) -> None:
        world = self.world
        for service, since in sorted(client.probed.items()):
            offering = {name for name in reachable if service in world.pods[name].spec.services}
            if offering and not offering & client.reached:
                world.violation(
                    "pool",
                    client.name,
                    f"a job waited for {service!r} (first at {since:g}s, no connection announced "
                    f"it); its pool never reached {', '.join(sorted(offering))}, which offer it",
                )
