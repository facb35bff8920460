"""PostgreSQL for tests: one private cluster per test session, a fresh database per test.

The cluster runs in a temporary folder (outside pytest's own temporary
directories, which the ``postgres`` user cannot reach when the tests run as
root) with durability switched off for speed, and with ``pg_stat_statements``
loaded so tests can count the statements a component sent.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import sql
from trio_broker_daemons.fylr.pgcluster import PgCluster

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
