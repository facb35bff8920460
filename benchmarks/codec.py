"""Cost of the wire codec: encode + decode per message, in microseconds.

Run: ``.venv/bin/python benchmarks/codec.py`` (or ``make bench``).

For each message the round trip ``decode(encode(m))`` is timed, and next to it the
floor measured in the same run: ``orjson.loads(orjson.dumps(d))`` of the same
frame as a plain dict, with no validation at all. The ratio says what validation
and the attrs values cost on top of JSON itself.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable

import orjson

from trio_broker.core import protocol as p


def _job_object(size: int) -> dict[str, object]:
    """A job object of about ``size`` bytes of JSON, shaped like a real one."""
    job: dict[str, object] = {
        "params": {"input": "https://fylr.example/api/v1/eas/123/original", "size": "250x250"},
        "env": {"LANG": "C.UTF-8"},
        "stdin_url": None,
        "stdout_url": None,
    }
    filler = size - len(orjson.dumps(job)) - len(', "note": ""')
    job["note"] = "x" * max(0, filler)
    return job


def samples() -> dict[str, p.Message]:
    receipt = p.Receipt(
        status="ok",
        exit_code=0,
        error=None,
        stderr_line=None,
        stdout_prefix='{"width": 250, "height": 188}',
        stdout_bytes=29,
        stdin_bytes=0,
        started_at=1790000000.25,
        duration_s=0.031,
        peak_memory=18874368,
        instance_id="4f1c1d7e9a3b4c55",
    )
    return {
        "WANT": p.Want(job_id="file-123456:thumbnail", service="thumbnail", priority=2),
        "OFFER": p.Offer(job_id="file-123456:thumbnail", token="q3Jx9c0bKqYp2m5T1u8wZg"),
        "JOB (1 KiB job)": p.Job(
            job_id="file-123456:thumbnail",
            token="q3Jx9c0bKqYp2m5T1u8wZg",
            service="thumbnail",
            subject="file-123456",
            job=_job_object(1024),
        ),
        "DONE": p.Done(job_id="file-123456:thumbnail", receipt=receipt),
    }


def per_call_us(fn: Callable[[], object], repeat: int, number: int) -> float:
    """Median over ``repeat`` runs of the cost of one call, in microseconds."""
    runs = timeit.repeat(fn, repeat=repeat, number=number)
    return statistics.median(runs) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=20000)
    args = parser.parse_args()

    print(f"{'message':<16} {'bytes':>6} {'round trip µs':>14} {'floor µs':>9} {'ratio':>6}")
    for name, message in samples().items():
        text = p.encode(message)
        assert p.decode(text) == message
        plain = orjson.loads(text)

        def round_trip(message: p.Message = message) -> object:
            return p.decode(p.encode(message))

        def floor(plain: object = plain) -> object:
            return orjson.loads(orjson.dumps(plain).decode())

        ours = per_call_us(round_trip, args.repeat, args.number)
        base = per_call_us(floor, args.repeat, args.number)
        size = len(text.encode())
        print(f"{name:<16} {size:>6} {ours:>14.2f} {base:>9.2f} {ours / base:>6.1f}")


if __name__ == "__main__":
    main()
