"""A dispatcher in a process of its own, for the multi-process dispatcher tests.

Run: ``python -m tests.support.dispatch_worker --dsn DSN --backend-id ID [--mode noop|stall]``.

It serves one local-bound action, ``noop``, and reports on stdout, one line each:

- ``ready`` once the dispatcher is registered and claiming;
- ``handled <id> <attempts>`` when a handler has done its (no-op) work
  (``--mode noop``), or ``holding <id> <attempts>`` when a handler started and
  blocks for ever (``--mode stall``: its rows stay claimed until the process dies).

SIGTERM or SIGINT stops it the ordinary way (rows it holds go back to the queue)
and it exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys

import trio

from trio_broker.trio.dispatcher import Action, DispatcherConfig, serve_dispatcher
from trio_broker.trio.store import QueueItem, open_store


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> None:
    async def noop(item: QueueItem) -> None:
        say(f"handled {item.id} {item.attempts}")

    async def stall(item: QueueItem) -> None:
        say(f"holding {item.id} {item.attempts}")
        await trio.sleep_forever()

    config = DispatcherConfig(
        backend_id=args.backend_id,
        name=args.backend_id,
        tick_interval=args.tick,
        heartbeat_interval=args.heartbeat,
        stale_after=args.stale_after,
        local_workers=args.local_workers,
    )
    action = Action("noop", False, stall if args.mode == "stall" else noop)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with (
            open_store(args.dsn, pool_size=args.pool_size, migrate=True) as store,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(serve_dispatcher, store, [action], config)
            say("ready")
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.support.dispatch_worker")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--backend-id", required=True)
    parser.add_argument("--mode", choices=("noop", "stall"), default="noop")
    parser.add_argument("--local-workers", type=int, default=8)
    parser.add_argument("--pool-size", type=int, default=4)
    parser.add_argument("--tick", type=float, default=0.2)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--stale-after", type=float, default=60.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse(sys.argv[1:]))
