"""How long the fylr's steps take, by action, service and outcome.

Every dispatcher action is wrapped (:func:`timed`): its handler starts a clock
in the step's task (a context variable: the handler, the job it runs and the
settle hook all run in that one task), :func:`step_service` names the
execserver service a step's job asked for, and the settle hook, called once
with the dispatcher's decision, counts the step's duration from its handler's
start to that decision into :meth:`FylrState.observe_step
<trio_broker_daemons.fylr.state.FylrState.observe_step>` under the decision's
outcome (``ok``, ``failed``, ``no_slot``, ``no_execserver``, ...). A step that
ran no job is counted under the service ``local``.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar
from typing import Final

import attrs
import trio

from trio_broker.core.dispatch import Decision
from trio_broker.trio.dispatcher import Action
from trio_broker.trio.store import QueueItem
from trio_broker_daemons.fylr.state import FylrState

__all__ = ["LOCAL", "step_service", "timed"]

LOCAL: Final = "local"
"""The service label of a step that ran no job on an execserver."""


class _Timing:
    __slots__ = ("service", "started")

    def __init__(self, started: float) -> None:
        self.started = started
        self.service = LOCAL


_CURRENT: ContextVar[_Timing | None] = ContextVar("trio_broker_fylr_step", default=None)


def step_service(service: str) -> None:
    """Name the service whose job the running step asks for (nothing outside a step)."""
    timing = _CURRENT.get()
    if timing is not None:
        timing.service = service


def timed(state: FylrState, actions: Iterable[Action]) -> list[Action]:
    """The actions with their steps timed into ``state``'s step-duration histograms."""
    return [_timed(state, action) for action in actions]


def _timed(state: FylrState, action: Action) -> Action:
    handler = action.handler
    settle = action.settle

    async def timed_handler(item: QueueItem) -> None:
        _CURRENT.set(_Timing(trio.current_time()))
        await handler(item)

    async def timed_settle(item: QueueItem, decision: Decision) -> None:
        timing = _CURRENT.get()
        if timing is not None:  # counted once, though settling may be tried again
            _CURRENT.set(None)
            state.observe_step(
                item.action,
                timing.service,
                decision.verdict.outcome,
                trio.current_time() - timing.started,
            )
        if settle is not None:
            await settle(item, decision)

    return attrs.evolve(action, handler=timed_handler, settle=timed_settle)
