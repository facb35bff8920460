"""A DNS server for tests: A records from a table the test controls, over real UDP.

A daemon resolves names with the system's resolver (``getaddrinfo``), which
asks the name servers of ``/etc/resolv.conf``. A test that runs the daemon in a
network namespace gives the namespace its own ``resolv.conf``
(``/etc/netns/<name>/resolv.conf``, which ``ip netns exec`` mounts over
``/etc/resolv.conf``) naming this server on the namespace's loopback: the
daemon's lookups then reach :func:`serve_dns`, and nothing else of the machine
changes.

The server answers queries of class IN: type A from :class:`Zone` (TTL 0, so
no resolver keeps an answer: each lookup asks again), any other type of a
known name with no records (NODATA), an unknown name NXDOMAIN. A name's
answers are a list taken one per A query, the last one repeating, so a name
can resolve to one address at its first lookup and to another at the next (a
rebinding DNS server). Every query is recorded.
"""

from __future__ import annotations

import ipaddress
import struct
from typing import Final

import attrs
import trio

__all__ = ["Query", "Zone", "respond", "serve_dns"]

TYPE_A: Final = 1
CLASS_IN: Final = 1
_HEADER: Final = struct.Struct("!HHHHHH")
_ANSWER: Final = struct.Struct("!HHHIH")  # name pointer, type, class, TTL, length


@attrs.frozen
class Query:
    """One question the server was asked: the name (lower case) and the record type."""

    name: str
    qtype: int


@attrs.define
class Zone:
    """Names to the answers of their A queries, one list per query (the last repeats).

    Attributes:
        names: name (lower case, no final dot) → answers, each a list of IPv4 addresses.
        queries: every question asked, in order.
    """

    names: dict[str, list[list[str]]] = attrs.field(factory=dict)
    queries: list[Query] = attrs.field(factory=list)

    def a_queries(self, name: str) -> int:
        """How many A queries asked for ``name``."""
        return sum(1 for q in self.queries if q.name == name and q.qtype == TYPE_A)

    def answer(self, name: str) -> list[str] | None:
        """The next answer to an A query for ``name`` (``None``: an unknown name)."""
        found = self.names.get(name)
        if not found:
            return None
        return found.pop(0) if len(found) > 1 else found[0]


def _question(packet: bytes) -> tuple[str, int, int, int] | None:
    """``(name, qtype, qclass, end offset)`` of the first question, or None if unreadable."""
    offset = _HEADER.size
    labels = []
    while offset < len(packet):
        length = packet[offset]
        offset += 1
        if length == 0:
            break
        if length & 0xC0:  # no compression in a question
            return None
        labels.append(packet[offset : offset + length].decode("ascii", "replace").lower())
        offset += length
    if offset + 4 > len(packet):
        return None
    qtype, qclass = struct.unpack_from("!HH", packet, offset)
    return ".".join(labels), qtype, qclass, offset + 4


def respond(packet: bytes, zone: Zone) -> bytes | None:
    """The answer to one query packet (``None`` for one that is not a query)."""
    if len(packet) < _HEADER.size:
        return None
    ident, flags, qdcount, *_ = _HEADER.unpack_from(packet)
    found = _question(packet) if qdcount == 1 and not flags & 0x8000 else None
    if found is None:
        return None
    name, qtype, qclass, end = found
    zone.queries.append(Query(name, qtype))
    question = packet[_HEADER.size : end]
    recursion = flags & 0x0100
    known = name in zone.names and qclass == CLASS_IN
    records: list[str] = []
    if known and qtype == TYPE_A:
        records = zone.answer(name) or []
    rcode = 0 if known else 3  # NOERROR (NODATA when no records), or NXDOMAIN
    # a response, authoritative, recursion as asked and available
    reply_flags = 0x8000 | 0x0400 | recursion | 0x0080 | rcode
    header = _HEADER.pack(ident, reply_flags, 1, len(records), 0, 0)
    answers = b"".join(
        _ANSWER.pack(0xC000 | _HEADER.size, TYPE_A, CLASS_IN, 0, 4)
        + ipaddress.IPv4Address(address).packed
        for address in records
    )
    return header + question + answers


async def serve_dns(
    sock: trio.socket.SocketType,
    zone: Zone,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer the queries that reach a bound UDP socket from ``zone`` until cancelled."""
    with sock:
        task_status.started()
        while True:
            packet, peer = await sock.recvfrom(4096)
            reply = respond(packet, zone)
            if reply is not None:
                await sock.sendto(reply, peer)
