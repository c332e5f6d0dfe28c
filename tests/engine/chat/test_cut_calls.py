"""A forced call the length cap cuts never leaks as text (issue 49): for every tool-call
format the engine writes, a reply of several calls is written by walking its real grammar
(llguidance's mask over the tiny model's vocabulary, a seeded choice among the tokens it
allows), then cut at every character: what the parser returns for each cut is whole calls
only, a beginning of the reply's calls, every call but the one the cut fell in, and no
content at all. A named tool is exactly one call, however the model would go on."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hydra_trio.engine.chat import ReplyParser, ToolRequest, parse_reply, parse_tools
from hydra_trio.engine.chat.call_grammar import tools_grammar
from hydra_trio.engine.chat.formats import FORMATS, ToolFormat
from hydra_trio.engine.llama import LlamaBackend
from hydra_trio.engine.structured import GuidanceCache

DIGIT = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
CHOICE = {
    "type": "object",
    "properties": {"b": {"enum": ["x", "y"]}, "c": {"type": "boolean"}},
    "required": ["b", "c"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": p}} for n, p in (("tool_0", DIGIT), ("tool_1", CHOICE))
]
MAX_STEPS = 4000


@pytest.fixture(scope="module")
def vocab(tiny_model: Path) -> Iterator[tuple[GuidanceCache, list[bytes], frozenset[int]]]:
    backend = LlamaBackend(str(tiny_model), n_slots=1, n_ctx=256, n_threads=1, n_batch=64, kv_unified=True)
    try:
        yield (
            GuidanceCache(backend.grammar_pieces, backend.eog_ids, backend.info.bos),
            backend.grammar_pieces,
            backend.eog_ids,
        )
    finally:
        backend.close()


def walk(
    vocab: tuple[GuidanceCache, list[bytes], frozenset[int]], fmt: ToolFormat, req: ToolRequest, seed: int, calls: int
) -> str:
    """A reply the grammar allows, picked token by token at random (seeded), ended as soon as
    the grammar lets it end once ``calls`` calls are written (never before)."""
    cache, pieces, eog = vocab
    grammar = tools_grammar(req, fmt)
    cache.compile(grammar)
    state = cache.new_state(grammar)
    rng = random.Random(seed)
    text = b""
    for _ in range(MAX_STEPS):
        allowed = [int(t) for t in np.flatnonzero(state.allowed())]
        assert allowed, (fmt.name, text)
        ends = [t for t in allowed if t in eog]
        rest = [t for t in allowed if t not in eog]
        written = len(
            parse_reply(text.decode("utf-8", "replace"), fmt, parse_tools=True, reasoning=False, tools=req).tool_calls
        )
        if ends and (not rest or written >= calls):
            return text.decode()
        token = rng.choice(rest)
        state.accept(token)
        text += pieces[token]
    raise AssertionError(f"{fmt.name}: no end in {MAX_STEPS} tokens: {text!r}")


def read_cut(fmt: ToolFormat, req: ToolRequest, text: str) -> tuple[str, list[tuple[str, Any]]]:
    parser = ReplyParser(fmt, parse_tools=True, reasoning=False, tools=req)
    deltas = [parser.feed(text), parser.finish(cut=True)]
    return "".join(d.content for d in deltas), [(c.name, json.loads(c.arguments)) for d in deltas for c in d.tool_calls]


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_a_cut_reply_keeps_its_whole_calls_and_shows_no_syntax(vocab: Any, fmt: ToolFormat) -> None:
    req = parse_tools({"tools": TOOLS, "tool_choice": "required"})
    assert req is not None
    want = 1 if fmt.one_call else 2  # gpt-oss: one call a reply
    # Seeded walks until two replies of several calls (a walk may close a list after one).
    texts = [t for seed in range(40) if len(parse_reply(t := walk(vocab, fmt, req, seed, 3), fmt, parse_tools=True,
                                                         reasoning=False, tools=req).tool_calls) >= want][:2]
    assert len(texts) == 2, fmt.name
    for text in texts:
        whole = parse_reply(text, fmt, parse_tools=True, reasoning=False, tools=req)
        assert whole.content == "", (fmt.name, text)
        everything = [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
        counts = []
        for k in range(len(text) + 1):
            content, calls = read_cut(fmt, req, text[:k])
            assert content.strip() == "", (fmt.name, k, text[:k], content)  # never call syntax as text
            assert calls == everything[: len(calls)], (fmt.name, k, text[:k], calls)  # whole calls, in order
            counts.append(len(calls))
        assert counts == sorted(counts) and counts[-1] == len(everything), (fmt.name, counts)
        # Cut in its last call, a reply keeps every call before it.
        assert counts[-2] >= len(everything) - 1, (fmt.name, text, counts[-5:])


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_a_named_tool_is_exactly_one_call(vocab: Any, fmt: ToolFormat) -> None:
    req = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "tool_1"}}})
    assert req is not None
    for seed in range(2):
        # The walk would write three calls if the grammar let it: it ends after one.
        text = walk(vocab, fmt, req, seed, 3)
        whole = parse_reply(text, fmt, parse_tools=True, reasoning=False, tools=req)
        assert [c.name for c in whole.tool_calls] == ["tool_1"] and whole.content == "", (fmt.name, text)
