"""Grammars on llama.cpp: the compile of GBNF on the GPU worker (llama.cpp's grammar
sampler), the bounded cache of compiled grammars, and (llama/schema.py) the JSON-schema converter.

What a request's constraint becomes as GBNF is decided in ``engine/chat/grammar.py`` (pure);
``GrammarCache.compile`` parses that text with llama.cpp once (on the worker) and keeps the
parsed grammar as a template; each request's sampler clones it, so the same schema twice is
converted once and parsed once.

A client's own GBNF (``grammar``) runs on llguidance instead (``GuidanceCache``, below).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import llama_cpp
import llguidance
import numpy as np
from llama_cpp.llama_grammar import JSON_GBNF

from ...wire.errors import ParamError

MAX_GBNF_CHARS = 256 * 1024  # llama.cpp parses grammars recursively: bound what it is given
# Parentheses deep: llama.cpp's parser recurses once per level and a grammar nested ~100k
# deep overflows the worker's stack (the process dies); 10k parsed fine when measured.
MAX_GBNF_NESTING = 1000
GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per model

Triggers = tuple[str, ...]  # a lazy grammar's trigger patterns; (): a grammar from the first token

# llama.cpp's JSON grammar (grammars/json.gbnf): any JSON object, for json_object mode.
JSON_OBJECT_GBNF = JSON_GBNF.strip() + "\n"
class GrammarError(ParamError):
    """A grammar llama.cpp could not parse: a 400 naming its problem."""


class GrammarCache:
    """Compiled grammars of one model's vocabulary, most recently used kept (a bounded LRU
    keyed by the GBNF text and the lazy triggers). ``compile`` and ``new_state`` run on the
    GPU worker only; ``known`` may be asked from any thread (one dict lookup)."""

    def __init__(
        self, vocab: Any, pieces: list[bytes], special: Mapping[int, bytes], eog_ids: Sequence[int],
        capacity: int = GRAMMAR_CACHE_SIZE,
    ) -> None:
        self._vocab = vocab
        self.pieces = pieces  # each token's bytes: constrained text is also kept valid UTF-8
        # Each token as llama.cpp's grammar reads it (control tokens spelled out): what a lazy
        # grammar's trigger is searched in (TriggerWatch).
        self.grammar_pieces = [special.get(t, piece) for t, piece in enumerate(pieces)]
        self.max_piece = max(map(len, self.grammar_pieces), default=1)
        self.guidance = GuidanceCache(vocab, pieces, special, eog_ids)  # a client's own GBNF runs there
        self._capacity = capacity
        self._templates: OrderedDict[tuple[str, Triggers], _Template] = OrderedDict()
        self.compiles = 0  # llama.cpp parses done (a test counts them)

    def known(self, gbnf: str, triggers: Triggers = ()) -> bool:
        return (gbnf, triggers) in self._templates

    def compile(self, gbnf: str, param: str = "grammar", triggers: Triggers = ()) -> None:
        """Parse ``gbnf`` with llama.cpp and keep it; a GrammarError naming what llama.cpp
        said when it cannot parse it. ``triggers``: a lazy grammar's patterns
        (``trigger_pattern``). Worker only."""
        self._template(gbnf, triggers, param)

    def new_state(self, gbnf: str, triggers: Triggers = ()) -> llama_cpp.llama_sampler_p:
        """A fresh grammar sampler for one request (the caller frees it). Worker only."""
        state = llama_cpp.llama_sampler_clone(self._template(gbnf, triggers, "grammar").ptr)
        if not state:
            raise RuntimeError("llama.cpp could not clone a grammar sampler")
        return state

    def _template(self, gbnf: str, triggers: Triggers, param: str) -> _Template:
        key = (gbnf, triggers)
        template = self._templates.get(key)
        if template is not None:
            self._templates.move_to_end(key)
            return template
        ptr, said = _with_stderr(lambda: self._init(gbnf, triggers), gbnf)
        self.compiles += 1
        if not ptr:
            raise GrammarError(f"{param}: llama.cpp cannot parse the grammar: {_problem(said)}", param)
        template = _Template(ptr)
        self._templates[key] = template
        while len(self._templates) > self._capacity:
            self._templates.popitem(last=False)  # freed once no sampler still clones from it
        return template

    def _init(self, gbnf: str, triggers: Triggers) -> llama_cpp.llama_sampler_p:
        if not triggers:
            return llama_cpp.llama_sampler_init_grammar(self._vocab, gbnf.encode(), b"root")
        # Lazy: the grammar passes every token until a pattern matches (llama.cpp compiles
        # each as a std::regex; ours come from trigger_pattern only, never from a request).
        patterns = (ctypes.c_char_p * len(triggers))(*(t.encode() for t in triggers))
        return llama_cpp.llama_sampler_init_grammar_lazy_patterns(
            self._vocab, gbnf.encode(), b"root", patterns, len(triggers), None, 0
        )


class TriggerWatch:
    """Whether a lazy grammar's trigger has appeared in what a request generated, checked
    over a bounded window of the text instead of all of it.

    llama.cpp's lazy grammar appends every token's text to a buffer and runs each trigger's
    std::regex over the whole buffer after each token: a reply's tokens cost more as it grows
    (5.8 -> 10.8 ms a token over 3,500 tokens with tool_choice auto, against 4.95 -> 8.9 with
    none), and ``^\\s*(...)$`` overflowed std::regex's stack past ~25,000 leading whitespace
    characters. The sampler keeps its lazy grammar out of the loop while this watch waits,
    and when the trigger appears hands llama.cpp a fresh lazy state and only the tokens from
    the one the match starts in: llama.cpp finds the same match in that short text and feeds
    its grammar exactly what it would have fed from the whole buffer.

    Why a window is enough, for the patterns ``engine/chat/grammar.py`` writes (literals and
    optional literal tails, anchored at the end): a match ends at the buffer's end and is at
    most as long as its pattern, so it lies in the last ``window`` characters; a ``^\\s*``
    pattern also needs everything before the match to be whitespace, which is checked as
    text leaves the window (once anything else leaves, it can never match). The text is
    bytes read as Latin-1, and ``\\s`` is ASCII's, as std::regex reads a std::string.
    """

    def __init__(self, patterns: Triggers, max_piece: int) -> None:
        as_bytes = [p.encode().decode("latin-1") for p in patterns]  # a literal's UTF-8 bytes, as std::regex sees them
        self._searches = [re.compile(p[:-1] + r"\Z" if p.endswith("$") else p, re.ASCII) for p in as_bytes]
        self._at_start = [p.startswith("^") for p in as_bytes]
        self._window = max(map(len, as_bytes), default=0) + 2 * max_piece
        self._text = ""  # the last part of the generated text (Latin-1), from offset _base
        self._base = 0
        self._spans: list[tuple[int, int, int]] = []  # (token, start, end) of tokens reaching the window
        self._only_space = True  # everything that left the window was whitespace
        self.fired = False

    def push(self, token: int, piece: bytes) -> list[int] | None:
        """Take the next generated token; the tokens to replay into a fresh lazy grammar
        state when the trigger appears with it (from the one its match starts in), else None."""
        start = self._base + len(self._text)
        self._text += piece.decode("latin-1")
        self._spans.append((token, start, start + len(piece)))
        for search, at_start in zip(self._searches, self._at_start, strict=True):
            if at_start and not self._only_space:
                continue
            found = search.search(self._text)
            if found is not None:
                self.fired = True
                group = next((i for i in range(1, (found.re.groups or 0) + 1) if found.group(i)), 0)
                begin = self._base + found.start(group)
                return [t for t, _, end in self._spans if end > begin]
        if len(self._text) > 2 * self._window:  # trim now and then: amortised O(1) a character
            cut = len(self._text) - self._window
            if self._only_space and self._text[:cut].strip(" \t\n\r\f\v"):
                self._only_space = False
            self._text, self._base = self._text[cut:], self._base + cut
            self._spans = [s for s in self._spans if s[2] > self._base]
        return None


class _Template:
    """A parsed grammar sampler, freed when the last reference goes (a request that looked
    it up may clone it after the cache dropped it)."""

    def __init__(self, ptr: llama_cpp.llama_sampler_p) -> None:
        self.ptr = ptr
        weakref.finalize(self, llama_cpp.llama_sampler_free, ptr)


def _problem(said: str) -> str:
    """The line of llama.cpp's output that names the problem."""
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    for line in lines:
        if "error parsing grammar:" in line:
            return line.split("error parsing grammar:", 1)[1].strip()
    for line in lines:
        if "grammar" in line and line != "failed to parse grammar":
            return line
    return "syntax error"


_stderr_lock = threading.Lock()


def _with_stderr(fn: Any, gbnf: str) -> tuple[Any, str]:
    """Run a llama call and return what it printed: the grammar parser writes its errors to
    fd 2 (fprintf), not through llama's log callback. The client is told the problem (a 400),
    so the parser's report (with the grammar echoed) is not printed; anything else printed
    meanwhile, by any thread, is written back to stderr."""
    from .log import captured

    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            try:
                result, lines = captured(fn)
            finally:
                os.dup2(saved, 2)
        finally:
            os.close(saved)
        tmp.seek(0)
        printed = tmp.read().decode("utf-8", "replace")
    rest = [
        line
        for line in printed.replace(gbnf, "").splitlines(keepends=True)
        if line.strip() and "parsing grammar" not in line and "failed to parse grammar" not in line
    ]
    if rest:
        sys.stderr.write("".join(rest))
    return result, printed + "".join(lines)


# ---- a client's GBNF on llguidance ---------------------------------------------------
# A client's own GBNF (``grammar``) on llguidance instead of llama.cpp's grammar engine.
#
# llama.cpp's grammar sampler expands its parse stacks inside one C call per token with no
# bound: an ambiguous grammar (``s ::= "a" s p | "a" s q | ""``) held the step loop, and every
# other stream, for 265 s. llguidance's Earley parser bounds each token's work
# (``LIMITS``): a grammar past the bound ends its own request with a clear error, and the
# step goes on. Measured on the 2-core VM, Gemma 3 270M's 262k vocabulary, the ambiguous
# grammar above: llguidance's default limits let one token's mask take 346 ms; with
# ``step_max_items`` 20000 and ``step_lexer_fuel`` 100000 the worst token took 42-67 ms before
# the grammar ended itself (997 tokens, "Current row has 2001 items"). Both its compile and
# its mask computation release the GIL.
#
# The grammars the engine builds itself (schemas, tools, json_object) stay on llama.cpp's
# engine: they are not ambiguous, they compile in under 0.1 ms, and their lazy triggers
# (tool_choice auto) are llama.cpp's. Only text a client wrote goes here.
#
# The tokenizer view llguidance needs (each token's bytes, control tokens marked) is built
# once per model on first use, off the GPU worker (1.5 s for 262k tokens; it releases the GIL).

# Per token: at most this many Earley items, this much lexer work (see above).
LIMITS = {"step_max_items": 20_000, "step_lexer_fuel": 100_000}
MATCHER_CACHE_SIZE = 32  # compiled grammars kept per model (each request gets a copy)


class GuidanceCache:
    """llguidance grammars of one model's vocabulary: the tokenizer view, built on first use,
    and the last MATCHER_CACHE_SIZE compiled grammars. ``compile`` may run on any thread but
    the trio thread (it takes up to a second for a large grammar); ``new_state`` is cheap."""

    def __init__(self, vocab: Any, pieces: Sequence[bytes], special: Mapping[int, bytes], eog_ids: Sequence[int]) -> None:
        self._vocab = vocab
        self._pieces = pieces
        self._special = special
        self._eog_ids = sorted(eog_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # one tokenizer build, one cache update at a time
        self._matchers: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def known(self, gbnf: str) -> bool:
        return gbnf in self._matchers

    def compile(self, gbnf: str, param: str = "grammar") -> None:
        """Compile ``gbnf`` (a GrammarError, a 400 naming llguidance's problem, when it cannot)."""
        self._matcher(gbnf, param)

    def new_state(self, gbnf: str, param: str = "grammar") -> GuidanceState:
        """A fresh grammar state for one request."""
        return GuidanceState(self._matcher(gbnf, param).deep_copy(), len(self._pieces))

    def _matcher(self, gbnf: str, param: str) -> llguidance.LLMatcher:
        with self._lock:
            found = self._matchers.get(gbnf)
            if found is not None:
                self._matchers.move_to_end(gbnf)
                return found
            tokenizer = self._tokenizer_locked()
        try:
            grammar = llguidance.grammar_from("gbnf", gbnf)
        except ValueError as exc:
            raise GrammarError(f"{param}: cannot parse the grammar: {_first_line(str(exc))}", param) from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise GrammarError(f"{param}: cannot parse the grammar: {_first_line(matcher.get_error())}", param)
        with self._lock:
            self._matchers[gbnf] = matcher
            while len(self._matchers) > MATCHER_CACHE_SIZE:
                self._matchers.popitem(last=False)
        return matcher

    def _tokenizer_locked(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            # Control tokens carry a 0xFF prefix: llguidance then never matches them as text.
            tokens = [b"\xff" + self._special[t] if t in self._special else piece for t, piece in enumerate(self._pieces)]
            tokenize = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
            self._tokenizer = llguidance.LLTokenizer.from_llamacpp(
                tokens=tokens, vocab_ptr=self._vocab, tokenize_fptr=tokenize, eos_token=self._eog_ids, slices=None
            )
        return self._tokenizer


class GuidanceState:
    """One request's llguidance matcher: the same questions the sampler asks llama.cpp's
    grammar (does it allow this token, which tokens may come next, take this token), and the
    error that ended it (``failure``: a grammar past LIMITS; the request ends with it)."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._mask = np.zeros((n_vocab + 31) // 32, dtype=np.uint32)

    @property
    def failure(self) -> str | None:
        return _first_line(self._matcher.get_error()) if self._matcher.is_error() else None

    def allows(self, token: int) -> bool:
        return self._matcher.validate_tokens([token]) == 1

    def allowed(self) -> np.ndarray:
        """Which tokens may come next, one bool per token of the vocabulary (none once it
        failed)."""
        self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if self._matcher.is_error():
            return np.zeros(self._n_vocab, dtype=bool)
        return np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self._n_vocab].astype(bool)

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "grammar error"
