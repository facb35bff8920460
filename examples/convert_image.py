"""A small image converter for the example execserver services, built on Pillow.

It reads one image from stdin (or ``--input PATH``) and writes the result to
stdout (or ``--output PATH``), so an execserver can run it in body mode: the
original comes in through the in-pipe, the rendition goes out through the
out-pipe. Subcommands::

    convert_image.py thumbnail --size 128x128 --format webp   # fits in the box
    convert_image.py preview --size 1024x1024 [--format jpeg]
    convert_image.py metadata                                 # one line of JSON
    convert_image.py modify --rotate 90 --crop 0,0,640,480 --format png

Thumbnails and previews keep the aspect ratio, never enlarge, follow the EXIF
orientation, and drop alpha onto white for JPEG. ``metadata`` prints width,
height, mode, format, MIME type, frame count, alpha, DPI and a few EXIF basics.
``modify`` makes a modified original: the EXIF orientation applied, then the
crop (``x,y,w,h`` in the upright image's pixels), then the rotation (90, 180 or
270 degrees clockwise), written in ``--format`` (the input's own format when
empty). Empty ``--crop`` and ``--rotate 0`` leave the picture as it is, so one
service with fixed placeholders serves every request (and, with a format alone,
converts: a BMP delivered as a PNG).

Exit status: 0 done; 1 the input is not a readable image (or the output cannot
be written); 2 bad arguments. Every failure prints exactly one line to stderr,
starting with ``convert_image:``, which an execserver receipt carries as its
``stderr_line``. Needs the ``examples`` extra (``Pillow>=13.0``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import warnings
from collections.abc import Sequence
from typing import IO, Any, NoReturn

from PIL import Image, ImageOps, UnidentifiedImageError

PROGRAM = "convert_image"
MAX_SIDE = 20000
FORMATS = {"webp": "WEBP", "png": "PNG", "jpeg": "JPEG", "jpg": "JPEG"}
MODIFY_FORMATS = {**FORMATS, "gif": "GIF", "bmp": "BMP", "tif": "TIFF", "tiff": "TIFF"}
ROTATIONS = {
    0: None,
    90: Image.Transpose.ROTATE_270,  # PIL turns counter-clockwise
    180: Image.Transpose.ROTATE_180,
    270: Image.Transpose.ROTATE_90,
}
EXIF_TAGS = {
    0x010F: "make",
    0x0110: "model",
    0x0112: "orientation",
    0x0131: "software",
    0x0132: "datetime",
    0x013B: "artist",
    0x8298: "copyright",
}


class Failure(Exception):
    """A problem to report in one stderr line, with its exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise Failure(f"{self.prog}: {message} (see --help)", status=2)


def parse_size(text: str) -> tuple[int, int]:
    """``"128x96"`` → ``(128, 96)``; ``"128"`` → ``(128, 128)``."""
    match = re.fullmatch(r"(\d+)(?:[xX](\d+))?", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT like 128x128, got {text!r}")
    width = int(match.group(1))
    height = int(match.group(2) or width)
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise argparse.ArgumentTypeError(f"sides must be from 1 to {MAX_SIDE}, got {text!r}")
    return width, height


def parse_crop(text: str) -> tuple[int, int, int, int] | None:
    """``"10,20,300,200"`` → ``(10, 20, 300, 200)``; ``""`` → ``None`` (no crop)."""
    if not text.strip():
        return None
    match = re.fullmatch(r"(\d+),(\d+),(\d+),(\d+)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected x,y,w,h like 0,0,640,480, got {text!r}")
    x, y, w, h = (int(group) for group in match.groups())
    if w < 1 or h < 1:
        raise argparse.ArgumentTypeError(f"width and height must be at least 1, got {text!r}")
    return x, y, w, h


def parse_rotation(text: str) -> int:
    """``"90"`` → 90; only 0, 90, 180 and 270 (degrees clockwise)."""
    if text.strip() not in {str(degrees) for degrees in ROTATIONS}:
        raise argparse.ArgumentTypeError(f"expected 0, 90, 180 or 270, got {text!r}")
    return int(text)


def parse_modify_format(text: str) -> str | None:
    """An output format's extension, or ``None`` (empty: the input's own format)."""
    fmt = text.strip().lower().lstrip(".")
    if not fmt:
        return None
    if fmt not in MODIFY_FORMATS:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(sorted(MODIFY_FORMATS))} or nothing, got {text!r}"
        )
    return fmt


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = _Parser(prog=PROGRAM, description=__doc__.splitlines()[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, size, fmt, text in (
        ("thumbnail", "128x128", "webp", "a small rendition that fits in the box"),
        ("preview", "1024x1024", "jpeg", "a large rendition that fits in the box"),
        ("metadata", None, None, "print the image's technical metadata as JSON"),
    ):
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument("--input", default="-", help="image file; - (default) is stdin")
        command.add_argument("--output", default="-", help="result file; - (default) is stdout")
        if size is not None:
            command.add_argument("--size", type=parse_size, default=parse_size(size))
            command.add_argument("--format", choices=sorted(FORMATS), default=fmt)
            command.add_argument("--quality", type=int, default=85, help="1-100 (JPEG, WebP)")
    text = "a modified original: cropped, rotated, in another format"
    modify = commands.add_parser("modify", help=text, description=text)
    modify.add_argument("--input", default="-", help="image file; - (default) is stdin")
    modify.add_argument("--output", default="-", help="result file; - (default) is stdout")
    modify.add_argument("--rotate", type=parse_rotation, default=0, help="0, 90, 180, 270")
    modify.add_argument("--crop", type=parse_crop, default=None, help="x,y,w,h or empty")
    modify.add_argument("--format", type=parse_modify_format, default=None, help="or empty")
    modify.add_argument("--quality", type=int, default=90, help="1-100 (JPEG, WebP)")
    return parser


def read_image(source: str) -> Image.Image:
    """Open and fully decode the input image."""
    try:
        if source == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(source, "rb") as stream:
                data = stream.read()
    except OSError as exc:
        raise Failure(f"cannot read {source!r}: {exc.strerror or exc}") from None
    if not data:
        raise Failure("cannot read image: the input is empty")
    image: Image.Image | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except UnidentifiedImageError:
            raise Failure(
                f"cannot read image: not an image format Pillow knows ({len(data)} bytes,"
                f" starting {data[:8]!r})"
            ) from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise Failure(f"cannot read image: {exc}") from None
        except Exception as exc:  # decoders raise OSError, SyntaxError, ValueError, ...
            reason = " ".join(str(exc).split()) or type(exc).__name__
            fmt = image.format if image is not None else None
            raise Failure(f"cannot read image: broken {fmt or 'image'} data: {reason}") from None
    return image


def render(image: Image.Image, size: tuple[int, int], fmt: str, quality: int) -> bytes:
    """Scale ``image`` to fit in ``size`` (never larger) and encode it."""
    if not 1 <= quality <= 100:
        raise Failure(f"--quality must be from 1 to 100, got {quality}", status=2)
    pil_format = FORMATS[fmt]
    image = ImageOps.exif_transpose(image)
    if image.mode not in ("RGB", "RGBA", "L", "LA"):
        image = image.convert("RGBA" if _has_alpha(image) else "RGB")
    image.thumbnail(size, Image.Resampling.LANCZOS)
    if pil_format == "JPEG" and image.mode in ("RGBA", "LA"):
        background = Image.new("RGB", image.size, "white")
        background.paste(image, mask=image.getchannel("A"))
        image = background
    out = io.BytesIO()
    options: dict[str, Any] = {}
    if pil_format in ("JPEG", "WEBP"):
        options["quality"] = quality
    if pil_format == "PNG":
        options["optimize"] = True
    image.save(out, pil_format, **options)
    return out.getvalue()


def modify(
    image: Image.Image,
    *,
    rotate: int,
    crop: tuple[int, int, int, int] | None,
    fmt: str | None,
    quality: int,
) -> bytes:
    """Crop (in the upright picture's pixels), then rotate clockwise, then encode."""
    if not 1 <= quality <= 100:
        raise Failure(f"--quality must be from 1 to 100, got {quality}", status=2)
    source_format = image.format
    pil_format = MODIFY_FORMATS[fmt] if fmt is not None else source_format
    if pil_format is None:
        raise Failure("cannot tell the input's format: give --format")
    image = ImageOps.exif_transpose(image)
    if crop is not None:
        x, y, w, h = crop
        if x + w > image.width or y + h > image.height:
            raise Failure(
                f"crop {x},{y},{w},{h} reaches outside the {image.width}x{image.height} image"
            )
        image = image.crop((x, y, x + w, y + h))
    turn = ROTATIONS[rotate]
    if turn is not None:
        image = image.transpose(turn)
    if pil_format == "JPEG" and image.mode not in ("RGB", "L"):
        background = Image.new("RGB", image.size, "white")
        rgba = image.convert("RGBA")
        background.paste(rgba, mask=rgba.getchannel("A"))
        image = background
    out = io.BytesIO()
    options: dict[str, Any] = {}
    if pil_format in ("JPEG", "WEBP"):
        options["quality"] = quality
    try:
        image.save(out, pil_format, **options)
    except (OSError, ValueError) as exc:
        raise Failure(f"cannot write {pil_format}: {' '.join(str(exc).split())}") from None
    return out.getvalue()


def _has_alpha(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info


def describe(image: Image.Image) -> dict[str, Any]:
    """The technical metadata of a decoded image."""
    info: dict[str, Any] = {
        "width": image.width,
        "height": image.height,
        "mode": image.mode,
        "format": image.format,
        "mimetype": Image.MIME.get(image.format) if image.format else None,
        "frames": getattr(image, "n_frames", 1),
        "has_alpha": _has_alpha(image),
    }
    dpi = image.info.get("dpi")
    if isinstance(dpi, tuple) and len(dpi) == 2:
        info["dpi"] = [round(float(value), 2) for value in dpi]
    exif = image.getexif()
    basics = {}
    for tag, name in EXIF_TAGS.items():
        value = exif.get(tag)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, str):
            value = value.strip("\x00 ")
        if value not in (None, ""):
            basics[name] = value if isinstance(value, str | int) else str(value)
    if basics:
        info["exif"] = basics
    return info


def write_output(target: str, data: bytes) -> None:
    """Write the result; a closed pipe or a full disk is a one-line failure."""
    try:
        if target == "-":
            stream: IO[bytes] = sys.stdout.buffer
            stream.write(data)
            stream.flush()
        else:
            with open(target, "wb") as out:
                out.write(data)
    except OSError as exc:
        if target == "-" and isinstance(exc, BrokenPipeError):
            # Python flushes stdout again at exit: point it at /dev/null so that
            # this stays the only stderr line.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        raise Failure(f"cannot write {target!r}: {exc.strerror or exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        image = read_image(args.input)
        if args.command == "metadata":
            data = (json.dumps(describe(image), sort_keys=True) + "\n").encode("utf-8")
        elif args.command == "modify":
            data = modify(
                image, rotate=args.rotate, crop=args.crop, fmt=args.format, quality=args.quality
            )
        else:
            data = render(image, args.size, args.format, args.quality)
        write_output(args.output, data)
    except Failure as failure:
        message = " ".join(str(failure).split())
        if not message.startswith(PROGRAM):
            message = f"{PROGRAM}: {message}"
        print(message, file=sys.stderr)
        return failure.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
