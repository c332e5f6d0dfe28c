"""The tool-call families: every way of writing calls the engine knows, one module each (a
module may hold a family's variants: Qwen3-Coder's and Seed-OSS's tags, MiniMax's and DSML's
invokes), every one registered in the roster the same way, JSON ones and markup ones alike.
Loading this package loads each module in the folder, and each registers its ``ToolFormat``
(``roster.register``): the chat room reads families from the roster only (``formats.py`` its
table and --tool-call-parser's names, ``caps.py`` the detection order, ``parser.py`` and
``call_grammar.py`` a format's fields), so nothing else lists them.

The folder holds more than a dozen modules by design: one a family (and the shared types,
roster and rules), so that a new family is one new file and nothing else.

To add a family, write one module here and its tests (tests/engine/chat/test_family_*.py):

- its ``ToolFormat`` (toolformat.py), passed to ``register``: the name (--tool-call-parser's),
  the literals the parser and the grammar share (openers, closers, what the grammar writes
  before, around and between calls), its lazy ``triggers``;
- ``detect``: the marks of its chat templates' Jinja source, each rule at a ``priority`` of its
  own (``roster.detection_order``: lowest first, the first rule that holds picks the family).
  Put a rule before those of families whose marks a template of yours also holds (the
  table of tests/engine/chat/test_toolcall_registry.py: Hermes' ``<tool_call>`` is at 270,
  the catch-all llama3 rule at 900);
- calls that are one JSON object need nothing more; markup of its own brings a ``Block`` (its
  ``read``: a region's text -> calls) and a ``call_rule`` (one call as llguidance's Lark, its
  arguments their schema's ``%json`` or typed text; param_rules.py has the shared ones), so
  what the grammar makes a model write is what the parser reads; a channel dialect brings a
  ``splitter`` (channels.py);
- its tests restate llama.cpp's (tests/test-chat.cpp) for its templates (models/templates/),
  and give the checks every family goes through replies of its own
  (tests/engine/chat/family_examples.py).

Pure."""

from __future__ import annotations

import importlib
import pkgutil

from .generic import GENERIC  # the fallback: the form of a template with no syntax of its own
from .roster import by_name, detection_order, formats, register
from .toolformat import (
    CALL_PREFIX,
    MAX_SALVAGE_TRIES,
    Block,
    Call,
    ChannelReader,
    Detect,
    Props,
    ToolFormat,
    Trigger,
)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")  # each family's module registers it

__all__ = [
    "CALL_PREFIX",
    "GENERIC",
    "MAX_SALVAGE_TRIES",
    "Block",
    "Call",
    "ChannelReader",
    "Detect",
    "Props",
    "ToolFormat",
    "Trigger",
    "by_name",
    "detection_order",
    "formats",
    "register",
]
