"""The fylr's probes: ``/livez`` (the process answers) and ``/readyz`` (it can take work).

Theory of operation
===================

A platform asks two different questions, and a fylr answers each on its own
route (both ``public``: probes carry no token and learn nothing secret):

``GET /livez``
    **Is the process alive?** Answered by the event loop itself, touching
    nothing else: 200 ``{"status": "serving"}``, or ``{"status": "stopping"}``
    while it stops (still 200: a liveness probe restarts a process only when
    it no longer answers, never because it stops or its database is down,
    which a restart would not cure).
``GET /readyz``
    **Should it get work now?** 200 ``{"status": "ready", "checks": …}`` when
    every check passes, else 503 (with ``Retry-After``) and
    ``{"status": "unready"}`` (or ``"stopping"``) naming the failed checks:

    - ``database``: the database answers within :data:`CHECK_TIMEOUT`, and
      every migration this fylr knows (the queue's and the fylr's own) is
      applied, one read of ``schema_migrations``
      (:func:`~trio_broker.trio.schema.pending_migrations`);
    - ``storage``: a file can be made and written in the storage folder (made
      first if it is missing, as the first upload would; the file is an
      anonymous temporary one, gone when closed: nothing is left behind even
      when the process dies meanwhile), within :data:`CHECK_TIMEOUT`;
    - ``stopping``: the process was asked to stop (SIGTERM): its claimed work
      goes back to the queue, it takes no new uploads.

    The two checks run at once, each bounded by :data:`CHECK_TIMEOUT`: one
    that hangs (a database behind a dropped route, a lost network mount) is
    left to its thread, which gives its connection back when it ends, and
    reported at the timeout. The kit's manifests give the probes a timeout
    above :data:`CHECK_TIMEOUT` (Kubernetes waits one second by default).

``GET /healthz`` (the file API's) stays what it was: 200 while serving, 503
while stopping.
"""

from __future__ import annotations

import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trio_broker.core.errors import StoreUnavailable
from trio_broker.trio.schema import Migration, load_migrations, pending_migrations
from trio_broker_daemons.fylr.access import Role
from trio_broker_daemons.fylr.files import fylr_migrations
from trio_broker_daemons.fylr.guard import GuardedRoute, route
from trio_broker_daemons.fylr.state import FylrState

__all__ = ["CHECK_TIMEOUT", "OK", "readiness", "routes"]

CHECK_TIMEOUT: Final = 3.0
"""Seconds each readiness check may take before it counts as failed."""
OK: Final = "ok"
"""A check that passed."""
RETRY_AFTER: Final = 2


def readiness(checks: dict[str, str], *, stopping: bool) -> tuple[int, dict[str, object]]:
    """The ``/readyz`` answer (status code, body) for the checks' results.

    Args:
        checks: each check's name and result (:data:`OK`, or what went wrong).
        stopping: the process was asked to stop.
    """
    failed = {name: result for name, result in checks.items() if result != OK}
    if stopping:
        return 503, {"status": "stopping", "checks": {**checks, "stopping": "stopping"}}
    if failed:
        return 503, {"status": "unready", "checks": checks, "failed": sorted(failed)}
    return 200, {"status": "ready", "checks": checks}


async def _bounded(check: Callable[[], Awaitable[str]]) -> str:
    with trio.move_on_after(CHECK_TIMEOUT):
        return await check()
    return f"no answer within {CHECK_TIMEOUT:g} s"


def _write_probe(root: Path) -> None:
    # the folder as the first upload makes it; then an anonymous file where the
    # filesystem can (O_TMPFILE), else one unlinked at once
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=root) as probe:
        probe.write(b"readyz\n")
        probe.flush()


class _Checks:
    def __init__(self, state: FylrState) -> None:
        self.state = state
        self.migrations: list[Migration] = [*load_migrations(), *fylr_migrations()]

    async def database(self) -> str:
        migrations = self.migrations
        try:
            missing = await self.state.store.call(
                lambda conn: pending_migrations(conn, migrations),
                kind="readyz",
                abandon_on_cancel=True,
            )
        except StoreUnavailable as exc:
            return f"unavailable: {' '.join(str(exc).split())}"
        if missing:
            names = ", ".join(f"{m.scope} {m.name}" for m in missing)
            return f"not migrated: {names} not applied"
        return OK

    async def storage(self) -> str:
        root = self.state.storage.root
        try:
            await trio.to_thread.run_sync(_write_probe, root, abandon_on_cancel=True)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            return f"not writable: {root}: {reason}"
        return OK


def routes(state: FylrState) -> list[GuardedRoute]:
    """``/livez`` and ``/readyz`` of one fylr process (``public``)."""
    checks = _Checks(state)

    async def livez(request: Request) -> Response:
        return JSONResponse({"status": "stopping" if state.stopping else "serving"})

    async def readyz(request: Request) -> Response:
        results: dict[str, str] = {}

        async def run(name: str, check: Callable[[], Awaitable[str]]) -> None:
            results[name] = await _bounded(check)

        if not state.stopping:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "database", checks.database)
                nursery.start_soon(run, "storage", checks.storage)
        status, body = readiness(dict(sorted(results.items())), stopping=state.stopping)
        headers = {"retry-after": str(RETRY_AFTER)} if status != 200 else None
        return JSONResponse(body, status_code=status, headers=headers)

    return [
        route("/livez", livez, role=Role.PUBLIC),
        route("/readyz", readyz, role=Role.PUBLIC),
    ]
