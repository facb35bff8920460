"""Who may do what on the fylr: roles, tokens, signed links, the names it answers to.

Theory of operation
===================

Every route of the fylr's listener declares a :class:`Role`
(:mod:`trio_broker_daemons.fylr.guard` builds them) and :class:`Access` judges
each request against it. Nothing here does I/O or reads a clock: the time is
passed in, so each rule has tests of its own.

**Roles.** Three roles carry tokens (``tokens: {upload, read, operator}`` in
the configuration, :class:`Tokens`):

- ``upload`` puts files in (``PUT /eas/put`` and the routes that make content);
- ``read`` reads file documents and downloads;
- ``operator`` runs the installation: sync, requeue, sweep, cancel, delete,
  the inspection pages and their websockets, the metrics.

Two roles carry none: ``public`` (the probes: what a balancer or a platform
asks) and ``pipe`` (what the execservers call back, who hold no fylr token:
the one-time pipes, whose unguessable id in the URL is their own credential,
and ``/whoami``, the callback check).

**The lattice** (:data:`GRANTS`): a token of a wider role is accepted where a
narrower one is asked. ``operator`` ⊃ ``read``: whoever may inspect and retry
the work may look at the files it is about. ``upload`` ⊃ ``read``: an upload
answers with the file's document, and an uploading client follows its files
to their end (``trio-broker upload --wait``). ``operator`` and ``upload`` are
not comparable: the operator token lives in monitoring (Prometheus scrapes
``/metrics`` with it) and admin tools, which have no business putting content
into the pipeline (content is what the converters parse, the part most
exposed to a hostile file), and an application that uploads has no business
requeueing, deleting or sweeping.

**Open roles.** A token role without a configured token is open: its routes
need no token. That is the behaviour of a fylr without tokens, allowed only
while the listener is on loopback or ``insecure_open_api`` is set
(:class:`~trio_broker_daemons.fylr.config.FylrConfig` refuses to load
otherwise). The lattice applies to tokens only: an open ``upload`` makes
uploads open, not downloads.

**Credentials.** ``Authorization: Bearer <token>``, or ``Basic`` with the token
as the password (the user name is ignored) so that a browser can open the
operator pages: a 401 offers both schemes. The token is compared with every
configured token in constant time (all of them, whatever matches), so the
time of an answer says nothing about a token. A token that matches none is
401; one whose role does not cover the route is 403, naming the role needed.

**Signed links.** A route may also accept a signed link (downloads, the
topology websocket of the page): ``?expires=<unix seconds>&signature=<s>``
where ``s`` is the HMAC-SHA256 of the path and the expiry under the link key
(``link_key`` / ``link_key_file``; a random key per process when unset),
URL-safe base64 without padding. A link works without a token until it
expires; a link whose signature does not match the path and expiry is 403.
The signature covers the path and ``expires`` only, so a client may add a
``Range`` header or more query parameters (``&page=2``) without breaking it:
a route that reads such a parameter must treat it as chosen by anyone holding
the link.

**Names and origins.** A request whose ``Host`` names neither an IP address,
``localhost``, the listen host, the configured ``name``, the host of
``callback_own_url`` nor one of ``allowed_hosts`` is refused (421): a page of
another site that rebinds its DNS name to this listener gets nothing. A
browser's ``Origin`` (sent with state-changing requests and websocket
upgrades) must be this fylr's own (the ``Host`` it asked for) or one of
``allowed_origins``; a form body (``application/x-www-form-urlencoded``,
``multipart/form-data``, ``text/plain``: what an HTML form can post across
sites) is refused on every state-changing route.
"""

import base64
import binascii
import enum
import hashlib
import hmac
import ipaddress
import math
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Annotated, Final

import attrs

from trio_broker_daemons.config.rules import Rule, optional_token
from trio_broker_daemons.config.sources import secret_file
from trio_broker_daemons.config.values import ConfigError, show

__all__ = [
    "FORM_TYPES",
    "GRANTS",
    "TOKEN_ROLES",
    "Access",
    "Refusal",
    "Role",
    "Tokens",
    "check_host_names",
    "check_origins",
    "hidden",
    "host_of",
]


class Role(enum.Enum):
    """What a route needs (see the module docstring)."""

    PUBLIC = "public"
    PIPE = "pipe"
    READ = "read"
    UPLOAD = "upload"
    OPERATOR = "operator"


TOKEN_ROLES: Final = (Role.UPLOAD, Role.READ, Role.OPERATOR)
"""The roles that carry tokens, in the configuration's order."""

GRANTS: Final[Mapping[Role, frozenset[Role]]] = {
    Role.READ: frozenset({Role.READ}),
    Role.UPLOAD: frozenset({Role.UPLOAD, Role.READ}),
    Role.OPERATOR: frozenset({Role.OPERATOR, Role.READ}),
}
"""What a token of each role is accepted for: its own role and the narrower ones."""

FORM_TYPES: Final = frozenset(
    {"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"}
)
"""The body types an HTML form can post to another site: refused on state-changing routes."""

_LINK_CONTEXT: Final = b"trio-broker fylr link\n"
_EXPIRES: Final = re.compile(r"[0-9]{1,12}")


# -- configuration -------------------------------------------------------------------------

_Token = Annotated[str | None, Rule(optional_token)]


def hidden(secret: object) -> str:
    """The repr of a secret: whether it is set, never its text."""
    return "None" if secret is None else "'***'"


@attrs.frozen(kw_only=True)
class Tokens:
    """``tokens``: one token per role, each null (the role is open) or a string.

    Each may also be read from a file (``upload_file``, ``read_file``,
    ``operator_file``: a mounted secret) or set by a variable
    (``TRIO_BROKER_TOKENS__OPERATOR``).

    Raises:
        ConfigError: two roles with the same token (they could not be told apart).
    """

    upload: _Token = attrs.field(default=None, metadata=secret_file(), repr=hidden)
    read: _Token = attrs.field(default=None, metadata=secret_file(), repr=hidden)
    operator: _Token = attrs.field(default=None, metadata=secret_file(), repr=hidden)

    def __attrs_post_init__(self) -> None:
        seen: dict[str, Role] = {}
        for role in TOKEN_ROLES:
            token = self.of(role)
            if token is None:
                continue
            if token in seen:
                raise ConfigError(
                    f"expected a token of its own, got the token of {seen[token].value}",
                    keys=(role.value,),
                )
            seen[token] = role

    def of(self, role: Role) -> str | None:
        """The token of a token role (``None``: not configured)."""
        token: str | None = getattr(self, role.value)
        return token

    @property
    def missing(self) -> tuple[Role, ...]:
        """The token roles without a token: open on loopback (or with ``insecure_open_api``)."""
        return tuple(role for role in TOKEN_ROLES if self.of(role) is None)


_NAME: Final = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*\.?")


def check_host_names(value: object) -> tuple[str, ...]:
    """``allowed_hosts``: host names (no port), or ``"*"`` for any; stored in lower case."""
    if not isinstance(value, list | tuple):
        raise ConfigError(f'expected a list of host names (or ["*"]), got {show(value)}')
    names = []
    for index, element in enumerate(value):
        if type(element) is not str or not (
            element == "*" or _NAME.fullmatch(element.lower()) or _ip(element.strip("[]"))
        ):
            raise ConfigError(
                f'expected a host name like "fylr.example.com" (no scheme, no port) or "*",'
                f" got {show(element)}",
                keys=(index,),
            )
        names.append(element.lower().strip("[]"))
    return tuple(names)


def check_origins(value: object) -> tuple[str, ...]:
    """``allowed_origins``: ``scheme://host[:port]`` of other sites' pages, in lower case."""
    if not isinstance(value, list | tuple):
        raise ConfigError(f"expected a list of origins, got {show(value)}")
    origins = []
    for index, element in enumerate(value):
        origin = _origin(element) if type(element) is str else None
        if origin is None:
            raise ConfigError(
                f'expected an origin like "https://ui.example.com" or "http://10.0.0.5:8080"'
                f" (scheme, host and port only), got {show(element)}",
                keys=(index,),
            )
        origins.append(origin)
    return tuple(origins)


def _origin(text: str) -> str | None:
    """``scheme://host[:port]`` in lower case, or ``None`` when ``text`` is no such origin."""
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if parts.path or parts.query or parts.fragment or "@" in parts.netloc:
        return None
    return f"{parts.scheme}://{parts.netloc}".lower()


def _ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def host_of(header: str) -> str | None:
    """The host of a ``Host`` header without its port, in lower case; ``None`` if malformed."""
    text = header.strip().lower()
    if text.startswith("["):
        end = text.find("]")
        host, rest = text[1:end], text[end + 1 :]
        if end == -1 or not _ip(host) or (rest and not re.fullmatch(r":[0-9]{1,5}", rest)):
            return None
        return host
    host, _, port = text.partition(":")
    if (port and not port.isdigit()) or not (_NAME.fullmatch(host) or _ip(host)):
        return None
    return host


# -- decisions ------------------------------------------------------------------------------


@attrs.frozen
class Refusal:
    """Why a request is refused: the HTTP status, one line of text, headers to add."""

    status: int
    text: str
    headers: tuple[tuple[str, str], ...] = ()


CHALLENGE: Final = (
    ("www-authenticate", 'Bearer realm="fylr"'),
    ("www-authenticate", 'Basic realm="fylr", charset="UTF-8"'),
)
"""What a 401 offers: a bearer token, or the token as the password of a browser's login."""


class Access:
    """The fylr's decisions on who may do what (see the module docstring).

    Args:
        tokens: the configured tokens; a role without one is open.
        link_key: the key that signs download and websocket links.
        link_ttl: how long a link made now stays valid, in seconds.
        host_names: the ``Host`` names answered besides IP addresses (the
            caller adds ``localhost``, the listen host …); ``"*"`` answers any.
        origins: the origins accepted besides this fylr's own.
    """

    def __init__(
        self,
        *,
        tokens: Tokens,
        link_key: bytes,
        link_ttl: float,
        host_names: Iterable[str] = (),
        origins: Iterable[str] = (),
    ) -> None:
        if not link_key:
            raise ValueError("link_key must not be empty")
        self.tokens = tokens
        self.open_roles = frozenset(tokens.missing)
        self._link_key = link_key
        self.link_ttl = link_ttl
        # digests: every comparison is of 32 bytes, whatever the lengths of the tokens
        self._configured = [
            (role, _digest(token)) for role in TOKEN_ROLES if (token := tokens.of(role)) is not None
        ]
        names = frozenset(name.lower() for name in host_names)
        self._any_host = "*" in names
        self.host_names = names - {"*"}
        self.origins = frozenset(origin.lower() for origin in origins)

    # -- tokens

    def roles_of(self, token: str) -> frozenset[Role]:
        """The roles a token is accepted for (empty: it is none of the configured ones).

        Every configured token is compared, in constant time, whatever matched.
        """
        given = _digest(token)
        granted: set[Role] = set()
        for role, expected in self._configured:
            if hmac.compare_digest(given, expected):
                granted |= GRANTS[role]
        return frozenset(granted)

    def judge(
        self,
        role: Role,
        authorization: str,
        *,
        path: str = "",
        query: Mapping[str, str] | None = None,
        now: float = 0.0,
    ) -> Refusal | None:
        """Whether a request may use a route of ``role``: ``None``, or why not.

        Args:
            role: the route's role.
            authorization: the value of its ``Authorization`` header (``""``: none).
            path: the request's path, for a route that takes signed links.
            query: its query parameters, for such a route; ``None`` for a route
                that takes no links.
            now: the wall-clock time (Unix seconds), to judge a link's expiry.
        """
        if role in (Role.PUBLIC, Role.PIPE) or role in self.open_roles:
            return None
        token = _token_of(authorization) if authorization else None
        if authorization and token is None:
            return Refusal(
                401,
                "expected Authorization: Bearer <token> (or Basic with the token as password)",
                CHALLENGE,
            )
        granted = self.roles_of(token) if token is not None else frozenset()
        if role in granted:
            return None
        if query is not None and ("signature" in query or "expires" in query):
            return self.check_link(path, query.get("expires", ""), query.get("signature", ""), now)
        if token is None:
            return Refusal(401, f"a token is required: the {role.value} token", CHALLENGE)
        if not granted:
            return Refusal(401, "the token is not one of this fylr's", CHALLENGE)
        held = " and ".join(sorted(r.value for r in granted))
        return Refusal(403, f"this token may {held}, not {role.value}: use the {role.value} token")

    # -- links

    def _signature(self, path: str, expires: int) -> str:
        message = (
            _LINK_CONTEXT + path.encode("utf-8", "surrogateescape") + b"\n" + str(expires).encode()
        )
        digest = hmac.new(self._link_key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def sign(self, path: str, *, now: float) -> str:
        """The query that makes ``path`` a link valid for ``link_ttl`` from ``now``.

        Returns:
            ``expires=<unix seconds>&signature=<signature>`` (append it after ``?``).
        """
        expires = math.ceil(now + self.link_ttl)
        return f"expires={expires}&signature={self._signature(path, expires)}"

    def check_link(self, path: str, expires: str, signature: str, now: float) -> Refusal | None:
        """Whether a link's ``expires`` and ``signature`` open ``path`` at ``now``.

        Returns:
            ``None``, or a 403 saying whether the signature does not match (a
            changed path or expiry, another key) or the link has expired.
        """
        if not _EXPIRES.fullmatch(expires):
            return Refusal(403, "the link's expires: expected Unix seconds")
        expected = self._signature(path, int(expires))
        if not hmac.compare_digest(signature.encode("utf-8", "replace"), expected.encode()):
            return Refusal(403, "the link's signature does not match its path and expiry")
        if int(expires) <= now:
            return Refusal(403, f"the link expired {math.ceil(now - int(expires))} s ago")
        return None

    # -- names and origins

    def host_allowed(self, header: str) -> bool:
        """Whether a ``Host`` header names this fylr: an IP address or one of ``host_names``."""
        host = host_of(header)
        if host is None:
            return False
        if self._any_host or _ip(host):
            return True
        return host.rstrip(".") in self.host_names

    def origin_allowed(self, origin: str, host_header: str) -> bool:
        """Whether a browser's ``Origin`` is this fylr's own (the ``Host`` asked) or allowed."""
        normal = _origin(origin)
        if normal is None:
            return False  # "null" (a sandboxed frame, a file) or garbage
        if normal in self.origins:
            return True
        own = urllib.parse.urlsplit(normal).netloc
        return own == host_header.strip().lower()


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def _token_of(authorization: str) -> str | None:
    """The token of ``Bearer <token>`` or ``Basic base64(user:token)``; ``None`` otherwise."""
    scheme, _, rest = authorization.partition(" ")
    if scheme == "Bearer" and rest:
        return rest
    if scheme.lower() == "basic" and rest:
        try:
            decoded = base64.b64decode(rest.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, colon, password = decoded.partition(":")
        return password if colon and password else None
    return None
