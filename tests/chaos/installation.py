"""The chaos soak's installation: every daemon a real process that can be killed and restarted.

:func:`open_chaos_installation` starts, on 127.0.0.1:

- a private PostgreSQL cluster (its own folder, like the test session's);
- three execservers (``exec-a`` dialled directly, ``exec-b`` and ``exec-c``
  behind a real HAProxy), running the example converter and coreutils as
  ``examples/execserver.yml`` configures them, plus a service ``escape`` whose
  command leaves a ``setsid sleep 600`` behind (a job that tries to outlive
  itself), each with a ``temp_dir`` of its own in the work folder;
- two or more fylrs on one database and one storage folder (one ``state_dir``),
  with the classes and versions of ``examples/fylr.yml`` (its ``rput`` with
  ``127.0.0.1`` let through the blocklist, for the run's remote file server) and
  a preset ``escape`` (an on-demand rendition by the ``escape`` service).

On a **mixed** fleet (``mixed=True``) the balancer's first replica, ``exec-b``,
offers ``image_metadata`` alone, and every fylr but the first knows only the
balancer (the first also dials ``exec-a``): several clients behind one
balancer whose pods offer different services. With ``cut_fylr`` that fylr's
callback base is a relay of this process (:mod:`tests.chaos.pipepath`), so its
pipe path from the execservers can be cut alone.

Every daemon listens on a port fixed for the whole run, so a restarted one is
found at the same address (the fylrs dial ``exec-a`` and the balancer by
address; the balancer's health checks take a dead replica out and a restarted
one back). Each daemon writes its log to ``logs/NAME.log`` in the work folder,
every start appending to it.

Every job's environment carries ``TRIO_BROKER_CHAOS_RUN=<token>`` (the
execservers' ``env``), so the jobs of this run, orphans of a killed execserver
included, can be told from any other process on the machine, and
``TRIO_BROKER_CHAOS_EXEC=<name>``, the execserver that started it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import attrs
import psutil
import trio
import yaml
from trio_broker_daemons.fylr.pgcluster import PgCluster, free_port

from tests.chaos.pipepath import PipePath, open_pipe_path
from tests.support.haproxy import HAProxy, open_haproxy

__all__ = [
    "ESCAPE",
    "EXAMPLES",
    "EXEC_MARKER",
    "JOB_MARKER",
    "ChaosInstallation",
    "Daemon",
    "execserver_mapping",
    "fylr_mapping",
    "job_processes",
    "open_chaos_installation",
    "restart_database",
]

EXAMPLES: Final = Path(__file__).resolve().parents[2] / "examples"
JOB_MARKER: Final = "TRIO_BROKER_CHAOS_RUN"
"""The environment variable every job of a run carries (its value: the run's token)."""
EXEC_MARKER: Final = "TRIO_BROKER_CHAOS_EXEC"
"""The environment variable naming the execserver that started a job."""
ESCAPE: Final = "escape"
"""The service (and the fylrs' preset) whose job leaves a ``setsid sleep 600`` behind it and
copies its input to its output a little slowly, so that some run when an execserver dies."""
ESCAPE_ARGV: Final = [
    "sh",
    "-c",
    "setsid sleep 600 </dev/null >/dev/null 2>&1 & cat; sleep 2",
]
METADATA_ONLY: Final = "image_metadata"
"""The one service of ``exec-b`` on a mixed fleet."""
READY_WITHIN: Final = 120.0
STOP_WITHIN: Final = 60.0
DATABASE_SETTINGS: Final = {"max_connections": "200"}
"""Durable, unlike the test session's cluster: with ``synchronous_commit`` or ``fsync``
off an immediate restart may lose commits a fylr was told about, which no daemon can
be asked to survive."""
DRAIN_TIMEOUT: Final = 30.0
"""The execservers' ``drain_timeout``: what a drain may take before jobs are stopped."""


class DaemonError(RuntimeError):
    """A daemon did not start (its log's last lines say why)."""


@attrs.define(eq=False)
class Daemon:
    """One daemon of the installation, run as ``python -m trio_broker_daemons``.

    Attributes:
        name: ``fylr-1``, ``exec-a`` …
        command: ``fylr`` or ``execserver``.
        config: its configuration file.
        port: the port it listens on, the same for every start.
        log: the file its stderr and stdout go to.
        process: the running process, or None while it is down.
        starts: how many times it was started.
    """

    name: str
    command: Literal["fylr", "execserver"]
    config: Path
    port: int
    log: Path
    process: trio.Process | None = None
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self) -> None:
        """Start it and wait until it listens (bounded by :data:`READY_WITHIN`).

        Raises:
            DaemonError: it exited before listening, or did not listen in time.
        """
        if self.running:
            raise DaemonError(f"{self.name} is already running")
        self.starts += 1
        with tempfile.TemporaryDirectory(prefix="trio-broker-chaos-ready-") as tmp:
            ready = Path(tmp) / "ready"
            os.mkfifo(ready)
            with self.log.open("ab") as log:
                log.write(f"---- start {self.starts} of {self.name}\n".encode())
                log.flush()
                process = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "trio_broker_daemons", "--log-level", "info",
                     self.command, "--config", str(self.config), "--ready-file", str(ready)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                )  # fmt: skip
            self.process = process
            text = ""
            with trio.move_on_after(READY_WITHIN):
                text = await _read_ready(ready, process)
            with contextlib.suppress(OSError):  # release an abandoned reader, if any
                os.close(os.open(ready, os.O_WRONLY | os.O_NONBLOCK))
        if not text.strip():
            await self.kill()
            raise DaemonError(
                f"{self.name} did not start (status {process.returncode}); its log ends:\n"
                + _tail(self.log)
            )

    async def kill(self) -> int:
        """``kill -9`` it and reap it; returns its exit status."""
        process = self.process
        assert process is not None, f"{self.name} is not running"
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
        return await process.wait()

    async def terminate(self, within: float = STOP_WITHIN) -> int | None:
        """SIGTERM (a fylr stops, an execserver drains); its exit status, None if it hung.

        A daemon still running after ``within`` seconds is killed; None is returned.
        """
        process = self.process
        assert process is not None, f"{self.name} is not running"
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        with trio.move_on_after(within):
            return await process.wait()
        process.kill()
        await process.wait()
        return None


async def _read_ready(ready: Path, process: trio.Process) -> str:
    """The ready FIFO's ``HOST PORT``, or ``""`` if the process exits before writing it."""
    result: list[str] = []
    async with trio.open_nursery() as nursery:

        async def read() -> None:
            result.append(await trio.to_thread.run_sync(ready.read_text, abandon_on_cancel=True))
            nursery.cancel_scope.cancel()

        async def watch() -> None:
            await process.wait()
            with contextlib.suppress(OSError):  # unblock the reader: no writer will come
                os.close(os.open(ready, os.O_WRONLY | os.O_NONBLOCK))
            nursery.cancel_scope.cancel()

        nursery.start_soon(read)
        nursery.start_soon(watch)
    return result[0] if result else ""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def execserver_mapping(
    name: str,
    port: int,
    token: str,
    *,
    temp_dir: Path | None = None,
    services: Sequence[str] | None = None,
) -> dict[str, Any]:
    """``examples/execserver.yml`` made runnable here: this interpreter, absolute paths.

    Args:
        temp_dir: the execserver's ``temp_dir`` (None: the example's default).
        services: offer only these (None: every service of the example, and ``escape``).
    """
    document: dict[str, Any] = yaml.safe_load((EXAMPLES / "execserver.yml").read_text())
    document["services"][ESCAPE] = {"argv": list(ESCAPE_ARGV), "timeout": "1m"}
    for service in document["services"].values():
        argv = service["argv"]
        if argv[0] == "python3":
            argv[0] = sys.executable
        service["argv"] = [a.replace("{config_dir}", str(EXAMPLES)) for a in argv]
    if services is not None:
        document["services"] = {k: v for k, v in document["services"].items() if k in services}
    document.update(
        listen=f"127.0.0.1:{port}",
        name=name,
        slots=2,
        drain_timeout=f"{DRAIN_TIMEOUT:g}s",
        env={JOB_MARKER: token, EXEC_MARKER: name},
    )
    if temp_dir is not None:
        document["temp_dir"] = str(temp_dir)
    return document


def fylr_mapping(
    name: str,
    port: int,
    state_dir: Path,
    dsn: str,
    execservers: list[str],
    *,
    callback_url: str | None = None,
) -> dict[str, Any]:
    """``examples/fylr.yml`` on the shared database and storage, with short heartbeats.

    ``callback_url``: the callback base put into its jobs (None: its own listener).
    """
    document: dict[str, Any] = yaml.safe_load((EXAMPLES / "fylr.yml").read_text())
    # written elsewhere: the example's secret files stay the ones beside it
    tokens = document.get("tokens") or {}
    for key, value in tokens.items():
        if key.endswith("_file") and value is not None:
            tokens[key] = str(EXAMPLES / value)
    document.update(
        listen=f"127.0.0.1:{port}",
        name=name,
        state_dir=str(state_dir),
        database=dsn,
        database_pool=4,
        execservers=execservers,
        connect_timeout="30s",
        retry_delay="1s",
        heartbeat_interval="0.5s",
        stale_after="5s",
    )
    # the run's remote file server is on loopback: open the blocklist for it alone
    document["rput"] = {**document.get("rput", {}), "allowed_hosts": ["127.0.0.1"]}
    presets = dict(document.get("custom_version_presets") or {})
    presets[ESCAPE] = {"service": ESCAPE, "mimetype": "application/octet-stream"}
    document["custom_version_presets"] = presets
    if callback_url is not None:
        document["callback_own_url"] = callback_url
    return document


@attrs.define(eq=False)
class ChaosInstallation:
    """What :func:`open_chaos_installation` started.

    Attributes:
        cluster: the database server.
        dsn: the fylrs' database.
        fylrs: ``fylr-1``, ``fylr-2`` ….
        execservers: ``exec-a`` (direct), ``exec-b``, ``exec-c`` (balanced).
        balancer: the HAProxy in front of ``exec-b`` and ``exec-c``.
        state_dir: the fylrs' one state folder (``files/`` is the shared storage).
        token: this run's job marker value.
        temp_dirs: each execserver's ``temp_dir``.
        pipe_path: the relayed callback path of ``cut_fylr``, if one was asked for.
        cut_fylr: the fylr whose pipe path can be cut, or None.
    """

    cluster: PgCluster
    dsn: str
    fylrs: tuple[Daemon, ...]
    execservers: tuple[Daemon, ...]
    balancer: HAProxy
    state_dir: Path
    token: str
    temp_dirs: dict[str, Path] = attrs.Factory(dict)
    pipe_path: PipePath | None = None
    cut_fylr: str | None = None

    @property
    def daemons(self) -> dict[str, Daemon]:
        return {d.name: d for d in (*self.fylrs, *self.execservers)}


async def restart_database(cluster: PgCluster) -> None:
    """``pg_ctl restart -m immediate``: every session is cut, the server recovers and serves."""
    await trio.to_thread.run_sync(lambda: cluster.restart(mode="immediate"))


def job_processes(token: str, execserver: str | None = None) -> list[psutil.Process]:
    """The live processes whose environment carries this run's job marker.

    ``execserver``: only those of the jobs that execserver started.
    """
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            environ = process.environ()
            if environ.get(JOB_MARKER) != token:
                continue
            if execserver is None or environ.get(EXEC_MARKER) == execserver:
                found.append(process)
    return found


def _write(path: Path, mapping: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(mapping), sort_keys=False))
    return path


@contextlib.asynccontextmanager
async def open_chaos_installation(
    workdir: Path,
    token: str,
    *,
    fylrs: int = 2,
    mixed: bool = False,
    cut_fylr: str | None = None,
) -> AsyncIterator[ChaosInstallation]:
    """Start the installation of the module docstring in ``workdir``; stop it at the end.

    Args:
        fylrs: how many fylrs (``fylr-1`` … ``fylr-N``).
        mixed: the mixed fleet of the module docstring.
        cut_fylr: the fylr whose callback base is a relay that can be cut.

    Leaving the block stops every daemon still running with SIGTERM (killing one
    that hangs), then the balancer and the database; the database's folder (a
    temporary one the ``postgres`` user can reach) is removed.
    """
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    configs = workdir / "configs"
    configs.mkdir(exist_ok=True)
    pg_folder = tempfile.mkdtemp(prefix="trio-broker-chaos-pg-")
    cluster = PgCluster(pg_folder, settings=DATABASE_SETTINGS)
    # outside the work folder (private to this user): the jobs run as another user
    temp_root = Path(tempfile.mkdtemp(prefix="trio-broker-chaos-tmp-"))
    os.chmod(temp_root, 0o755)
    daemons: list[Daemon] = []
    try:
        await trio.to_thread.run_sync(cluster.start)
        dsn = await trio.to_thread.run_sync(cluster.ensure_database, "fylr")
        execservers = []
        temp_dirs: dict[str, Path] = {}
        for name in ("exec-a", "exec-b", "exec-c"):
            port = free_port()
            temp_dirs[name] = temp_root / name
            temp_dirs[name].mkdir()
            temp_dirs[name].chmod(0o755)
            services = [METADATA_ONLY] if mixed and name == "exec-b" else None
            mapping = execserver_mapping(
                name, port, token, temp_dir=temp_dirs[name], services=services
            )
            config = _write(configs / f"{name}.yml", mapping)
            execservers.append(Daemon(name, "execserver", config, port, logs / f"{name}.log"))
        daemons.extend(execservers)
        for daemon in execservers:
            await daemon.start()
        names = [f"fylr-{n}" for n in range(1, fylrs + 1)]
        ports = {name: free_port() for name in names}
        async with contextlib.AsyncExitStack() as stack:
            balancer = await stack.enter_async_context(
                open_haproxy(
                    [("127.0.0.1", d.port) for d in execservers[1:]], workdir=workdir / "haproxy"
                )
            )
            pipe_path = None
            if cut_fylr is not None:
                pipe_path = await stack.enter_async_context(open_pipe_path(ports[cut_fylr]))
            state_dir = workdir / "state"
            every = [execservers[0].address, balancer.address]
            started = []
            for number, name in enumerate(names):
                addresses = every if number == 0 or not mixed else [balancer.address]
                callback = pipe_path.url if pipe_path is not None and name == cut_fylr else None
                mapping = fylr_mapping(
                    name, ports[name], state_dir, dsn, addresses, callback_url=callback
                )
                config = _write(configs / f"{name}.yml", mapping)
                started.append(Daemon(name, "fylr", config, ports[name], logs / f"{name}.log"))
            daemons.extend(started)
            for daemon in started:
                await daemon.start()
            yield ChaosInstallation(
                cluster=cluster,
                dsn=dsn,
                fylrs=tuple(started),
                execservers=tuple(execservers),
                balancer=balancer,
                state_dir=state_dir,
                token=token,
                temp_dirs=temp_dirs,
                pipe_path=pipe_path,
                cut_fylr=cut_fylr,
            )
    finally:
        with trio.CancelScope(shield=True):
            for daemon in reversed(daemons):
                if daemon.running:
                    await daemon.terminate()
            await trio.to_thread.run_sync(cluster.stop)
            shutil.rmtree(pg_folder, ignore_errors=True)
            shutil.rmtree(temp_root, ignore_errors=True)
