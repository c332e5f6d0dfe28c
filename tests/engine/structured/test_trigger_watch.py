"""A lazy grammar's trigger is searched in a bounded window (structured/triggers.py
TriggerWatch, issue 40): llama.cpp ran each trigger's regex over the whole reply after every
token, so a token cost more as the reply grew, and ``^\\s*(...)$`` overflowed std::regex's stack
past ~25,000 leading whitespace characters. The watch must fire at the token the whole-text
search fires at, with the text from where its match starts (what the grammar is fed); and
the sampler must then hold the grammar."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.engine.chat import parse_tools
from hydra_trio.engine.chat.call_grammar import tool_triggers, tools_grammar
from hydra_trio.engine.chat.formats import FORMATS, GENERIC
from hydra_trio.engine.sample import Sampler, SamplingParams
from hydra_trio.engine.structured import TriggerWatch

_TOOL_0 = parse_tools(
    {"tools": [{"type": "function", "function": {"name": "tool_0", "parameters": {"type": "object"}}}]}
)
assert _TOOL_0 is not None
# Each format's triggers, and the per-tool ones (Muse Glimmer's) for a tool named tool_0.
HERMES = FORMATS["hermes"]
PATTERNS = tuple(t.pattern for fmt in FORMATS.values() for t in (*fmt.triggers, *tool_triggers(fmt, _TOOL_0)))
# Pieces that build triggers, near-misses, whitespace and filler, in any order.
PIECES = sorted(
    {
        " ",
        "\n",
        "  ",
        "x",
        "Hi ",
        "{",
        '"',
        "tool",
        "_calls",
        '{"tool_calls"',
        "<tool_call>",
        "<tool",
        "_call>",
        "<|python_tag|>",
        "[TOOL_CALLS]",
        "\n{",
        '"name',
        "é",
        "\t",
        " to=",
        "tool_0",
        "self",
        "<|message|>",
        "<atem:",
    }
)


def whole_text_fire(patterns: tuple[str, ...], pieces: list[bytes]) -> tuple[int, bytes] | None:
    """llama.cpp's rule on the whole buffer (the reference): after each token, each pattern
    searched in everything so far; on a match, the text from its first non-empty group on."""
    regexes = [re.compile(p.encode().decode("latin-1")[:-1] + r"\Z", re.ASCII) for p in patterns]
    text = ""
    for i, piece in enumerate(pieces):
        text += piece.decode("latin-1")
        for rx in regexes:
            m = rx.search(text)
            if m is not None:
                group = next((g for g in range(1, rx.groups + 1) if m.group(g)), 0)
                return i, text[m.start(group):].encode("latin-1")
    return None


def watch_fire(patterns: tuple[str, ...], pieces: list[bytes], max_piece: int) -> tuple[int, bytes] | None:
    watch = TriggerWatch(patterns, max_piece)
    for i, piece in enumerate(pieces):
        fed = watch.push(piece)
        if fed is not None:
            assert watch.fired
            return i, fed
    assert not watch.fired
    return None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=300), st.integers(0, len(PATTERNS) - 1))
def test_the_watch_fires_where_the_whole_text_search_fires(chosen: list[str], which: int) -> None:
    pieces = [p.encode() for p in chosen]
    patterns = (PATTERNS[which],)
    assert watch_fire(patterns, pieces, max(map(len, pieces), default=1)) == whole_text_fire(patterns, pieces)


def test_long_free_text_and_long_leading_whitespace() -> None:
    hermes, generic = HERMES.triggers[0].pattern, GENERIC.triggers[0].pattern
    # 20,000 tokens of free text, then the trigger over two tokens: only its text is fed.
    pieces = [b"word "] * 20_000 + [b"<tool", b"_call>", b"\n{"]
    assert watch_fire((hermes,), pieces, 8) == (20_001, b"<tool_call>")
    # 30,000 spaces, then an at-start trigger: it still fires (the spaces are whitespace) ...
    pieces = [b" "] * 30_000 + [b'{"tool_calls"']
    assert watch_fire((generic,), pieces, 16) == (30_000, b'{"tool_calls"')
    # ... but not after any other text, however far back it left the window.
    assert watch_fire((generic,), [b"x"] + [b" "] * 30_000 + [b'{"tool_calls"'], 16) is None


async def test_the_sampler_triggers_after_30k_spaces_and_then_holds_the_grammar(engine: Any) -> None:
    """Through the real lazy grammar: 30,000 leading spaces (past where llama.cpp's regex over
    the whole buffer overflowed its stack), then the generic format's at-start trigger; from
    then on a token the grammar refuses is replaced by one it allows."""
    eng = engine.state.engine
    backend = eng._core.backend
    grammars = eng._core.inputs.grammars
    req = parse_tools({"tools": [{"type": "function", "function": {"name": "tool_0", "parameters": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}]})
    assert req is not None
    grammar = tools_grammar(req, GENERIC)
    assert grammar.triggers and grammar.triggers[0].startswith("^")

    def run() -> str:
        grammars.compile(grammar)
        sampler = Sampler(SamplingParams(grammar=grammar), grammars=grammars)
        eog = np.fromiter(sorted(backend.eog_ids), dtype=np.intp)
        n_vocab = backend.info.n_vocab
        out = bytearray()

        def favour(token: int) -> int:
            logits = np.zeros(n_vocab, dtype=np.float32)
            logits[token] = 10.0
            picked = sampler.sample(logits, eog)
            out.extend(backend.token_bytes(picked))
            return picked

        try:
            space = backend.tokenize(" ", add_special=False, parse_special=False)[-1]
            assert backend.token_bytes(space) == b" "
            for _ in range(30_000):
                assert favour(space) == space  # free text: anything goes
            for token in backend.tokenize('{"tool_calls"', add_special=False, parse_special=False):
                assert favour(token) == token
            forced = backend.tokenize("Z", add_special=False, parse_special=False)[-1]
            for _ in range(12):
                assert favour(forced) != forced  # the grammar holds now
        finally:
            backend.retire(sampler)
        return out.decode()

    text = await eng._core.worker.call(run)
    trigger = GENERIC.triggers[0]
    reply = text.lstrip(" ")  # (the trigger's tokens may start with a space of their own)
    assert len(text) - len(reply) >= 30_000 and reply.startswith(trigger.text)
    after, expected = reply[len(trigger.text):], trigger.then + "tool_0"
    assert after.startswith(expected) or expected.startswith(after), after
