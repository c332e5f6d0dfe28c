"""The replies of tool-call families added to engine/chat/families/ after the first thirty,
for the checks every family goes through (test_tool_families.py: whole and split anywhere;
test_toolcalls.py: one and parallel calls; test_reply_bounds.py: nesting, arguments that
cannot be written out, linear work; test_tool_grammar.py: what its grammar writes first). The first families' replies
are written in those files; a family added since brings its own in its one test module,
``tests/engine/chat/test_family_<name>.py``:

- ``CASES``: (format name, reply, starts in reasoning, content, reasoning, calls), as
  test_tool_families.CASES (calling its TOOLS), at least one a single call of
  ``special_function`` with ``{"arg1": 1}`` (test_reply_bounds.py writes its hostile values there);
- ``write_calls(fmt, calls, value)``: calls ``[(name, arguments)]`` as the family writes them (as
  its grammar makes a model write them), ``value(name, key, v)`` the text of an argument where
  the family writes a value as text (a declared string as it is, else its JSON); None for a
  format that is not its;
- ``XML_VALUES``: its families whose parameter values are text (kept as text where not JSON).

A registered family without them fails those checks, so a new family is its module and its
test module, nothing else. Its test module imports no other test module (this one imports
it while they load)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

_MODULES: list[ModuleType] = [
    importlib.import_module(path.stem) for path in sorted(Path(__file__).parent.glob("test_family_*.py"))
]

CASES: list[tuple[str, str, bool, str, str, list[tuple[str, dict[str, Any]]]]] = [
    case for module in _MODULES for case in getattr(module, "CASES", ())
]
XML_VALUES: set[str] = {name for module in _MODULES for name in getattr(module, "XML_VALUES", ())}
Value = Callable[[str, str, Any], str]  # (tool, key, value) -> the value's text
_WRITERS: list[Callable[[Any, list[tuple[str, dict[str, Any]]], Value], str | None]] = [
    module.write_calls for module in _MODULES if hasattr(module, "write_calls")
]


def write_calls(fmt: Any, calls: list[tuple[str, dict[str, Any]]], value: Value) -> str | None:
    """``calls`` as a family added since writes them; None: no such family is ``fmt``."""
    for write in _WRITERS:
        if (text := write(fmt, calls, value)) is not None:
            return text
    return None
