"""The private PostgreSQL cluster helper, with the real server binaries."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from trio_broker_daemons.fylr.pgcluster import (
    PgCluster,
    PgClusterError,
    PostgresNotFound,
    find_pg_bin,
    open_pg_cluster,
)


@pytest.fixture
def folder() -> Iterator[Path]:
    """A temporary folder the ``postgres`` user can reach (pytest's own are root-only)."""
    path = Path(tempfile.mkdtemp(prefix="trio-broker-pgtest-"))
    path.chmod(0o711)  # searchable, not listable, by the postgres user
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fake_bin(root: Path, version: str) -> Path:
    """A directory holding executables named like the server binaries (for the search only)."""
    bin_dir = root / version / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("initdb", "pg_ctl", "postgres"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_not_found_says_how_to_install_or_configure(tmp_path: Path) -> None:
    """Without binaries on PATH or in the search folders the error names both ways out."""
    with pytest.raises(PostgresNotFound) as caught:
        find_pg_bin([str(tmp_path / "nothing" / "*" / "bin")], path=str(tmp_path))
    message = str(caught.value)
    assert "apt-get install postgresql" in message
    assert "DSN" in message


def test_cluster_start_raises_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PgCluster.start raises PostgresNotFound before touching anything when nothing is found."""
    monkeypatch.setenv("PATH", str(tmp_path))
    cluster = PgCluster(tmp_path / "pg", search=[str(tmp_path / "none" / "*" / "bin")])
    with pytest.raises(PostgresNotFound):
        cluster.start()
    assert not (tmp_path / "pg").exists()


def test_search_prefers_the_newest_version(tmp_path: Path) -> None:
    """Of several installed versions the highest number wins (10 over 9)."""
    fake_bin(tmp_path, "9")
    newest = fake_bin(tmp_path, "10")
    assert find_pg_bin([str(tmp_path / "*" / "bin")], path="") == newest


def test_search_finds_the_system_binaries() -> None:
    """The default search finds a real initdb and pg_ctl on this machine."""
    bin_dir = find_pg_bin()
    assert (bin_dir / "initdb").exists()
    assert (bin_dir / "pg_ctl").exists()


def test_fresh_cluster_reuse_adopt_restart(folder: Path) -> None:
    """A new cluster starts (even in a folder too deep for a socket path), keeps its data across
    a stop and start, is adopted while running, and restarts on the same port."""
    deep = folder / ("d" * 60) / ("e" * 60)
    cluster = PgCluster(deep, settings={"fsync": "off"})
    with cluster:
        assert cluster.running
        assert not str(cluster.socket_dir).startswith(str(deep))  # fell back to a short path
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (x int)")
            conn.execute("INSERT INTO kept VALUES (42)")
        with psycopg.connect(cluster.tcp_dsn) as conn:
            assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
        twin = PgCluster(deep).start()  # the server is still running: adopted
        assert (twin.port, twin.socket_dir) == (cluster.port, cluster.socket_dir)
        port = cluster.port
        cluster.restart()
        assert cluster.port == port
        with psycopg.connect(cluster.dsn) as conn:
            assert conn.execute("SELECT x FROM kept").fetchone() == (42,)
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO kept VALUES (43)")
            cluster.restart(mode="immediate")  # as after a crash: the session is cut
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
        assert cluster.port == port
        with psycopg.connect(cluster.dsn) as conn:  # recovered from its log
            assert conn.execute("SELECT sum(x) FROM kept").fetchone() == (85,)
    with pytest.raises(PgClusterError, match="running"):
        cluster.restart(mode="immediate")
    assert not cluster.running
    cluster.stop()  # idempotent
    with PgCluster(deep) as again:  # reuses the data directory: no second initdb
        with psycopg.connect(again.dsn_for("postgres")) as conn:
            assert conn.execute("SELECT x FROM kept").fetchone() == (42,)
        dsn = again.ensure_database("fylr")
        assert again.ensure_database("fylr") == dsn
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("fylr",)


async def test_open_pg_cluster_runs_in_a_thread(folder: Path) -> None:
    """The async wrapper starts and stops a cluster without blocking trio's thread."""
    async with open_pg_cluster(folder / "pg", settings={"fsync": "off"}) as cluster:
        assert cluster.port > 0
        assert cluster.running
    assert not cluster.running


@pytest.mark.skipif(os.geteuid() != 0, reason="the postgres-user hand-over happens only as root")
def test_unreachable_folder_is_explained(tmp_path: Path) -> None:
    """As root, a folder the postgres user cannot reach is refused with what to change."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(PgClusterError, match=r"cannot reach .*chmod o\+x"):
        PgCluster(private / "pg").start()
