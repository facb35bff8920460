"""The client core's rules one at a time, with explicit clocks (beside test_client.py's
scenarios): usage errors, queries, counts, callback bases, liveness, growth timing."""

from __future__ import annotations
