"""Originals made by the fylr itself, and versions uploaded by hand: the pure decisions.

No I/O, no clock, no database: the routes (:mod:`~trio_broker_daemons.fylr.entry_api`)
and the original's produce step (:mod:`~trio_broker_daemons.fylr.derived_worker`)
ask these functions and write what they decide
(:mod:`~trio_broker_daemons.fylr.derived_store`).

Theory of operation
===================

Two kinds of original go through a ``produce`` step of their own before they
are originals at all; both start in ``pending_produce`` with that step queued
(``file_ref`` = the original's id; a version's produce names the version):

**Produce-first originals.** A class with ``convert`` (BMP or TIFF delivered
as PNG) has its uploads converted: the upload is stored as it came, the class's
conversion service reads it and writes the original. The converted original is
named with the conversion's ``extension`` (``scan.tif`` becomes ``scan.png``)
and classified again by it: that class (which does not convert) gives its
metadata step and its versions. The upload is kept, as the original's manual
version ``delivered``.

**Modified originals** (``POST /eas/produce?source=ID&rotate=…&crop=…&format=…``,
:func:`parse_modification`). A new original made from another one by the
``modify`` service (rotated, cropped, written in another format); it has its
own metadata and versions, and its row links its source (``derived_from``) and
what was asked (``derivation``). Its name is the source's, with the new format's
extension; its class is the one of that name, and it is never converted again.

Either way the step's end stores the produced bytes as the original and queues
its metadata step (state ``new``) or, for a class without one, its sync.

**Manual versions** (``PUT /eas/put?original=ID&version=NAME``,
:func:`manual_refusal`). A version uploaded by hand is ``done`` at once and is
never touched by a sync (a sync neither removes it nor makes a version of that
name). Refused while the original's class makes a version of that name itself
(409, its next sync would replace it), while the original is not produced yet
(its class is known only then), and for the name ``delivered`` of a converted
original (the fylr keeps the upload there).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import attrs

from trio_broker_daemons.fylr.config import (
    DELIVERED_VERSION,
    RESERVED_VERSION_NAMES,
    FylrConfig,
    job_limits,
)
from trio_broker_daemons.fylr.produce import class_of

__all__ = [
    "CROP_MAX",
    "ROTATIONS",
    "Modification",
    "OwnProduce",
    "ProduceRefused",
    "manual_refusal",
    "own_produce",
    "parse_modification",
    "priority_of",
    "renamed",
]

ROTATIONS: Final = (90, 180, 270)
"""The rotations a modified original may ask for, in degrees clockwise."""
CROP_MAX: Final = 2**31 - 1
"""The largest coordinate or side of a crop."""
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
_FORMAT: Final = re.compile(r"[a-z0-9]{1,10}")
_VERSION_NAME: Final = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class ProduceRefused(ValueError):
    """A request the fylr cannot serve as asked: the message names the parameter or rule.

    Attributes:
        status: the HTTP status to answer with (400 a bad parameter, 409 a file
            in a state that does not allow it).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@attrs.frozen(kw_only=True)
class Modification:
    """What a modified original is asked to be.

    Attributes:
        rotate: degrees clockwise (0: not rotated).
        crop: ``(x, y, width, height)`` in the source's pixels, or ``None``.
        format: the new format's extension (``png``), or ``None`` to keep the source's.
    """

    rotate: int = 0
    crop: tuple[int, int, int, int] | None = None
    format: str | None = None

    def document(self) -> dict[str, Any]:
        """As stored in the row's ``derivation`` and shown in documents."""
        return {
            "rotate": self.rotate,
            "crop": None if self.crop is None else list(self.crop),
            "format": self.format,
        }

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> Modification:
        """Back from :meth:`document`."""
        crop = document.get("crop")
        return cls(
            rotate=int(document.get("rotate") or 0),
            crop=None if crop is None else (int(crop[0]), int(crop[1]), int(crop[2]), int(crop[3])),
            format=document.get("format"),
        )

    def params(self) -> dict[str, str | int]:
        """The job params: ``rotate`` (0, 90, 180, 270), ``crop`` (``x,y,w,h`` or ``""``)
        and ``format`` (an extension, ``""`` to keep the source's)."""
        return {
            "rotate": self.rotate,
            "crop": "" if self.crop is None else ",".join(map(str, self.crop)),
            "format": self.format or "",
        }


def priority_of(raw: str) -> tuple[int, str | None]:
    """A request's ``priority``: its value, and why it is refused (``None``: it is not)."""
    try:
        priority = int(raw)
    except ValueError:
        return 0, f"priority: expected an integer, got {raw!r}"
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        return priority, f"priority: expected a 32-bit signed integer, got {priority}"
    return priority, None


def _crop(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    problem = f"crop: expected x,y,w,h (integers, w and h at least 1), got {text!r}"
    if len(parts) != 4 or not all(p.strip().isascii() and p.strip().isdigit() for p in parts):
        raise ProduceRefused(problem)
    x, y, w, h = (int(p) for p in parts)
    if w < 1 or h < 1 or max(x, y, w, h) > CROP_MAX:
        raise ProduceRefused(problem)
    return x, y, w, h


def parse_modification(query: Mapping[str, str]) -> Modification:
    """The modification a ``POST /eas/produce`` asks for.

    Args:
        query: the request's query parameters (``rotate``, ``crop``, ``format``;
            others are not looked at).

    Returns:
        The modification.

    Raises:
        ProduceRefused: a parameter is malformed (the message names it), or none
            of the three is given.
    """
    rotate = 0
    raw_rotate = query.get("rotate")
    if raw_rotate is not None:
        if raw_rotate not in {str(r) for r in ROTATIONS}:
            raise ProduceRefused(f"rotate: expected 90, 180 or 270, got {raw_rotate!r}")
        rotate = int(raw_rotate)
    raw_crop = query.get("crop")
    crop = None if raw_crop is None else _crop(raw_crop)
    raw_format = query.get("format")
    fmt = None
    if raw_format is not None:
        fmt = raw_format.lower().lstrip(".")
        if not _FORMAT.fullmatch(fmt):
            raise ProduceRefused(
                f"format: expected an extension of 1 to 10 letters and digits, got {raw_format!r}"
            )
    if raw_rotate is None and raw_crop is None and raw_format is None:
        raise ProduceRefused("expected at least one of rotate, crop and format")
    return Modification(rotate=rotate, crop=crop, format=fmt)


def renamed(filename: str, extension: str | None) -> str:
    """A file name with its last extension replaced (or one added).

    Args:
        filename: the name (``sunset.jpg``, ``README``).
        extension: the new extension, or ``None`` to keep the name.

    Returns:
        ``sunset.png``, ``README.png``; the name itself for ``None``.
    """
    if extension is None:
        return filename
    stem, dot, last = filename.rpartition(".")
    if dot and stem and not re.search(r"[/\\]", last) and not stem.endswith(("/", "\\")):
        return f"{stem}.{extension}"
    return f"{filename}.{extension}"


@attrs.frozen(kw_only=True)
class OwnProduce:
    """An original's own produce step, as the configuration says it now.

    Attributes:
        service: the execserver service.
        params: the job's params.
        limits: the job's own ``timeout``/``stall_timeout`` members.
        filename: the original's name once produced.
        file_class: its class once produced (``None``: no class).
        mimetype: what the produced bytes are labelled with (``None``: a guess
            from ``filename``).
        metadata_step: whether its class has a metadata step (state ``new``
            afterwards; otherwise ``sync``).
        delivered: the upload is kept as the manual version ``delivered`` (a
            produce-first original; a modified original reads its source's bytes).
    """

    service: str
    params: Mapping[str, Any]
    limits: Mapping[str, str]
    filename: str
    file_class: str | None
    mimetype: str | None
    metadata_step: bool
    delivered: bool


def own_produce(
    config: FylrConfig, *, filename: str, derivation: Mapping[str, Any] | None
) -> OwnProduce | str:
    """What an original in ``pending_produce`` is produced by, from the configuration.

    Args:
        config: the fylr's configuration.
        filename: the original's name (a modified original's is already its own).
        derivation: a modified original's :meth:`Modification.document`;
            ``None`` for a produce-first upload.

    Returns:
        The step, or why there is none any more (the configuration changed since
        the original was recorded): the step then fails with that reason.
    """
    if derivation is not None:
        step = config.modify
        if step is None:
            return "modified originals are not configured (modify) any more"
        modification = Modification.from_document(derivation)
        class_name = class_of(filename, config)
        params = {**step.params, **modification.params()}
        return OwnProduce(
            service=step.service,
            params=params,
            limits=job_limits(step),
            filename=filename,
            file_class=class_name,
            mimetype=None,
            metadata_step=_has_metadata(config, class_name),
            delivered=False,
        )
    upload_class = class_of(filename, config)
    file_class = None if upload_class is None else config.classes.get(upload_class)
    convert = None if file_class is None else file_class.convert
    if convert is None:
        return f"class {upload_class!r} converts its uploads no more (convert)"
    produced = renamed(filename, convert.extension)
    class_name = class_of(produced, config)
    return OwnProduce(
        service=convert.service,
        params=dict(convert.params),
        limits=job_limits(convert),
        filename=produced,
        file_class=class_name,
        mimetype=convert.mimetype,
        metadata_step=_has_metadata(config, class_name),
        delivered=True,
    )


def _has_metadata(config: FylrConfig, class_name: str | None) -> bool:
    file_class = None if class_name is None else config.classes.get(class_name)
    return file_class is not None and file_class.metadata is not None


def manual_refusal(
    config: FylrConfig,
    *,
    name: str,
    original_filename: str,
    original_status: str,
    converted: bool,
) -> ProduceRefused | None:
    """Why a manual version may not be stored (``None``: it may).

    Args:
        config: the fylr's configuration.
        name: the version's name.
        original_filename: its original's name (classified as a sync would).
        original_status: its original's internal state.
        converted: the original is a produce-first original (it has ``delivered``).

    Returns:
        A 400 for a malformed or reserved name, a 409 while the original is not
        produced yet, for a name its class makes itself, and for ``delivered``
        of a converted original.
    """
    if not _VERSION_NAME.fullmatch(name):
        return ProduceRefused(
            f"version: expected 1 to 200 letters, digits, '_', '.' and '-', got {name!r}"
        )
    if name in RESERVED_VERSION_NAMES:
        return ProduceRefused(f"version: the name {name!r} is the uploaded file's")
    if original_status == "pending_produce":
        return ProduceRefused(
            "the original is not produced yet (state pending_produce): its class, and so the"
            " versions it makes, is known once it is",
            status=409,
        )
    if converted and name == DELIVERED_VERSION:
        return ProduceRefused(
            f"version {name!r} keeps the upload this original was converted from", status=409
        )
    class_name = class_of(original_filename, config)
    file_class = None if class_name is None else config.classes.get(class_name)
    if file_class is not None and name in file_class.versions:
        return ProduceRefused(
            f"version {name!r} is made by class {class_name!r} itself: a manual one would"
            " be replaced at its next sync",
            status=409,
        )
    return None
