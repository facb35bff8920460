"""Every exception of the library, sorted by whose fault it is.

Theory of operation
===================

An exception answers one question for whoever catches it: *who has to do
something?* The tree has four branches, one per answer::

    Exception
    ├── ProtocolError ·············· remote: the peer broke the wire protocol
    ├── UsageError (RuntimeError) ·· local: the calling code misused an object
    │   ├── BrokerUsageError             the execserver core (core.broker)
    │   ├── ClientUsageError             the client core (core.client)
    │   └── DispatchUsageError           the dispatch core (core.dispatch)
    ├── BrokerError ················ operational: the work could not reach a known end
    │   ├── NoSlot                       no slot within connect_timeout
    │   ├── NoExecserver                 no execserver reachable (or all drain)
    │   ├── UnknownService               no reachable execserver offers the service
    │   ├── JobLost                      the connection holding the slot closed
    │   ├── ClientClosed                 the client closed while the job waited or ran
    │   ├── JobStopped                   the execserver stopped the job before its end
    │   ├── StoreUnavailable             the queue database could not be reached
    │   └── RetryLater                   a handler's own reason to try again later
    └── WorkFailed ················· the work: as it stands it fails again, every time
        ├── JobFailed                    the job ran and failed (core.endings: its receipt)
        └── ServiceNotOffered            no execserver offered the service, claim after claim

**Remote.** :class:`ProtocolError` is raised only by the codec
(:func:`trio_broker.core.protocol.decode`); the cores catch it and answer with an
``ERROR`` frame (execserver) or report it for the log (client). Its ``code`` is one
of :data:`ErrorCode`, the codes an ``ERROR`` frame carries. It never reaches
the code driving a core, and the core's state is unchanged by the bad frame.

**Local.** A :class:`UsageError` is a bug in the code around an object: time
going backwards, an id the object never issued, a job id submitted twice. It is
raised *before* anything changes, so the object is exactly as it was (its clock
included) and the caller may carry on. Fix the caller; never retry.

**Operational.** A :class:`BrokerError` means the system this process depends
on (a slot, an execserver, a connection, the database) was not there or went
away: nobody's code is wrong, and trying again later may succeed. What a queue
does with each one (requeue at once, requeue later, or fail the item) is the
table of :mod:`trio_broker.core.dispatch`, the one place that decides it.

**The work.** A :class:`WorkFailed` means the work itself is at fault: the job ran
to its end and failed (a corrupt input, a converter's own failure, a time or memory
limit it exceeded: :class:`~trio_broker.core.endings.JobFailed`, which carries the
receipt), or the service it names was offered by no execserver however often the
item came back (:class:`ServiceNotOffered`). Running it again as it is fails again:
a queue fails the item and keeps the reason until someone fixes the input or the
recipe and requeues it.

:func:`describe` renders any of them (or an exception group of them) as the
one-line text the queue stores and the logs show.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

__all__ = [
    "BrokerError",
    "BrokerUsageError",
    "ClientClosed",
    "ClientUsageError",
    "DispatchUsageError",
    "ErrorCode",
    "JobLost",
    "JobStopped",
    "NoExecserver",
    "NoSlot",
    "ProtocolError",
    "RetryLater",
    "ServiceNotOffered",
    "StoreUnavailable",
    "UnknownService",
    "UsageError",
    "WorkFailed",
    "describe",
]


# -- remote ------------------------------------------------------------------------------

ErrorCode: TypeAlias = Literal[
    "bad_frame",
    "unknown_type",
    "bad_field",
    "not_registered",
    "already_registered",
    "draining",
    "unknown_service",
    "duplicate_job",
    "unknown_token",
    "token_mismatch",
    "unknown_job",
    "offer_expired",
    "too_many_wants",
]
"""The ``ERROR.code`` values, in the precedence order of the protocol.

A :class:`ProtocolError` carries one of the first three (the codec decides
them); the execserver's broker refuses a decoded frame with one of the next
eight, first broken rule first (the table ``REFUSALS`` of
:mod:`trio_broker.core.broker`); ``offer_expired`` is news, not a refusal;
``too_many_wants`` refuses a ``WANT`` beyond the connection's cap, after every
other rule a ``WANT`` can break.
"""


class ProtocolError(Exception):
    """A frame broke the protocol. Raised by :func:`~trio_broker.core.protocol.decode` only.

    Args:
        code: the ``ERROR`` code of PROTOCOL.md (``bad_frame``, ``unknown_type``
            or ``bad_field`` from the codec).
        message: a sentence for humans that names the offending member.
        job_id: the frame's ``job_id`` member when it had a string one (valid or
            not), otherwise ``None``; an ``ERROR`` answer echoes it.
    """

    def __init__(self, code: ErrorCode, message: str, job_id: str | None = None) -> None:
        super().__init__(code, message, job_id)
        self.code: ErrorCode = code
        self.message = message
        self.job_id = job_id

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


# -- local -------------------------------------------------------------------------------


class UsageError(RuntimeError):
    """The code driving an object misused it; nothing changed. Fix the caller."""


class BrokerUsageError(UsageError):
    """The code driving the execserver core (:class:`~trio_broker.core.broker.Broker`)
    misused it."""


class ClientUsageError(UsageError):
    """The code driving the client core (:class:`~trio_broker.core.client.ClientCore`)
    misused it."""


class DispatchUsageError(UsageError):
    """The code driving the dispatch core (:class:`~trio_broker.core.dispatch.DispatchCore`)
    misused it."""


# -- operational -------------------------------------------------------------------------


class BrokerError(Exception):
    """Base class of operational failures: the work could not reach a known end.

    Nobody's code is at fault; trying again later may succeed.
    """


class NoSlot(BrokerError):
    """No execserver offered a slot within ``connect_timeout``."""


class NoExecserver(BrokerError):
    """No execserver is reachable right now (or every reachable one drains)."""


class UnknownService(BrokerError):
    """No reachable execserver offers this service (the ones that do may be restarting)."""


class JobLost(BrokerError):
    """The connection holding the job's slot closed before its ``DONE``.

    The job may have run; its end will never be known.
    """


class ClientClosed(BrokerError):
    """The client was closed while the job waited or ran."""


class JobStopped(BrokerError):
    """The job was interrupted before a whole end: the execserver stopped it.

    A ``stopped`` receipt (the execserver drained, or the job's stream broke), or
    a job whose streamed output did not arrive whole.
    :meth:`BrokerClient.run <trio_broker.trio.client.BrokerClient.run>` returns
    such receipts like any other; a queue handler raises this to have the item
    run again later, on whichever execserver is there then.
    """


class StoreUnavailable(BrokerError):
    """The database could not be reached, or the connection broke mid-call.

    The call may or may not have taken effect; every queue operation is safe to
    retry after a short back-off (the pool reconnects meanwhile).
    """


class RetryLater(BrokerError):
    """A handler's own temporary reason: requeue the item after ``delay`` seconds.

    Args:
        delay: seconds before the item may be claimed again (negative counts as 0);
            ``None``: after the queue's own ``retry_delay``, the delay of every
            reason that tries again *later*.
        reason: stored as the item's ``last_error``.
    """

    def __init__(self, delay: float | None, reason: str) -> None:
        super().__init__(delay, reason)
        self.delay = None if delay is None else max(0.0, float(delay))
        self.reason = reason

    def __str__(self) -> str:
        if self.delay is None:
            return f"retry later: {self.reason}"
        return f"retry in {self.delay:g} s: {self.reason}"


# -- the work ----------------------------------------------------------------------------


class WorkFailed(Exception):
    """Base class of the failures of the work itself: as it stands, it fails again.

    A queue fails the item with the reason (it is not retried until someone
    fixes the input or the recipe and requeues it).
    """


class ServiceNotOffered(WorkFailed):
    """No execserver offered the service, though the client looked for it long enough.

    The client core decides it (:mod:`trio_broker.core.client`): a job whose
    service no connection announced fails so once its pool has looked for the
    service a whole ``pool_reprobe_interval`` (time, not attempts), so a recipe
    that names a service nobody offers (a misspelling) fails instead of waiting
    for ever, and a service a replica behind a balancer offers is found first.
    A dispatch core may also bound an item's ``UnknownService`` by its claims
    (:class:`~trio_broker.core.dispatch.DispatchConfig`), for clients that give
    no such verdict.
    """


def describe(exc: BaseException) -> str:
    """One line for the queue's ``last_error`` and the logs.

    Args:
        exc: any exception, or an exception group.

    Returns:
        ``"<type name>: <text>"`` (just the name when the text is empty); a
        :class:`RetryLater` gives its reason; a group gives its members' lines
        joined by ``"; "``.
    """
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(member) for member in exc.exceptions)
    if isinstance(exc, RetryLater):
        return exc.reason
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
