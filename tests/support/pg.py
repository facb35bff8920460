"""PostgreSQL for tests: one private cluster per test session, a fresh database per test.

The cluster runs in a temporary folder (outside pytest's own temporary
directories, which the ``postgres`` user cannot reach when the tests run as
root) with durability switched off for speed, and with ``pg_stat_statements``
loaded so tests can count the statements a component sent.

A test that fails a server over makes a cluster of its own (:func:`own_cluster`)
and a streaming replica of it (:func:`streaming_replica`): a real standby made
by ``pg_basebackup -R`` (``standby.signal`` and ``primary_conninfo``), kept
synchronous, so that a commit the primary acknowledged is on the standby too,
and promoted with ``pg_ctl promote`` (:meth:`Replica.promote`).
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from trio_broker_daemons.fylr.pgcluster import SUPERUSER, PgCluster, PgClusterError

TEST_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "top",
}


@contextmanager
def own_cluster(**settings: str) -> Iterator[PgCluster]:
    """A PostgreSQL cluster of its own, with :data:`TEST_SETTINGS` and ``settings``
    over them, for a test that restarts or fails over its server."""
    folder = tempfile.mkdtemp(prefix="trio-broker-pg-")
    cluster = PgCluster(folder, settings={**TEST_SETTINGS, **settings})
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(folder, ignore_errors=True)


REPLICA_TIMEOUT = 60.0
"""Seconds a standby may take to catch up with its primary, or to be promoted."""


class Replica(PgCluster):
    """A streaming standby of another :class:`PgCluster` (:func:`streaming_replica`)."""

    def clone(self, primary: PgCluster) -> None:
        """Fill this cluster's data directory with ``pg_basebackup -R`` of ``primary``.

        The copy streams the write-ahead log it needs (``-X stream``) and gets
        ``standby.signal`` and a ``primary_conninfo`` naming the primary's socket,
        so it starts as a hot standby following ``primary``.
        """
        if self._bin_dir is None:
            self._bin_dir = primary._bin_dir
        self._prepare_folder()
        shutil.copy(primary.password_file, self.password_file)
        self._chown(self.password_file)
        assert self._bin_dir is not None
        self._run(
            [
                str(self._bin_dir / "pg_basebackup"),
                "--pgdata",
                str(self.data_dir),
                "--dbname",
                make_conninfo(primary.dsn, application_name=self.application_name),
                "--wal-method=stream",
                "--write-recovery-conf",
                "--checkpoint=fast",
                "--no-sync",
            ]
        )

    @property
    def application_name(self) -> str:
        """The name the standby reports to its primary (``pg_stat_replication``)."""
        return f"replica_{self.folder.name.replace('-', '_')}"

    def promote(self) -> None:
        """``pg_ctl promote``: end recovery; returns once the server takes writes.

        Raises:
            PgClusterError: the promotion failed or took longer than
                :data:`REPLICA_TIMEOUT`.
        """
        result = self._pg_ctl(["promote", "-w", "-t", str(round(REPLICA_TIMEOUT))])
        if result.returncode != 0:
            raise PgClusterError(f"pg_ctl promote failed: {result.stderr.strip()}")


def crash(cluster: PgCluster) -> None:
    """``pg_ctl stop -m immediate``: the server ends at once, as if its host failed (its
    sessions are cut, nothing is checkpointed)."""
    result = cluster._pg_ctl(["stop", "-m", "immediate", "-w", "-t", str(round(REPLICA_TIMEOUT))])
    if result.returncode != 0:
        raise PgClusterError(f"pg_ctl stop -m immediate failed: {result.stderr.strip()}")


def _wait_streaming(primary: PgCluster, replica: Replica) -> None:
    """Make ``replica`` the primary's synchronous standby and wait until it is one.

    ``synchronous_standby_names`` names it and ``synchronous_commit`` is ``on``
    (through ``ALTER SYSTEM``, which the copy did not take, so the standby once
    promoted waits for nobody): from then on the primary acknowledges a commit only
    once the standby has flushed it. Waits, bounded, until ``pg_stat_replication``
    shows the standby streaming and synchronous.
    """
    with psycopg.connect(primary.dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(
                sql.Literal(replica.application_name)
            )
        )
        conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
        conn.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + REPLICA_TIMEOUT
        while True:
            row = conn.execute(
                "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                (replica.application_name,),
            ).fetchone()
            if row == ("streaming", "sync"):
                return
            if time.monotonic() > deadline:
                raise PgClusterError(
                    f"the standby in {replica.folder} is not a streaming synchronous standby"
                    f" after {REPLICA_TIMEOUT:g} s (pg_stat_replication: {row})"
                )
            time.sleep(0.05)  # polling the server's view: no event to wait on


@contextmanager
def streaming_replica(primary: PgCluster) -> Iterator[Replica]:
    """A synchronous streaming standby of ``primary`` (running), stopped and removed at the
    end. Its databases, roles and password are the primary's; it listens on a port and a
    socket of its own."""
    folder = tempfile.mkdtemp(prefix="trio-broker-replica-")
    replica = Replica(folder, settings={**TEST_SETTINGS, "hot_standby": "on"})
    try:
        replica.clone(primary)
        replica.start()
        _wait_streaming(primary, replica)
        yield replica
    finally:
        try:
            replica.stop()
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def multi_host_dsn(dbname: str, *clusters: PgCluster, **params: str) -> str:
    """A libpq multi-host connection string to ``dbname`` naming each cluster's socket in
    turn (``host=a,b port=p,q``), with ``params`` added (``target_session_attrs=…``)."""
    return make_conninfo(
        host=",".join(str(c.socket_dir) for c in clusters),
        port=",".join(str(c.port) for c in clusters),
        user=SUPERUSER,
        dbname=dbname,
        **params,
    )


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """The session's private PostgreSQL cluster (started once)."""
    with own_cluster() as cluster:
        yield cluster


@pytest.fixture
def pg_dsn(pg_cluster: PgCluster) -> Iterator[str]:
    """A connection string to a database of this test's own, dropped afterwards."""
    name = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(pg_cluster.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield pg_cluster.dsn_for(name)
    finally:
        with psycopg.connect(pg_cluster.dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
