"""The chaos soak: uploads from two uploaders while daemons are killed, then every check.

Theory of operation
===================

:func:`run_chaos` starts the installation of :mod:`tests.chaos.installation`,
writes the workload of :mod:`tests.chaos.samples` and runs, in one nursery:

- **one uploader per fylr**, each sending its share of the samples (at its own
  pace, decided by the seed) to its own fylr through the upload API, and to the
  next fylr when that one does not answer; a share of the samples (``remote``) is
  registered by URL instead (``PUT /eas/rput``: copied in, or left on its
  remote), served by a file server on loopback that answers 503 and drops or
  cuts connections on purpose (:mod:`tests.chaos.remote`);
- **one follower per uploader**, each following its uploader's files through
  ``GET /api/v1/eas/<id>?wait=S`` on the fylrs in turn (as a client would);
- **the escaper** (``escapes``): on-demand renditions by the preset ``escape``
  of files that ended, whose job leaves a ``setsid sleep 600`` behind it (its
  output must be the original's bytes);
- **the chaos schedule** (:func:`schedule`): ``kill -9`` of a fylr or an
  execserver and its restart after a while, ``pg_ctl restart -m immediate``, a
  drain (SIGTERM) of an execserver and its restart, ``checksum`` runs over
  every stored file (asked of a fylr while the rest goes on), and cuts of the
  pipe path from the execservers to one fylr (an nftables drop for 5–10 s,
  :mod:`tests.chaos.pipepath`). Each event waits until the
  run's *progress* (files uploaded plus originals ended, out of twice the
  files) has reached its threshold and until its gap after the previous event
  has passed. The seed decides every event's kind, target, threshold, gap and
  down time, the workload and the uploaders' pace; the machine decides only
  how fast the daemons go.

When an execserver is killed or drained, every process its jobs started (a
``setsid`` one included) must be gone within :data:`OUTLIVE_WITHIN` of its end.
During each database restart every fylr is asked for a file over and over
until each has answered 200 after it: a 500 there (or anywhere else) is a
violation, a 503 is not. Once the uploads and the schedule are through, the run
waits (bounded) until every file has ended and the queue has nothing ready or
claimed, then checks (:mod:`tests.chaos.checks`): the rows and downloads of
every file (after one more checksum run of them all: no file may be marked
damaged, since nothing changed a stored byte), the queue left empty but for the
``failed`` rows of the versions a
corrupt image fails (the converter's refusal in their ``last_error``), every
execserver idle (no running job, offer
or parked want, its pool free; waited for, bounded), every daemon stopping
cleanly on SIGTERM, no work folder left in any execserver's ``temp_dir`` and no
job process of the run left on the machine.

The long plan runs three fylrs on a **mixed fleet**
(:func:`~tests.chaos.installation.open_chaos_installation`): the balancer's
first replica offers ``image_metadata`` alone and the second and third fylrs
know only the balancer.
"""

from __future__ import annotations

import collections
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import attrs
import httpx
import psycopg
import trio
from psycopg.rows import dict_row
from trio_broker_daemons.commands.upload import UploadError, upload
from trio_broker_daemons.fylr.config import FylrConfig

from tests.chaos.checks import CONVERTER_ERROR, FileRecord, check_file, check_rows
from tests.chaos.installation import (
    DRAIN_TIMEOUT,
    ESCAPE,
    ChaosInstallation,
    Daemon,
    DaemonError,
    job_processes,
    open_chaos_installation,
    restart_database,
)
from tests.chaos.remote import RemoteFiles, open_remote_files
from tests.chaos.samples import Sample, make_workload
from trio_broker.trio.workdir import PREFIX as WORK_PREFIX

__all__ = ["ChaosPlan", "ChaosReport", "Event", "fylr_names", "run_chaos", "schedule"]

FYLRS: Final = ("fylr-1", "fylr-2")
"""The fylrs of a plan with two (the default)."""
EXECSERVERS: Final = ("exec-a", "exec-b", "exec-c")
PROBE_INTERVAL: Final = 0.25
"""Seconds between two looks at the run's progress, at a restarting database, at an execserver."""
RECOVER_WITHIN: Final = 60.0
"""Seconds a fylr may take to answer 200 again after a database restart."""
IDLE_WITHIN: Final = 30.0
"""Seconds the execservers may take to settle once every file has ended (offers expire)."""
EVENT_WAIT: Final = 300.0
"""The longest an event waits for its progress threshold (it fires anyway after that)."""
UPLOAD_ATTEMPTS: Final = 40
OUTLIVE_WITHIN: Final = 1.0
"""Seconds a job's process may outlive its execserver (a work folder, the run's end)."""
ESCAPE_PACE: Final = (0.5, 4.0)
"""The range of seconds the escaper waits between two renditions."""


@attrs.frozen(kw_only=True)
class ChaosPlan:
    """What a run does; everything random in it follows from ``seed``.

    Attributes:
        seed: decides the workload, the schedule and the uploaders' pace.
        files: how many uploads.
        kills: how many ``kill -9`` of a daemon (fylr or execserver).
        database_restarts: how many ``pg_ctl restart -m immediate``.
        drains: how many drains of an execserver.
        checksums: how many checksum runs over every stored file, during the run.
        max_side: the largest side of a generated image.
        pace: the most seconds an uploader waits between two uploads.
        gap: the range of seconds between two events.
        down: the range of seconds a killed daemon stays down.
        end_within: seconds everything may take to end after the last upload
            and event.
        remote: the share of samples registered by URL (a third of them left
            on their remote).
        fylrs: how many fylrs (and uploaders).
        mixed: the mixed fleet (see the module docstring).
        cuts: how many cuts of the last fylr's pipe path.
        cut: the range of seconds a cut lasts.
        escapes: how many renditions by the preset ``escape``.
    """

    seed: int
    files: int
    kills: int
    database_restarts: int = 2
    drains: int = 1
    checksums: int = 2
    max_side: int = 1200
    pace: float = 0.3
    gap: tuple[float, float] = (2.0, 5.0)
    down: tuple[float, float] = (0.3, 3.0)
    end_within: float = 300.0
    remote: float = 0.2
    fylrs: int = 2
    mixed: bool = False
    cuts: int = 0
    cut: tuple[float, float] = (5.0, 10.0)
    escapes: int = 0


SHORT: Final = ChaosPlan(
    seed=1, files=40, kills=4, max_side=640, pace=3.0, gap=(1.0, 3.0), end_within=240.0
)
"""The version ``make test`` runs: about a minute (the uploads spread over the schedule)."""
LONG: Final = ChaosPlan(
    seed=1,
    files=300,
    kills=24,
    max_side=1600,
    pace=2.6,
    gap=(1.5, 4.0),
    end_within=600.0,
    fylrs=3,
    mixed=True,
    cuts=3,
    escapes=40,
)
"""The version ``make soak`` runs: several minutes."""


@attrs.frozen(kw_only=True)
class Event:
    """One step of the chaos schedule.

    Attributes:
        action: ``kill`` (then restart), ``database`` (an immediate restart),
            ``drain`` (SIGTERM to an execserver, then restart) or ``checksum`` (a
            checksum run over every stored file, asked of a fylr).
        target: the daemon (``fylr-1``, ``exec-b`` …); None for the database.
        progress: the share of the run's progress (0..1) it waits for.
        gap: the least seconds after the previous event.
        down: for a kill, the seconds the daemon stays down.
    """

    action: Literal["kill", "database", "drain", "checksum", "cut"]
    target: str | None
    progress: float
    gap: float
    down: float

    def describe(self) -> str:
        if self.action == "database":
            return "restart the database (immediate)"
        if self.action == "drain":
            return f"drain {self.target} and restart it"
        if self.action == "checksum":
            return f"a checksum run of every stored file, asked of {self.target}"
        if self.action == "cut":
            return f"cut the pipe path to {self.target} for {self.down:.1f} s"
        return f"kill -9 {self.target}, restart it after {self.down:.1f} s"


def fylr_names(plan: ChaosPlan) -> tuple[str, ...]:
    """``fylr-1`` … ``fylr-N``; the last is the one whose pipe path is cut."""
    return tuple(f"fylr-{n}" for n in range(1, plan.fylrs + 1))


def schedule(plan: ChaosPlan) -> list[Event]:
    """The chaos events of a plan, in order (the same for the same plan).

    With more kills than fylrs, every fylr and at least one execserver are
    killed. Thresholds are spread over 5 % to 85 % of the progress.
    """
    fylrs = fylr_names(plan)
    rng = random.Random(f"chaos-schedule-{plan.seed}")
    targets: list[str] = []
    if plan.kills >= len(fylrs) + 1:
        targets = [*fylrs, rng.choice(EXECSERVERS)]
    daemons = fylrs + EXECSERVERS
    targets += [rng.choice(daemons) for _ in range(plan.kills - len(targets))]
    actions: list[tuple[Literal["kill", "database", "drain"], str | None]] = [
        *(("kill", t) for t in targets),
        *(("database", None) for _ in range(plan.database_restarts)),
        *(("drain", rng.choice(EXECSERVERS)) for _ in range(plan.drains)),
    ]
    rng.shuffle(actions)
    thresholds = sorted(rng.uniform(0.05, 0.85) for _ in actions)
    events = [
        Event(
            action=action,
            target=target,
            progress=round(threshold, 3),
            gap=round(rng.uniform(*plan.gap), 2),
            down=round(rng.uniform(*plan.down), 2),
        )
        for (action, target), threshold in zip(actions, thresholds, strict=True)
    ]
    # checksum runs from a generator of their own: the other events stay as they were
    sums = random.Random(f"chaos-checksums-{plan.seed}")
    events += [
        Event(
            action="checksum",
            target=sums.choice(fylrs),
            progress=round(sums.uniform(0.05, 0.85), 3),
            gap=round(sums.uniform(*plan.gap), 2),
            down=round(sums.uniform(*plan.down), 2),  # unused: nothing goes down
        )
        for _ in range(plan.checksums)
    ]
    # cuts too: the plans without them keep their events
    cuts = random.Random(f"chaos-cuts-{plan.seed}")
    events += [
        Event(
            action="cut",
            target=fylrs[-1],
            progress=round(cuts.uniform(0.05, 0.85), 3),
            gap=round(cuts.uniform(*plan.gap), 2),
            down=round(cuts.uniform(*plan.cut), 2),
        )
        for _ in range(plan.cuts)
    ]
    return sorted(events, key=lambda event: event.progress)


@attrs.define
class ChaosReport:
    """What a run did and found."""

    plan: ChaosPlan
    workdir: Path
    files: int = 0
    corrupt: int = 0
    copied: int = 0
    referenced: int = 0
    remote_answers: str = ""
    uploads_retried: int = 0
    kills: list[str] = attrs.Factory(list)
    restarts: int = 0
    database_restarts: int = 0
    drains: int = 0
    checksums: int = 0
    cuts: int = 0
    cut_seconds: float = 0.0
    dropped: int = 0
    escapes: collections.Counter[str] = attrs.Factory(collections.Counter)
    killed_jobs: int = 0
    killed_escapes: int = 0
    violations: list[str] = attrs.Factory(list)
    notes: list[str] = attrs.Factory(list)
    duration: float = 0.0

    def summary(self) -> str:
        """The lines to print: the figures, then each violation, then the notes."""
        killed = collections.Counter(self.kills)
        kills = ", ".join(f"{name} ×{n}" for name, n in sorted(killed.items())) or "none"
        lines = [
            f"chaos soak, seed {self.plan.seed}: {self.files} files ({self.corrupt} corrupt,"
            f" 1 duplicate, {self.uploads_retried} uploads retried),"
            f" {len(self.kills)} kills ({kills}), {self.restarts} restarts,"
            f" {self.database_restarts} database restarts, {self.drains} drains,"
            f" {self.checksums} checksum runs, {self.cuts} pipe-path cuts"
            f" ({self.cut_seconds:.1f} s, {self.dropped} packets dropped),"
            f" {len(self.violations)} violations, {self.duration:.1f} s",
            f"  {self.plan.fylrs} fylrs, {'a mixed' if self.plan.mixed else 'an even'} fleet;"
            f" escape renditions: "
            + (", ".join(f"{k} ×{n}" for k, n in sorted(self.escapes.items())) or "none")
            + f"; {self.killed_jobs} job processes on killed or drained execservers"
            f" ({self.killed_escapes} setsid ones)",
            f"  by URL: {self.copied} copied in, {self.referenced} left on the remote;"
            f" the remote: {self.remote_answers or 'not asked'}",
        ]
        lines += [f"  VIOLATION {v}" for v in self.violations]
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"  logs: {self.workdir / 'logs'}")
        return "\n".join(lines)


async def run_chaos(plan: ChaosPlan, workdir: Path) -> ChaosReport:
    """Run one chaos soak in ``workdir`` (created; logs and samples stay there)."""
    started = time.monotonic()
    report = ChaosReport(plan=plan, workdir=workdir)
    samples = make_workload(plan.seed, plan.files, max_side=plan.max_side, remote=plan.remote)
    report.files = len(samples)
    report.corrupt = sum(s.kind == "corrupt" for s in samples)
    report.copied = sum(s.way == "copy" for s in samples)
    report.referenced = sum(s.way == "reference" for s in samples)
    folder = workdir / "samples"
    folder.mkdir(parents=True, exist_ok=True)
    for sample in samples:
        (folder / sample.name).write_bytes(sample.data)
    token = secrets.token_hex(8)
    try:
        async with (
            open_remote_files(samples, plan.seed) as remote,
            open_chaos_installation(
                workdir,
                token,
                fylrs=plan.fylrs,
                mixed=plan.mixed,
                cut_fylr=fylr_names(plan)[-1] if plan.cuts else None,
            ) as inst,
            httpx.AsyncClient(timeout=60.0) as http,
        ):
            run = _Run(plan, inst, http, samples, folder, report, remote)
            try:
                await run.workload()
                await run.check()
                await run.stop()
                await run.check_work_folders()
            finally:
                report.remote_answers = remote.figures.describe()
        leftovers = job_processes(token)
        report.violations += [
            f"job process {p.pid} ({' '.join(_cmdline(p))[:120]}) is left after the run"
            for p in leftovers
        ]
    finally:
        report.duration = time.monotonic() - started
    return report


async def _poll(check: Callable[[], Awaitable[bool]]) -> None:
    """Return once ``check()`` holds, looking every :data:`PROBE_INTERVAL` (bound it)."""
    while True:
        if await check():
            return
        await trio.sleep(PROBE_INTERVAL)


async def outliving(token: str, execserver: str, within: float) -> list[Any]:
    """The job processes of ``execserver`` still alive ``within`` seconds from now (or [])."""
    left: list[Any] = []

    async def gone() -> bool:
        nonlocal left
        left = job_processes(token, execserver)
        return not left

    with trio.move_on_after(within):
        await _poll(gone)
    if left:
        await gone()  # one last look, at the bound
    return left


async def work_folders_left(temp_dirs: Sequence[Path], within: float) -> list[Path]:
    """The jobs' work folders in ``temp_dirs`` still there ``within`` seconds from now (or [])."""
    left: list[Path] = []

    async def removed() -> bool:
        nonlocal left
        left = [folder for temp_dir in temp_dirs for folder in temp_dir.glob(f"{WORK_PREFIX}*")]
        return not left

    with trio.move_on_after(within):
        await _poll(removed)
    if left:
        await removed()  # one last look, at the bound
    return left


def _cmdline(process: Any) -> list[str]:
    try:
        return list(process.cmdline())
    except Exception:
        return ["?"]


class _Run:
    """One run's state: the installation, the uploads, the schedule, the 500s seen."""

    def __init__(
        self,
        plan: ChaosPlan,
        inst: ChaosInstallation,
        http: httpx.AsyncClient,
        samples: Sequence[Sample],
        folder: Path,
        report: ChaosReport,
        remote: RemoteFiles,
    ) -> None:
        self.plan = plan
        self.remote = remote
        self.inst = inst
        self.http = http
        self.samples = samples
        self.folder = folder
        self.report = report
        self.ids: dict[str, int] = {}
        self.uploaded = 0
        self.ended = 0
        self.phase = "start"
        self.errors: collections.Counter[tuple[str, str, int]] = collections.Counter()
        self.uploads_done = trio.Event()
        self.ids_changed = trio.Event()  # set, and replaced, when an upload gets its id
        self.settled = trio.Event()
        self.done: list[str] = []  # samples seen done by a follower, in that order
        self.started = time.monotonic()
        self.config = FylrConfig.from_yaml(inst.fylrs[0].config)

    # -- the database, read directly -----------------------------------------------------

    def _query(self, sql: str) -> list[dict[str, Any]]:
        with psycopg.connect(self.inst.dsn, connect_timeout=5, row_factory=dict_row) as conn:
            return list(conn.execute(sql.encode()).fetchall())

    async def query(self, sql: str) -> list[dict[str, Any]] | None:
        """The rows of ``sql``, or None while the database cannot answer."""
        try:
            return await trio.to_thread.run_sync(self._query, sql)
        except psycopg.Error:
            return None

    async def progress(self) -> float:
        rows = await self.query(
            "SELECT count(*) AS n FROM files"
            " WHERE kind = 'original' AND status IN ('done', 'error')"
        )
        if rows is not None:
            self.ended = int(rows[0]["n"])
        return (self.uploaded + self.ended) / (2 * len(self.samples))

    # -- the workload --------------------------------------------------------------------

    async def workload(self) -> None:
        rng = random.Random(f"chaos-uploaders-{self.plan.seed}")
        count = len(self.inst.fylrs)
        shares = [list(self.samples[n::count]) for n in range(count)]
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as uploads:
                for index, share in enumerate(shares):
                    uploads.start_soon(self._uploader, index, share, rng.random())
                    nursery.start_soon(self._follower, index, share)
                uploads.start_soon(self._chaos)
                if self.plan.escapes:
                    nursery.start_soon(self._escaper)
            self.uploads_done.set()
            self._ids_changed()
            self.phase = "end"
            if await self._wait_settled():
                self.report.notes.append(
                    f"everything ended {time.monotonic() - self.started:.1f} s after the start"
                )
            self.settled.set()
        for (name, phase, code), count in sorted(self.errors.items()):
            self.report.violations.append(f"{name} answered {code} {count} times (during {phase})")

    def _note_answer(self, fylr: Daemon, code: int) -> None:
        if code == 500:
            self.errors[(fylr.name, self.phase, code)] += 1

    async def _uploader(self, index: int, samples: Sequence[Sample], seed: float) -> None:
        rng = random.Random(seed)
        for sample in samples:
            await self._upload(sample, index)
            await trio.sleep(rng.uniform(0, self.plan.pace))  # the uploader's pace

    async def _upload(self, sample: Sample, prefer: int) -> None:
        last = ""
        for attempt in range(UPLOAD_ATTEMPTS):
            fylr = self.inst.fylrs[(prefer + attempt) % len(self.inst.fylrs)]
            if not fylr.running:
                await trio.sleep(0.2)  # both may be down for a moment: try the other next
                continue
            try:
                document = await self._send(fylr, sample)
            except UploadError as exc:
                last = str(exc)
                if "answered 500" in last:
                    self._note_answer(fylr, 500)
                self.report.uploads_retried += 1
                await trio.sleep(0.2)  # a retry's back-off
                continue
            self.ids[sample.name] = int(document["id"])
            self.uploaded += 1
            self._ids_changed()
            return
        self.report.violations.append(
            f"{sample.name}: not uploaded after {UPLOAD_ATTEMPTS} attempts: {last}"
        )
        self.uploaded += 1  # counted for the progress all the same

    async def _send(self, fylr: Daemon, sample: Sample) -> dict[str, Any]:
        """Upload a sample, or register it by its URL (copied in, or left on the remote).

        Raises:
            UploadError: not accepted (the text says how the fylr answered).
        """
        if sample.way == "put":
            return await upload(
                self.http, fylr.url, self.folder / sample.name, priority=sample.priority
            )
        params: dict[str, str | int] = {
            "url": self.remote.url(sample),
            "priority": sample.priority,
            "filename": sample.name,
            "leave_on_remote": int(sample.way == "reference"),
        }
        try:
            response = await self.http.put(f"{fylr.url}/eas/rput", params=params)
        except httpx.HTTPError as exc:
            raise UploadError(f"{sample.name}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 201:
            raise UploadError(f"{sample.name}: answered {response.status_code}: {response.text}")
        document: dict[str, Any] = response.json()
        return document

    async def _follower(self, index: int, samples: Sequence[Sample]) -> None:
        """Follow this uploader's files through the API, on the fylrs in turn."""
        names = [s.name for s in samples]
        ended: set[str] = set()
        turn = index
        while not self.settled.is_set():
            waiting = [n for n in names if n in self.ids and n not in ended]
            if not waiting:
                if self.uploads_done.is_set():
                    return  # no upload is left to get an id
                await self.ids_changed.wait()  # a new id, or the uploads are over
                continue
            for name in waiting:
                turn += 1
                fylr = self.inst.fylrs[turn % len(self.inst.fylrs)]
                if self.settled.is_set():
                    return
                if not fylr.running:
                    await trio.sleep(PROBE_INTERVAL)  # it is being restarted
                    continue
                url = f"{fylr.url}/api/v1/eas/{self.ids[name]}"
                try:
                    response = await self.http.get(url, params={"wait": "2"})
                except httpx.HTTPError:
                    continue
                self._note_answer(fylr, response.status_code)
                if response.status_code == 200 and response.json()["status"] in ("done", "failed"):
                    ended.add(name)
                    if response.json()["status"] == "done":
                        self.done.append(name)

    # -- the chaos -----------------------------------------------------------------------

    async def _chaos(self) -> None:
        last = time.monotonic()
        for number, event in enumerate(schedule(self.plan), 1):
            await trio.sleep(max(0.0, last + event.gap - time.monotonic()))  # the schedule's gap
            reached = await self._wait_progress(event.progress)
            at = await self.progress()
            if not reached:
                self.report.notes.append(
                    f"event {number} waited {EVENT_WAIT:g} s for {event.progress:.0%} progress"
                )
            self.report.notes.append(
                f"event {number} at {at:.0%}, {time.monotonic() - self.started:.1f} s:"
                f" {event.describe()}"
            )
            self.phase = f"event {number}: {event.describe()}"
            await self._event(event, number)
            self.phase = f"after event {number}"
            last = time.monotonic()

    def _ids_changed(self) -> None:
        self.ids_changed.set()
        self.ids_changed = trio.Event()

    async def _wait_progress(self, threshold: float) -> bool:
        async def reached() -> bool:
            return await self.progress() >= threshold

        with trio.move_on_after(EVENT_WAIT):
            await _poll(reached)
            return True
        return False

    async def _event(self, event: Event, number: int) -> None:
        if event.action == "database":
            await self._restart_database(self.report.database_restarts + 1)
            return
        if event.action == "checksum":
            await self._checksum(event.target, f"event {number}")
            return
        if event.action == "cut":
            await self._cut(event, number)
            return
        assert event.target is not None
        daemon = self.inst.daemons[event.target]
        status: int | None
        jobs = self._count_jobs(daemon)
        if event.action == "kill":
            status = await daemon.kill()
            self.report.kills.append(daemon.name)
            if status != -9:
                self.report.violations.append(
                    f"event {number}: {daemon.name} had exited ({status}) before its kill"
                )
            await self._check_outlived(daemon, jobs, number)
            await trio.sleep(event.down)  # the time it stays down: part of the schedule
        else:
            status = await daemon.terminate(within=DRAIN_TIMEOUT + 30.0)
            self.report.drains += 1
            if status != 0:
                self.report.violations.append(
                    f"event {number}: the drain of {daemon.name} ended with status {status}"
                    " (0 expected)"
                )
            await self._check_outlived(daemon, jobs, number)
        await self._restart(daemon, number)

    def _count_jobs(self, daemon: Daemon) -> int:
        """Note how many job processes of an execserver run (before its kill or drain)."""
        if daemon.command != "execserver":
            return 0
        found = job_processes(self.inst.token, daemon.name)
        self.report.killed_jobs += len(found)
        self.report.killed_escapes += sum(_cmdline(p)[:2] == ["sleep", "600"] for p in found)
        return len(found)

    async def _check_outlived(self, daemon: Daemon, jobs: int, number: int) -> None:
        """No process of an execserver's jobs may outlive it by more than OUTLIVE_WITHIN."""
        if daemon.command != "execserver":
            return
        left = await outliving(self.inst.token, daemon.name, OUTLIVE_WITHIN)
        self.report.violations += [
            f"event {number}: job process {p.pid} ({' '.join(_cmdline(p))[:80]}) outlived"
            f" {daemon.name} by more than {OUTLIVE_WITHIN:g} s ({jobs} were running)"
            for p in left
        ]

    async def _cut(self, event: Event, number: int) -> None:
        """Cut the execservers' path to a fylr's pipes for ``event.down`` seconds."""
        path = self.inst.pipe_path
        assert path is not None, "a cut needs the installation's pipe path"
        before = path.relay.connections
        await trio.to_thread.run_sync(path.cut)
        try:
            await trio.sleep(event.down)  # the cut's length: part of the schedule
        finally:
            with trio.CancelScope(shield=True):
                dropped = await trio.to_thread.run_sync(path.heal)
        self.report.cuts += 1
        self.report.cut_seconds += event.down
        self.report.dropped += dropped
        self.report.notes.append(
            f"event {number}: {dropped} packets dropped; the relay had carried"
            f" {before} connections before it, {path.relay.connections} after"
        )

    async def _escaper(self) -> None:
        """Ask for renditions whose job leaves a ``setsid sleep 600`` (``escapes`` of them)."""
        rng = random.Random(f"chaos-escaper-{self.plan.seed}")
        by_name = {s.name: s for s in self.samples}
        asked = 0
        while asked < self.plan.escapes and not self.settled.is_set():
            await trio.sleep(rng.uniform(*ESCAPE_PACE))  # the escaper's pace
            candidates = [n for n in self.done if by_name[n].way != "reference"]
            running = [f for f in self.inst.fylrs if f.running]
            if not candidates or not running:
                continue
            sample = by_name[rng.choice(candidates)]
            fylr = rng.choice(running)
            asked += 1
            url = f"{fylr.url}/api/v1/eas/download/{self.ids[sample.name]}/custom"
            try:
                response = await self.http.get(url, params={"preset": ESCAPE})
            except httpx.HTTPError as exc:
                self.report.escapes[type(exc).__name__] += 1
                continue
            self._note_answer(fylr, response.status_code)
            self.report.escapes[str(response.status_code)] += 1
            if response.status_code == 200 and response.content != sample.data:
                self.report.violations.append(
                    f"{sample.name}: its escape rendition through {fylr.name} is"
                    f" {len(response.content)} bytes, not the original's {len(sample.data)}"
                )

    async def check_work_folders(self) -> None:
        """Once every daemon stopped, no job's work folder may be left (within OUTLIVE_WITHIN)."""
        left = await work_folders_left(list(self.inst.temp_dirs.values()), OUTLIVE_WITHIN)
        self.report.violations += [
            f"work folder {folder} is left after every execserver stopped" for folder in left
        ]

    async def _checksum(self, target: str | None, what: str) -> None:
        """Ask a fylr (``target``, or any that runs) to checksum every stored file."""
        names = [target] if target is not None else [f.name for f in self.inst.fylrs]
        for fylr in [self.inst.daemons[name] for name in names]:
            if not fylr.running:
                continue
            try:
                response = await self.http.post(
                    f"{fylr.url}/inspect/system/fylr/checksum",
                    headers={"authorization": f"Bearer {self.config.tokens.operator}"},
                )
            except httpx.HTTPError as exc:
                self.report.notes.append(f"{what}: checksum not asked of {fylr.name}: {exc}")
                continue
            self._note_answer(fylr, response.status_code)
            if response.status_code == 202:
                self.report.checksums += 1
                self.report.notes.append(f"{what}: {response.json()['queued']} files to checksum")
                return
            self.report.notes.append(f"{what}: {fylr.name} answered {response.status_code}")

    async def _restart(self, daemon: Daemon, number: int) -> None:
        for attempt in (1, 2):
            try:
                await daemon.start()
            except DaemonError as exc:
                self.report.violations.append(f"event {number}: restart {attempt}: {exc}")
                continue
            self.report.restarts += 1
            return

    async def _restart_database(self, number: int) -> None:
        probe_id = next(iter(self.ids.values()), 1)
        answered: dict[str, list[int]] = {f.name: [] for f in self.inst.fylrs}
        restarted = trio.Event()
        recovered = 0
        all_recovered = trio.Event()
        async with trio.open_nursery() as nursery:

            async def probe(fylr: Daemon) -> None:
                nonlocal recovered
                seen = answered[fylr.name]
                while True:
                    try:
                        response = await self.http.get(f"{fylr.url}/api/v1/eas/{probe_id}")
                        code = response.status_code
                    except httpx.HTTPError:
                        code = 0
                    seen.append(code)
                    self._note_answer(fylr, code)
                    if restarted.is_set() and code in (200, 404):
                        recovered += 1
                        if recovered == len(self.inst.fylrs):
                            all_recovered.set()
                        return
                    await trio.sleep(0.05)  # the probe's rate

            for fylr in self.inst.fylrs:
                nursery.start_soon(probe, fylr)
            await restart_database(self.inst.cluster)
            restarted.set()
            self.report.database_restarts += 1
            with trio.move_on_after(RECOVER_WITHIN):
                await all_recovered.wait()
            nursery.cancel_scope.cancel()
        for name, codes in answered.items():
            counts = collections.Counter(codes)
            self.report.notes.append(
                f"database restart {number}: {name} answered "
                + ", ".join(f"{code or 'no answer'} ×{n}" for code, n in sorted(counts.items()))
            )
        if recovered < len(self.inst.fylrs):
            self.report.violations.append(
                f"database restart {number}: a fylr did not answer 200 within"
                f" {RECOVER_WITHIN:g} s after it"
            )

    async def _wait_settled(self) -> bool:
        """Until every file has ended and nothing is ready or claimed (bounded): whether it did."""
        sql = (
            "SELECT (SELECT count(*) FROM files WHERE status NOT IN ('done', 'error')) AS open,"
            " (SELECT count(*) FROM broker_queue WHERE status IN ('new', 'claimed')) AS queued"
        )
        with trio.move_on_after(self.plan.end_within):
            while True:
                rows = await self.query(sql)
                if rows is not None and rows[0]["open"] == 0 and rows[0]["queued"] == 0:
                    return True
                await trio.sleep(PROBE_INTERVAL)
        rows = await self.query(
            "SELECT id, kind, filename, version, status, error FROM files"
            " WHERE status NOT IN ('done', 'error') ORDER BY id LIMIT 20"
        )
        for row in rows or []:
            what = f"version {row['version']} of " if row["kind"] == "version" else ""
            self.report.violations.append(
                f"{what}{row['filename']} (file {row['id']}): still {row['status']!r}"
                f" {self.plan.end_within:g} s after the last event"
            )
        return False

    # -- the checks ----------------------------------------------------------------------

    async def check(self) -> None:
        await self._checksum(None, "the end")  # every file once more: nothing may be damaged
        await self._wait_settled()
        damaged = await self.query(
            "SELECT id, filename, version, damage FROM files WHERE damage IS NOT NULL ORDER BY id"
        )
        for row in damaged or []:
            what = f"version {row['version']} of " if row["version"] else ""
            self.report.violations.append(
                f"{what}{row['filename']} (file {row['id']}) marked damaged: {row['damage']}"
            )
        rows = await self.query(
            "SELECT id, kind, parent_id, version, source, filename, class AS file_class, status,"
            " storage_key, size, sha256, metadata, error FROM files ORDER BY id"
        )
        if rows is None:
            self.report.violations.append("the database does not answer after the run")
            return
        records = [FileRecord(**row) for row in rows]
        violations = self.report.violations
        violations += check_rows(records, self.samples)
        versions: dict[int, list[FileRecord]] = collections.defaultdict(list)
        for record in records:
            if record.parent_id is not None:
                versions[record.parent_id].append(record)
        by_name = {s.name: s for s in self.samples}
        urls = [f.url for f in self.inst.fylrs]
        for record in records:
            sample = by_name.get(record.filename)
            if record.kind == "original" and sample is not None:
                violations += await check_file(
                    self.http, urls, sample, record, versions[record.id], self.config
                )
        extra = len([r for r in records if r.kind == "original"]) - len(self.samples)
        if extra > 0:
            self.report.notes.append(f"{extra} uploads were stored twice (an answer was lost)")
        refused = CONVERTER_ERROR.replace("'", "''")
        queue = await self.query(
            "SELECT status, action, count(*) AS n, max(last_error) AS error,"
            f" bool_and(last_error LIKE '%{refused}%') AS refused FROM broker_queue"
            " GROUP BY status, action"
        )
        for row in queue or []:
            if row["status"] == "failed" and row["action"] == "produce" and row["refused"]:
                # a corrupt image's picture versions: failed rows, for an operator to requeue
                self.report.notes.append(f"{row['n']} produce rows failed: the converter refused")
                continue
            violations.append(
                f"the queue is not empty: {row['n']} {row['action']} rows {row['status']!r}"
                f" (last error {row['error']!r})"
            )
        await self._check_execservers()
        self._note_storage(records)

    def _note_storage(self, records: Sequence[FileRecord]) -> None:
        root = self.inst.state_dir / "files"
        keys = {r.storage_key for r in records if r.storage_key}
        on_disk = [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
        temporary = [p for p in on_disk if p.name.startswith(".tmp-")]
        unreferenced = [
            p for p in on_disk if p not in temporary and p.relative_to(root).as_posix() not in keys
        ]
        missing = [k for k in keys if not (root / k).is_file()]
        self.report.violations += [f"stored file {k} of a row is missing" for k in missing]
        self.report.notes.append(
            f"storage: {len(on_disk)} files, {len(temporary)} temporary,"
            f" {len(unreferenced)} unreferenced"
        )

    async def _check_execservers(self) -> None:
        problems: dict[str, list[str]] = {}
        with trio.move_on_after(IDLE_WITHIN):
            while True:
                for daemon in self.inst.execservers:
                    problems[daemon.name] = await self._busy(daemon)
                if not any(problems.values()):
                    return
                await trio.sleep(PROBE_INTERVAL)
        for name, found in problems.items():
            self.report.violations += [
                f"{name} is not idle {IDLE_WITHIN:g} s after the end: {p}" for p in found
            ]

    async def _busy(self, daemon: Daemon) -> list[str]:
        """What an execserver's inspection document shows still going on."""
        try:
            response = await self.http.get(f"{daemon.url}/inspect/system/execserver")
            document = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            return [f"no inspection document: {exc}"]
        pool = document["pool"]
        found = []
        free = pool["slots"] - pool["fast_reserve"]  # idle leaves the fast reserve out
        if pool["busy"] or pool["idle"] != free:
            found.append(f"pool {pool['busy']} busy, {pool['idle']} idle of {free}")
        found += [f"job {job['job_id']} ({job['service']}) running" for job in document["running"]]
        for name, service in document["services"].items():
            for what in ("running", "offered", "parked"):
                if service[what]:
                    found.append(f"service {name}: {service[what]} {what}")
        for conn in document["connections"]:
            for what in ("running", "offered", "parked"):
                if conn[what]:
                    found.append(f"connection {conn['name']}: {conn[what]} {what}")
        return found

    async def stop(self) -> None:
        """Stop every daemon with SIGTERM: each must exit 0."""
        for daemon in (*self.inst.fylrs, *self.inst.execservers):
            if not daemon.running:
                self.report.violations.append(f"{daemon.name} is not running at the end")
                continue
            status = await daemon.terminate()
            if status != 0:
                self.report.violations.append(
                    f"{daemon.name} stopped with status {status} on SIGTERM (0 expected)"
                )
