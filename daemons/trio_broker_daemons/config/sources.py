"""Where a configuration document comes from: a YAML file, the environment, secret files.

Both daemons build their configuration the same way
(:func:`trio_broker_daemons.config.structure.load_config` ties the steps together):

1. :func:`load_yaml_mapping` reads the file: UTF-8 YAML holding one mapping,
   PyYAML's safe loader, duplicate keys refused.
2. :func:`apply_environment` lays the environment over it. Every key can be set
   by a variable ``TRIO_BROKER_<KEY>``; nested keys are joined with ``__``
   (``TRIO_BROKER_TLS__CERT``, ``TRIO_BROKER_SERVICES__VIDEO__MAX_SLOTS``).
   Names match keys case-insensitively (a mapping key such as a service name
   matches the key the file already has; a new one is taken as written). A
   variable wins over the file. A key that holds text (names, tokens,
   addresses, paths) takes the variable's text as it is; any other value is
   read as YAML (``4``, ``2.5``, ``true``, ``null``, ``[a, b]``, ``{a: 1}``).
   A variable whose first key is no key of this configuration is ignored: the
   two daemons and the upload command share the prefix (``TRIO_BROKER_SERVER``
   is the upload command's). A wrong key below a known one is an error.
3. :func:`read_secret_files` replaces ``<key>_file: PATH`` by ``<key>``: the
   file's text without its final line ending, for the keys a configuration
   class marks with :func:`secret_file` (``broker_token``). Giving both is an
   error; a variable setting one of the pair removes the other from the file's
   document, so ``TRIO_BROKER_BROKER_TOKEN`` overrides a ``broker_token_file``.
4. Relative paths (``temp_dir``, ``tls.cert``, a ``<key>_file``) are resolved
   against the folder of the configuration file, and ``{config_dir}`` in an
   argv element becomes that folder; the rules that do it live with the
   values (:func:`trio_broker_daemons.config.structure.structure_config`).

Every problem is a :class:`~trio_broker_daemons.config.values.ConfigError` naming the key path;
a problem with a value that came from a variable also names the variable.
"""

import collections.abc
import copy
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, TypeAlias, Union, get_args, get_origin

import attrs
import yaml

from trio_broker_daemons.config.values import ConfigError, Key, show

__all__ = [
    "ENV_PREFIX",
    "SECRET_FILE",
    "EnvironmentSources",
    "apply_environment",
    "blame_environment",
    "keys_of",
    "load_yaml_mapping",
    "read_secret_files",
    "secret_file",
]

ENV_PREFIX: Final = "TRIO_BROKER_"
"""The prefix of the variables that override configuration keys."""
SECRET_FILE: Final = "trio_broker_secret_file"
"""The attrs field metadata key of a key that may also be read from ``<key>_file``."""

EnvironmentSources: TypeAlias = dict[tuple[Key, ...], str]
"""Key path → the variable that set it (what :func:`apply_environment` returns)."""


def secret_file() -> dict[str, bool]:
    """The ``metadata=`` of an attrs field that may also be given as ``<name>_file``."""
    return {SECRET_FILE: True}


# -- YAML -------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate mapping keys (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {show(key)}", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = " ".join(f"{exc.context or ''} {exc.problem or ''}".split())
        return f"invalid YAML at {where}{problem}"
    return f"invalid YAML: {' '.join(str(exc).split())}"


def load_yaml_mapping(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """Read a YAML file holding one mapping (both daemons' configuration files).

    Args:
        path: the file.

    Returns:
        The parsed mapping.

    Raises:
        ConfigError: the file is missing or unreadable (``file`` set), is not valid
            YAML (with line and column), or does not hold a mapping.
    """
    file = os.fspath(path)
    try:
        with open(file, encoding="utf-8") as stream:
            text = stream.read()
    except FileNotFoundError:
        raise ConfigError("no such file", file=file) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read: not UTF-8 text ({exc.reason})", file=file) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", file=file) from None
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_problem(exc), file=file) from None
    if data is None:
        raise ConfigError("expected a mapping at the top level, got an empty file", file=file)
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping at the top level, got {show(data)}", file=file)
    return data


# -- the types behind a key path ------------------------------------------------------


def _strip(tp: Any) -> Any:
    """``tp`` without ``Annotated`` and without ``| None``."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
            continue
        if get_origin(tp) in (Union, types.UnionType):
            rest = [arg for arg in get_args(tp) if arg is not type(None)]
            if len(rest) == 1:
                tp = rest[0]
                continue
        return tp


def _secret_names(cls: type[Any]) -> frozenset[str]:
    return frozenset(f.name for f in attrs.fields(cls) if f.metadata.get(SECRET_FILE))


def keys_of(cls: type[Any]) -> dict[str, Any]:
    """The keys of an attrs class: its fields and their ``<secret>_file`` partners."""
    hints = typing.get_type_hints(cls, include_extras=True)
    keys = {f.name: hints.get(f.name, Any) for f in attrs.fields(cls)}
    for name in _secret_names(cls):
        keys[f"{name}_file"] = str
    return keys


def _mapping_value(tp: Any) -> Any | None:
    """The value type of a ``Mapping[str, X]`` (or ``dict``), else ``None``."""
    if get_origin(tp) in (collections.abc.Mapping, dict) and len(get_args(tp)) == 2:
        return get_args(tp)[1]
    return None


def _is_text(tp: Any) -> bool:
    return _strip(tp) in (str, Path)


def _partner(cls: type[Any], key: str) -> str | None:
    """The other key of a secret pair (``broker_token`` ↔ ``broker_token_file``)."""
    secrets = _secret_names(cls)
    if key in secrets:
        return f"{key}_file"
    if key.endswith("_file") and key[: -len("_file")] in secrets:
        return key[: -len("_file")]
    return None


# -- the environment ------------------------------------------------------------------


def _resolve_path(
    document: Mapping[str, Any], cls: type[Any], segments: Sequence[str], variable: str
) -> tuple[tuple[str, ...], Any, type[Any] | None] | None:
    """The key path a variable names, the type it sets, and the attrs class holding it.

    ``None`` when the first segment is no key of ``cls`` (the variable is not ours).
    """
    keys: list[str] = []
    tp: Any = cls
    node: Any = document
    owner: type[Any] | None = None
    for depth, segment in enumerate(segments):
        if not segment:
            raise ConfigError(f"{variable}: empty key between '__' separators")
        inner = _strip(tp)
        if attrs.has(inner):
            known = keys_of(inner)
            name = next((k for k in known if k.lower() == segment.lower()), None)
            if name is None:
                if depth == 0:
                    return None
                name = segment.lower()  # structuring reports it as an unknown key
            owner, tp = inner, known.get(name, Any)
        else:
            existing = node.keys() if isinstance(node, Mapping) else ()
            name = next((str(k) for k in existing if str(k).lower() == segment.lower()), None)
            name = name if name is not None else segment
            owner, tp = None, _mapping_value(inner) or Any
        keys.append(name)
        node = node.get(name) if isinstance(node, Mapping) else None
    return tuple(keys), tp, owner


def _env_value(text: str, tp: Any, keys: Sequence[str], variable: str) -> Any:
    if _is_text(tp):
        return text
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{_yaml_problem(exc)} (from {variable})", keys=keys) from None


def _set(document: dict[str, Any], keys: Sequence[str], value: Any, variable: str) -> None:
    node = document
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigError(
                f"expected a mapping to set {variable} in, got {show(child)}",
                keys=keys[: depth + 1],
            )
        node = child
    node[keys[-1]] = value


def apply_environment(
    document: Mapping[str, Any],
    cls: type[Any],
    environ: Mapping[str, str],
    *,
    prefix: str = ENV_PREFIX,
) -> tuple[dict[str, Any], EnvironmentSources]:
    """Lay ``TRIO_BROKER_…`` variables over a parsed document (see the module docstring).

    Args:
        document: the file's mapping (not changed; a copy is returned).
        cls: the attrs class the document is for (its keys and their types).
        environ: the environment, usually ``os.environ``.
        prefix: the variables' prefix.

    Returns:
        The new document, and which key path each variable set.

    Raises:
        ConfigError: an empty key (``A____B``), a value that is not YAML where YAML
            is read, or a key below a value that is not a mapping.
    """
    result: dict[str, Any] = copy.deepcopy(dict(document))
    sources: EnvironmentSources = {}
    found = sorted(
        (name[len(prefix) :].split("__"), name)
        for name in environ
        if name.startswith(prefix) and len(name) > len(prefix)
    )
    found.sort(key=lambda item: len(item[0]))  # a whole mapping before its keys
    for segments, variable in found:
        resolved = _resolve_path(result, cls, segments, variable)
        if resolved is None:
            continue
        keys, tp, owner = resolved
        value = _env_value(environ[variable], tp, keys, variable)
        _set(result, keys, value, variable)
        sources[keys] = variable
        partner = _partner(owner, keys[-1]) if owner is not None else None
        if partner is not None:
            parent: Any = result
            for key in keys[:-1]:
                parent = parent[key]
            parent.pop(partner, None)
    return result, sources


def blame_environment(exc: ConfigError, sources: EnvironmentSources) -> ConfigError:
    """``exc`` naming the variable that set the offending value, if one did.

    Args:
        exc: a problem found in a document :func:`apply_environment` returned.
        sources: what :func:`apply_environment` returned with it.

    Returns:
        ``exc`` itself, or a copy whose reason ends ``(from TRIO_BROKER_…)``.
    """
    for keys, variable in sources.items():
        if exc.keys[: len(keys)] == keys and variable not in exc.reason:
            return ConfigError(f"{exc.reason} (from {variable})", keys=exc.keys, file=exc.file)
    return exc


# -- secret files ---------------------------------------------------------------------


def _read_secret(where: object, folder: Path | None, keys: tuple[Key, ...]) -> str:
    if type(where) is not str or not where:
        raise ConfigError(f"expected the path of a file, got {show(where)}", keys=keys)
    path = Path(where)
    if folder is not None and not path.is_absolute():
        path = folder / path
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        reason = f"cannot read {str(path)!r}: not UTF-8 ({exc.reason})"
        raise ConfigError(reason, keys=keys) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc.strerror or exc}", keys=keys) from None
    secret = text.removesuffix("\n").removesuffix("\r")
    if not secret:
        raise ConfigError(f"expected a non-empty secret, {str(path)!r} is empty", keys=keys)
    return secret


def _secrets_of(
    node: Mapping[Any, Any], cls: type[Any], folder: Path | None, keys: tuple[Key, ...]
) -> dict[Any, Any]:
    result = dict(node)
    for name in sorted(_secret_names(cls)):
        file_key = f"{name}_file"
        if file_key not in result:
            continue
        where = result.pop(file_key)
        if where is None:
            continue
        if result.get(name) is not None:
            raise ConfigError(
                f"expected either {name} or {file_key}, got both", keys=(*keys, file_key)
            )
        result[name] = _read_secret(where, folder, (*keys, file_key))
    for name, tp in keys_of(cls).items():
        value = result.get(name)
        if not isinstance(value, Mapping):
            continue
        inner = _strip(tp)
        if attrs.has(inner):
            result[name] = _secrets_of(value, inner, folder, (*keys, name))
            continue
        item = _strip(_mapping_value(inner))
        if item is not None and attrs.has(item):
            result[name] = {
                key: _secrets_of(sub, item, folder, (*keys, name, key))
                if isinstance(sub, Mapping)
                else sub
                for key, sub in value.items()
            }
    return result


def read_secret_files(
    document: Mapping[str, Any], cls: type[Any], folder: Path | None
) -> dict[str, Any]:
    """Replace every ``<key>_file`` of a secret key by the file's text.

    A key is secret when its attrs field has :func:`secret_file` metadata, at any
    depth (nested classes and mappings of classes included). ``<key>_file: null``
    means no file.

    Args:
        document: the parsed document (not changed).
        cls: the attrs class it is for.
        folder: what relative file paths are relative to (the configuration
            file's folder); ``None`` for the working directory.

    Returns:
        The new document.

    Raises:
        ConfigError: both keys of a pair given, a path that is no string, a file
            that cannot be read, is not UTF-8, or is empty.
    """
    return _secrets_of(document, cls, folder, ())
