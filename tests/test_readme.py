"""The Python examples of README.md and daemons/README.md run as written (against the
real library) and print what their text says they print."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "README.md", ROOT / "daemons" / "README.md")
BLOCKS: list[str] = [
    text
    for document in DOCUMENTS
    for text in re.findall(r"```python\n(.*?)```", document.read_text(encoding="utf-8"), re.S)
]

# What identifies each example; every block must be one of these (a new example
# needs a test that runs it).
CORE = "broker.frames_to_send()"
EXECSERVER = "CommandRunner(services)"
CLIENT = "open_broker_client(config"
MODEL_CHECKS = "broker_machine("
SIMULATION = "capacity_report("
MARKERS = (CORE, EXECSERVER, CLIENT, MODEL_CHECKS, SIMULATION)


def block(containing: str) -> str:
    (found,) = [text for text in BLOCKS if containing in text]
    return found


def printing(lines: list[str], extra: Callable[[], None] | None = None) -> dict[str, Any]:
    """A namespace whose ``print`` records each line (and calls ``extra`` after)."""

    def record(*args: object) -> None:
        lines.append(" ".join(map(str, args)))
        if extra is not None:
            extra()

    return {"print": record, "__name__": "readme_example"}


def test_every_example_compiles_and_is_run_by_a_test() -> None:
    """Each python block is valid Python and is exactly one of the examples run below."""
    assert len(BLOCKS) >= 5
    for text in BLOCKS:
        compile(text, "README.md", "exec")
        assert sum(marker in text for marker in MARKERS) == 1, text[:200]


def test_the_core_example_offers_the_slot() -> None:
    """The sans-IO example prints HELLO then an OFFER for j1."""
    printed: list[tuple[Any, ...]] = []
    namespace: dict[str, Any] = {"print": lambda *args: printed.append(args)}
    exec(block(CORE), namespace)
    messages = [args[1] for args in printed if len(args) == 2]
    assert [m.TYPE for m in messages] == ["HELLO", "OFFER"]
    assert messages[1].job_id == "j1"


def without_run(text: str) -> str:
    """The example without its last line, ``trio.run(main)``, and on a free port."""
    assert text.rstrip().endswith("trio.run(main)")
    return text.rstrip().removesuffix("trio.run(main)").replace("127.0.0.1:7000", "127.0.0.1:0")


def test_the_execserver_and_client_examples_run_a_job() -> None:
    """The execserver example serves the service the client example calls, with the
    parameters and pipes it sends: the job ends ok and both print what the text says."""
    served: list[str] = []
    serving = trio.Event()
    execserver = printing(served, serving.set)
    exec(without_run(block(EXECSERVER)), execserver)
    printed: list[str] = []
    client = printing(printed)
    client_text = without_run(block(CLIENT))

    async def run() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(execserver["main"])
                await serving.wait()
                found = re.fullmatch(r"serving ws://(127\.0\.0\.1:(\d+))/broker", served[0])
                assert found is not None, served
                exec(client_text.replace("127.0.0.1:0", found[1]), client)
                await client["main"]()
                nursery.cancel_scope.cancel()

    trio.run(run)
    assert len(printed) == 1, "the client example printed nothing"
    assert re.fullmatch(r"ok (\d+) bytes in, (\d+) out", printed[0]), printed
    _, text_in, _, _, compressed, _ = printed[0].split()
    assert int(text_in) == len(client["TEXT"])
    assert 0 < int(compressed) < int(text_in)
    # what the text says they print: the figures are those of a run (gzip -9 of that text)
    port = served[0].rsplit(":", 1)[1].split("/")[0]
    said_served = re.search(r"# (serving ws://\S*)", block(EXECSERVER))
    assert said_served is not None
    assert served == [said_served[1].replace(":7000", ":" + port)]
    said = re.search(r"# (ok \d+ bytes in, \d+ out)", block(CLIENT))
    assert said is not None
    assert said[1] == printed[0]


def test_the_model_check_example_builds_test_cases() -> None:
    """The model-check example makes three unittest TestCase classes."""
    namespace: dict[str, Any] = {}
    exec(block(MODEL_CHECKS), namespace)
    for name in ("TestMyPool", "TestFairness", "TestRaces"):
        assert namespace[name].__name__


def test_the_simulation_example_prints_a_capacity_report() -> None:
    """The simulation example's seeds pass their checks and it prints the capacity
    report the text lists: throughput, slot use per pod, waits per priority, shares."""
    printed: list[str] = []
    exec(block(SIMULATION), printing(printed))
    (report,) = printed
    assert report.startswith("scenario two-pods + 1: 2 seeds")
    for part in ("throughput", "slot use", "wait", "priority", "share"):
        assert part in report
