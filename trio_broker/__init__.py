"""trio_broker: a slot broker for scarce external jobs, on trio.

Execservers own pools of execution slots; clients park *wants* on them over one
persistent websocket each, and every freed slot is offered to exactly one want:
highest priority first, then round-robin across connections, then FIFO.

Importing this package, or its sans-IO core (:mod:`trio_broker.core.protocol` and the
core modules), does not import trio: the trio layer lives in its own modules.
"""

from trio_broker._version import __version__

__all__ = ["__version__"]
