"""On-demand renditions: latency against the conversion run directly, and a 1 GiB stream.

Run: ``.venv/bin/python benchmarks/renditions.py`` (``--rounds N`` latency samples,
``--stream-size BYTES`` for the stream, 1 GiB by default).

Every daemon is a real process (``trio-broker fylr`` with its private PostgreSQL
cluster, ``trio-broker execserver``), the HTTP client is this process:

1. **latency**: one 1600x1200 PNG (about 30 kB) is uploaded; then ``N`` times
   ``GET /api/v1/eas/download/<id>/custom?preset=web`` (the example converter,
   ``examples/convert_image.py thumbnail --size 640x640 --format webp``, Pillow)
   with the time to the first byte of the body and to its end; against the same
   conversion run directly ``N`` times (one process per conversion, the image on
   its stdin, as the execserver runs it): the time to its first byte of stdout
   and to its exit. The service has no cache, so every request runs the command.
   The same preset on a cached service is then asked ``N`` times (all hits but the
   first): the cost of a hit.
2. **stream**: one request for a rendition whose command writes ``--stream-size``
   bytes (``head -c``), read to the end and discarded: MB/s, the CPU seconds per
   GiB of the fylr and of the execserver (a figure that a loaded machine
   distorts less than the rate), and the peak RSS (``VmHWM``) of both processes,
   before and after.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_checkout  # noqa: F401  (tests.support is this checkout's)
import httpx
import psutil
import trio
import yaml
from PIL import Image, ImageDraw

from tests.support.processes import open_execserver_process, open_fylr_process

REPOSITORY = Path(__file__).resolve().parent.parent
CONVERTER = REPOSITORY / "examples" / "convert_image.py"
THUMBNAIL = ["thumbnail", "--size", "640x640", "--format", "webp"]


def picture() -> bytes:
    """A 1600x1200 PNG with some structure (about 30 kB: it compresses well)."""
    image = Image.new("RGB", (1600, 1200), (30, 90, 160))
    draw = ImageDraw.Draw(image)
    for step in range(0, 1600, 40):
        draw.ellipse((step, step % 1200, step + 300, step % 1200 + 200), fill=(step % 256, 200, 60))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def execserver_config(temp_dir: Path) -> str:
    thumbnail = [sys.executable, str(CONVERTER), "thumbnail", "--size", "{size}", "--format",
                 "{format}"]  # fmt: skip
    return yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "slots": 2,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "temp_dir": str(temp_dir),
            "services": {
                "thumbnail": {"argv": thumbnail},
                "thumbnail_cached": {
                    "argv": thumbnail,
                    "cache": {"key": ["size", "format"], "max_size": "1G"},
                },
                "zeros": {"argv": ["sh", "-c", 'cat >/dev/null; head -c "$0" /dev/zero', "{n}"]},
            },
        }
    )


def fylr_config(state: Path, execserver: str, stream_size: int) -> str:
    web = {"params": {"size": "640x640", "format": "webp"}, "mimetype": "image/webp"}
    return yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "name": "bench-fylr",
            "state_dir": str(state),
            "database": None,
            "execservers": [execserver],
            "classes": {"image": {"extensions": ["png"]}},
            "custom_version_presets": {
                "web": {"service": "thumbnail", **web},
                "web_cached": {"service": "thumbnail_cached", **web},
                "zeros": {"service": "zeros", "params": {"n": stream_size}},
            },
        }
    )


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process and its children so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def peak_rss(pid: int) -> int:
    """The process's peak resident set (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


async def timed_get(
    http: httpx.AsyncClient, url: str, params: dict[str, str]
) -> tuple[float, float, int]:
    """Seconds to the first body byte and to the end, and the bytes read."""
    started = time.perf_counter()
    first = None
    size = 0
    async with http.stream("GET", url, params=params) as response:
        response.raise_for_status()
        async for chunk in response.aiter_raw():
            if first is None:
                first = time.perf_counter() - started
            size += len(chunk)
    return first or 0.0, time.perf_counter() - started, size


def direct(data: bytes) -> tuple[float, float]:
    """The conversion run directly: seconds to its first stdout byte and to its exit."""
    started = time.perf_counter()
    with subprocess.Popen(
        [sys.executable, str(CONVERTER), *THUMBNAIL],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as process:
        assert process.stdin is not None
        assert process.stdout is not None
        process.stdin.write(data)
        process.stdin.close()
        process.stdout.read(1)
        first = time.perf_counter() - started
        process.stdout.read()
    return first, time.perf_counter() - started


def summary(samples: list[tuple[float, float]]) -> str:
    ttfb = [s[0] * 1000 for s in samples]
    total = [s[1] * 1000 for s in samples]
    return (
        f"first byte median {statistics.median(ttfb):7.1f} ms,"
        f" total median {statistics.median(total):7.1f} ms"
        f" (p90 {sorted(total)[math.ceil(len(total) * 0.9) - 1]:7.1f} ms)"
    )


async def main(rounds: int, stream_size: int) -> dict[str, Any]:
    data = picture()
    results: dict[str, Any] = {"image_bytes": len(data)}
    with tempfile.TemporaryDirectory(prefix="bench-renditions-") as folder:
        root = Path(folder)
        os.chmod(root, 0o755)  # the private cluster runs as 'postgres' when this runs as root
        os.mkdir(root / "exec")
        async with open_execserver_process(execserver_config(root / "exec")) as execserver:
            address = f"{execserver.host}:{execserver.port}"
            config = fylr_config(root / "state", address, stream_size)
            async with (
                open_fylr_process(config) as fylr,
                httpx.AsyncClient(base_url=fylr.http_url, timeout=600) as http,
            ):
                put = await http.put("/eas/put", params={"filename": "big.png"}, content=data)
                put.raise_for_status()
                url = f"/api/v1/eas/download/{put.json()['id']}/custom"
                await timed_get(http, url, {"preset": "web"})  # warm: connections, imports
                on_demand = [await timed_get(http, url, {"preset": "web"}) for _ in range(rounds)]
                cached = [
                    await timed_get(http, url, {"preset": "web_cached"}) for _ in range(rounds + 1)
                ][1:]
                base_fylr, base_exec = peak_rss(fylr.process.pid), peak_rss(execserver.process.pid)
                pids = {"fylr": fylr.process.pid, "execserver": execserver.process.pid}
                cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                _, total, size = await timed_get(http, url, {"preset": "zeros"})
                for name, pid in pids.items():
                    results[f"{name}_cpu_s_per_gib"] = (
                        (cpu_seconds(pid) - cpu_before[name]) / size * (1 << 30)
                    )
                results.update(
                    rendition_bytes=on_demand[0][2],
                    stream_bytes=size,
                    stream_seconds=total,
                    stream_mb_s=size / total / 1e6,
                    fylr_rss_before=base_fylr,
                    fylr_rss_after=peak_rss(fylr.process.pid),
                    exec_rss_before=base_exec,
                    exec_rss_after=peak_rss(execserver.process.pid),
                )
    baseline = [await trio.to_thread.run_sync(direct, data) for _ in range(rounds)]
    results["on_demand"] = summary([(s[0], s[1]) for s in on_demand])
    results["cached_hits"] = summary([(s[0], s[1]) for s in cached])
    results["direct"] = summary(baseline)
    return results


def report(results: dict[str, Any], rounds: int) -> None:
    mib = 1 << 20
    print(f"image {results['image_bytes']} bytes, rendition {results['rendition_bytes']} bytes,"
          f" {rounds} rounds each")  # fmt: skip
    print(f"on demand through the fylr : {results['on_demand']}")
    print(f"same preset, cached (hits) : {results['cached_hits']}")
    print(f"the conversion run directly: {results['direct']}")
    print(
        f"stream {results['stream_bytes'] / mib:.0f} MiB in {results['stream_seconds']:.1f} s:"
        f" {results['stream_mb_s']:.0f} MB/s"
    )
    fylr = f"{results['fylr_rss_before'] / mib:.0f} -> {results['fylr_rss_after'] / mib:.0f}"
    execserver = f"{results['exec_rss_before'] / mib:.0f} -> {results['exec_rss_after'] / mib:.0f}"
    print(f"peak RSS during the stream: fylr {fylr} MiB, execserver {execserver} MiB")
    print(
        f"CPU per GiB streamed: fylr {results['fylr_cpu_s_per_gib']:.1f} s,"
        f" execserver {results['execserver_cpu_s_per_gib']:.1f} s (its commands included)"
    )
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--stream-size", type=int, default=1 << 30)
    args = parser.parse_args()
    report(trio.run(main, args.rounds, args.stream_size), args.rounds)
