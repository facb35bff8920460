"""Numbered schema migrations, applied once by whichever server starts first.

Migrations are SQL files named ``NNN_name.sql`` (the library's own in
``trio_broker/trio/migrations``, loaded with :mod:`importlib.resources`).
:func:`apply_migrations` applies the ones a database lacks inside one
transaction holding ``pg_advisory_xact_lock`` and records each in
``schema_migrations`` by scope and version: several servers starting at once
apply each migration exactly once, and a second run does nothing. The
library's scope is ``queue``; an application brings its own tables as
migrations of its own scope (``open_store(migrations=...)``), numbered
independently.
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Sequence
from importlib.resources.abc import Traversable
from typing import Final

import attrs
import psycopg
from psycopg.rows import TupleRow

__all__ = [
    "MIGRATION_LOCK",
    "QUEUE_SCOPE",
    "Migration",
    "apply_migrations",
    "load_migrations",
    "pending_migrations",
]

Connection = psycopg.Connection[TupleRow]

MIGRATION_LOCK: Final = 0x7472_696F_6272_6B01
"""The advisory lock key held while migrations are checked and applied."""

MIGRATION_NAME = re.compile(r"^(\d+)_([\w\-]+)\.sql$")


@attrs.frozen(kw_only=True)
class Migration:
    """One numbered schema migration of one scope.

    Attributes:
        scope: whose schema it changes: ``"queue"`` for this library's tables,
            another name for an application's own tables (the reference fylr's
            are ``"fylr"``). Versions count separately per scope.
        version: its number within the scope.
        name: its file name.
        sql: the statements.
    """

    scope: str
    version: int
    name: str
    sql: str


QUEUE_SCOPE: Final = "queue"
"""The scope of the library's own migrations (``broker_queue``, ``broker_backends``)."""


# -- migrations ----------------------------------------------------------------------------


def load_migrations(
    folder: Traversable | None = None, *, scope: str = QUEUE_SCOPE
) -> list[Migration]:
    """The migrations in ``folder`` (files named ``NNN_name.sql``), by version.

    Args:
        folder: where to look; the library's own ``trio_broker/trio/migrations`` by
            default. Other files are ignored.
        scope: the scope the migrations belong to.

    Raises:
        ValueError: two files share a version number.
    """
    if folder is None:
        folder = importlib.resources.files("trio_broker.trio").joinpath("migrations")
    found: dict[int, Migration] = {}
    for entry in folder.iterdir():
        match = MIGRATION_NAME.match(entry.name)
        if match is None:
            continue
        version = int(match.group(1))
        if version in found:
            raise ValueError(
                f"migrations {found[version].name!r} and {entry.name!r} share version {version}"
            )
        found[version] = Migration(
            scope=scope, version=version, name=entry.name, sql=entry.read_text("utf-8")
        )
    return [found[v] for v in sorted(found)]


def _ensure_migrations_table(conn: Connection) -> None:
    """Create ``schema_migrations``, or give an older one (without scopes) its scope."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " scope text NOT NULL,"
        " version integer NOT NULL,"
        " name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now(),"
        " PRIMARY KEY (scope, version))"
    )
    scoped = conn.execute(
        "SELECT 1 FROM information_schema.columns"
        " WHERE table_name = 'schema_migrations' AND column_name = 'scope'"
        " AND table_schema = current_schema()"
    ).fetchone()
    if scoped is None:
        # Releases before scopes numbered the fylr's files table as queue version 2.
        conn.execute(
            b"ALTER TABLE schema_migrations ADD COLUMN scope text NOT NULL DEFAULT 'queue';"
            b" ALTER TABLE schema_migrations DROP CONSTRAINT schema_migrations_pkey;"
            b" UPDATE schema_migrations SET scope = 'fylr', version = 1"
            b"  WHERE version = 2 AND name = '002_files.sql';"
            b" ALTER TABLE schema_migrations ADD PRIMARY KEY (scope, version);"
            b" ALTER TABLE schema_migrations ALTER COLUMN scope DROP DEFAULT"
        )


def apply_migrations(
    conn: Connection, migrations: Sequence[Migration] | None = None
) -> list[tuple[str, int]]:
    """Apply the migrations ``conn``'s database lacks, in one locked transaction.

    Safe to run from several processes at once: they queue on an advisory lock,
    and each migration is applied exactly once and recorded in
    ``schema_migrations`` under its scope and version.

    Args:
        conn: a connection (autocommit or not; it must not be inside a transaction).
        migrations: what to apply, in order; the library's own by default.

    Returns:
        ``(scope, version)`` of each migration applied now (empty when the schema
        was up to date).
    """
    if migrations is None:
        migrations = load_migrations()
    applied_now: list[tuple[str, int]] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        _ensure_migrations_table(conn)
        done = set(conn.execute("SELECT scope, version FROM schema_migrations").fetchall())
        for migration in migrations:
            key = (migration.scope, migration.version)
            if key in done:
                continue
            # several statements in one call: no parameters, so the simple protocol
            conn.execute(migration.sql.encode("utf-8"))
            conn.execute(
                "INSERT INTO schema_migrations (scope, version, name) VALUES (%s, %s, %s)",
                (*key, migration.name),
            )
            applied_now.append(key)
    return applied_now


def pending_migrations(
    conn: Connection, migrations: Sequence[Migration] | None = None
) -> list[Migration]:
    """The migrations of ``migrations`` that ``conn``'s database has not applied (one read).

    Nothing is written or locked: a readiness check asks this of a database
    that a newer or an older server may share.

    Args:
        conn: a connection in autocommit mode.
        migrations: what should be applied; the library's own by default.

    Returns:
        The missing ones, in the given order (all of them when the database has
        no ``schema_migrations`` at all).
    """
    if migrations is None:
        migrations = load_migrations()
    try:
        done = set(conn.execute("SELECT scope, version FROM schema_migrations").fetchall())
    except psycopg.errors.UndefinedTable:
        return list(migrations)
    return [m for m in migrations if (m.scope, m.version) not in done]
