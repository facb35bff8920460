"""The examples: the Pillow converter, the sample generator and both configurations at work.

Every command runs as a real subprocess in a working directory of its own, the
way an execserver runs a service: input on stdin, result on stdout.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from PIL import Image
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_broker_daemons.fylr import derived, produce
from trio_broker_daemons.fylr.config import (
    ConvertConfig,
    FylrConfig,
    MetadataConfig,
    VersionConfig,
)

from trio_broker.core.argv import fill_argv

REPOSITORY = Path(__file__).resolve().parents[2]
EXAMPLES = REPOSITORY / "examples"
CONVERTER = EXAMPLES / "convert_image.py"
TIMEOUT = 60
SAMPLES = [
    "sunset.jpg",
    "portrait.jpg",
    "diagram.png",
    "logo.png",
    "icon.gif",
    "notes.txt",
    "measurements.csv",
    "broken.png",
    "archive.bin",
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the samples and the localized execserver configuration."""
    folder = tmp_path_factory.mktemp("samples")
    subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "make_samples.py"),
            str(folder),
            "--execserver-config",
            str(EXAMPLES / "execserver.yml"),
        ],
        check=True,
        capture_output=True,
        timeout=TIMEOUT,
    )
    return folder


@attrs.frozen
class Run:
    """How one command ended."""

    returncode: int
    stdout: bytes
    stderr: str


async def run(argv: Sequence[str], stdin: bytes, workdir: Path) -> Run:
    """Run a command in ``workdir`` with ``stdin``, like an execserver in body mode."""
    await trio.Path(workdir).mkdir(parents=True, exist_ok=True)
    with trio.fail_after(TIMEOUT):
        result = await trio.run_process(
            list(argv), stdin=stdin, capture_stdout=True, capture_stderr=True, check=False,
            cwd=workdir,
        )  # fmt: skip
    return Run(result.returncode, result.stdout, result.stderr.decode("utf-8", "replace"))


async def convert(args: Sequence[str], stdin: bytes, workdir: Path) -> Run:
    """Run the converter with this interpreter."""
    return await run([sys.executable, str(CONVERTER), *args], stdin, workdir)


def image_of(data: bytes | str) -> Image.Image:
    """Decode an image completely (fails on anything broken, or on a failure's message)."""
    if isinstance(data, str):
        pytest.fail(f"expected an image, the command failed: {data}")
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def one_line(text: str) -> str:
    """The single line of ``text``, asserting there is exactly one."""
    lines = text.splitlines()
    assert len(lines) == 1, text
    return lines[0]


# -- the sample generator -------------------------------------------------------------


def test_samples_are_deterministic(prepared: Path, tmp_path: Path) -> None:
    """Two runs of the generator write the same files, byte for byte."""
    again = tmp_path / "again"
    subprocess.run(
        [sys.executable, str(EXAMPLES / "make_samples.py"), str(again)],
        check=True,
        capture_output=True,
        timeout=TIMEOUT,
    )
    assert sorted(path.name for path in again.iterdir()) == sorted(SAMPLES)
    for name in SAMPLES:
        assert (again / name).read_bytes() == (prepared / name).read_bytes(), name


# -- the converter ----------------------------------------------------------------------


async def test_thumbnail_is_a_smaller_valid_image(prepared: Path, tmp_path: Path) -> None:
    """A WebP thumbnail fits the box, keeps the aspect ratio and decodes completely."""
    original = image_of((prepared / "sunset.jpg").read_bytes())
    result = await convert(
        ["thumbnail", "--size", "128x128", "--format", "webp"],
        (prepared / "sunset.jpg").read_bytes(),
        tmp_path,
    )
    assert (result.returncode, result.stderr) == (0, "")
    thumbnail = image_of(result.stdout)
    assert thumbnail.format == "WEBP"
    assert thumbnail.size == (128, 85)
    assert original.size == (1600, 1067)
    assert len(result.stdout) < (prepared / "sunset.jpg").stat().st_size


async def test_thumbnail_follows_the_exif_orientation(prepared: Path, tmp_path: Path) -> None:
    """An image stored sideways with orientation 6 comes out upright (taller than wide)."""
    stored = image_of((prepared / "portrait.jpg").read_bytes())
    assert stored.size == (900, 600)
    result = await convert(
        ["thumbnail", "--size", "128", "--format", "png"],
        (prepared / "portrait.jpg").read_bytes(),
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert image_of(result.stdout).size == (85, 128)


async def test_small_images_are_never_enlarged(prepared: Path, tmp_path: Path) -> None:
    """An image smaller than the box keeps its size."""
    result = await convert(
        ["preview", "--size", "1024x1024", "--format", "png"],
        (prepared / "icon.gif").read_bytes(),
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert image_of(result.stdout).size == (48, 48)


async def test_jpeg_of_a_transparent_image_is_on_white(prepared: Path, tmp_path: Path) -> None:
    """Transparency becomes white in a JPEG preview (JPEG has no alpha)."""
    result = await convert(
        ["preview", "--size", "200x200", "--format", "jpeg"],
        (prepared / "logo.png").read_bytes(),
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    preview = image_of(result.stdout)
    assert (preview.format, preview.mode, preview.size) == ("JPEG", "RGB", (200, 200))
    corner = preview.getpixel((0, 0))
    assert isinstance(corner, tuple)
    assert min(corner) >= 250


async def test_metadata_prints_one_json_line(prepared: Path, tmp_path: Path) -> None:
    """metadata prints the size, format, MIME type and EXIF basics as one JSON line."""
    result = await convert(["metadata"], (prepared / "sunset.jpg").read_bytes(), tmp_path)
    assert result.returncode == 0, result.stderr
    info = json.loads(one_line(result.stdout.decode()))
    assert info["width"] == 1600
    assert info["height"] == 1067
    assert (info["format"], info["mimetype"], info["mode"]) == ("JPEG", "image/jpeg", "RGB")
    assert info["exif"]["make"] == "trio_broker"
    assert info["exif"]["orientation"] == 1


async def test_paths_instead_of_pipes(prepared: Path, tmp_path: Path) -> None:
    """--input and --output read and write files instead of stdin and stdout."""
    target = tmp_path / "out.png"
    result = await convert(
        ["thumbnail", "--input", str(prepared / "diagram.png"), "--output", str(target),
         "--format", "png", "--size", "64x64"],
        b"",
        tmp_path,
    )  # fmt: skip
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", "")
    assert image_of(target.read_bytes()).size == (64, 48)


@pytest.mark.parametrize(
    ("sample", "reason"),
    [
        (
            "broken.png",
            "convert_image: cannot read image: broken PNG data: image file is truncated",
        ),
        ("notes.txt", "convert_image: cannot read image: not an image format Pillow knows"),
        (None, "convert_image: cannot read image: the input is empty"),
    ],
)
async def test_bad_input_fails_with_one_line(
    prepared: Path, tmp_path: Path, sample: str | None, reason: str
) -> None:
    """An unreadable input exits 1 with one stderr line saying why, and writes nothing."""
    data = b"" if sample is None else (prepared / sample).read_bytes()
    for command in (["thumbnail"], ["preview"], ["metadata"]):
        result = await convert(command, data, tmp_path)
        assert result.returncode == 1
        assert result.stdout == b""
        assert one_line(result.stderr).startswith(reason)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["thumbnail", "--size", "big"], "convert_image thumbnail: argument --size: expected"),
        (["thumbnail", "--size", "0x10"], "convert_image thumbnail: argument --size: sides"),
        (["preview", "--format", "gif"], "convert_image preview: argument --format: invalid"),
        (["preview", "--quality", "0"], "convert_image: --quality must be from 1 to 100, got 0"),
        (["resize"], "convert_image: argument command: invalid choice: 'resize'"),
        ([], "convert_image: the following arguments are required: command"),
    ],
)
async def test_bad_arguments_fail_with_one_line(
    prepared: Path, tmp_path: Path, args: list[str], reason: str
) -> None:
    """A usage mistake exits 2 with one stderr line (no usage block)."""
    result = await convert(args, (prepared / "icon.gif").read_bytes(), tmp_path)
    assert result.returncode == 2
    assert one_line(result.stderr).startswith(reason)


async def test_modify_crops_then_rotates_clockwise(prepared: Path, tmp_path: Path) -> None:
    """modify crops the upright picture, turns it clockwise, and writes the asked format."""
    source = image_of((prepared / "sunset.jpg").read_bytes()).convert("RGB")
    result = await convert(
        ["modify", "--rotate", "90", "--crop", "0,0,400,100", "--format", "png"],
        (prepared / "sunset.jpg").read_bytes(),
        tmp_path,
    )
    assert (result.returncode, result.stderr) == (0, "")
    modified = image_of(result.stdout)
    assert (modified.format, modified.size) == ("PNG", (100, 400))
    # turned clockwise: the crop's top left corner is now the top right one
    assert _close(modified.convert("RGB").getpixel((99, 0)), source.getpixel((0, 0)))


async def test_modify_follows_the_exif_orientation_and_keeps_the_format(
    prepared: Path, tmp_path: Path
) -> None:
    """Without a format the input's own is kept; the EXIF orientation is applied first."""
    result = await convert(
        ["modify", "--rotate", "0", "--crop", "", "--format", ""],
        (prepared / "portrait.jpg").read_bytes(),
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    upright = image_of(result.stdout)
    assert (upright.format, upright.size) == ("JPEG", (600, 900))


@pytest.mark.parametrize(
    ("args", "status", "reason"),
    [
        (["--crop", "0,0,2000,10"], 1, "convert_image: crop 0,0,2000,10 reaches outside the"),
        (["--rotate", "45"], 2, "convert_image modify: argument --rotate: expected 0, 90, 180"),
        (["--crop", "1,2,3"], 2, "convert_image modify: argument --crop: expected x,y,w,h"),
        (["--format", "exe"], 2, "convert_image modify: argument --format: expected one of"),
    ],
)
async def test_modify_refuses_with_one_line(
    prepared: Path, tmp_path: Path, args: list[str], status: int, reason: str
) -> None:
    """A crop outside the picture (exit 1) or a bad argument (exit 2): one stderr line."""
    result = await convert(["modify", *args], (prepared / "sunset.jpg").read_bytes(), tmp_path)
    assert (result.returncode, result.stdout) == (status, b"")
    assert one_line(result.stderr).startswith(reason)


def _close(one: object, other: object) -> bool:
    """Two RGB pixels within JPEG's rounding of each other."""
    assert isinstance(one, tuple)
    assert isinstance(other, tuple)
    return all(abs(a - b) <= 12 for a, b in zip(one, other, strict=True))


async def test_a_missing_input_file_fails_with_one_line(tmp_path: Path) -> None:
    """A missing --input path exits 1 naming the file."""
    result = await convert(["metadata", "--input", str(tmp_path / "nope.jpg")], b"", tmp_path)
    assert result.returncode == 1
    assert one_line(result.stderr) == (
        f"convert_image: cannot read {str(tmp_path / 'nope.jpg')!r}: No such file or directory"
    )


# -- the configurations -------------------------------------------------------------------


def test_both_example_configurations_load(prepared: Path) -> None:
    """The example execserver and fylr files load, and localizing keeps the execserver valid."""
    execserver = ExecserverConfig.from_yaml(EXAMPLES / "execserver.yml")
    localized = ExecserverConfig.from_yaml(prepared / "execserver.yml")
    fylr = FylrConfig.from_yaml(EXAMPLES / "fylr.yml")
    assert set(execserver.services) == {
        "thumbnail",
        "preview",
        "image_metadata",
        "file_metadata",
        "gzip",
        "sha256",
        "modify",
    }
    assert set(localized.services) == set(execserver.services)
    thumbnail = localized.services["thumbnail"].argv
    assert thumbnail is not None
    assert thumbnail[:2] == (sys.executable, str(CONVERTER))
    assert localized.services["gzip"].argv == execserver.services["gzip"].argv
    assert f"{fylr.host}:{fylr.port}" != execserver.listen
    assert fylr.execservers == (execserver.listen,)


def test_every_step_fills_its_service_template(prepared: Path) -> None:
    """Every metadata step and version, each conversion and the modify step, names an
    example service and fills its argv."""
    execserver = ExecserverConfig.from_yaml(prepared / "execserver.yml")
    fylr = FylrConfig.from_yaml(EXAMPLES / "fylr.yml")
    steps = 0
    calls: list[VersionConfig | MetadataConfig | ConvertConfig] = []
    for file_class in fylr.classes.values():
        calls += [*file_class.versions.values()]
        calls += [file_class.metadata] if file_class.metadata else []
        calls += [file_class.convert] if file_class.convert else []
    assert fylr.modify is not None
    modification = derived.Modification(rotate=90, crop=(0, 0, 10, 10), format="png")
    calls.append(attrs.evolve(fylr.modify, params=modification.params()))
    for call in calls:
        service = execserver.services[call.service]
        assert service.argv is not None
        assert service.placeholders <= set(call.params)
        fill_argv(service.argv, call.params)
        steps += 1
    assert steps == 11


def service_argv(
    execserver: ExecserverConfig, service: str, params: Mapping[str, Any]
) -> list[str]:
    """The command a job of this service runs, filled from its params."""
    argv = execserver.services[service].argv
    assert argv is not None
    return list(fill_argv(argv, params))


@attrs.frozen
class Outcome:
    """What one file became: its class, metadata (or failure) and versions."""

    file_class: str | None
    metadata: Mapping[str, Any] | str
    versions: Mapping[str, bytes | str]
    """Version name → content, or the failure's stderr line."""


async def process(
    name: str, data: bytes, execserver: ExecserverConfig, fylr: FylrConfig, workdir: Path
) -> Outcome:
    """Do what the fylr worker does with one upload, running each step's command."""
    class_name = produce.class_of(name, fylr)
    file_class = fylr.classes[class_name] if class_name is not None else None
    metadata: Mapping[str, Any] | str = {}
    if file_class is not None and file_class.metadata is not None:
        step = file_class.metadata
        result = await run(service_argv(execserver, step.service, step.params), data, workdir)
        if result.returncode == 0:
            metadata = produce.parse_metadata_output(result.stdout.decode("utf-8", "replace"))
        else:
            metadata = one_line(result.stderr)
    wanted = produce.wanted_versions(file_class, hashlib.sha256(data).hexdigest())
    plan = produce.plan_sync({}, wanted)
    assert produce.plan_sync(wanted, wanted).changes is False
    versions: dict[str, bytes | str] = {}
    states: dict[str, produce.FileState] = {}
    for version_name in plan.create:
        assert file_class is not None
        version = file_class.versions[version_name]
        readiness = produce.source_readiness(version, states)
        if readiness == "failed":
            versions[version_name] = f"source version {version.source!r} failed"
            states[version_name] = "error"
            continue
        assert readiness == "ready"  # sources come first in the plan
        source = data if version.source is None else versions[version.source]
        assert isinstance(source, bytes)
        argv = service_argv(execserver, version.service, version.params)
        result = await run(argv, source, workdir / version_name)
        if result.returncode == 0:
            versions[version_name] = result.stdout
            states[version_name] = "done"
        else:
            versions[version_name] = one_line(result.stderr)
            states[version_name] = "error"
    assert produce.original_done(states.values())
    return Outcome(class_name, metadata, versions)


async def test_the_example_configurations_do_real_work(prepared: Path, tmp_path: Path) -> None:
    """Every sample goes through its class's metadata step and versions with real commands."""
    execserver = ExecserverConfig.from_yaml(prepared / "execserver.yml")
    fylr = FylrConfig.from_yaml(EXAMPLES / "fylr.yml")
    outcomes: dict[str, Outcome] = {}
    limiter = trio.CapacityLimiter(2)

    async def one(name: str) -> None:
        async with limiter:
            data = (prepared / name).read_bytes()
            outcomes[name] = await process(name, data, execserver, fylr, tmp_path / name)

    async with trio.open_nursery() as nursery:
        for name in SAMPLES:
            nursery.start_soon(one, name)

    def sha256_line(name: str) -> bytes:
        return hashlib.sha256((prepared / name).read_bytes()).hexdigest().encode() + b"  -\n"

    for name in ["sunset.jpg", "portrait.jpg", "diagram.png", "logo.png", "icon.gif"]:
        outcome = outcomes[name]
        assert outcome.file_class == "image"
        assert isinstance(outcome.metadata, Mapping)
        assert outcome.metadata["mimetype"].startswith("image/")
        versions = outcome.versions
        assert set(versions) == {"thumbnail", "preview", "preview_small", "sha256"}
        thumbnail, preview, small = (
            image_of(versions[v]) for v in ("thumbnail", "preview", "preview_small")
        )
        assert thumbnail.format == "WEBP"
        assert max(thumbnail.size) <= 128
        assert preview.format == "JPEG"
        assert max(preview.size) <= 1024
        assert small.format == "PNG"
        assert max(small.size) <= 320
        assert versions["sha256"] == sha256_line(name)
    assert image_of(outcomes["sunset.jpg"].versions["preview"]).size == (1024, 683)

    for name, mimetype in [("notes.txt", "text/plain"), ("measurements.csv", "text/csv")]:
        outcome = outcomes[name]
        assert outcome.file_class == "text"
        assert outcome.metadata == {"mimetype": mimetype}
        compressed = outcome.versions["gz"]
        assert isinstance(compressed, bytes)
        assert gzip.decompress(compressed) == (prepared / name).read_bytes()
        assert len(compressed) < (prepared / name).stat().st_size // 2
        assert outcome.versions["sha256"] == sha256_line(name)

    archive = outcomes["archive.bin"]
    assert archive == Outcome("other", {"mimetype": "application/octet-stream"}, {})

    broken = outcomes["broken.png"]
    assert broken.file_class == "image"
    assert isinstance(broken.metadata, str)
    assert broken.metadata.startswith("convert_image: cannot read image: broken PNG data")
    assert broken.versions["sha256"] == sha256_line("broken.png")
    for version in ("thumbnail", "preview"):
        failure = broken.versions[version]
        assert isinstance(failure, str)
        assert failure.startswith("convert_image: cannot read image: broken PNG data")
    assert broken.versions["preview_small"] == "source version 'preview' failed"
