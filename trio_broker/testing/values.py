"""Handy protocol values for tests, model checks and benchmarks (no hypothesis)."""

from __future__ import annotations

from trio_broker.core import protocol as p
from trio_broker.core.job import ended_receipt

__all__ = ["receipt"]


def receipt(
    status: p.Status = "ok",
    *,
    duration: float = 0.5,
    peak_memory: int | None = None,
    started_at: float = 0.0,
) -> p.Receipt:
    """A receipt as a runner would write it, with the fields that matter to the pool.

    Args:
        status: how the job ended; its error is the status in words (``out of
            memory``), none for ``ok``.
        duration: ``duration_s``.
        peak_memory: the job's footprint as the pool learns it.
        started_at: when it started.

    Returns:
        The receipt, built like a runner's (:func:`~trio_broker.core.job.ended_receipt`).
    """
    return ended_receipt(
        status,
        None if status == "ok" else status.replace("_", " "),
        started_at=started_at,
        duration_s=duration,
        instance_id="",
        exit_code=0 if status == "ok" else (None if status == "error" else 1),
        peak_memory=peak_memory,
    )
