"""Who may do what on a real fylr: every route × every credential, links, browsers, names.

Each test runs the fylr in-process (``serve_fylr``) on a real PostgreSQL and a
real loopback listener, without execservers (nothing here needs a job), and
speaks HTTP to it, websocket upgrades included. The decisions themselves are
tested without a server in ``test_access.py``.

The matrix test walks the routes of the application the fylr really serves
(``FylrHandle.app``), so a route added later is tried the moment it exists, and
fails the test when it declares no role.
"""

from __future__ import annotations

import base64
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_broker_daemons.commands import top
from trio_broker_daemons.fylr.access import Role
from trio_broker_daemons.fylr.app import FylrHandle, serve_fylr
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.guard import GuardedRoute

from tests.support.rawhttp import UPGRADE, exchange

WAIT = 60.0

TOKENS = {"upload": "upload-secret-1", "read": "read-secret-2", "operator": "operator-secret-3"}
CREDENTIALS: dict[str, str | None] = {"none": None, "wrong": "not-a-token-of-this-fylr", **TOKENS}

MAY: dict[Role, set[str]] = {
    Role.PUBLIC: set(CREDENTIALS),
    Role.PIPE: set(CREDENTIALS),
    Role.READ: {"read", "upload", "operator"},
    Role.UPLOAD: {"upload"},
    Role.OPERATOR: {"operator"},
}
"""Which credentials each role lets through, written out: the lattice as the issue states it."""

KNOWN_ROUTES: dict[str, Role] = {
    "/eas/put": Role.UPLOAD,
    "/eas/produce": Role.UPLOAD,
    "/eas/rput": Role.UPLOAD,
    "/api/v1/eas/{file_id}": Role.READ,
    "/api/v1/eas/{file_id}/sync": Role.OPERATOR,
    "/api/v1/eas/download/{file_id}/{version}": Role.READ,
    "/api/v1/eas/download/{file_id}/custom": Role.READ,
    "/api/v1/eas/export/{file_id}": Role.READ,
    "/healthz": Role.PUBLIC,
    "/livez": Role.PUBLIC,
    "/readyz": Role.PUBLIC,
    "/inspect/system/fylr": Role.OPERATOR,
    "/inspect/system/fylr/requeue": Role.OPERATOR,
    "/inspect/system/fylr/sweep": Role.OPERATOR,
    "/inspect/system/fylr/checksum": Role.OPERATOR,
    "/inspect/system/fylr/copy_move": Role.OPERATOR,
    "/inspect/system/fylr/sync_check": Role.OPERATOR,
    "/metrics": Role.OPERATOR,
    "/inspect/system/fylr/files": Role.OPERATOR,
    "/inspect/system/fylr/files/{file_id}": Role.OPERATOR,
    "/inspect/system/fylr/files/{file_id}/retry": Role.OPERATOR,
    "/inspect/system/fylr/steps": Role.OPERATOR,
    "/inspect/system/fylr/steps/{item_id}": Role.OPERATOR,
    "/inspect/system/fylr/steps/{item_id}/cancel": Role.OPERATOR,
    "/inspect/system/fylr/steps/{item_id}/retry": Role.OPERATOR,
    "/inspect/system/queues": Role.OPERATOR,
    "/inspect/system/topology": Role.OPERATOR,
    "/inspect/system/topology/data": Role.OPERATOR,
    "/inspect/system/topology/ws": Role.OPERATOR,
    "/pipe/{pipe_id}": Role.PIPE,
    "/whoami": Role.PIPE,
}
"""The routes today and the role each must have: the matrix sees at least these (and any
route added later, with the role it declares)."""


def mapping(pg_dsn: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "listen": "127.0.0.1:0",
        "name": "access-fylr",
        "state_dir": str(tmp_path / "state"),
        "database": pg_dsn,
        "database_pool": 4,
        "execservers": [],
        "heartbeat_interval": "0.5s",
        "stale_after": "2s",
        "classes": {"text": {"extensions": ["txt"]}},
        **extra,
    }


@asynccontextmanager
async def running(pg_dsn: str, tmp_path: Path, **extra: Any) -> AsyncIterator[FylrHandle]:
    config = FylrConfig.from_mapping(mapping(pg_dsn, tmp_path, **extra))
    async with trio.open_nursery() as nursery:
        handle: FylrHandle = await nursery.start(serve_fylr, config)
        try:
            yield handle
        finally:
            handle.stop()
            with trio.fail_after(WAIT):
                await handle.wait_closed()


def auth(token: str | None) -> dict[str, str]:
    return {} if token is None else {"authorization": f"Bearer {token}"}


async def upload(http: httpx.AsyncClient, token: str | None, name: str = "a.txt") -> Any:
    response = await http.put(
        "/eas/put",
        params={"filename": name},
        content=b"some text\n",
        headers={**auth(token), "content-type": "application/octet-stream"},
    )
    assert response.status_code == 201, response.text
    return response.json()


def concrete(template: str, file_id: int) -> str:
    """A path for a route template: a real file, its original, "1" for anything else."""
    values = {"file_id": str(file_id), "version": "original", "pipe_id": "A" * 22}
    return re.sub(r"\{(\w+)(:[^}]*)?\}", lambda match: values.get(match.group(1), "1"), template)


async def status_of(
    handle: FylrHandle, route: GuardedRoute, method: str, path: str, token: str | None
) -> int:
    headers = [*auth(token).items()]
    if route.websocket:
        answers = await exchange(handle.host, handle.port, [("GET", path, (*UPGRADE, *headers))])
        return answers[0][0]
    async with httpx.AsyncClient(base_url=handle.url, timeout=WAIT) as http:
        response = await http.request(
            method,
            path,
            params={"filename": "matrix.txt"},
            content=b"matrix\n" if method in ("PUT", "POST", "DELETE") else None,
            headers={**dict(headers), "content-type": "application/octet-stream"},
        )
    return response.status_code


async def test_every_route_with_no_a_wrong_and_each_roles_token(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The matrix: every route of the real application × {no token, a wrong one, the
    upload, read and operator tokens}. A route without a declared role fails at once;
    a credential its role lets through is never 401/403; any other gets 401 (none,
    wrong) or 403 (a token of another role)."""
    async with (
        running(pg_dsn, tmp_path, tokens=TOKENS) as handle,
        httpx.AsyncClient(base_url=handle.url, timeout=WAIT) as http,
    ):
        file_id = (await upload(http, TOKENS["upload"]))["id"]
        routes = list(handle.app.routes)
        for each in routes:
            assert isinstance(each, GuardedRoute), (
                f"route {getattr(each, 'path', each)!r} declares no role: build it with"
                " trio_broker_daemons.fylr.guard.route(..., role=Role.…)"
            )
        guarded = [r for r in routes if isinstance(r, GuardedRoute)]
        assert {r.path for r in guarded} >= set(KNOWN_ROUTES)
        for each in guarded:
            assert KNOWN_ROUTES.get(each.path, each.role) is each.role, each
        tried = 0
        for each in guarded:
            methods = ["GET"] if each.websocket else sorted(each.methods - {"HEAD"})
            path = concrete(each.path, file_id)
            for method in methods:
                for name, token in CREDENTIALS.items():
                    status = await status_of(handle, each, method, path, token)
                    tried += 1
                    where = f"{method} {each.path} [{each.role.value}] with {name}: {status}"
                    if name in MAY[each.role]:
                        assert status not in (401, 403), where
                    else:
                        assert status == (401 if name in ("none", "wrong") else 403), where
        assert tried >= len(KNOWN_ROUTES) * len(CREDENTIALS)


async def test_a_configuration_with_only_the_operator_token_keeps_uploads_and_reads_open(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As in examples/fylr.yml: uploads, documents and downloads need nothing on loopback;
    the operator routes need the operator token; the start-up line names the open roles."""
    caplog.set_level(logging.INFO, logger="trio_broker_daemons.fylr.app")
    async with (
        running(pg_dsn, tmp_path, tokens={"operator": TOKENS["operator"]}) as handle,
        httpx.AsyncClient(base_url=handle.url, timeout=WAIT) as http,
    ):
        document = await upload(http, None)
        assert (await http.get(f"/api/v1/eas/{document['id']}")).status_code == 200
        assert (await http.get(f"/api/v1/eas/download/{document['id']}/original")).content == (
            b"some text\n"
        )
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics", headers=auth(TOKENS["operator"]))).status_code == 200
    (line,) = [r.getMessage() for r in caplog.records if "no token for" in r.getMessage()]
    assert line == (
        "no token for upload, read: anyone on this host may use them (the listener is on"
        " loopback only)"
    )


async def test_insecure_open_api_is_one_warning_line(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """insecure_open_api serves the roles without a token and says so in one warning."""
    caplog.set_level(logging.INFO, logger="trio_broker_daemons.fylr.app")
    async with running(pg_dsn, tmp_path, insecure_open_api=True) as handle:
        pass
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        f"insecure_open_api: anyone who can reach {handle.url} may use upload, read, operator"
        " without a token"
    ]


# -- signed links -------------------------------------------------------------------------


async def test_download_links_work_without_a_token_until_they_expire_or_change(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The document's url is a signed link: it downloads without a token (a Range header
    and a further parameter leave it valid); the same link made earlier, now expired, and
    every tampered form of it are 403; without any link, 401."""
    async with (
        running(pg_dsn, tmp_path, tokens=TOKENS, link_ttl="10m") as handle,
        httpx.AsyncClient(timeout=WAIT) as http,
    ):
        document = await upload(http_for(handle, http), TOKENS["upload"])
        url = document["url"]
        path, _, query = url.removeprefix(handle.url).partition("?")
        assert path == f"/api/v1/eas/download/{document['id']}/original"
        assert re.fullmatch(r"expires=\d+&signature=[A-Za-z0-9_-]{43}", query), query
        expires = int(query.split("&")[0].removeprefix("expires="))
        assert time.time() + 590 < expires <= time.time() + 601
        fetched = await http.get(url)
        assert (fetched.status_code, fetched.content) == (200, b"some text\n")
        ranged = await http.get(url, headers={"range": "bytes=0-3"})
        assert (ranged.status_code, ranged.content) == (206, b"some")
        assert (await http.get(url + "&page=2")).status_code == 200
        # the same link as the fylr made it twenty minutes ago: expired ten minutes ago
        access = handle.app.state.access
        old = f"{handle.url}{path}?{access.sign(path, now=time.time() - 1200)}"
        expired = await http.get(old)
        assert expired.status_code == 403
        assert re.fullmatch(r"the link expired \d+ s ago\n", expired.text), expired.text
        signature = query.split("signature=")[1]
        tampered = [
            url.replace(f"/{document['id']}/original", f"/{document['id'] + 1}/original"),
            url.replace(f"expires={expires}", f"expires={expires + 86400}"),
            url.replace(signature, signature[::-1]),
            url.split("&signature=")[0],
        ]
        for bad in tampered:
            answer = await http.get(bad)
            assert (answer.status_code, answer.text) == (
                403,
                "the link's signature does not match its path and expiry\n",
            ), bad
        assert (await http.get(f"{handle.url}{path}")).status_code == 401
        # the read token needs no link
        assert (
            await http.get(f"{handle.url}{path}", headers=auth(TOKENS["read"]))
        ).status_code == 200


def http_for(handle: FylrHandle, http: httpx.AsyncClient) -> httpx.AsyncClient:
    """``http`` with the fylr as its base URL."""
    http.base_url = httpx.URL(handle.url)
    return http


# -- browsers ------------------------------------------------------------------------------


async def test_a_cross_origin_form_post_is_refused(pg_dsn: str, tmp_path: Path) -> None:
    """What a page of another site can make a logged-in operator's browser send (a form
    post carrying the browser's Basic login) is refused: the foreign Origin (403), and a
    form body even from the fylr's own origin (415); the same request as JSON from the
    fylr's own page passes."""
    operator = "Basic " + base64.b64encode(f"admin:{TOKENS['operator']}".encode()).decode()
    async with (
        running(pg_dsn, tmp_path, tokens=TOKENS) as handle,
        httpx.AsyncClient(base_url=handle.url, timeout=WAIT) as http,
    ):
        form = {"authorization": operator, "content-type": "application/x-www-form-urlencoded"}
        foreign = await http.post(
            "/inspect/system/fylr/sweep", headers={**form, "origin": "http://evil.example"}
        )
        assert (foreign.status_code, foreign.text) == (
            403,
            "Origin 'http://evil.example' may not use this fylr (its own or allowed_origins)\n",
        )
        for kind in (
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "text/plain",
        ):
            own = await http.post(
                "/inspect/system/fylr/requeue",
                headers={"authorization": operator, "content-type": kind, "origin": handle.url},
                content=b"id=1",
            )
            assert own.status_code == 415, kind
            assert own.text.startswith("a form body (")
        sandboxed = await http.post(
            "/inspect/system/fylr/sweep", headers={**form, "origin": "null"}
        )
        assert sandboxed.status_code == 403
        passes = await http.post(
            "/inspect/system/fylr/sweep",
            headers={
                "authorization": operator,
                "content-type": "application/json",
                "origin": handle.url,
            },
            content=b"{}",
        )
        assert passes.status_code == 200, passes.text
        # the upload route is state-changing too
        refused = await http.put(
            "/eas/put",
            params={"filename": "x.txt"},
            headers={**auth(TOKENS["upload"]), "origin": "https://evil.example"},
            content=b"x",
        )
        assert refused.status_code == 403


async def test_allowed_origins_may_post(pg_dsn: str, tmp_path: Path) -> None:
    """An origin listed in allowed_origins posts like the fylr's own pages."""
    async with (
        running(
            pg_dsn, tmp_path, tokens=TOKENS, allowed_origins=["https://ui.example.com"]
        ) as handle,
        httpx.AsyncClient(base_url=handle.url, timeout=WAIT) as http,
    ):
        answer = await http.post(
            "/inspect/system/fylr/sweep",
            headers={**auth(TOKENS["operator"]), "origin": "https://ui.example.com"},
        )
        assert answer.status_code == 200


async def test_a_foreign_host_is_refused(pg_dsn: str, tmp_path: Path) -> None:
    """A Host that names another site (a page that rebound its DNS name to this listener)
    gets 421 on every route, the probe and the pipes included; IP addresses, localhost and
    allowed_hosts pass; a request without a Host is 400."""
    async with running(pg_dsn, tmp_path, allowed_hosts=["files.example.com"]) as handle:
        port = handle.port
        for path in ("/healthz", "/api/v1/eas/1", "/inspect/system/fylr", "/pipe/x", "/nowhere"):
            answers = await exchange(
                handle.host, port, [("GET", path, (("host", f"evil.example:{port}"),))]
            )
            refusal = f"Host 'evil.example:{port}' names no name of this fylr (allowed_hosts)\n"
            assert answers == [(421, refusal.encode())], path
        for good in (f"127.0.0.1:{port}", f"localhost:{port}", "files.example.com", "[::1]"):
            answers = await exchange(handle.host, port, [("GET", "/healthz", (("host", good),))])
            assert answers[0][0] == 200, good
        ws = await exchange(
            handle.host,
            port,
            [("GET", "/inspect/system/topology/ws", (*UPGRADE, ("host", "evil.example")))],
        )
        assert ws[0][0] == 421
        # HTTP/1.0 without a Host
        stream = await trio.open_tcp_stream(handle.host, port)
        async with stream:
            await stream.send_all(b"GET /healthz HTTP/1.0\r\n\r\n")
            head = b""
            with trio.fail_after(WAIT):
                while b"\r\n" not in head:
                    head += await stream.receive_some(1024)
        assert head.split(b"\r\n")[0].split(b" ")[1] == b"400"


async def test_the_topology_websocket_from_a_foreign_origin_is_refused(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The websocket streams the installation's backend ids and addresses: a page of another
    origin cannot open it, even with the operator's login; the fylr's own page can, with
    the token or with the signed link its page embeds."""
    async with running(pg_dsn, tmp_path, tokens=TOKENS) as handle:
        path = "/inspect/system/topology/ws"
        operator = ("authorization", f"Bearer {TOKENS['operator']}")

        async def upgrade(target: str, *headers: tuple[str, str]) -> tuple[int, bytes]:
            return (
                await exchange(handle.host, handle.port, [("GET", target, (*UPGRADE, *headers))])
            )[0]

        foreign = await upgrade(path, operator, ("origin", "http://evil.example"))
        assert foreign == (
            403,
            b"Origin 'http://evil.example' may not use this fylr (its own or allowed_origins)\n",
        )
        assert (await upgrade(path, operator, ("origin", handle.url)))[0] == 101
        assert (await upgrade(path, ("origin", handle.url)))[0] == 401
        async with httpx.AsyncClient(base_url=handle.url, timeout=WAIT) as http:
            page = await http.get("/inspect/system/topology", headers=dict([operator]))
        assert page.status_code == 200
        (link,) = re.findall(r'const WEBSOCKET = "([^"]+)";', page.text)
        assert link.startswith(f"{path}?expires=")
        assert (await upgrade(link, ("origin", handle.url)))[0] == 101
        assert (await upgrade(link, ("origin", "http://evil.example")))[0] == 403
        assert (await upgrade(link.replace("expires=", "expires=9"), ("origin", handle.url)))[
            0
        ] == 403


async def test_several_authorization_headers_are_400_on_the_fylr(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Two Authorization headers are refused with 400 on every route, the open ones, the
    websocket and an unknown path included, as on the execserver."""
    two = (
        ("authorization", f"Bearer {TOKENS['operator']}"),
        ("authorization", f"Bearer {TOKENS['read']}"),
    )
    several = b"several Authorization headers: send one\n"
    async with running(pg_dsn, tmp_path, tokens=TOKENS) as handle:
        for path in ("/healthz", "/metrics", "/api/v1/eas/1", "/whoami", "/nowhere"):
            answers = await exchange(handle.host, handle.port, [("GET", path, two)])
            assert answers == [(400, several)], path
        ws = await exchange(
            handle.host, handle.port, [("GET", "/inspect/system/topology/ws", (*UPGRADE, *two))]
        )
        assert ws == [(400, several)]


async def test_top_follows_the_websocket_with_the_operator_token(
    pg_dsn: str, tmp_path: Path
) -> None:
    """trio-broker top sends its token on the websocket's upgrade: with the operator token
    it follows the document (the refusals of the upgrade are the raw tests above)."""
    async with running(pg_dsn, tmp_path, tokens=TOKENS) as handle:
        seen: list[dict[str, Any]] = []
        with trio.fail_after(WAIT):
            await top.follow(handle.url, seen.append, updates=1, token=TOKENS["operator"])
        assert seen[0]["fylrs"][0]["name"] == "access-fylr"
