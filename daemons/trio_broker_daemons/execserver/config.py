"""The reference execserver's configuration: YAML in, frozen values out.

:meth:`ExecserverConfig.from_yaml` reads a file (with the environment laid over
it: :func:`~trio_broker_daemons.config.structure.load_config`) and
:meth:`ExecserverConfig.from_mapping` validates a parsed document through the
daemons' one cattrs converter (strict primitives, unknown keys refused). Every
problem raises a :class:`~trio_broker_daemons.config.values.ConfigError`, one line
that starts with the dotted key path::

    services.ffmpeg.max_slots: expected an integer, got 'two'

Where values come from (the file, ``TRIO_BROKER_…`` variables, secret files) and
the value conventions (durations, sizes, integers, strings) are the daemons'
shared ones: :mod:`trio_broker_daemons.config`. ``null`` is accepted only where
the documented default is null (``broker_token``, ``tls``, ``temp_dir``,
``job_user``, and a service's ``timeout``, ``stall_timeout``, ``memory_limit``).

The placeholder ``{config_dir}`` in an argv element is the configuration file's
folder (``argv: [python3, "{config_dir}/convert_image.py"]``). No other argv
element is touched: a command runs in a fresh work folder of its own, so a
relative path in argv is relative to that folder, as the program itself sees
it. ``{{config_dir}}`` is the literal text. ``config_dir`` is therefore no job
parameter name.

Top-level keys (:class:`ExecserverConfig`):

``listen`` (``"127.0.0.1:7000"``)
    ``host:port`` of the one HTTP listener; ``[::1]:7000`` for IPv6; port 0 picks
    a free port. Parsed as :attr:`ExecserverConfig.host` / :attr:`~ExecserverConfig.port`.
``name`` (the host name)
    Announced in ``HELLO.name``; a non-empty string.
``broker_token`` (null), or ``broker_token_file``
    When set, ``/broker``, ``/inspect/system/execserver`` and ``/metrics``
    require ``Authorization: Bearer <token>``.
``tls`` (null)
    ``{cert: PATH, key: PATH}`` serves https/wss (:class:`TlsConfig`). Relative
    paths are relative to the configuration file; the files are not opened here
    (a missing one is a start-up failure of the daemon).
``slots`` (0)
    Size of the one slot pool shared by every service; 0 = the host's CPUs
    (:attr:`~trio_broker.trio.host.HostResources.cpus`, cgroup quota included).
``fast_reserve`` (-1)
    Slots heavy services never take: -1 = a quarter of the pool, at least 1; 0 =
    none; N = N. Never the whole pool (see :meth:`ExecserverConfig.resolved_fast_reserve`).
``heavy_threshold`` (10s, > 0)
    Rolling-mean runtime at or above which a service is heavy.
``unknown_share`` (0.5, 0 < x <= 1)
    Share of the pool that unmeasured services hold together.
``memory_budget`` (``"auto"``)
    Bytes or a size string; ``"auto"`` = the host's memory
    (:attr:`~trio_broker.trio.host.HostResources.memory`: RAM or the lower cgroup limit).
``offer_ttl`` (10s, > 0), ``ping_interval`` (5s, > 0)
    How long an offer holds its slot; how often a connection is pinged.
``ping_timeout`` (15s, > ``ping_interval``)
    A connection silent this long is dead.
``drain_timeout`` (60s, >= 0)
    On SIGTERM, how long running jobs may finish; ``"0"`` stops them at once.
``priority_aging`` (null)
    A parked want rises one priority band (2) per this much waiting, up to the
    top band (4, or 5 for the high variants); null or ``"0"`` = strict priority.
``turn_hold`` (0.05s, >= 0)
    How long a slot freed by a connection owed the next turn waits for that
    connection's next ``WANT`` (the *turn hold* of PROTOCOL.md section 10);
    ``"0"`` offers every freed slot at once. A client that does not come back
    leaves the slot idle this long: raise it for distant clients only.
``stall_timeout`` (10m)
    A job without progress this long is stalled; ``"0"`` = no stall supervision.
``temp_dir`` (null)
    Parent of the jobs' working directories; null = the system temp dir. A
    relative path is relative to the configuration file. Several execservers
    may share it: each locks the folders of its running jobs, and at start
    removes the folders no live execserver holds.
``job_user`` (null)
    The user commands run as: a name, a number, or ``UID:GID`` for a user
    without a name; null = the daemon's own user when it is not root, else
    ``nobody``. Checked when the daemon starts
    (:func:`~trio_broker_daemons.execserver.app.job_user_from`).
``cgroup`` (``"auto"``)
    ``auto``: when the daemon is given a cgroup v2 it may write (systemd's
    ``Delegate=yes``, a container's own cgroup), each job runs in a cgroup of
    its own; ``off`` (or ``false``): never (jobs are found by their process tree).
``max_frame_bytes`` (1048576, >= 1024)
    Largest websocket frame accepted.
``max_wants_per_connection`` (10000, >= 1)
    Wants one broker connection may have parked or offered at once; one more
    ``WANT`` is refused with ``ERROR too_many_wants`` (PROTOCOL.md, *Limits*).
``env`` ({})
    Added to every command's environment (string names and values).
``services`` (required, at least one)
    Service name (1..200 characters) → :class:`ServiceConfig`.

Service keys (:class:`ServiceConfig`):

``argv`` / ``builtin`` (exactly one)
    ``argv`` is a non-empty list of strings; each element may hold ``{name}``
    placeholders filled from ``job.params`` and ``{config_dir}`` (the
    configuration file's folder, filled at load) (``{{`` and ``}}`` are literal braces;
    a placeholder is a bare identifier, no index, attribute, conversion or format
    spec; no element holds a NUL). The program, ``argv[0]``, is a non-empty string
    without placeholders so that a job can never choose what runs. The grammar is
    :mod:`trio_broker.core.argv`'s, so the runner fills whatever loads; the value
    is stored parsed, as an :class:`~trio_broker.core.argv.ArgvTemplate` (which
    reads as the tuple of elements written). ``builtin`` is ``noop`` (ends at once)
    or ``sleep`` (holds its slot ``params.seconds``).
``allow_leading_dash`` ([])
    Parameters of ``argv`` whose values may begin with ``-`` where an option can
    start. Without it, a value beginning with ``-`` is refused (the job ends
    ``error`` naming the parameter) where a placeholder stands alone, starts its
    element or is glued to a leading dash (``"{file}"``, ``"-{level}"``): there it
    would become an option of the program (*Guarded options* in
    :mod:`trio_broker.core.argv`). Each name must be a placeholder of ``argv``.
``max_slots`` (0)
    Cap on the service's concurrent jobs; 0 = no cap beyond the pool.
``threads`` (0)
    ``FYLR_CONVERT_THREADS``: 0 all CPUs, ``N``, ``-N`` all but N, ``"N%"``,
    ``"-N%"`` (N from 1 to 100); see :func:`resolve_threads`.
``timeout`` (none)
    Wall-clock limit; ``"0"`` = none.
``timeout_sec`` (legacy)
    Integer seconds, 0 = none; used only when ``timeout`` is absent or null.
``stall_timeout`` (null = the top-level one)
    ``"0"`` = no stall supervision for this service. :meth:`ExecserverConfig.from_mapping`
    stores the effective value.
``memory_limit`` (null)
    This service's own per-job ceiling on process-group RSS, in bytes or a size
    string, on top of the shared budget. An addition of ours beyond DESIGN.md.
``env`` ({})
    Added to this service's commands' environment, after the top-level ``env``.
``cache`` (null)
    ``{key: [PARAM, ...], max_size: SIZE}`` keeps the service's output in a
    produce cache (:mod:`trio_broker.trio.produce_cache`), in
    ``<temp_dir>/produce-cache/<service>``: a job whose object carries an
    ``input_hash`` is keyed by the service, those params (placeholders of
    ``argv``) and that hash; ``max_size`` (> 0) bounds the cache, least recently
    used entries go first. Not for a builtin.
"""

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeAlias

import attrs

from trio_broker.core.argv import ArgvTemplate, TemplateError
from trio_broker.trio.host import HostResources
from trio_broker_daemons.config.rules import (
    MAX_SERVICE_NAME_CHARS,
    Rule,
    config_folder,
    config_path,
    integer,
    listen_address,
    nonempty_string,
    not_a_string,
    number,
    optional_size,
    optional_token,
    parse_listen,
    positive_duration,
)
from trio_broker_daemons.config.sources import secret_file
from trio_broker_daemons.config.structure import (
    class_hook_factory,
    converter,
    load_config,
    locate,
    structure_config,
)
from trio_broker_daemons.config.values import (
    SIZE_HINT,
    ConfigError,
    ThreadsSpec,
    check_threads,
    parse_duration,
    parse_size,
    show,
)

__all__ = [
    "CONFIG_DIR",
    "DEFAULT_LISTEN",
    "Builtin",
    "CacheConfig",
    "ExecserverConfig",
    "ServiceConfig",
    "TlsConfig",
]

DEFAULT_LISTEN: Final = "127.0.0.1:7000"

Builtin: TypeAlias = Literal["noop", "sleep"]
"""The in-process services."""

CONFIG_DIR: Final = "{config_dir}"
"""In an argv element: the folder of the configuration file (see the module docstring)."""

# -- argv templates ----------------------------------------------------------------------

_CONFIG_DIR_TOKENS: Final = re.compile(r"\{\{|\}\}|\{config_dir\}")


def _expand_config_dir(element: str) -> str:
    """``element`` with ``{config_dir}`` replaced by the configuration file's folder.

    Escaped braces (``{{config_dir}}``) stay literal; braces in the folder's name
    are escaped, so that the core's template grammar reads them as text.
    """
    if CONFIG_DIR not in element:
        return element
    folder = str(config_folder() or Path.cwd()).replace("{", "{{").replace("}", "}}")
    return _CONFIG_DIR_TOKENS.sub(
        lambda match: folder if match.group() == CONFIG_DIR else match.group(), element
    )


def _check_argv(value: object) -> ArgvTemplate | None:
    """Validate an argv template list and parse it (the grammar is the core's)."""
    if value is None or isinstance(value, ArgvTemplate):
        return value
    if not isinstance(value, list | tuple):
        raise ConfigError(f"expected a list of strings, got {show(value)}")
    if not value:
        raise ConfigError("expected a non-empty list of strings, got an empty list")
    for index, element in enumerate(value):
        if type(element) is not str:
            raise ConfigError(not_a_string(element).reason, keys=(index,))
    try:
        return ArgvTemplate.parse(tuple(_expand_config_dir(element) for element in value))
    except TemplateError as exc:
        raise ConfigError(exc.reason, keys=() if exc.index is None else (exc.index,)) from None


def _argv_field(value: object) -> ArgvTemplate | None:
    """``ServiceConfig.argv`` built by hand: checked and parsed like a loaded one."""
    try:
        return _check_argv(value)
    except ConfigError as exc:
        raise ConfigError(exc.reason, keys=("argv", *exc.keys)) from None


def _parameter_names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"expected a list of parameter names, got {show(value)}")
    for index, element in enumerate(value):
        if type(element) is not str:
            raise ConfigError(not_a_string(element).reason, keys=(index,))
    return tuple(value)


def _seconds(value: float) -> str:
    """A duration for error messages: ``5s``, ``0.25s``."""
    return f"{value:g}s"


# -- field rules ---------------------------------------------------------------


def _optional_path(value: object) -> Path | None:
    return None if value is None else config_path(value)


def _optional_seconds(value: object) -> int | None:
    return None if value is None else integer(0)(value)


def _share(value: object) -> float:
    share = number(value)
    if not 0 < share <= 1:
        raise ConfigError(f"expected a number greater than 0 and at most 1, got {show(value)}")
    return share


def _duration_or_none(value: object) -> float | None:
    """A duration where zero means none."""
    return parse_duration(value) or None


def _nullable_duration_or_none(value: object) -> float | None:
    """A duration where zero and null mean none (null: the key's default is none)."""
    return None if value is None else _duration_or_none(value)


def _memory_budget(value: object) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    try:
        return parse_size(value)
    except ConfigError as exc:
        if exc.reason.startswith("expected a size ("):
            raise ConfigError(
                f'expected "auto" or a size ({SIZE_HINT}), got {show(value)}'
            ) from None
        raise


def _cgroup(value: object) -> Literal["auto", "off"]:
    if value == "auto":
        return "auto"
    if value == "off" or value is False:  # YAML reads an unquoted off as false
        return "off"
    raise ConfigError(f"expected one of auto, off, got {show(value)}")


def _job_user(value: object) -> str | None:
    if value is None:
        return None
    if type(value) is int and value >= 0:  # a uid written as a YAML number
        return str(value)
    name = nonempty_string(value)
    if any(character.isspace() or character == "\x00" for character in name):
        raise ConfigError(f"expected a user name or number, got {show(value)}")
    return name


def _builtin(value: object) -> Builtin | None:
    if value is None:
        return None
    if value == "noop":
        return "noop"
    if value == "sleep":
        return "sleep"
    raise ConfigError(f"expected one of noop, sleep, got {show(value)}")


_ENV_NAME: Final = re.compile(r"[^=\x00]+")


def _env(value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a mapping of strings, got {show(value)}")
    result: dict[str, str] = {}
    for name, text in value.items():
        if type(name) is not str or not _ENV_NAME.fullmatch(name):
            raise ConfigError(
                f"expected a variable name (a non-empty string without '='), got {show(name)}"
            )
        if type(text) is not str:
            raise ConfigError(not_a_string(text).reason, keys=(name,))
        if "\x00" in text:
            raise ConfigError("expected a string without NUL characters", keys=(name,))
        result[name] = text
    return result


def _services(value: object) -> dict[str, "ServiceConfig"]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a mapping of service names to services, got {show(value)}")
    result: dict[str, ServiceConfig] = {}
    for name, raw in value.items():
        if type(name) is not str or not 1 <= len(name) <= MAX_SERVICE_NAME_CHARS:
            raise ConfigError(
                f"expected service names of 1 to {MAX_SERVICE_NAME_CHARS} characters,"
                f" got {show(name)}"
            )
        try:
            result[name] = _structure_service(raw, ServiceConfig)
        except Exception as exc:
            inner = locate(exc)
            raise ConfigError(inner.reason, keys=(name, *inner.keys)) from None
    return result


_Name = Annotated[str, Rule(nonempty_string)]
_Token = Annotated[str | None, Rule(optional_token)]
_Listen = Annotated[str, Rule(listen_address)]
_PathValue = Annotated[Path, Rule(config_path)]
_OptionalPath = Annotated[Path | None, Rule(_optional_path)]
_Count = Annotated[int, Rule(integer(0))]
_Reserve = Annotated[int, Rule(integer(-1))]
_FrameBytes = Annotated[int, Rule(integer(1024))]
_AtLeastOne = Annotated[int, Rule(integer(1))]
_LegacySeconds = Annotated[int | None, Rule(_optional_seconds)]
_Share = Annotated[float, Rule(_share)]
_Positive = Annotated[float, Rule(positive_duration)]
_Drain = Annotated[float, Rule(parse_duration)]
_Stall = Annotated[float | None, Rule(_duration_or_none)]
_Timeout = Annotated[float | None, Rule(_nullable_duration_or_none)]
_Budget = Annotated[int | Literal["auto"], Rule(_memory_budget)]
_Limit = Annotated[int | None, Rule(optional_size)]
_Argv = Annotated[ArgvTemplate | None, Rule(_check_argv)]
_ParameterNames = Annotated[tuple[str, ...], Rule(_parameter_names)]
_BuiltinValue = Annotated[Builtin | None, Rule(_builtin)]
_Threads = Annotated[ThreadsSpec, Rule(check_threads)]
_Env = Annotated[Mapping[str, str], Rule(_env)]
_JobUser = Annotated[str | None, Rule(_job_user)]
_Cgroup = Annotated[Literal["auto", "off"], Rule(_cgroup)]


# -- the classes ---------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TlsConfig:
    """The certificate chain and private key for https/wss (PEM files)."""

    cert: _PathValue
    key: _PathValue


@attrs.frozen(kw_only=True)
class CacheConfig:
    """A service's produce cache: the params of its key and its size bound."""

    key: _ParameterNames = ()
    max_size: Annotated[int, Rule(parse_size)]


@attrs.frozen(kw_only=True)
class ServiceConfig:
    """One service: a command template or a builtin, with its limits.

    Built by :meth:`ExecserverConfig.from_mapping`, ``timeout`` and
    ``stall_timeout`` hold the effective values (legacy ``timeout_sec`` and the
    top-level ``stall_timeout`` folded in). Built by hand, they are taken as given.
    """

    argv: _Argv = attrs.field(default=None, converter=_argv_field)
    builtin: _BuiltinValue = None
    allow_leading_dash: _ParameterNames = ()
    max_slots: _Count = 0
    threads: _Threads = 0
    timeout: _Timeout = None
    timeout_sec: _LegacySeconds = None
    stall_timeout: _Timeout = 600.0
    memory_limit: _Limit = None
    env: _Env = attrs.field(factory=dict)
    cache: CacheConfig | None = None

    def __attrs_post_init__(self) -> None:
        if (self.argv is None) == (self.builtin is None):
            got = "neither" if self.argv is None else "both"
            raise ConfigError(f"expected exactly one of argv and builtin, got {got}")
        if self.argv is None:
            if self.allow_leading_dash:
                raise ConfigError(
                    "expected no parameters: a builtin has no argv", keys=("allow_leading_dash",)
                )
            if self.cache is not None:
                raise ConfigError("expected null: a builtin has no output", keys=("cache",))
            return
        for index, name in enumerate(self.cache.key if self.cache is not None else ()):
            if name not in self.argv.placeholders:
                known = ", ".join(sorted(self.argv.placeholders)) or "none"
                raise ConfigError(
                    f"expected a placeholder of argv ({known}), got {show(name)}",
                    keys=("cache", "key", index),
                )
        for index, name in enumerate(self.allow_leading_dash):
            if name not in self.argv.placeholders:
                known = ", ".join(sorted(self.argv.placeholders)) or "none"
                raise ConfigError(
                    f"expected a placeholder of argv ({known}), got {show(name)}",
                    keys=("allow_leading_dash", index),
                )
        # the template carries the allowance to the runner (CommandSpec takes it as it is)
        template = ArgvTemplate.parse(self.argv, allow_leading_dash=self.allow_leading_dash)
        object.__setattr__(self, "argv", template)

    @property
    def placeholders(self) -> frozenset[str]:
        """The ``{name}`` placeholders of ``argv``: the job params it needs."""
        return frozenset() if self.argv is None else self.argv.placeholders


_Services = Annotated[Mapping[str, ServiceConfig], Rule(_services)]


@attrs.frozen(kw_only=True)
class ExecserverConfig:
    """The reference execserver's configuration; see the module docstring for keys.

    Construct it from outside data with :meth:`from_yaml` or :meth:`from_mapping`.
    """

    listen: _Listen = DEFAULT_LISTEN
    name: _Name = attrs.field(factory=socket.gethostname)
    broker_token: _Token = attrs.field(default=None, metadata=secret_file())
    tls: TlsConfig | None = None
    slots: _Count = 0
    fast_reserve: _Reserve = -1
    heavy_threshold: _Positive = 10.0
    unknown_share: _Share = 0.5
    memory_budget: _Budget = "auto"
    offer_ttl: _Positive = 10.0
    ping_interval: _Positive = 5.0
    ping_timeout: _Positive = 15.0
    drain_timeout: _Drain = 60.0
    turn_hold: _Drain = 0.05
    priority_aging: _Timeout = None
    stall_timeout: _Stall = 600.0
    temp_dir: _OptionalPath = None
    job_user: _JobUser = None
    cgroup: _Cgroup = "auto"
    max_frame_bytes: _FrameBytes = 1048576
    max_wants_per_connection: _AtLeastOne = 10_000
    env: _Env = attrs.field(factory=dict)
    services: _Services

    def __attrs_post_init__(self) -> None:
        if self.ping_timeout <= self.ping_interval:
            raise ConfigError(
                f"expected a duration greater than ping_interval"
                f" ({_seconds(self.ping_interval)}), got {_seconds(self.ping_timeout)}",
                keys=("ping_timeout",),
            )
        if not self.services:
            raise ConfigError(
                "expected at least one service, got an empty mapping", keys=("services",)
            )

    @classmethod
    def from_yaml(
        cls, path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
    ) -> "ExecserverConfig":
        """Load a YAML configuration file (see :func:`load_config`).

        Args:
            path: the file; UTF-8 YAML holding one mapping. Relative paths in it
                are relative to its folder.
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
    def from_mapping(cls, data: object) -> "ExecserverConfig":
        """Validate a parsed configuration document.

        Args:
            data: the document, usually a ``dict`` from YAML or JSON.

        Returns:
            The configuration, with each service's ``timeout`` and ``stall_timeout``
            resolved (legacy ``timeout_sec``, the top-level ``stall_timeout``).

        Raises:
            ConfigError: the first problem, with its key path.
        """
        return structure_config(data, ExecserverConfig)

    @property
    def host(self) -> str:
        """The host part of ``listen`` (an IPv6 address without brackets)."""
        return parse_listen(self.listen)[0]

    @property
    def port(self) -> int:
        """The port part of ``listen``; 0 asks for a free port."""
        return parse_listen(self.listen)[1]

    def pool_size(self, host: HostResources) -> int:
        """The number of slots: ``slots``, or the host's CPUs when it is 0.

        Args:
            host: the host's resources, read once (:func:`~trio_broker.trio.host.probe_host`).

        Returns:
            The pool size, at least 1.
        """
        return self.slots or host.cpus

    def resolved_fast_reserve(self, host: HostResources) -> int:
        """The slots heavy services never take.

        ``-1`` is a quarter of the pool (rounded down), at least 1; ``0`` is none;
        ``N`` is N. Whatever the rule gives is capped at ``pool_size() - 1``, so a
        heavy service can always run: a pool of 1 has no reserve.

        Args:
            host: passed to :meth:`pool_size`.

        Returns:
            The reserve, from 0 to ``pool_size(host) - 1``.
        """
        pool = self.pool_size(host)
        wanted = max(1, pool // 4) if self.fast_reserve == -1 else self.fast_reserve
        return min(wanted, pool - 1)

    def resolved_memory_budget(self, host: HostResources) -> int:
        """The memory budget in bytes: ``memory_budget``, or the host's memory when ``auto``.

        Args:
            host: the host's resources; its ``memory`` is host RAM or the lower
                cgroup limit.

        Returns:
            The budget in bytes.
        """
        if isinstance(self.memory_budget, int):
            return self.memory_budget
        return host.memory


# -- the converter's hooks for these classes ----------------------------------------


def _structure_execserver(value: Any, cls: Any) -> ExecserverConfig:
    """Structure the top level, then fold in each service's inherited values."""
    config: ExecserverConfig = _structure_top(value, cls)
    raw_services: Mapping[str, Mapping[str, Any]] = value["services"]
    services: dict[str, ServiceConfig] = {}
    for name, service in config.services.items():
        raw = raw_services[name]
        if raw.get("stall_timeout") is None:
            service = attrs.evolve(service, stall_timeout=config.stall_timeout)
        if raw.get("timeout") is None and service.timeout_sec is not None:
            service = attrs.evolve(service, timeout=float(service.timeout_sec) or None)
        services[name] = service
    return attrs.evolve(config, services=services)


_structure_top: Final = class_hook_factory(ExecserverConfig, converter)
_structure_service: Final = converter.get_structure_hook(ServiceConfig)
converter.register_structure_hook(ExecserverConfig, _structure_execserver)
