"""Work a caller waits for: an error at once where a queued step would be requeued.

The outcome table of :mod:`trio_broker.core.dispatch` is for *queued* steps:
nobody waits for them, so a step that could not run now (no slot within the
connect timeout, no execserver, a lost connection…) goes back to the queue and
is tried again later. A caller that waits for its answer (an on-demand request:
a rendition made at request time, a plugin callback) must not be requeued: it
gets an error at once, with the reason. :func:`answer_caller` is the table for
such a caller:

=====================================  ======  ====================================
the work raised (the table's row)      status  hint
=====================================  ======  ====================================
``NoSlot`` … ``StoreUnavailable``      503     none: try again when there is room
``RetryLater``                         503     its delay, as ``retry_after``
anything else (``failed``)             500     none
=====================================  ======  ====================================

Exception groups are judged as :func:`~trio_broker.core.dispatch.judge` does.
The trio helper :func:`trio_broker.trio.dispatcher.run_on_demand` applies it
around the caller's work.

Everything here is pure: no trio, no I/O, no clock.
"""

from __future__ import annotations

from typing import Literal

import attrs

from trio_broker.core.dispatch import OutcomeName, judge
from trio_broker.core.errors import describe

__all__ = ["CallerAnswer", "answer_caller"]


@attrs.frozen(kw_only=True)
class CallerAnswer:
    """What a caller waiting for its answer is told when its work did not succeed.

    Attributes:
        outcome: the deciding row of the outcome table.
        status: 503 (unavailable: a queued step would have been requeued) or 500
            (failed), as an HTTP status.
        error: the reason, the exception's text.
        retry_after: seconds after which trying again makes sense (a
            :class:`~trio_broker.core.errors.RetryLater`'s delay), or ``None``.
    """

    outcome: OutcomeName
    status: Literal[500, 503]
    error: str
    retry_after: float | None = None


def answer_caller(exc: BaseException) -> CallerAnswer:
    """Judge ``exc`` for a caller that waits for its answer: an error, never a requeue.

    Exception groups are judged as :func:`judge` does.
    """
    verdict = judge(exc, retry_delay=0.0)
    error = verdict.error if verdict.error is not None else describe(exc)
    if verdict.kind == "fail":
        return CallerAnswer(outcome=verdict.outcome, status=500, error=error)
    retry_after = verdict.delay if verdict.outcome == "retry_later" else None
    return CallerAnswer(outcome=verdict.outcome, status=503, error=error, retry_after=retry_after)
