"""Remote sources by host name, resolved by the system's resolver on a DNS server the test runs.

The fylr daemon runs on a test host (a network namespace) whose
``/etc/resolv.conf`` names a DNS server of this test on the namespace's
loopback (:mod:`tests.support.dns`): the fylr's ``getaddrinfo`` really asks it,
and the test decides every answer, including one that changes between the
registration's lookup and the copy's (DNS rebinding). The remote file server
listens on the host's own address (``10.213.0.2``, a private address the
configuration lets through); a server holding a secret listens on the same port
of the namespace's ``127.0.0.1``, blocked by the default list: it must see no
connection.
"""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import trio
import yaml

from tests.network.test_faults import http_client
from tests.support.dns import TYPE_A, Zone, serve_dns
from tests.support.netns import Host, open_network, require_namespaces
from tests.support.processes import open_fylr_process
from tests.support.remote import RemoteServer, answer, serve_remote

FYLR_PORT = 7100
FILES_PORT = 8080
WAIT = 90.0


def fylr_config(host: Host, state_dir: Path) -> str:
    return yaml.safe_dump(
        {
            "listen": f"{host.address}:{FYLR_PORT}",
            "name": "fylr",
            "state_dir": str(state_dir),
            "database_pool": 4,
            "execservers": [],
            "insecure_open_api": True,  # no tokens, beyond loopback: a test host of its own
            "retry_delay": "1s",
            "heartbeat_interval": "0.5s",
            "stale_after": "2s",
            "rput": {"allowed_hosts": [host.address], "timeout": "5s"},
            "classes": {"plain": {"extensions": ["bin"]}},
        }
    )


async def ended(http: httpx.AsyncClient, file_id: int) -> dict[str, object]:
    """The file's document once it has ended (each request waits for a change)."""
    with trio.fail_after(WAIT):
        while True:
            response = await http.get(f"/api/v1/eas/{file_id}", params={"wait": "10"})
            document: dict[str, object] = response.json()
            if document["status"] in ("done", "failed"):
                return document


async def test_names_are_resolved_checked_and_pinned(shared_dir: Path) -> None:
    """Through the real resolver: a name that resolves to an allowed address is fetched with
    its name in ``Host``; one that resolves to a blocked address is refused at registration;
    one that resolves to a blocked address only on the second lookup fails its copy with the
    rule's line, the blocked server untouched; a name that does not resolve is a 400."""
    require_namespaces()
    zone = Zone(
        names={
            "files.test": [["10.213.0.2"]],
            "blocked.test": [["127.0.0.1"]],
            "rebind.test": [["10.213.0.2"], ["127.0.0.1"]],
        }
    )
    files, secret = RemoteServer(), RemoteServer()
    data = b"fetched by name\n" * 64
    files.script("/a.bin", answer(data))
    secret.script("/secret.bin", answer(b"the secret\n"))
    with open_network("fylr") as network:
        host = network["fylr"]
        assert host.address == "10.213.0.2"
        with host.resolv_conf("nameserver 127.0.0.1\noptions timeout:2 attempts:2\n"):
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_dns, await host.udp("127.0.0.1", 53), zone)
                for server, address in ((files, host.address), (secret, "127.0.0.1")):
                    listener = await host.listen(FILES_PORT, address=address)
                    await nursery.start(serve_remote, listener, server)
                config = fylr_config(host, shared_dir / "state")
                async with (
                    open_fylr_process(config, log_level="info", prefix=host.prefix),
                    http_client(host, FYLR_PORT) as http,
                ):
                    await _check(http, zone, files, secret, data)
                nursery.cancel_scope.cancel()


async def _check(
    http: httpx.AsyncClient,
    zone: Zone,
    files: RemoteServer,
    secret: RemoteServer,
    data: bytes,
) -> None:
    rput = functools.partial(http.put, "/eas/rput")
    # an allowed name: fetched at the address it resolved to, named in Host
    created = await rput(params={"url": f"http://files.test:{FILES_PORT}/a.bin"})
    assert created.status_code == 201, created.text
    document = await ended(http, created.json()["id"])
    assert document["status"] == "done", document
    download = await http.get(f"/api/v1/eas/download/{document['id']}/original")
    assert download.content == data
    assert [r.host for r in files.requests] == [f"files.test:{FILES_PORT}"]
    # a name that resolves to a blocked address: refused before anything is recorded
    refused = await rput(params={"url": f"http://blocked.test:{FILES_PORT}/secret.bin"})
    assert (refused.status_code, refused.json()) == (
        400,
        {
            "error": "url: blocked.test resolves to 127.0.0.1, which is in"
            " rput.blocked_hosts (127.0.0.0/8)"
        },
    )
    # allowed at the registration's lookup, blocked at the copy's: the copy fails
    created = await rput(params={"url": f"http://rebind.test:{FILES_PORT}/secret.bin"})
    assert created.status_code == 201, created.text
    document = await ended(http, created.json()["id"])
    assert document["status"] == "failed"
    assert document["error"] == (
        "copy: rebind.test resolves to 127.0.0.1, which is in rput.blocked_hosts (127.0.0.0/8)"
    )
    assert zone.a_queries("rebind.test") >= 2
    assert secret.connections == 0
    # no such name
    unknown = await rput(params={"url": "http://nowhere.test/x.bin"})
    assert unknown.status_code == 400
    assert unknown.json()["error"].startswith("url: cannot resolve nowhere.test: ")
    assert any(q.name == "nowhere.test" and q.qtype == TYPE_A for q in zone.queries)
