"""The codec: round trips, and every malformed input mapped to the right ERROR code."""

from __future__ import annotations

import json
import typing
from typing import Any, get_args, get_origin

import attrs
import orjson
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from trio_broker.core import protocol as p
from trio_broker.testing import strategies as bs


def try_decode(text: str | bytes) -> p.Message | p.ProtocolError:
    """The decoded message, or the ProtocolError that decode raised."""
    try:
        return p.decode(text)
    except p.ProtocolError as exc:
        return exc


def decode_error(text: str | bytes, **kwargs: Any) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as info:
        p.decode(text, **kwargs)
    return info.value


# -- round trips --------------------------------------------------------------


@pytest.mark.parametrize("message_type", sorted(p.MESSAGE_TYPES))
@given(data=st.data())
def test_round_trip_every_type(message_type: str, data: st.DataObject) -> None:
    """decode(encode(m)) == m for generated messages of each of the 18 types."""
    message = data.draw(bs.messages_of(message_type))
    text = p.encode(message)
    assert p.decode(text) == message
    assert json.loads(text)["type"] == message_type


def test_every_protocol_type_has_a_class() -> None:
    """The codec knows exactly the types of PROTOCOL.md, split by direction."""
    assert set(p.MESSAGE_TYPES) == {
        "HELLO", "REGISTER", "WANT", "QUEUED", "UNWANT", "OFFER", "JOB", "DECLINE",
        "CANCEL", "DONE", "QUERY", "POSITION", "ERROR", "PING", "PONG",
        "SUBSCRIBE", "UNSUBSCRIBE", "STATS",
    }  # fmt: skip
    assert set(p.MESSAGE_TYPES) == p.CLIENT_TO_EXEC | p.EXEC_TO_CLIENT
    assert {"PING", "PONG"} == p.CLIENT_TO_EXEC & p.EXEC_TO_CLIENT


@given(bs.messages)
def test_encode_writes_every_member(message: p.Message) -> None:
    """Nulls are written too (but JOB.traceparent's), and ``type`` comes first."""
    body = json.loads(p.encode(message))
    assert next(iter(body)) == "type"
    members = {f.name for f in attrs.fields(type(message))}
    if isinstance(message, p.Job) and message.traceparent is None:
        members.discard("traceparent")
    assert set(body) == {"type"} | members


def test_job_leaves_out_a_null_traceparent() -> None:
    """A JOB without trace context is the frame version 1 always had; with one, the
    member is written and read back."""
    job = p.Job(job_id="j", token="t", service="s", job={})
    assert p.encode(job) == (
        '{"type":"JOB","job_id":"j","token":"t","service":"s","subject":null,"job":{}}'
    )
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    traced = attrs.evolve(job, traceparent=parent)
    assert json.loads(p.encode(traced))["traceparent"] == parent
    assert p.decode(p.encode(traced)) == traced
    assert p.decode(p.encode(job)) == job


def test_messages_are_frozen_values() -> None:
    want = p.Want(job_id="a", service="s", priority=1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        want.priority = 2  # type: ignore[misc]
    assert want == p.Want(job_id="a", service="s", priority=1)
    assert repr(want) == "Want(job_id='a', service='s', priority=1)"


# -- arbitrary input only ever raises ProtocolError -------------------------------


@given(st.text())
def test_arbitrary_text_raises_only_protocol_error(text: str) -> None:
    """Any text decodes or raises ProtocolError; non-JSON is bad_frame."""
    try:
        orjson.loads(text)
        is_json = True
    except orjson.JSONDecodeError:
        is_json = False
    result = try_decode(text)
    if not is_json:
        assert isinstance(result, p.ProtocolError)
        assert result.code == "bad_frame"


@given(st.binary())
def test_binary_frames_are_bad_frames(payload: bytes) -> None:
    assert decode_error(payload).code == "bad_frame"


@given(bs.json_values)
def test_arbitrary_json_values(value: Any) -> None:
    """Non-objects and objects without a string type are bad_frame."""
    text = orjson.dumps(value).decode()
    error = decode_error(text)
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        assert error.code == "bad_frame"
    else:
        assert error.code in ("unknown_type", "bad_field")


@given(st.dictionaries(bs.texts, bs.json_values), st.sampled_from(sorted(p.MESSAGE_TYPES)))
def test_arbitrary_objects_with_a_known_type(body: dict[str, Any], kind: str) -> None:
    """An object with a known type and random members decodes or is bad_field."""
    body["type"] = kind
    result = try_decode(orjson.dumps(body).decode())
    if isinstance(result, p.ProtocolError):
        assert result.code == "bad_field"
        assert result.message.startswith(f"{kind}.")
    else:
        assert result.TYPE == kind


# -- mutated valid frames -----------------------------------------------------

_WRONG_BY_KIND: dict[str, list[Any]] = {
    "str": [1, True, 1.5, [], {}],
    "int": ["1", True, False, 1.5, 2.0, [], {}],
    "number": ["1", True, [], {}],
    "bool": [0, 1, "true", [], {}],
    "object": ["x", 1, True, []],
    "array": ["x", 1, True, {}],
}


def _member_kinds(cls: type[Any]) -> dict[str, tuple[str, bool]]:
    """Each member's JSON kind and whether it may be null."""
    hints = typing.get_type_hints(cls)
    result = {}
    for field in attrs.fields(cls):
        hint = hints[field.name]
        nullable = False
        if type(None) in get_args(hint):
            nullable = True
            hint = next(a for a in get_args(hint) if a is not type(None))
        base = get_origin(hint) or hint
        if base is typing.Literal or base is str:
            kind = "str"
        elif base is bool:
            kind = "bool"
        elif base is int:
            kind = "int"
        elif base is float:
            kind = "number"
        elif base in (tuple, list):
            kind = "array"
        else:
            kind = "object"
        result[field.name] = (kind, nullable)
    return result


@given(bs.messages, st.data())
def test_missing_member(message: p.Message, data: st.DataObject) -> None:
    """Dropping a required member is bad_field naming it; a nullable one means null."""
    body = json.loads(p.encode(message))
    kinds = _member_kinds(type(message))
    name = data.draw(st.sampled_from(sorted(kinds)))
    body.pop(name, None)  # JOB.traceparent is left out when null
    text = json.dumps(body)
    if kinds[name][1]:
        assert getattr(p.decode(text), name) is None
    else:
        error = decode_error(text)
        assert error.code == "bad_field"
        assert error.message == f"{message.TYPE}.{name}: required member is missing"


@given(bs.messages, st.data())
def test_member_of_wrong_type(message: p.Message, data: st.DataObject) -> None:
    """A member of the wrong JSON type is bad_field naming it; job_id is echoed."""
    body = json.loads(p.encode(message))
    kinds = _member_kinds(type(message))
    name = data.draw(st.sampled_from(sorted(kinds)))
    kind, nullable = kinds[name]
    wrong = _WRONG_BY_KIND[kind] + ([] if nullable else [None])
    body[name] = data.draw(st.sampled_from(wrong))
    note(f"{name} = {body[name]!r}")
    error = decode_error(json.dumps(body))
    assert error.code == "bad_field"
    assert error.message.startswith(f"{message.TYPE}.{name}: expected ")
    expected_job_id = body["job_id"] if isinstance(body.get("job_id"), str) else None
    assert error.job_id == expected_job_id


@given(bs.messages, st.dictionaries(bs.texts, bs.json_values, max_size=3))
def test_unknown_members_are_ignored(message: p.Message, extra: dict[str, Any]) -> None:
    body = json.loads(p.encode(message))
    for key, value in extra.items():
        body.setdefault(key, value)
    assert p.decode(json.dumps(body)) == message


@given(bs.messages, bs.texts)
def test_unknown_type(message: p.Message, kind: str) -> None:
    body = json.loads(p.encode(message))
    body["type"] = kind
    text = json.dumps(body)
    if kind in p.MESSAGE_TYPES:
        # another known type: its members may not fit, which is bad_field and only that
        codes = set()
        try:
            p.decode(text)
        except p.ProtocolError as exc:
            codes.add(exc.code)
        assert codes <= {"bad_field"}
    else:
        assert decode_error(text).code == "unknown_type"


@given(bs.messages)
def test_lowercase_type_is_unknown(message: p.Message) -> None:
    """Types are case-sensitive."""
    body = json.loads(p.encode(message))
    body["type"] = message.TYPE.lower()
    assert decode_error(json.dumps(body)).code == "unknown_type"


@given(bs.messages)
def test_direction(message: p.Message) -> None:
    """Each side accepts only the types of its own direction (plus PING/PONG)."""
    text = p.encode(message)
    for accept in (p.CLIENT_TO_EXEC, p.EXEC_TO_CLIENT):
        if message.TYPE in accept:
            assert p.decode(text, accept=accept) == message
        else:
            assert decode_error(text, accept=accept).code == "unknown_type"


# -- a table of hand-written malformed frames ---------------------------------

_RECEIPT = (
    '"status":"ok","exit_code":0,"error":null,"stderr_line":null,"stdout_prefix":"",'
    '"stdout_bytes":0,"stdin_bytes":0,"started_at":1.0,"duration_s":0.5,'
    '"peak_memory":null,"instance_id":"i"'
)
_HELLO = (
    '"type":"HELLO","protocol":1,"instance_id":"i","name":"n","processes":4,"idle":0,'
    '"clients":1,"draining":false,"addr":"127.0.0.1:7000"'
)

MALFORMED: list[tuple[str | bytes, str, str, str | None]] = [
    # (frame, code, message fragment, job_id)
    (b'{"type":"PING","nonce":"x"}', "bad_frame", "binary", None),
    ("", "bad_frame", "not valid JSON", None),
    ("{", "bad_frame", "not valid JSON", None),
    ('{"type":"PING","nonce":"x"} trailing', "bad_frame", "not valid JSON", None),
    ('{"type":"PING","nonce":NaN}', "bad_frame", "not valid JSON", None),
    ('{"type":"PING","nonce":"\\ud800"}', "bad_frame", "not valid JSON", None),
    ("[]", "bad_frame", "not an array", None),
    ('"WANT"', "bad_frame", "not string 'WANT'", None),
    ("null", "bad_frame", "not null", None),
    ("{}", "bad_frame", "string member 'type'", None),
    ('{"type":null,"job_id":"j"}', "bad_frame", "string member 'type'", "j"),
    ('{"type":["WANT"]}', "bad_frame", "string member 'type'", None),
    ('{"type":"want","job_id":"j"}', "unknown_type", "'want'", "j"),
    ('{"type":"FROB","job_id":7}', "unknown_type", "'FROB'", None),
    ('{"type":"WANT","job_id":"j","service":"s"}', "bad_field", "WANT.priority: required", "j"),
    (
        '{"type":"WANT","job_id":"j","service":"s","priority":2147483648}',
        "bad_field",
        "WANT.priority: expected a 32-bit integer, got 2147483648",
        "j",
    ),
    (
        '{"type":"WANT","job_id":"j","service":"s","priority":-2147483649}',
        "bad_field",
        "WANT.priority: expected a 32-bit integer",
        "j",
    ),
    (
        '{"type":"WANT","job_id":"j","service":"s","priority":true}',
        "bad_field",
        "WANT.priority: expected an integer, got true",
        "j",
    ),
    (
        '{"type":"WANT","job_id":"j","service":"s","priority":1.0}',
        "bad_field",
        "WANT.priority: expected an integer, got 1.0",
        "j",
    ),
    (
        '{"type":"WANT","job_id":"j","service":"s","priority":1e40}',
        "bad_field",
        "WANT.priority: expected an integer",
        "j",
    ),
    (
        '{"type":"WANT","job_id":"","service":"s","priority":1}',
        "bad_field",
        "WANT.job_id: expected 1 to 200 characters, got 0",
        "",
    ),
    (
        '{"type":"WANT","job_id":"' + "x" * 201 + '","service":"s","priority":1}',
        "bad_field",
        "WANT.job_id: expected 1 to 200 characters, got 201",
        "x" * 201,
    ),
    (
        '{"type":"WANT","job_id":"j","service":"","priority":1}',
        "bad_field",
        "WANT.service: expected 1 to 200 characters, got 0",
        "j",
    ),
    ('{"type":"UNWANT","job_id":5}', "bad_field", "UNWANT.job_id: expected a string", None),
    ('{"type":"CANCEL"}', "bad_field", "CANCEL.job_id: required member is missing", None),
    ('{"type":"DECLINE","token":null}', "bad_field", "DECLINE.token: expected a string", None),
    (
        '{"type":"JOB","job_id":"j","token":"t","service":"s","job":[1]}',
        "bad_field",
        "JOB.job: expected an object, got an array",
        "j",
    ),
    (
        '{"type":"JOB","job_id":"j","token":"t","service":"s","subject":3,"job":{}}',
        "bad_field",
        "JOB.subject: expected a string, got 3",
        "j",
    ),
    (
        '{"type":"REGISTER","backend_id":"b","name":"n","version":1}',
        "bad_field",
        "REGISTER.version: expected a string, got 1",
        None,
    ),
    (
        '{"type":"REGISTER","backend_id":"' + "b" * 201 + '","name":"n","version":"1"}',
        "bad_field",
        "REGISTER.backend_id: expected at most 200 characters, got 201",
        None,
    ),
    (
        '{"type":"REGISTER","backend_id":"b","name":"' + "é" * 300_000 + '","version":"1"}',
        "bad_field",
        "REGISTER.name: expected at most 200 characters, got 300000",
        None,
    ),
    (
        '{"type":"REGISTER","backend_id":"b","name":"n","version":"' + "v" * 201 + '"}',
        "bad_field",
        "REGISTER.version: expected at most 200 characters, got 201",
        None,
    ),
    (
        '{"type":"REGISTER","backend_id":"b","name":"n","version":"1","callback_url":"http://'
        + "h" * 2042
        + '"}',
        "bad_field",
        "REGISTER.callback_url: expected at most 2048 characters, got 2049",
        None,
    ),
    ('{"type":"PING"}', "bad_field", "PING.nonce: required member is missing", None),
    ('{"type":"PONG","nonce":{}}', "bad_field", "PONG.nonce: expected a string", None),
    (
        '{"type":"DONE","job_id":"j","receipt":{' + _RECEIPT.replace('"ok"', '"fine"') + "}}",
        "bad_field",
        "DONE.receipt.status: expected one of ok, failed",
        "j",
    ),
    (
        '{"type":"DONE","job_id":"j","receipt":{'
        + _RECEIPT.replace('"stdout_bytes":0', '"stdout_bytes":-1')
        + "}}",
        "bad_field",
        "DONE.receipt.stdout_bytes: expected an integer from 0 to 2**63-1, got -1",
        "j",
    ),
    (
        '{"type":"DONE","job_id":"j","receipt":null}',
        "bad_field",
        "DONE.receipt: expected an object",
        "j",
    ),
    (
        '{"type":"POSITION","job_id":"j","running":1,"ahead":-1,"capacity":2,"eta_s":null}',
        "bad_field",
        "POSITION.ahead: expected an integer from 0",
        "j",
    ),
    (
        '{"type":"POSITION","job_id":"j","running":1,"ahead":1,"capacity":2,"eta_s":"soon"}',
        "bad_field",
        "POSITION.eta_s: expected a number",
        "j",
    ),
    (
        '{"type":"ERROR","code":"oops","message":"m","job_id":null}',
        "bad_field",
        "ERROR.code: expected one of bad_frame",
        None,
    ),
    ("{" + _HELLO + "}", "bad_field", "HELLO.services: required member is missing", None),
    (
        "{" + _HELLO + ',"services":{"ffmpeg":{"max_slots":2,"kind":"medium"}}}',
        "bad_field",
        "HELLO.services.ffmpeg.kind: expected one of light, heavy, unknown",
        None,
    ),
    (
        "{" + _HELLO + ',"services":{"ffmpeg":{"kind":"light"}}}',
        "bad_field",
        "HELLO.services.ffmpeg.max_slots: required member is missing",
        None,
    ),
    (
        "{" + _HELLO + ',"services":{"ffmpeg":2}}',
        "bad_field",
        "HELLO.services.ffmpeg: expected an object, got 2",
        None,
    ),
    (
        "{" + _HELLO.replace("false", "0") + ',"services":{}}',
        "bad_field",
        "HELLO.draining: expected true or false, got 0",
        None,
    ),
]


@pytest.mark.parametrize(("frame", "code", "fragment", "job_id"), MALFORMED)
def test_malformed_frames(frame: str | bytes, code: str, fragment: str, job_id: str | None) -> None:
    """Each hand-written bad frame gets its code, a message naming the member, the job_id."""
    error = decode_error(frame)
    assert (error.code, error.job_id) == (code, job_id)
    assert fragment in error.message


def test_first_bad_member_in_declaration_order_is_reported() -> None:
    error = decode_error('{"type":"WANT","job_id":"","service":"","priority":"x"}')
    assert error.message.startswith("WANT.job_id:")


def test_nullable_members_may_be_left_out() -> None:
    assert p.decode('{"type":"REGISTER","backend_id":"b","name":"n","version":"1"}') == (
        p.Register(backend_id="b", name="n", version="1", callback_url=None)
    )
    assert p.decode('{"type":"ERROR","code":"draining","message":"m"}') == p.Error(
        code="draining", message="m", job_id=None
    )


def test_receipt_byte_counts_are_64_bit() -> None:
    """Memory peaks and output sizes above 2 GiB survive the codec."""
    receipt = p.Receipt(
        status="ok",
        exit_code=0,
        stdout_prefix="",
        stdout_bytes=5 * 2**30,
        stdin_bytes=0,
        started_at=1.0,
        duration_s=2.0,
        peak_memory=3 * 2**30,
        instance_id="i",
    )
    done = p.Done(job_id="j", receipt=receipt)
    assert p.decode(p.encode(done)) == done


def test_protocol_error_str() -> None:
    error = p.ProtocolError("bad_field", "WANT.priority: expected an integer", "j")
    assert str(error) == "bad_field: WANT.priority: expected an integer"
    assert (error.code, error.job_id) == ("bad_field", "j")


def test_register_strings_up_to_their_bounds_are_taken() -> None:
    """REGISTER's labels of 200 characters and a callback_url of 2,048 decode."""
    url = "http://" + "h" * (p.MAX_URL_CHARS - 7)
    text = p.encode(
        p.Register(backend_id="b" * 200, name="é" * 200, version="v" * 200, callback_url=url)
    )
    message = p.decode(text)
    assert isinstance(message, p.Register)
    assert (len(message.name), len(message.callback_url or "")) == (200, p.MAX_URL_CHARS)
