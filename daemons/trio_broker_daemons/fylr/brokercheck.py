"""The fylr's TLS context for ``wss://`` execservers, and a startup check of each address.

The broker client keeps redialling an execserver that refuses it, quietly: a
wrong token or an untrusted certificate would look like an execserver that is
simply not there, and exec-bound work would wait for ever. At startup the fylr
therefore asks each configured address once, over the same transport (TLS with
the same context, the same ``Authorization`` header), for the execserver's
``/metrics`` page, which needs the broker token when one is set, and logs one
error line per address that refuses it:

- ``execserver wss://h:p: TLS certificate not trusted (...); broker_ca_file
  must name the CA that signed it``
- ``execserver h:p: the broker token was refused (HTTP 401); check
  broker_token``

An address that cannot be reached at all is a warning only (it may come up
later; the client dials it again). The check runs only when there is something
to get wrong: ``wss://`` addresses or a broker token. Otherwise it would be one
more connection to a balancer, whose round-robin then hands the fylr's broker
connections to other replicas than it would have.
"""

from __future__ import annotations

import logging
import ssl

import httpx
import trio

from trio_broker_daemons.fylr.config import FylrConfig, split_broker_address

__all__ = ["broker_problem", "broker_ssl_context", "check_execservers"]

log = logging.getLogger("trio_broker_daemons.fylr")

CHECK_TIMEOUT = 10.0
"""Seconds one address may take to answer the check."""


def broker_ssl_context(config: FylrConfig) -> ssl.SSLContext | None:
    """The client TLS context for ``wss://`` addresses (``None`` for ``ws://``)."""
    if not config.broker_tls:
        return None
    cafile = None if config.broker_ca_file is None else str(config.broker_ca_file)
    return ssl.create_default_context(cafile=cafile)


def _cause(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


async def broker_problem(
    address: str, *, token: str | None, context: ssl.SSLContext | None
) -> tuple[int, str] | None:
    """Why ``address`` would refuse this fylr, or ``None`` when it accepts it.

    Returns:
        ``(logging level, sentence)``: ``ERROR`` for a refused token or an
        untrusted certificate, ``WARNING`` for an address that does not answer.
    """
    tls, host_port = split_broker_address(address)
    url = f"{'https' if tls else 'http'}://{host_port}/metrics"
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    verify: ssl.SSLContext | bool = context if context is not None else True
    try:
        async with httpx.AsyncClient(verify=verify, timeout=CHECK_TIMEOUT) as http:
            response = await http.get(url, headers=headers)
    except httpx.HTTPError as exc:
        bad_cert = _cause(exc, ssl.SSLCertVerificationError)
        if isinstance(bad_cert, ssl.SSLCertVerificationError):
            reason = bad_cert.verify_message or str(bad_cert)
            return logging.ERROR, (
                f"execserver {address}: TLS certificate not trusted ({reason}); "
                "broker_ca_file must name the CA that signed it"
            )
        if _cause(exc, ssl.SSLError) is not None:
            return logging.ERROR, f"execserver {address}: TLS handshake failed: {exc}"
        return logging.WARNING, f"execserver {address}: not reachable yet: {exc!r}"
    if response.status_code in (401, 403):
        what = "the broker token was refused" if token else "it needs a broker token"
        return logging.ERROR, (
            f"execserver {address}: {what} (HTTP {response.status_code}); check broker_token"
        )
    return None


async def check_execservers(config: FylrConfig, context: ssl.SSLContext | None) -> None:
    """Check every configured address at once; log one line per address refusing us.

    Nothing is checked without ``wss://`` addresses or a broker token.
    """
    if not (config.broker_tls or config.broker_token):
        return

    async def one(address: str) -> None:
        problem = await broker_problem(address, token=config.broker_token, context=context)
        if problem is not None:
            log.log(*problem)

    async with trio.open_nursery() as nursery:
        for address in config.execservers:
            nursery.start_soon(one, address)
