"""What one claim of a queue item learned about its job, for the attempt the store keeps.

The dispatcher runs each claimed item's handler inside :func:`noting`, which
gives it a fresh :class:`AttemptNote`; the broker client's
:meth:`~trio_broker.trio.client.BrokerClient.run` calls :func:`note_receipt`
with every receipt it returns, so the note holds the execserver instance that
ran the item's (last) job and, when the job ended badly, the receipt's decisive
line. The dispatcher writes both with the item's outcome
(:attr:`~trio_broker.trio.store.Outcome.instance_id`,
:attr:`~trio_broker.trio.store.Outcome.line`). Outside a dispatcher's item (an
on-demand job, a script), :func:`note_receipt` does nothing.

The note travels in a :class:`contextvars.ContextVar`: tasks a handler starts
inherit it, so a job run in a child task of the handler is noted too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from trio_broker.core import protocol as p
from trio_broker.core.endings import decisive_line

__all__ = ["AttemptNote", "note_receipt", "noting"]


class AttemptNote:
    """What the jobs of one claim told (filled by :func:`note_receipt`).

    Attributes:
        instance_id: the execserver instance of the last receipt, or ``None``.
        line: the last receipt's decisive line when it was not ``ok``, else ``None``.
    """

    __slots__ = ("instance_id", "line")

    def __init__(self) -> None:
        self.instance_id: str | None = None
        self.line: str | None = None


_current: contextvars.ContextVar[AttemptNote | None] = contextvars.ContextVar(
    "trio_broker_attempt_note", default=None
)


@contextlib.contextmanager
def noting() -> Iterator[AttemptNote]:
    """A fresh note for the code run inside (one claim's handler)."""
    note = AttemptNote()
    token = _current.set(note)
    try:
        yield note
    finally:
        _current.reset(token)


def note_receipt(receipt: p.Receipt) -> None:
    """Keep a receipt's instance and decisive line in the current claim's note, if any."""
    note = _current.get()
    if note is None:
        return
    note.instance_id = receipt.instance_id
    note.line = None if receipt.status == "ok" else decisive_line(receipt)
