"""Fixtures of the network tests: test hosts in namespaces, and folders PostgreSQL can reach."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.netns import Network, open_network, require_namespaces

HOSTS = ("fylr", "exec-a", "exec-b")
"""The hosts of every network test: one fylr and two execservers."""


@pytest.fixture
def network() -> Iterator[Network]:
    """Three test hosts on one switch, deleted afterwards however the test ends."""
    require_namespaces()
    with open_network(*HOSTS) as net:
        yield net


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder of this test's own that the ``postgres`` user can pass through.

    pytest's ``tmp_path`` is private to root, but a fylr started as root runs its
    private PostgreSQL as ``postgres`` in ``state_dir/pg``.
    """
    folder = Path(tempfile.mkdtemp(prefix="trio-broker-net-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
