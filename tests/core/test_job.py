"""The job object (JobSpec) and the receipt constructors of the core."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_broker.core import protocol as p
from trio_broker.core.job import (
    STDERR_LINE_CHARS,
    STDOUT_PREFIX_BYTES,
    JobSpec,
    JobSpecError,
    LastLine,
    ended_receipt,
    error_receipt,
    format_job_duration,
    parse_job_duration,
    stdout_prefix,
    with_pipe_urls,
)

json_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=10)
params = st.dictionaries(st.text(max_size=8), json_scalars, max_size=4)
urls = st.sampled_from(
    [None, "http://127.0.0.1:8000/pipe/abc", "https://client.example/pipe/x", "http://[::1]:1/p"]
)
limits = st.none() | st.just(0.0) | st.integers(1, 10**8).map(lambda ms: ms / 1000)
specs = st.builds(
    JobSpec, params=params, stdin_url=urls, stdout_url=urls, timeout=limits, stall_timeout=limits
)


# -- the job object -----------------------------------------------------------------


def test_an_empty_object_is_a_job_without_params_or_pipes() -> None:
    """Absent members mean no params and no pipes; null pipe URLs mean none too."""
    assert JobSpec.from_wire({}) == JobSpec()
    assert JobSpec.from_wire({"stdin_url": None, "stdout_url": None}) == JobSpec()
    assert JobSpec().to_wire() == {"params": {}}


def test_from_wire_reads_every_member_and_ignores_others() -> None:
    """params and both pipe URLs are read; unknown members are ignored (forward compatibility)."""
    job = {
        "params": {"size": "64x64", "n": 3},
        "stdin_url": "http://10.0.0.5:8080/pipe/in",
        "stdout_url": "https://fylr.example/pipe/out",
        "timeout": "1h30m",
        "stall_timeout": "0",
        "priority_hint": "later",
    }
    spec = JobSpec.from_wire(job)
    assert spec == JobSpec(
        params={"size": "64x64", "n": 3},
        stdin_url="http://10.0.0.5:8080/pipe/in",
        stdout_url="https://fylr.example/pipe/out",
        timeout=5400.0,
        stall_timeout=0.0,
    )
    assert spec.to_wire() == {
        **{key: value for key, value in job.items() if key != "priority_hint"},
        "timeout": "5400s",
    }


def test_job_limits_take_precedence_over_the_services() -> None:
    """Absent: the service's limit; "0": none; a duration: the job's own."""
    assert JobSpec().effective_timeout(30.0) == 30.0
    assert JobSpec(timeout=0.0).effective_timeout(30.0) is None
    assert JobSpec(timeout=5.0).effective_timeout(30.0) == 5.0
    assert JobSpec(timeout=5.0).effective_timeout(None) == 5.0
    assert JobSpec(stall_timeout=0.0).effective_stall_timeout(600.0) is None
    assert JobSpec(stall_timeout=60.0).effective_stall_timeout(600.0) == 60.0


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30m", 1800.0), ("12h", 43200.0), ("1.5s", 1.5), ("250ms", 0.25), ("1h30m", 5400.0),
     ("0", 0.0), (None, None)],
)  # fmt: skip
def test_parse_job_duration(text: str | None, seconds: float | None) -> None:
    assert parse_job_duration("timeout", text) == seconds


@pytest.mark.parametrize("bad", ["", "10", "0s", "-1s", "1 m", "soon", 10, 1.5, True, [], "0ms"])
def test_bad_job_durations_name_the_member(bad: object) -> None:
    """Numbers without a unit, zero written with one, and anything but a string are refused."""
    with pytest.raises(JobSpecError, match=r"^stall_timeout must be a duration"):
        parse_job_duration("stall_timeout", bad)
    with pytest.raises(JobSpecError, match="stall_timeout"):
        JobSpec.from_wire({"stall_timeout": bad})


def test_format_job_duration() -> None:
    assert [format_job_duration(x) for x in (0, 0.0001, 0.25, 1.0, 90.5, 3600)] == [
        "0", "1ms", "250ms", "1s", "90500ms", "3600s"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="finite"):
        format_job_duration(-1)


@given(specs)
def test_wire_round_trip(spec: JobSpec) -> None:
    """Any job object survives to_wire and from_wire unchanged."""
    assert JobSpec.from_wire(spec.to_wire()) == spec


def test_params_are_copied() -> None:
    """A JobSpec keeps its own copy of params: changing the caller's dict changes nothing."""
    given_params = {"a": 1}
    spec = JobSpec(params=given_params)
    given_params["a"] = 2
    assert spec.params == {"a": 1}


@pytest.mark.parametrize(
    ("job", "error"),
    [
        ({"params": [1, 2]}, "params must be an object"),
        ({"params": None}, "params must be an object"),
        ({"params": "x"}, "params must be an object"),
        ({"stdin_url": 42}, "stdin_url must be an http or https URL"),
        ({"stdin_url": "ftp://host/x"}, "stdin_url must be an http or https URL"),
        ({"stdin_url": "not a url"}, "stdin_url must be an http or https URL"),
        ({"stdin_url": "http:///no-host"}, "stdin_url must be an http or https URL"),
        ({"stdin_url": "http://h:99999/x"}, "stdin_url must be an http or https URL"),
        ({"stdin_url": "http://h:abc/x"}, "stdin_url must be an http or https URL"),
        ({"stdin_url": "http://[::1/x"}, "stdin_url must be an http or https URL"),
        ({"stdin_url": "http://h/a b"}, "stdin_url must be an http or https URL"),
        ({"stdin_url": "http://h/\x01"}, "stdin_url must be an http or https URL"),
        ({"stdin_url": ""}, "stdin_url must be an http or https URL"),
        ({"stdout_url": ["http://h/x"]}, "stdout_url must be an http or https URL"),
        ({"stdout_url": "https://"}, "stdout_url must be an http or https URL"),
        # the first problem is named: params, then stdin_url, then stdout_url
        ({"params": 1, "stdin_url": 1, "stdout_url": 1}, "params must be an object"),
        ({"stdin_url": 1, "stdout_url": 1}, "stdin_url must be an http or https URL"),
    ],
)
def test_bad_job_objects_are_refused_with_the_receipt_sentence(
    job: dict[str, Any], error: str
) -> None:
    """A member of the wrong kind raises JobSpecError naming it, the receipt's error."""
    with pytest.raises(JobSpecError) as info:
        JobSpec.from_wire(job)
    assert str(info.value) == error


def test_hand_built_job_objects_are_checked_too() -> None:
    """Building a JobSpec by hand applies the same rules as reading one."""
    with pytest.raises(JobSpecError, match=r"^stdout_url must be an http or https URL$"):
        JobSpec(stdout_url="file:///etc/passwd")
    with pytest.raises(JobSpecError, match=r"^params must be an object$"):
        JobSpec(params={1: "x"})  # type: ignore[dict-item]


def test_pipe_paths_are_completed_on_the_winning_base() -> None:
    """with_pipe_urls puts each path on the callback base, keeping the other members."""
    job = JobSpec(params={"a": 1}).to_wire()
    filled = with_pipe_urls(job, "http://10.0.0.5:8080/", {"stdin_url": "/pipe/in"})
    assert filled == {"params": {"a": 1}, "stdin_url": "http://10.0.0.5:8080/pipe/in"}
    assert job == {"params": {"a": 1}}  # the submitted object is left alone
    assert JobSpec.from_wire(filled).stdin_url == "http://10.0.0.5:8080/pipe/in"


# -- receipts -----------------------------------------------------------------------


def test_error_receipt_has_no_process_fields() -> None:
    """error_receipt is status error with the reason and every process field at its null value."""
    receipt = error_receipt(
        "missing parameter 'text'", started_at=5.0, duration_s=0.5, instance_id="i"
    )
    assert receipt == p.Receipt(
        status="error",
        exit_code=None,
        error="missing parameter 'text'",
        stderr_line=None,
        stdout_prefix="",
        stdout_bytes=0,
        stdin_bytes=0,
        started_at=5.0,
        duration_s=0.5,
        peak_memory=None,
        instance_id="i",
    )


def test_ended_receipt_carries_every_field() -> None:
    """ended_receipt passes every member through to the wire receipt."""
    receipt = ended_receipt(
        "failed",
        "exit status 3",
        started_at=1.0,
        duration_s=2.0,
        instance_id="x",
        exit_code=3,
        stderr_line="bad",
        stdout_prefix="out",
        stdout_bytes=3,
        stdin_bytes=7,
        peak_memory=1024,
    )
    assert p.decode(p.encode(p.Done(job_id="j", receipt=receipt))) == p.Done(
        job_id="j", receipt=receipt
    )
    assert (receipt.exit_code, receipt.stderr_line, receipt.stdin_bytes) == (3, "bad", 7)


@pytest.mark.parametrize(("status", "error"), [("ok", "oops"), ("failed", None), ("error", None)])
def test_error_is_set_exactly_when_not_ok(status: p.Status, error: str | None) -> None:
    """A receipt with an error for ok, or none for a failure, is refused as a caller's mistake."""
    with pytest.raises(ValueError, match="exactly when it is not ok"):
        ended_receipt(status, error, started_at=0.0, duration_s=0.0, instance_id="")


@pytest.mark.parametrize(
    ("output", "prefix"),
    [
        (b"", ""),
        (b"a" * 3999 + "é".encode() + b"b", "a" * 3999),  # é is bytes 3999-4000
        (b"a" * 3998 + "é".encode() + b"b", "a" * 3998 + "é"),  # é ends at byte 4000
        (b"a" * 3998 + "€".encode(), "a" * 3998),  # 3-byte char straddling
        (b"a" * 3997 + "𝄞".encode(), "a" * 3997),  # 4-byte char straddling
        ("€".encode() * 1334, "€" * 1333),  # 4002 bytes of text: cut before the last one
    ],
)
def test_stdout_prefix_is_cut_at_a_character_boundary(output: bytes, prefix: str) -> None:
    """The prefix is at most 4000 bytes of UTF-8 and never ends inside a character."""
    assert stdout_prefix(output[: STDOUT_PREFIX_BYTES + 1]) == prefix


@pytest.mark.parametrize(
    ("output", "total"),
    [
        (b"a" * 3000 + b"\xff" + b"z", 3002),  # one byte that is no UTF-8
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 50, 52341),  # an image's start
        (b"\x1f\x8b\x08\x00", 4),  # gzip
        (b"RIFF\x1c\x00\x00\x00WEBPVP8 ", 28),  # valid UTF-8, but a NUL: binary
        (b"\x80" * 4001, 10_000_000),  # no boundary in sight
    ],
)
def test_binary_output_is_shown_as_its_size(output: bytes, total: int) -> None:
    """Output that is not UTF-8 text (or holds a NUL) is its byte count, not U+FFFD soup."""
    head = output[: STDOUT_PREFIX_BYTES + 1]
    assert stdout_prefix(head, total=total) == f"<{total} bytes of binary output>"
    assert stdout_prefix(head) == f"<{len(head)} bytes of binary output>"


def _text(data: bytes) -> str | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\x00" in text else text


@given(st.binary(max_size=STDOUT_PREFIX_BYTES + 1))
def test_stdout_prefix_is_a_short_cut_of_the_head_or_binary(head: bytes) -> None:
    """Whatever the bytes, the prefix is the head (cut at most 3 bytes short) or the marker."""
    prefix = stdout_prefix(head, total=123)
    if len(head) <= STDOUT_PREFIX_BYTES:
        assert prefix == (_text(head) or "<123 bytes of binary output>") or head == b""
    else:
        cuts = range(STDOUT_PREFIX_BYTES - 3, STDOUT_PREFIX_BYTES + 1)
        assert prefix in {_text(head[:cut]) for cut in cuts} | {"<123 bytes of binary output>"}


@pytest.mark.parametrize(
    ("chunks", "line"),
    [
        ([b""], None),
        ([b"  \n\n "], None),
        ([b"first\n", b"  last words  \n\n  \n"], "last words"),
        ([b"frame 1\rframe 2\rdone"], "done"),
        ([b"frame 1\rframe 2\r"], "frame 2"),
        ([b"par", b"tial"], "partial"),
        (["é".encode() * 100000 + b"END"], "é" * (STDERR_LINE_CHARS - 3) + "END"),
    ],
)
def test_last_line(chunks: list[bytes], line: str | None) -> None:
    """The decisive stderr line is the last non-empty one, stripped, its last 1000 characters."""
    last = LastLine()
    for chunk in chunks:
        last.feed(chunk)
    assert last.result() == line
