"""The fylr configuration: defaults, every key, pinned error lines, class validation."""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.fylr.app import dispatcher_config
from trio_broker_daemons.fylr.config import (
    FileClass,
    FylrConfig,
    MetadataConfig,
    VersionConfig,
    new_backend_id,
)

from trio_broker.core.admission import InstanceLoad, auto_max_in_flight, exec_limit, limits
from trio_broker.trio.host import cpu_count

MINIMAL: dict[str, Any] = {"execservers": []}


def load(tmp_path: Path, text: str) -> FylrConfig:
    """Load YAML text through a real file."""
    path = tmp_path / "fylr.yml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return FylrConfig.from_yaml(path)


def error(data: object) -> str:
    """The one-line ConfigError that from_mapping raises for this data."""
    with pytest.raises(ConfigError) as info:
        FylrConfig.from_mapping(data)
    message = str(info.value)
    assert "\n" not in message
    return message


def with_classes(classes: Any, **top: Any) -> dict[str, Any]:
    """A top-level mapping holding these classes."""
    return {"execservers": [], "classes": classes, **top}


def one_class(**keys: Any) -> dict[str, Any]:
    """A top-level mapping holding one class ``c`` with extension ``x`` and these keys."""
    return with_classes({"c": {"extensions": ["x"], **keys}})


# -- defaults and every key ----------------------------------------------------------


def test_every_default() -> None:
    """A document with only an empty execserver list gets every documented default."""
    assert FylrConfig.from_mapping(MINIMAL) == FylrConfig(
        listen="127.0.0.1:7100",
        name=socket.gethostname(),
        backend_id=None,
        state_dir=Path("fylr-state"),
        database=None,
        database_pool=20,
        execservers=(),
        broker_token=None,
        callback_own_url=None,
        connect_timeout=60.0,
        ping_interval=5.0,
        ping_timeout=15.0,
        max_frame_bytes=1048576,
        pool_grow_interval=2.0,
        pool_max=16,
        pool_reprobe_interval=60.0,
        max_in_flight=0,
        local_workers=0,
        claim_interval=1.0,
        retry_delay=60.0,
        unknown_service_attempts=5,
        counts_interval=60.0,
        heartbeat_interval=10.0,
        stale_after=45.0,
        max_upload_size=None,
        default_class=None,
        classes={},
    )


def test_full_configuration(tmp_path: Path) -> None:
    """Every key set to a non-default value is read into the right type."""
    config = load(
        tmp_path,
        """
        listen: "[::1]:0"
        name: fylr-b
        backend_id: fylr-b-1
        state_dir: /var/lib/fylr
        database: postgresql://fylr:secret@db.example:5433/fylr?sslmode=require
        database_pool: 4
        execservers: [127.0.0.1:7000, "[::1]:7001", exec.example:443]
        broker_token: s3cret
        callback_own_url: http://10.1.2.3:7100
        connect_timeout: 30s
        ping_interval: 1s
        ping_timeout: 3s
        max_frame_bytes: 2048
        pool_grow_interval: 500ms
        pool_max: 3
        pool_reprobe_interval: 5m
        max_in_flight: 7
        local_workers: 3
        claim_interval: 250ms
        retry_delay: "0"
        unknown_service_attempts: 2
        counts_interval: 10s
        heartbeat_interval: 2s
        stale_after: 1m
        max_upload_size: 512M
        default_class: other
        classes:
          image:
            extensions: [JPG, .png, tar.gz]
            metadata: {service: image_metadata, params: {depth: 2}}
            versions:
              thumb: {service: thumbnail, params: {size: 64x64, q: 0.5, fast: true}}
              small: {service: thumbnail, source: thumb, mimetype: image/png}
          other: {}
        """,
    )
    assert (config.host, config.port, config.name, config.backend_id) == (
        "::1",
        0,
        "fylr-b",
        "fylr-b-1",
    )
    assert config.state_dir == Path("/var/lib/fylr")
    assert config.storage_dir == Path("/var/lib/fylr/files")
    assert config.pg_dir == Path("/var/lib/fylr/pg")
    assert config.database == "postgresql://fylr:secret@db.example:5433/fylr?sslmode=require"
    assert config.database_pool == 4
    assert config.execservers == ("127.0.0.1:7000", "[::1]:7001", "exec.example:443")
    assert (config.broker_token, config.callback_own_url) == ("s3cret", "http://10.1.2.3:7100")
    assert (config.connect_timeout, config.ping_interval, config.ping_timeout) == (30, 1, 3)
    assert config.max_frame_bytes == 2048
    assert (config.pool_grow_interval, config.pool_max, config.pool_reprobe_interval) == (
        0.5,
        3,
        300,
    )
    assert (config.max_in_flight, config.local_workers) == (7, 3)
    assert (config.claim_interval, config.retry_delay) == (0.25, 0.0)
    assert (config.unknown_service_attempts, config.counts_interval) == (2, 10)
    assert (config.heartbeat_interval, config.stale_after) == (2, 60)
    assert config.max_upload_size == 512 * 1024**2
    assert config.default_class == "other"
    assert config.classes == {
        "image": FileClass(
            extensions=("jpg", "png", "tar.gz"),
            metadata=MetadataConfig(service="image_metadata", params={"depth": 2}),
            versions={
                "thumb": VersionConfig(
                    service="thumbnail", params={"size": "64x64", "q": 0.5, "fast": True}
                ),
                "small": VersionConfig(service="thumbnail", source="thumb", mimetype="image/png"),
            },
        ),
        "other": FileClass(),
    }


def test_the_example_configuration_loads() -> None:
    """examples/fylr.yml is a valid configuration with the classes it documents."""
    path = Path(__file__).resolve().parents[2] / "examples" / "fylr.yml"
    config = FylrConfig.from_yaml(path)
    assert set(config.classes) == {"image", "text", "legacy_image", "other"}
    assert config.classes["image"].versions["preview_small"].source == "preview"
    assert config.classes["other"].versions == {}
    convert = config.classes["legacy_image"].convert
    assert convert is not None
    assert (convert.service, convert.extension, convert.mimetype) == ("modify", "png", "image/png")
    assert config.modify is not None
    assert config.modify.service == "modify"
    assert (config.parallel, config.storage_locations, config.storage_location) == (None, {}, None)


def test_an_api_only_node_and_storage_locations(tmp_path: Path) -> None:
    """parallel: 0 makes an API-only node; locations are folders by name, relative ones
    relative to the file; storage_location picks where new files go."""
    config = load(
        tmp_path,
        """
        execservers: []
        parallel: 0
        storage_locations: {archive: archive, cold: /srv/cold}
        storage_location: archive
        """,
    )
    assert config.api_only
    assert config.locations == {
        "default": config.storage_dir,
        "archive": tmp_path / "archive",
        "cold": Path("/srv/cold"),
    }
    assert config.storage_location == "archive"
    assert (
        FylrConfig.from_mapping({**MINIMAL, "storage_location": "default"}).storage_location is None
    )
    assert not FylrConfig.from_mapping(MINIMAL).api_only


def test_a_produce_first_class_and_modified_originals() -> None:
    """convert names the conversion and the converted original's extension; modify the
    service of modified originals."""
    config = FylrConfig.from_mapping(
        with_classes(
            {
                "scan": {
                    "extensions": ["bmp", "tif"],
                    "convert": {"service": "to_png", "extension": ".PNG", "timeout": "1m"},
                },
                "image": {"extensions": ["png"]},
            },
            modify={"service": "modify", "params": {"quality": 90}},
        )
    )
    convert = config.classes["scan"].convert
    assert convert is not None
    assert (convert.service, convert.extension, convert.timeout) == ("to_png", "png", 60.0)
    assert config.modify == MetadataConfig(service="modify", params={"quality": 90})


# -- pinned error lines ---------------------------------------------------------------


LISTEN_HINT = 'expected host:port (e.g. "127.0.0.1:7000" or "[::1]:7000"), got '
ID_HINT = "expected 1 to 200 printable ASCII characters without spaces, got "
URL_HINT = 'expected null or an http(s) URL like "http://10.0.0.5:7100", got '
DSN_HINT = (
    "expected null or a PostgreSQL connection string (key=value pairs or a postgresql:// URI)"
)
EXT_HINT = "expected an extension like jpg or tar.gz (no spaces, slashes or empty parts), got "
SCALAR_HINT = "expected a string, number or boolean, got "
OTHER_VERSION = "expected the name of another version of this class"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("execservers", "a:1", "expected a list of addresses (\"host:port\"), got 'a:1'"),
        ("execservers", ["a"], "[0]: " + LISTEN_HINT + "'a'"),
        ("execservers", ["a:0"], "[0]: expected a port from 1 to 65535, got 'a:0'"),
        ("execservers", ["a:1", "b:2", "a:1"], "[2]: duplicate address 'a:1'"),
        ("listen", "7100", LISTEN_HINT + "'7100'"),
        ("name", "", "expected a non-empty string, got ''"),
        ("backend_id", "a b", ID_HINT + "'a b'"),
        ("backend_id", "x" * 201, ID_HINT + repr("x" * 37 + "...")),
        ("state_dir", None, "expected a string, got null"),
        ("database", 5432, "expected a string, got 5432 (quote it)"),
        ("database", "dbname", DSN_HINT + ': missing "=" after "dbname" in connection info string'),
        ("database_pool", 0, "expected an integer >= 1, got 0"),
        ("callback_own_url", "10.0.0.1:7100", URL_HINT + "'10.0.0.1:7100'"),
        ("callback_own_url", "http://a:99999", URL_HINT + "'http://a:99999'"),
        (
            "callback_own_url",
            "http://a:1/x?y",
            "expected a URL without query or fragment, got 'http://a:1/x?y'",
        ),
        (
            "connect_timeout",
            "soon",
            'invalid duration \'soon\' (use e.g. "10s", "30m", "12h" or a number of seconds)',
        ),
        ("ping_timeout", "5s", "expected a duration greater than ping_interval (5s), got 5s"),
        ("pool_max", 0, "expected an integer >= 1, got 0"),
        ("max_in_flight", -1, "expected an integer >= 0, got -1"),
        ("local_workers", "2", "expected an integer, got '2'"),
        ("max_frame_bytes", 1000, "expected an integer >= 1024, got 1000"),
        (
            "stale_after",
            "20s",
            "expected a duration greater than twice heartbeat_interval (20s), got 20s",
        ),
        ("max_upload_size", 0, "expected a size greater than 0, got 0"),
        ("default_class", "x", "expected null or the name of a class (none configured), got 'x'"),
        ("classes", [], "expected a mapping of class names to classes, got a list"),
        ("classes", {"": {}}, "['']: expected class names of 1 to 200 characters, got ''"),
        ("classes", {"c": []}, ".c: expected a mapping, got a list"),
        ("databse", None, "unknown key (did you mean 'database'?)"),
        (
            "parallel",
            4,
            "expected 0 (an API-only node: no file processing here) or null (process files),"
            " got 4: the dispatcher sizes itself (max_in_flight, local_workers)",
        ),
        (
            "parallel",
            False,
            "expected 0 (an API-only node: no file processing here) or null"
            " (process files), got false: the dispatcher sizes itself (max_in_flight,"
            " local_workers)",
        ),
        ("storage_locations", [], "expected a mapping of location names to folders, got a list"),
        (
            "storage_locations",
            {"Cold": "/x"},
            ".Cold: expected a location name of 1 to 63 characters of a-z, 0-9, '_' and '-',"
            " starting with a letter or digit, got 'Cold'",
        ),
        (
            "storage_locations",
            {"default": "/x"},
            ".default: the location name 'default' is state_dir/files, always there",
        ),
        ("storage_locations", {"cold": ""}, ".cold: expected a non-empty string, got ''"),
        (
            "storage_location",
            "cold",
            "expected null, 'default' or a name of storage_locations (none configured), got 'cold'",
        ),
        ("modify", {"params": {}}, ".service: required key is missing"),
        ("modify", {"service": "m", "extension": "png"}, ".extension: unknown key"),
    ],
)
def test_top_level_errors(key: str, value: object, message: str) -> None:
    """Each top-level problem is one line naming the key, what was expected and what came."""
    separator = "" if message[0] in ".[" else ": "
    assert error({"execservers": [], key: value}) == f"{key}{separator}{message}"


def test_document_errors() -> None:
    """A missing required key and a non-mapping document are one-line errors too."""
    assert error({}) == "execservers: required key is missing"
    assert error([]) == "expected a mapping at the top level, got a list"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"extension": ["x"]}, "extension: unknown key (did you mean 'extensions'?)"),
        ({"extensions": "jpg"}, "extensions: expected a list of extensions, got 'jpg'"),
        ({"extensions": ["x", "a/b"]}, "extensions[1]: " + EXT_HINT + "'a/b'"),
        ({"extensions": ["x", "a..b"]}, "extensions[1]: " + EXT_HINT + "'a..b'"),
        ({"extensions": ["x", "."]}, "extensions[1]: " + EXT_HINT + "'.'"),
        (
            {"extensions": ["x", 3]},
            "extensions[1]: expected an extension (a string like jpg), got 3",
        ),
        ({"extensions": ["jpg", ".JPG"]}, "extensions[1]: duplicate extension 'jpg'"),
        (
            {"extensions": []},
            "extensions: expected at least one extension (or make this class the default_class)",
        ),
        ({"metadata": "image_metadata"}, "metadata: expected a mapping, got 'image_metadata'"),
        ({"metadata": {}}, "metadata.service: required key is missing"),
        (
            {"metadata": {"service": "m", "params": {"a": None}}},
            "metadata.params.a: " + SCALAR_HINT + "null",
        ),
        ({"versions": []}, "versions: expected a mapping of version names to versions, got a list"),
        (
            {"versions": {"original": {"service": "s"}}},
            "versions.original: the version name 'original' is reserved in download URLs",
        ),
        (
            {"versions": {"a/b": {"service": "s"}}},
            "versions['a/b']: expected version names of letters, digits, '_', '.' and '-',"
            " got 'a/b'",
        ),
        ({"versions": {"v": {}}}, "versions.v.service: required key is missing"),
        (
            {"versions": {"v": {"service": ""}}},
            "versions.v.service: expected a service name of 1 to 200 characters, got ''",
        ),
        (
            {"versions": {"v": {"service": "s", "parms": {}}}},
            "versions.v.parms: unknown key (did you mean 'params'?)",
        ),
        (
            {"versions": {"v": {"service": "s", "params": {"size": [1, 2]}}}},
            "versions.v.params.size: " + SCALAR_HINT + "a list",
        ),
        (
            {"versions": {"v": {"service": "s", "params": {"q": float("nan")}}}},
            "versions.v.params.q: " + SCALAR_HINT + "nan",
        ),
        (
            {"versions": {"v": {"service": "s", "params": {1: "a"}}}},
            "versions.v.params: expected parameter names of 1 to 200 characters, got 1",
        ),
        (
            {"versions": {"v": {"service": "s", "mimetype": ""}}},
            "versions.v.mimetype: expected a non-empty string, got ''",
        ),
        (
            {"versions": {"v": {"service": "s", "source": "v"}}},
            "versions.v.source: " + OTHER_VERSION + " (there is none), got 'v'",
        ),
        (
            {"versions": {"v": {"service": "s", "source": "w"}, "u": {"service": "s"}}},
            "versions.v.source: " + OTHER_VERSION + " (one of u), got 'w'",
        ),
        (
            {
                "versions": {
                    "a": {"service": "s", "source": "b"},
                    "b": {"service": "s", "source": "c"},
                    "c": {"service": "s", "source": "a"},
                }
            },
            "versions.a.source: sources form a cycle: a -> b -> c -> a",
        ),
        ({"convert": {"service": "s"}}, "convert.extension: required key is missing"),
        (
            {"convert": {"service": "s", "extension": "a b"}},
            "convert.extension: " + EXT_HINT + "'a b'",
        ),
        (
            {"convert": {"service": "s", "extension": "x"}},
            "convert.extension: files converted to 'x' belong to class 'c', which converts"
            " again: name an extension of a class without convert",
        ),
        (
            {
                "convert": {"service": "s", "extension": "y"},
                "versions": {"delivered": {"service": "t"}},
            },
            "versions.delivered: the version name 'delivered' keeps the upload of a class with"
            " convert: name this version otherwise",
        ),
    ],
)
def test_class_errors(keys: dict[str, Any], message: str) -> None:
    """Each problem inside a class is one line with the full key path."""
    assert error(one_class(**keys)) == f"classes.c.{message}"


def test_an_extension_belongs_to_one_class() -> None:
    """Two classes claiming one extension (in any case or spelling) are refused at the second."""
    data = with_classes({"a": {"extensions": ["jpg"]}, "b": {"extensions": ["png", ".JPG"]}})
    assert error(data) == "classes.b.extensions[1]: extension 'jpg' already belongs to class 'a'"


def test_a_class_without_extensions_may_be_the_default() -> None:
    """A class with no extensions is fine as the default class, and only then."""
    config = FylrConfig.from_mapping(with_classes({"rest": {}}, default_class="rest"))
    assert config.classes["rest"] == FileClass()


@pytest.mark.parametrize(
    "dsn",
    [
        "dbname=fylr",
        "host=/run/postgresql dbname=fylr user=fylr",
        "postgresql://localhost/fylr",
        "postgres://u:p@h:5432/d?application_name=fylr",
        # multi-host, for a fail-over (daemons/README.md, Database fail-over)
        "host=db1,db2 port=5432,5433 dbname=fylr user=fylr target_session_attrs=read-write",
        "postgresql://fylr@db1:5432,db2:5433/fylr?target_session_attrs=read-write",
    ],
)
def test_database_strings(dsn: str) -> None:
    """libpq key=value strings and URIs, multi-host ones included, are accepted as
    written."""
    assert FylrConfig.from_mapping({**MINIMAL, "database": dsn}).database == dsn


def test_a_bad_database_string_does_not_echo_it() -> None:
    """A refused connection string is not repeated in the error (it may hold a password)."""
    message = error({**MINIMAL, "database": "host=db password=hunter2 nonsense"})
    assert message.startswith("database: expected null or a PostgreSQL connection string")
    assert "hunter2" not in message


def test_stale_after_must_exceed_two_heartbeats() -> None:
    """stale_after equal to two heartbeat intervals is refused, anything above accepted."""
    assert error({**MINIMAL, "heartbeat_interval": "3s", "stale_after": "6s"}).startswith(
        "stale_after: expected a duration greater than twice heartbeat_interval (6s)"
    )
    config = FylrConfig.from_mapping({**MINIMAL, "heartbeat_interval": "3s", "stale_after": 6.5})
    assert config.stale_after == 6.5


# -- the file -------------------------------------------------------------------------


def test_file_errors(tmp_path: Path) -> None:
    """Missing, empty, non-mapping, invalid and duplicate-key files are one-line errors."""
    missing = tmp_path / "nope.yml"
    with pytest.raises(ConfigError) as info:
        FylrConfig.from_yaml(missing)
    assert str(info.value) == f"{missing}: no such file"
    assert info.value.file == str(missing)
    duplicate = "invalid YAML at line 2, column 1: duplicate key 'execservers'"
    for text, reason in [
        ("", "expected a mapping at the top level, got an empty file"),
        ("- a\n", "expected a mapping at the top level, got a list"),
        ("execservers: [\n", "invalid YAML at line 2, column 1:"),
        ("execservers: []\nexecservers: []\n", duplicate),
    ]:
        with pytest.raises(ConfigError) as info:
            load(tmp_path, text)
        message = str(info.value)
        assert message.startswith(f"{tmp_path / 'fylr.yml'}: {reason}"), message
        assert "\n" not in message


def test_key_errors_from_a_file_name_the_key(tmp_path: Path) -> None:
    """A problem inside a loaded file is reported by key path, like from_mapping."""
    with pytest.raises(ConfigError) as info:
        load(tmp_path, "execservers: []\nclasses: {c: {extensions: [x], versions: {v: {}}}}\n")
    assert str(info.value) == "classes.c.versions.v.service: required key is missing"
    assert info.value.keys == ("classes", "c", "versions", "v", "service")


# -- derived values -------------------------------------------------------------------


def test_new_backend_id() -> None:
    """Every call makes a fresh id that REGISTER and the config rules accept."""
    ids = {new_backend_id("fylr a\tb") for _ in range(50)}
    assert len(ids) == 50
    for backend_id in ids:
        assert backend_id.startswith("fylr_a_b-")
        assert (
            FylrConfig.from_mapping({**MINIMAL, "backend_id": backend_id}).backend_id == backend_id
        )
    assert len(new_backend_id("x" * 500)) <= 200


def test_resolved_local_workers(tmp_path: Path) -> None:
    """local_workers 0 is the CPU count (with a cgroup quota), any other value itself."""
    root = tmp_path / "root"
    for name, text in {
        "proc/self/cgroup": "0::/fylr\n",
        "sys/fs/cgroup/cgroup.controllers": "cpu\n",
        "sys/fs/cgroup/fylr/cpu.max": "100000 100000\n",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    assert FylrConfig.from_mapping(MINIMAL).resolved_local_workers(root=root) == 1
    assert FylrConfig.from_mapping(MINIMAL).resolved_local_workers() == cpu_count()
    config = FylrConfig.from_mapping({**MINIMAL, "local_workers": 5})
    assert config.resolved_local_workers(root=root) == 5
    assert len(os.sched_getaffinity(0)) >= 1


@pytest.mark.parametrize(
    ("pool", "base", "expected"),
    [(20, 0, 32), (20, 5, 32), (20, 9, 36), (20, 20, 40), (20, 100, 40), (10, 3, 20)],
)
def test_automatic_max_in_flight(pool: int, base: int, expected: int) -> None:
    """Automatic max_in_flight is 4 × base, at least 32, at most twice the database pool: the
    fylr hands 0 to the admission arithmetic, which computes it from the store's pool."""
    config = FylrConfig.from_mapping({**MINIMAL, "database_pool": pool})
    admission = dispatcher_config(config, backend_id="b").admission
    assert admission.max_in_flight == 0
    assert auto_max_in_flight(base, config.database_pool) == expected


def test_fixed_max_in_flight() -> None:
    """A configured max_in_flight caps the exec-bound items in flight as it is, odd reserve
    included, however big the fleet."""
    config = FylrConfig.from_mapping({**MINIMAL, "max_in_flight": 3})
    admission = dispatcher_config(config, backend_id="b").admission
    fleet = [InstanceLoad(instance_id="x", processes=1000, clients=1, idle=0)]
    got = limits(fleet, rise=0, config=admission)
    assert (got.limit, got.reserve) == (2, 1)
    assert exec_limit(fleet, waiting=0, queue_deep=True, config=admission) == 2


# -- source graphs --------------------------------------------------------------------


@st.composite
def source_forests(draw: st.DrawFn) -> dict[str, str | None]:
    """Version names mapped to a source among the earlier names (or None), then shuffled."""
    count = draw(st.integers(1, 8))
    names = [f"v{i}" for i in range(count)]
    sources: dict[str, str | None] = {}
    for index, name in enumerate(names):
        sources[name] = draw(st.none() | st.sampled_from(names[:index])) if index else None
    order = draw(st.permutations(names))
    return {name: sources[name] for name in order}


def class_with_sources(sources: dict[str, str | None]) -> dict[str, Any]:
    """A one-class document whose versions have these sources."""
    return one_class(
        versions={name: {"service": "s", "source": src} for name, src in sources.items()}
    )


@given(sources=source_forests())
def test_acyclic_sources_load_in_production_order(sources: dict[str, str | None]) -> None:
    """Any acyclic set of sources loads, and production order puts each source first."""
    cls = FylrConfig.from_mapping(class_with_sources(sources)).classes["c"]
    order = cls.production_order()
    assert sorted(order) == sorted(sources)
    for name, source in sources.items():
        if source is not None:
            assert order.index(source) < order.index(name)


@given(sources=source_forests(), data=st.data())
def test_any_cycle_is_refused(sources: dict[str, str | None], data: st.DataObject) -> None:
    """Pointing a version at itself or at anything made from it is refused as a cycle."""
    names = list(sources)
    victim = data.draw(st.sampled_from(names))
    descendants = {victim}
    changed = True
    while changed:
        changed = False
        for name, source in sources.items():
            if source in descendants and name not in descendants:
                descendants.add(name)
                changed = True
    target = data.draw(st.sampled_from(sorted(descendants)))
    message = error(class_with_sources({**sources, victim: target}))
    if target == victim:
        assert "expected the name of another version of this class" in message
    else:
        assert "sources form a cycle" in message


@pytest.mark.parametrize("value", ["0", 0, None])
def test_connect_timeout_zero_or_null_is_the_default(value: object) -> None:
    """connect_timeout 0 or null means 60 s, as the broker client reads it."""
    data = {"execservers": ["127.0.0.1:7000"], "connect_timeout": value}
    assert FylrConfig.from_mapping(data).connect_timeout == 60.0


# -- on-demand renditions ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("presets", "message"),
    [
        ({"p": {}}, "custom_version_presets.p.service: required key is missing"),
        (
            {"p": {"service": "s", "filename": "{stem}.{size}"}},
            "custom_version_presets.p.filename: expected placeholders among filename, id,"
            " preset, stem, got {size}",
        ),
        (
            {"p": {"service": "s", "mimetype": "image/{"}},
            "custom_version_presets.p.mimetype: expected {name} placeholders and plain text,"
            " got 'image/{'",
        ),
        (
            {"p": {"service": "s", "classes": ["nope"]}},
            "custom_version_presets.p.classes[0]: expected the name of a class (c), got 'nope'",
        ),
        (
            {"a/b": {"service": "s"}},
            "custom_version_presets['a/b']: expected preset names of letters, digits, '_', '.'"
            " and '-', got 'a/b'",
        ),
    ],
)
def test_preset_errors(presets: dict[str, Any], message: str) -> None:
    """Each problem of a preset is one line with its key path."""
    assert error({**one_class(), "custom_version_presets": presets}) == message


@pytest.mark.parametrize(
    ("custom", "message"),
    [
        ({"s": {}}, "custom_versions.s.params: required key is missing"),
        (
            {"s": {"params": {"size": []}}},
            "custom_versions.s.params.size: expected a non-empty list of allowed values,"
            " got a list",
        ),
        (
            {"s": {"params": {"service": ["x"]}}},
            "custom_versions.s.params: expected parameter names of letters, digits, '_', '.'"
            " and '-' (not service), got 'service'",
        ),
        (
            {"s": {"params": {"size": ["1"]}, "filename": "{preset}"}},
            "custom_versions.s.filename: expected placeholders among filename, id, service,"
            " size, stem, got {preset}",
        ),
    ],
)
def test_custom_version_errors(custom: dict[str, Any], message: str) -> None:
    """Each problem of a class's custom versions is one line with its key path."""
    assert error(one_class(custom_versions=custom)) == f"classes.c.{message}"


def test_custom_is_no_version_name() -> None:
    """``custom`` names the on-demand route in download URLs."""
    assert error(one_class(versions={"custom": {"service": "s"}})) == (
        "classes.c.versions.custom: the version name 'custom' is reserved in download URLs"
    )
