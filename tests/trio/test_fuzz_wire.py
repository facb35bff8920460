"""Random valid and malformed frames over real sockets: errors, never a crash."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import orjson
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.wire import WAIT, connect, start_execserver
from trio_broker.core import protocol as p
from trio_broker.testing import strategies as bs

_SERVICES = st.sampled_from(["noop", "echo", "nope"])

_valid = st.one_of(
    st.builds(
        p.Want, job_id=st.sampled_from(["a", "b", "c"]), service=_SERVICES, priority=bs.int32
    ),
    st.builds(p.Unwant, job_id=st.sampled_from(["a", "b", "z"])),
    st.builds(p.Cancel, job_id=st.sampled_from(["a", "b", "z"])),
    st.builds(p.Query, job_id=st.sampled_from(["a", "b", "z"])),
    st.builds(p.Decline, token=bs.texts),
    st.builds(
        p.Job,
        job_id=st.sampled_from(["a", "b"]),
        token=bs.texts,
        service=_SERVICES,
        subject=st.none() | bs.texts,
        job=bs.json_objects,
    ),
    st.builds(p.Register, backend_id=bs.texts, name=bs.texts, version=bs.texts),
    st.builds(p.Pong, nonce=bs.texts),
    bs.messages_of("OFFER"),  # the wrong direction
    bs.messages_of("HELLO"),
).map(p.encode)


@st.composite
def _mutated(draw: st.DrawFn) -> str:
    """A valid frame with one member removed, retyped, or its type changed."""
    body: dict[str, Any] = orjson.loads(draw(_valid))
    key = draw(st.sampled_from(sorted(body)))
    action = draw(st.sampled_from(["drop", "retype", "retype", "case"]))
    if action == "drop":
        del body[key]
    elif action == "retype":
        body[key] = draw(st.sampled_from([None, 1, 1.5, True, "x", [], {}]))
    else:
        body["type"] = str(body["type"]).lower()
    return orjson.dumps(body).decode()


_frames = st.one_of(
    _valid,
    _valid,
    _mutated(),
    _mutated(),
    st.text(max_size=60),
    bs.json_values.map(lambda v: orjson.dumps(v).decode()),
    st.binary(max_size=40),
)


def _expected_error(frame: str | bytes, registered: bool) -> tuple[str, str | None] | None:
    """The ERROR a frame must get regardless of the execserver's state, if any."""
    try:
        message = p.decode(frame, accept=p.CLIENT_TO_EXEC)
    except p.ProtocolError as exc:
        return exc.code, exc.job_id
    if isinstance(message, p.Register):
        return ("already_registered", None) if registered else None
    if not registered and not isinstance(message, p.Ping | p.Pong):
        return "not_registered", getattr(message, "job_id", None)
    return None


async def _scenario(frames: list[str | bytes]) -> None:
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=2)
        barrier = itertools.count()
        async with connect(handle, register=False) as peer:
            registered = False
            for frame in frames:
                expected = _expected_error(frame, registered)
                if not registered and not isinstance(frame, bytes):
                    with contextlib.suppress(p.ProtocolError):
                        registered = isinstance(
                            p.decode(frame, accept=p.CLIENT_TO_EXEC), p.Register
                        )
                await peer.send(frame)
                nonce = f"barrier-{next(barrier)}"
                await peer.send(p.Ping(nonce=nonce))
                errors = []
                while True:
                    answer = await peer.recv()
                    if isinstance(answer, p.Pong) and answer.nonce == nonce:
                        break
                    if isinstance(answer, p.Error) and answer.code != "offer_expired":
                        errors.append((answer.code, answer.job_id))
                if expected is not None:
                    assert errors == [expected], (frame, errors)
        with trio.fail_after(WAIT):
            await handle.wait_until(lambda: not handle.broker.connections())
        assert handle.broker.pool.busy == 0
        async with connect(handle) as fresh:
            offer = await fresh.want("after", "echo")
            assert isinstance(offer, p.Offer)
            await fresh.run(offer, "echo", {"text": "still here"})
            assert (await fresh.done("after")).receipt.stdout_prefix == "still here\n"
        nursery.cancel_scope.cancel()


@settings(max_examples=25)
@given(st.lists(_frames, min_size=1, max_size=12))
def test_random_frames_over_real_sockets(frames: list[str | bytes]) -> None:
    """The server answers each bad frame with the right ERROR and keeps serving."""
    trio.run(_scenario, frames)
