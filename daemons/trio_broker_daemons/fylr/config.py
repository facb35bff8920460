"""The reference fylr daemon's configuration: YAML in, frozen values out.

:meth:`FylrConfig.from_yaml` and :meth:`FylrConfig.from_mapping` follow the
conventions of :mod:`trio_broker_daemons.config` and share its converter and field
rules: strict primitives, unknown keys refused, and every problem raised as one
:class:`~trio_broker_daemons.config.values.ConfigError` line that starts with the
dotted key path::

    classes.image.versions.small.source: expected the name of another version of
    this class (one of preview, thumb), got 'big'

Durations, sizes, ``null``, integers and strings follow the value conventions of
:mod:`trio_broker_daemons.config` (``"10s"``, ``"512M"``, quoted numbers refused …).

Top-level keys (:class:`FylrConfig`):

``listen`` (``"127.0.0.1:7100"``)
    ``host:port`` of the one HTTP listener (file API, pipes, ``/whoami``,
    inspection); port 0 picks a free port.
``name`` (the host name)
    Sent in ``REGISTER.name`` and shown by the inspection pages.
``backend_id`` (null)
    Sent in ``REGISTER.backend_id``, answered by ``/whoami`` and written into the
    claimed queue rows. Null (the default) means a fresh random id for every
    process start (:func:`new_backend_id`): a backend id names one *running
    process*, whose pipes live in its memory and whose heartbeat vouches for its
    claims. A restarted process is a new backend; the rows its predecessor had
    claimed go back to the queue through the stale-heartbeat sweep. Reusing an id
    across restarts would let the new process's heartbeat keep the dead one's
    claims alive. Set a fixed id only for a process that is never run twice at
    once and whose claims are returned at startup by other means. 1 to 200
    printable ASCII characters without spaces.
``state_dir`` (``"fylr-state"``)
    The daemon's own folder: stored files under ``files/`` (:attr:`FylrConfig.storage_dir`)
    and the embedded PostgreSQL cluster under ``pg/`` (:attr:`FylrConfig.pg_dir`).
    A relative path is relative to the configuration file's folder (to the
    working directory for a document not read from a file).
``database`` (null)
    Null runs a private PostgreSQL cluster in ``state_dir/pg``; otherwise a
    libpq connection string (``"host=db dbname=fylr"`` or a ``postgresql://``
    URI) of a server shared by several fylrs. Its syntax is checked here.
``database_pool`` (20, >= 1)
    Connections to the database; the automatic ``max_in_flight`` stays at or below
    twice this.
``execservers`` (required; may be empty)
    Addresses (``host:port``, ``[v6]:port``) of the execservers or of balancers in
    front of them; each is dialled at ``ws://host:port/broker``. Written
    ``wss://host:port``, it is dialled over TLS (the certificate is checked
    against ``broker_ca_file``, else the system's trust store, and must name the
    host); ``ws://host:port`` is the plain form spelled out. Either every address
    is ``wss://`` or none is. No duplicates. An empty list runs local work only;
    exec-bound work waits.
``broker_token`` (null), or ``broker_token_file``
    Sent as ``Authorization: Bearer <token>`` when dialling ``/broker``;
    ``broker_token_file`` reads it from a file (a mounted secret), not both.
``tokens`` ({}): ``{upload, read, operator}``
    Who may do what on the listener (:mod:`~trio_broker_daemons.fylr.access`):
    ``upload`` puts files in, ``read`` reads documents and downloads,
    ``operator`` syncs, requeues, sweeps and reads the inspection pages, their
    websockets and the metrics; an ``upload`` or ``operator`` token also reads.
    Each is null (that role's routes need no token) or a string, also
    ``upload_file``, ``read_file``, ``operator_file`` (a mounted secret) or
    ``TRIO_BROKER_TOKENS__<ROLE>``; no two roles share a token. A role without a
    token is allowed only while ``listen`` is on loopback, or with
    ``insecure_open_api``.
``insecure_open_api`` (false)
    Serve the roles without a token on a listener beyond loopback (one warning
    line at start). Without it such a configuration does not load.
``allowed_hosts`` ([])
    ``Host`` names the listener answers besides IP addresses, ``localhost``, the
    listen host, ``name`` and the host of ``callback_own_url``: the names
    clients and proxies use (``fylr.example.com``); ``["*"]`` answers any name.
    Another name is refused (421), so a page that rebinds its DNS name to this
    address gets nothing.
``allowed_origins`` ([])
    Origins (``https://ui.example.com``) whose pages may post to the fylr and open
    its websockets, besides the fylr's own.
``link_key`` (null), or ``link_key_file``
    The key (at least 32 characters) that signs the download links of the file
    documents; null = a random key at every start (links then die with the
    process, and one fylr's links fail on another). Fylrs behind one address
    share it.
``link_ttl`` (1h, > 0)
    How long a signed link stays valid.
``broker_ca_file`` (null)
    A PEM file of the certificate authorities that sign the execservers' TLS
    certificates (``wss://`` addresses only); null = the system's trust store.
    Checked at load. A wrong token or an untrusted certificate is logged as one
    error line per address when the fylr starts.
``callback_own_url`` (null)
    The callback base put into jobs verbatim (``http://host:port``, no query or
    fragment), overriding the address seen on each broker connection (NAT).
``connect_timeout`` (60s; null or 0 = 60s)
    How long a job waits for a slot before it gives up and its item is requeued.
``ping_interval`` (5s, > 0), ``ping_timeout`` (15s, > ``ping_interval``)
    Liveness of the broker connections, as on the execserver side.
``max_frame_bytes`` (1048576, >= 1024)
    Largest websocket frame accepted from an execserver.
``pool_grow_interval`` (2s, > 0), ``pool_max`` (16, >= 1), ``pool_reprobe_interval`` (60s, > 0)
    The client-side connection pool per address (PROTOCOL.md).
    ``pool_reprobe_interval`` is also how long the pool looks for a service no
    connection announced before a step of it fails for good.
``max_in_flight`` (0, >= 0)
    Cap on queue items in flight; 0 = automatic
    (:func:`~trio_broker.core.admission.auto_max_in_flight` of the database pool).
``local_workers`` (0, >= 0)
    Concurrent local-bound actions (sync, checksum, copy_move, sync_check); 0 =
    :func:`~trio_broker.trio.host.cpu_count`.
``parallel`` (null)
    ``0`` makes an API-only node: no dispatcher and no broker connections; it
    serves uploads, downloads, pipes and inspection while another fylr on the
    same database (and storage folder) does the work. Null (the default)
    processes files. Any other value is refused: the dispatcher sizes itself
    (``max_in_flight``, ``local_workers``).
``claim_interval`` (1s, > 0)
    How often the dispatcher claims queue rows when nothing finishes.
``retry_delay`` (1m, >= 0)
    How long a requeued item waits (no slot in time, a draining execserver, a
    storage error): the dispatcher's one ``retry_delay``.
``unknown_service_attempts`` (5, >= 1; ignored)
    Accepted so that older files load; it has no effect. A step whose service
    no connected execserver offers (a misspelled recipe) is requeued after
    ``retry_delay`` with the reason and the closest offered name in its file's
    ``error`` (one warning) while the broker client looks for the service,
    and fails once the client looked a whole ``pool_reprobe_interval`` without
    finding it (time, not claims: behind a balancer the pool keeps dialling the
    replicas it has not reached, PROTOCOL.md "Several clients behind one
    balancer").
``counts_interval`` (1m, >= 0)
    The files by kind and state that ``/metrics`` and ``/inspect/system/fylr``
    show are counted again at most this often (a full count reads every row);
    their age is shown beside them. 0 counts at every request.
``heartbeat_interval`` (10s, > 0)
    How often this backend writes its heartbeat.
``stale_after`` (45s, > 2 × ``heartbeat_interval``)
    A backend whose heartbeat is older than this is dead; its claimed rows are
    requeued. More than two intervals, so one late heartbeat never kills a live one.
    It also paces the storage sweep (:mod:`~trio_broker_daemons.fylr.sweep`): a dead
    writer's leftovers go once 2 × ``stale_after`` old, swept every 10 × ``stale_after``.
``max_upload_size`` (null)
    Largest upload accepted, bytes or a size string; null = no limit. A file
    copied in from a remote URL (``PUT /eas/rput``) is held to it too.
``storage_locations`` ({})
    Further storage locations besides ``default`` (``state_dir/files``): a name
    (1 to 63 of ``a-z 0-9 _ -``, starting with a letter or digit, not
    ``default``) → a folder (relative to the configuration file's folder). A
    stored file's key names its location (``archive:originals/…``); the
    ``copy_move`` action moves files between locations.
``storage_location`` (null)
    Where new files are stored: null = ``default``, or a name of
    ``storage_locations``. ``copy_move`` moves files here unless told another.
``modify`` (null)
    The step that makes modified originals (``POST /eas/produce``): ``{service:
    NAME, params: {...}, timeout, stall_timeout}``; the job's params are these
    with ``rotate`` (0, 90, 180, 270), ``crop`` (``x,y,w,h`` or empty) and
    ``format`` (an extension, or empty to keep the source's) laid over them.
    Null: modified originals are refused (501).
``rput`` ({})
    Remote sources (:class:`~trio_broker_daemons.fylr.remote.RputConfig`):
    ``blocked_hosts`` (CIDR ranges, addresses and host names the fylr never
    fetches from; default: loopback, link-local with the cloud metadata
    address, private, unique-local, ``0.0.0.0/8`` and multicast; a list given
    replaces it), ``allowed_hosts`` (ranges let through although blocked, ``[]``),
    ``give_up_after`` (1h), ``timeout`` (30s), ``reference_steps`` (``none``,
    ``metadata`` or ``all``: what is made of a file left on its remote).
``default_class`` (null)
    The class of files whose extension no class lists (and of files without one);
    null = such files have no class: no metadata step and no versions.
``classes`` ({})
    File class name (1..200 characters) → :class:`FileClass`.
``custom_version_presets`` ({})
    Preset name (1..200 characters of ``A-Z a-z 0-9 _ . -``) → :class:`PresetConfig`:
    the renditions ``GET /api/v1/eas/download/<id>/custom?preset=NAME`` makes at
    request time (:mod:`~trio_broker_daemons.fylr.renditions`).

File class keys (:class:`FileClass`):

``extensions`` ([])
    File name extensions without the dot, matched case-insensitively (stored in
    lower case, a leading dot is dropped); several dots are allowed (``tar.gz``,
    the longest match wins). An extension belongs to at most one class. A class
    with no extensions must be the ``default_class``.
``metadata`` (null)
    The metadata step: ``{service: NAME, params: {...}}`` run on the original after
    upload; null = none. It takes ``timeout`` and ``stall_timeout`` as a version does.
``versions`` ({})
    Version name → :class:`VersionConfig`. Names are 1 to 200 characters of
    ``A-Z a-z 0-9 _ . -`` (they appear in download URLs), not ``original`` or
    ``custom``.
``custom_versions`` ({})
    Service name → :class:`CustomVersionConfig`: the on-demand renditions a
    download may ask for with explicit parameters
    (``…/custom?service=NAME&PARAM=VALUE…``), limited to the values listed here.
``convert`` (null)
    A produce-first class: its originals are converted before they are
    originals at all (:class:`ConvertConfig`: ``service``, ``params``,
    ``extension``, ``mimetype``, ``timeout``, ``stall_timeout``). The upload is
    kept as the original's manual version ``delivered``; the converted bytes
    are the original, named with ``extension`` and classified again by it, so
    the class of that extension gives its metadata step and versions. That
    class must not convert again, and a class with ``convert`` has no version
    named ``delivered``.

Preset keys (:class:`PresetConfig`):

``service`` (required), ``params`` ({}), ``timeout``, ``stall_timeout`` (null)
    As for a version.
``mimetype`` (null)
    The response's ``Content-Type``; null = ``application/octet-stream``.
``filename`` (``"{stem}.{preset}"``)
    The ``Content-Disposition`` file name: a pattern of ``{filename}`` (the
    original's), ``{stem}`` (it without its last extension), ``{id}``,
    ``{preset}`` and the preset's params.
``classes`` ([])
    The classes whose files may use it; empty = every file.

Custom version keys (:class:`CustomVersionConfig`):

``params`` (required)
    Parameter name → the list of values a request may give it (strings,
    numbers, booleans); a request gives every one of them, nothing else.
``mimetype`` (null), ``filename`` (``"{stem}.{service}"``)
    Patterns as for a preset, with ``{service}`` instead of ``{preset}``; a
    ``{param}`` is the value the request chose (``"image/{format}"``).
``timeout``, ``stall_timeout`` (null)
    As for a version.

Version keys (:class:`VersionConfig`):

``service`` (required)
    The execserver service that produces it (checked by the execservers, not here).
``params`` ({})
    The job's params: names to strings, numbers or booleans (they fill the
    service's argv template).
``source`` (null)
    Null: produced from the original. Otherwise the name of another version of
    the same class, produced from that version's content; no cycles.
``mimetype`` (null)
    The MIME type the stored rendition is labelled with (``image/webp``); null =
    taken from the produce metadata or ``application/octet-stream``. Not part of
    the produce hash: changing it does not produce the version again.
``timeout`` (null), ``stall_timeout`` (null)
    This recipe's own wall-clock ceiling and stall window for its job (durations,
    ``"0"`` = none), sent in the job object, where they take precedence over the
    execserver service's; null = the service's. Not part of the produce hash.
"""

import math
import os
import re
import secrets
import socket
import ssl
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Final, TypeAlias

import attrs
import psycopg
from psycopg.conninfo import conninfo_to_dict

from trio_broker.core.job import format_job_duration
from trio_broker.trio.host import cpu_count
from trio_broker_daemons.config.rules import (
    MAX_SERVICE_NAME_CHARS,
    Rule,
    config_path,
    integer,
    listen_address,
    loopback_host,
    nonempty_string,
    optional_size,
    optional_token,
    parse_listen,
    positive_duration,
    string,
)
from trio_broker_daemons.config.sources import secret_file
from trio_broker_daemons.config.structure import (
    converter,
    load_config,
    locate,
    structure_config,
)
from trio_broker_daemons.config.values import ConfigError, parse_duration, show
from trio_broker_daemons.fylr.access import Tokens, check_host_names, check_origins, hidden
from trio_broker_daemons.fylr.remote import RputConfig

__all__ = [
    "DEFAULT_FYLR_LISTEN",
    "DEFAULT_LOCATION",
    "DELIVERED_VERSION",
    "MAX_BACKEND_ID_CHARS",
    "MAX_NAME_CHARS",
    "RESERVED_VERSION_NAMES",
    "ConvertConfig",
    "CustomVersionConfig",
    "FileClass",
    "FylrConfig",
    "MetadataConfig",
    "ParamValue",
    "PresetConfig",
    "VersionConfig",
    "fill_pattern",
    "is_version_name",
    "job_limits",
    "new_backend_id",
    "split_broker_address",
]

DEFAULT_FYLR_LISTEN: Final = "127.0.0.1:7100"
MAX_NAME_CHARS: Final = 200
"""Longest class or version name."""
MAX_BACKEND_ID_CHARS: Final = 200
RESERVED_VERSION_NAMES: Final = frozenset({"original", "custom"})
"""Version names refused: in download URLs ``original`` names the uploaded file and
``custom`` an on-demand rendition."""
DELIVERED_VERSION: Final = "delivered"
"""The manual version that keeps a produce-first original's upload as it was delivered."""
DEFAULT_LOCATION: Final = "default"
"""The storage location ``state_dir/files`` (keys without a location prefix)."""
_LOCATION_NAME: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")

ParamValue: TypeAlias = str | int | float | bool
"""A job parameter value (what an argv placeholder can be filled with)."""

_VERSION_NAME: Final = re.compile(r"[A-Za-z0-9_.-]+")
_BACKEND_ID: Final = re.compile(r"[!-~]+")  # printable ASCII, no space
_EXTENSION: Final = re.compile(r"[^\s/\\.]+(?:\.[^\s/\\.]+)*")


def new_backend_id(name: str) -> str:
    """A fresh backend id for one process: the name (cut to 100 characters) and 128 random bits.

    Args:
        name: the configured ``name``.

    Returns:
        ``"<name>-<22 URL-safe characters>"`` with spaces and control characters
        of the name replaced by ``_``; at most :data:`MAX_BACKEND_ID_CHARS` long.
    """
    safe = "".join(c if "!" <= c <= "~" else "_" for c in name[:100])
    return f"{safe}-{secrets.token_urlsafe(16)}"


# -- field rules ---------------------------------------------------------------


def _bounded_name(what: str) -> Callable[[object], str]:
    def check(value: object) -> str:
        if type(value) is not str or not 1 <= len(value) <= MAX_NAME_CHARS:
            raise ConfigError(
                f"expected {what} of 1 to {MAX_NAME_CHARS} characters, got {show(value)}"
            )
        return value

    return check


def _service_name(value: object) -> str:
    if type(value) is not str or not 1 <= len(value) <= MAX_SERVICE_NAME_CHARS:
        raise ConfigError(
            f"expected a service name of 1 to {MAX_SERVICE_NAME_CHARS} characters,"
            f" got {show(value)}"
        )
    return value


def _optional_name(value: object) -> str | None:
    return None if value is None else _bounded_name("a name")(value)


def _backend_id(value: object) -> str | None:
    if value is None:
        return None
    text = string(value)
    if not 1 <= len(text) <= MAX_BACKEND_ID_CHARS or not _BACKEND_ID.fullmatch(text):
        raise ConfigError(
            f"expected 1 to {MAX_BACKEND_ID_CHARS} printable ASCII characters without"
            f" spaces, got {show(value)}"
        )
    return text


def _dsn(value: object) -> str | None:
    if value is None:
        return None
    text = nonempty_string(value)
    try:
        conninfo_to_dict(text)
    except psycopg.Error as exc:
        # libpq's reason, without echoing the string (it may hold a password)
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(
            f"expected null or a PostgreSQL connection string (key=value pairs or a"
            f" postgresql:// URI): {reason}"
        ) from None
    return text


def _address(value: object) -> str:
    listen_address(value)
    assert isinstance(value, str)
    if parse_listen(value)[1] == 0:
        raise ConfigError(f"expected a port from 1 to 65535, got {show(value)}")
    return value


BROKER_SCHEMES: Final = ("ws", "wss")


def _broker_address(value: object) -> str:
    """``host:port``, or ``ws://host:port`` / ``wss://host:port``."""
    if isinstance(value, str) and "://" in value:
        scheme, _, rest = value.partition("://")
        if scheme not in BROKER_SCHEMES:
            raise ConfigError(
                f'expected "host:port", "ws://host:port" or "wss://host:port", got {show(value)}'
            )
        _address(rest)
        return value
    return _address(value)


def split_broker_address(address: str) -> tuple[bool, str]:
    """(whether it is ``wss://``, ``host:port``) of a configured execserver address."""
    scheme, sep, rest = address.partition("://")
    return (scheme == "wss", rest) if sep else (False, address)


def _broker_ca_file(value: object) -> Path | None:
    if value is None:
        return None
    path = config_path(value)
    try:
        ssl.create_default_context(cafile=str(path))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load CA certificates from '{path}': {exc}") from None
    return path


def _addresses(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f'expected a list of addresses ("host:port"), got {show(value)}')
    seen: set[str] = set()
    for index, element in enumerate(value):
        try:
            _broker_address(element)
        except ConfigError as exc:
            raise ConfigError(exc.reason, keys=(index,)) from None
        if element in seen:
            raise ConfigError(f"duplicate address {show(element)}", keys=(index,))
        seen.add(element)
    return tuple(value)


def _callback_url(value: object) -> str | None:
    if value is None:
        return None
    text = nonempty_string(value)
    problem = f'expected null or an http(s) URL like "http://10.0.0.5:7100", got {show(value)}'
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise ConfigError(problem) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(problem)
    if parts.query or parts.fragment or "?" in text or "#" in text:
        raise ConfigError(f"expected a URL without query or fragment, got {show(value)}")
    return text


def _param_value(value: object) -> ParamValue:
    if type(value) in (str, int, bool):
        assert isinstance(value, str | int)
        return value
    if type(value) is float and math.isfinite(value):
        return value
    raise ConfigError(f"expected a string, number or boolean, got {show(value)}")


def _params(value: object) -> dict[str, ParamValue]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a mapping of parameter names to values, got {show(value)}")
    result: dict[str, ParamValue] = {}
    for name, raw in value.items():
        if type(name) is not str or not 1 <= len(name) <= MAX_NAME_CHARS:
            raise ConfigError(
                f"expected parameter names of 1 to {MAX_NAME_CHARS} characters, got {show(name)}"
            )
        try:
            result[name] = _param_value(raw)
        except ConfigError as exc:
            raise ConfigError(exc.reason, keys=(name,)) from None
    return result


def _extension(value: object) -> str:
    if type(value) is not str:
        raise ConfigError(f"expected an extension (a string like jpg), got {show(value)}")
    text = value[1:] if value.startswith(".") else value
    if not _EXTENSION.fullmatch(text):
        raise ConfigError(
            f"expected an extension like jpg or tar.gz (no spaces, slashes or empty"
            f" parts), got {show(value)}"
        )
    return text.lower()


def _extensions(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"expected a list of extensions, got {show(value)}")
    result: list[str] = []
    for index, element in enumerate(value):
        try:
            extension = _extension(element)
        except ConfigError as exc:
            raise ConfigError(exc.reason, keys=(index,)) from None
        if extension in result:
            raise ConfigError(f"duplicate extension {extension!r}", keys=(index,))
        result.append(extension)
    return tuple(result)


def is_version_name(text: str) -> bool:
    """Whether ``text`` could name a version (what the configuration accepts)."""
    return 1 <= len(text) <= MAX_NAME_CHARS and _VERSION_NAME.fullmatch(text) is not None


def _version_name(value: object) -> str:
    if type(value) is not str or not 1 <= len(value) <= MAX_NAME_CHARS:
        raise ConfigError(
            f"expected version names of 1 to {MAX_NAME_CHARS} characters, got {show(value)}"
        )
    if not is_version_name(value):
        raise ConfigError(
            f"expected version names of letters, digits, '_', '.' and '-', got {show(value)}"
        )
    if value in RESERVED_VERSION_NAMES:
        raise ConfigError(f"the version name {value!r} is reserved in download URLs")
    return value


def _structured_mapping(
    value: object, cls: type[Any], what: str, check_name: Callable[[object], object]
) -> dict[str, Any]:
    """A mapping of names to attrs classes, each structured with its key path."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a mapping of {what}, got {show(value)}")
    result: dict[str, Any] = {}
    for name, raw in value.items():
        try:
            check_name(name)
        except ConfigError as exc:
            raise ConfigError(exc.reason, keys=(name,) if type(name) is str else ()) from None
        try:
            result[name] = converter.structure(raw, cls)
        except Exception as exc:
            inner = locate(exc)
            raise ConfigError(inner.reason, keys=(name, *inner.keys)) from None
    return result


def _versions(value: object) -> dict[str, "VersionConfig"]:
    return _structured_mapping(value, VersionConfig, "version names to versions", _version_name)


def _classes(value: object) -> dict[str, "FileClass"]:
    return _structured_mapping(
        value, FileClass, "class names to classes", _bounded_name("class names")
    )


def _metadata(value: object) -> "MetadataConfig | None":
    if value is None:
        return None
    config: MetadataConfig = converter.structure(value, MetadataConfig)
    return config


def _job_limit(value: object) -> float | None:
    """A recipe's job limit: null = the service's, zero = none for this job."""
    return None if value is None else parse_duration(value)


def job_limits(recipe: "VersionConfig | MetadataConfig | ConvertConfig") -> dict[str, str]:
    """The job object members for a recipe's own limits (none when it sets none)."""
    limits = {"timeout": recipe.timeout, "stall_timeout": recipe.stall_timeout}
    return {name: format_job_duration(v) for name, v in limits.items() if v is not None}


DEFAULT_CONNECT_TIMEOUT: Final = 60.0


def _connect_timeout(value: object) -> float:
    """A duration where null and 0 mean the default (60 s), as in the client."""
    return (
        DEFAULT_CONNECT_TIMEOUT
        if value is None
        else parse_duration(value) or DEFAULT_CONNECT_TIMEOUT
    )


MIN_LINK_KEY_CHARS: Final = 32


def _link_key(value: object) -> str | None:
    if value is None:
        return None
    text = string(value)
    if len(text) < MIN_LINK_KEY_CHARS:
        raise ConfigError(
            f"expected null or a key of at least {MIN_LINK_KEY_CHARS} characters (e.g. the"
            f" output of 'openssl rand -base64 32'), got {len(text)} characters"
        )
    return text


def _mimetype(value: object) -> str | None:
    return None if value is None else nonempty_string(value)


_PLACEHOLDER: Final = re.compile(r"\{(\w*)\}")


def fill_pattern(pattern: str, values: Mapping[str, object]) -> str:
    """A ``filename`` or ``mimetype`` pattern with each ``{name}`` replaced by its value."""
    return _PLACEHOLDER.sub(lambda match: str(values[match.group(1)]), pattern)


def _check_pattern(pattern: str | None, known: set[str], key: str) -> None:
    if pattern is None:
        return
    for name in _PLACEHOLDER.findall(pattern):
        if name not in known:
            raise ConfigError(
                f"expected placeholders among {', '.join(sorted(known))}, got {{{name}}}",
                keys=(key,),
            )


def _pattern(value: object) -> str:
    text = nonempty_string(value)
    if "{" in _PLACEHOLDER.sub("", text) or "}" in _PLACEHOLDER.sub("", text):
        raise ConfigError(f"expected {{name}} placeholders and plain text, got {show(value)}")
    return text


def _optional_pattern(value: object) -> str | None:
    return None if value is None else _pattern(value)


def _allowed_values(value: object) -> tuple[ParamValue, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"expected a non-empty list of allowed values, got {show(value)}")
    result: list[ParamValue] = []
    for index, element in enumerate(value):
        try:
            result.append(_param_value(element))
        except ConfigError as exc:
            raise ConfigError(exc.reason, keys=(index,)) from None
    return tuple(result)


def _allowed_params(value: object) -> dict[str, tuple[ParamValue, ...]]:
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(
            f"expected a mapping of parameter names to value lists, got {show(value)}"
        )
    result: dict[str, tuple[ParamValue, ...]] = {}
    for name, raw in value.items():
        if type(name) is not str or not _VERSION_NAME.fullmatch(name) or name == "service":
            raise ConfigError(
                f"expected parameter names of letters, digits, '_', '.' and '-' (not service),"
                f" got {show(name)}"
            )
        try:
            result[name] = _allowed_values(raw)
        except ConfigError as exc:
            raise ConfigError(exc.reason, keys=(name, *exc.keys)) from None
    return result


def _custom_versions(value: object) -> dict[str, "CustomVersionConfig"]:
    return _structured_mapping(
        value, CustomVersionConfig, "service names to custom versions", _service_name
    )


def _presets(value: object) -> dict[str, "PresetConfig"]:
    return _structured_mapping(value, PresetConfig, "preset names to presets", _preset_name)


def _preset_name(value: object) -> str:
    if type(value) is not str or not 1 <= len(value) <= MAX_NAME_CHARS:
        raise ConfigError(
            f"expected preset names of 1 to {MAX_NAME_CHARS} characters, got {show(value)}"
        )
    if not _VERSION_NAME.fullmatch(value):
        raise ConfigError(
            f"expected preset names of letters, digits, '_', '.' and '-', got {show(value)}"
        )
    return value


def _class_names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"expected a list of class names, got {show(value)}")
    return tuple(_bounded_name("class names")(element) for element in value)


def _parallel(value: object) -> int | None:
    """``null`` (process files) or ``0`` (an API-only node); nothing else."""
    if value is None or (type(value) is int and value == 0):
        return value
    raise ConfigError(
        "expected 0 (an API-only node: no file processing here) or null (process files),"
        f" got {show(value)}: the dispatcher sizes itself (max_in_flight, local_workers)"
    )


def _location_name(value: object) -> str:
    if type(value) is not str or not _LOCATION_NAME.fullmatch(value):
        raise ConfigError(
            "expected a location name of 1 to 63 characters of a-z, 0-9, '_' and '-',"
            f" starting with a letter or digit, got {show(value)}"
        )
    if value == DEFAULT_LOCATION:
        raise ConfigError(f"the location name {value!r} is state_dir/files, always there")
    return value


def _locations(value: object) -> dict[str, Path]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a mapping of location names to folders, got {show(value)}")
    result: dict[str, Path] = {}
    for name, raw in value.items():
        try:
            result[_location_name(name)] = config_path(raw)
        except ConfigError as exc:
            raise ConfigError(exc.reason, keys=(name,) if type(name) is str else ()) from None
    return result


def _optional_location(value: object) -> str | None:
    if value is None or value == DEFAULT_LOCATION:
        return None
    return _location_name(value)


def _convert(value: object) -> "ConvertConfig | None":
    if value is None:
        return None
    config: ConvertConfig = converter.structure(value, ConvertConfig)
    return config


_Listen = Annotated[str, Rule(listen_address)]
_Name = Annotated[str, Rule(nonempty_string)]
_BackendId = Annotated[str | None, Rule(_backend_id)]
_PathValue = Annotated[Path, Rule(config_path)]
_Dsn = Annotated[str | None, Rule(_dsn)]
_Addresses = Annotated[tuple[str, ...], Rule(_addresses)]
_CaFile = Annotated[Path | None, Rule(_broker_ca_file)]
_Token = Annotated[str | None, Rule(optional_token)]
_CallbackUrl = Annotated[str | None, Rule(_callback_url)]
_Positive = Annotated[float, Rule(positive_duration)]
_ConnectTimeout = Annotated[float, Rule(_connect_timeout)]
_Delay = Annotated[float, Rule(parse_duration)]
_Count = Annotated[int, Rule(integer(0))]
_AtLeastOne = Annotated[int, Rule(integer(1))]
_FrameBytes = Annotated[int, Rule(integer(1024))]
_UploadLimit = Annotated[int | None, Rule(optional_size)]
_OptionalName = Annotated[str | None, Rule(_optional_name)]
_ServiceName = Annotated[str, Rule(_service_name)]
_Params = Annotated[Mapping[str, ParamValue], Rule(_params)]
_Extensions = Annotated[tuple[str, ...], Rule(_extensions)]
_MimeType = Annotated[str | None, Rule(_mimetype)]
_JobLimit = Annotated[float | None, Rule(_job_limit)]
_LinkKey = Annotated[str | None, Rule(_link_key)]
_HostNames = Annotated[tuple[str, ...], Rule(check_host_names)]
_Origins = Annotated[tuple[str, ...], Rule(check_origins)]
_Parallel = Annotated[int | None, Rule(_parallel)]
_Locations = Annotated[Mapping[str, Path], Rule(_locations)]
_Location = Annotated[str | None, Rule(_optional_location)]
_Extension = Annotated[str, Rule(_extension)]


# -- the classes ---------------------------------------------------------------


@attrs.frozen(kw_only=True)
class MetadataConfig:
    """A class's metadata step: the service run on each original after upload."""

    service: _ServiceName
    params: _Params = attrs.field(factory=dict)
    timeout: _JobLimit = None
    stall_timeout: _JobLimit = None


@attrs.frozen(kw_only=True)
class VersionConfig:
    """One wanted version (rendition) of the files of a class.

    Attributes:
        service: the execserver service that produces it.
        params: the job's params (fill the service's argv template).
        source: ``None`` to produce it from the original, or the name of another
            version of the same class to produce it from.
        mimetype: the MIME type the rendition is labelled with, if configured.
        timeout, stall_timeout: the job's own limits in seconds (0 = none), or
            ``None`` for the execserver service's.
    """

    service: _ServiceName
    params: _Params = attrs.field(factory=dict)
    source: _OptionalName = None
    mimetype: _MimeType = None
    timeout: _JobLimit = None
    stall_timeout: _JobLimit = None


_Pattern = Annotated[str, Rule(_pattern)]
_OptionalPattern = Annotated[str | None, Rule(_optional_pattern)]
_AllowedParams = Annotated[Mapping[str, tuple[ParamValue, ...]], Rule(_allowed_params)]
_ClassNames = Annotated[tuple[str, ...], Rule(_class_names)]
_RENDITION_NAMES: Final = {"filename", "stem", "id"}
"""Placeholders every rendition pattern may use besides its params."""


@attrs.frozen(kw_only=True)
class PresetConfig:
    """A named on-demand rendition (``custom_version_presets``; module docstring)."""

    service: _ServiceName
    params: _Params = attrs.field(factory=dict)
    mimetype: _OptionalPattern = None
    filename: _Pattern = "{stem}.{preset}"
    classes: _ClassNames = ()
    timeout: _JobLimit = None
    stall_timeout: _JobLimit = None

    def __attrs_post_init__(self) -> None:
        known = {*_RENDITION_NAMES, "preset", *self.params}
        _check_pattern(self.mimetype, known, "mimetype")
        _check_pattern(self.filename, known, "filename")


@attrs.frozen(kw_only=True)
class CustomVersionConfig:
    """The explicit parameters a class allows one service (``custom_versions``)."""

    params: _AllowedParams
    mimetype: _OptionalPattern = None
    filename: _Pattern = "{stem}.{service}"
    timeout: _JobLimit = None
    stall_timeout: _JobLimit = None

    def __attrs_post_init__(self) -> None:
        known = {*_RENDITION_NAMES, "service", *self.params}
        _check_pattern(self.mimetype, known, "mimetype")
        _check_pattern(self.filename, known, "filename")


_Presets = Annotated[Mapping[str, PresetConfig], Rule(_presets)]
_CustomVersions = Annotated[Mapping[str, CustomVersionConfig], Rule(_custom_versions)]


@attrs.frozen(kw_only=True)
class ConvertConfig:
    """A produce-first class's conversion: what its uploads become before they are originals.

    Attributes:
        service: the execserver service that converts (body mode: the upload on
            its stdin, the original on its stdout).
        extension: the converted original's extension (its name and its class).
        params: the job's params.
        mimetype: the MIME type the converted original is labelled with.
        timeout, stall_timeout: the job's own limits, as a version's.
    """

    service: _ServiceName
    extension: _Extension
    params: _Params = attrs.field(factory=dict)
    mimetype: _MimeType = None
    timeout: _JobLimit = None
    stall_timeout: _JobLimit = None


_Versions = Annotated[Mapping[str, VersionConfig], Rule(_versions)]
_Metadata = Annotated[MetadataConfig | None, Rule(_metadata)]
_Convert = Annotated[ConvertConfig | None, Rule(_convert)]


@attrs.frozen(kw_only=True)
class FileClass:
    """A file class: the extensions it claims, its metadata step and its versions.

    Raises:
        ConfigError: a ``source`` that names no other version of this class, or a
            cycle of sources (key path relative to the class).
    """

    extensions: _Extensions = ()
    metadata: _Metadata = None
    versions: _Versions = attrs.field(factory=dict)
    custom_versions: _CustomVersions = attrs.field(factory=dict)
    convert: _Convert = None

    def __attrs_post_init__(self) -> None:
        if self.convert is not None and DELIVERED_VERSION in self.versions:
            raise ConfigError(
                f"the version name {DELIVERED_VERSION!r} keeps the upload of a class with"
                " convert: name this version otherwise",
                keys=("versions", DELIVERED_VERSION),
            )
        names = sorted(self.versions)
        for name, version in self.versions.items():
            if version.source is not None and (
                version.source == name or version.source not in self.versions
            ):
                others = ", ".join(n for n in names if n != name)
                hint = f"one of {others}" if others else "there is none"
                raise ConfigError(
                    f"expected the name of another version of this class ({hint}),"
                    f" got {show(version.source)}",
                    keys=("versions", name, "source"),
                )
        for name in self.versions:
            chain = [name]
            source = self.versions[name].source
            while source is not None:
                if source == name:
                    raise ConfigError(
                        f"sources form a cycle: {' -> '.join([*chain, name])}",
                        keys=("versions", name, "source"),
                    )
                if source in chain:  # a cycle that does not pass through `name`
                    break
                chain.append(source)
                source = self.versions[source].source

    def production_order(self) -> tuple[str, ...]:
        """Version names with every source before the versions made from it.

        Returns:
            The names, otherwise in configuration order.
        """
        order: list[str] = []
        placed: set[str] = set()

        def place(name: str) -> None:
            if name in placed:
                return
            source = self.versions[name].source
            if source is not None:
                place(source)
            placed.add(name)
            order.append(name)

        for name in self.versions:
            place(name)
        return tuple(order)


_Classes = Annotated[Mapping[str, FileClass], Rule(_classes)]


@attrs.frozen(kw_only=True)
class FylrConfig:
    """The reference fylr daemon's configuration; see the module docstring for keys.

    Construct it from outside data with :meth:`from_yaml` or :meth:`from_mapping`.
    """

    listen: _Listen = DEFAULT_FYLR_LISTEN
    name: _Name = attrs.field(factory=socket.gethostname)
    backend_id: _BackendId = None
    state_dir: _PathValue = Path("fylr-state")
    database: _Dsn = None
    database_pool: _AtLeastOne = 20
    execservers: _Addresses
    broker_token: _Token = attrs.field(default=None, metadata=secret_file())
    tokens: Tokens = attrs.field(factory=Tokens)
    insecure_open_api: bool = False
    allowed_hosts: _HostNames = ()
    allowed_origins: _Origins = ()
    link_key: _LinkKey = attrs.field(default=None, metadata=secret_file(), repr=hidden)
    link_ttl: _Positive = 3600.0
    broker_ca_file: _CaFile = None
    callback_own_url: _CallbackUrl = None
    connect_timeout: _ConnectTimeout = DEFAULT_CONNECT_TIMEOUT
    ping_interval: _Positive = 5.0
    ping_timeout: _Positive = 15.0
    max_frame_bytes: _FrameBytes = 1048576
    pool_grow_interval: _Positive = 2.0
    pool_max: _AtLeastOne = 16
    pool_reprobe_interval: _Positive = 60.0
    max_in_flight: _Count = 0
    local_workers: _Count = 0
    claim_interval: _Positive = 1.0
    retry_delay: _Delay = 60.0
    unknown_service_attempts: _AtLeastOne = 5  # ignored: the broker client decides
    counts_interval: _Delay = 60.0
    heartbeat_interval: _Positive = 10.0
    stale_after: _Positive = 45.0
    max_upload_size: _UploadLimit = None
    rput: RputConfig = attrs.field(factory=RputConfig)
    default_class: _OptionalName = None
    classes: _Classes = attrs.field(factory=dict)
    custom_version_presets: _Presets = attrs.field(factory=dict)
    parallel: _Parallel = None
    storage_locations: _Locations = attrs.field(factory=dict)
    storage_location: _Location = None
    modify: _Metadata = None

    def __attrs_post_init__(self) -> None:
        if self.ping_timeout <= self.ping_interval:
            raise ConfigError(
                f"expected a duration greater than ping_interval"
                f" ({self.ping_interval:g}s), got {self.ping_timeout:g}s",
                keys=("ping_timeout",),
            )
        if self.stale_after <= 2 * self.heartbeat_interval:
            raise ConfigError(
                f"expected a duration greater than twice heartbeat_interval"
                f" ({2 * self.heartbeat_interval:g}s), got {self.stale_after:g}s",
                keys=("stale_after",),
            )
        if self.default_class is not None and self.default_class not in self.classes:
            known = ", ".join(sorted(self.classes)) or "none configured"
            raise ConfigError(
                f"expected null or the name of a class ({known}), got {show(self.default_class)}",
                keys=("default_class",),
            )
        self._check_broker_tls()
        self._check_open_api()
        for name, preset in self.custom_version_presets.items():
            for index, class_name in enumerate(preset.classes):
                if class_name not in self.classes:
                    known = ", ".join(sorted(self.classes)) or "none configured"
                    raise ConfigError(
                        f"expected the name of a class ({known}), got {show(class_name)}",
                        keys=("custom_version_presets", name, "classes", index),
                    )
        owner: dict[str, str] = {}
        for class_name, file_class in self.classes.items():
            if not file_class.extensions and class_name != self.default_class:
                raise ConfigError(
                    "expected at least one extension (or make this class the default_class)",
                    keys=("classes", class_name, "extensions"),
                )
            for index, extension in enumerate(file_class.extensions):
                if extension in owner:
                    raise ConfigError(
                        f"extension {extension!r} already belongs to class {owner[extension]!r}",
                        keys=("classes", class_name, "extensions", index),
                    )
                owner[extension] = class_name
        self._check_conversions(owner)
        if self.storage_location is not None and self.storage_location not in (
            self.storage_locations
        ):
            known = ", ".join(sorted(self.storage_locations)) or "none configured"
            raise ConfigError(
                f"expected null, {DEFAULT_LOCATION!r} or a name of storage_locations ({known}),"
                f" got {show(self.storage_location)}",
                keys=("storage_location",),
            )

    def _check_conversions(self, owner: Mapping[str, str]) -> None:
        """A converted original's extension must lead to a class that does not convert."""
        for class_name, file_class in self.classes.items():
            if file_class.convert is None:
                continue
            extension = file_class.convert.extension
            target = owner.get(extension, self.default_class)
            if target is not None and self.classes[target].convert is not None:
                raise ConfigError(
                    f"files converted to {extension!r} belong to class {target!r}, which"
                    " converts again: name an extension of a class without convert",
                    keys=("classes", class_name, "convert", "extension"),
                )

    def _check_broker_tls(self) -> None:
        schemes = {split_broker_address(a)[0] for a in self.execservers}
        if len(schemes) > 1:
            raise ConfigError(
                "expected every address wss:// or none (one TLS setting serves them all)",
                keys=("execservers",),
            )
        if self.broker_ca_file is not None and not self.broker_tls:
            raise ConfigError(
                "expected null: a CA file needs wss:// execserver addresses",
                keys=("broker_ca_file",),
            )

    def _check_open_api(self) -> None:
        missing = self.tokens.missing
        if not missing or self.insecure_open_api or loopback_host(self.host):
            return
        names = ", ".join(role.value for role in missing)
        raise ConfigError(
            f"expected a token for {names}: listen ({self.listen}) is beyond loopback, where"
            " anyone who reaches it could use a role without a token (or set"
            " insecure_open_api: true)",
            keys=("tokens",),
        )

    @property
    def open_roles(self) -> tuple[str, ...]:
        """The token roles that have no token: their routes need none."""
        return tuple(role.value for role in self.tokens.missing)

    @property
    def broker_tls(self) -> bool:
        """Whether the execservers are dialled over TLS (``wss://`` addresses)."""
        return any(split_broker_address(a)[0] for a in self.execservers)

    @property
    def execserver_addresses(self) -> tuple[str, ...]:
        """The execserver addresses as ``host:port`` (the scheme left out)."""
        return tuple(split_broker_address(a)[1] for a in self.execservers)

    @classmethod
    def from_yaml(
        cls, path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
    ) -> "FylrConfig":
        """Load a YAML configuration file (see :func:`load_config`).

        Args:
            path: the file; UTF-8 YAML holding one mapping. Relative paths in it
                (``state_dir``, the ``*_file`` secrets) are relative to its folder.
            environ: ``TRIO_BROKER_…`` variables laid over the file (the daemon
                passes ``os.environ``); ``None`` reads the file alone.

        Returns:
            The validated configuration.

        Raises:
            ConfigError: the file is missing or unreadable (``file`` set), is not
                valid YAML (with line and column), is not a mapping, or any key is
                wrong (see :meth:`from_mapping`).
        """
        return load_config(path, cls, environ=environ)

    @classmethod
    def from_mapping(cls, data: object) -> "FylrConfig":
        """Validate a parsed configuration document.

        Args:
            data: the document, usually a ``dict`` from YAML or JSON.

        Returns:
            The configuration.

        Raises:
            ConfigError: the first problem, with its key path.
        """
        return structure_config(data, FylrConfig)

    @property
    def host(self) -> str:
        """The host part of ``listen`` (an IPv6 address without brackets)."""
        return parse_listen(self.listen)[0]

    @property
    def port(self) -> int:
        """The port part of ``listen``; 0 asks for a free port."""
        return parse_listen(self.listen)[1]

    @property
    def storage_dir(self) -> Path:
        """Where stored files live: ``state_dir/files``."""
        return self.state_dir / "files"

    @property
    def pg_dir(self) -> Path:
        """Where the embedded PostgreSQL cluster lives: ``state_dir/pg``."""
        return self.state_dir / "pg"

    @property
    def api_only(self) -> bool:
        """Whether this fylr processes no files (``parallel: 0``)."""
        return self.parallel == 0

    @property
    def locations(self) -> dict[str, Path]:
        """Every storage location by name: ``default`` and ``storage_locations``."""
        return {DEFAULT_LOCATION: self.storage_dir, **self.storage_locations}

    def resolved_local_workers(self, *, root: str | os.PathLike[str] = "/") -> int:
        """Concurrent local-bound actions: ``local_workers``, or the CPU count when 0.

        Args:
            root: where ``/proc`` and ``/sys`` are found (tests point it elsewhere).

        Returns:
            The count, at least 1.
        """
        return self.local_workers or cpu_count(root=root)
