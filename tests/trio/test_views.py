"""Backend views in a real PostgreSQL: published with the backend's row, read by anyone."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from trio_broker.trio.store import Store, open_store
from trio_broker.trio.views import publish_view, read_views


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[Store]:
    async with open_store(pg_dsn, pool_size=2) as store:
        yield store


async def test_a_view_is_published_and_read_by_everyone(store: Store) -> None:
    """Each backend's view comes back to every reader, with ages on the database's clock."""
    await store.register_backend("b1", "fylr-1")
    await store.register_backend("b2", "fylr-2")
    assert [(v.backend_id, v.view, v.view_age) for v in await read_views(store)] == [
        ("b1", None, None),
        ("b2", None, None),
    ]
    written, views = await publish_view(store, "b1", {"links": [{"to": "exec-a"}], "n": 1})
    assert written
    (first, second) = views
    assert (first.backend_id, first.name, first.view) == (
        "b1",
        "fylr-1",
        {"links": [{"to": "exec-a"}], "n": 1},
    )
    assert first.view_age is not None
    assert first.view_age >= 0.0
    assert first.heartbeat_age >= 0.0
    assert second.view is None
    await publish_view(store, "b1", {"n": 2})
    assert [v.view for v in await read_views(store)] == [{"n": 2}, None]


async def test_an_unregistered_backend_publishes_nothing(store: Store) -> None:
    """A backend without a row (never registered, or swept as stale) writes nothing."""
    written, views = await publish_view(store, "ghost", {"n": 1})
    assert not written
    assert views == []
    await store.register_backend("b1", "fylr-1")
    await store.unregister_backend("b1")
    written, _ = await publish_view(store, "b1", {"n": 1})
    assert not written
