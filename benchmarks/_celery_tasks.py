"""The Celery side of ``benchmarks/vs_celery.py``: the app, its tuning and the two tasks.

The worker is started as ``celery -A _celery_tasks worker`` with this folder on
``PYTHONPATH`` and the Redis URL in ``BENCH_REDIS_URL``; the benchmark builds its
own app with :func:`make_app`. Both tasks return ``[start, end]``, read with
``time.time()`` inside the task, so job timings come from the same clock as the
execserver's receipts (``started_at``, also ``time.time()``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery.signals import worker_ready


def make_app(url: str) -> Celery:
    """A Celery app on the Redis at ``url`` (broker and result backend), tuned.

    Tuning: one message prefetched per process or thread
    (``worker_prefetch_multiplier = 1``) and acknowledged after the task
    (``task_acks_late``), so a waiting message stays in Redis, where priorities
    and the queue order still apply, instead of in a worker's buffer.
    """
    app = Celery("bench", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_default_queue="bench",
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )

    app.task(name="bench.noop")(noop)
    app.task(name="bench.hold")(hold)
    return app


def noop() -> list[float]:
    """The no-op job: when it ran."""
    now = time.time()
    return [now, now]


def hold(seconds: float) -> list[float]:
    """Hold the slot ``seconds``: when it started and ended."""
    start = time.time()
    time.sleep(seconds)
    return [start, time.time()]


app = make_app(os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))


def _ready(**_: Any) -> None:
    """Tell the benchmark, on the worker's own stdout, that it consumes now."""
    os.write(1, b"ready\n")


worker_ready.connect(_ready, weak=False)
