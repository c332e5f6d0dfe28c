"""Llama 3.1 to 3.3: ``<|python_tag|>`` and the calls' JSON objects, ``;`` between two, or a
bare call object opening the reply (its ``parameters`` the arguments). Pure."""

from __future__ import annotations

from .roster import register
from .toolformat import CALL_PREFIX, Detect, ToolFormat, Trigger

LLAMA3 = register(ToolFormat(
    "llama3",
    "parameters",
    opener="<|python_tag|>",
    at_start=True,
    separator=";",
    before="<|python_tag|>",
    before_optional=True,
    between="; ",
    triggers=(Trigger("<|python_tag|>", False, CALL_PREFIX), Trigger('{"name"', True, CALL_PREFIX[len('{"name"'):])),
    # its python tag; else a template that speaks of ipython and parameters, after every family's marks
    detect=(Detect(300, ("<|python_tag|>",)), Detect(900, ("ipython", "parameters"))),
))
