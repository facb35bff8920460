"""Queue positions end to end: a backlog at a real execserver, unclaimed rows in PostgreSQL.

One execserver with one slot; a raw broker connection of the test (``peer``)
holds the slot and parks a backlog; a fylr whose dispatcher may have one
exec-bound item in flight parks its file's metadata step behind that backlog,
and more rows wait unclaimed in the database. The reported position must be
the wants ahead by the grant rule (priority, then round-robin across
connections) plus the rows ahead by the claim order (priority descending, then
id), plus one, and must move up as the jobs ahead finish.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import httpx
import psycopg
import trio
from rich.console import Console
from trio_broker_daemons.commands.position import eta_text, queue_text
from trio_broker_daemons.commands.upload import upload_files

from tests.support.installation import WAIT, open_installation
from tests.support.wire import connect
from trio_broker.core import protocol as p

TEXT_CLASS = {"extensions": ["txt"], "metadata": {"service": "sha256"}, "versions": {}}


async def queue_of(http: httpx.AsyncClient, file_id: int) -> dict[str, Any] | None:
    response = await http.get(f"/api/v1/eas/{file_id}")
    assert response.status_code == 200, response.text
    queue: dict[str, Any] | None = response.json()["queue"]
    return queue


def insert_rows(dsn: str, priority: int, count: int) -> None:
    """Unclaimed exec-bound rows (of a file that does not exist) ahead in the claim order."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(count):
            conn.execute(
                "INSERT INTO broker_queue (file_ref, action, priority)"
                " VALUES ('0', 'metadata', %s)",
                (priority,),
            )


class Watched(io.StringIO):
    """A console's file that wakes a waiter whenever text is written."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = trio.Event()

    def write(self, text: str) -> int:
        written = super().write(text)
        self.changed.set()
        self.changed = trio.Event()
        return written

    async def wait_for(self, text: str) -> None:
        while text not in self.getvalue():
            await self.changed.wait()


async def test_position_counts_wants_and_rows_ahead_and_moves_up(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Parked behind a backlog: the POSITION answers plus the unclaimed rows ahead; unclaimed:
    every want at its priority or above plus the rows ahead; both move up as jobs end; the
    position command and the upload display print it."""
    async with open_installation(
        pg_dsn,
        tmp_path,
        fylrs=1,
        balanced=0,
        execserver={"slots": 1},
        fylr={"classes": {"text": TEXT_CLASS}, "max_in_flight": 1},
    ) as inst:
        (fylr,) = inst.fylrs
        (handle,) = inst.execservers
        async with (
            connect(handle) as peer,
            httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
        ):
            held = await peer.want("w0", "hold")
            assert isinstance(held, p.Offer)
            await peer.run(held, "hold", {"seconds": 600})
            for job_id, priority in (("w1", 2), ("w2", 0), ("w3", 0)):
                assert isinstance(await peer.want(job_id, "hold", priority), p.Queued)
            response = await http.put("/eas/put", params={"filename": "x.txt"}, content=b"x")
            x = response.json()["id"]
            with trio.fail_after(WAIT):  # the fylr's metadata want is parked behind them
                await handle.wait_until(lambda: len(handle.broker.book) == 4)
            insert_rows(pg_dsn, priority=4, count=2)
            response = await http.put("/eas/put", params={"filename": "y.txt"}, content=b"y")
            y = response.json()["id"]

            # parked: w1 (priority 2), then w2 (the peer's turn comes first at 0), plus 2 rows
            queue = await queue_of(http, x)
            assert queue is not None
            assert (queue["basis"], queue["position"], queue["rows_ahead"]) == ("execserver", 5, 2)
            # waiting: the 4 wants of the execserver's book and the 3 unclaimed rows
            assert (queue["running"], queue["waiting"], queue["capacity"]) == (1, 7, 1)
            assert queue["action"] == "metadata"
            # unclaimed: every want at priority 0 or above (4), plus the 2 rows of priority 4
            queue = await queue_of(http, y)
            assert queue is not None
            assert (queue["basis"], queue["position"], queue["rows_ahead"]) == ("figures", 7, 2)

            command = [sys.executable, "-m", "trio_broker_daemons", "position", str(x)]
            with trio.fail_after(WAIT):
                printed = await trio.run_process(
                    [*command, "--server", fylr.url], capture_stdout=True, capture_stderr=True
                )
            assert printed.stdout.decode() == (
                f"x.txt #{x} metadata: 1 running, 7 waiting, you are number 5\n"
            )

            await peer.send(p.Cancel(job_id="w0"))  # w0 ends: its slot is offered to w1
            w1 = await peer.expect(p.Offer)  # (the freed slot is offered before DONE)
            assert w1.job_id == "w1"
            await peer.done("w0")
            queue = await queue_of(http, x)
            assert queue is not None
            assert queue["position"] == 4
            await peer.run(w1, "hold", {"seconds": 0})  # w1 ends at once: w2 is offered
            w2 = await peer.expect(p.Offer)
            assert w2.job_id == "w2"
            await peer.done("w1")
            queue = await queue_of(http, x)
            assert queue is not None
            assert queue["position"] == 3

            # a new upload waits unclaimed behind w3 and x (parked), the 2 rows and y's row
            (tmp_path / "z.txt").write_text("z")
            out = Watched()
            console = Console(file=out, width=200)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: upload_files(
                        fylr.url, [(tmp_path / "z.txt", 0)], wait=True, console=console
                    )
                )
                with trio.fail_after(WAIT):
                    await out.wait_for("you are number")
                nursery.cancel_scope.cancel()
            # w3 and x in the book, the 2 rows, y and z unclaimed: 6 waiting, z the last
    assert "z.txt: 1 running, 6 waiting, you are number 6" in out.getvalue()


def test_the_words_of_a_position() -> None:
    """The running, waiting, number and a rough time, in that order; the time only as roughly."""
    queue = {"running": 3, "waiting": 7, "position": 11, "eta_s": 230.0}
    assert queue_text(queue) == "3 running, 7 waiting, you are number 11, roughly 4 minutes"
    assert queue_text({**queue, "waiting": None, "eta_s": None}) == "3 running, you are number 11"
    assert [eta_text(s) for s in (0.2, 1.4, 89.0, 91.0, 3600.0, 9000.0)] == [
        "roughly 1 second",
        "roughly 1 second",
        "roughly 89 seconds",
        "roughly 2 minutes",
        "roughly 60 minutes",
        "roughly 2 hours",
    ]
    assert eta_text(None) is None


HOLD_CLASS: dict[str, Any] = {
    "extensions": ["txt"],
    "metadata": {"service": "hold", "params": {"seconds": 600}},
    "versions": {},
}


async def test_claimed_rows_the_execserver_does_not_see_count_ahead(
    pg_dsn: str, tmp_path: Path
) -> None:
    """One slot, six files: the dispatcher claims as many rows as it may (3 here), one runs,
    the others wait; the last file is unclaimed. Its position merges both books: the
    claimed rows ahead that hold no slot (2 of 3) and the unclaimed rows ahead (2), and
    "waiting" counts the same, so the line reads "1 running, 5 waiting, you are number
    5" (it read "2 waiting, you are number 5": the execserver's book alone)."""
    async with open_installation(
        pg_dsn,
        tmp_path,
        fylrs=1,
        balanced=0,
        execserver={"slots": 1},
        fylr={"classes": {"text": HOLD_CLASS}, "max_in_flight": 8},
    ) as inst:
        (fylr,) = inst.fylrs
        (handle,) = inst.execservers
        async with httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http:
            ids = []
            for n in range(6):
                response = await http.put("/eas/put", params={"filename": f"{n}.txt"}, content=b"x")
                ids.append(response.json()["id"])
            with trio.fail_after(WAIT):  # all claimed, the first runs
                await fylr.wait_until(
                    lambda s: (
                        s.dispatcher is not None
                        and s.dispatcher.exec_in_flight == min(6, s.dispatcher.exec_limit)
                    )
                )
                await handle.wait_until(lambda: handle.broker.running() == 1)
            queue = await queue_of(http, ids[-1])
            dispatcher = fylr.statistics().dispatcher
    assert dispatcher is not None
    claimed = dispatcher.exec_in_flight
    assert 1 < claimed < 6  # the admission's limit (3 on two cores)
    assert queue is not None
    assert queue["basis"] == "figures"
    assert (queue["rows_ahead"], queue["held_ahead"]) == (5 - claimed, claimed - 1)
    assert (queue["running"], queue["waiting"], queue["position"]) == (1, 5, 5)
