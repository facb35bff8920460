"""Tests of the public model-check harness (trio_broker/testing)."""
