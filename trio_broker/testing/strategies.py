"""Hypothesis strategies for the wire messages of :mod:`trio_broker.core.protocol`.

Every strategy generates values that :func:`trio_broker.core.protocol.encode` accepts
and that survive a round trip through the codec unchanged.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from trio_broker.core import protocol as p

__all__ = [
    "ids",
    "int32",
    "json_objects",
    "json_values",
    "messages",
    "messages_of",
    "receipts",
    "texts",
]

texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
"""Strings of Unicode scalar values (no lone surrogates: they are not UTF-8)."""

ids = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=p.MAX_ID_CHARS)
"""Valid ``job_id`` and ``service`` values."""

int32 = st.integers(min_value=p.INT32_MIN, max_value=p.INT32_MAX)
counts = st.integers(min_value=0, max_value=p.INT32_MAX)
byte_counts = st.integers(min_value=0, max_value=p.INT64_MAX)
numbers = st.floats(allow_nan=False, allow_infinity=False)

json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | numbers
    | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
"""Any JSON value that orjson encodes and decodes back to an equal value."""

json_objects: st.SearchStrategy[dict[str, Any]] = st.dictionaries(texts, json_values, max_size=5)

receipts = st.builds(
    p.Receipt,
    status=st.sampled_from(
        ["ok", "failed", "timed_out", "stalled", "out_of_memory", "stopped", "cancelled", "error"]
    ),
    exit_code=st.none() | int32,
    error=st.none() | texts,
    stderr_line=st.none() | texts,
    stdout_prefix=texts,
    stdout_bytes=byte_counts,
    stdin_bytes=byte_counts,
    started_at=numbers,
    duration_s=numbers,
    peak_memory=st.none() | byte_counts,
    instance_id=texts,
)

_service_infos = st.builds(
    p.ServiceInfo, max_slots=counts, kind=st.sampled_from(["light", "heavy", "unknown"])
)

_service_figures = st.builds(
    p.ServiceFigures,
    kind=st.sampled_from(["light", "heavy", "unknown"]),
    capacity=counts,
    mean_s=st.none() | numbers,
    running=counts,
    waiting=counts,
)

_BY_TYPE: dict[str, st.SearchStrategy[Any]] = {
    "HELLO": st.builds(
        p.Hello,
        protocol=int32,
        instance_id=texts,
        name=texts,
        services=st.dictionaries(texts, _service_infos, max_size=4),
        processes=counts,
        idle=counts,
        clients=counts,
        draining=st.booleans(),
        addr=texts,
    ),
    "REGISTER": st.builds(
        p.Register,
        backend_id=texts,
        name=texts,
        version=texts,
        callback_url=st.none() | texts,
    ),
    "WANT": st.builds(p.Want, job_id=ids, service=ids, priority=int32),
    "QUEUED": st.builds(p.Queued, job_id=ids),
    "UNWANT": st.builds(p.Unwant, job_id=ids),
    "OFFER": st.builds(p.Offer, job_id=ids, token=texts),
    "JOB": st.builds(
        p.Job,
        job_id=ids,
        token=texts,
        service=ids,
        subject=st.none() | texts,
        job=json_objects,
        traceparent=st.none() | texts,
    ),
    "DECLINE": st.builds(p.Decline, token=texts),
    "CANCEL": st.builds(p.Cancel, job_id=ids),
    "DONE": st.builds(p.Done, job_id=ids, receipt=receipts),
    "QUERY": st.builds(p.Query, job_id=ids),
    "POSITION": st.builds(
        p.Position,
        job_id=ids,
        running=counts,
        ahead=counts,
        capacity=counts,
        eta_s=st.none() | numbers,
    ),
    "ERROR": st.builds(
        p.Error,
        code=st.sampled_from(
            [
                "bad_frame",
                "unknown_type",
                "bad_field",
                "not_registered",
                "already_registered",
                "draining",
                "unknown_service",
                "duplicate_job",
                "unknown_token",
                "token_mismatch",
                "unknown_job",
                "offer_expired",
                "too_many_wants",
            ]
        ),
        message=texts,
        job_id=st.none() | texts,
    ),
    "PING": st.builds(p.Ping, nonce=texts),
    "PONG": st.builds(p.Pong, nonce=texts),
    "SUBSCRIBE": st.builds(p.Subscribe, job_id=st.none() | texts),
    "UNSUBSCRIBE": st.builds(p.Unsubscribe, job_id=st.none() | texts),
    "STATS": st.builds(
        p.Stats,
        instance_id=texts,
        name=texts,
        slots=counts,
        fast_reserve=counts,
        running=counts,
        offered=counts,
        waiting=counts,
        finished=byte_counts,
        failed=byte_counts,
        per_minute=counts,
        bytes_in=byte_counts,
        bytes_out=byte_counts,
        clients=counts,
        draining=st.booleans(),
        callback_check=st.none() | texts,
        services=st.dictionaries(texts, _service_figures, max_size=4),
        waiting_by_priority=st.lists(
            st.builds(p.PriorityCount, priority=int32, waiting=counts), max_size=4
        ).map(tuple),
    ),
}


def messages_of(message_type: str) -> st.SearchStrategy[Any]:
    """Valid messages of one wire ``type`` (``"WANT"``, ``"HELLO"``, ...)."""
    return _BY_TYPE[message_type]


messages: st.SearchStrategy[p.Message] = st.one_of(*_BY_TYPE.values())
"""Valid messages of every type."""
