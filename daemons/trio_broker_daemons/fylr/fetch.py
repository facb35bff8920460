"""Fetching remote files under the blocklist: every connection to a checked address.

Theory of operation
===================

:class:`RemoteFetcher` is httpx with a network backend of its own
(:class:`_CheckedBackend`): when httpcore opens a connection for a request, the
backend checks the host name against ``rput.blocked_hosts``, resolves it once
(:data:`Resolver`; the system's ``getaddrinfo`` unless one is given), checks
*every* address it got, and connects to the first address that answers, as an
address: the name is never resolved again for that connection, so an answer
that changes between the check and the connection (DNS rebinding) cannot reach
a blocked address. TLS still names the host (SNI, certificate check) and the
request still carries it in ``Host``, since both come from the URL, not from
the connection. A refusal raises :class:`~trio_broker_daemons.fylr.remote.RemoteRefused`
with one line naming the address and the rule.

Redirects are followed here, not by httpx, one hop at a time (at most
:data:`~trio_broker_daemons.fylr.remote.MAX_REDIRECTS`), each hop an
``http``/``https`` URL; a hop to another host opens a new connection, which
the backend checks like the first. Proxies from the environment are never used
(``trust_env`` off): a proxy would make the connections the blocklist judges.
Bodies are read as sent (``Accept-Encoding: identity``, no decoding).

The same checks run once at registration (:meth:`RemoteFetcher.check`), so a
URL whose host resolves to a blocked address is refused at once (400); one that
only does so later is refused by the step that connects.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Final, TypeAlias

import httpcore
import httpx
import trio

from trio_broker_daemons.fylr.remote import (
    MAX_REDIRECTS,
    REDIRECTS,
    HostPolicy,
    RemoteRefused,
    RemoteSourceFailed,
)

__all__ = [
    "MAX_URL_CHARS",
    "BadRemoteUrl",
    "RemoteFetcher",
    "Resolver",
    "Unresolvable",
    "filename_of",
    "parse_remote_url",
    "system_resolver",
]

Resolver: TypeAlias = Callable[[str, int], Awaitable[list[str]]]
"""``async (host, port) -> addresses``: one resolution of a host name."""

_IDENTITY: Final = {"accept-encoding": "identity"}
MAX_URL_CHARS: Final = 4096
"""The longest URL ``/eas/rput`` accepts."""


class BadRemoteUrl(ValueError):
    """A URL ``/eas/rput`` cannot take (its text says why, starting with ``url:``)."""


class Unresolvable(Exception):
    """A host name could not be resolved (its text says why)."""


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` by the system's resolver (``getaddrinfo``), in its order.

    Raises:
        Unresolvable: the name has no address, or the resolver failed.
    """
    try:
        found = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:  # socket.gaierror
        raise Unresolvable(f"cannot resolve {host}: {exc.strerror or exc}") from None
    addresses: list[str] = []
    for *_, sockaddr in found:
        address = str(sockaddr[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise Unresolvable(f"cannot resolve {host}: no address")
    return addresses


def parse_remote_url(text: str) -> httpx.URL:
    """A URL ``/eas/rput`` may register: ``http`` or ``https``, a host, no credentials.

    Args:
        text: the ``url`` query parameter.

    Returns:
        The parsed URL.

    Raises:
        BadRemoteUrl: one line saying what is wrong (``url: …``).
    """
    if not text:
        raise BadRemoteUrl("url: required (the remote file's http or https URL)")
    if len(text) > MAX_URL_CHARS:
        raise BadRemoteUrl(f"url: expected at most {MAX_URL_CHARS} characters")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in text):
        raise BadRemoteUrl("url: expected no spaces or control characters")
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL as exc:
        raise BadRemoteUrl(f"url: not a URL: {exc}") from None
    if url.scheme not in ("http", "https"):
        raise BadRemoteUrl(f"url: expected an http or https URL, got {text[:200]!r}")
    if not url.host:
        raise BadRemoteUrl("url: expected a host")
    if url.userinfo:
        raise BadRemoteUrl("url: credentials in the URL are not accepted")
    return url


def filename_of(url: httpx.URL) -> str:
    """The file name a remote file gets when none is given: the URL path's last part.

    Returns:
        ``photo.jpg`` for ``http://host/a/photo.jpg?x=1``; the host when the path
        names no file (``http://host/``).
    """
    last = url.path.rstrip("/").rsplit("/", 1)[-1]
    return last or url.host


def _literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


async def checked_addresses(
    policy: HostPolicy, resolver: Resolver, host: str, port: int
) -> list[str]:
    """The addresses ``host`` may be connected at, all of them checked.

    Raises:
        RemoteRefused: a blocked name, or a name with a blocked address.
        Unresolvable: the name has no address.
    """
    line = policy.refuse_name(host)
    if line is not None:
        raise RemoteRefused(line)
    literal = _literal(host)
    addresses = [literal] if literal is not None else await resolver(host, port)
    for address in addresses:
        line = policy.refuse_address(address, host=None if literal is not None else host)
        if line is not None:
            raise RemoteRefused(line)
    return addresses


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's trio backend, connecting only to addresses the blocklist lets through."""

    def __init__(self, policy: HostPolicy, resolver: Resolver) -> None:
        self._policy = policy
        self._resolver = resolver
        self._inner = httpcore.TrioBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        with trio.move_on_after(float("inf") if timeout is None else timeout) as scope:
            try:
                addresses = await checked_addresses(self._policy, self._resolver, host, port)
            except Unresolvable as exc:
                raise httpcore.ConnectError(str(exc)) from None
        if scope.cancelled_caught:
            raise httpcore.ConnectTimeout(f"cannot resolve {host}: timed out")
        failed: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address,
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failed = exc
        assert failed is not None
        raise failed

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise RemoteRefused("a remote file is fetched over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _CheckedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport on a connection pool whose connections :class:`_CheckedBackend` makes.

    httpx builds its pool without a way to pass a network backend, so the pool
    is made again here with one (the pool is httpcore's public class).
    """

    def __init__(self, context: ssl.SSLContext, backend: _CheckedBackend) -> None:
        super().__init__(verify=context, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context, network_backend=backend, max_keepalive_connections=0
        )


class RemoteFetcher:
    """Reads remote files through the blocklist (see the module docstring).

    Args:
        policy: the blocklist.
        timeout: the longest wait to connect, for an answer, and between reads.
        resolver: how host names are resolved (the system's by default).
    """

    def __init__(
        self, policy: HostPolicy, *, timeout: float, resolver: Resolver | None = None
    ) -> None:
        self.policy = policy
        self.timeout = timeout
        self.resolver: Resolver = resolver or system_resolver
        self._context = httpx.create_ssl_context(trust_env=False)

    async def check(self, url: httpx.URL) -> None:
        """What :meth:`get` would check before connecting to ``url``, without connecting.

        Raises:
            RemoteRefused: the host is blocked, or resolves to a blocked address.
            Unresolvable: the host does not resolve (within the timeout too).
        """
        port = url.port or _default_port(url)
        with trio.move_on_after(self.timeout):
            await checked_addresses(self.policy, self.resolver, url.host, port)
            return
        raise Unresolvable(f"cannot resolve {url.host}: timed out")

    @contextlib.asynccontextmanager
    async def get(self, url: httpx.URL) -> AsyncIterator[httpx.Response]:
        """``GET url``, redirects followed: the final answer, its body not read yet.

        Yields:
            The answer that is no redirect (any status); read its body with
            ``aiter_raw()``. It is closed when the block ends.

        Raises:
            RemoteRefused: a connection the blocklist refuses (a redirect's too).
            RemoteSourceFailed: too many redirects, or a redirect to a URL that
                is not ``http``/``https``.
            httpx.TransportError: the remote could not be reached, broke the
                connection, or timed out (``httpx.TimeoutException``).
        """
        transport = _CheckedTransport(self._context, _CheckedBackend(self.policy, self.resolver))
        async with httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(self.timeout),
            follow_redirects=False,
            trust_env=False,
            headers=_IDENTITY,
        ) as client:
            current = url
            for hop in range(MAX_REDIRECTS + 1):
                try:
                    response = await client.send(client.build_request("GET", current), stream=True)
                except RemoteRefused as exc:
                    if hop == 0:
                        raise
                    where = f"{current.host}:{current.port or _default_port(current)}"
                    raise RemoteRefused(f"a redirect to {where}: {exc.line}") from None
                try:
                    target = _redirect_target(response)
                    if target is None:
                        yield response
                        return
                finally:
                    await response.aclose()
                current = target
            raise RemoteSourceFailed(f"more than {MAX_REDIRECTS} redirects")


def _default_port(url: httpx.URL) -> int:
    return 443 if url.scheme == "https" else 80


def _redirect_target(response: httpx.Response) -> httpx.URL | None:
    """Where a redirect points (``None``: the answer is no redirect).

    Raises:
        RemoteSourceFailed: a redirect to a URL that is not ``http``/``https``.
    """
    location = response.headers.get("location")
    if response.status_code not in REDIRECTS or location is None:
        return None
    try:
        target = response.request.url.join(location)
    except httpx.InvalidURL as exc:
        raise RemoteSourceFailed(f"a redirect to a URL that is no URL: {exc}") from None
    if target.scheme not in ("http", "https") or not target.host:
        raise RemoteSourceFailed(f"a redirect to {target.scheme or 'no'} scheme, not http(s)")
    return target
