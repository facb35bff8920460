"""The reference daemons' wiring: configuration, logging, signals. Thin by design."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import trio

from trio_broker.config import ConfigError, ExecserverConfig
from trio_broker.execserver import ExecserverHandle, serve_execserver

__all__ = ["run_execserver"]

log = logging.getLogger("trio_broker.daemon")


async def _watch_signals(handle: ExecserverHandle) -> None:
    """First SIGTERM/SIGINT drains; a second one stops at once."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        count = 0
        async for signum in signals:
            count += 1
            name = signal.Signals(signum).name
            if count == 1:
                log.info("%s: draining (send it again to stop at once)", name)
                handle.drain()
            else:
                log.info("%s again: stopping running jobs now", name)
                handle.stop()


async def _execserver_main(config: ExecserverConfig, ready_file: Path | None) -> None:
    async with trio.open_nursery() as nursery:
        handle: ExecserverHandle = await nursery.start(serve_execserver, config)
        nursery.start_soon(_watch_signals, handle)
        if ready_file is not None:
            await trio.Path(ready_file).write_text(f"{handle.host} {handle.port}\n")
        await handle.wait_closed()
        nursery.cancel_scope.cancel()


def run_execserver(config_path: str, *, ready_file: str | None = None) -> int:
    """``trio-broker execserver --config FILE``: returns the exit status.

    A configuration problem prints one line naming the key path and returns 2.
    A drained execserver returns 0.
    """
    try:
        config = ExecserverConfig.from_yaml(config_path)
    except ConfigError as exc:
        where = "" if exc.file else f"{config_path}: "
        print(f"trio-broker execserver: {where}{exc}", file=sys.stderr)
        return 2
    trio.run(_execserver_main, config, Path(ready_file) if ready_file else None)
    return 0
