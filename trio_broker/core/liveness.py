"""The protocol's liveness rule, shared by both sides (sans-IO, time passed in).

Each side sends ``PING`` when it has sent nothing for ``ping_interval``, and
declares its peer dead when it has received nothing at all for ``ping_timeout``.
Any frame counts as a sign of life, in either direction. The cores keep the
last-sent and last-received instants per connection and ask this rule, at their
timers, what to do and when to look again.
"""

from __future__ import annotations

import attrs

__all__ = ["Liveness"]


@attrs.frozen
class Liveness:
    """The liveness timing of one side. Durations are seconds."""

    ping_interval: float
    ping_timeout: float

    def ping(self, last_sent: float, now: float) -> tuple[bool, float]:
        """Whether a ``PING`` is due now, and when to look again."""
        due = last_sent + self.ping_interval
        if due <= now:
            return True, now + self.ping_interval
        return False, due

    def dead(self, last_received: float, now: float) -> float | None:
        """None when the peer is dead now, otherwise when to look again."""
        due = last_received + self.ping_timeout
        return None if due <= now else due

    @property
    def reason(self) -> str:
        """Why a connection is closed as dead."""
        return f"nothing received for {self.ping_timeout:g}s"
