"""Several client cores on one balanced, mixed fleet (trio_broker.testing.fleet_machine)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from trio_broker.testing.fleet_machine import fleet_machine

# TRIO_BROKER_MODEL_SCALE (default 1) scales the budget, as in test_model.py
_SCALE = float(os.environ.get("TRIO_BROKER_MODEL_SCALE", "1"))
_STEPS = settings(max_examples=max(5, round(40 * _SCALE)), stateful_step_count=30, deadline=None)
_SOAK = settings(max_examples=2000, stateful_step_count=80, deadline=None)

# two clients, the first pod in rotation offering only "a", the second "a" and "b"
TestTwoClients = fleet_machine(clients=2).TestCase
TestTwoClients.settings = _STEPS

# three clients on three pods of which only the last offers "b"
TestThreeClients = fleet_machine(clients=3, pods=(("a",), ("a",), ("a", "b"))).TestCase
TestThreeClients.settings = _STEPS


@pytest.mark.soak
class TestFleetSoak(fleet_machine(clients=3, pods=(("a",), ("a", "c"), ("a", "b"))).TestCase):  # type: ignore[misc]
    """A bigger budget, three clients and three pods offering three services (make soak)."""

    settings = _SOAK
