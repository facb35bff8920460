"""Files per second end to end through one fylr and two execservers, and slot utilisation.

Run: ``.venv/bin/python benchmarks/fylr.py`` (``--files N``, ``--slots S`` per execserver);
``--compare TREE [--rounds R]`` runs a checkout of the code before (``git worktree
add /tmp/before COMMIT``) and this one alternately, ``R`` times each, and prints
the medians.

In one run, every daemon a real process (``trio-broker fylr`` with its private
PostgreSQL cluster, ``trio-broker execserver`` twice), the uploader in this process:

1. **end to end**: ``N`` small PNG images (a few kilobytes each) are uploaded
   (``PUT /eas/put``, four at a time) to a fylr whose one class makes one
   ``thumbnail`` version of each with the example converter
   (``examples/convert_image.py``, Pillow) in body mode: the original through the
   in-pipe, the rendition through the out-pipe into storage. The clock runs from
   the first upload to the last file ``done`` (every step: upload, sync, produce,
   the database writes, the pipes). **files/s** = ``N`` / that time.
2. **slot utilisation**: the share of that wall time the execservers' slots spent
   running jobs: Σ of the receipts' ``duration_s`` (each version's metadata keeps
   its receipt) / (wall time × slots). The rest is the cost of getting work to the
   slots (claims, offers, pipes, writes) and the ramp-up at start and end.
3. **baseline**: the same conversions run directly with the converter, one
   process per image as the execserver runs them, in a local loop with ``S × 2``
   workers (as many as the slots): files/s and the same utilisation figure (it
   loses only the loop's own process start-up gaps).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_checkout  # noqa: F401  (tests.support is this checkout's)
import httpx
import psutil
import trio
import yaml
from PIL import Image, ImageDraw
from rich.console import Console
from trio_broker_daemons.commands.upload import upload_files

from tests.support.processes import open_execserver_process, open_fylr_process

REPOSITORY = Path(__file__).resolve().parent.parent
CONVERTER = REPOSITORY / "examples" / "convert_image.py"
THUMBNAIL = ["thumbnail", "--size", "64x64", "--format", "webp"]


def image(seed: int) -> bytes:
    """A small, slightly different PNG per seed (160x120, a few kilobytes)."""
    picture = Image.new("RGB", (160, 120), (seed * 37 % 256, 90, 160))
    draw = ImageDraw.Draw(picture)
    draw.ellipse((20 + seed % 50, 20, 100 + seed % 50, 100), fill=(240, 200, 60))
    out = io.BytesIO()
    picture.save(out, "PNG")
    return out.getvalue()


def execserver_config(slots: int) -> str:
    return yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "slots": slots,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "services": {
                "thumbnail": {
                    "argv": [sys.executable, str(CONVERTER), "thumbnail", "--size", "{size}",
                             "--format", "{format}"],
                },
            },
        }
    )  # fmt: skip


def fylr_config(state: Path, execservers: list[str]) -> str:
    return yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "name": "bench-fylr",
            "state_dir": str(state),
            "database": None,
            "execservers": execservers,
            "classes": {
                "image": {
                    "extensions": ["png"],
                    "versions": {
                        "thumbnail": {
                            "service": "thumbnail",
                            "params": {"size": "64x64", "format": "webp"},
                            "mimetype": "image/webp",
                        }
                    },
                }
            },
        }
    )


async def end_to_end(folder: Path, paths: list[Path], slots: int) -> tuple[float, list[float]]:
    """Wall time of every file through the fylr, and the produce receipts' durations."""
    async with (
        open_execserver_process(execserver_config(slots)) as first,
        open_execserver_process(execserver_config(slots)) as second,
    ):
        addresses = [f"{d.host}:{d.port}" for d in (first, second)]
        async with open_fylr_process(fylr_config(folder / "state", addresses)) as fylr:
            # one file first, so that both services are measured and connections are up
            quiet = Console(quiet=True)
            await upload_files(
                fylr.http_url, [(paths[0], 0)], wait=True, timeout=120, console=quiet
            )
            processes = {
                "fylr": [fylr.process.pid],
                "execservers": [first.process.pid, second.process.pid],
                "postgres": postgres_pids(folder / "state" / "pg"),
                "uploader": [os.getpid()],
            }
            cpu_before = {name: cpu_seconds(pids) for name, pids in processes.items()}
            started = time.monotonic()
            files = len(paths) - 1
            outcomes = await upload_files(
                fylr.http_url,
                [(path, 0) for path in paths[1:]],
                wait=True,
                timeout=600,
                console=quiet,
            )
            wall = time.monotonic() - started
            cpu = {name: cpu_seconds(pids) - cpu_before[name] for name, pids in processes.items()}
            print(
                "  CPU seconds used meanwhile: "
                + ", ".join(f"{name} {seconds:.1f}" for name, seconds in cpu.items())
                + " (execservers: with their commands)"
            )
            ours = (cpu["fylr"] + cpu["postgres"]) / files
            print(f"  fylr + postgres CPU per file: {ours * 1000:.1f} ms")
            durations = []
            for outcome in outcomes:
                assert outcome.document is not None, outcome.error
                version = outcome.document["versions"]["thumbnail"]
                assert version["status"] == "done", version
                durations.append(version["metadata"]["produced"]["duration_s"])
            async with httpx.AsyncClient() as http:
                page = (await http.get(f"{fylr.http_url}/inspect/system/fylr")).json()
            calls = page["store"]["calls"]
            print(
                f"  database calls per file: {sum(calls.values()) / (len(paths)):.1f} ("
                + ", ".join(f"{k} {v / len(paths):.2f}" for k, v in sorted(calls.items()))
                + ")"
            )
            print(
                f"  (fylr: {page['dispatcher']['completed']} steps, peak"
                f" {page['dispatcher']['peak_exec_in_flight']} jobs in flight,"
                f" {page['pipes']['bytes_served']} bytes in, {page['pipes']['bytes_received']} out)"
            )
    return wall, durations


def postgres_pids(folder: Path) -> list[int]:
    """The private cluster's server and its backends."""
    text = (folder / "data" / "postmaster.pid").read_text()
    server = psutil.Process(int(text.splitlines()[0]))
    return [server.pid, *(child.pid for child in server.children())]


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU of these processes and of their reaped children."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


async def baseline(paths: list[Path], workers: int) -> tuple[float, list[float]]:
    """The converter run directly on every image, ``workers`` at a time."""
    limiter = trio.CapacityLimiter(workers)
    durations: list[float] = []

    async def one(path: Path) -> None:
        async with limiter:
            data = await trio.Path(path).read_bytes()
            begun = time.monotonic()
            result = await trio.run_process(
                [sys.executable, str(CONVERTER), *THUMBNAIL], stdin=data, capture_stdout=True
            )
            durations.append(time.monotonic() - begun)
            assert result.stdout.startswith(b"RIFF")

    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        for path in paths:
            nursery.start_soon(one, path)
    return time.monotonic() - started, durations


async def main(files: int, slots: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="trio-broker-bench-fylr-"))
    os.chmod(folder, 0o755)  # the private cluster runs as 'postgres' under root
    try:
        paths = []
        (folder / "in").mkdir()
        for n in range(files + 1):
            path = folder / "in" / f"image-{n:04d}.png"
            path.write_bytes(image(n))
            paths.append(path)
        total_slots = 2 * slots
        print(
            f"{files} images of ~{statistics.mean(len(p.read_bytes()) for p in paths) / 1024:.1f}"
            f" KiB, one thumbnail each; two execservers x {slots} slot(s); {os.cpu_count()} CPUs"
        )
        wall, durations = await end_to_end(folder, paths, slots)
        busy = sum(durations) / (wall * total_slots)
        print(
            f"end to end through one fylr: {files / wall:.1f} files/s ({wall:.1f}s);"
            f" slot utilisation {busy:.0%} (mean job {statistics.mean(durations) * 1000:.0f} ms)"
        )
        base_wall, base_durations = await baseline(paths[1:], total_slots)
        base_busy = sum(base_durations) / (base_wall * total_slots)
        print(
            f"baseline, the converter in a local loop x {total_slots}:"
            f" {files / base_wall:.1f} files/s ({base_wall:.1f}s); busy {base_busy:.0%}"
            f" (mean run {statistics.mean(base_durations) * 1000:.0f} ms)"
        )
        print(f"end to end / baseline: {base_wall / wall:.0%} of the direct loop's rate")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


_FIGURES = {
    "fylr_cpu": re.compile(r"meanwhile: fylr ([\d.]+),.* postgres ([\d.]+)"),
    "e2e": re.compile(r"end to end through one fylr: ([\d.]+) files/s"),
    "direct": re.compile(r"baseline, the converter .*: ([\d.]+) files/s"),
    "ratio": re.compile(r"end to end / baseline: (\d+)%"),
}


def compare(before: Path, files: int, slots: int, rounds: int) -> None:
    """Run ``before``'s benchmark and this one alternately, each in a process of its own.

    ``before`` is a checkout of the code to compare with (``git worktree add
    /tmp/before COMMIT``); its daemons and uploader run from it (``PYTHONPATH``),
    with its own ``.venv`` when it has one (a checkout whose module paths or
    console script differ needs its own installation).
    """
    found: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for round_ in range(rounds):
        for label, tree in (("before", before.resolve()), ("after", REPOSITORY)):
            env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'daemons'}"}
            python = tree / ".venv" / "bin" / "python"
            executable = str(python) if tree != REPOSITORY and python.exists() else sys.executable
            command = [executable, str(tree / "benchmarks" / "fylr.py")]
            command += ["--files", str(files), "--slots", str(slots)]
            # in the tree's own folder: ``python -m`` puts the working folder first on the path
            result = subprocess.run(
                command, env=env, cwd=tree, capture_output=True, text=True, check=True
            )
            print(f"-- round {round_ + 1}, {label} ({tree})")
            print(result.stdout.rstrip())
            figures: dict[str, float] = {}
            for name, pattern in _FIGURES.items():
                match = pattern.search(result.stdout)
                assert match is not None, (name, result.stdout)
                values = [float(v) for v in match.groups()]
                figures[name] = sum(values) / files * 1000 if name == "fylr_cpu" else values[0]
            found[label].append(figures)
    print("-- medians over the rounds")
    for label, runs in found.items():
        print(
            f"{label}: end to end {statistics.median(r['e2e'] for r in runs):.1f} files/s,"
            f" direct loop {statistics.median(r['direct'] for r in runs):.1f} files/s,"
            f" end to end / direct {statistics.median(r['ratio'] for r in runs):.0f}%,"
            f" fylr + postgres CPU {statistics.median(r['fylr_cpu'] for r in runs):.1f} ms per file"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--files", type=int, default=200, help="images to send (default 200)")
    parser.add_argument(
        "--slots", type=int, default=1, help="slots per execserver (default 1: 2 in all)"
    )
    parser.add_argument(
        "--compare",
        type=Path,
        metavar="TREE",
        help="a checkout of the code before: run its benchmark and this one alternately",
    )
    parser.add_argument("--rounds", type=int, default=2, help="with --compare (default 2)")
    args = parser.parse_args()
    if args.compare is not None:
        compare(args.compare, args.files, args.slots, args.rounds)
    else:
        trio.run(main, args.files, args.slots)
