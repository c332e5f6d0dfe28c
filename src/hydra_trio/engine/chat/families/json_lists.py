"""The families whose calls are one JSON list of ``{"name": ..., "arguments": {...}}`` after a
marker of their own: Mistral Nemo and older Mistral templates (``[TOOL_CALLS]``; the current
ones write ``[TOOL_CALLS]NAME[ARGS]{...}``: mistral_args.py, detected before this), IBM Granite
3.3 (``<|tool_call|>``), NVIDIA Nemotron Nano v2 (``<TOOLCALL>``), ServiceNow Apriel 1.5 and 1.6
(``<tool_calls>``), and Fireworks' firefunction v2 (`` functools``). Pure."""

from __future__ import annotations

from .roster import register
from .toolformat import CALL_PREFIX, Detect, ToolFormat, Trigger, json_list

MISTRAL = register(json_list("mistral", "[TOOL_CALLS]", detect=(Detect(280, ("[TOOL_CALLS]",)),)))
# IBM Granite 3.3: "respond only with <|tool_call|> followed by a JSON list of tools used"
GRANITE = register(json_list("granite", "<|tool_call|>", detect=(Detect(290, ("<|tool_call|>",)),)))
# NVIDIA Nemotron Nano v2: <TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>
NEMOTRON = register(json_list("nemotron", "<TOOLCALL>", "</TOOLCALL>", detect=(Detect(200, ("<TOOLCALL>[",)),)))
# ServiceNow Apriel 1.5 and 1.6: <tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>
# (before Hermes' <tool_call>: Apriel 1.5 names both)
APRIEL = register(json_list("apriel", "<tool_calls>", "</tool_calls>", detect=(Detect(260, ("<tool_calls>[",)),)))
# Fireworks' firefunction v2: " functools[{"name": ..., "arguments": {...}}, ...]" (no closing marker;
# the grammar writes it from "functools[", its trigger, on: what a lazy grammar is fed starts there)
FIREFUNCTION = register(ToolFormat(
    "firefunction",
    "arguments",
    opener="functools",
    listed=True,
    before="functools[",
    between=", ",
    after="]",
    triggers=(Trigger("functools[", False, CALL_PREFIX),),
    detect=(Detect(210, ("functools[",)),),
))
