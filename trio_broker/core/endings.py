"""How a job's end reads to the code that ran it: the receipt's rules, one exception per failure.

Theory of operation
===================

:meth:`BrokerClient.run <trio_broker.trio.client.BrokerClient.run>` returns the
receipt of a job that ran, whatever its status, and raises when the job reached
no known end. This module says what either means, once, so that no layer above
restates it (the trio client, a queue handler, an application).

**A run that reached no end.** The client core ends such a job with a
:class:`~trio_broker.core.client_values.Failed` effect; :data:`RUN_FAILURES` is the
table of its reasons, and :func:`run_failure` the exception a caller gets:

- ``no_slot`` raises :class:`~trio_broker.core.errors.NoSlot` (no slot within
  ``connect_timeout``);
- ``no_execserver`` raises :class:`~trio_broker.core.errors.NoExecserver` (none
  reachable, or all drain);
- ``unknown_service`` raises :class:`~trio_broker.core.errors.UnknownService` (no
  reachable execserver offers the service yet: try again later);
- ``service_not_offered`` raises :class:`~trio_broker.core.errors.ServiceNotOffered`
  (the pool looked for the service a whole ``pool_reprobe_interval`` and found
  no execserver offering it: for good);
- ``lost`` raises :class:`~trio_broker.core.errors.JobLost` (the connection holding
  the job's slot closed before its end);
- ``cancelled`` raises nothing: the caller withdrew the job (its own cancellation).

**A receipt.** Three rules read the receipt of a job that ran:

- *interrupted* (:func:`interrupted`): the execserver stopped the job (it drained,
  a stream of the job broke, or its in-pipe could not be reached: ``stopped``) or
  its client cancelled it (``cancelled``). Neither is a verdict on the job: run
  it again, later or elsewhere. So is the receipt of an older execserver for an
  in-pipe it could not open: status ``error``, no ``exit_code``, an error
  beginning ``missing input: `` (:data:`LEGACY_UNREACHABLE`); it reads as
  ``stopped`` (``PROTOCOL.md``, Decision S36).
- *whole output* (:func:`output_whole`): a job whose stdout streamed into an
  out-pipe delivered it whole only when the pipe saw the end of the stream
  (``done``), or when there was nothing to stream (the pipe was never opened,
  ``closed``, and the receipt counts 0 bytes). An ``ok`` receipt whose stream was
  cut is no result.
- *the decisive line* (:func:`decisive_line`): for a command that failed on its
  own (``failed``), the last line of its stderr (its own words: ``codec: no such
  format``), else the receipt's error (``exit status 3``); for an ending the runner
  decided (``timed_out``, ``stalled``, ``out_of_memory``, ``stopped``,
  ``cancelled``, ``error``), the receipt's error (``timed out after 30m``), else
  the stderr line.

:func:`receipt_failure` puts them together: nothing for an ``ok`` receipt whose
output arrived whole; :class:`~trio_broker.core.errors.JobStopped` (run it again)
for an interrupted job or a cut stream; :class:`JobFailed` (the work is at fault)
for any other ending. A queue handler raises what it returns, and the outcome
table of :mod:`trio_broker.core.dispatch` decides what becomes of the item.

Everything here is pure: no trio, no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal, TypeAlias

from trio_broker.core.client_values import Failed, FailReason
from trio_broker.core.errors import (
    BrokerError,
    JobLost,
    JobStopped,
    NoExecserver,
    NoSlot,
    ServiceNotOffered,
    UnknownService,
    WorkFailed,
)
from trio_broker.core.protocol import Receipt

__all__ = [
    "LEGACY_UNREACHABLE",
    "RUN_FAILURES",
    "JobFailed",
    "PipeState",
    "decisive_line",
    "interrupted",
    "output_whole",
    "receipt_failure",
    "run_failure",
]

PipeState: TypeAlias = Literal["open", "active", "done", "aborted", "closed"]
"""Where a one-time pipe stands (:class:`trio_broker.trio.pipes.Pipe`): ``open``: it
waits for its request; ``active``: a request is being served; ``done``: the whole
stream went through; ``aborted``: the transfer started but did not complete;
``closed``: closed before any request came."""

RUN_FAILURES: Final[Mapping[FailReason, type[BrokerError | ServiceNotOffered] | None]] = {
    "no_slot": NoSlot,
    "no_execserver": NoExecserver,
    "unknown_service": UnknownService,
    "service_not_offered": ServiceNotOffered,
    "lost": JobLost,
    "cancelled": None,
}
"""The exception a :class:`~trio_broker.core.client_values.Failed` reason raises
(``None``: nothing, the caller withdrew the job)."""

_INTERRUPTED: Final = frozenset({"stopped", "cancelled"})

LEGACY_UNREACHABLE: Final = "missing input: "
"""How an older execserver's ``error`` receipt for an unreachable in-pipe begins."""


def _legacy_unreachable(receipt: Receipt) -> bool:
    return (
        receipt.status == "error"
        and receipt.exit_code is None
        and (receipt.error or "").startswith(LEGACY_UNREACHABLE)
    )


def run_failure(failed: Failed) -> BrokerError | ServiceNotOffered | None:
    """The exception the caller of a job gets for its ``Failed`` effect (:data:`RUN_FAILURES`).

    Returns:
        ``NoSlot("job <id>: <detail>")`` and the like; ``None`` for ``cancelled``.
    """
    kind = RUN_FAILURES[failed.reason]
    return None if kind is None else kind(f"job {failed.job_id}: {failed.detail}")


def interrupted(receipt: Receipt) -> bool:
    """Whether the job was interrupted before a verdict: ``stopped`` or ``cancelled``
    (or an older execserver's unreachable in-pipe)."""
    return receipt.status in _INTERRUPTED or _legacy_unreachable(receipt)


def output_whole(receipt: Receipt, stdout: PipeState) -> bool:
    """Whether a job's stdout reached its out-pipe whole.

    Args:
        receipt: the job's receipt.
        stdout: the out-pipe's state once the job ended.

    Returns:
        True when the pipe saw the end of the stream (``done``), or was never
        opened because there was nothing to stream (``closed`` and 0 bytes).
    """
    return stdout == "done" or (stdout == "closed" and receipt.stdout_bytes == 0)


def decisive_line(receipt: Receipt) -> str:
    """The line that says why a job did not end ``ok`` (see the module docstring).

    Returns:
        For ``failed``, the stderr line, else the error; for another status, the
        error, else the stderr line; ``status <status>`` when the receipt has neither.
    """
    if receipt.status == "failed":
        line = receipt.stderr_line or receipt.error
    else:
        line = receipt.error or receipt.stderr_line
    return line or f"status {receipt.status}"


class JobFailed(WorkFailed):
    """The job ran to its end and failed: the input or the recipe is at fault.

    Its text is the status and the decisive line (``failed (exit status 3): codec:
    no such format``, ``timed_out: timed out after 30m``).

    Args:
        receipt: the job's receipt (any status but ``ok``, ``stopped`` and ``cancelled``).

    Attributes:
        receipt: the receipt.
        line: its decisive line (:func:`decisive_line`).
    """

    def __init__(self, receipt: Receipt) -> None:
        super().__init__(receipt)
        self.receipt = receipt
        self.line = decisive_line(receipt)

    def __str__(self) -> str:
        receipt = self.receipt
        exit_status = receipt.status == "failed" and receipt.error and receipt.error != self.line
        status = f"{receipt.status} ({receipt.error})" if exit_status else receipt.status
        return f"{status}: {self.line}"


def receipt_failure(
    receipt: Receipt, *, stdout: PipeState | None = None, what: str = "the job"
) -> JobStopped | JobFailed | None:
    """What a receipt means to the code that ran the job: nothing, or the exception to raise.

    Args:
        receipt: the job's receipt.
        stdout: the state of the job's out-pipe once the job ended (``None``: its
            stdout was not streamed).
        what: how the job is named in a ``JobStopped``'s text.

    Returns:
        ``None`` for an ``ok`` receipt whose output arrived whole;
        ``JobStopped`` for an interrupted job (``<what> was stopped: <line>``) or
        an ``ok`` one whose stream was cut; ``JobFailed`` for any other ending.
    """
    if interrupted(receipt):
        status = "stopped" if receipt.status == "error" else receipt.status
        return JobStopped(f"{what} was {status}: {decisive_line(receipt)}")
    if receipt.status != "ok":
        return JobFailed(receipt)
    if stdout is not None and not output_whole(receipt, stdout):
        return JobStopped(f"the output did not arrive whole (out-pipe {stdout})")
    return None
