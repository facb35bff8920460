"""Sample inputs for the example fylr and execserver configurations.

Run ``python examples/make_samples.py OUTDIR`` to write, deterministically (the
same bytes on every run with the same Pillow and zlib):

* images of the ``image`` class: a large JPEG with EXIF, a JPEG stored sideways
  with an EXIF orientation, a PNG, a PNG with transparency, a tiny GIF (smaller
  than a thumbnail, so it is never enlarged);
* texts of the ``text`` class, a few tens of kilobytes each (gzip and sha256sum
  versions; large enough that a rendition streams through the out-pipe);
* ``broken.png``: a PNG cut short, whose image versions fail with a clear
  ``stderr_line`` from the converter;
* ``archive.bin``: random bytes of the ``other`` class, which has no versions.

``--execserver-config FILE`` also writes ``OUTDIR/execserver.yml``: FILE with
each service's ``python3`` replaced by this interpreter and each relative
``examples/…`` argument made absolute, since an execserver runs every command
in its own temporary working directory. Needs the ``examples`` extra (Pillow).
"""

from __future__ import annotations

import argparse
import io
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from PIL import Image, ImageDraw

REPOSITORY = Path(__file__).resolve().parent.parent
"""The folder that holds ``examples/`` (what relative ``examples/…`` arguments mean)."""

_EXIF_MAKE, _EXIF_MODEL, _EXIF_ORIENTATION, _EXIF_SOFTWARE, _EXIF_DATETIME = (
    0x010F,
    0x0110,
    0x0112,
    0x0131,
    0x0132,
)


def _scene(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic picture: a gradient sky, a sun and some hills."""
    rng = random.Random(seed)
    gradient = Image.linear_gradient("L").resize((width, height))
    sky = Image.merge(
        "RGB",
        (
            gradient.point(lambda v: 40 + v * 0.7),
            gradient.point(lambda v: 60 + v * 0.4),
            gradient.point(lambda v: 160 - v * 0.3),
        ),
    )
    draw = ImageDraw.Draw(sky)
    radius = min(width, height) // 8
    cx, cy = width * 2 // 3, height // 3
    draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=(250, 200, 80))
    for layer in range(4):
        base = height * (6 + layer) // 10
        points = [(0, height)]
        for x in range(0, width + 1, max(1, width // 12)):
            points.append((x, base - rng.randrange(height // 10 + 1)))
        points.append((width, height))
        shade = 30 + layer * 25
        draw.polygon(points, fill=(shade, 90 + layer * 20, shade))
    return sky


def _exif(orientation: int = 1) -> bytes:
    exif = Image.Exif()
    exif[_EXIF_MAKE] = "trio_broker"
    exif[_EXIF_MODEL] = "make_samples"
    exif[_EXIF_SOFTWARE] = "Pillow"
    exif[_EXIF_DATETIME] = "2026:01:02 03:04:05"
    exif[_EXIF_ORIENTATION] = orientation
    return exif.tobytes()


def _encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _logo() -> Image.Image:
    logo = Image.new("RGBA", (300, 300), (0, 0, 0, 0))
    draw = ImageDraw.Draw(logo)
    draw.ellipse((20, 20, 280, 280), fill=(30, 110, 200, 255))
    draw.rectangle((110, 60, 190, 240), fill=(255, 255, 255, 200))
    return logo


def _icon() -> Image.Image:
    icon = Image.new("P", (48, 48), 0)
    icon.putpalette([255, 255, 255, 200, 40, 40, 40, 40, 200] + [0] * (256 * 3 - 9))
    draw = ImageDraw.Draw(icon)
    draw.rectangle((8, 8, 39, 39), fill=1)
    draw.line((8, 8, 39, 39), fill=2, width=3)
    return icon


def _notes() -> bytes:
    rng = random.Random(11)
    words = [
        "slot",
        "broker",
        "want",
        "offer",
        "grant",
        "priority",
        "execserver",
        "client",
        "pipe",
        "receipt",
        "queue",
        "version",
        "thumbnail",
        "preview",
        "metadata",
        "checksum",
        "drain",
        "heartbeat",
        "sync",
        "produce",
    ]
    lines = []
    for number in range(400):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randrange(6, 14)))
        lines.append(f"{number:04d} {sentence.capitalize()}.")
    return ("\n".join(lines) + "\n").encode("utf-8")


def _measurements() -> bytes:
    rng = random.Random(42)
    rows = ["station,day,temperature_c,humidity_pct,wind_kmh"]
    for day in range(1, 366):
        for station in ("north", "south", "east"):
            rows.append(
                f"{station},{day},{rng.gauss(11, 8):.1f},{rng.uniform(30, 95):.0f},"
                f"{abs(rng.gauss(12, 6)):.1f}"
            )
    return ("\n".join(rows) + "\n").encode("utf-8")


def sample_contents() -> dict[str, bytes]:
    """Every sample file's name and bytes, in a fixed order."""
    sunset = _scene(1600, 1067, seed=1)
    # a 600x900 portrait stored turned left (900x600); orientation 6 shows it upright
    sideways = _scene(600, 900, seed=2).transpose(Image.Transpose.ROTATE_90)
    diagram = _scene(640, 480, seed=3)
    png = _encode(diagram, "PNG")
    return {
        "sunset.jpg": _encode(sunset, "JPEG", quality=88, exif=_exif()),
        "portrait.jpg": _encode(sideways, "JPEG", quality=88, exif=_exif(orientation=6)),
        "diagram.png": png,
        "logo.png": _encode(_logo(), "PNG"),
        "icon.gif": _encode(_icon(), "GIF"),
        "notes.txt": _notes(),
        "measurements.csv": _measurements(),
        "broken.png": png[:300],
        "archive.bin": random.Random(7).randbytes(6000),
    }


def make_samples(folder: str | Path) -> list[Path]:
    """Write the samples into ``folder`` (created if missing).

    Returns:
        The paths written, in a fixed order.
    """
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in sample_contents().items():
        path = target / name
        path.write_bytes(data)
        written.append(path)
    return written


def localize_execserver_config(
    text: str, *, python: str = sys.executable, root: Path = REPOSITORY
) -> str:
    """An execserver configuration made runnable from any working directory.

    Args:
        text: the YAML text (e.g. ``examples/execserver.yml``).
        python: the interpreter that replaces an argv's ``python3`` program.
        root: the folder that relative ``examples/…`` arguments are relative to.

    Returns:
        The YAML text of the rewritten configuration (comments are not kept).
    """
    document = yaml.safe_load(text)
    for service in (document.get("services") or {}).values():
        argv = service.get("argv") if isinstance(service, dict) else None
        if not argv:
            continue
        if argv[0] == "python3":
            argv[0] = python
        for index, element in enumerate(argv):
            if isinstance(element, str) and element.startswith("examples/"):
                argv[index] = str(root / element)
            elif isinstance(element, str):  # the copy lives elsewhere: fill {config_dir} now
                argv[index] = element.replace("{config_dir}", str(root / "examples"))
    return str(yaml.safe_dump(document, sort_keys=False))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("outdir", type=Path, help="folder to write the samples into")
    parser.add_argument(
        "--execserver-config",
        type=Path,
        metavar="FILE",
        help="also write OUTDIR/execserver.yml: FILE made runnable from any directory",
    )
    args = parser.parse_args(argv)
    for path in make_samples(args.outdir):
        print(f"{path}  {path.stat().st_size} bytes")
    if args.execserver_config is not None:
        text = args.execserver_config.read_text(encoding="utf-8")
        target = args.outdir / "execserver.yml"
        target.write_text(localize_execserver_config(text), encoding="utf-8")
        print(f"{target}  (from {args.execserver_config})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
