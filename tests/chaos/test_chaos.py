"""The chaos soak: the short seeded run (``make test``), the long one (``make soak``), and the
harness's own decisions and checks.

The runs start real processes (two fylrs, three in the long run, on one PostgreSQL
and one storage folder, three execservers, two behind a real HAProxy) and kill them;
see :mod:`tests.chaos.run`. ``python -m tests.chaos`` runs the same outside pytest.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import secrets
from pathlib import Path

import attrs
import pytest
import trio
from PIL import Image
from trio_broker_daemons.fylr.config import FylrConfig

from tests.chaos.checks import (
    CONVERTER_ERROR,
    FileRecord,
    _expected_status,
    _invalid,
    _original_problems,
    _reference_problems,
    check_rows,
)
from tests.chaos.installation import (
    ESCAPE,
    EXAMPLES,
    EXEC_MARKER,
    JOB_MARKER,
    execserver_mapping,
    fylr_mapping,
)
from tests.chaos.pipepath import open_pipe_path
from tests.chaos.run import (
    EXECSERVERS,
    FYLRS,
    LONG,
    SHORT,
    ChaosPlan,
    fylr_names,
    outliving,
    run_chaos,
    schedule,
    work_folders_left,
)
from tests.chaos.samples import Sample, make_workload
from tests.support.netns import require_namespaces, until
from trio_broker.trio.workdir import PREFIX as WORK_PREFIX

RUN_WITHIN = 1200.0


def _config() -> FylrConfig:
    return FylrConfig.from_yaml(EXAMPLES / "fylr.yml")


# -- the harness decides by its seed ------------------------------------------------------------


def test_the_schedule_follows_the_seed() -> None:
    """Same plan, same events; another seed, other events; every kind of event is there."""
    plan = ChaosPlan(seed=5, files=40, kills=6)
    events = schedule(plan)
    assert events == schedule(plan)
    assert events != schedule(attrs.evolve(plan, seed=6))
    kills = [e.target for e in events if e.action == "kill"]
    assert len(kills) == 6
    assert set(FYLRS) <= set(kills)
    assert set(kills) & set(EXECSERVERS)
    assert [e.action for e in events].count("database") == 2
    checksums = [e for e in events if e.action == "checksum"]
    assert len(checksums) == plan.checksums
    assert all(e.target in FYLRS for e in checksums)
    drains = [e for e in events if e.action == "drain"]
    assert len(drains) == 1
    assert drains[0].target in EXECSERVERS
    thresholds = [e.progress for e in events]
    assert thresholds == sorted(thresholds)
    assert all(0.05 <= t <= 0.85 for t in thresholds)
    assert all(e.gap >= plan.gap[0] and plan.down[0] <= e.down <= plan.down[1] for e in events)


def test_cuts_and_a_third_fylr_join_the_schedule_and_leave_the_rest_alone() -> None:
    """With three fylrs every one is killed and checksums go to all three; cuts are events of
    their own (5 to 10 s of the last fylr's pipe path) that leave the other events as they
    were; the short plan has no cut, the long one has them on a mixed fleet of three fylrs."""
    plan = ChaosPlan(seed=5, files=40, kills=6)
    three = attrs.evolve(plan, fylrs=3)
    assert fylr_names(three) == ("fylr-1", "fylr-2", "fylr-3")
    kills = {e.target for e in schedule(three) if e.action == "kill"}
    assert set(fylr_names(three)) <= kills
    cut = attrs.evolve(plan, cuts=2)
    cuts = [e for e in schedule(cut) if e.action == "cut"]
    assert len(cuts) == 2
    assert all(e.target == "fylr-2" and 5.0 <= e.down <= 10.0 for e in cuts)
    assert [e for e in schedule(cut) if e.action != "cut"] == schedule(plan)
    assert (SHORT.cuts, SHORT.fylrs, SHORT.mixed) == (0, 2, False)
    assert (LONG.fylrs, LONG.mixed) == (3, True)
    assert LONG.cuts > 0
    assert LONG.escapes > 0


def test_the_mixed_fleet_and_the_escape_service_are_configured() -> None:
    """exec-b of a mixed fleet offers image_metadata alone; every other execserver offers the
    escape service, whose command leaves a setsid sleep behind; every fylr has its preset and
    the cut one its relayed callback base."""
    metadata_only = execserver_mapping("exec-b", 1, "t", services=["image_metadata"])
    assert list(metadata_only["services"]) == ["image_metadata"]
    full = execserver_mapping("exec-a", 1, "t", temp_dir=Path("/tmp/x"))
    assert "setsid sleep 600" in " ".join(full["services"][ESCAPE]["argv"])
    assert full["temp_dir"] == "/tmp/x"
    assert full["env"]["TRIO_BROKER_CHAOS_EXEC"] == "exec-a"
    fylr = fylr_mapping("fylr-3", 1, Path("/tmp/s"), "dsn", ["a"], callback_url="http://x:2")
    assert fylr["callback_own_url"] == "http://x:2"
    assert fylr["custom_version_presets"][ESCAPE]["service"] == ESCAPE


async def _echo(stream: trio.SocketStream) -> None:
    async with stream:
        while data := await stream.receive_some(4096):
            await stream.send_all(data)


async def _round_trip(port: int) -> bytes:
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(b"ping")
        return await stream.receive_some(4096)


async def test_a_cut_of_the_pipe_path_drops_its_port_alone_and_heals(
    nursery: trio.Nursery,
) -> None:
    """Cut, the relayed path loses its packets silently (a connection waits, the drop counter
    grows) while the target's own port still answers; healed, the waiting connection goes
    through and the table is gone."""
    require_namespaces()  # root and nftables, as the namespaces need
    [listener] = await trio.open_tcp_listeners(0, host="127.0.0.1")
    target = listener.socket.getsockname()[1]
    nursery.start_soon(trio.serve_listeners, _echo, [listener])
    with trio.fail_after(60):
        async with open_pipe_path(target) as path:
            assert await _round_trip(path.port) == b"ping"
            path.cut()
            done = trio.Event()
            answers: list[bytes] = []

            async def through_the_cut() -> None:
                answers.append(await _round_trip(path.port))
                done.set()

            nursery.start_soon(through_the_cut)
            assert await _round_trip(target) == b"ping"  # the target itself: untouched
            await until(
                lambda: trio.to_thread.run_sync(path.dropped), lambda n: n > 0, interval=0.1
            )
            assert not done.is_set()
            assert path.heal() > 0
            await done.wait()
            assert answers == [b"ping"]
            assert not path.cut_now


async def test_a_job_process_that_outlives_its_execserver_is_found(tmp_path: Path) -> None:
    """A process marked as a job of an execserver is reported while it lives past the bound
    and not once it is gone; so is a work folder left in a temp_dir, and not once removed."""
    token = secrets.token_hex(8)
    env = {**os.environ, JOB_MARKER: token, EXEC_MARKER: "exec-x"}
    process = await trio.lowlevel.open_process(["sleep", "600"], env=env)
    try:
        with trio.fail_after(60):
            [left] = await outliving(token, "exec-x", 0.5)
            assert left.pid == process.pid
            assert await outliving(token, "exec-y", 0.5) == []
            process.kill()
            await process.wait()
            assert await outliving(token, "exec-x", 0.5) == []
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    folder = tmp_path / f"{WORK_PREFIX}abc"
    folder.mkdir()
    with trio.fail_after(60):
        assert await work_folders_left([tmp_path], 0.5) == [folder]
        folder.rmdir()
        assert await work_folders_left([tmp_path], 0.5) == []


def test_the_workload_follows_the_seed() -> None:
    """The same bytes for the same seed; corrupt images that do not decode; one duplicate."""
    samples = make_workload(3, 30, max_side=300)
    again = make_workload(3, 30, max_side=300)
    assert [(s.name, s.data, s.priority) for s in samples] == [
        (s.name, s.data, s.priority) for s in again
    ]
    assert len(samples) == 30
    assert len({s.name for s in samples}) == 30
    assert {s.priority for s in samples} <= set(range(-2, 4))
    corrupt = [s for s in samples if s.kind == "corrupt"]
    assert len(corrupt) >= 3
    for sample in corrupt:
        with pytest.raises(Exception):  # noqa: B017, PT011 - Pillow raises several kinds
            Image.open(io.BytesIO(sample.data)).load()
    [duplicate] = [s for s in samples if s.duplicate_of is not None]
    [original] = [s for s in samples if s.name == duplicate.duplicate_of]
    assert duplicate.data == original.data
    assert samples.index(original) < samples.index(duplicate)
    for sample in samples:
        if sample.kind == "image":
            image = Image.open(io.BytesIO(sample.data))
            assert image.size == sample.size
            turned = image.getexif().get(0x0112) in (5, 6, 7, 8)
            assert sample.shown == (image.size[::-1] if turned else image.size)


def test_the_way_of_each_sample_follows_the_seed_and_keeps_the_bytes() -> None:
    """A share goes by URL (copied, or left on its remote), decided by its own stream of the
    seed: the same seed gives the same ways, and the bytes are those of a workload without."""
    plain = make_workload(4, 60, max_side=200)
    mixed = make_workload(4, 60, max_side=200, remote=0.5)
    assert [(s.name, s.data) for s in mixed] == [(s.name, s.data) for s in plain]
    assert {s.way for s in plain} == {"put"}
    ways = [s.way for s in mixed]
    assert ways == [s.way for s in make_workload(4, 60, max_side=200, remote=0.5)]
    assert {"put", "copy", "reference"} <= set(ways)
    assert 15 <= ways.count("copy") + ways.count("reference") <= 45


# -- the checks find what is wrong ---------------------------------------------------------------


def _record(**changes: object) -> FileRecord:
    fields: dict[str, object] = {
        "id": 1, "kind": "original", "parent_id": None, "version": None, "source": None,
        "filename": "0000-image.png", "file_class": "image", "status": "done",
        "storage_key": None, "size": None, "sha256": None, "metadata": {}, "error": None,
    }  # fmt: skip
    fields.update(changes)
    return FileRecord(**fields)  # type: ignore[arg-type]


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), "teal").save(out, "PNG")
    return out.getvalue()


def _sample(width: int, height: int, kind: str = "image") -> Sample:
    return Sample(
        name="0000-image.png",
        kind=kind,  # type: ignore[arg-type]
        data=_png(width, height),
        priority=0,
        size=(width, height),
        shown=(width, height),
    )


def test_the_rows_show_lost_uploads_strangers_and_shared_files() -> None:
    sample = _sample(10, 10)
    assert check_rows([_record()], [sample]) == []
    assert check_rows([], [sample]) == ["0000-image.png: never stored (no original row)"]
    stranger = _record(id=2, filename="nobody.png")
    assert check_rows([_record(), stranger], [sample]) == [
        "file 2: an original named 'nobody.png', which was never uploaded"
    ]
    key = "versions/ab/ab" + "0" * 30
    versions = [
        _record(id=3, kind="version", parent_id=1, version="a", storage_key=key),
        _record(id=4, kind="version", parent_id=1, version="b", storage_key=key),
    ]
    assert check_rows([_record(), *versions], [sample]) == [
        f"versions 3 and 4 share the stored file {key}"
    ]


def test_an_original_must_end_done_with_its_metadata_or_the_converters_error() -> None:
    sample = _sample(40, 30)
    assert _original_problems(sample, _record(metadata={"width": 40, "height": 30})) == []
    assert _original_problems(sample, _record(status="error", error="boom")) == [
        "0000-image.png (file 1): ended 'error' (boom), expected 'done'",
        "0000-image.png (file 1): error 'boom' on a valid file",
    ]
    assert _original_problems(sample, _record(metadata={"width": 30, "height": 40})) == [
        "0000-image.png (file 1): metadata says (30, 40), the image is (40, 30)"
    ]
    corrupt = attrs.evolve(sample, kind="corrupt")
    refused = _record(error=f"metadata: {CONVERTER_ERROR}: broken PNG data")
    assert _original_problems(corrupt, refused) == []
    assert _original_problems(corrupt, _record()) == [
        "0000-image.png (file 1): metadata error None, expected the converter's"
    ]


def test_a_corrupt_image_fails_its_pictures_and_keeps_its_checksum() -> None:
    versions = _config().classes["image"].versions
    corrupt = attrs.evolve(_sample(10, 10), kind="corrupt")
    assert {name: _expected_status(corrupt, name, versions) for name in versions} == {
        "thumbnail": "failed",
        "preview": "failed",
        "preview_small": "failed",
        "sha256": "done",
    }
    assert {_expected_status(_sample(10, 10), name, versions) for name in versions} == {"done"}


def test_an_original_left_on_its_remote_is_stored_nowhere_and_identified_as_the_sample() -> None:
    sample = attrs.evolve(_sample(10, 10), way="reference")
    digest = hashlib.sha256(sample.data).hexdigest()
    assert _reference_problems(sample, _record(size=len(sample.data), sha256=digest)) == []
    assert _reference_problems(
        sample, _record(size=len(sample.data), sha256=digest, storage_key="originals/x")
    ) == ["0000-image.png (file 1): left on its remote, but stored as originals/x"]
    assert _reference_problems(sample, _record()) == [
        "0000-image.png (file 1): identified as None bytes None, not the sample"
    ]


def test_renditions_are_checked_against_their_recipe_and_source() -> None:
    config = _config()
    image = config.classes["image"].versions
    text = config.classes["text"].versions
    sample = _sample(400, 200)
    source = sample.data

    def webp(width: int, height: int, fmt: str = "WEBP") -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (width, height), "red").save(out, fmt)
        return out.getvalue()

    thumbnail = image["thumbnail"]  # fits 128x128, WebP
    assert _invalid(thumbnail, webp(128, 64), source, sample) is None
    assert _invalid(thumbnail, webp(128, 64, "PNG"), source, sample) == "PNG image, WEBP promised"
    assert _invalid(thumbnail, webp(200, 100), source, sample) == (
        "200x100 does not fit in 128x128"
    )
    assert "does not keep the aspect" in str(_invalid(thumbnail, webp(128, 90), source, sample))
    assert "fills neither side" in str(_invalid(thumbnail, webp(100, 50), source, sample))
    assert "does not decode" in str(_invalid(thumbnail, b"garbage", source, sample))
    small = _sample(60, 30)  # never enlarged
    assert _invalid(thumbnail, webp(60, 30), small.data, small) is None
    assert "larger than" in str(_invalid(thumbnail, webp(120, 60), small.data, small))

    line = hashlib.sha256(source).hexdigest().encode() + b"  -\n"
    assert _invalid(image["sha256"], line, source, sample) is None
    assert "checksum line" in str(_invalid(image["sha256"], line[::-1], source, sample))
    assert _invalid(text["gz"], gzip.compress(b"abc"), b"abc", sample) is None
    assert _invalid(text["gz"], gzip.compress(b"abd"), b"abc", sample) == (
        "does not decompress to its source"
    )
    assert "not gzip data" in str(_invalid(text["gz"], b"abc", b"abc", sample))


# -- the runs ------------------------------------------------------------------------------------


async def _run(plan: ChaosPlan, tmp_path: Path) -> None:
    with trio.fail_after(RUN_WITHIN):
        report = await run_chaos(plan, tmp_path / "chaos")
    print(report.summary())
    assert len(report.kills) == plan.kills
    assert report.database_restarts == plan.database_restarts
    assert report.drains == plan.drains
    assert report.checksums >= 1  # the one at the end, at least
    if report.violations:
        pytest.fail(report.summary(), pytrace=False)


async def test_chaos_short(tmp_path: Path) -> None:
    """About a minute: ~40 uploads, four kills (both fylrs among them), two database
    restarts, a drain, checksum runs; every file ends as promised, no checksum marks a
    file damaged, and nothing is left behind."""
    await _run(SHORT, tmp_path)


@pytest.mark.soak
async def test_chaos_long(tmp_path: Path) -> None:
    """Several minutes: a few hundred uploads and a kill every few seconds (make soak).
    ``TRIO_BROKER_CHAOS_SEED`` picks the seed."""
    seed = int(os.environ.get("TRIO_BROKER_CHAOS_SEED", LONG.seed))
    await _run(attrs.evolve(LONG, seed=seed), tmp_path)
