"""Remote sources over the real fylr: ``PUT /eas/rput``, the copy step, files left on their remote.

A real PostgreSQL, the fylr in-process, real execservers with coreutils, and
real HTTP servers on loopback (:mod:`tests.support.remote`) that answer from a
script: the file, a redirect, 503 or 429 with ``Retry-After``, 404, a dropped
or cut connection, or nothing at all. The blocklist is the default one with
``127.0.0.1`` opened for the test's own server (as the demo opens it); a
server on ``127.0.0.2`` (loopback too, still blocked) stands for what must
never be reached, and must see no connection. Host names and DNS rebinding are
tested where the test controls the resolver
(``tests/daemons/test_remote_fetch.py``, ``tests/network/test_remote_names.py``).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
from trio_broker_daemons.fylr.app import FylrHandle
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.remote import DEFAULT_BLOCKED_HOSTS

from tests.daemons.test_fylr import (
    TEXT,
    TEXT_CLASS,
    WAIT,
    download,
    ended,
    fylr_mapping,
    rows,
    running_execserver,
    running_fylr,
    settled,
    sha256_line,
    stored_files,
)
from tests.support.remote import (
    RemoteServer,
    Reply,
    answer,
    http_date,
    open_listener,
    serve_remote,
)

OPENED = {"allowed_hosts": ["127.0.0.1"]}
"""The default blocklist with the test's own loopback address let through."""
PLAIN_CLASS: dict[str, Any] = {"extensions": ["bin"]}
"""A class without metadata or versions: its files need no execserver."""


@asynccontextmanager
async def remote_server(host: str = "127.0.0.1") -> AsyncIterator[tuple[RemoteServer, str]]:
    """A scripted HTTP server on ``host``; yields it and its base URL."""
    server = RemoteServer()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_remote, await open_listener(host), server)
        try:
            yield server, f"http://{host}:{port}"
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def remote_fylr(
    pg_dsn: str,
    tmp_path: Path,
    *,
    rput: Mapping[str, Any] = OPENED,
    execserver: bool = True,
    classes: Mapping[str, Any] | None = None,
    **extra: Any,
) -> AsyncIterator[tuple[FylrHandle, httpx.AsyncClient]]:
    """A fylr with remote sources configured (and an execserver unless told otherwise)."""
    classes = {"text": TEXT_CLASS, "plain": PLAIN_CLASS} if classes is None else classes
    async with contextlib.AsyncExitStack() as stack:
        address = "127.0.0.1:1"  # replaced, or unused: no execserver
        if execserver:
            handle = await stack.enter_async_context(running_execserver())
            address = f"{handle.host}:{handle.port}"
        mapping = fylr_mapping(pg_dsn, tmp_path / "state", address, classes, rput=dict(rput))
        if not execserver:
            mapping["execservers"] = []
        mapping.update(extra)
        fylr = await stack.enter_async_context(running_fylr(FylrConfig.from_mapping(mapping)))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=fylr.url, timeout=WAIT))
        yield fylr, http


async def rput(http: httpx.AsyncClient, url: str, **params: Any) -> httpx.Response:
    return await http.put("/eas/rput", params={"url": url, **params})


async def registered(http: httpx.AsyncClient, url: str, **params: Any) -> dict[str, Any]:
    response = await rput(http, url, **params)
    assert response.status_code == 201, response.text
    document: dict[str, Any] = response.json()
    return document


def queue_row(dsn: str, file_id: int) -> tuple[str, str, str | None]:
    """(action, status, last_error) of a file's one queue row."""
    (found,) = rows(
        dsn, f"SELECT action, status, last_error FROM broker_queue WHERE file_ref = '{file_id}'"
    )
    return found[0], found[1], found[2]


async def waiting_notice(http: httpx.AsyncClient, file_id: int) -> dict[str, Any]:
    """The document once its error carries why it waits (each request waits for a change)."""
    with trio.fail_after(WAIT):
        while True:
            document: dict[str, Any] = (
                await http.get(f"/api/v1/eas/{file_id}", params={"wait": "5"})
            ).json()
            if document["error"]:
                return document


# -- copied in ---------------------------------------------------------------------------------


async def test_a_remote_file_is_copied_in_and_goes_on_as_an_upload(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The copy stores the remote bytes hashed; metadata and versions follow as for an upload."""
    async with remote_server() as (server, base), remote_fylr(pg_dsn, tmp_path) as (fylr, http):
        server.script("/docs/notes.txt", answer(TEXT, content_type="text/plain"))
        created = await registered(http, f"{base}/docs/notes.txt", priority=2)
        assert created["filename"] == "notes.txt"  # from the URL
        assert created["state"] == "copy"
        assert created["status"] == "processing"
        assert created["url"] is None  # nothing to download yet
        assert created["remote"] == {
            "url": f"{base}/docs/notes.txt",
            "leave_on_remote": False,
            "checked_at": None,
        }
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        assert document["hash"] == {"sha256": hashlib.sha256(TEXT).hexdigest()}
        assert document["filesize"] == len(TEXT)
        assert document["metadata"] == {"mimetype": "text/plain"}
        assert document["remote"]["checked_at"] is not None
        assert {n: v["status"] for n, v in document["versions"].items()} == dict.fromkeys(
            ("gz", "sha256", "gz_sha256"), "done"
        )
        assert await download(http, created["id"], "original") == TEXT
        assert gzip.decompress(await download(http, created["id"], "gz")) == TEXT
        assert await download(http, created["id"], "sha256") == sha256_line(TEXT)
        (request,) = server.requests
        assert request.host == base.removeprefix("http://")  # the URL's host, as sent
        assert fylr.statistics().steps["copy.ok"] == 1


async def test_the_copy_needs_no_execserver(pg_dsn: str, tmp_path: Path) -> None:
    """The copy is local I/O: with no execserver at all, a file of a class without steps ends."""
    async with (
        remote_server() as (server, base),
        remote_fylr(pg_dsn, tmp_path, execserver=False) as (fylr, http),
    ):
        data = bytes(range(256)) * 40
        server.script("/blob.bin", answer(data))
        created = await registered(http, f"{base}/blob.bin", filename="named.bin")
        assert created["filename"] == "named.bin"
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        assert document["mimetype"] == "application/octet-stream"  # the answer's, no guess
        assert await download(http, created["id"], "original") == data
        stats = fylr.statistics().dispatcher
        assert stats is not None
        assert stats.peak_exec_in_flight == 0


# -- the blocklist -------------------------------------------------------------------------------


async def test_blocked_addresses_are_refused_at_registration(pg_dsn: str, tmp_path: Path) -> None:
    """Loopback, the metadata address, private, IPv6 loopback and a blocked name: 400, one
    line naming the rule; nothing recorded, nothing connected."""
    blocked_names = {"blocked_hosts": [*DEFAULT_BLOCKED_HOSTS, "*.internal"], **OPENED}
    async with (
        remote_server("127.0.0.2") as (secret, secret_base),
        remote_fylr(pg_dsn, tmp_path, rput=blocked_names, execserver=False) as (_, http),
    ):
        refused = {
            f"{secret_base}/secret": "url: 127.0.0.2 is in rput.blocked_hosts (127.0.0.0/8)",
            "http://169.254.169.254/latest/meta-data/": (
                "url: 169.254.169.254 is in rput.blocked_hosts (169.254.0.0/16)"
            ),
            "http://10.1.2.3/x": "url: 10.1.2.3 is in rput.blocked_hosts (10.0.0.0/8)",
            "http://[::1]:8080/x": "url: ::1 is in rput.blocked_hosts (::1/128)",
            "http://[::ffff:127.0.0.2]/x": "url: 127.0.0.2 is in rput.blocked_hosts (127.0.0.0/8)",
            "http://0.0.0.0/x": "url: 0.0.0.0 is in rput.blocked_hosts (0.0.0.0/8)",
            "http://metadata.Google.internal/x": (
                "url: the host metadata.google.internal is in rput.blocked_hosts (*.internal)"
            ),
        }
        for url, line in refused.items():
            response = await rput(http, url)
            assert (response.status_code, response.json()) == (400, {"error": line}), url
        assert secret.connections == 0
        assert rows(pg_dsn, "SELECT count(*) FROM files") == [(0,)]
        assert rows(pg_dsn, "SELECT count(*) FROM broker_queue") == [(0,)]


async def test_bad_registrations_are_refused_naming_the_parameter(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Each bad query is a 400 naming what is wrong; nothing is recorded."""
    async with remote_fylr(pg_dsn, tmp_path, execserver=False) as (_, http):
        cases: dict[tuple[tuple[str, str], ...], str] = {
            (): "url: required (the remote file's http or https URL)",
            (("url", "ftp://127.0.0.1/x"),): (
                "url: expected an http or https URL, got 'ftp://127.0.0.1/x'"
            ),
            (("url", "http://user:pw@127.0.0.1/x"),): (
                "url: credentials in the URL are not accepted"
            ),
            (("url", "http://127.0.0.1/a b"),): "url: expected no spaces or control characters",
            (("url", "http:///x"),): "url: expected a host",
            (("url", "http://127.0.0.1/x"), ("priority", "high")): (
                "priority: expected an integer, got 'high'"
            ),
            (("url", "http://127.0.0.1/x"), ("leave_on_remote", "yes")): (
                "leave_on_remote: expected 1 or 0, got 'yes'"
            ),
            (("url", "http://127.0.0.1/x"), ("filename", "")): (
                "filename: expected 1 to 1000 characters"
            ),
        }
        for params, line in cases.items():
            response = await http.put("/eas/rput", params=dict(params))
            assert (response.status_code, response.json()) == (400, {"error": line}), params
        too_long = "http://127.0.0.1/" + "x" * 4100
        response = await rput(http, too_long)
        assert response.json() == {"error": "url: expected at most 4096 characters"}
        assert rows(pg_dsn, "SELECT count(*) FROM files") == [(0,)]


async def test_a_redirect_to_a_blocked_address_fails_the_copy(pg_dsn: str, tmp_path: Path) -> None:
    """The allowed server redirects to 127.0.0.2: the copy fails for good with the rule's line,
    and the blocked server sees no connection."""
    async with (
        remote_server() as (server, base),
        remote_server("127.0.0.2") as (secret, secret_base),
        remote_fylr(pg_dsn, tmp_path, execserver=False) as (fylr, http),
    ):
        secret.script("/key", answer(b"the secret\n"))
        server.script("/file.bin", Reply(status=302, headers={"location": f"{secret_base}/key"}))
        created = await registered(http, f"{base}/file.bin")
        document = await ended(http, created["id"])
        where = secret_base.removeprefix("http://")
        line = f"a redirect to {where}: 127.0.0.2 is in rput.blocked_hosts (127.0.0.0/8)"
        assert document["status"] == "failed"
        assert document["error"] == f"copy: {line}"
        await settled(fylr)
        action, status, last_error = queue_row(pg_dsn, created["id"])
        assert (action, status) == ("copy", "failed")
        assert last_error is not None
        assert line in last_error
        assert secret.connections == 0
        assert fylr.statistics().steps["copy.error"] == 1


# -- the answers ---------------------------------------------------------------------------------


async def test_503_with_retry_after_is_asked_again_after_it(pg_dsn: str, tmp_path: Path) -> None:
    """503 with ``Retry-After: 2``, then 200: asked again two seconds later (not after the
    minute of ``retry_delay``), the wait's reason in the file meanwhile, then done."""
    async with (
        remote_server() as (server, base),
        remote_fylr(pg_dsn, tmp_path, execserver=False, retry_delay="60s") as (fylr, http),
    ):
        data = b"available at last\n" * 100
        server.script("/busy.bin", answer(b"busy\n", 503, retry_after="2"), answer(data))
        created = await registered(http, f"{base}/busy.bin")
        waiting = await waiting_notice(http, created["id"])
        assert waiting["state"] == "copy"
        assert waiting["error"] == (
            "the remote answered 503 Service Unavailable; asked again in 2 s"
        )
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        assert document["error"] is None
        assert await download(http, created["id"], "original") == data
        first, second = server.seen("/busy.bin")
        assert second.at - first.at >= 2.0
        assert fylr.statistics().steps["copy.requeued"] == 1


async def test_429_with_an_http_date_is_asked_again_at_that_date(
    pg_dsn: str, tmp_path: Path
) -> None:
    """429 whose ``Retry-After`` is an HTTP date three seconds ahead (whole seconds: at least
    two from now): the second request comes no earlier."""
    async with (
        remote_server() as (server, base),
        remote_fylr(pg_dsn, tmp_path, execserver=False, retry_delay="60s") as (fylr, http),
    ):
        server.script(
            "/limited.bin",
            answer(b"slow down\n", 429, retry_after=http_date(time.time() + 3)),
            answer(b"data\n"),
        )
        created = await registered(http, f"{base}/limited.bin")
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        first, second = server.seen("/limited.bin")
        assert second.at - first.at >= 1.9
        assert fylr.statistics().steps["copy.requeued"] == 1


async def test_404_fails_the_copy_for_good_and_a_requeue_copies_it(
    pg_dsn: str, tmp_path: Path
) -> None:
    """404: failed at once, one request, the row failed with the status; once the file is
    there, the operator's requeue copies it."""
    async with (
        remote_server() as (server, base),
        remote_fylr(pg_dsn, tmp_path, execserver=False) as (fylr, http),
    ):
        created = await registered(http, f"{base}/missing.bin")
        document = await ended(http, created["id"])
        assert document["status"] == "failed"
        assert document["error"] == "copy: the remote answered 404 Not Found"
        await settled(fylr)
        action, status, last_error = queue_row(pg_dsn, created["id"])
        assert (action, status) == ("copy", "failed")
        assert last_error == "RemoteSourceFailed: the remote answered 404 Not Found"
        assert len(server.seen("/missing.bin")) == 1
        server.script("/missing.bin", answer(b"here now\n"))
        requeued = (await http.post("/inspect/system/fylr/requeue")).json()["requeued"]
        assert [item["action"] for item in requeued] == ["copy"]
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        assert await download(http, created["id"], "original") == b"here now\n"


async def test_a_server_that_never_answers_is_temporary_until_the_give_up(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A server that reads the request and never answers: each attempt times out and is
    requeued, until ``give_up_after`` since the copy was queued; then the copy fails with
    the last reason."""
    rput_config = {**OPENED, "timeout": "0.5s", "give_up_after": "3s"}
    async with (
        remote_server() as (server, base),
        remote_fylr(pg_dsn, tmp_path, rput=rput_config, execserver=False, retry_delay="0.5s") as (
            fylr,
            http,
        ),
    ):
        server.script("/silent.bin", Reply(fault="hang"))
        created = await registered(http, f"{base}/silent.bin")
        document = await ended(http, created["id"])
        assert document["status"] == "failed"
        assert document["error"] == (
            "copy: gave up after 3s: the remote did not answer within 0.5 s (ReadTimeout)"
        )
        assert len(server.seen("/silent.bin")) >= 2
        steps = fylr.statistics().steps
        assert steps["copy.requeued"] >= 1
        assert steps["copy.error"] == 1


async def test_dropped_and_cut_connections_are_temporary(pg_dsn: str, tmp_path: Path) -> None:
    """A connection closed before the answer, then one cut in mid-body: both requeued, the
    third copy stores the whole file (nothing of the cut one is kept)."""
    async with (
        remote_server() as (server, base),
        remote_fylr(pg_dsn, tmp_path, execserver=False) as (fylr, http),
    ):
        data = b"0123456789abcdef" * 5000
        server.script(
            "/flaky.bin", Reply(fault="drop"), Reply(body=data, fault="cut"), answer(data)
        )
        created = await registered(http, f"{base}/flaky.bin")
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        assert await download(http, created["id"], "original") == data
        assert len(server.seen("/flaky.bin")) == 3
        assert fylr.statistics().steps["copy.requeued"] == 2
        assert len(stored_files(tmp_path / "state")) == 1  # the whole copy, no leftovers


async def test_a_remote_file_over_max_upload_size_fails(pg_dsn: str, tmp_path: Path) -> None:
    """``max_upload_size`` holds for copies: a larger remote file fails the copy, naming it."""
    async with (
        remote_server() as (server, base),
        remote_fylr(pg_dsn, tmp_path, execserver=False, max_upload_size=1000) as (_, http),
    ):
        server.script("/big.bin", answer(b"x" * 2000))
        created = await registered(http, f"{base}/big.bin")
        document = await ended(http, created["id"])
        assert document["error"] == "copy: the remote file is larger than 1000 bytes"
        assert stored_files(tmp_path / "state") == []


# -- left on the remote ----------------------------------------------------------------------------


async def test_a_file_left_on_its_remote_gets_metadata_and_versions_from_its_bytes(
    pg_dsn: str, tmp_path: Path
) -> None:
    """``leave_on_remote=1`` with ``reference_steps: all``: nothing is stored of the original,
    its metadata and versions are made from the remote bytes (fed by the fylr), its bytes
    identified once, and the URL checked again before it is done."""
    rput_config = {**OPENED, "reference_steps": "all"}
    async with (
        remote_server() as (server, base),
        remote_fylr(pg_dsn, tmp_path, rput=rput_config) as (fylr, http),
    ):
        server.script("/notes.txt", answer(TEXT))
        created = await registered(http, f"{base}/notes.txt", leave_on_remote="1")
        assert created["remote"]["leave_on_remote"] is True
        assert created["state"] == "new"  # its metadata step comes first
        document = await ended(http, created["id"])
        assert document["status"] == "done", document
        assert document["url"] is None
        assert document["hash"] == {"sha256": hashlib.sha256(TEXT).hexdigest()}
        assert document["filesize"] == len(TEXT)
        assert document["metadata"] == {"mimetype": "text/plain"}
        assert {n: v["status"] for n, v in document["versions"].items()} == dict.fromkeys(
            ("gz", "sha256", "gz_sha256"), "done"
        )
        assert gzip.decompress(await download(http, created["id"], "gz")) == TEXT
        assert await download(http, created["id"], "sha256") == sha256_line(TEXT)
        original = await http.get(f"/api/v1/eas/download/{created['id']}/original")
        assert original.status_code == 404
        assert not (tmp_path / "state" / "files" / "originals").exists() or not any(
            (tmp_path / "state" / "files" / "originals").rglob("*.*")
        )
        # metadata, the bytes' identity at sync, gz and sha256, the check before done
        assert len(server.seen("/notes.txt")) == 5
        assert fylr.statistics().steps["sync.ok"] == 2


async def test_a_file_left_on_its_remote_whose_url_disappears_ends_error(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The metadata step reads the remote; then the URL answers 404 before the end of sync:
    the file ends ``error`` with the reason; once the URL answers again, a requeue ends it."""
    rput_config = {**OPENED, "reference_steps": "metadata"}
    async with (
        remote_server() as (server, base),
        remote_fylr(pg_dsn, tmp_path, rput=rput_config) as (fylr, http),
    ):
        server.script("/notes.txt", answer(TEXT), answer(b"gone\n", 404))
        created = await registered(http, f"{base}/notes.txt", leave_on_remote="1")
        document = await ended(http, created["id"])
        assert document["status"] == "failed"
        assert document["error"] == (
            "the remote no longer answers: the remote answered 404 Not Found"
        )
        assert document["metadata"] == {"mimetype": "text/plain"}  # read before it vanished
        assert document["versions"] == {}  # reference_steps: metadata makes none
        await settled(fylr)
        assert queue_row(pg_dsn, created["id"])[:2] == ("sync", "failed")
        server.script("/notes.txt", answer(TEXT))
        await http.post("/inspect/system/fylr/requeue")
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        assert document["error"] is None
        assert document["remote"]["checked_at"] is not None


async def test_a_bare_reference_is_checked_and_done(pg_dsn: str, tmp_path: Path) -> None:
    """``reference_steps: none`` (the default): no metadata, no versions, one check at sync."""
    async with (
        remote_server() as (server, base),
        remote_fylr(pg_dsn, tmp_path) as (_, http),
    ):
        server.script("/notes.txt", answer(TEXT))
        created = await registered(http, f"{base}/notes.txt", leave_on_remote="1")
        assert created["state"] == "sync"
        document = await ended(http, created["id"])
        assert (document["status"], document["metadata"], document["versions"]) == ("done", {}, {})
        assert document["hash"] is None  # its bytes were never read whole
        assert len(server.seen("/notes.txt")) == 1


async def test_a_reference_whose_url_keeps_failing_is_given_up(pg_dsn: str, tmp_path: Path) -> None:
    """503 at every check of a reference: requeued after ``Retry-After`` until the remote has
    been failing for ``give_up_after``, then the file ends ``error`` with the last reason."""
    rput_config = {**OPENED, "give_up_after": "1s"}
    async with (
        remote_server() as (server, base),
        remote_fylr(pg_dsn, tmp_path, rput=rput_config) as (_, http),
    ):
        server.script("/notes.txt", answer(b"busy\n", 503, retry_after="0"))
        created = await registered(http, f"{base}/notes.txt", leave_on_remote="1")
        document = await ended(http, created["id"])
        assert document["error"] == (
            "the remote no longer answers: gave up after 1s:"
            " the remote answered 503 Service Unavailable"
        )
        assert len(server.seen("/notes.txt")) >= 2
