"""What a file should become: classes, wanted versions, produce hashes and the sync plan.

Pure logic for the fylr file worker: no I/O, no clock, no database. The worker
reads rows, calls these functions and writes what they decide.

Theory of operation
===================

A file row is an *original* (uploaded) or a *version* (a rendition produced from
the original or from another version). Its **internal state** says which step it
is at; whether that step is running right now is the queue's business
(``broker_queue``), not the file's.

An original goes ``new → metadata → sync → produce → done``:

1. **upload** stores the bytes (hashing as they arrive) and inserts the row in
   state ``new`` with a queued metadata step (``sync`` at once when its class has
   no metadata step, or it has no class).
2. **metadata** (exec) runs the class's metadata service on the original; its
   stdout becomes the technical metadata (:func:`parse_metadata_output`).
3. **sync** (local) computes the wanted versions (:func:`wanted_versions`), diffs
   them against the version rows (:func:`plan_sync`): creates the missing ones in
   state ``new`` with a queued produce each, deletes the rows (and stored files)
   of versions no longer wanted, keeps the rest untouched. Syncing again changes
   nothing unless the configuration or the original changed.
4. **produce** (exec, body mode): each version's service reads its source (the
   original, or the source version's content) through the in-pipe and writes the
   rendition through the out-pipe into storage; the version's metadata comes from
   the receipt (:func:`version_metadata`).
5. The original is ``done`` once every version is ``done`` or ``error``
   (:func:`original_done`); a failed version does not fail the original.

Internal states, the API status they read as (for an original, for a version),
and who is in them:

===================  ==============  ==============  ==================================
state                original        version         meaning
===================  ==============  ==============  ==================================
``pending_produce``  ``processing``  ``processing``  original: its own produce step (a
                                                     produce-first conversion, or a
                                                     modified original) queued or running
``new``              ``processing``  ``pending``     original: stored, its first step
                                                     queued; version: row created by
                                                     sync, not yet begun
``copy``             ``processing``  ``processing``  original: registered by URL, its
                                                     copy step (the fetch into storage)
                                                     queued or running
``metadata``         ``processing``  ``processing``  original: metadata job claimed
                                                     (running)
``sync``             ``sync``        ``sync``        original: metadata known, sync
                                                     queued or running (local)
``produce``          ``sync``        ``processing``  original: its versions being made;
                                                     version: produce job claimed
``done``             ``done``        ``done``        finished: content and metadata
                                                     stored
``error``            ``failed``      ``failed``      failed for good; the row's
                                                     ``error`` says why
===================  ==============  ==============  ==================================

The API collapses the states as the published file worker does: an original
whose first step is queued or running is ``processing``, one whose versions are
planned or being made is ``sync``; ``pending`` is a version that has not begun
(its produce waits for a slot, or for its source version). A version is never
in ``copy``, ``metadata`` or ``sync``; the table maps them anyway. An original
being copied in from its URL (``copy``) reads ``processing``, as its first step
does: its bytes are not here yet, so it cannot be downloaded (the published
worker's ``pending_copy`` reads ``sync``, but there the bytes exist).

**Remote sources** (``PUT /eas/rput``, :mod:`~trio_broker_daemons.fylr.remote`):
an original copied in from a URL starts in ``copy`` (``copy → new`` or
``sync`` once stored, as an upload would); one left on its remote has no stored
bytes and starts at ``new`` or ``sync`` like an upload, its steps reading the
URL. Its sync checks that the URL still answers; its versions' end takes it
back to ``sync`` for that check before ``done`` (``produce → sync``), so an
original left on a URL that vanished ends ``error``, with the reason.

**Originals that are produced first** start in ``pending_produce`` with a
queued ``produce`` step of their own: a class's *conversion* (``convert``: the
upload, say a BMP, delivered as a PNG; the upload itself is kept as the manual
version ``delivered``), or a *modified original* (``POST /eas/produce``: a
rotated, cropped or reformatted copy of another original, linked to it by
``derived_from``). Once produced, the original goes on as an upload would:
``pending_produce → new → metadata → sync → produce → done`` (``sync`` at once
without a metadata step). **Manual versions** (uploaded by hand) are ``done``
from the start and never touched by a sync; a version whose stored bytes went
missing is queued again (``done → new``, the ``sync_check`` action).

Transitions (:data:`TRANSITIONS`, checked by :func:`check_transition`): a claimed
step that is requeued (no slot within ``connect_timeout``, no execserver, a
draining execserver) goes back to the state it was claimed from; any step may end
in ``error``; a finished original can be synced again (configuration changed) or
processed again from the start; a failed version can be retried.

Produce hash
------------

A version row remembers the ``produce_hash`` it was made for:
:func:`produce_hash` is the SHA-256 of canonical JSON of the version's service,
params, source version name and the *source hash*. For a version made from the
original the source hash is the original's content SHA-256; for a version made
from another version it is that version's produce hash, since the source's bytes
do not exist yet when sync plans (and the produce hash identifies them: same
recipe, same input). A change anywhere up a chain therefore changes every hash
below it, and exactly those versions are made again.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal, TypeAlias

import attrs

from trio_broker.core.protocol import Receipt
from trio_broker_daemons.fylr.config import FileClass, FylrConfig, VersionConfig

__all__ = [
    "API_STATUS",
    "FINISHED_STATES",
    "PRODUCE_HASH_FORMAT",
    "STATES",
    "TRANSITIONS",
    "ApiStatus",
    "FileKind",
    "FileState",
    "InvalidTransition",
    "Readiness",
    "SyncPlan",
    "api_status",
    "can_transition",
    "check_transition",
    "class_of",
    "extension_candidates",
    "original_done",
    "parse_metadata_output",
    "plan_sync",
    "produce_hash",
    "source_readiness",
    "version_metadata",
    "wanted_versions",
]

FileState: TypeAlias = Literal[
    "pending_produce", "new", "copy", "metadata", "sync", "produce", "done", "error"
]
"""A file row's internal state (see the module docstring)."""
ApiStatus: TypeAlias = Literal["pending", "processing", "sync", "done", "failed"]
"""What ``GET /api/v1/eas/<id>`` reports."""
FileKind: TypeAlias = Literal["original", "version"]
Readiness: TypeAlias = Literal["ready", "waiting", "failed"]
"""Whether a version's source exists (:func:`source_readiness`)."""

STATES: Final[tuple[FileState, ...]] = (
    "pending_produce",
    "new",
    "copy",
    "metadata",
    "sync",
    "produce",
    "done",
    "error",
)
FINISHED_STATES: Final[frozenset[FileState]] = frozenset({"done", "error"})

API_STATUS: Final[Mapping[FileKind, Mapping[FileState, ApiStatus]]] = {
    "original": {
        "pending_produce": "processing",
        "new": "processing",
        "copy": "processing",
        "metadata": "processing",
        "sync": "sync",
        "produce": "sync",
        "done": "done",
        "error": "failed",
    },
    "version": {
        "pending_produce": "processing",
        "new": "pending",
        "copy": "processing",
        "metadata": "processing",
        "sync": "sync",
        "produce": "processing",
        "done": "done",
        "error": "failed",
    },
}
"""Kind → internal state → API status (the table of the module docstring)."""

TRANSITIONS: Final[Mapping[FileKind, Mapping[FileState, frozenset[FileState]]]] = {
    "original": {
        # produced: its metadata queued; no metadata step (straight to sync); failed
        "pending_produce": frozenset({"new", "sync", "error"}),
        # claimed for metadata; no metadata step (straight to sync); failed
        "new": frozenset({"metadata", "sync", "error"}),
        # copied in: metadata queued; no metadata step (straight to sync); failed
        "copy": frozenset({"new", "sync", "error"}),
        # metadata known; requeued; failed
        "metadata": frozenset({"sync", "new", "error"}),
        # versions queued; nothing to produce; failed
        "sync": frozenset({"produce", "done", "error"}),
        # every version finished; synced again meanwhile; failed
        "produce": frozenset({"done", "sync", "error"}),
        # synced again (configuration changed); processed again from the start
        "done": frozenset({"sync", "new"}),
        # or its own produce step retried, or a failed copy requeued by an operator
        "error": frozenset({"sync", "new", "pending_produce", "copy"}),
    },
    "version": {
        # claimed for produce; its source failed
        "new": frozenset({"produce", "error"}),
        # stored; failed; requeued
        "produce": frozenset({"done", "error", "new"}),
        # its stored bytes went missing: made again (sync_check)
        "done": frozenset({"new"}),
        # retried
        "error": frozenset({"new"}),
    },
}
"""Allowed transitions per kind of file: old state → new states."""

PRODUCE_HASH_FORMAT: Final = 1
"""Part of every produce hash: a change of what is hashed bumps it (and redoes all)."""

_SHA256_HEX: Final = re.compile(r"[0-9a-f]{64}")
_MIME_TYPE: Final = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*", re.I)


class InvalidTransition(ValueError):
    """A caller asked for a state change the table does not allow (a bug, not data)."""


# -- states -------------------------------------------------------------------------


def api_status(state: FileState, kind: FileKind = "original") -> ApiStatus:
    """The API status of an internal state.

    Args:
        state: one of :data:`STATES`.
        kind: ``original`` or ``version``.

    Returns:
        ``pending``, ``processing``, ``sync``, ``done`` or ``failed``.

    Raises:
        ValueError: not a known state or kind.
    """
    try:
        return API_STATUS[kind][state]
    except KeyError:
        raise ValueError(f"unknown file state {state!r} of kind {kind!r}") from None


def can_transition(kind: FileKind, old: FileState, new: FileState) -> bool:
    """Whether :data:`TRANSITIONS` allows ``old → new`` for this kind of file.

    Args:
        kind: ``original`` or ``version``.
        old: the current state.
        new: the wanted state.

    Returns:
        ``True`` when allowed; ``False`` for any unknown kind or state.
    """
    return new in TRANSITIONS.get(kind, {}).get(old, frozenset())


def check_transition(kind: FileKind, old: FileState, new: FileState) -> None:
    """Raise unless :data:`TRANSITIONS` allows ``old → new`` for this kind of file.

    Args:
        kind: ``original`` or ``version``.
        old: the current state.
        new: the wanted state.

    Raises:
        InvalidTransition: naming the kind, both states and what is allowed.
    """
    if not can_transition(kind, old, new):
        allowed = sorted(TRANSITIONS.get(kind, {}).get(old, frozenset()))
        raise InvalidTransition(
            f"{kind} file cannot go from {old!r} to {new!r}"
            f" (allowed: {', '.join(allowed) or 'nothing'})"
        )


def original_done(version_states: Iterable[FileState]) -> bool:
    """Whether an original is finished: every one of its versions is ``done`` or ``error``.

    Args:
        version_states: the states of all the original's version rows.

    Returns:
        ``True`` when every state is finished (also when there are none).
    """
    return all(state in FINISHED_STATES for state in version_states)


def source_readiness(version: VersionConfig, states: Mapping[str, FileState]) -> Readiness:
    """Whether a version can be produced now.

    Args:
        version: the version's configuration.
        states: the states of the original's version rows, by name.

    Returns:
        ``ready`` when it is made from the original or its source version is
        ``done``; ``failed`` when the source version is ``error`` or has no row
        (the version must fail too); ``waiting`` otherwise (requeue it).
    """
    if version.source is None:
        return "ready"
    state = states.get(version.source)
    if state == "done":
        return "ready"
    if state is None or state == "error":
        return "failed"
    return "waiting"


# -- classes and wanted versions -----------------------------------------------------


def extension_candidates(filename: str) -> tuple[str, ...]:
    """The extensions a file name may be classified by, longest first, in lower case.

    The name's last path component counts (``/`` and ``\\`` separate); a leading
    dot starts no extension (``.bashrc`` has none), nor does a trailing one.

    Args:
        filename: the uploaded file's name, as the client sent it.

    Returns:
        ``"a.Tar.GZ"`` → ``("tar.gz", "gz")``; ``"README"`` → ``()``.
    """
    base = re.split(r"[/\\]", filename)[-1].lower().lstrip(".")
    parts = base.split(".")
    if len(parts) < 2 or not parts[-1]:
        return ()
    return tuple(".".join(parts[start:]) for start in range(1, len(parts)) if parts[start])


def class_of(filename: str, config: FylrConfig) -> str | None:
    """The class of a file name: by extension, case-insensitive, longest match first.

    Args:
        filename: the uploaded file's name.
        config: the configuration holding ``classes`` and ``default_class``.

    Returns:
        The class name; ``default_class`` when no class lists an extension of the
        name (which may be ``None``: no class).
    """
    owners = {
        extension: name
        for name, file_class in config.classes.items()
        for extension in file_class.extensions
    }
    for extension in extension_candidates(filename):
        if extension in owners:
            return owners[extension]
    return config.default_class


def _canonical_json(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def produce_hash(version: VersionConfig, source_hash: str) -> str:
    """The identity of a version's recipe and input.

    SHA-256 (hex) over canonical JSON (sorted keys, no spaces, UTF-8) of
    ``{"format": 1, "service": …, "params": {…}, "source": name or null,
    "source_hash": …}``. ``mimetype`` is not part of it. Params keep their JSON
    type: ``1``, ``1.0``, ``true`` and ``"1"`` are four different recipes (they
    fill an argv template differently).

    Args:
        version: the version's configuration.
        source_hash: the SHA-256 (64 lowercase hex digits) of the original's
            content for a version made from the original, or the source version's
            produce hash for a version made from another version.

    Returns:
        64 lowercase hex digits.

    Raises:
        ValueError: ``source_hash`` is not 64 lowercase hex digits.
    """
    if not isinstance(source_hash, str) or not _SHA256_HEX.fullmatch(source_hash):
        raise ValueError(f"source_hash must be 64 lowercase hex digits, got {source_hash!r}")
    recipe = {
        "format": PRODUCE_HASH_FORMAT,
        "service": version.service,
        "params": dict(version.params),
        "source": version.source,
        "source_hash": source_hash,
    }
    return hashlib.sha256(_canonical_json(recipe)).hexdigest()


def wanted_versions(file_class: FileClass | None, original_sha256: str) -> dict[str, str]:
    """The versions a file of this class should have, with their produce hashes.

    Args:
        file_class: the file's class, ``None`` for a file without one.
        original_sha256: the original's content SHA-256 (64 lowercase hex digits).

    Returns:
        Version name → produce hash, sources before the versions made from them
        (:meth:`FileClass.production_order`); empty for no class.

    Raises:
        ValueError: ``original_sha256`` is not 64 lowercase hex digits.
    """
    if not isinstance(original_sha256, str) or not _SHA256_HEX.fullmatch(original_sha256):
        raise ValueError(
            f"original_sha256 must be 64 lowercase hex digits, got {original_sha256!r}"
        )
    if file_class is None:
        return {}
    wanted: dict[str, str] = {}
    for name in file_class.production_order():
        version = file_class.versions[name]
        source = original_sha256 if version.source is None else wanted[version.source]
        wanted[name] = produce_hash(version, source)
    return wanted


# -- the sync plan ---------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SyncPlan:
    """What a sync does to an original's version rows.

    Apply ``remove`` first (delete those rows and their stored files), then
    ``create`` (new rows in state ``new`` with the wanted produce hash, a produce
    queued for each); ``keep`` rows are left alone, whatever their state. A
    version whose produce hash changed is in both ``remove`` and ``create``.

    Attributes:
        create: names to create, in the order of ``wanted`` (sources first).
        keep: names whose row already has the wanted produce hash, in the order of
            ``wanted``.
        remove: names whose row is not wanted or has another produce hash, in the
            order of ``existing``.
    """

    create: tuple[str, ...]
    keep: tuple[str, ...]
    remove: tuple[str, ...]

    @property
    def changes(self) -> bool:
        """Whether the plan creates or removes anything."""
        return bool(self.create or self.remove)


def plan_sync(existing: Mapping[str, str], wanted: Mapping[str, str]) -> SyncPlan:
    """Diff an original's version rows against the versions it should have.

    Args:
        existing: version name → produce hash of the rows there are.
        wanted: version name → produce hash of the versions there should be
            (:func:`wanted_versions`).

    Returns:
        The plan; applying it to ``existing`` yields exactly ``wanted``, and the
        plan of a mapping against itself changes nothing.
    """
    keep = tuple(name for name, hash_ in wanted.items() if existing.get(name) == hash_)
    kept = set(keep)
    return SyncPlan(
        create=tuple(name for name in wanted if name not in kept),
        keep=keep,
        remove=tuple(name for name in existing if name not in kept),
    )


# -- metadata ----------------------------------------------------------------------------


def parse_metadata_output(text: str) -> dict[str, Any]:
    """The technical metadata a metadata service printed.

    Args:
        text: the job's stdout (a receipt's ``stdout_prefix``).

    Returns:
        A JSON object as it is; a single MIME type (what ``file --mime-type -b``
        prints) as ``{"mimetype": …}``; nothing as ``{}``; any other text as
        ``{"output": …}`` (stripped).
    """
    stripped = text.strip()
    if not stripped:
        return {}
    if stripped.startswith("{"):
        try:
            value = json.loads(stripped)
        except ValueError:
            pass
        else:
            if isinstance(value, dict):
                return value
    if _MIME_TYPE.fullmatch(stripped):
        return {"mimetype": stripped.lower()}
    return {"output": stripped}


def _iso(seconds: float) -> str:
    """A UNIX time as ISO 8601 in UTC with milliseconds (as the inspection pages write it)."""
    stamp = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


def version_metadata(name: str, version: VersionConfig, receipt: Receipt) -> dict[str, Any]:
    """The metadata stored with a produced version, from its configuration and receipt.

    Args:
        name: the version's name.
        version: its configuration.
        receipt: the produce job's receipt.

    Returns:
        A JSON-ready mapping: ``version``, ``service``, ``params``, ``source``
        (``null`` = the original), ``mimetype`` (when configured), and under
        ``produced`` the receipt's ``status``, ``exit_code``, ``duration_s``,
        ``peak_memory``, ``stdin_bytes``, ``stdout_bytes``, ``started_at`` (ISO
        8601 in UTC; ``null`` for a job that never started) and ``instance_id``.
    """
    metadata: dict[str, Any] = {
        "version": name,
        "service": version.service,
        "params": dict(version.params),
        "source": version.source,
    }
    if version.mimetype is not None:
        metadata["mimetype"] = version.mimetype
    metadata["produced"] = {
        "status": receipt.status,
        "exit_code": receipt.exit_code,
        "duration_s": receipt.duration_s,
        "peak_memory": receipt.peak_memory,
        "stdin_bytes": receipt.stdin_bytes,
        "stdout_bytes": receipt.stdout_bytes,
        "started_at": _iso(receipt.started_at) if receipt.started_at > 0 else None,
        "instance_id": receipt.instance_id,
    }
    return metadata
