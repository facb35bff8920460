"""A whole installation for tests: fylrs on one database, execservers, a real HAProxy.

:func:`open_installation` starts, in one nursery and on 127.0.0.1:

- ``direct`` execservers that every fylr dials by address (``exec-a`` …), and
  ``balanced`` more behind one HAProxy (tcp mode, round-robin) that every fylr
  dials as one address;
- ``fylrs`` fylr servers on one PostgreSQL database, started one after the
  other, each waiting until it reached every address, so the balancer's
  round-robin hands the first fylr the first replica, the second the next;
- with ``callback_balancer``, a second HAProxy in front of the first fylr that
  the *last* fylr names as its ``callback_own_url``: the callback checks of its
  connections reach the first fylr and fail with a mismatch, as a callback base
  behind a balancer of several fylrs does. (The last fylr is added to that
  balancer's rotation once it has started, so it fronts several replicas.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_broker_daemons.fylr.app import FylrHandle, serve_fylr
from trio_broker_daemons.fylr.config import FylrConfig

from tests.support.haproxy import HAProxy, open_haproxy
from trio_broker.trio.execserver import ExecserverHandle

WAIT = 60.0

SERVICES: dict[str, Any] = {
    "noop": {"builtin": "noop"},
    "hold": {"builtin": "sleep"},
    "sha256": {"argv": ["sha256sum"]},
}


@attrs.frozen(kw_only=True)
class Installation:
    """What :func:`open_installation` started.

    Attributes:
        direct: the execservers the fylrs dial by their own address.
        balanced: the execservers behind ``balancer``.
        balancer: the HAProxy in front of ``balanced`` (None without any).
        fylrs: the fylr servers, in the order they started.
        callback_balancer: the HAProxy in front of the fylrs (None unless asked for).
    """

    direct: tuple[ExecserverHandle, ...]
    balanced: tuple[ExecserverHandle, ...]
    balancer: HAProxy | None
    fylrs: tuple[FylrHandle, ...]
    callback_balancer: HAProxy | None

    @property
    def execservers(self) -> tuple[ExecserverHandle, ...]:
        return self.direct + self.balanced


def execserver_config(name: str, **overrides: Any) -> ExecserverConfig:
    data: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "name": name,
        "slots": 2,
        "fast_reserve": 0,
        "unknown_share": 1.0,
        "services": SERVICES,
    }
    data.update(overrides)
    return ExecserverConfig.from_mapping(data)


def fylr_config(
    dsn: str, state_dir: Path, name: str, addresses: list[str], **extra: Any
) -> FylrConfig:
    mapping: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "name": name,
        "state_dir": str(state_dir),
        "database": dsn,
        "database_pool": 4,
        "execservers": addresses,
        "connect_timeout": "30s",
        "retry_delay": "1s",
        "heartbeat_interval": "0.5s",
        "stale_after": "5s",
        "classes": {},
    }
    mapping.update(extra)
    return FylrConfig.from_mapping(mapping)


async def _reached_every_address(fylr: FylrHandle) -> None:
    with trio.fail_after(WAIT):
        await fylr.wait_until(
            lambda s: s.client is not None and all(a.instances for a in s.client.addresses)
        )


@contextlib.asynccontextmanager
async def open_installation(
    pg_dsn: str,
    tmp_path: Path,
    *,
    fylrs: int = 2,
    direct: int = 1,
    balanced: int = 2,
    callback_balancer: bool = False,
    execserver: Mapping[str, Any] | None = None,
    fylr: Mapping[str, Any] | None = None,
) -> AsyncIterator[Installation]:
    """Start the installation of the module docstring; stop it when the block ends.

    Args:
        pg_dsn: the shared database.
        tmp_path: where the fylrs' state folders and the balancers' files go.
        fylrs, direct, balanced: how many of each.
        callback_balancer: the last fylr's callback base is a balancer in front
            of the first one (its callback checks fail with a mismatch).
        execserver: overrides for every execserver configuration.
        fylr: overrides for every fylr configuration.
    """
    names = [f"exec-{chr(ord('a') + i)}" for i in range(direct + balanced)]
    async with trio.open_nursery() as nursery, contextlib.AsyncExitStack() as stack:
        handles: list[ExecserverHandle] = []
        for name in names:
            handle: ExecserverHandle = await nursery.start(
                serve_from_config, execserver_config(name, **(execserver or {}))
            )
            handles.append(handle)
        balancer = None
        addresses = [f"{h.host}:{h.port}" for h in handles[:direct]]
        if balanced:
            balancer = await stack.enter_async_context(
                open_haproxy(
                    [(h.host, h.port) for h in handles[direct:]], workdir=tmp_path / "haproxy"
                )
            )
            addresses.append(balancer.address)
        started: list[FylrHandle] = []
        front: HAProxy | None = None
        for index in range(fylrs):
            extra = dict(fylr or {})
            last = index == fylrs - 1
            if callback_balancer and last:
                front = await stack.enter_async_context(
                    open_haproxy([(started[0].host, started[0].port)], workdir=tmp_path / "front")
                )
                extra["callback_own_url"] = front.http_url
            config = fylr_config(
                pg_dsn, tmp_path / f"fylr-{index}", f"fylr-{index + 1}", addresses, **extra
            )
            handle_f: FylrHandle = await nursery.start(serve_fylr, config)
            started.append(handle_f)
            await _reached_every_address(handle_f)
        if front is not None:
            await front.add_backend(started[-1].host, started[-1].port)
        try:
            yield Installation(
                direct=tuple(handles[:direct]),
                balanced=tuple(handles[direct:]),
                balancer=balancer,
                fylrs=tuple(started),
                callback_balancer=front,
            )
        finally:
            for handle_f in reversed(started):
                handle_f.stop()
            with trio.fail_after(WAIT):
                for handle_f in started:
                    await handle_f.wait_closed()
            nursery.cancel_scope.cancel()
