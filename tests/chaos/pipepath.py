"""The path from the execservers to one fylr's pipes, and its cut.

Every daemon of the soak listens on 127.0.0.1, so no address tells the
execservers' connections to a fylr from the uploaders'. One fylr therefore
gets a callback base of its own (``callback_own_url``): a port on 127.0.0.1
where a relay of this process (:func:`tests.support.netns.serve_relay`)
forwards every connection to the fylr's listener. Only the execservers (and the
fylr's own callback check) dial that port, so an nftables drop of that port is
a cut of the execservers → fylr pipe path alone: new connections wait for
their timeout, open ones stall, both ways, no reset; the uploaders and the
fylr's database and broker connections are untouched.

The rules live in one table of the root namespace's ``ip`` family, named with
this process's id (``tbchaos_<pid>``) and holding nothing but the two drops of
that one port. :meth:`PipePath.heal` deletes it, the end of
:func:`open_pipe_path` deletes it however the block ends, and
:func:`sweep_leftovers` deletes the tables of processes that no longer run
(a harness killed mid-cut).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import AsyncIterator
from typing import Final

import attrs
import trio

from tests.support.netns import RelayStatistics, serve_relay, tool

__all__ = ["PipePath", "open_pipe_path", "sweep_leftovers"]

_TABLE_PREFIX: Final = "tbchaos_"


def _nft(*args: str, stdin: str | None = None) -> str:
    nft = tool("nft")
    if nft is None:
        raise RuntimeError("nft (nftables) is missing: the pipe-path cut needs it")
    done = subprocess.run(
        [nft, *args], input=stdin, capture_output=True, text=True, check=False, timeout=30
    )
    if done.returncode != 0:
        raise RuntimeError(f"nft {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def _tables() -> list[str]:
    listing = json.loads(_nft("-j", "list", "tables", "ip"))
    return [
        item["table"]["name"]
        for item in listing.get("nftables", [])
        if "table" in item and item["table"]["name"].startswith(_TABLE_PREFIX)
    ]


def sweep_leftovers() -> list[str]:
    """Delete the cut tables of harness processes that no longer run; their names."""
    swept = []
    for name in _tables():
        match = re.fullmatch(rf"{_TABLE_PREFIX}(\d+)", name)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
            continue  # its harness still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _nft("delete", "table", "ip", name)
        swept.append(name)
    return swept


@attrs.define(eq=False)
class PipePath:
    """The relayed callback path of one fylr; :meth:`cut` and :meth:`heal` it.

    Attributes:
        port: the relay's port on 127.0.0.1 (the fylr's callback base).
        relay: what the relay carried.
        cut_now: whether the path is cut.
    """

    port: int
    relay: RelayStatistics
    cut_now: bool = False

    @property
    def table(self) -> str:
        return f"{_TABLE_PREFIX}{os.getpid()}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        """Drop every packet to and from the relay's port (no reset: a silent cut)."""
        if self.cut_now:
            raise RuntimeError("the pipe path is already cut")
        _nft(
            "-f",
            "-",
            stdin=f"""table ip {self.table} {{
  counter dropped {{ }}
  chain output {{
    type filter hook output priority 0; policy accept;
    ip daddr 127.0.0.1 tcp dport {self.port} counter name dropped drop
    ip saddr 127.0.0.1 tcp sport {self.port} counter name dropped drop
  }}
}}
""",
        )
        self.cut_now = True

    def dropped(self) -> int:
        """How many packets the cut in place has dropped so far."""
        if not self.cut_now:
            raise RuntimeError("the pipe path is not cut")
        listing = json.loads(_nft("-j", "list", "counter", "ip", self.table, "dropped"))
        dropped = 0
        for item in listing.get("nftables", []):
            counter = item.get("counter")
            if counter and counter.get("name") == "dropped":
                dropped = int(counter["packets"])
        return dropped

    def heal(self) -> int:
        """Undo :meth:`cut`; how many packets it dropped."""
        dropped = self.dropped()
        _nft("delete", "table", "ip", self.table)
        self.cut_now = False
        return dropped


@contextlib.asynccontextmanager
async def open_pipe_path(target_port: int) -> AsyncIterator[PipePath]:
    """A relay on 127.0.0.1 to ``127.0.0.1:target_port``, for the block; never left cut."""
    await trio.to_thread.run_sync(sweep_leftovers)
    [listener] = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    path: PipePath | None = None
    try:
        async with trio.open_nursery() as nursery:
            relay: RelayStatistics = await nursery.start(
                serve_relay, listener, None, ("127.0.0.1", target_port)
            )
            path = PipePath(port=port, relay=relay)
            try:
                yield path
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if path is not None and path.cut_now:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(path.heal)
