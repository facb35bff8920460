"""Who may do what on the fylr, decided without a server: roles, tokens, links, names, origins.

The decisions of :mod:`trio_broker_daemons.fylr.access` take the time as an
argument, so expiry is tested at chosen instants. The same rules over a real
fylr are in ``test_fylr_access.py``.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.routing import Route
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.fylr.access import GRANTS, Access, Role, Tokens, host_of
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.guard import access_of, route, undeclared

TOKENS = Tokens(upload="up-token", read="read-token", operator="op-token")
KEY = b"k" * 32
NOW = 1_700_000_000.0
PATH = "/api/v1/eas/download/7/original"


def access(tokens: Tokens = TOKENS, **extra: Any) -> Access:
    return Access(tokens=tokens, link_key=KEY, link_ttl=3600.0, **extra)


def bearer(token: str) -> str:
    return f"Bearer {token}"


# -- roles and tokens --------------------------------------------------------------------


def test_the_lattice() -> None:
    """operator and upload each cover read; neither covers the other; read covers itself."""
    assert GRANTS == {
        Role.READ: {Role.READ},
        Role.UPLOAD: {Role.UPLOAD, Role.READ},
        Role.OPERATOR: {Role.OPERATOR, Role.READ},
    }


@pytest.mark.parametrize(
    ("role", "allowed"),
    [
        (Role.READ, {"up-token", "read-token", "op-token"}),
        (Role.UPLOAD, {"up-token"}),
        (Role.OPERATOR, {"op-token"}),
        (Role.PUBLIC, {None, "wrong", "up-token", "read-token", "op-token"}),
        (Role.PIPE, {None, "wrong", "up-token", "read-token", "op-token"}),
    ],
)
def test_each_token_against_each_role(role: Role, allowed: set[str | None]) -> None:
    """No token and a wrong one are 401; a token whose role does not cover the route is 403."""
    decide = access()
    for token in (None, "wrong", "up-token", "read-token", "op-token"):
        refusal = decide.judge(role, bearer(token) if token else "")
        if token in allowed:
            assert refusal is None, (role, token)
        else:
            assert refusal is not None, (role, token)
            expected = 401 if token in (None, "wrong") else 403
            assert refusal.status == expected, (role, token, refusal)


def test_refusals_say_what_is_needed() -> None:
    """401 offers Bearer and Basic; 403 names what the token may do and the role needed."""
    decide = access()
    missing = decide.judge(Role.OPERATOR, "")
    assert missing is not None
    assert missing.text == "a token is required: the operator token"
    assert [value for _, value in missing.headers] == [
        'Bearer realm="fylr"',
        'Basic realm="fylr", charset="UTF-8"',
    ]
    wrong = decide.judge(Role.OPERATOR, bearer("nope"))
    assert wrong is not None
    assert (wrong.status, wrong.text) == (401, "the token is not one of this fylr's")
    narrow = decide.judge(Role.OPERATOR, bearer("up-token"))
    assert narrow is not None
    assert (narrow.status, narrow.text) == (
        403,
        "this token may read and upload, not operator: use the operator token",
    )
    odd = decide.judge(Role.READ, "Token read-token")
    assert odd is not None
    assert odd.status == 401
    assert odd.text.startswith("expected Authorization: Bearer <token>")


def test_basic_carries_the_token_as_its_password() -> None:
    """A browser's login sends the token as the password; the user name does not matter."""
    decide = access()

    def basic(text: str) -> str:
        return "Basic " + base64.b64encode(text.encode()).decode()

    assert decide.judge(Role.OPERATOR, basic("anyone:op-token")) is None
    assert decide.judge(Role.OPERATOR, basic(":op-token")) is None
    for refused in (basic("op-token"), basic("op-token:"), "Basic !!!", basic("x:read-token")):
        answer = decide.judge(Role.OPERATOR, refused)
        assert answer is not None
        assert answer.status in (401, 403), refused


def test_a_role_without_a_token_is_open_and_the_lattice_does_not_open_more() -> None:
    """Only operator has a token: uploads and reads need none; operator routes do. An open
    upload opens uploads only: with a read token set, reads still need one."""
    only_operator = access(Tokens(operator="op-token"))
    assert only_operator.open_roles == {Role.UPLOAD, Role.READ}
    assert only_operator.judge(Role.UPLOAD, "") is None
    assert only_operator.judge(Role.READ, "") is None
    refused = only_operator.judge(Role.OPERATOR, "")
    assert refused is not None
    assert refused.status == 401
    open_upload = access(Tokens(read="read-token", operator="op-token"))
    assert open_upload.judge(Role.UPLOAD, "") is None
    assert open_upload.judge(Role.READ, "") is not None


def test_no_two_roles_share_a_token() -> None:
    """Two roles with one token could not be told apart: the configuration names the second."""
    with pytest.raises(ConfigError) as info:
        Tokens(upload="same", operator="same")
    assert str(info.value) == "operator: expected a token of its own, got the token of upload"


# -- signed links ------------------------------------------------------------------------


def test_a_link_opens_its_path_until_it_expires() -> None:
    """A signed link needs no token until its expiry, and is 403 after it."""
    decide = access()
    query = dict(part.split("=") for part in decide.sign(PATH, now=NOW).split("&"))
    assert query["expires"] == str(int(NOW + 3600))
    assert decide.judge(Role.READ, "", path=PATH, query=query, now=NOW + 3599) is None
    expired = decide.judge(Role.READ, "", path=PATH, query=query, now=NOW + 3600)
    assert expired is not None
    assert (expired.status, expired.text) == (403, "the link expired 0 s ago")
    later = decide.judge(Role.READ, "", path=PATH, query=query, now=NOW + 7200)
    assert later is not None
    assert later.text == "the link expired 3600 s ago"
    # a token still opens the route whatever the link says
    assert (
        decide.judge(Role.READ, bearer("read-token"), path=PATH, query=query, now=NOW + 7200)
        is None
    )


@pytest.mark.parametrize(
    "tamper",
    [
        lambda path, q: ("/api/v1/eas/download/8/original", q),  # another file
        lambda path, q: ("/api/v1/eas/download/7/preview", q),  # another version
        lambda path, q: (path, {**q, "expires": str(int(q["expires"]) + 86400)}),  # longer life
        lambda path, q: (path, {**q, "signature": q["signature"][:-1] + "A"}),
        lambda path, q: (path, {**q, "signature": ""}),
        lambda path, q: (path, {"expires": q["expires"]}),
    ],
    ids=["file", "version", "expiry", "signature", "empty", "no-signature"],
)
def test_a_tampered_link_is_refused(tamper: Any) -> None:
    """Changing the path, the expiry or the signature breaks the link: 403, whatever the time."""
    decide = access()
    query = dict(part.split("=") for part in decide.sign(PATH, now=NOW).split("&"))
    path, changed = tamper(PATH, query)
    refusal = decide.judge(Role.READ, "", path=path, query=changed, now=NOW)
    assert refusal is not None
    assert (refusal.status, refusal.text) == (
        403,
        "the link's signature does not match its path and expiry",
    )


def test_a_link_from_another_key_or_a_route_without_links_opens_nothing() -> None:
    """Another fylr's key signs other links; a route that takes no links ignores them."""
    query = dict(part.split("=") for part in access().sign(PATH, now=NOW).split("&"))
    other = Access(tokens=TOKENS, link_key=b"o" * 32, link_ttl=3600.0)
    assert other.judge(Role.READ, "", path=PATH, query=query, now=NOW) is not None
    without_links = access().judge(Role.READ, "", path=PATH, query=None, now=NOW)
    assert without_links is not None
    assert without_links.status == 401
    bad = access().judge(Role.READ, "", path=PATH, query={**query, "expires": "soon"}, now=NOW)
    assert bad is not None
    assert bad.text == "the link's expires: expected Unix seconds"


# -- names and origins -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "host"),
    [
        ("127.0.0.1:7400", "127.0.0.1"),
        ("LocalHost", "localhost"),
        ("[::1]:7400", "::1"),
        ("[::1]", "::1"),
        ("fylr.example.com.", "fylr.example.com."),
        ("evil.example:80", "evil.example"),
        ("", None),
        ("a b", None),
        ("[::1", None),
        ("[nope]:1", None),
        ("host:port", None),
        ("user@host", None),
    ],
)
def test_the_host_of_a_host_header(header: str, host: str | None) -> None:
    """The host without its port, lower case; anything malformed is None."""
    assert host_of(header) == host


def test_host_names_ip_addresses_and_the_configured_names_pass() -> None:
    """IP literals always pass (a rebinding page sends its own name, never an address);
    names only when configured; ``*`` lets any through."""
    decide = access(host_names=["localhost", "fylr.example.com"])
    for good in ("127.0.0.1:1", "[::1]:1", "10.0.0.5", "localhost:7400", "FYLR.example.com"):
        assert decide.host_allowed(good), good
    for bad in ("evil.example", "fylr.example.com.evil.example", "", "local host"):
        assert not decide.host_allowed(bad), bad
    assert access(host_names=["*"]).host_allowed("anything.example")


def test_an_origin_is_the_fylrs_own_or_allowed() -> None:
    """Same scheme-less host and port as the Host asked for, or listed; "null" never passes."""
    decide = access(origins=["https://ui.example.com"])
    assert decide.origin_allowed("http://127.0.0.1:7400", "127.0.0.1:7400")
    assert decide.origin_allowed("https://ui.example.com", "127.0.0.1:7400")
    assert decide.origin_allowed("HTTPS://UI.example.com", "127.0.0.1:7400")
    for bad in ("http://evil.example", "null", "http://127.0.0.1:7401", "file://", ""):
        assert not decide.origin_allowed(bad, "127.0.0.1:7400"), bad


@given(st.text(max_size=40))
def test_no_header_text_breaks_the_decisions(text: str) -> None:
    """Whatever a client sends as Authorization, Host or Origin, the answer is a decision."""
    decide = access()
    refusal = decide.judge(Role.OPERATOR, text, path=PATH, query={"signature": text}, now=NOW)
    assert refusal is None or refusal.status in (401, 403)
    decide.host_allowed(text)
    decide.origin_allowed(text, text)


# -- the configuration --------------------------------------------------------------------


def mapping(**extra: Any) -> dict[str, Any]:
    return {"listen": "127.0.0.1:0", "execservers": [], **extra}


def test_tokens_come_from_files_and_the_environment(tmp_path: Path) -> None:
    """upload_file reads a secret file beside the configuration; a variable sets a role's token."""
    (tmp_path / "upload.token").write_text("from-a-file\n")
    config = tmp_path / "fylr.yml"
    config.write_text("listen: 127.0.0.1:0\nexecservers: []\ntokens: {upload_file: upload.token}\n")
    loaded = FylrConfig.from_yaml(
        config, environ={"TRIO_BROKER_TOKENS__OPERATOR": "from-the-environment"}
    )
    assert loaded.tokens == Tokens(upload="from-a-file", operator="from-the-environment")
    assert loaded.open_roles == ("read",)


def test_an_open_role_beyond_loopback_is_refused_unless_insecure() -> None:
    """A listener beyond loopback needs every role's token, or insecure_open_api: true."""
    with pytest.raises(ConfigError) as info:
        FylrConfig.from_mapping(mapping(listen="10.1.2.3:7400", tokens={"operator": "o"}))
    assert str(info.value) == (
        "tokens: expected a token for upload, read: listen (10.1.2.3:7400) is beyond loopback,"
        " where anyone who reaches it could use a role without a token (or set"
        " insecure_open_api: true)"
    )
    with pytest.raises(ConfigError, match="expected a token for upload, read, operator"):
        FylrConfig.from_mapping(mapping(listen="fylr-a:7400"))
    insecure = FylrConfig.from_mapping(mapping(listen="10.1.2.3:7400", insecure_open_api=True))
    assert insecure.open_roles == ("upload", "read", "operator")
    closed = {"upload": "u", "read": "r", "operator": "o"}
    assert FylrConfig.from_mapping(mapping(listen="0.0.0.0:7400", tokens=closed)).open_roles == ()
    for loopback in ("127.0.0.1:0", "[::1]:0", "localhost:7400"):
        assert FylrConfig.from_mapping(mapping(listen=loopback)).open_roles == (
            "upload",
            "read",
            "operator",
        )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"link_key": "short"}, "link_key: expected null or a key of at least 32 characters"),
        ({"link_ttl": "0"}, "link_ttl: expected a duration greater than 0"),
        ({"tokens": {"root": "x"}}, "tokens.root: unknown key"),
        ({"tokens": {"read": ""}}, "tokens.read: expected a non-empty string"),
        ({"allowed_hosts": ["http://x"]}, 'allowed_hosts[0]: expected a host name like "fylr'),
        ({"allowed_hosts": "x"}, "allowed_hosts: expected a list of host names"),
        ({"allowed_origins": ["ui.example.com"]}, "allowed_origins[0]: expected an origin like"),
        ({"allowed_origins": ["https://ui.example.com/app"]}, "allowed_origins[0]: expected an"),
        ({"insecure_open_api": "yes"}, "insecure_open_api: expected true or false"),
    ],
)
def test_bad_access_keys_name_the_key(extra: dict[str, Any], message: str) -> None:
    """Each bad access key is one line starting with its key path."""
    with pytest.raises(ConfigError) as info:
        FylrConfig.from_mapping(mapping(**extra))
    assert str(info.value).startswith(message), str(info.value)


def test_the_configured_names_and_key_reach_the_decisions() -> None:
    """allowed_hosts, the listen host, name and callback_own_url's host are answered; the
    configured link key signs (two fylrs with one key accept each other's links)."""
    config = FylrConfig.from_mapping(
        mapping(
            listen="localhost:0",
            name="Fylr-A",
            callback_own_url="http://fylr-a.internal:7400",
            allowed_hosts=["files.example.com"],
            allowed_origins=["https://ui.example.com"],
            link_key="x" * 32,
        )
    )
    decide = access_of(config)
    for name in ("localhost", "fylr-a", "fylr-a.internal", "files.example.com"):
        assert decide.host_allowed(f"{name}:7400"), name
    assert not decide.host_allowed("other.example.com")
    assert decide.origin_allowed("https://ui.example.com", "localhost:7400")
    link = dict(part.split("=") for part in access_of(config).sign(PATH, now=NOW).split("&"))
    assert decide.check_link(PATH, link["expires"], link["signature"], NOW) is None
    unkeyed = FylrConfig.from_mapping(mapping())
    assert access_of(unkeyed).check_link(PATH, link["expires"], link["signature"], NOW) is not None


def test_a_route_without_a_role_is_found() -> None:
    """The check build_app runs: a plain starlette route declares no role."""

    async def endpoint(request: Any) -> Any:
        raise AssertionError

    declared = route("/declared", endpoint, role=Role.READ)
    assert undeclared([declared, Route("/plain", endpoint)]) == ["/plain"]
    with pytest.raises(TypeError, match="role: expected a Role"):
        route("/x", endpoint, role="read")  # type: ignore[arg-type]
