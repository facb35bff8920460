"""The client core's timers model check (trio_broker.testing.client_timers)."""

from __future__ import annotations

import os

from hypothesis import settings

from trio_broker.testing.client_timers import client_timers_machine

# TRIO_BROKER_MODEL_SCALE (default 1) scales the budget, as in test_model.py
_SCALE = float(os.environ.get("TRIO_BROKER_MODEL_SCALE", "1"))
_STEPS = settings(max_examples=max(5, round(60 * _SCALE)), stateful_step_count=40)

TestClientTimers = client_timers_machine().TestCase
TestClientTimers.settings = _STEPS

# intervals that meet in floating point: 0.1 steps against a 0.3 s growth interval
TestClientTimersFine = client_timers_machine(
    connect_timeout=0.7, grow_interval=0.3, retry_tick=0.1
).TestCase
TestClientTimersFine.settings = _STEPS
