"""The wire messages of the broker protocol, version 1, and their codec.

Every application message is one websocket text frame holding one JSON object
with a ``"type"`` member. This module turns such text into frozen message values
and back, and it is the one place where wire input is validated: a message value
that :func:`decode` returns is known to respect every type and range rule of the
protocol, so the rest of the library never re-checks a field.

Rules enforced here:

* A frame that is not JSON, not an object, binary, or has no string ``type`` is
  ``bad_frame``. A ``type`` that is unknown, or not accepted in the direction the
  caller says it is reading, is ``unknown_type``. A required member that is missing,
  or a member of the wrong JSON type or out of range, is ``bad_field``.
* Members that are not part of a message are ignored (forward compatibility).
  A member whose type is "or null" may be left out, meaning null.
* Integers are JSON integers (never ``true`` or ``1.0``) within the signed 32-bit
  range; counts are additionally non-negative. The byte counts of a receipt are
  the one exception: they are non-negative 64-bit integers, since a job's memory
  peak or output easily exceeds 2 GiB.
* ``job_id`` and ``service`` are 1 to 200 characters (code points); the strings
  of ``REGISTER`` are bounded too (``backend_id``, ``name`` and ``version`` at most
  200 characters, ``callback_url`` at most 2,048), since the execserver keeps them
  for as long as the connection lives. ``JOB.subject`` is a label of any length on
  the wire; the broker keeps at most :data:`MAX_SUBJECT_CHARS` of it.
* Strings are Unicode scalar values: a lone surrogate, escaped or not, makes the
  frame ``bad_frame`` (it cannot be represented as UTF-8).

:func:`decode` raises :class:`ProtocolError` and nothing else, whatever the input
(the class lives in :mod:`trio_broker.core.errors`, in the remote branch of the
library's exception tree, with :data:`ErrorCode`, the codes of ``ERROR`` frames;
both are re-exported here, the names of the wire's ``Error`` message).
"""

import math
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Final, Literal, TypeAlias, get_args

import attrs
import orjson
from cattrs.errors import ClassValidationError, IterableValidationError
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override
from cattrs.preconf.orjson import make_converter

from trio_broker.core.errors import ErrorCode, ProtocolError

__all__ = [
    "CLIENT_TO_EXEC",
    "CLOSE_GOING_AWAY",
    "CLOSE_NORMAL",
    "CLOSE_POLICY",
    "CLOSE_TOO_BIG",
    "EXEC_TO_CLIENT",
    "MAX_ID_CHARS",
    "MAX_LABEL_CHARS",
    "MAX_SUBJECT_CHARS",
    "MAX_URL_CHARS",
    "PROTOCOL_VERSION",
    "STATS_TAG",
    "Cancel",
    "Decline",
    "Done",
    "Error",
    "ErrorCode",
    "Hello",
    "Job",
    "Kind",
    "Message",
    "Offer",
    "Ping",
    "Pong",
    "Position",
    "PriorityCount",
    "ProtocolError",
    "Query",
    "Queued",
    "Receipt",
    "Register",
    "ServiceFigures",
    "ServiceInfo",
    "Stats",
    "Status",
    "Subscribe",
    "Unsubscribe",
    "Unwant",
    "Want",
    "clip_subject",
    "converter",
    "decode",
    "encode",
]

PROTOCOL_VERSION: Final = 1
MAX_ID_CHARS: Final = 200
MAX_LABEL_CHARS: Final = 200
"""The longest ``REGISTER.backend_id``, ``name`` and ``version`` (code points)."""
MAX_URL_CHARS: Final = 2048
"""The longest ``REGISTER.callback_url`` (code points)."""
MAX_SUBJECT_CHARS: Final = 200
"""How much of a ``JOB.subject`` the execserver keeps (longer ones are cut: see
:func:`clip_subject`)."""
INT32_MIN: Final = -(2**31)
INT32_MAX: Final = 2**31 - 1
INT64_MAX: Final = 2**63 - 1

# The websocket close codes (RFC 6455) the protocol uses; both sides take them from here.
CLOSE_NORMAL: Final = 1000
"""The connection is not needed any more: a duplicate instance, a client closing."""
CLOSE_GOING_AWAY: Final = 1001
"""The peer sent nothing for ``ping_timeout``, or the execserver drained."""
CLOSE_POLICY: Final = 1008
"""The peer does not read its frames: its outbox overflowed."""
CLOSE_TOO_BIG: Final = 1009
"""A frame of more than ``max_frame_bytes`` bytes arrived."""

Kind: TypeAlias = Literal["light", "heavy", "unknown"]
"""How the pool classifies a service: by its measured mean runtime, or not yet."""

Status: TypeAlias = Literal[
    "ok", "failed", "timed_out", "stalled", "out_of_memory", "stopped", "cancelled", "error"
]
"""How a job ended (``Receipt.status``)."""

# Field types that carry a validation rule beyond their Python type. To a type
# checker they are plain ``str``/``int``; the converter hooks below enforce them.
JobId = Annotated[str, "job_id: 1..200 characters"]
ServiceName = Annotated[str, "service: 1..200 characters"]
Label = Annotated[str, "a REGISTER label: 0..200 characters"]
Url = Annotated[str, "a REGISTER callback_url: 0..2048 characters"]
Count = Annotated[int, "int32 >= 0"]
ByteCount = Annotated[int, "int64 >= 0"]
JsonObject = Annotated[dict[str, Any], "any JSON object"]


# -- messages -----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ServiceInfo:
    """One entry of ``HELLO.services``."""

    max_slots: Count
    kind: Kind


@attrs.frozen(kw_only=True)
class Receipt:
    """How a job ended; carried by ``DONE``. Every member is always sent."""

    status: Status
    exit_code: int | None = None
    error: str | None = None
    stderr_line: str | None = None
    stdout_prefix: str
    stdout_bytes: ByteCount
    stdin_bytes: ByteCount
    started_at: float
    duration_s: float
    peak_memory: ByteCount | None = None
    instance_id: str


@attrs.frozen(kw_only=True)
class Hello:
    """exec → client: the capability snapshot, first on every connection."""

    TYPE: ClassVar[str] = "HELLO"
    protocol: int
    instance_id: str
    name: str
    services: Mapping[str, ServiceInfo]
    processes: Count
    idle: Count
    clients: Count
    draining: bool
    addr: str


@attrs.frozen(kw_only=True)
class Register:
    """client → exec: who the client is; once, before any ``WANT``."""

    TYPE: ClassVar[str] = "REGISTER"
    backend_id: Label
    name: Label
    version: Label
    callback_url: Url | None = None


@attrs.frozen(kw_only=True)
class Want:
    """client → exec: a job waits for a slot."""

    TYPE: ClassVar[str] = "WANT"
    job_id: JobId
    service: ServiceName
    priority: int


@attrs.frozen(kw_only=True)
class Queued:
    """exec → client: no slot fits now; the want is parked."""

    TYPE: ClassVar[str] = "QUEUED"
    job_id: JobId


@attrs.frozen(kw_only=True)
class Unwant:
    """client → exec: withdraw a parked want or release its outstanding offer."""

    TYPE: ClassVar[str] = "UNWANT"
    job_id: JobId


@attrs.frozen(kw_only=True)
class Offer:
    """exec → client: a slot is reserved for this job until the token expires."""

    TYPE: ClassVar[str] = "OFFER"
    job_id: JobId
    token: str


@attrs.frozen(kw_only=True)
class Job:
    """client → exec: redeem an offer's token and start the job."""

    TYPE: ClassVar[str] = "JOB"
    job_id: JobId
    token: str
    service: ServiceName
    subject: str | None = None
    job: JsonObject
    traceparent: str | None = None
    """The caller's trace context (W3C ``traceparent``), written only when set."""


@attrs.frozen(kw_only=True)
class Decline:
    """client → exec: a surplus offer; free its slot at once."""

    TYPE: ClassVar[str] = "DECLINE"
    token: str


@attrs.frozen(kw_only=True)
class Cancel:
    """client → exec: abort a running job (or withdraw a parked one)."""

    TYPE: ClassVar[str] = "CANCEL"
    job_id: JobId


@attrs.frozen(kw_only=True)
class Done:
    """exec → client: the job ended."""

    TYPE: ClassVar[str] = "DONE"
    job_id: JobId
    receipt: Receipt


@attrs.frozen(kw_only=True)
class Query:
    """client → exec: where does this parked want stand?"""

    TYPE: ClassVar[str] = "QUERY"
    job_id: JobId


@attrs.frozen(kw_only=True)
class Position:
    """exec → client: the answer to ``QUERY``."""

    TYPE: ClassVar[str] = "POSITION"
    job_id: JobId
    running: Count
    ahead: Count
    capacity: Count
    eta_s: float | None = None


@attrs.frozen(kw_only=True)
class Error:
    """exec → client: a frame was refused (or, for ``offer_expired``, a notice)."""

    TYPE: ClassVar[str] = "ERROR"
    code: ErrorCode
    message: str
    job_id: str | None = None


@attrs.frozen(kw_only=True)
class Ping:
    """both: liveness probe; answered by a ``PONG`` with the same nonce."""

    TYPE: ClassVar[str] = "PING"
    nonce: str


@attrs.frozen(kw_only=True)
class Pong:
    """both: answer to a ``PING``."""

    TYPE: ClassVar[str] = "PONG"
    nonce: str


@attrs.frozen(kw_only=True)
class Subscribe:
    """client → exec: send ``STATS`` frames on this connection until ``UNSUBSCRIBE``.

    ``job_id`` is not a job: it is a tag that an older execserver echoes in its
    ``ERROR unknown_type`` answer, so the client can tell that this request was
    refused (the reference client sends :data:`STATS_TAG`).
    """

    TYPE: ClassVar[str] = "SUBSCRIBE"
    job_id: str | None = None


@attrs.frozen(kw_only=True)
class Unsubscribe:
    """client → exec: no more ``STATS`` frames on this connection."""

    TYPE: ClassVar[str] = "UNSUBSCRIBE"
    job_id: str | None = None


@attrs.frozen(kw_only=True)
class ServiceFigures:
    """One entry of ``STATS.services``."""

    kind: Kind
    capacity: Count
    mean_s: float | None = None
    running: Count
    waiting: Count


@attrs.frozen(kw_only=True)
class PriorityCount:
    """One entry of ``STATS.waiting_by_priority``."""

    priority: int
    waiting: Count


@attrs.frozen(kw_only=True)
class Stats:
    """exec → client: the execserver's figures, sent only to a subscribed connection."""

    TYPE: ClassVar[str] = "STATS"
    instance_id: str
    name: str
    slots: Count
    fast_reserve: Count
    running: Count
    offered: Count
    waiting: Count
    finished: ByteCount
    failed: ByteCount
    per_minute: Count
    bytes_in: ByteCount
    bytes_out: ByteCount
    clients: Count
    draining: bool
    callback_check: str | None = None
    services: Mapping[str, ServiceFigures]
    waiting_by_priority: tuple[PriorityCount, ...]


Message: TypeAlias = (
    Hello
    | Register
    | Want
    | Queued
    | Unwant
    | Offer
    | Job
    | Decline
    | Cancel
    | Done
    | Query
    | Position
    | Error
    | Ping
    | Pong
    | Subscribe
    | Unsubscribe
    | Stats
)

MESSAGE_TYPES: Final[dict[str, type[Message]]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Register,
        Want,
        Queued,
        Unwant,
        Offer,
        Job,
        Decline,
        Cancel,
        Done,
        Query,
        Position,
        Error,
        Ping,
        Pong,
        Subscribe,
        Unsubscribe,
        Stats,
    )
}
"""Every message class by its wire ``type``."""

CLIENT_TO_EXEC: Final = frozenset(
    {
        "REGISTER",
        "WANT",
        "UNWANT",
        "JOB",
        "DECLINE",
        "CANCEL",
        "QUERY",
        "PING",
        "PONG",
        "SUBSCRIBE",
        "UNSUBSCRIBE",
    }
)
"""The types an execserver accepts."""

EXEC_TO_CLIENT: Final = frozenset(
    {"HELLO", "QUEUED", "OFFER", "DONE", "POSITION", "ERROR", "PING", "PONG", "STATS"}
)
"""The types a client accepts."""

STATS_TAG: Final = "stats"
"""The ``job_id`` tag the reference client puts on ``SUBSCRIBE`` and ``UNSUBSCRIBE``."""


# -- the converter --------------------------------------------------------------


class _FieldError(ValueError):
    """A structure hook's refusal; its text completes "<member>: ..."."""


def _show(value: object) -> str:
    """A short JSON-ish rendering of an offending value for error messages."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return f"string {text!r}"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return repr(value)


def _strict_str(value: Any, _: Any) -> str:
    if type(value) is not str:
        raise _FieldError(f"expected a string, got {_show(value)}")
    return value


def _bounded_str(value: Any, _: Any) -> str:
    if type(value) is not str:
        raise _FieldError(f"expected a string, got {_show(value)}")
    if not 1 <= len(value) <= MAX_ID_CHARS:
        raise _FieldError(f"expected 1 to {MAX_ID_CHARS} characters, got {len(value)}")
    return value


def _at_most(limit: int) -> Callable[[Any, Any], str]:
    """The structure hook of a string of at most ``limit`` code points."""

    def check(value: Any, _: Any) -> str:
        if type(value) is not str:
            raise _FieldError(f"expected a string, got {_show(value)}")
        if len(value) > limit:
            raise _FieldError(f"expected at most {limit} characters, got {len(value)}")
        return value

    return check


def clip_subject(subject: str | None) -> str | None:
    """A ``JOB.subject`` as the execserver keeps it: at most :data:`MAX_SUBJECT_CHARS`.

    A longer one is cut to its first ``MAX_SUBJECT_CHARS - 1`` characters followed
    by ``…``, so the cut shows; the job itself is taken as usual.
    """
    if subject is None or len(subject) <= MAX_SUBJECT_CHARS:
        return subject
    return subject[: MAX_SUBJECT_CHARS - 1] + "…"


def _int32(value: Any, _: Any) -> int:
    if type(value) is not int:
        raise _FieldError(f"expected an integer, got {_show(value)}")
    if not INT32_MIN <= value <= INT32_MAX:
        raise _FieldError(f"expected a 32-bit integer, got {value}")
    return value


def _count(value: Any, _: Any) -> int:
    if type(value) is not int:
        raise _FieldError(f"expected an integer, got {_show(value)}")
    if not 0 <= value <= INT32_MAX:
        raise _FieldError(f"expected an integer from 0 to {INT32_MAX}, got {value}")
    return value


def _byte_count(value: Any, _: Any) -> int:
    if type(value) is not int:
        raise _FieldError(f"expected an integer, got {_show(value)}")
    if not 0 <= value <= INT64_MAX:
        raise _FieldError(f"expected an integer from 0 to 2**63-1, got {value}")
    return value


def _number(value: Any, _: Any) -> float:
    kind = type(value)
    if kind is not float and kind is not int:
        raise _FieldError(f"expected a number, got {_show(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise _FieldError(f"expected a finite number, got {value}")
    return result


def _boolean(value: Any, _: Any) -> bool:
    if type(value) is not bool:
        raise _FieldError(f"expected true or false, got {_show(value)}")
    return value


def _json_object(value: Any, _: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _FieldError(f"expected an object, got {_show(value)}")
    return value


def _literal_hook(allowed: tuple[str, ...]) -> Callable[[Any, Any], str]:
    choices = ", ".join(allowed)

    def structure(value: Any, _: Any) -> str:
        if type(value) is not str or value not in allowed:
            raise _FieldError(f"expected one of {choices}, got {_show(value)}")
        return value

    return structure


def _mapping_hook(cls: type[Any]) -> Callable[[Any, Any], dict[str, Any]]:
    """Structure a JSON object whose members are all ``cls`` objects (``HELLO.services``)."""

    def structure(value: Any, _: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise _FieldError(f"expected an object, got {_show(value)}")
        result: dict[str, Any] = {}
        for name, info in value.items():
            try:
                result[name] = converter.structure(info, cls)
            except (ClassValidationError, _FieldError) as exc:
                path, reason = _first_failure(exc)
                raise _NestedFieldError(f"{name}.{path}" if path else name, reason) from None
        return result

    return structure


def _array_hook(cls: type[Any]) -> Callable[[Any, Any], tuple[Any, ...]]:
    """Structure a JSON array whose items are all ``cls`` objects."""

    def structure(value: Any, _: Any) -> tuple[Any, ...]:
        if type(value) is not list:
            raise _FieldError(f"expected an array, got {_show(value)}")
        result = []
        for index, item in enumerate(value):
            try:
                result.append(converter.structure(item, cls))
            except (ClassValidationError, _FieldError) as exc:
                path, reason = _first_failure(exc)
                raise _NestedFieldError(f"{index}.{path}" if path else str(index), reason) from None
        return tuple(result)

    return structure


class _NestedFieldError(ValueError):
    """A failure below a mapping key, carrying its own member path."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path = path
        self.reason = reason


def _object_hook_factory(cls: type[Any], conv: Any) -> Callable[[Any, Any], Any]:
    """Structure an attrs class from a JSON object, refusing any other JSON value."""
    structure_fields = make_dict_structure_fn(cls, conv)

    def structure(value: Any, _: Any) -> Any:
        if type(value) is not dict:
            raise _FieldError(f"expected an object, got {_show(value)}")
        return structure_fields(value, cls)

    return structure


def _make_converter() -> Any:
    conv = make_converter(detailed_validation=True)
    conv.register_structure_hook_factory(attrs.has, _object_hook_factory)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(int, _int32)
    conv.register_structure_hook(float, _number)
    conv.register_structure_hook(bool, _boolean)
    conv.register_structure_hook_func(lambda t: t in (JobId, ServiceName), _bounded_str)
    conv.register_structure_hook_func(lambda t: t == Label, _at_most(MAX_LABEL_CHARS))
    conv.register_structure_hook_func(lambda t: t == Url, _at_most(MAX_URL_CHARS))
    conv.register_structure_hook_func(lambda t: t == Count, _count)
    conv.register_structure_hook_func(lambda t: t == ByteCount, _byte_count)
    conv.register_structure_hook_func(lambda t: t == JsonObject, _json_object)
    for nested in (ServiceInfo, ServiceFigures):
        conv.register_structure_hook_func(
            lambda t, cls=nested: t == Mapping[str, cls],  # type: ignore[misc,valid-type]
            _mapping_hook(nested),
        )
    conv.register_structure_hook_func(
        lambda t: t == tuple[PriorityCount, ...], _array_hook(PriorityCount)
    )
    for literal in (ErrorCode, Kind, Status):
        conv.register_structure_hook_func(
            lambda t, lit=literal: t == lit,  # type: ignore[misc]
            _literal_hook(get_args(literal)),
        )
    return conv


converter: Final = _make_converter()
"""The project's cattrs converter for wire messages (strict primitives)."""


# JOB.traceparent, an addition to version 1, is left out of the frame when null,
# so a client that traces nothing sends the JOB frames it always sent.
converter.register_unstructure_hook(
    Job,
    make_dict_unstructure_fn(Job, converter, traceparent=override(omit_if_default=True)),
)

# The converter's hooks per message class, looked up once rather than per frame.
_UNSTRUCTURE: Final[dict[type[Any], Callable[[Any], dict[str, Any]]]] = {
    cls: converter.get_unstructure_hook(cls) for cls in MESSAGE_TYPES.values()
}
_STRUCTURE: Final[dict[str, tuple[type[Any], Callable[[Any, Any], Any]]]] = {
    kind: (cls, converter.get_structure_hook(cls)) for kind, cls in MESSAGE_TYPES.items()
}


def _first_failure(exc: BaseException) -> tuple[str, str]:
    """The member path and reason of the first failure inside a cattrs error."""
    path: list[str] = []
    while True:
        if isinstance(exc, _NestedFieldError):
            path.append(exc.path)
            return ".".join(path), exc.reason
        if isinstance(exc, ClassValidationError | IterableValidationError):
            inner = exc.exceptions[0]
            for note in getattr(inner, "__notes__", ()):
                name = getattr(note, "name", None)
                if name is not None:
                    path.append(str(name))
                    break
            exc = inner
            continue
        if isinstance(exc, KeyError):
            return ".".join(path), "required member is missing"
        return ".".join(path), str(exc)


# -- the codec ----------------------------------------------------------------


def encode(message: Message) -> str:
    """Serialise a message to the text of one frame.

    Every member is written, nulls included, with ``type`` first; the one
    exception is ``JOB.traceparent``, an addition to version 1, written only when set.
    """
    cls = type(message)
    return orjson.dumps({"type": cls.TYPE, **_UNSTRUCTURE[cls](message)}).decode()


def decode(text: str | bytes, *, accept: frozenset[str] | None = None) -> Message:
    """Parse and validate the text of one frame.

    Args:
        text: the frame's payload. ``bytes`` stands for a binary frame, which the
            protocol forbids.
        accept: the ``type`` values this side accepts (:data:`CLIENT_TO_EXEC` on an
            execserver, :data:`EXEC_TO_CLIENT` on a client); ``None`` accepts all.

    Returns:
        The message value.

    Raises:
        ProtocolError: ``bad_frame``, ``unknown_type`` or ``bad_field``, with the
            frame's ``job_id`` when it had a string one. Nothing else escapes.
    """
    if not isinstance(text, str):
        raise ProtocolError("bad_frame", "binary frames are not part of the protocol")
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError("bad_frame", f"the frame is not valid JSON: {exc}") from None
    if type(body) is not dict:
        raise ProtocolError("bad_frame", f"the frame must be a JSON object, not {_show(body)}")
    job_id = body.get("job_id")
    if type(job_id) is not str:
        job_id = None
    kind = body.get("type")
    if type(kind) is not str:
        raise ProtocolError("bad_frame", "the frame needs a string member 'type'", job_id)
    entry = _STRUCTURE.get(kind)
    if entry is None or (accept is not None and kind not in accept):
        shown = kind if len(kind) <= 40 else kind[:37] + "..."
        raise ProtocolError("unknown_type", f"type {shown!r} is not accepted here", job_id)
    cls, structure = entry
    try:
        message: Message = structure(body, cls)
    except (ClassValidationError, _FieldError) as exc:
        path, reason = _first_failure(exc)
        raise ProtocolError("bad_field", f"{kind}.{path}: {reason}", job_id) from None
    return message
