"""The public model check of the dispatch core, run against several admission settings."""

from __future__ import annotations

import os

from hypothesis import settings

from trio_broker.core.admission import AdmissionConfig
from trio_broker.testing.dispatch import dispatch_machine

# TRIO_BROKER_MODEL_SCALE (default 1) scales the budget, as in test_model.py
_SCALE = float(os.environ.get("TRIO_BROKER_MODEL_SCALE", "1"))
_STEPS = settings(max_examples=max(5, round(300 * _SCALE)), stateful_step_count=50)

TestSmallFleet = dispatch_machine().TestCase
TestSmallFleet.settings = _STEPS

TestNoOddReserve = dispatch_machine(
    admission=AdmissionConfig(cpus=2, odd_reserve=0, db_pool=4), local_limit=1
).TestCase
TestNoOddReserve.settings = _STEPS

TestFixedCapBigReserve = dispatch_machine(
    admission=AdmissionConfig(cpus=0, odd_reserve=5, max_in_flight=3, use_idle=False),
    local_limit=3,
    retry_delay=0.0,
    priorities=(-1, 0, 1, 4),
    unknown_service_attempts={"local": 1, "exec_b": 3},
).TestCase
TestFixedCapBigReserve.settings = _STEPS

TestAdaptiveRiseSmallCap = dispatch_machine(
    admission=AdmissionConfig(cpus=1, odd_reserve=1, max_in_flight=6, adapt_interval=1.0),
    local_limit=4,
    priorities=(0, 1, 2),
).TestCase
TestAdaptiveRiseSmallCap.settings = _STEPS
