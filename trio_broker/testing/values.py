"""Handy protocol values for tests, model checks and benchmarks (no hypothesis)."""

from __future__ import annotations

from trio_broker.core import protocol as p

__all__ = ["receipt"]


def receipt(
    status: p.Status = "ok",
    *,
    duration: float = 0.5,
    peak_memory: int | None = None,
    started_at: float = 0.0,
) -> p.Receipt:
    """A receipt as a runner would write it, with the fields that matter to the pool."""
    return p.Receipt(
        status=status,
        exit_code=0 if status == "ok" else (None if status == "error" else 1),
        error=None if status == "ok" else status.replace("_", " "),
        stdout_prefix="",
        stdout_bytes=0,
        stdin_bytes=0,
        started_at=started_at,
        duration_s=duration,
        peak_memory=peak_memory,
        instance_id="",
    )
