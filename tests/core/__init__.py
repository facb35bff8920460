"""Tests of the sans-IO core (trio_broker/core)."""
