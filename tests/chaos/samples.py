"""The chaos soak's uploads: real images and texts made with Pillow, decided by a seed.

:func:`make_workload` returns the same samples (names, bytes, priorities) for the
same seed and count: JPEG with EXIF orientations, PNG with and without alpha,
GIF, WebP, BMP and TIFF of varied sizes; texts of the ``text`` class; a few
``other`` files (no versions); one duplicate (the bytes of an earlier image
under another name); and corrupt images (cut short, or not an image at all)
whose picture versions the converter refuses. A share of the samples is
registered by URL instead of uploaded (:data:`Way`): copied in, or left on its
remote, chosen by a stream of the seed of its own (the bytes stay the same).
"""

from __future__ import annotations

import io
import json
import random
from typing import Any, Final, Literal, TypeAlias

import attrs
from PIL import Image, ImageDraw

__all__ = ["PRIORITIES", "Sample", "SampleKind", "Way", "make_workload"]

SampleKind: TypeAlias = Literal["image", "corrupt", "text", "other"]
Way: TypeAlias = Literal["put", "copy", "reference"]
"""How a sample reaches the fylr: uploaded, copied in from a URL, or left on its remote."""

PRIORITIES: Final = (-2, -1, 0, 1, 2, 3)
"""The priorities the uploads are spread over."""

_ORIENTATION_TAG: Final = 0x0112
_IMAGE_FORMATS: Final = ("jpg", "jpg", "jpg", "png", "png", "gif", "webp", "bmp", "tif")
_TEXT_EXTENSIONS: Final = ("txt", "csv", "md", "json", "log")
_WORDS: Final = ("slot", "broker", "want", "offer", "grant", "priority", "execserver",
                 "client", "pipe", "receipt", "queue", "version", "thumbnail", "preview",
                 "metadata", "checksum", "drain", "heartbeat", "sync", "restart")  # fmt: skip


@attrs.frozen(kw_only=True)
class Sample:
    """One upload and what is known of it.

    Attributes:
        name: the file name it is uploaded under (unique in a workload).
        kind: ``image`` (a valid picture), ``corrupt`` (an image-class file the
            converter refuses), ``text`` or ``other``.
        data: its bytes.
        priority: the priority it is uploaded with.
        size: an image's stored width and height (before its EXIF orientation).
        shown: an image's width and height once its EXIF orientation is applied.
        duplicate_of: the name of the earlier sample with the same bytes, if any.
        way: uploaded (``put``), or registered by URL and copied in (``copy``) or
            left on its remote (``reference``).
    """

    name: str
    kind: SampleKind
    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")
    priority: int
    size: tuple[int, int] | None = None
    shown: tuple[int, int] | None = None
    duplicate_of: str | None = None
    way: Way = "put"


def _picture(width: int, height: int, rng: random.Random, alpha: bool) -> Image.Image:
    """A cheap but real picture: a gradient, a few shapes and some noise lines."""
    gradient = Image.linear_gradient("L").resize((width, height))
    base = Image.merge(
        "RGB",
        (
            gradient,
            gradient.transpose(Image.Transpose.FLIP_TOP_BOTTOM),
            Image.new("L", (width, height), rng.randrange(256)),
        ),
    )
    draw = ImageDraw.Draw(base)
    for _ in range(rng.randrange(3, 8)):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randrange(1, width), y0 + rng.randrange(1, height)
        colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        else:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
    if alpha:
        mask = Image.linear_gradient("L").resize((width, height)).rotate(90, expand=False)
        rgba = base.convert("RGBA")
        rgba.putalpha(mask)
        return rgba
    return base


def _encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[_ORIENTATION_TAG] = orientation
    return exif.tobytes()


def _image(index: int, rng: random.Random, max_side: int, priority: int) -> Sample:
    ext = rng.choice(_IMAGE_FORMATS)
    width = rng.randrange(16, max_side + 1)
    height = rng.randrange(16, max_side + 1)
    orientation = 1
    if ext == "jpg":
        orientation = rng.choice((1, 1, 3, 6, 8))
        data = _encode(
            _picture(width, height, rng, alpha=False),
            "JPEG",
            quality=rng.randrange(60, 95),
            exif=_exif(orientation),
        )
    elif ext == "png":
        data = _encode(_picture(width, height, rng, alpha=rng.random() < 0.5), "PNG")
    elif ext == "gif":
        data = _encode(_picture(width, height, rng, alpha=False).convert("P"), "GIF")
    elif ext == "webp":
        data = _encode(_picture(width, height, rng, alpha=rng.random() < 0.5), "WEBP")
    elif ext == "bmp":
        data = _encode(_picture(width, height, rng, alpha=False), "BMP")
    else:
        data = _encode(_picture(width, height, rng, alpha=False), "TIFF")
    shown = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
    return Sample(
        name=f"{index:04d}-image.{ext}",
        kind="image",
        data=data,
        priority=priority,
        size=(width, height),
        shown=shown,
    )


def _corrupt(index: int, rng: random.Random, priority: int) -> Sample:
    """An image-class file Pillow cannot read: cut short, or no image at all."""
    how = index % 3
    picture = _picture(rng.randrange(200, 400), rng.randrange(200, 400), rng, alpha=False)
    if how == 0:
        ext, data = "png", _encode(picture, "PNG")[:300]
    elif how == 1:
        full = _encode(picture, "JPEG", quality=90)
        ext, data = "jpg", full[: len(full) // 2]
    else:
        ext, data = "jpg", b"not a picture at all\n" + rng.randbytes(2000)
    try:  # make sure it really is unreadable (or it would not be corrupt)
        Image.open(io.BytesIO(data)).load()
    except Exception:
        pass
    else:  # pragma: no cover - the cuts above always break the file
        raise AssertionError(f"sample {index} was meant to be corrupt but decodes")
    return Sample(name=f"{index:04d}-corrupt.{ext}", kind="corrupt", data=data, priority=priority)


def _text(index: int, rng: random.Random, max_bytes: int, priority: int) -> Sample:
    ext = rng.choice(_TEXT_EXTENSIONS)
    target = rng.randrange(200, max_bytes + 1)
    if ext == "json":
        items: list[dict[str, Any]] = []
        size = 2
        while size < target:
            item = {"n": len(items), "word": rng.choice(_WORDS), "value": rng.random()}
            items.append(item)
            size += len(json.dumps(item)) + 2
        data = json.dumps(items, indent=1).encode()
    else:
        lines = []
        size = 0
        while size < target:
            line = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(4, 16)))
            lines.append(line)
            size += len(line) + 1
        separator = "," if ext == "csv" else " "
        data = ("\n".join(line.replace(" ", separator) for line in lines) + "\n").encode()
    return Sample(name=f"{index:04d}-text.{ext}", kind="text", data=data, priority=priority)


def make_workload(
    seed: int, count: int, *, max_side: int = 1200, remote: float = 0.0
) -> list[Sample]:
    """``count`` samples (at least 8) for ``seed``, in upload order.

    Args:
        seed: decides every choice.
        count: how many uploads.
        max_side: the largest side of a generated image, in pixels.
        remote: the share registered by URL (a third of them left on the remote).

    Returns:
        Roughly 60 % images, 25 % texts, 5 % ``other`` files, a corrupt image
        per 15 uploads (at least 3), and exactly one duplicate of an earlier image.
    """
    if count < 8:
        raise ValueError(f"count: expected at least 8 uploads, got {count}")
    rng = random.Random(f"chaos-workload-{seed}")
    corrupt = max(3, count // 15)
    kinds: list[SampleKind] = ["image", "image"]
    kinds += ["corrupt"] * corrupt
    for _ in range(count - len(kinds) - 1):  # one is the duplicate
        roll = rng.random()
        kinds.append("image" if roll < 0.65 else "text" if roll < 0.93 else "other")
    rng.shuffle(kinds)
    samples: list[Sample] = []
    for index, kind in enumerate(kinds):
        priority = rng.choice(PRIORITIES)
        if kind == "image":
            samples.append(_image(index, rng, max_side, priority))
        elif kind == "corrupt":
            samples.append(_corrupt(index, rng, priority))
        elif kind == "text":
            samples.append(_text(index, rng, 60_000, priority))
        else:
            data = rng.randbytes(rng.randrange(100, 20_000))
            samples.append(Sample(name=f"{index:04d}-other.bin", kind="other", data=data,
                                  priority=priority))  # fmt: skip
    images = [s for s in samples if s.kind == "image"]
    original = images[rng.randrange(len(images))]
    position = rng.randrange(samples.index(original) + 1, len(samples) + 1)
    ext = original.name.rsplit(".", 1)[1]
    duplicate = attrs.evolve(
        original,
        name=f"{len(samples):04d}-duplicate.{ext}",
        priority=rng.choice(PRIORITIES),
        duplicate_of=original.name,
    )
    samples.insert(position, duplicate)
    ways = random.Random(f"chaos-ways-{seed}")
    for index, sample in enumerate(samples):
        if ways.random() < remote:
            way: Way = "reference" if ways.random() < 1 / 3 else "copy"
            samples[index] = attrs.evolve(sample, way=way)
    return samples
