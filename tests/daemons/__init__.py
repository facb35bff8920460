"""Tests of the reference daemons (daemons/trio_broker_daemons)."""
