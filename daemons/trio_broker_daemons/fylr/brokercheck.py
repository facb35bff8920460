"""The fylr's TLS context for ``wss://`` execservers, a startup check of each address,
and the check that its callback base leads back to it.

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

**The callback base** (:class:`CallbackCheck`). The execservers open a job's
pipes at the callback base the broker connection registered: ``callback_own_url``,
else ``http://<the connection's source address>:<listen port>``. On a host with
several addresses the connection may leave from an address the listener does not
serve, and then no pipe can be opened: every job ends ``stopped`` and is run
again, for ever. The fylr therefore asks itself, at start-up (``callback_own_url``)
and for every new broker connection (the base it registered), for ``GET
<base>/whoami``, and expects its own ``backend_id``. A base that does not answer,
answers something else or names another fylr is one warning line per base
(``callback base http://10.0.0.5:7200 does not lead back to this fylr: it does not
answer (connection refused); …``) naming the fix, ``callback_own_url`` or
``listen``, and the same sentence is among the fylr's ``warnings`` on the
topology page until a later check of that base succeeds.
"""

from __future__ import annotations

import logging
import ssl

import httpx
import trio

from trio_broker.trio.client import BrokerClient, LinkState
from trio_broker.trio.pipe_io import unreachable_cause
from trio_broker_daemons.fylr.config import FylrConfig, split_broker_address

__all__ = [
    "CallbackCheck",
    "broker_problem",
    "broker_ssl_context",
    "callback_problem",
    "check_execservers",
]

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


async def callback_problem(base: str, backend_id: str) -> str | None:
    """Why ``base`` does not lead back to the fylr ``backend_id`` (``None``: it does)."""
    try:
        async with httpx.AsyncClient(timeout=CHECK_TIMEOUT, trust_env=False) as http:
            response = await http.get(base.rstrip("/") + "/whoami")
    except httpx.HTTPError as exc:
        return f"it does not answer ({unreachable_cause(exc)}: {type(exc).__name__})"
    if response.status_code != 200:
        return f"it answers HTTP {response.status_code}"
    try:
        found = response.json().get("backend_id")
    except (ValueError, AttributeError):
        found = None
    if found != backend_id:
        return f"it answers as backend {found!r}, not {backend_id!r}"
    return None


class CallbackCheck:
    """Checks that each callback base this fylr registers leads back to it (module docstring).

    Args:
        config: the fylr's configuration (``listen``, ``callback_own_url``).
        backend_id: what its ``/whoami`` answers.
    """

    def __init__(self, config: FylrConfig, backend_id: str) -> None:
        self._config = config
        self._backend_id = backend_id
        self._problems: dict[str, str] = {}
        self._seen_conns: set[int] = set()

    @property
    def warnings(self) -> list[str]:
        """One sentence per callback base that does not lead back, for the topology page."""
        return list(self._problems.values())

    async def check(self, base: str) -> None:
        """Ask ``base`` once; log a warning the first time it fails, forget it once it works."""
        problem = await callback_problem(base, self._backend_id)
        if problem is None:
            self._problems.pop(base, None)
            return
        sentence = (
            f"callback base {base} does not lead back to this fylr: {problem}; the execservers"
            " cannot open its pipes, so its jobs end stopped and are run again. Set"
            " callback_own_url to a URL of this fylr that the execservers reach, or make"
            f" listen ({self._config.listen}) serve the address its broker connections"
            " leave from"
        )
        if base not in self._problems:
            log.warning(sentence)
        self._problems[base] = sentence

    def _new_links(self, client: BrokerClient) -> list[LinkState]:
        return [link for link in client.links() if link.conn not in self._seen_conns]

    async def serve(self, client: BrokerClient | None) -> None:
        """Check ``callback_own_url`` now, then each new broker connection's base; until
        cancelled."""
        if self._config.callback_own_url is not None:
            await self.check(self._config.callback_own_url)
        if client is None:
            return
        while True:
            await client.wait_until(lambda: bool(self._new_links(client)))
            links = self._new_links(client)
            self._seen_conns.update(link.conn for link in links)
            bases = {link.callback_base for link in links if link.callback_base is not None}
            async with trio.open_nursery() as nursery:
                for base in sorted(bases):
                    nursery.start_soon(self.check, base)
