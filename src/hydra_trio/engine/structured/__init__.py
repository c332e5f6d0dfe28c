"""Structured output: what a reply must follow, and the engine that makes it. A request's
constraint as it asked (``Constraint``), the grammar it becomes (``OutputGrammar``: Lark with
JSON schemas as ``%json``, under the schema policy of schema_policy.py), compiled and run on
llguidance (``GuidanceCache``, ``GuidanceState``), a lazy grammar's trigger (``TriggerWatch``),
and the reply's think block that holds a grammar until it closes (``ThinkPlan``,
``ThinkGate``). Pure: nothing of llama.cpp (the tokenizer view llguidance runs over is handed
in by engine/llama/), nothing of the chat templates (engine/chat/ writes tool calls' grammars
with what this package exports)."""

from .grammars import (
    MAX_GRAMMAR_CHARS,
    Constraint,
    OutputGrammar,
    SchemaExpr,
    SchemaRules,
    Triggers,
    format_expr,
    format_grammar,
    literal,
    output_constraint,
    regex,
    request_constraint,
    seq,
)
from .guidance import GrammarError, GuidanceCache, GuidanceState
from .schema_policy import PreparedSchema, prepare_schema
from .thinking import ThinkGate, ThinkPlan
from .triggers import TriggerWatch, optional_tail, regex_literal, trigger_pattern

__all__ = [
    "MAX_GRAMMAR_CHARS",
    "Constraint",
    "GrammarError",
    "GuidanceCache",
    "GuidanceState",
    "OutputGrammar",
    "PreparedSchema",
    "SchemaExpr",
    "SchemaRules",
    "ThinkGate",
    "ThinkPlan",
    "TriggerWatch",
    "Triggers",
    "format_expr",
    "format_grammar",
    "literal",
    "optional_tail",
    "output_constraint",
    "prepare_schema",
    "regex",
    "regex_literal",
    "request_constraint",
    "seq",
    "trigger_pattern",
]
