"""Argv templates: how a service's command is written, and how a job fills it in.

A service runs a command given as an argv template, a list of strings; a job fills
it from its ``params``. There is no shell anywhere: each element becomes exactly one
argument whatever a value holds, so a job's values can never become shell syntax.
:meth:`ArgvTemplate.parse` reads a template once into a value that knows its
placeholders; :meth:`ArgvTemplate.fill` fills it for one job. The configuration
loader and the runner both go through this module, so a template the loader
accepts is one the runner can fill.

The grammar of one element (a subset of Python's ``str.format``, which fills an
accepted template the same way):

* ``{name}`` is a placeholder. ``name`` is a bare identifier (``str.isidentifier``):
  no index, attribute, conversion or format spec, so ``{0}``, ``{}``, ``{x.y}``,
  ``{x!r}``, ``{x:>5}`` and ``{x:}`` are refused.
* ``{{`` and ``}}`` are a literal ``{`` and ``}``.
* Any other ``{`` or ``}`` is refused: a template error is the operator's mistake,
  found when the configuration loads, never when a job runs.
* No element contains a NUL character (no argument can).
* The program, element 0, is a non-empty string without placeholders, so that a
  job can never choose what runs.

Filling: a string goes in as it is, a number as JSON prints it (``3``, ``2.5``,
``1e+21``), a boolean as ``true`` or ``false``. A missing parameter, any other value
(an object, a list, null, a non-finite number) and a value holding a NUL character
are refused with :class:`ParameterError`, whose text is the receipt's error.

Guarded options: a value that begins with ``-`` is refused where the template
lets an option start, that is where everything before the placeholder in its
element is dashes or nothing: a placeholder standing alone (``{file}``), at
the start of its element (``{name}.png``) or glued to a leading dash
(``-{level}``, ``--{flag}``). There the value would become an option of the
program (``level: -help`` fills ``-{level}`` as ``--help``), so it is refused
with a :class:`ParameterError` naming the parameter, the element and the rule,
unless the template lists the parameter in ``allow_leading_dash``. After other
text (``--size={size}``, ``-o{out}``, ``x{name}``) a value is never an option
and is not guarded. The guard looks at the dash only: a placeholder glued to a
dash hands the program option letters by design (``-{level}`` with ``level: d``
is gzip's ``-d``), so such a template belongs to parameters that come from a
trusted configuration.

The module is pure: no I/O, no trio.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Final, overload

import attrs

__all__ = [
    "ArgvTemplate",
    "ParameterError",
    "Placeholder",
    "TemplateError",
    "fill_argv",
]

_BRACE_HINT: Final = "(write {{ and }} for literal braces)"


class TemplateError(ValueError):
    """An argv template is malformed: the operator's mistake.

    Attributes:
        reason: what was expected and what came, e.g. ``invalid placeholder in
            '{0}': expected {name} with an identifier name, got {0}``.
        index: the position of the offending element in the template, ``None``
            for a problem of the whole template (an empty one).
    """

    def __init__(self, reason: str, *, index: int | None = None) -> None:
        super().__init__(reason, index)
        self.reason = reason
        self.index = index

    def __str__(self) -> str:
        return self.reason if self.index is None else f"argv[{self.index}]: {self.reason}"


class ParameterError(ValueError):
    """A job's parameters cannot fill an argv template; the text is the receipt's error."""


@attrs.frozen
class Placeholder:
    """A ``{name}`` in an argv element: filled from ``params[name]``."""

    name: str


Part = str | Placeholder
"""A piece of an element: literal text (braces already unescaped) or a placeholder."""


def _show(text: str) -> str:
    """A short rendering of an element for error messages."""
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _parse_element(element: str) -> tuple[Part, ...]:
    """Split one element into literal text and placeholders.

    Raises:
        TemplateError: a stray brace, a placeholder that is not a bare identifier,
            or a NUL character (``index`` unset: the caller knows it).
    """
    if "\0" in element:
        raise TemplateError(f"invalid template {_show(element)}: it holds a NUL character")
    parts: list[Part] = []
    literal: list[str] = []
    position = 0
    end = len(element)
    while position < end:
        char = element[position]
        if char not in "{}":
            literal.append(char)
            position += 1
        elif element.startswith(char * 2, position):  # {{ or }}
            literal.append(char)
            position += 2
        elif char == "}":
            raise TemplateError(f"invalid template {_show(element)}: a single '}}' {_BRACE_HINT}")
        else:
            close = element.find("}", position + 1)
            reopen = element.find("{", position + 1)
            if close == -1 or (reopen != -1 and reopen < close):
                raise TemplateError(
                    f"invalid template {_show(element)}: a single '{{' {_BRACE_HINT}"
                )
            name = element[position + 1 : close]
            if not name.isidentifier():
                raise TemplateError(
                    f"invalid placeholder in {_show(element)}: expected {{name}} with an"
                    f" identifier name, got {{{name}}}"
                )
            if literal:
                parts.append("".join(literal))
                literal = []
            parts.append(Placeholder(name))
            position = close + 1
    if literal:
        parts.append("".join(literal))
    return tuple(parts)


def _format_value(name: str, value: object) -> str:
    if isinstance(value, str):
        text = value
    elif value is True or value is False:
        text = "true" if value else "false"
    elif isinstance(value, int | float) and math.isfinite(value):
        text = json.dumps(value)
    else:
        raise ParameterError(f"parameter {name!r} must be a string, number or boolean")
    if "\0" in text:
        raise ParameterError(f"parameter {name!r} must not contain a NUL character")
    return text


@attrs.frozen(kw_only=True)
class ArgvTemplate(Sequence[str]):
    """A parsed argv template; as a sequence, the elements as written.

    Build one with :meth:`parse`. ``len()``, indexing, slicing and iteration see
    the elements as written (``template[0]`` is the program), so a template reads
    like the list of strings it came from.

    Attributes:
        source: the elements as written.
        parts: each element split into literal text and placeholders.
        allow_leading_dash: the parameters whose values may begin with ``-``
            where an option can start (*Guarded options* in the module docstring).
    """

    source: tuple[str, ...]
    parts: tuple[tuple[Part, ...], ...] = attrs.field(repr=False, eq=False)
    allow_leading_dash: frozenset[str] = frozenset()

    @classmethod
    def parse(
        cls, argv: Sequence[str], *, allow_leading_dash: Iterable[str] | None = None
    ) -> ArgvTemplate:
        """Parse an argv template (see the module docstring for the grammar).

        Args:
            argv: the elements; a template is returned as it is (with
                ``allow_leading_dash`` replaced when that is given).
            allow_leading_dash: the parameters whose values may begin with ``-``
                where an option can start (see *Guarded options* in the module
                docstring); each must be a placeholder of the template.

        Returns:
            The template, its placeholders known.

        Raises:
            TemplateError: the template is not a non-empty sequence of strings,
                an element breaks the grammar (``index`` names it), the
                program is empty or holds a placeholder, or ``allow_leading_dash``
                names no placeholder.
        """
        if isinstance(argv, ArgvTemplate):
            if allow_leading_dash is None:
                return argv
            return cls(
                source=argv.source,
                parts=argv.parts,
                allow_leading_dash=argv._allowed(allow_leading_dash),
            )
        if isinstance(argv, str | bytes) or not isinstance(argv, Sequence):
            raise TemplateError(f"expected a list of strings, got {type(argv).__name__}")
        if not argv:
            raise TemplateError("expected a non-empty list of strings, got an empty list")
        parsed = []
        for index, element in enumerate(argv):
            if not isinstance(element, str):
                raise TemplateError(f"expected a string, got {type(element).__name__}", index=index)
            try:
                parsed.append(_parse_element(element))
            except TemplateError as exc:
                raise TemplateError(exc.reason, index=index) from None
        if not argv[0] or any(isinstance(part, Placeholder) for part in parsed[0]):
            raise TemplateError(
                "expected the program as a non-empty string without placeholders,"
                f" got {_show(argv[0])}",
                index=0,
            )
        template = cls(source=tuple(argv), parts=tuple(parsed))
        if allow_leading_dash is None:
            return template
        return cls(
            source=template.source,
            parts=template.parts,
            allow_leading_dash=template._allowed(allow_leading_dash),
        )

    def _allowed(self, names: Iterable[str]) -> frozenset[str]:
        """``names`` as a set, each checked to be a placeholder of this template."""
        if isinstance(names, str):
            raise TemplateError(
                f"allow_leading_dash: expected a list of parameter names, got {names!r}"
            )
        placeholders = self.placeholders
        for name in names:
            if name not in placeholders:
                known = ", ".join(sorted(placeholders)) or "none"
                raise TemplateError(
                    f"allow_leading_dash: expected placeholders of the template ({known}),"
                    f" got {name!r}"
                )
        return frozenset(names)

    @property
    def program(self) -> str:
        """What runs: element 0, which holds no placeholder (braces unescaped)."""
        return "".join(part for part in self.parts[0] if isinstance(part, str))

    @property
    def placeholders(self) -> frozenset[str]:
        """The names of every ``{name}``: the parameters a job must give."""
        return frozenset(
            part.name for element in self.parts for part in element if isinstance(part, Placeholder)
        )

    def fill(self, params: Mapping[str, object]) -> tuple[str, ...]:
        """Fill the placeholders from a job's parameters.

        Args:
            params: the job's ``params``; names the template does not use are ignored.

        Returns:
            The argv to run, one argument per element.

        Raises:
            ParameterError: a placeholder's parameter is missing, is not a string,
                finite number or boolean, or holds a NUL character, or its value
                begins with ``-`` where an option can start and the parameter is
                not in ``allow_leading_dash``; the first such placeholder (in
                template order) is named.
        """
        return tuple(
            self._fill_element(index, element, params) for index, element in enumerate(self.parts)
        )

    def _fill_element(
        self, index: int, element: tuple[Part, ...], params: Mapping[str, object]
    ) -> str:
        pieces = []
        option_start = True  # everything so far in the element is dashes (or nothing)
        for part in element:
            if isinstance(part, str):
                text = part
            elif part.name not in params:
                raise ParameterError(f"missing parameter {part.name!r}")
            else:
                text = _format_value(part.name, params[part.name])
                if (
                    option_start
                    and text.startswith("-")
                    and part.name not in self.allow_leading_dash
                ):
                    raise ParameterError(
                        f"parameter {part.name!r} must not begin with '-' where an option can"
                        f" start (argv[{index}] {_show(self.source[index])}, got {_show(text)});"
                        " the service may allow it with allow_leading_dash"
                    )
            option_start = option_start and text.strip("-") == ""
            pieces.append(text)
        return "".join(pieces)

    # -- the sequence of elements as written

    def __len__(self) -> int:
        return len(self.source)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...
    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self.source[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)


def fill_argv(
    argv: Sequence[str],
    params: Mapping[str, object],
    *,
    allow_leading_dash: Iterable[str] | None = None,
) -> tuple[str, ...]:
    """Parse an argv template (or take a parsed one) and fill it from ``params``.

    Raises:
        TemplateError: the template is malformed.
        ParameterError: ``params`` cannot fill it (see :meth:`ArgvTemplate.fill`).
    """
    return ArgvTemplate.parse(argv, allow_leading_dash=allow_leading_dash).fill(params)
