"""OpenTelemetry traces (the ``otel`` extra): one upload is one trace across the fylr
and the execserver, joined through ``JOB.traceparent``; without the package the same
code paths run and trace nothing.

Spans are read from the SDK's in-memory exporter through a provider of the test's
own (``tracing.set_tracer_provider``), so no other test is traced.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.daemons.test_fylr import TEXT, TEXT_CLASS, ended, fylr_and_execserver, put, settled
from tests.support.wire import WAIT, connect, start_execserver
from trio_broker import ClientConfig, NoExecserver, open_broker_client
from trio_broker.core import protocol as p
from trio_broker.trio import tracing

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The library's spans go to an in-memory exporter for the test's duration."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        tracing.set_tracer_provider(None)
        provider.shutdown()


def named(finished: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in finished if span.name == name]


async def test_one_upload_is_one_trace_across_fylr_and_execserver(
    pg_dsn: str, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    """The upload's span is the root; every step it leads to (metadata, sync, three
    versions) is a span of its trace, each exec-bound step has its slot wait and the
    execserver's job run as children, the job's parent reached through the wire."""
    async with fylr_and_execserver(pg_dsn, tmp_path, {"text": TEXT_CLASS}) as (fylr, http):
        created = await put(http, "notes.txt", TEXT, priority=2)
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        await settled(fylr)
    finished = spans.get_finished_spans()
    (upload,) = named(finished, "fylr.upload")
    assert upload.parent is None
    assert upload.kind == SpanKind.SERVER
    assert upload.attributes is not None
    assert upload.attributes["fylr.file"] == created["id"]
    trace_id = upload.context.trace_id
    assert {span.context.trace_id for span in finished} == {trace_id}
    steps = named(finished, "trio_broker.step")
    actions = sorted(str((s.attributes or {})["trio_broker.action"]) for s in steps)
    assert actions.count("produce") == 3  # gz, sha256, gz_sha256
    assert "metadata" in actions
    assert "sync" in actions
    assert all((s.attributes or {})["trio_broker.outcome"] == "ok" for s in steps)
    by_id = {span.context.span_id: span for span in finished}
    jobs = named(finished, "trio_broker.job")
    waits = named(finished, "trio_broker.slot_wait")
    # metadata (mime) and three versions run on the execserver
    assert len(jobs) == len(waits) == 4
    for job in jobs:
        assert job.kind == SpanKind.SERVER
        assert job.parent is not None
        assert job.parent.is_remote  # from JOB.traceparent, not this process's context
        assert by_id[job.parent.span_id].name == "trio_broker.step"
        assert (job.attributes or {})["trio_broker.status"] == "ok"
        assert (job.attributes or {})["trio_broker.instance"] == "test-exec"
    for wait in waits:
        assert wait.parent is not None
        assert by_id[wait.parent.span_id].name == "trio_broker.step"
        assert (wait.attributes or {})["trio_broker.outcome"] == "offer"
    for step in steps:
        assert step.parent is not None
        assert step.parent.is_remote  # from the queue row's payload
        assert by_id[step.parent.span_id].name in ("fylr.upload", "trio_broker.step")


async def test_an_upload_continues_the_callers_trace(
    pg_dsn: str, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    """An upload request with a traceparent header becomes a child of the caller's span."""
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with fylr_and_execserver(pg_dsn, tmp_path, {"text": TEXT_CLASS}) as (fylr, http):
        response = await http.put(
            "/eas/put",
            params={"filename": "notes.txt"},
            content=TEXT,
            headers={"traceparent": parent},
        )
        assert response.status_code == 201, response.text
        await ended(http, response.json()["id"])
        await settled(fylr)
    finished = spans.get_finished_spans()
    (upload,) = named(finished, "fylr.upload")
    assert upload.parent is not None
    assert format(upload.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(upload.parent.span_id, "016x") == "b7ad6b7169203331"
    assert {span.context.trace_id for span in finished} == {upload.context.trace_id}


async def test_a_job_with_a_bad_traceparent_runs_in_a_trace_of_its_own(
    spans: InMemorySpanExporter,
) -> None:
    """A JOB whose traceparent is not W3C's runs as usual; its span starts a new trace,
    and a failed job's span is marked as an error with the receipt's reason."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery)
        async with connect(handle) as peer:
            for job_id, traceparent, params in (
                ("bad", "not a traceparent", {"text": "hello"}),
                ("missing", None, {}),
            ):
                offer = await peer.want(job_id, "echo")
                assert isinstance(offer, p.Offer)
                await peer.send(
                    p.Job(
                        job_id=job_id,
                        token=offer.token,
                        service="echo",
                        job={"params": params},
                        traceparent=traceparent,
                    )
                )
                await peer.done(job_id)
        nursery.cancel_scope.cancel()
    bad, missing = named(spans.get_finished_spans(), "trio_broker.job")
    assert bad.parent is None
    assert (bad.attributes or {})["trio_broker.status"] == "ok"
    assert bad.status.status_code == StatusCode.UNSET
    assert missing.parent is None
    assert bad.context.trace_id != missing.context.trace_id
    assert (missing.attributes or {})["trio_broker.status"] == "error"
    assert missing.status.status_code == StatusCode.ERROR
    assert "text" in (missing.status.description or "")


def test_without_opentelemetry_the_same_paths_run_and_trace_nothing() -> None:
    """With ``opentelemetry`` unimportable, a job still runs through the client and the
    execserver (the span sites are passed), no JOB carries a traceparent, and a queue
    payload is left as it was."""
    program = textwrap.dedent(
        """
        import sys
        sys.modules["opentelemetry"] = None  # import opentelemetry raises ImportError

        import trio
        from trio_broker.core import protocol as p
        from trio_broker.trio import tracing
        from trio_broker.trio.store import _traced
        from trio_broker_daemons.execserver.app import serve_from_config
        from trio_broker_daemons.execserver.config import ExecserverConfig
        from trio_broker import ClientConfig, open_broker_client

        assert not tracing.ENABLED
        assert tracing.current_traceparent() is None
        assert _traced({"a": 1}, tracing.current_traceparent()) == {"a": 1}
        sent = []
        original = p.encode

        def spy(message):
            text = original(message)
            if isinstance(message, p.Job):
                sent.append(text)
            return text

        p.encode = spy

        async def main():
          with trio.fail_after(WAIT):
            config = ExecserverConfig.from_mapping(
                {"listen": "127.0.0.1:0", "slots": 1, "fast_reserve": 0,
                 "services": {"noop": {"builtin": "noop"}}}
            )
            async with trio.open_nursery() as nursery:
                handle = await nursery.start(serve_from_config, config)
                client_config = ClientConfig(
                    backend_id="b", name="b", version="1",
                    addresses=(f"{handle.host}:{handle.port}",),
                )
                async with open_broker_client(client_config) as client:
                    with tracing.span("outer") as opened:
                        assert opened is None
                        receipt = await client.run("noop", {})
                print(receipt.status, len(sent), "traceparent" in sent[0])
                nursery.cancel_scope.cancel()

        trio.run(main)
        loaded = {name.split(".")[0] for name, module in sys.modules.items() if module}
        assert "opentelemetry" not in loaded
        """
    ).replace("WAIT", str(WAIT))
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "1", "False"]


async def test_a_slot_wait_that_fails_is_counted_and_traced_by_its_outcome(
    spans: InMemorySpanExporter,
) -> None:
    """No execserver reachable: the run fails at once; its wait is counted under
    ``no_execserver`` and its span ends as an error saying why."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"  # bound, never listening
        config = ClientConfig(backend_id="b", name="b", version="1", addresses=(address,))
        async with open_broker_client(config, wait_connected=WAIT) as client:
            with pytest.raises(NoExecserver):
                await client.run("noop", {})
            waits = client.statistics().slot_waits
    assert list(waits) == [("noop", "no_execserver")]
    assert waits["noop", "no_execserver"].count == 1
    (wait,) = named(spans.get_finished_spans(), "trio_broker.slot_wait")
    assert (wait.attributes or {})["trio_broker.outcome"] == "no_execserver"
    assert wait.status.status_code == StatusCode.ERROR
    assert "no execserver" in (wait.status.description or "")
