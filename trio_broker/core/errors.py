"""Exceptions a library user catches around :meth:`BrokerClient.run`.

They are split by what the caller should do next: :class:`NoSlot` and
:class:`NoExecserver` mean "try again later" (a queue requeues the item),
:class:`UnknownService` means the fleet cannot run this at all, and
:class:`JobLost` means the job may have run but its end will never be known.
"""

from __future__ import annotations

__all__ = ["BrokerError", "ClientClosed", "JobLost", "NoExecserver", "NoSlot", "UnknownService"]


class BrokerError(Exception):
    """Base class: the broker could not get this job run to a known end."""


class NoSlot(BrokerError):
    """No execserver offered a slot within ``connect_timeout``."""


class NoExecserver(BrokerError):
    """No execserver is reachable right now."""


class UnknownService(BrokerError):
    """No reachable execserver offers this service."""


class JobLost(BrokerError):
    """The connection holding the job's slot closed before its ``DONE``."""


class ClientClosed(BrokerError):
    """The client was closed while the job waited or ran."""
