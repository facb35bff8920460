"""Remote sources: which addresses the fylr may fetch from, and what a remote's answer means.

Pure decisions for ``PUT /eas/rput`` and the steps that read a remote file: no
I/O, no clock (the time is an argument). The fetcher
(:mod:`~trio_broker_daemons.fylr.fetch`) resolves, connects and reads; the
remote steps (:mod:`~trio_broker_daemons.fylr.remote_steps`) ask this module
what to do with what came back.

Theory of operation
===================

**The blocklist** (``rput.blocked_hosts``, :class:`HostPolicy`). The fylr
fetches URLs its clients give it, so a client could make it reach what only the
fylr can reach: its own loopback services, the cloud's metadata address
(``169.254.169.254``), the private network behind it. Every connection the
fetcher opens is checked twice: the host *name* against the blocked names, then
every *address* the name resolves to against the blocked ranges, and the
connection is made to a checked address, never to the name (so a second
resolution cannot swap the address under the check: DNS rebinding). A redirect
opens a new connection, checked the same way. A name that resolves to any
blocked address is refused, even when it has allowed ones too. The default
list (:data:`DEFAULT_BLOCKED_HOSTS`) is loopback, link-local (the metadata
address included), the private and unique-local ranges, ``0.0.0.0/8`` (and
``::``) and multicast; an IPv4 address written as IPv6 (``::ffff:10.0.0.1``)
is judged as the IPv4 address it is. ``rput.allowed_hosts`` lets ranges
through that the list would block (a test server on loopback, an internal
mirror). A refusal is one line naming the address, the rule and the entry.

**The answers** (:func:`judge_status`, :func:`judge_failure`, :func:`give_up`):

========================================  =========================================
the remote…                               the step
========================================  =========================================
answers 2xx                               goes on with the body
redirects (301, 302, 303, 307, 308)       follows, at most :data:`MAX_REDIRECTS`
answers 429, 502, 503 or 504              temporary: asked again after its
                                          ``Retry-After`` (seconds or an HTTP
                                          date), at most :data:`MAX_RETRY_AFTER`;
                                          :data:`DEFAULT_RETRY_AFTER` when absent
answers another 5xx; cannot be reached;   temporary: asked again after the queue's
breaks the connection; times out          ``retry_delay``
answers another 4xx, another 3xx, 1xx     fails for good, naming the status
is refused by the blocklist; sends more   fails for good, naming the rule or the
than ``max_upload_size``; redirects too   limit
often or to a scheme other than http(s)
========================================  =========================================

A temporary answer is given up once the remote has been failing for
``rput.give_up_after`` (an hour by default) and fails for good with the last
reason; a retry is never put later than that moment, so the last attempt is
made on it. The clock starts when the copy step is queued (a file copied in),
or at the first failure since the remote last answered (a file left on its
remote).
"""

from __future__ import annotations

import datetime
import email.utils
import ipaddress
import math
import re
from collections.abc import Iterable
from typing import Annotated, Final, Literal, TypeAlias

import attrs

from trio_broker.core.errors import WorkFailed
from trio_broker_daemons.config.rules import Rule, positive_duration
from trio_broker_daemons.config.values import ConfigError, show

__all__ = [
    "DEFAULT_BLOCKED_HOSTS",
    "DEFAULT_RETRY_AFTER",
    "MAX_REDIRECTS",
    "MAX_RETRY_AFTER",
    "REDIRECTS",
    "RETRY_AFTER_STATUSES",
    "Failure",
    "HostPolicy",
    "ReferenceSteps",
    "RemoteRefused",
    "RemoteSourceFailed",
    "RputConfig",
    "Temporary",
    "give_up",
    "judge_failure",
    "judge_status",
    "retry_after_seconds",
]

MAX_REDIRECTS: Final = 10
"""Redirects followed for one request; one more fails the step for good."""
REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
"""The statuses that are followed (to their ``Location``)."""
RETRY_AFTER_STATUSES: Final = frozenset({429, 502, 503, 504})
"""The statuses asked again after their ``Retry-After``."""
MAX_RETRY_AFTER: Final = 600.0
"""The longest ``Retry-After`` honoured, in seconds (a longer one is cut to it)."""
DEFAULT_RETRY_AFTER: Final = 60.0
"""The wait after a status of :data:`RETRY_AFTER_STATUSES` without a usable ``Retry-After``."""

DEFAULT_BLOCKED_HOSTS: Final[tuple[str, ...]] = (
    "127.0.0.0/8",  # loopback
    "::1/128",
    "169.254.0.0/16",  # link-local, the cloud metadata address 169.254.169.254 included
    "fe80::/10",
    "10.0.0.0/8",  # private
    "172.16.0.0/12",
    "192.168.0.0/16",
    "fc00::/7",  # unique-local
    "0.0.0.0/8",  # "this network", and the unspecified IPv6 address
    "::/128",
    "224.0.0.0/4",  # multicast
    "ff00::/8",
)
"""``rput.blocked_hosts`` when it is not set."""

ReferenceSteps: TypeAlias = Literal["none", "metadata", "all"]
"""What the fylr makes of a file left on its remote (``rput.reference_steps``)."""

_Network: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAME: Final = re.compile(r"(\*\.)?[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")


class RemoteRefused(Exception):
    """The blocklist refused a connection: :attr:`line` names the address and the rule."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


class RemoteSourceFailed(WorkFailed):
    """A remote source failed for good: its step fails with this text, and so does its file."""


# -- configuration -------------------------------------------------------------------------


def _network(entry: str) -> _Network | None:
    try:
        network = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return None
    if isinstance(network, ipaddress.IPv6Network) and network.network_address.ipv4_mapped:
        mapped = network.network_address.ipv4_mapped
        return ipaddress.ip_network(f"{mapped}/{max(0, network.prefixlen - 96)}", strict=False)
    return network


def _host_entry(value: object, *, names: bool) -> str:
    if type(value) is not str:
        raise ConfigError(f"expected a string, got {show(value)}")
    if _network(value) is not None:
        return value
    text = value.lower()
    if names and _NAME.fullmatch(text) and not text.replace(".", "").isdigit():
        return text.rstrip(".")
    what = (
        "a CIDR range (10.0.0.0/8), an address or a host name"
        if names
        else ("a CIDR range (10.0.0.0/8) or an address")
    )
    raise ConfigError(f"expected {what}, got {show(value)}")


def _host_entries(names: bool) -> Rule:
    def check(value: object) -> tuple[str, ...]:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"expected a list, got {show(value)}")
        result: list[str] = []
        for index, element in enumerate(value):
            try:
                result.append(_host_entry(element, names=names))
            except ConfigError as exc:
                raise ConfigError(exc.reason, keys=(index,)) from None
        return tuple(result)

    return Rule(check)


def _reference_steps(value: object) -> ReferenceSteps:
    if value not in ("none", "metadata", "all"):
        raise ConfigError(f"expected none, metadata or all, got {show(value)}")
    return value


_Blocked = Annotated[tuple[str, ...], _host_entries(names=True)]
_Allowed = Annotated[tuple[str, ...], _host_entries(names=False)]
_Positive = Annotated[float, Rule(positive_duration)]
_Steps = Annotated[ReferenceSteps, Rule(_reference_steps)]


@attrs.frozen(kw_only=True)
class RputConfig:
    """The fylr's ``rput`` key: remote sources.

    Attributes:
        blocked_hosts: CIDR ranges, addresses and host names the fylr never
            fetches from (``*.example.com`` covers the names below it);
            :data:`DEFAULT_BLOCKED_HOSTS` when not set. A list given replaces it.
        allowed_hosts: CIDR ranges and addresses let through although
            ``blocked_hosts`` covers them.
        give_up_after: how long a remote may keep failing with temporary
            answers before its step fails for good.
        timeout: the longest wait for a connection, for an answer, and between
            two reads of a body.
        reference_steps: what is made of a file left on its remote: ``none``
            (a reference only), ``metadata`` (the class's metadata step, on the
            remote bytes) or ``all`` (its metadata and its versions).
    """

    blocked_hosts: _Blocked = DEFAULT_BLOCKED_HOSTS
    allowed_hosts: _Allowed = ()
    give_up_after: _Positive = 3600.0
    timeout: _Positive = 30.0
    reference_steps: _Steps = "none"

    def policy(self) -> HostPolicy:
        """The blocklist of this configuration."""
        return HostPolicy.from_entries(self.blocked_hosts, self.allowed_hosts)


# -- the blocklist ---------------------------------------------------------------------------


def _address(text: str) -> _Address | None:
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@attrs.frozen
class HostPolicy:
    """Which hosts and addresses may be fetched from (see the module docstring).

    Attributes:
        blocked: the blocked ranges with the entry each came from.
        blocked_names: blocked host names, lower case (``*.`` covers the names below).
        allowed: ranges let through although blocked.
    """

    blocked: tuple[tuple[_Network, str], ...]
    blocked_names: tuple[str, ...]
    allowed: tuple[_Network, ...]

    @classmethod
    def from_entries(cls, blocked: Iterable[str], allowed: Iterable[str] = ()) -> HostPolicy:
        """A policy from ``rput.blocked_hosts`` and ``rput.allowed_hosts`` entries.

        Raises:
            ValueError: an allowed entry is no range or address.
        """
        ranges: list[tuple[_Network, str]] = []
        names: list[str] = []
        for entry in blocked:
            network = _network(entry)
            if network is None:
                names.append(entry.lower().rstrip("."))
            else:
                ranges.append((network, entry))
        opened = []
        for entry in allowed:
            network = _network(entry)
            if network is None:
                raise ValueError(f"allowed host {entry!r} is no CIDR range or address")
            opened.append(network)
        return cls(tuple(ranges), tuple(names), tuple(opened))

    def refuse_name(self, host: str) -> str | None:
        """Why a host name is refused (``None``: it is not a blocked name).

        Args:
            host: the URL's host (a name, or an address: addresses are never
                blocked by name).
        """
        name = host.lower().rstrip(".")
        for entry in self.blocked_names:
            hit = name.endswith(entry[1:]) if entry.startswith("*.") else name == entry
            if hit:
                return f"the host {name} is in rput.blocked_hosts ({entry})"
        return None

    def refuse_address(self, address: str, *, host: str | None = None) -> str | None:
        """Why an address is refused (``None``: it may be connected to).

        Args:
            address: an IPv4 or IPv6 address (an IPv6 zone is ignored; an IPv4
                address written as IPv6 is judged as IPv4).
            host: the name it was resolved from, for the line (``None``: the
                URL named the address itself).

        Returns:
            ``127.0.0.2 is in rput.blocked_hosts (127.0.0.0/8)``, or with a
            name ``a.test resolves to 127.0.0.2, which is in …``.
        """
        parsed = _address(address)
        if parsed is None:
            return f"{address} is no IP address"
        if any(parsed in network for network in self.allowed if network.version == parsed.version):
            return None
        for network, entry in self.blocked:
            if network.version == parsed.version and parsed in network:
                rule = f"rput.blocked_hosts ({entry})"
                if host is None:
                    return f"{parsed} is in {rule}"
                return f"{host} resolves to {parsed}, which is in {rule}"
        return None


# -- the answers -----------------------------------------------------------------------------


@attrs.frozen
class Temporary:
    """A temporary failure: ask again after ``delay`` seconds.

    Attributes:
        delay: seconds to wait.
        reason: what happened, one line.
    """

    delay: float
    reason: str


@attrs.frozen
class Failure:
    """A failure for good.

    Attributes:
        reason: what happened, one line.
    """

    reason: str


def retry_after_seconds(value: str | None, *, now: float) -> float | None:
    """The wait a ``Retry-After`` header asks for, in seconds.

    Args:
        value: the header (delay seconds, or an HTTP date), or ``None``.
        now: the current UNIX time (what an HTTP date is measured from).

    Returns:
        The seconds (0 for a date in the past, at most :data:`MAX_RETRY_AFTER`);
        ``None`` when absent or unreadable.
    """
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        return min(float(text), MAX_RETRY_AFTER)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return min(max(0.0, seconds), MAX_RETRY_AFTER)


def judge_status(
    status: int, phrase: str, retry_after: str | None, *, now: float, retry_delay: float
) -> Temporary | Failure | None:
    """What a remote's final answer (after redirects) means.

    Args:
        status: its status code.
        phrase: its reason phrase (may be empty).
        retry_after: its ``Retry-After`` header, if any.
        now: the current UNIX time.
        retry_delay: the queue's delay for temporary failures.

    Returns:
        ``None`` for a 2xx answer (go on); a :class:`Temporary` for 429, 502,
        503 and 504 (after ``Retry-After``) and the other 5xx (after
        ``retry_delay``); a :class:`Failure` naming the status otherwise.
    """
    if 200 <= status < 300:
        return None
    said = f"{status} {phrase}".strip()
    if status in RETRY_AFTER_STATUSES:
        delay = retry_after_seconds(retry_after, now=now)
        return Temporary(
            DEFAULT_RETRY_AFTER if delay is None else delay, f"the remote answered {said}"
        )
    if 500 <= status < 600:
        return Temporary(retry_delay, f"the remote answered {said}")
    return Failure(f"the remote answered {said}")


def judge_failure(description: str, *, retry_delay: float) -> Temporary:
    """A remote that could not be reached, broke the connection or timed out: temporary.

    Args:
        description: what went wrong, one line.
        retry_delay: the queue's delay for temporary failures.
    """
    return Temporary(retry_delay, description)


def give_up(
    outcome: Temporary, *, since: float, now: float, give_up_after: float
) -> Temporary | Failure:
    """A temporary failure, unless the remote has been failing for too long.

    Args:
        outcome: the temporary failure.
        since: when the clock started (UNIX time; see the module docstring).
        now: the current UNIX time.
        give_up_after: ``rput.give_up_after``.

    Returns:
        The :class:`Failure` ``gave up after …: <reason>`` once ``give_up_after``
        has passed since ``since``; else the temporary failure with its delay
        cut so that the next attempt is not later than that moment.
    """
    left = since + give_up_after - now
    if left <= 0:
        return Failure(f"gave up after {_seconds(give_up_after)}: {outcome.reason}")
    return Temporary(min(outcome.delay, left), outcome.reason)


def _seconds(value: float) -> str:
    """``3600`` → ``1h``, ``90`` → ``90s``, ``2.5`` → ``2.5s``."""
    for unit, size in (("h", 3600.0), ("m", 60.0)):
        if value >= size and value % size == 0:
            return f"{value / size:g}{unit}"
    return f"{value:g}s"
