"""Helpers the tests share: a private PostgreSQL, wire peers, worker processes."""
