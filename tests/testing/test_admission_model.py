"""The admission's model check (trio_broker.testing.admission), over several knobs."""

from __future__ import annotations

import os

from hypothesis import settings

from trio_broker.core.admission import AdmissionConfig
from trio_broker.testing.admission import admission_machine

# TRIO_BROKER_MODEL_SCALE (default 1) scales the budget, as in test_model.py
_SCALE = float(os.environ.get("TRIO_BROKER_MODEL_SCALE", "1"))
_STEPS = settings(max_examples=max(5, round(60 * _SCALE)), stateful_step_count=40)

TestAdmissionDefaults = admission_machine(AdmissionConfig(cpus=2)).TestCase
TestAdmissionDefaults.settings = _STEPS

# a fixed cap the rise runs into, no odd reserve, a short interval
TestAdmissionFixedCap = admission_machine(
    AdmissionConfig(cpus=1, odd_reserve=0, max_in_flight=9, adapt_interval=0.5)
).TestCase
TestAdmissionFixedCap.settings = _STEPS

# no rise by idle slots; a small database pool bounds the automatic cap
TestAdmissionNoIdle = admission_machine(
    AdmissionConfig(cpus=0, odd_reserve=3, db_pool=5, use_idle=False)
).TestCase
TestAdmissionNoIdle.settings = _STEPS
