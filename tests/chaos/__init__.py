"""The chaos soak of the whole installation: ``python -m tests.chaos``, or its tests here."""
