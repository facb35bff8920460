"""The package's face: the documented names import from ``trio_broker``, core names
without loading trio."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import trio_broker


def test_every_exported_name_resolves() -> None:
    """Each name of ``trio_broker.__all__`` is an attribute, the same object as at its home."""
    for name in trio_broker.__all__:
        assert getattr(trio_broker, name) is not None
    from trio_broker.core.broker import Broker
    from trio_broker.trio.client import open_broker_client

    assert trio_broker.Broker is Broker
    assert trio_broker.open_broker_client is open_broker_client
    assert trio_broker.protocol.decode is not None


def test_core_names_from_the_package_leave_trio_unloaded() -> None:
    """``from trio_broker import Broker, ClientCore, protocol …`` loads only the core."""
    code = (
        "import sys\n"
        "from trio_broker import Broker, ClientCore, WantBook, PoolConfig, NoSlot, protocol\n"
        "from trio_broker import DispatchCore, JobSpec, ArgvTemplate, AdmissionConfig\n"
        "assert 'trio' not in sys.modules, sorted(m for m in sys.modules if 'trio' in m)\n"
    )
    env = {**os.environ, "HYPOTHESIS_NO_PLUGINS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)


def test_an_unknown_name_is_an_attribute_error() -> None:
    """A typo fails like any module attribute, naming what was asked for."""
    with pytest.raises(AttributeError, match="open_broker"):
        trio_broker.open_broker  # noqa: B018
