"""The remote fetcher against real HTTP servers on loopback, with a resolver the test controls.

Names resolve through the :data:`~trio_broker_daemons.fylr.fetch.Resolver` the
test gives (its answers can change between two lookups, as a rebinding DNS
server's do); the connections, redirects and answers are real. The system
resolver on a DNS server the test runs is ``tests/network/test_remote_names.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import httpx
import pytest
import trio
from trio_broker_daemons.fylr.fetch import RemoteFetcher, Unresolvable
from trio_broker_daemons.fylr.remote import (
    DEFAULT_BLOCKED_HOSTS,
    MAX_REDIRECTS,
    HostPolicy,
    RemoteRefused,
    RemoteSourceFailed,
)

from tests.support.remote import RemoteServer, Reply, answer, open_listener, serve_remote

POLICY = HostPolicy.from_entries(DEFAULT_BLOCKED_HOSTS, ["127.0.0.1"])


class Zone:
    """A resolver the test controls: each name's answers, one list per lookup (the last repeats)."""

    def __init__(self, answers: dict[str, list[list[str]]]) -> None:
        self.answers = answers
        self.lookups: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        found = self.answers.get(host)
        if not found:
            raise Unresolvable(f"cannot resolve {host}: no such name")
        return found.pop(0) if len(found) > 1 else found[0]


@asynccontextmanager
async def servers(*hosts: str) -> AsyncIterator[list[tuple[RemoteServer, int]]]:
    """One scripted server per address; yields each with its port."""
    async with trio.open_nursery() as nursery:
        started = []
        for host in hosts:
            server = RemoteServer()
            port = await nursery.start(serve_remote, await open_listener(host), server)
            started.append((server, port))
        try:
            yield started
        finally:
            nursery.cancel_scope.cancel()


async def body(fetcher: RemoteFetcher, url: str) -> tuple[int, bytes]:
    async with fetcher.get(httpx.URL(url)) as response:
        return response.status_code, b"".join([c async for c in response.aiter_raw()])


def fetcher(zone: Zone | None = None, policy: HostPolicy = POLICY) -> RemoteFetcher:
    return RemoteFetcher(policy, timeout=5.0, resolver=zone)


async def test_a_name_is_connected_at_its_checked_address_and_keeps_its_host_header() -> None:
    """The resolver's address is the one connected to; the request still names the host."""
    async with servers("127.0.0.1") as [(server, port)]:
        server.script("/f", answer(b"content"))
        zone = Zone({"files.test": [["127.0.0.1"]]})
        assert await body(fetcher(zone), f"http://files.test:{port}/f") == (200, b"content")
        assert [r.host for r in server.requests] == [f"files.test:{port}"]
        assert zone.lookups == ["files.test"]


async def test_a_name_that_rebinds_to_a_blocked_address_is_refused_at_the_connection() -> None:
    """Allowed at the first lookup (registration), blocked at the second (the fetch): the
    connection is refused, and the blocked server sees nothing."""
    async with servers("127.0.0.1", "127.0.0.2") as [(server, port), (secret, _)]:
        server.script("/f", answer(b"content"))
        zone = Zone({"rebind.test": [["127.0.0.1"], ["127.0.0.2"]]})
        remote = fetcher(zone)
        await remote.check(httpx.URL(f"http://rebind.test:{port}/f"))  # first lookup: fine
        with pytest.raises(RemoteRefused) as info:
            await body(remote, f"http://rebind.test:{port}/f")
        assert info.value.line == (
            "rebind.test resolves to 127.0.0.2, which is in rput.blocked_hosts (127.0.0.0/8)"
        )
        assert zone.lookups == ["rebind.test", "rebind.test"]
        assert server.connections == secret.connections == 0


async def test_one_blocked_address_among_several_refuses_the_name() -> None:
    """A name with an allowed and a blocked address is refused (and nothing is connected)."""
    async with servers("127.0.0.1") as [(server, port)]:
        zone = Zone({"both.test": [["127.0.0.1", "10.0.0.1"]]})
        with pytest.raises(RemoteRefused, match=r"both\.test resolves to 10\.0\.0\.1"):
            await fetcher(zone).check(httpx.URL(f"http://both.test:{port}/"))
        with pytest.raises(RemoteRefused):
            await body(fetcher(zone), f"http://both.test:{port}/")
        assert server.connections == 0


async def test_a_redirect_is_checked_like_the_first_connection() -> None:
    """A redirect to an allowed place is followed; one to a blocked name or address is
    refused, naming the hop; the blocked server sees nothing."""
    async with servers("127.0.0.1", "127.0.0.2") as [(server, port), (secret, sport)]:
        zone = Zone({"inside.test": [["127.0.0.2"]], "files.test": [["127.0.0.1"]]})
        server.script(
            "/moved", Reply(status=301, headers={"location": f"http://files.test:{port}/f"})
        )
        server.script("/f", answer(b"moved here"))
        server.script(
            "/to-ip", Reply(status=307, headers={"location": f"http://127.0.0.2:{sport}/k"})
        )
        server.script(
            "/to-name", Reply(status=302, headers={"location": f"http://inside.test:{sport}/k"})
        )
        remote = fetcher(zone)
        assert await body(remote, f"http://127.0.0.1:{port}/moved") == (200, b"moved here")
        with pytest.raises(RemoteRefused) as info:
            await body(remote, f"http://127.0.0.1:{port}/to-ip")
        assert info.value.line == (
            f"a redirect to 127.0.0.2:{sport}: 127.0.0.2 is in rput.blocked_hosts (127.0.0.0/8)"
        )
        with pytest.raises(RemoteRefused) as info:
            await body(remote, f"http://127.0.0.1:{port}/to-name")
        assert info.value.line == (
            f"a redirect to inside.test:{sport}: inside.test resolves to 127.0.0.2,"
            " which is in rput.blocked_hosts (127.0.0.0/8)"
        )
        assert secret.connections == 0  # fmt: skip


async def test_redirects_are_bounded_and_stay_on_http() -> None:
    """More than the bound, or a redirect to another scheme, fails for good."""
    async with servers("127.0.0.1") as [(server, port)]:
        for hop in range(MAX_REDIRECTS + 1):
            server.script(f"/r{hop}", Reply(status=302, headers={"location": f"/r{hop + 1}"}))
        server.script(f"/r{MAX_REDIRECTS + 1}", answer(b"too far"))
        server.script("/ftp", Reply(status=302, headers={"location": "ftp://127.0.0.1/x"}))
        remote = fetcher()
        with pytest.raises(RemoteSourceFailed, match=f"more than {MAX_REDIRECTS} redirects"):
            await body(remote, f"http://127.0.0.1:{port}/r0")
        assert await body(remote, f"http://127.0.0.1:{port}/r1") == (200, b"too far")
        with pytest.raises(RemoteSourceFailed, match="a redirect to ftp scheme, not http"):
            await body(remote, f"http://127.0.0.1:{port}/ftp")


async def test_proxies_of_the_environment_are_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy would make the connections the blocklist judges: it is ignored."""
    async with servers("127.0.0.1", "127.0.0.2") as [(server, port), (proxy, pport)]:
        server.script("/f", answer(b"direct"))
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
            monkeypatch.setenv(name, f"http://127.0.0.2:{pport}")
        assert await body(fetcher(), f"http://127.0.0.1:{port}/f") == (200, b"direct")
        assert proxy.connections == 0


async def test_a_name_that_does_not_resolve_is_named() -> None:
    """No address: the check says which name."""
    with pytest.raises(Unresolvable, match=r"cannot resolve nowhere\.test: no such name"):
        await fetcher(Zone({})).check(httpx.URL("http://nowhere.test/x"))


@pytest.mark.parametrize("fault", ["drop", "cut"])
async def test_broken_connections_surface_as_transport_errors(
    fault: Literal["drop", "cut"],
) -> None:
    """A dropped or cut answer is an httpx transport error (the step judges it temporary)."""
    async with servers("127.0.0.1") as [(server, port)]:
        server.script("/f", Reply(body=b"x" * 10000, fault=fault))
        with pytest.raises(httpx.TransportError):
            await body(fetcher(), f"http://127.0.0.1:{port}/f")
