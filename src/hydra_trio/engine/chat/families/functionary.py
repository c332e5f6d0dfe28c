"""Functionary v3.2: each message starts at ``>>>`` with its recipient's line, ``all`` for
content, a tool's name for a call whose arguments' JSON follows (the prompt ends with the
first ``>>>``). Its lazy patterns name the request's tools. Pure."""

from __future__ import annotations

from ...structured import SchemaExpr, literal, optional_tail, regex_literal, seq
from ..tools import Tool
from .roster import register
from .toolformat import Detect, ToolFormat, Trigger


def _call(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    """The tool's name on its line, then its arguments' JSON."""
    return seq(literal(tool.name + "\n"), schema(tool.parameters, f"tools[{i}].function.parameters")), []


def recipient_patterns(fmt: ToolFormat, names: list[str]) -> tuple[str, ...]:
    """Functionary's lazy trigger: a recipient line after the opener that names a tool.
    llama.cpp's ``>>>(?!all)``, searched after each token, also matches a ``>>>`` that ends
    the text before ``all`` comes (a ``>>>all`` content line written over two tokens is
    forced into a call); this waits for the first character that parts the name from
    content's ``all\\n`` line, so ``>>>all`` never triggers, and matches only a beginning of
    ``>>>NAME\\n`` (as much of it as the last token carries): what is fed is a beginning of
    the grammar. As llama.cpp's, it is searched in the generated text only, so a call the
    reply opens with (after the prompt's ``>>>``) is not triggered; nor is a tool named ``all``."""
    content = fmt.recipient + "\n"
    alternatives = []
    for name in names:
        line = name + "\n"
        parts = next((i for i, (a, b) in enumerate(zip(line, content, strict=False)) if a != b), None)
        if parts is None:  # the name is content's recipient (a shorter one cannot be: names have no newline)
            continue
        alternatives.append(regex_literal(line[: parts + 1]) + optional_tail(line[parts + 1:]))
    if not alternatives:  # still lazy (no triggers would hold the grammar from the start): one that never matches
        return ("([^\\s\\S])$",)
    names_re = "|".join(alternatives)
    return (f"({regex_literal(fmt.opener)}(?:{names_re}))$",)


FUNCTIONARY = register(ToolFormat(
    "functionary",
    "arguments",
    opener=">>>",
    recipient="all",
    before=">>>",
    before_optional=True,
    between=">>>",
    triggers=(Trigger(">>>", False, ""),),  # under auto its patterns are recipient_patterns'
    call_rule=_call,
    tool_patterns=recipient_patterns,
    detect=(Detect(220, (">>>all", ">>>${recipient}")),),  # as llama.cpp tells it
))
