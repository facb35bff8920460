"""Optional OpenTelemetry traces: one span per slot wait and job run, and the
trace context carried across processes.

With the ``otel`` extra installed (``opentelemetry-api``), the library opens
spans through the global tracer provider, which the application configures
(``opentelemetry.sdk``, or ``opentelemetry-instrument`` from its environment);
without a configured provider the API's spans are no-ops. Without the package,
every function here does nothing and returns ``None``: the library runs as it
always did, and ``JOB`` frames carry no ``traceparent``.

Where the spans are:

- ``trio_broker.slot_wait`` (client): from :meth:`BrokerClient.run
  <trio_broker.trio.client.BrokerClient.run>` asking for a slot until an offer
  is taken, or the wait fails. The ``JOB`` frame carries the caller's context
  (W3C ``traceparent``, :func:`current_traceparent`), so the execserver's span
  is a child of whatever span the caller had open (the fylr's step).
- ``trio_broker.job`` (execserver): the job's run, from ``JOB`` to its receipt,
  child of the ``traceparent`` the frame brought (a new trace without one, or
  with one that is not a valid W3C ``traceparent``).
- ``trio_broker.step`` (dispatcher): one claimed queue item's handler and its
  verdict, child of the ``traceparent`` its payload holds: :func:`enqueue_in
  <trio_broker.trio.store.enqueue_in>` records the span current when an item is
  queued, so steps queued by a request or another step join its trace.

The propagation is W3C Trace Context whatever propagator the application
configured: the wire member is a ``traceparent`` by definition.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final

try:
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed
    _trace = None  # type: ignore[assignment]

__all__ = [
    "ENABLED",
    "TRACER_NAME",
    "Span",
    "current_traceparent",
    "end_span",
    "set_attributes",
    "set_error",
    "set_tracer_provider",
    "span",
    "start_span",
]

TRACER_NAME: Final = "trio_broker"
"""The instrumentation scope of every span the library opens."""

ENABLED: Final = _trace is not None
"""Whether ``opentelemetry-api`` is importable (the ``otel`` extra)."""

Span = Any
"""An OpenTelemetry span, or ``None`` without the extra (typed loosely on purpose:
the package may be absent)."""

_PROPAGATOR: Final = TraceContextTextMapPropagator() if _trace is not None else None
_provider: Any = None  # set_tracer_provider's; None: OpenTelemetry's global provider


def set_tracer_provider(provider: Any) -> None:
    """Open the library's spans through ``provider`` rather than OpenTelemetry's
    global one (``None``: the global one again), for a program that keeps its
    provider to itself (or a test that reads its own in-memory exporter)."""
    global _provider
    _provider = provider


def _tracer() -> Any:
    assert _trace is not None
    return _trace.get_tracer(TRACER_NAME, tracer_provider=_provider)


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, or ``None`` (no extra, no span,
    or a span that is not sampled into a real trace)."""
    if _PROPAGATOR is None:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


@contextmanager
def span(
    name: str,
    *,
    traceparent: str | None = None,
    remote: bool = False,
    kind: str = "internal",
    attributes: Mapping[str, str | int | float | bool | None] | None = None,
) -> Iterator[Span]:
    """Open a span (current within the block) and yield it; ``None`` without the extra.

    Args:
        name: the span's name.
        traceparent: when ``remote`` is set, the parent's W3C context (``None`` or
            an invalid one: the span starts a new trace).
        remote: take the parent from ``traceparent`` rather than the current context.
        kind: ``internal``, ``client``, ``server``, ``producer`` or ``consumer``.
        attributes: set on the span; ``None`` values are left out.

    An exception leaving the block is recorded on the span and sets its status
    to error, then goes on.
    """
    if _trace is None:
        yield None
        return
    context = None
    if remote:
        assert _PROPAGATOR is not None
        carrier = {} if traceparent is None else {"traceparent": traceparent}
        context = _PROPAGATOR.extract(carrier)
    with _tracer().start_as_current_span(
        name,
        context=context,
        kind=_trace.SpanKind[kind.upper()],
        attributes=_clean(attributes),
    ) as opened:
        yield opened


def start_span(
    name: str, *, attributes: Mapping[str, str | int | float | bool | None] | None = None
) -> Span:
    """Start a span, child of the current one, that :func:`end_span` ends (it is
    not made current: for a wait that ends in another task); ``None`` without
    the extra."""
    if _trace is None:
        return None
    return _tracer().start_span(name, attributes=_clean(attributes))


def end_span(opened: Span, *, error: str | None = None, **attributes: str | int | None) -> None:
    """End a span from :func:`start_span` with these attributes, failed when
    ``error`` says why (nothing without the extra, or when it already ended)."""
    if opened is None or not opened.is_recording():
        return
    set_attributes(opened, attributes)
    if error is not None:
        set_error(opened, error)
    opened.end()


def set_attributes(opened: Span, attributes: Mapping[str, str | int | float | bool | None]) -> None:
    """Set attributes on a span from :func:`span` (nothing without the extra)."""
    if opened is not None:
        opened.set_attributes(_clean(attributes))


def set_error(opened: Span, description: str) -> None:
    """Mark a span from :func:`span` as failed, with why (nothing without the extra)."""
    if opened is not None and _trace is not None:
        opened.set_status(_trace.Status(_trace.StatusCode.ERROR, description))


def _clean(
    attributes: Mapping[str, str | int | float | bool | None] | None,
) -> dict[str, str | int | float | bool]:
    return {k: v for k, v in (attributes or {}).items() if v is not None}
