"""Tests of the trio layer (trio_broker/trio)."""
