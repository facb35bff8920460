"""Checks shared by the core's tests on its value classes."""

from __future__ import annotations

from types import ModuleType

import attrs


def assert_keyword_only(module: ModuleType) -> None:
    """Every attrs class defined in the module takes its fields by keyword only.

    The core's value classes promise it, so that fields can be added or reordered
    without breaking a caller.
    """
    classes = [
        value
        for value in vars(module).values()
        if isinstance(value, type) and attrs.has(value) and value.__module__ == module.__name__
    ]
    assert classes, f"{module.__name__} defines no attrs class"
    for cls in classes:
        positional = [field.name for field in attrs.fields(cls) if not field.kw_only]
        assert not positional, f"{cls.__name__} takes {positional} by position"
