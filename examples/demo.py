"""The demonstration behind ``make demo``: one execserver daemon, two clients.

It starts the reference daemon (``trio-broker execserver``) with two slots and a
``resize`` service that runs a real command, then connects two clients:

* a background resync that parks eight jobs at priority -2, and
* an interactive user who arrives a moment later with two jobs at priority 2.

Watch the interactive jobs take the next free slots although they came last,
the queue positions the execserver reports, the receipts of real processes, and
finally a graceful drain on SIGTERM with exit status 0.
"""

from __future__ import annotations

import signal
import sys
import time

import httpx
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from trio_broker import protocol as p
from trio_broker.testing.processes import open_execserver_process

CONFIG = """\
listen: 127.0.0.1:0
name: demo-exec
slots: 2
fast_reserve: 0
unknown_share: 1.0
services:
  resize:
    argv:
      - "{python}"
      - "-c"
      - "import sys, time; time.sleep(0.4); print('resized', sys.argv[1])"
      - "{{file}}"
    timeout: 30s
"""

T0 = time.monotonic()


def say(who: str, text: str) -> None:
    print(f"{time.monotonic() - T0:6.2f}s  {who:<12} {text}", flush=True)


async def client(url: str, who: str, priority: int, files: list[str], delay: float) -> None:
    await trio.sleep(delay)
    async with open_websocket_url(url) as ws:
        hello = p.decode(await ws.get_message())
        assert isinstance(hello, p.Hello)
        say(who, f"connected: {hello.name} has {hello.processes} slots, {hello.clients} client(s)")
        await send(ws, p.Register(backend_id=who, name=who, version="demo"))
        for name in files:
            await send(ws, p.Want(job_id=name, service="resize", priority=priority))
        pending = set(files)
        while pending:
            message = p.decode(await ws.get_message(), accept=p.EXEC_TO_CLIENT)
            if isinstance(message, p.Queued):
                await send(ws, p.Query(job_id=message.job_id))
            elif isinstance(message, p.Position):
                say(who, f"{message.job_id}: queued, {message.ahead} ahead of it, "
                         f"{message.running} running")  # fmt: skip
            elif isinstance(message, p.Offer):
                say(who, f"{message.job_id}: got a slot, starting (priority {priority})")
                await send(
                    ws,
                    p.Job(job_id=message.job_id, token=message.token, service="resize",
                          subject=message.job_id, job={"params": {"file": message.job_id}}),
                )  # fmt: skip
            elif isinstance(message, p.Done):
                r = message.receipt
                say(who, f"{message.job_id}: {r.status} in {r.duration_s:.2f}s: "
                         f"{r.stdout_prefix.strip()!r}")  # fmt: skip
                pending.discard(message.job_id)
            elif isinstance(message, p.Ping):
                await send(ws, p.Pong(nonce=message.nonce))


async def send(ws: WebSocketConnection, message: p.Message) -> None:
    await ws.send_message(p.encode(message))


async def main() -> None:
    config = CONFIG.format(python=sys.executable)
    async with open_execserver_process(config) as daemon:
        say("demo", f"execserver daemon pid {daemon.process.pid} serving {daemon.url}")
        async with trio.open_nursery() as nursery:
            files = [f"scan-{n:02d}.tif" for n in range(8)]
            nursery.start_soon(client, daemon.url, "background", -2, files, 0.0)
            uploads = ["upload-1.jpg", "upload-2.jpg"]
            nursery.start_soon(client, daemon.url, "interactive", 2, uploads, 0.3)
        async with httpx.AsyncClient() as http:
            page = (await http.get(f"{daemon.http_url}/inspect/system/execserver")).json()
        resize = page["services"]["resize"]
        say("demo", f"resize: {resize['completed']} runs, mean {resize['mean_runtime_s']:.2f}s, "
                    f"classified {resize['kind']}")  # fmt: skip
        daemon.process.send_signal(signal.SIGTERM)
        status = await daemon.process.wait()
        say("demo", f"SIGTERM: the execserver drained and exited with status {status}")
    if status != 0:
        raise SystemExit(status)


if __name__ == "__main__":
    trio.run(main)
