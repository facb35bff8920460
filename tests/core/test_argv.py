"""The argv template grammar: what parses, what is refused and how, how a job fills it."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_broker.core.argv import (
    ArgvTemplate,
    ParameterError,
    Placeholder,
    TemplateError,
    fill_argv,
)

HINT = "(write {{ and }} for literal braces)"

identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True) | st.sampled_from(
    ["é", "名前", "_", "class"]
)
literal_text = st.text(st.characters(exclude_characters="\0"), max_size=12)
scalars = (
    st.text(st.characters(exclude_characters="\0"))
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
)
parts_lists = st.lists(literal_text | identifiers.map(Placeholder), max_size=6)


def escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def render(parts: list[str | Placeholder]) -> str:
    """The element text that parses to ``parts``."""
    return "".join(escape(p) if isinstance(p, str) else "{" + p.name + "}" for p in parts)


def merged(parts: list[str | Placeholder]) -> tuple[str | Placeholder, ...]:
    """``parts`` with adjacent literals joined and empty literals dropped."""
    out: list[str | Placeholder] = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        elif part != "":
            out.append(part)
    return tuple(out)


# -- what parses --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("element", "parts"),
    [
        ("plain", ("plain",)),
        ("{input}", (Placeholder("input"),)),
        ("-o{out}.png", ("-o", Placeholder("out"), ".png")),
        ("{a}{b}", (Placeholder("a"), Placeholder("b"))),
        ("{{literal}}", ("{literal}",)),
        ("{{{value}}}", ("{", Placeholder("value"), "}")),
        ("{a}}}", (Placeholder("a"), "}")),
        ("}}{{", ("}{",)),
        ("{é}", (Placeholder("é"),)),
        ("$(rm -rf /); `x`", ("$(rm -rf /); `x`",)),
        ("", ()),
    ],
)
def test_accepted_elements(element: str, parts: tuple[object, ...]) -> None:
    """Elements split into literal text (braces unescaped) and bare-identifier placeholders."""
    template = ArgvTemplate.parse(["prog", element])
    assert template.parts[1] == parts


def test_a_template_reads_as_the_elements_written() -> None:
    """As a sequence, a template is its elements as written; it knows its placeholders."""
    template = ArgvTemplate.parse(["convert", "{input}", "-thumbnail", "{size}", "{{x}}"])
    assert len(template) == 5
    assert template[0] == "convert"
    assert template[:2] == ("convert", "{input}")
    assert (
        tuple(template)
        == template.source
        == ("convert", "{input}", "-thumbnail", "{size}", "{{x}}")
    )
    assert template.placeholders == {"input", "size"}
    assert template.program == "convert"
    assert ArgvTemplate.parse(template) is template
    assert template == ArgvTemplate.parse(list(template.source))


# -- what is refused ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("element", "reason"),
    [
        ("{input", f"invalid template '{{input': a single '{{' {HINT}"),
        ("x}", f"invalid template 'x}}': a single '}}' {HINT}"),
        ("}{", f"invalid template '}}{{': a single '}}' {HINT}"),
        ("{{a}", f"invalid template '{{{{a}}': a single '}}' {HINT}"),
        ("{a{b}}", f"invalid template '{{a{{b}}}}': a single '{{' {HINT}"),
        ("{}", "invalid placeholder in '{}': expected {name} with an identifier name, got {}"),
        ("{0}", "invalid placeholder in '{0}': expected {name} with an identifier name, got {0}"),
        (
            "{x.y}",
            "invalid placeholder in '{x.y}': expected {name} with an identifier name, got {x.y}",
        ),
        (
            "{x!r:>5}",
            "invalid placeholder in '{x!r:>5}': expected {name} with an identifier name,"
            " got {x!r:>5}",
        ),
        (
            "{a:}",
            "invalid placeholder in '{a:}': expected {name} with an identifier name, got {a:}",
        ),
        (
            "{a!}",
            "invalid placeholder in '{a!}': expected {name} with an identifier name, got {a!}",
        ),
        (
            "{ a}",
            "invalid placeholder in '{ a}': expected {name} with an identifier name, got { a}",
        ),
        ("a\0b", "invalid template 'a\\x00b': it holds a NUL character"),
        ("x" * 50 + "}", f"invalid template '{'x' * 37}...': a single '}}' {HINT}"),
    ],
)
def test_refused_elements(element: str, reason: str) -> None:
    """Stray braces, non-identifier placeholders and NULs are refused with a pinned reason."""
    with pytest.raises(TemplateError) as info:
        ArgvTemplate.parse(["prog", "ok", element])
    assert (info.value.reason, info.value.index) == (reason, 2)
    assert str(info.value) == f"argv[2]: {reason}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "expected a non-empty list of strings, got an empty list"),
        ("prog", "expected a list of strings, got str"),
        (["prog", 5], "argv[1]: expected a string, got int"),
        (
            ["{tool}", "x"],
            "argv[0]: expected the program as a non-empty string without"
            " placeholders, got '{tool}'",
        ),
        (
            ["", "x"],
            "argv[0]: expected the program as a non-empty string without placeholders, got ''",
        ),
        (
            ["a{x}b"],
            "argv[0]: expected the program as a non-empty string without placeholders, got 'a{x}b'",
        ),
    ],
)
def test_refused_templates(argv: Any, message: str) -> None:
    """A template must be a non-empty list of strings whose program holds no placeholder."""
    with pytest.raises(TemplateError) as info:
        ArgvTemplate.parse(argv)
    assert str(info.value) == message


def test_literal_braces_may_name_the_program() -> None:
    """Escaped braces are literal text, so they may appear in the program."""
    assert ArgvTemplate.parse(["{{odd}}"]).program == "{odd}"


# -- filling ------------------------------------------------------------------------


def test_values_are_filled_without_a_shell() -> None:
    """Strings go in as they are, numbers as JSON prints them, booleans as true/false."""
    params = {"n": 3, "f": 2.5, "big": 1e21, "yes": True, "no": False, "s": "a b; $(rm -rf /)"}
    argv = ("p", "{n}", "{f}", "{big}", "{yes}", "{no}", "{{lit}}", "x{s}y", "{n}{n}", "{neg}")
    assert fill_argv(argv, {**params, "neg": -1}, allow_leading_dash=["neg"]) == (
        "p",
        "3",
        "2.5",
        "1e+21",
        "true",
        "false",
        "{lit}",
        "xa b; $(rm -rf /)y",
        "33",
        "-1",
    )


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({}, "missing parameter 'text'"),
        ({"other": "x"}, "missing parameter 'text'"),
        ({"text": {"a": 1}}, "parameter 'text' must be a string, number or boolean"),
        ({"text": [1]}, "parameter 'text' must be a string, number or boolean"),
        ({"text": None}, "parameter 'text' must be a string, number or boolean"),
        ({"text": math.nan}, "parameter 'text' must be a string, number or boolean"),
        ({"text": math.inf}, "parameter 'text' must be a string, number or boolean"),
        ({"text": "a\0b"}, "parameter 'text' must not contain a NUL character"),
    ],
)
def test_parameters_that_cannot_fill(params: dict[str, Any], error: str) -> None:
    """A missing, non-scalar or NUL-holding parameter is refused with the receipt's sentence."""
    with pytest.raises(ParameterError) as info:
        fill_argv(("echo", "{text}"), params)
    assert str(info.value) == error


def test_the_first_unfillable_placeholder_is_named() -> None:
    """When several parameters are missing, the first in template order is named."""
    with pytest.raises(ParameterError, match=r"^missing parameter 'b'$"):
        fill_argv(("p", "{b}", "{a}"), {})


# -- properties ---------------------------------------------------------------------


@given(st.lists(parts_lists, min_size=1, max_size=5))
def test_rendered_parts_parse_back(elements: list[list[str | Placeholder]]) -> None:
    """Any literals and placeholders, written with escaped braces, parse back to themselves."""
    argv = ["prog", *(render(parts) for parts in elements)]
    template = ArgvTemplate.parse(argv)
    assert template.parts[1:] == tuple(merged(parts) for parts in elements)
    assert template.source == tuple(argv)


@given(st.lists(st.text(max_size=10), min_size=1, max_size=5), st.data())
def test_whatever_parses_fills_with_every_placeholder_given(
    tail: list[str], data: st.DataObject
) -> None:
    """Any template that parses fills, one argument per element, once each placeholder is given."""
    try:
        template = ArgvTemplate.parse(["prog", *tail])
    except TemplateError:
        return
    params = {name: data.draw(scalars) for name in template.placeholders}
    allowed = ArgvTemplate.parse(template, allow_leading_dash=template.placeholders)
    assert len(allowed.fill(params)) == len(tail) + 1


@given(st.lists(parts_lists, min_size=1, max_size=4), st.data())
def test_filling_agrees_with_str_format(
    elements: list[list[str | Placeholder]], data: st.DataObject
) -> None:
    """An accepted template fills as Python's str.format fills it with the same strings."""
    argv = ["prog", *(render(parts) for parts in elements)]
    template = ArgvTemplate.parse(argv)
    values = st.text(st.characters(exclude_characters="\0"), max_size=8)
    params = {name: data.draw(values) for name in template.placeholders}
    expected = tuple(element.format(**params) for element in argv)
    allowed = ArgvTemplate.parse(argv, allow_leading_dash=template.placeholders)
    assert allowed.fill(params) == expected
    if any(argument.startswith("-") for argument in expected[1:]):
        return  # the guard may refuse it (its own tests)
    assert template.fill(params) == expected


@given(literal_text, st.sampled_from("{}"), literal_text)
def test_a_lone_brace_is_always_refused(before: str, brace: str, after: str) -> None:
    """A single brace among escaped text is refused, wherever it stands."""
    element = escape(before) + brace + escape(after)
    with pytest.raises(TemplateError, match=r"a single|invalid placeholder"):
        ArgvTemplate.parse(["prog", element])


# -- guarded options -----------------------------------------------------------------


GUARD = "must not begin with '-' where an option can start"


@pytest.mark.parametrize(
    ("element", "value"),
    [
        ("{v}", "-help"),  # standing alone
        ("{v}", "--output=/etc/passwd"),
        ("{v}", -1),  # a negative number is an option too (gzip -1, head -1)
        ("-{v}", "-help"),  # glued to a leading dash: --help
        ("--{v}", "-x"),
        ("{v}.png", "-x"),  # at the start of its element
        ("{empty}{v}", "-x"),  # an empty value before it leaves the start open
        ("-{empty}{v}", "-x"),
        ("{v}", "-"),  # a lone dash (stdin for many programs) is refused too
    ],
)
def test_a_leading_dash_where_an_option_can_start_is_refused(element: str, value: object) -> None:
    """A value beginning with '-' is refused wherever the argument could become an option;
    the error names the parameter, the element and the rule."""
    argv = ("prog", "-c", element)
    with pytest.raises(ParameterError) as info:
        fill_argv(argv, {"v": value, "empty": ""})
    shown = repr(str(value) if isinstance(value, str) else json.dumps(value))
    assert str(info.value) == (
        f"parameter 'v' {GUARD} (argv[2] {element!r}, got {shown});"
        " the service may allow it with allow_leading_dash"
    )


@pytest.mark.parametrize(
    ("element", "value", "filled"),
    [
        ("--size={v}", "-1", "--size=-1"),  # after other text: never an option
        ("-o{v}", "-x", "-o-x"),
        ("x{v}", "-y", "x-y"),
        ("{v}", "9", "9"),
        ("-{v}", "9", "-9"),  # the template's own dash: an option by design
        ("{v}", "a-b", "a-b"),
        ("{v}", "", ""),
    ],
)
def test_values_that_cannot_start_an_option_fill(element: str, value: str, filled: str) -> None:
    """A dash after other text, or a value without a leading dash, fills as before."""
    assert fill_argv(("prog", element), {"v": value}) == ("prog", filled)


def test_a_parameter_the_service_allows_may_begin_with_a_dash() -> None:
    """allow_leading_dash lets one parameter through; the others stay guarded."""
    template = ArgvTemplate.parse(
        ["grep", "-e", "{pattern}", "{file}"], allow_leading_dash=["pattern"]
    )
    assert template.allow_leading_dash == {"pattern"}
    assert template.fill({"pattern": "-v", "file": "in.txt"}) == ("grep", "-e", "-v", "in.txt")
    with pytest.raises(ParameterError, match=r"^parameter 'file' must not begin"):
        template.fill({"pattern": "-v", "file": "-r"})
    # the same elements without the allowance refuse the pattern
    with pytest.raises(ParameterError, match=r"^parameter 'pattern' must not begin"):
        ArgvTemplate.parse(template.source).fill({"pattern": "-v", "file": "in.txt"})


def test_allowing_a_dash_names_placeholders_only() -> None:
    """allow_leading_dash must name placeholders of the template (a typo is the operator's)."""
    with pytest.raises(TemplateError) as info:
        ArgvTemplate.parse(["prog", "{a}", "{b}"], allow_leading_dash=["c"])
    assert str(info.value) == (
        "allow_leading_dash: expected placeholders of the template (a, b), got 'c'"
    )
    with pytest.raises(TemplateError, match="expected a list of parameter names, got 'a'"):
        ArgvTemplate.parse(["prog", "{a}"], allow_leading_dash="a")


def test_reparsing_a_template_keeps_or_replaces_its_allowance() -> None:
    """A parsed template passes through parse unchanged, or with the allowance given."""
    template = ArgvTemplate.parse(["prog", "{a}"], allow_leading_dash=["a"])
    assert ArgvTemplate.parse(template) is template
    cleared = ArgvTemplate.parse(template, allow_leading_dash=[])
    assert cleared.allow_leading_dash == frozenset()
    assert cleared.source == template.source
    assert cleared != template


@given(st.lists(parts_lists, min_size=1, max_size=4), st.data())
def test_no_filled_argument_starts_with_a_dash_the_template_did_not_write(
    elements: list[list[str | Placeholder]], data: st.DataObject
) -> None:
    """Whatever the values, an argument that begins with '-' after filling begins with a
    dash the template wrote itself, unless the filling was refused."""
    argv = ["prog", *(render(parts) for parts in elements)]
    template = ArgvTemplate.parse(argv)
    values = st.text(st.sampled_from("-ab"), max_size=3)
    params = {name: data.draw(values) for name in template.placeholders}
    try:
        filled = template.fill(params)
    except ParameterError:
        return
    for parts, argument in zip(template.parts[1:], filled[1:], strict=True):
        if argument.startswith("-"):
            texts = [params[p.name] if isinstance(p, Placeholder) else p for p in parts]
            first = next(index for index, text in enumerate(texts) if text)
            assert not isinstance(parts[first], Placeholder), (parts, params)
