"""The figures of benchmarks/vs_celery.py, computed from job timings, and its traffic count.

The benchmark itself needs Celery and Redis (the bench-celery extra); what it
computes from the timings is pure and checked here on schedules written by hand,
and its traffic count on a real loopback connection.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import trio

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load() -> ModuleType:
    sys.path.append(str(BENCHMARKS))  # its own folder's modules, as when it is run
    spec = importlib.util.spec_from_file_location("vs_celery", BENCHMARKS / "vs_celery.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_celery"] = module  # attrs classes look their module up
    spec.loader.exec_module(module)
    return module


vs = _load()


def test_reuse_gaps_leave_out_the_first_two_jobs() -> None:
    runs = [vs.Run(0, start, start + 10) for start in (0, 11, 22.5, 34.5, 45)]
    assert vs.reuse_gaps(list(reversed(runs))) == [2.0, 0.5]


def test_a_probe_that_takes_the_first_freed_slot_is_ideal() -> None:
    # two slots end at 15 and 20; the high job is submitted at 12 and takes the slot at 15
    runs = [
        vs.Run(0, 5, 15, "low"),
        vs.Run(0, 10, 20, "low"),
        vs.Run(12, 15.5, 25.5, "high"),
        vs.Run(0, 20.5, 30.5, "low"),
    ]
    excess, inversions = vs.priority_figures(runs, 2)
    assert excess == pytest.approx(0.5)
    assert inversions == 0


def test_a_low_job_in_a_slot_freed_after_the_probe_is_an_inversion() -> None:
    runs = [
        vs.Run(0, 5, 15, "low"),
        vs.Run(0, 10, 20, "low"),
        vs.Run(0, 15.5, 25.5, "low"),  # took the slot freed at 15, after the submit at 12
        vs.Run(12, 20.5, 30.5, "high"),
    ]
    excess, inversions = vs.priority_figures(runs, 2)
    assert excess == pytest.approx(5.5)
    assert inversions == 1


def test_a_low_job_in_a_slot_freed_before_the_probe_is_no_inversion() -> None:
    runs = [
        vs.Run(0, 5, 15, "low"),
        vs.Run(0, 10, 20, "low"),
        vs.Run(0, 15.5, 25.5, "low"),  # the slot freed at 15, before the submit at 15.2
        vs.Run(15.2, 20.5, 30.5, "high"),
    ]
    assert vs.priority_figures(runs, 2) == (pytest.approx(0.5), 0)


def test_freed_at_gives_each_start_the_slot_freed_earliest() -> None:
    runs = [vs.Run(0, 0, 10), vs.Run(0, 1, 12), vs.Run(0, 10.5, 20), vs.Run(0, 12.5, 22)]
    taken = vs.freed_at(runs, 2)
    assert taken[0] == taken[1] == -float("inf")
    assert (taken[2], taken[3]) == (10, 12)


def test_fairness_share_and_wait() -> None:
    # two slots, window 0..40: B holds a slot 0..10 and 21..31, 20 of the 80 slot-seconds
    runs = [
        vs.Run(0, 0, 10, "b"),  # a free slot at its submit: 10 before the next slot end
        vs.Run(0, 0, 20, "a"),
        vs.Run(0, 10, 20, "a"),
        vs.Run(11, 21, 31, "b"),  # submitted at 11: the next slot end is 20, so it waited 1
        vs.Run(0, 20, 40, "a"),
        vs.Run(0, 31, 45, "a"),
    ]
    share, wait = vs.fairness_figures(runs, 2, 0.0, 40.0)
    assert share == pytest.approx(20 / 80)
    assert wait == pytest.approx((0 - 10 + 1) / 2)


def test_flood_figures_end_with_a_and_count_every_slot_second() -> None:
    runs = [vs.Run(0, 0, 10, "a"), vs.Run(0, 0, 5, "b"), vs.Run(0, 12, 20, "a")]
    figures = vs.flood_figures(runs, 2, 0.0)
    assert figures["busy"] == pytest.approx((10 + 5 + 8) / 40)
    assert figures["share"] == pytest.approx(5 / 40)


def test_fairness_clips_to_the_window() -> None:
    runs = [vs.Run(0, -5, 5, "b"), vs.Run(0, 35, 45, "b")]
    share, _ = vs.fairness_figures(runs, 1, 0.0, 40.0)
    assert share == pytest.approx(10 / 40)


async def test_tcp_traffic_counts_what_crosses_a_loopback_connection() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with listeners[0], await trio.open_tcp_stream("127.0.0.1", port) as client:
        server = await listeners[0].accept()
        async with server:
            before = vs.tcp_traffic(port)
            await client.send_all(b"x" * 100)
            received = b""
            while len(received) < 100:
                received += await server.receive_some()
            await server.send_all(b"y" * 30)
            received = b""
            while len(received) < 30:
                received += await client.receive_some()
            after = vs.tcp_traffic(port)
            mine = client.socket.getsockname()[1]
            other = vs.tcp_traffic(port, {mine + 1 if mine < 65535 else mine - 1})
    assert before.connections == after.connections == 1
    assert after.payload - before.payload == 130
    assert after.segments - before.segments == 2
    assert other.connections == 0
