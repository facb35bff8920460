"""The fylr token of the client commands (``upload``, ``position``, ``top``).

A fylr with tokens (:mod:`trio_broker_daemons.fylr.access`) answers 401 to a
request without the token its route needs and 403 to a token of a narrower
role. The commands send the token they were given (``--token-file``,
``--token`` or ``$TRIO_BROKER_FYLR_TOKEN``, resolved by the command line) as
``Authorization: Bearer <token>`` on every request, and name both refusals in
their messages with :func:`refusal_hint`.
"""

from __future__ import annotations

from typing import Final

__all__ = ["TOKEN_HINT", "auth_headers", "refusal_hint"]

TOKEN_HINT: Final = "give the fylr's token: --token-file FILE or $TRIO_BROKER_FYLR_TOKEN"


def auth_headers(token: str | None) -> dict[str, str]:
    """The headers that carry ``token`` (none without one)."""
    return {} if token is None else {"authorization": f"Bearer {token}"}


def refusal_hint(status: int, role: str) -> str:
    """What to add to an answer's status: how to pass the token a 401 or 403 asked for."""
    if status == 401:
        return f" ({TOKEN_HINT}; this command needs the {role} token)"
    if status == 403:
        return f" (this command needs the {role} token)"
    return ""
