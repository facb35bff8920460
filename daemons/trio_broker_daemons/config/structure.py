"""The configuration converter: a parsed document in, frozen values out.

One cattrs converter (:data:`converter`) structures both daemons'
configuration classes: strict primitives (a YAML integer where an integer is
expected, a string where a string is), unknown keys refused, and each field
that carries a :class:`~trio_broker_daemons.config.rules.Rule` checked by it.
:func:`locate` turns whatever cattrs raised into the one
:class:`~trio_broker_daemons.config.values.ConfigError` reported: the first
problem with its full key path, an unknown key before any other problem of the
same mapping, with the closest known key as a hint (``did you mean 'slots'?``).

:func:`structure_config` validates a document; :func:`load_config` reads a file,
lays the environment and the secret files over it
(:mod:`~trio_broker_daemons.config.sources`) and structures the result relative
to the file's folder.
"""

import difflib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Final, TypeVar, get_origin

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn

from trio_broker_daemons.config.rules import Rule, number, reading_from, string
from trio_broker_daemons.config.sources import (
    EnvironmentSources,
    apply_environment,
    blame_environment,
    load_yaml_mapping,
    read_secret_files,
)
from trio_broker_daemons.config.values import ConfigError, Key, show

__all__ = ["class_hook_factory", "converter", "load_config", "locate", "structure_config"]

# -- the converter ---------------------------------------------------------------


def _rule_of(tp: Any) -> Rule | None:
    if get_origin(tp) is Annotated:
        for meta in tp.__metadata__:
            if isinstance(meta, Rule):
                return meta
    return None


def _rule_hook_factory(tp: Any) -> Callable[[Any, Any], Any]:
    rule = _rule_of(tp)
    assert rule is not None
    check = rule.check

    def structure(value: Any, _: Any) -> Any:
        return check(value)

    return structure


def class_hook_factory(cls: type[Any], conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
    """Structure an attrs class from a mapping, refusing any other value."""
    structure_fields = make_dict_structure_fn(cls, conv)

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a mapping, got {show(value)}")
        return structure_fields(value, cls)

    return structure


def _primitive(kind: type[Any], expected: str) -> Callable[[Any, Any], Any]:
    def structure(value: Any, _: Any) -> Any:
        if type(value) is not kind:
            raise ConfigError(f"expected {expected}, got {show(value)}")
        return value

    return structure


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(str, lambda value, _: string(value))
    conv.register_structure_hook(int, _primitive(int, "an integer"))
    conv.register_structure_hook(bool, _primitive(bool, "true or false"))
    conv.register_structure_hook(float, lambda value, _: number(value))
    conv.register_structure_hook_factory(attrs.has, class_hook_factory)
    conv.register_structure_hook_factory(lambda t: _rule_of(t) is not None, _rule_hook_factory)
    return conv


converter: Final = _make_converter()
"""The cattrs converter for configuration: strict primitives, unknown keys refused."""


def locate(exc: BaseException) -> ConfigError:
    """The first problem inside a cattrs error, as a ConfigError with its full key path.

    At each level an unknown key is reported before the other problems.
    """
    keys: list[Key] = []
    while True:
        if isinstance(exc, ClassValidationError | IterableValidationError):
            extra = [e for e in exc.exceptions if isinstance(e, ForbiddenExtraKeysError)]
            inner = extra[0] if extra else exc.exceptions[0]
            for note in getattr(inner, "__notes__", ()):
                if isinstance(note, AttributeValidationNote):
                    keys.append(note.name)
                    break
                if isinstance(note, IterableValidationNote):
                    keys.append(note.index)
                    break
            exc = inner
        elif isinstance(exc, ForbiddenExtraKeysError):
            unknown = sorted(exc.extra_fields, key=str)[0]
            known = [field.name for field in attrs.fields(exc.cl)]
            close = difflib.get_close_matches(str(unknown), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return ConfigError(f"unknown key{hint}", keys=(*keys, unknown))
        elif isinstance(exc, KeyError):
            return ConfigError("required key is missing", keys=keys)
        elif isinstance(exc, ConfigError):
            return ConfigError(exc.reason, keys=(*keys, *exc.keys))
        else:
            return ConfigError(" ".join(str(exc).split()) or type(exc).__name__, keys=keys)


_C = TypeVar("_C")


def structure_config(data: object, cls: type[_C], *, config_dir: Path | None = None) -> _C:
    """Validate a parsed configuration document into ``cls`` with the strict converter.

    Args:
        data: the document.
        cls: the configuration class.
        config_dir: the folder of the file the document came from. Relative paths
            (the :func:`~trio_broker_daemons.config.rules.config_path` rule: ``temp_dir``,
            ``tls.cert`` …) are made relative
            to it, and ``{config_dir}`` in an argv element becomes it. ``None``
            (a document not read from a file): paths stay as written (relative
            to the working directory) and ``{config_dir}`` is the working directory.

    Returns:
        The configuration.

    Raises:
        ConfigError: not a mapping, or the first problem, with its key path.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping at the top level, got {show(data)}")
    with reading_from(config_dir):
        try:
            return converter.structure(data, cls)
        except Exception as exc:
            raise locate(exc) from None


def load_config(
    path: str | os.PathLike[str], cls: type[_C], *, environ: Mapping[str, str] | None = None
) -> _C:
    """Read a configuration file, lay the environment over it, read its secret files.

    The steps are :mod:`trio_broker_daemons.config.sources`': the YAML file; each
    ``TRIO_BROKER_<KEY>`` variable (nested keys joined with ``__``) over the
    file's value; each ``<key>_file`` of a key marked
    :func:`~trio_broker_daemons.config.sources.secret_file`; then :func:`structure_config`
    with the file's folder, so relative paths are relative to the file, not to
    the working directory.

    Args:
        path: the configuration file.
        cls: the configuration class (an attrs class the converter structures).
        environ: the variables to apply, usually ``os.environ``; ``None`` for none.

    Returns:
        The configuration.

    Raises:
        ConfigError: the first problem; one that a variable caused names it.
    """
    document = load_yaml_mapping(path)
    folder = Path(os.path.abspath(path)).parent
    sources: EnvironmentSources = {}
    try:
        if environ is not None:
            document, sources = apply_environment(document, cls, environ)
        document = read_secret_files(document, cls, folder)
        return structure_config(document, cls, config_dir=folder)
    except ConfigError as exc:
        raise blame_environment(exc, sources) from None
