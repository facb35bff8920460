"""The README's Python examples run as written (against the real library)."""

from __future__ import annotations

import builtins
import re
from pathlib import Path
from typing import Any

import pytest
import trio

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS: list[str] = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def block(containing: str) -> str:
    (found,) = [text for text in BLOCKS if containing in text]
    return found


def test_every_example_compiles() -> None:
    """Each python block of the README is valid Python."""
    assert len(BLOCKS) >= 4
    for text in BLOCKS:
        compile(text, "README.md", "exec")


def test_the_core_example_offers_the_slot() -> None:
    """The sans-IO example prints HELLO then an OFFER for j1."""
    printed: list[tuple[Any, ...]] = []
    namespace: dict[str, Any] = {"print": lambda *args: printed.append(args)}
    exec(block("broker.frames_to_send()"), namespace)
    messages = [args[1] for args in printed if len(args) == 2]
    assert [m.TYPE for m in messages] == ["HELLO", "OFFER"]
    assert messages[1].job_id == "j1"


def test_the_execserver_example_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded-execserver example binds and says where; then it is stopped."""
    text = block("serve_execserver, config")
    text = text.replace("trio.run(main)", "")
    text = text.replace('"127.0.0.1:7000"', '"127.0.0.1:0"')
    namespace: dict[str, Any] = {}
    exec(text, namespace)
    seen: list[str] = []

    async def run() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                def record(*args: object) -> None:
                    seen.append(" ".join(map(str, args)))
                    nursery.cancel_scope.cancel()

                monkeypatch.setattr(builtins, "print", record)
                nursery.start_soon(namespace["main"])

    trio.run(run)
    assert seen
    assert seen[0].startswith("serving ws://127.0.0.1:")


def test_the_model_check_example_builds_test_cases() -> None:
    """The model-check example makes three unittest TestCase classes."""
    namespace: dict[str, Any] = {}
    exec(block("broker_machine("), namespace)
    for name in ("TestMyPool", "TestFairness", "TestRaces"):
        assert namespace[name].__name__
