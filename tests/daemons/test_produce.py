"""The produce plan: classes, produce hashes, the sync diff, states and metadata."""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trio_broker_daemons.fylr import produce as pr
from trio_broker_daemons.fylr.config import FileClass, FylrConfig, VersionConfig

from trio_broker.core.protocol import Receipt

SHA_A = hashlib.sha256(b"a").hexdigest()
SHA_B = hashlib.sha256(b"b").hexdigest()


def config(classes: Mapping[str, Any], default_class: str | None = None) -> FylrConfig:
    """A configuration with these classes and no execservers."""
    return FylrConfig.from_mapping(
        {"execservers": [], "classes": classes, "default_class": default_class}
    )


def file_class(versions: Mapping[str, Any]) -> FileClass:
    """One class ``c`` (extension ``x``) with these versions, loaded through the config."""
    return config({"c": {"extensions": ["x"], "versions": versions}}).classes["c"]


IMAGES = config(
    {
        "image": {"extensions": ["jpg", "JPEG", "png"]},
        "archive": {"extensions": ["gz", "tar.gz", "zip"]},
        "sidecar": {"extensions": [".xmp"]},
        "other": {},
    },
    default_class="other",
)


# -- classes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filename", "expected"),
    [
        ("photo.jpg", "image"),
        ("PHOTO.JPG", "image"),
        ("scan.Jpeg", "image"),
        ("dir/sub/photo.png", "image"),
        ("C:\\Users\\me\\photo.png", "image"),
        ("backup.tar.gz", "archive"),
        ("notes.txt.gz", "archive"),
        ("bundle.zip", "archive"),
        ("photo.xmp", "sidecar"),
        ("README", "other"),
        (".jpg", "other"),
        ("photo.", "other"),
        ("photo.jpg.txt", "other"),
        ("", "other"),
    ],
)
def test_class_of(filename: str, expected: str) -> None:
    """A file name's class is found by its longest configured extension, ignoring case."""
    assert pr.class_of(filename, IMAGES) == expected


def test_class_of_without_default_is_none() -> None:
    """Without a default class, a file whose extension no class lists has no class."""
    plain = config({"image": {"extensions": ["jpg"]}})
    assert pr.class_of("a.jpg", plain) == "image"
    assert pr.class_of("a.txt", plain) is None


def test_extension_candidates() -> None:
    """Candidates run from the longest dotted suffix to the last one, lower-cased."""
    assert pr.extension_candidates("a.B.Tar.GZ") == ("b.tar.gz", "tar.gz", "gz")
    assert pr.extension_candidates("..hidden.txt") == ("txt",)
    assert pr.extension_candidates("a..b") == ("b",)
    assert pr.extension_candidates(".bashrc") == ()
    assert pr.extension_candidates("x/y.d/z") == ()


# -- produce hashes and wanted versions -----------------------------------------------


def test_produce_hash_is_pinned() -> None:
    """The produce hash is SHA-256 over the documented canonical JSON, so it is stable."""
    version = VersionConfig(service="thumbnail", params={"size": "128x128", "q": 1.5})
    canonical = (
        '{"format":1,"params":{"q":1.5,"size":"128x128"},"service":"thumbnail",'
        f'"source":null,"source_hash":"{SHA_A}"}}'
    )
    assert pr.produce_hash(version, SHA_A) == hashlib.sha256(canonical.encode()).hexdigest()
    # computed once, in another process: no per-process salt anywhere
    code = (
        "from trio_broker_daemons.fylr.produce import produce_hash;"
        "from trio_broker_daemons.fylr.config import VersionConfig;"
        f"print(produce_hash(VersionConfig(service='thumbnail', params={{'q': 1.5, "
        f"'size': '128x128'}}), {SHA_A!r}))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert other.stdout.strip() == pr.produce_hash(version, SHA_A)


@pytest.mark.parametrize(
    "changed",
    [
        VersionConfig(service="preview", params={"size": "128x128"}),
        VersionConfig(service="thumbnail", params={"size": "129x128"}),
        VersionConfig(service="thumbnail", params={"size": "128x128", "extra": True}),
        VersionConfig(service="thumbnail", params={"size": "128x128"}, source="other"),
        VersionConfig(service="thumbnail", params={"size": 128}),
    ],
)
def test_produce_hash_changes_with_the_recipe(changed: VersionConfig) -> None:
    """Changing the service, a param, a param's type or the source changes the hash."""
    base = VersionConfig(service="thumbnail", params={"size": "128x128"})
    assert pr.produce_hash(changed, SHA_A) != pr.produce_hash(base, SHA_A)


def test_produce_hash_ignores_mimetype_and_param_order() -> None:
    """The MIME type label and the order params are written in do not change the hash."""
    one = VersionConfig(service="s", params={"a": 1, "b": 2})
    two = VersionConfig(service="s", params={"b": 2, "a": 1}, mimetype="image/png")
    assert pr.produce_hash(one, SHA_A) == pr.produce_hash(two, SHA_A)
    assert pr.produce_hash(one, SHA_A) != pr.produce_hash(one, SHA_B)


def test_param_types_are_distinct_recipes() -> None:
    """1, 1.0, true and "1" are four recipes, since they fill a template differently."""
    hashes = {
        pr.produce_hash(VersionConfig(service="s", params={"p": value}), SHA_A)
        for value in (1, 1.0, True, "1")
    }
    assert len(hashes) == 4


@pytest.mark.parametrize("bad", ["", "abc", SHA_A.upper(), SHA_A + "0", 42])
def test_produce_hash_refuses_a_bad_source_hash(bad: Any) -> None:
    """A source hash that is not 64 lowercase hex digits is a caller's bug."""
    with pytest.raises(ValueError, match="64 lowercase hex digits"):
        pr.produce_hash(VersionConfig(service="s"), bad)
    with pytest.raises(ValueError, match="64 lowercase hex digits"):
        pr.wanted_versions(None, bad)


def test_wanted_versions_chain_through_produce_hashes() -> None:
    """A version made from another one is hashed over that one's produce hash, sources first."""
    cls = file_class(
        {
            "small": {"service": "thumbnail", "source": "preview", "params": {"size": 64}},
            "preview": {"service": "preview"},
            "sha": {"service": "sha256"},
        }
    )
    wanted = pr.wanted_versions(cls, SHA_A)
    assert list(wanted) == ["preview", "small", "sha"]
    assert wanted["preview"] == pr.produce_hash(cls.versions["preview"], SHA_A)
    assert wanted["small"] == pr.produce_hash(cls.versions["small"], wanted["preview"])
    assert pr.wanted_versions(None, SHA_A) == {}


def test_changing_a_source_changes_its_dependents_only() -> None:
    """Changing a version's recipe changes its hash and its dependents', nothing else."""
    before = file_class(
        {
            "preview": {"service": "preview", "params": {"size": 1024}},
            "small": {"service": "thumbnail", "source": "preview"},
            "sha": {"service": "sha256"},
        }
    )
    after = file_class(
        {
            "preview": {"service": "preview", "params": {"size": 2048}},
            "small": {"service": "thumbnail", "source": "preview"},
            "sha": {"service": "sha256"},
        }
    )
    plan = pr.plan_sync(pr.wanted_versions(before, SHA_A), pr.wanted_versions(after, SHA_A))
    assert plan == pr.SyncPlan(
        create=("preview", "small"), keep=("sha",), remove=("preview", "small")
    )


# -- the sync plan ----------------------------------------------------------------------


def test_plan_sync_cases() -> None:
    """The diff creates new names, removes unwanted ones and replaces changed hashes."""
    existing = {"old": "h1", "same": "h2", "changed": "h3"}
    wanted = {"same": "h2", "changed": "h4", "new": "h5"}
    plan = pr.plan_sync(existing, wanted)
    assert plan == pr.SyncPlan(create=("changed", "new"), keep=("same",), remove=("old", "changed"))
    assert plan.changes
    assert not pr.plan_sync(wanted, wanted).changes
    assert pr.plan_sync({}, {}) == pr.SyncPlan(create=(), keep=(), remove=())


def apply(
    plan: pr.SyncPlan, existing: Mapping[str, str], wanted: Mapping[str, str]
) -> dict[str, str]:
    """What the worker does with a plan: delete ``remove``, then insert ``create``."""
    rows = {name: hash_ for name, hash_ in existing.items() if name not in plan.remove}
    for name in plan.create:
        assert name not in rows, f"{name} created over a row that was kept"
        rows[name] = wanted[name]
    return rows


names = st.sampled_from(["thumb", "preview", "small", "sha256", "gz", "big"])
hashes = st.sampled_from(["h1", "h2", "h3"])
version_maps = st.dictionaries(names, hashes, max_size=6)


@given(existing=version_maps, wanted=version_maps)
def test_plan_sync_applied_yields_wanted(existing: dict[str, str], wanted: dict[str, str]) -> None:
    """Applying the plan to ``existing`` yields exactly ``wanted``, touching no kept row."""
    plan = pr.plan_sync(existing, wanted)
    assert apply(plan, existing, wanted) == wanted
    assert set(plan.keep).isdisjoint(plan.create)
    assert set(plan.keep).isdisjoint(plan.remove)
    assert set(plan.remove) <= set(existing)
    assert set(plan.create) <= set(wanted)
    for name in plan.keep:
        assert existing[name] == wanted[name]
    for name in plan.remove:  # nothing removed that was already right
        assert existing[name] != wanted.get(name)
    assert [name for name in wanted if name in plan.create] == list(plan.create)


@given(wanted=version_maps)
def test_plan_sync_against_itself_is_empty(wanted: dict[str, str]) -> None:
    """A re-sync with nothing changed creates and removes nothing and keeps everything."""
    plan = pr.plan_sync(wanted, wanted)
    assert plan == pr.SyncPlan(create=(), keep=tuple(wanted), remove=())
    again = pr.plan_sync(apply(plan, wanted, wanted), wanted)
    assert not again.changes


# -- states ---------------------------------------------------------------------------


def test_api_status_table() -> None:
    """Every internal state maps to the API status of the published table, by kind."""
    assert {state: pr.api_status(state) for state in pr.STATES} == {
        "pending_produce": "processing",  # its own produce step (convert, modify) first
        "new": "processing",  # queued for its first step
        "copy": "processing",  # registered by URL, not fetched yet
        "metadata": "processing",
        "sync": "sync",
        "produce": "sync",  # its versions being made
        "done": "done",
        "error": "failed",
    }
    assert {state: pr.api_status(state, "version") for state in pr.STATES} == {
        "pending_produce": "processing",  # never a version's; mapped anyway
        "new": "pending",
        "copy": "processing",
        "metadata": "processing",
        "sync": "sync",
        "produce": "processing",
        "done": "done",
        "error": "failed",
    }
    with pytest.raises(ValueError, match="unknown file state 'uploading'"):
        pr.api_status("uploading")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="of kind 'rendition'"):
        pr.api_status("new", "rendition")  # type: ignore[arg-type]


def test_the_table_is_in_the_module_docstring() -> None:
    """The module docstring's state table says what API_STATUS does."""
    doc = pr.__doc__ or ""
    for state in pr.STATES:
        original, version = pr.API_STATUS["original"][state], pr.API_STATUS["version"][state]
        assert any(
            line.startswith(f"``{state}``")
            and line.split()[1:3] == [f"``{original}``", f"``{version}``"]
            for line in doc.splitlines()
        ), state


def test_transitions() -> None:
    """The documented life cycles are allowed; skipping or resurrecting steps is not."""
    original: list[pr.FileState] = ["new", "metadata", "sync", "produce", "done"]
    for old, new in itertools.pairwise(original):
        pr.check_transition("original", old, new)
    pr.check_transition("original", "metadata", "new")  # requeued
    pr.check_transition("original", "new", "sync")  # no metadata step
    pr.check_transition("original", "done", "sync")  # re-sync
    produced_first: list[pr.FileState] = ["pending_produce", "new", "metadata", "sync"]
    for old, new in itertools.pairwise(produced_first):
        pr.check_transition("original", old, new)
    pr.check_transition("original", "pending_produce", "sync")  # its class has no metadata step
    pr.check_transition("original", "error", "pending_produce")  # its failed produce retried
    for copied in ("new", "sync"):  # a remote file copied in goes on as an upload
        pr.check_transition("original", "copy", copied)
    pr.check_transition("original", "error", "copy")  # a failed copy requeued
    pr.check_transition("original", "produce", "sync")  # left on its remote: checked again
    version: list[pr.FileState] = ["new", "produce", "done"]
    for old, new in itertools.pairwise(version):
        pr.check_transition("version", old, new)
    pr.check_transition("version", "produce", "new")  # requeued
    pr.check_transition("version", "done", "new")  # its stored bytes went missing (sync_check)
    assert not pr.can_transition("original", "new", "done")
    assert not pr.can_transition("original", "pending_produce", "done")
    assert not pr.can_transition("original", "done", "pending_produce")
    assert not pr.can_transition("version", "done", "produce")
    assert not pr.can_transition("version", "new", "metadata")
    assert not pr.can_transition("version", "new", "pending_produce")
    assert not pr.can_transition("bogus", "new", "new")  # type: ignore[arg-type]
    with pytest.raises(pr.InvalidTransition) as info:
        pr.check_transition("version", "done", "produce")
    assert str(info.value) == "version file cannot go from 'done' to 'produce' (allowed: new)"


def test_every_unfinished_state_can_fail() -> None:
    """Every step an original or version can be at may end in error."""
    for kind, table in pr.TRANSITIONS.items():
        for state in table:
            if state not in pr.FINISHED_STATES:
                assert pr.can_transition(kind, state, "error"), (kind, state)
            assert set(table[state]) <= set(pr.STATES)


@pytest.mark.parametrize(
    ("states", "done"),
    [
        ([], True),
        (["done"], True),
        (["done", "error"], True),
        (["error", "error"], True),
        (["done", "produce"], False),
        (["new"], False),
        (["done", "error", "new"], False),
    ],
)
def test_original_done(states: list[pr.FileState], done: bool) -> None:
    """An original is done exactly when every version is done or error."""
    assert pr.original_done(states) is done


def test_source_readiness() -> None:
    """A version waits for its source version, and fails when that failed or is gone."""
    from_original = VersionConfig(service="s")
    chained = VersionConfig(service="s", source="preview")
    assert pr.source_readiness(from_original, {}) == "ready"
    assert pr.source_readiness(chained, {"preview": "done"}) == "ready"
    assert pr.source_readiness(chained, {"preview": "produce"}) == "waiting"
    assert pr.source_readiness(chained, {"preview": "new"}) == "waiting"
    assert pr.source_readiness(chained, {"preview": "error"}) == "failed"
    assert pr.source_readiness(chained, {}) == "failed"


# -- metadata -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"width": 3, "height": 2}\n', {"width": 3, "height": 2}),
        ("text/CSV\n", {"mimetype": "text/csv"}),
        ("application/vnd.ms-excel", {"mimetype": "application/vnd.ms-excel"}),
        ("", {}),
        ("  \n", {}),
        ("4711 -\n", {"output": "4711 -"}),
        ("[1, 2]", {"output": "[1, 2]"}),
        ('{"cut": ', {"output": '{"cut":'}),
    ],
)
def test_parse_metadata_output(text: str, expected: dict[str, Any]) -> None:
    """JSON objects, a bare MIME type and other text become metadata as documented."""
    assert pr.parse_metadata_output(text) == expected


def test_version_metadata_comes_from_the_receipt() -> None:
    """A produced version's metadata holds its recipe and the produce receipt's figures."""
    receipt = Receipt(
        status="ok",
        exit_code=0,
        stdout_prefix="",
        stdout_bytes=5000,
        stdin_bytes=70000,
        started_at=1790000000.25,
        duration_s=0.5,
        peak_memory=1 << 20,
        instance_id="exec-1",
    )
    version = VersionConfig(
        service="thumbnail", params={"size": "64x64"}, source="preview", mimetype="image/png"
    )
    metadata = pr.version_metadata("small", version, receipt)
    assert metadata == {
        "version": "small",
        "service": "thumbnail",
        "params": {"size": "64x64"},
        "source": "preview",
        "mimetype": "image/png",
        "produced": {
            "status": "ok",
            "exit_code": 0,
            "duration_s": 0.5,
            "peak_memory": 1048576,
            "stdin_bytes": 70000,
            "stdout_bytes": 5000,
            "started_at": "2026-09-21T14:13:20.250Z",
            "instance_id": "exec-1",
        },
    }
    json.dumps(metadata)  # ready for a jsonb column
    assert "mimetype" not in pr.version_metadata("x", VersionConfig(service="s"), receipt)


def test_module_is_pure() -> None:
    """Importing the produce logic pulls in no trio, sockets or database driver I/O layer."""
    code = (
        "import sys; import trio_broker_daemons.fylr.produce;"
        "layers = ('trio', 'httpx', 'hypercorn', 'psycopg_pool');"
        "print(sorted(m for m in layers if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
