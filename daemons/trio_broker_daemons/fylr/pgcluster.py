"""A private PostgreSQL cluster in a folder: the embedded default, and the tests' database.

Theory of operation
===================

:class:`PgCluster` owns one folder::

    <folder>/data        the data directory (initdb runs once; later starts reuse it)
    <folder>/run         the unix socket directory
    <folder>/postgres.log the server log
    <folder>/password    the password of the ``postgres`` role over TCP (mode 0600)

It finds ``initdb`` and ``pg_ctl`` on ``PATH`` or under
``/usr/lib/postgresql/<version>/bin`` (the newest version wins), and raises
:class:`PostgresNotFound`, which says how to install PostgreSQL or how to use an
existing server instead, when there are none.

PostgreSQL refuses to run as root. When this process runs as root, the folder
is handed to the ``postgres`` system user and every command runs as that user
(through ``runuser``, or ``su`` when there is no ``runuser``); every folder above
it must then be searchable by that user, which :meth:`PgCluster.start` checks
first.

The server listens on its unix socket and on 127.0.0.1 only, on a port that was
free when it started (or the one given). Over the socket the local superuser
``postgres`` is trusted (the socket directory is private to the cluster's
owner); over TCP it needs the generated password. :attr:`PgCluster.dsn` uses the
socket, :attr:`PgCluster.tcp_dsn` the TCP port.

Settings that change from start to start (port, addresses, socket directory, and
the caller's ``settings``) are written to ``data/trio_broker.conf``, which the
main configuration includes; nothing goes through a shell. A server still
running from an earlier start (its owner was killed) is adopted: its port and
socket come from ``postmaster.pid``.

One owner. :func:`open_pg_cluster` (the fylr's embedded database) first locks
the folder (:class:`ClusterOwner`: an exclusive ``flock`` on ``<folder>/owner``,
held for the life of the process and released by the kernel however it ends,
``kill -9`` included). A second process on the same folder, another fylr with
the same ``state_dir``, does not get the lock and refuses to start with one
line naming the process that holds it (:class:`PgClusterBusy`); it never
touches the server. The owner stops the server when it is done only if it is
its own: one it started, or one that the last owner started (the lock file
records the postmaster's pid) and left running when it was killed. A server
that somebody else started on the folder is used and left running.

Everything here blocks (it runs once at start-up); :func:`open_pg_cluster` runs
it in a worker thread for trio code.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pwd
import re
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal

import trio
from psycopg.conninfo import make_conninfo

__all__ = [
    "DEFAULT_SEARCH",
    "ClusterOwner",
    "PgCluster",
    "PgClusterBusy",
    "PgClusterError",
    "PostgresNotFound",
    "find_pg_bin",
    "free_port",
    "open_pg_cluster",
]

DEFAULT_SEARCH: tuple[str, ...] = ("/usr/lib/postgresql/*/bin",)
"""Glob patterns searched for ``initdb``/``pg_ctl`` when they are not on ``PATH``."""

SUPERUSER = "postgres"
"""The cluster's superuser role (and the system user it runs as under root)."""

log = logging.getLogger("trio_broker_daemons.fylr.pgcluster")

CONF_NAME = "trio_broker.conf"
OWNER_NAME = "owner"
"""The lock file of the folder's owner (:class:`ClusterOwner`)."""
START_TIMEOUT = 60
STOP_TIMEOUT = 60
SOCKET_PATH_MAX = 107
"""The longest unix socket path the kernel takes (``sun_path`` less its NUL)."""


class PgClusterError(RuntimeError):
    """The private cluster could not be set up, started or stopped."""


class PostgresNotFound(PgClusterError):
    """No PostgreSQL server binaries (``initdb``, ``pg_ctl``) were found."""


class PgClusterBusy(PgClusterError):
    """Another process owns the cluster's folder (:class:`ClusterOwner`)."""


def _version_key(path: Path) -> tuple[int, ...]:
    # /usr/lib/postgresql/15/bin -> (15,); unparsable names sort first
    numbers = re.findall(r"\d+", path.parent.name)
    return tuple(int(n) for n in numbers) or (-1,)


def find_pg_bin(search: Iterable[str] = DEFAULT_SEARCH, *, path: str | None = None) -> Path:
    """The directory that holds ``initdb``, ``pg_ctl`` and ``postgres``.

    Args:
        search: glob patterns tried, newest version first, when ``PATH`` has none.
        path: the ``PATH`` to look in (default: this process's).

    Returns:
        The directory.

    Raises:
        PostgresNotFound: neither ``PATH`` nor ``search`` has them; the message
            says how to install PostgreSQL or configure a DSN instead.
    """
    found = shutil.which("pg_ctl", path=path)
    if found is not None:
        bin_dir = Path(found).resolve().parent
        if (bin_dir / "initdb").exists():
            return bin_dir
    candidates: list[Path] = []
    for pattern in search:
        root = Path(pattern).anchor or "."
        relative = str(Path(pattern).relative_to(root)) if Path(pattern).is_absolute() else pattern
        candidates.extend(p for p in Path(root).glob(relative) if p.is_dir())
    for bin_dir in sorted(candidates, key=_version_key, reverse=True):
        if all(os.access(bin_dir / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres")):
            return bin_dir
    where = ", ".join(search) or "nowhere else"
    raise PostgresNotFound(
        "no PostgreSQL server binaries found (initdb and pg_ctl are neither on PATH nor "
        f"under {where}): install them (Debian/Ubuntu: apt-get install postgresql; "
        "Fedora: dnf install postgresql-server; macOS: brew install postgresql), "
        "or configure a database DSN (for example "
        "'postgresql://user:password@dbhost/dbname') to use an existing server instead "
        "of a private cluster"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _conf_quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


class PgCluster:
    """A private PostgreSQL cluster in ``folder`` (see the module docstring).

    Args:
        folder: where the cluster lives; created if missing.
        bin_dir: the directory of ``initdb``/``pg_ctl``; found with
            :func:`find_pg_bin` when ``None``.
        search: glob patterns for :func:`find_pg_bin`.
        port: the TCP port; ``None`` picks a free one at every start.
        settings: extra server settings (``{"fsync": "off"}``), written to the
            cluster's configuration at every start.

    Use it as a context manager (start, then stop at the end) or call
    :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        bin_dir: str | os.PathLike[str] | None = None,
        search: Sequence[str] = DEFAULT_SEARCH,
        port: int | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.folder = Path(folder).absolute()
        self._bin_dir = Path(bin_dir) if bin_dir is not None else None
        self._search = tuple(search)
        self._fixed_port = port
        self._settings = dict(settings or {})
        self._port: int | None = None
        self._socket_dir: Path | None = None
        self._own_socket_dir: Path | None = None
        self._runas: pwd.struct_passwd | None = None
        self.adopted = False
        """Whether :meth:`start` found the server running (it did not start it)."""

    # -- paths and identity ------------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        return self.folder / "data"

    @property
    def log_file(self) -> Path:
        return self.folder / "postgres.log"

    @property
    def password_file(self) -> Path:
        return self.folder / "password"

    @property
    def port(self) -> int:
        """The TCP port the running server listens on.

        Raises:
            PgClusterError: the cluster is not started.
        """
        if self._port is None:
            raise PgClusterError("the cluster is not started")
        return self._port

    @property
    def socket_dir(self) -> Path:
        """The directory of the server's unix socket."""
        if self._socket_dir is None:
            raise PgClusterError("the cluster is not started")
        return self._socket_dir

    @property
    def dsn(self) -> str:
        """A libpq connection string to the ``postgres`` database over the unix socket."""
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        """A connection string to ``dbname`` over the unix socket, as ``postgres``."""
        return make_conninfo(
            host=str(self.socket_dir), port=self.port, user=SUPERUSER, dbname=dbname
        )

    @property
    def tcp_dsn(self) -> str:
        """A connection string over 127.0.0.1, with the generated password."""
        return make_conninfo(
            host="127.0.0.1",
            port=self.port,
            user=SUPERUSER,
            password=self.password_file.read_text().strip(),
            dbname="postgres",
        )

    @property
    def postmaster_pid(self) -> int | None:
        """The server's process id (``postmaster.pid``), ``None`` when it is not running."""
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            return int(first)
        except (OSError, ValueError):
            return None

    @property
    def running(self) -> bool:
        """Whether a server runs on the data directory right now."""
        if not (self.data_dir / "postmaster.pid").exists():
            return False
        result = self._pg_ctl(["status"], check=False)
        return result.returncode == 0

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> PgCluster:
        """Create the cluster if needed, then start it (or adopt a running one).

        Returns:
            self, started.

        Raises:
            PostgresNotFound: no server binaries.
            PgClusterError: the folder is unusable, initdb failed, or the server
                did not start (the message holds the end of its log).
        """
        if self._bin_dir is None:
            self._bin_dir = find_pg_bin(self._search)
        self._prepare_folder()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        if (self.data_dir / "postmaster.pid").exists() and self.running:
            self._adopt()
            self.adopted = True
            return self
        self.adopted = False
        attempts = 1 if self._fixed_port is not None else 3
        for attempt in range(attempts):
            port = self._fixed_port or self._port or free_port()
            self._write_conf(port)
            result = self._pg_ctl(
                ["start", "-w", "-t", str(START_TIMEOUT), "-l", str(self.log_file)], check=False
            )
            if result.returncode == 0:
                self._port = port
                return self
            self._port = None  # maybe taken meanwhile: pick another
            if attempt == attempts - 1:
                raise PgClusterError(
                    f"PostgreSQL did not start in {self.folder} (pg_ctl exit status "
                    f"{result.returncode}): {result.stderr.strip()}\n{self._log_tail()}"
                )
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop the server (fast mode: sessions are disconnected). Idempotent."""
        try:
            if self._bin_dir is not None and self.running:
                result = self._pg_ctl(["stop", "-w", "-t", str(STOP_TIMEOUT), "-m", "fast"])
                if result.returncode != 0:
                    raise PgClusterError(f"pg_ctl stop failed: {result.stderr.strip()}")
        finally:
            if self._own_socket_dir is not None:
                shutil.rmtree(self._own_socket_dir, ignore_errors=True)
                self._own_socket_dir = None
            self._socket_dir = None

    def restart(self, *, mode: Literal["fast", "immediate"] = "fast") -> None:
        """Stop, then start again on the same port (tests: a database restart).

        Args:
            mode: ``"fast"`` stops cleanly (sessions are disconnected) and starts
                anew; ``"immediate"`` is ``pg_ctl restart -m immediate``: the server
                stops without a checkpoint, as after a crash, and recovers from its
                write-ahead log on the way up.

        Raises:
            PgClusterError: the server is not running, or did not come back.
        """
        if mode == "fast":
            port = self.port
            self.stop()
            self._port = port
            self.start()
            return
        if self._bin_dir is None or not self.running:
            raise PgClusterError("restart(mode='immediate') needs a running server")
        args = ["restart", "-m", "immediate", "-w", "-t", str(STOP_TIMEOUT)]
        result = self._pg_ctl([*args, "-l", str(self.log_file)])
        if result.returncode != 0:
            raise PgClusterError(f"pg_ctl restart failed: {result.stderr.strip()}")

    def ensure_database(self, dbname: str) -> str:
        """Create ``dbname`` unless it exists; return its connection string."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,))
            if exists.fetchone() is None:
                with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        return self.dsn_for(dbname)

    def __enter__(self) -> PgCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------------

    def _prepare_folder(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            try:
                self._runas = pwd.getpwnam(SUPERUSER)
            except KeyError:
                raise PgClusterError(
                    "running as root, but there is no 'postgres' system user to run "
                    "PostgreSQL as (it refuses to run as root): create one "
                    "(useradd --system postgres), install the distribution's "
                    "postgresql package, or configure a database DSN instead"
                ) from None
            self._check_reachable()
            os.chown(self.folder, self._runas.pw_uid, self._runas.pw_gid)
        self.folder.chmod(0o700)

    def _check_reachable(self) -> None:
        assert self._runas is not None
        uid, gid = self._runas.pw_uid, self._runas.pw_gid
        groups = {gid} | set(os.getgrouplist(self._runas.pw_name, gid))
        for parent in self.folder.parents:
            st = parent.stat()
            if st.st_uid == uid:
                ok = bool(st.st_mode & stat.S_IXUSR)
            elif st.st_gid in groups:
                ok = bool(st.st_mode & stat.S_IXGRP)
            else:
                ok = bool(st.st_mode & stat.S_IXOTH)
            if not ok:
                raise PgClusterError(
                    f"the 'postgres' user cannot reach {self.folder}: {parent} is not "
                    f"searchable by it (mode {stat.S_IMODE(st.st_mode):04o}); use a folder "
                    f"it can reach, or allow it (chmod o+x {parent})"
                )

    def _command(self, argv: Sequence[str]) -> list[str]:
        if self._runas is None:
            return list(argv)
        runuser = shutil.which("runuser") or shutil.which("runuser", path="/usr/sbin:/sbin")
        if runuser is not None:
            return [runuser, "-u", SUPERUSER, "--", *argv]
        su = shutil.which("su") or "/bin/su"
        import shlex

        return [su, SUPERUSER, "-s", "/bin/sh", "-c", shlex.join(argv)]

    def _run(self, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, LC_ALL="C", LANG="C")
        env.pop("PGDATA", None)
        result = subprocess.run(
            self._command(argv),
            cwd=self.folder,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if check and result.returncode != 0:
            raise PgClusterError(
                f"{Path(argv[0]).name} failed (exit status {result.returncode}): "
                f"{(result.stderr or result.stdout).strip()}"
            )
        return result

    def _pg_ctl(
        self, args: Sequence[str], *, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        assert self._bin_dir is not None
        return self._run(
            [str(self._bin_dir / "pg_ctl"), "-D", str(self.data_dir), *args], check=check
        )

    def _chown(self, path: Path) -> None:
        if self._runas is not None:
            os.chown(path, self._runas.pw_uid, self._runas.pw_gid)

    def _initdb(self) -> None:
        assert self._bin_dir is not None
        if self.data_dir.exists() and any(self.data_dir.iterdir()):
            raise PgClusterError(
                f"{self.data_dir} exists but holds no PostgreSQL cluster (no PG_VERSION): "
                "remove it or choose another folder"
            )
        password = secrets.token_urlsafe(24)
        fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        self._chown(self.password_file)
        self._run(
            [
                str(self._bin_dir / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                SUPERUSER,
                "-E",
                "UTF8",
                "--no-locale",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                f"--pwfile={self.password_file}",
            ]
        )
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# settings of each start, written by trio_broker\n"
                f"include_if_exists = '{CONF_NAME}'\n"
            )

    def _pick_socket_dir(self, port: int) -> Path:
        run = self.folder / "run"
        if len(f"{run}/.s.PGSQL.{port}") <= SOCKET_PATH_MAX:
            run.mkdir(exist_ok=True)
            self._chown(run)
            run.chmod(0o700)
            return run
        # the folder's path is too long for a unix socket: use a short private one
        short = Path(tempfile.mkdtemp(prefix="tbpg-"))
        self._chown(short)
        self._own_socket_dir = short
        return short

    def _write_conf(self, port: int) -> None:
        if self._own_socket_dir is not None:
            shutil.rmtree(self._own_socket_dir, ignore_errors=True)
            self._own_socket_dir = None
        self._socket_dir = self._pick_socket_dir(port)
        lines = {
            "port": str(port),
            "listen_addresses": _conf_quote("127.0.0.1"),
            "unix_socket_directories": _conf_quote(str(self._socket_dir)),
            "unix_socket_permissions": "0700",
        }
        for key, value in self._settings.items():
            lines[key] = value if re.fullmatch(r"[\w.\-]+", value) else _conf_quote(value)
        conf = self.data_dir / CONF_NAME
        conf.write_text("".join(f"{key} = {value}\n" for key, value in lines.items()))
        self._chown(conf)

    def _adopt(self) -> None:
        # postmaster.pid: pid, data dir, start time, port, socket dir, listen address, ...
        lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        try:
            self._port = int(lines[3])
            self._socket_dir = Path(lines[4].split(",")[0].strip())
        except (IndexError, ValueError):
            raise PgClusterError(
                f"a server runs on {self.data_dir} but its postmaster.pid is unreadable"
            ) from None

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])


class ClusterOwner:
    """The one owner of a cluster's folder: an exclusive lock on ``<folder>/owner``.

    The lock file also records the owner's process id (for the message of a
    second process) and the pid of the server a fylr started (so that the next
    owner knows a server left running by a killed predecessor for a fylr's own).

    Args:
        folder: the cluster's folder (created if missing).
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder).absolute()
        self.path = self.folder / OWNER_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or say who holds it.

        Raises:
            PgClusterBusy: another process holds it (the text names its pid).
            PgClusterError: the lock file cannot be made.
        """
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise PgClusterError(f"cannot lock {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._recorded(fd, "pid")
            os.close(fd)
            who = "another process" if holder is None else f"process {holder}"
            raise PgClusterBusy(
                f"the private PostgreSQL in {self.folder} is in use by {who} (another fylr"
                " with the same state_dir): stop it, or give each fylr a state_dir of its own"
            ) from None
        self._fd = fd

    def started_by_owner(self, postmaster_pid: int | None) -> bool:
        """Whether the server of ``postmaster_pid`` was started by an owner of this folder."""
        assert self._fd is not None, "acquire() first"
        return postmaster_pid is not None and self._recorded(self._fd, "postmaster") == (
            postmaster_pid
        )

    def record(self, postmaster_pid: int | None) -> None:
        """Write this process's pid and the pid of the server it owns (``None``: none)."""
        assert self._fd is not None, "acquire() first"
        text = f"pid {os.getpid()}\npostmaster {postmaster_pid or '-'}\n".encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text, 0)

    def release(self) -> None:
        """Give the folder up (closing the file drops the lock). Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def _recorded(fd: int, key: str) -> int | None:
        try:
            text = os.pread(fd, 256, 0).decode("ascii", "replace")
        except OSError:
            return None
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.isdigit():
                return int(value)
        return None


def _start_owned(cluster: PgCluster, owner: ClusterOwner) -> bool:
    """Lock the folder, start (or adopt) the server; whether it is this owner's to stop."""
    owner.acquire()
    try:
        cluster.start()
    except BaseException:
        owner.release()
        raise
    pid = cluster.postmaster_pid
    ours = not cluster.adopted or owner.started_by_owner(pid)
    if cluster.adopted:
        log.info(
            "adopted the PostgreSQL server running in %s (pid %s): %s",
            cluster.folder,
            pid,
            "a killed fylr started it, it is stopped at the end"
            if ours
            else "somebody else started it, it is left running",
        )
    owner.record(pid if ours else None)
    return ours


@contextlib.asynccontextmanager
async def open_pg_cluster(
    folder: str | os.PathLike[str],
    *,
    bin_dir: str | os.PathLike[str] | None = None,
    port: int | None = None,
    settings: Mapping[str, str] | None = None,
) -> AsyncIterator[PgCluster]:
    """Own a :class:`PgCluster` and start it in a worker thread; stop it at the end if it
    is this process's (see *One owner* in the module docstring).

    Args:
        folder, bin_dir, port, settings: as for :class:`PgCluster`.

    Yields:
        The started cluster.

    Raises:
        PgClusterBusy: another process owns the folder.
        PostgresNotFound: no server binaries.
        PgClusterError: it could not be started.
    """
    cluster = PgCluster(folder, bin_dir=bin_dir, port=port, settings=settings)
    owner = ClusterOwner(folder)
    ours = await trio.to_thread.run_sync(_start_owned, cluster, owner)
    try:
        yield cluster
    finally:
        with trio.CancelScope(shield=True):
            try:
                if ours:
                    await trio.to_thread.run_sync(cluster.stop)
            finally:
                owner.release()
