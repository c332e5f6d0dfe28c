"""Every output grammar runs on llguidance: compiled once per vocabulary and kept
(``GuidanceCache``), one state per request (``GuidanceState``).

Why llguidance: its Earley parser bounds each token's work (``LIMITS``), so no grammar holds
the step loop (llama.cpp's grammar sampler expanded an ambiguous client grammar for 265 s of
every stream's time); it compiles JSON Schema itself (``%json`` inside Lark), so the engine
keeps no converter of its own; compile and mask computation release the GIL. Measured on
the 2-core VM with Gemma 3's 262k vocabulary: with ``step_max_items`` 20000 and
``step_lexer_fuel`` 100000 an ambiguous grammar's worst token took 42-67 ms before the grammar
ended itself ("Too many items"); ``max_items_in_row`` is raised so a grammar of 20,000
alternatives (one row) runs.

The tokenizer view (vocab_view.py) is built once per model, off the GPU worker and the trio
thread (``warm``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence

import llguidance
import numpy as np

from ...wire.errors import ParamError
from .grammars import OutputGrammar
from .schema_policy import checked
from .vocab_view import guidance_tokenizer

log = logging.getLogger("hydra_trio.structured")

# Per token: at most this many Earley items, this much lexer work (see the module docstring).
LIMITS = {"step_max_items": 20_000, "step_lexer_fuel": 100_000, "max_items_in_row": 50_000}
MATCHER_CACHE_SIZE = 64  # compiled grammars kept per model (each request gets a copy)
# Compiled grammars' text kept per model at most: a compiled grammar's size follows its text
# (descriptions are not in it: schema_policy.py), so this bounds the cache's memory too.
MATCHER_CACHE_BYTES = 16 << 20
UNREADABLE = "llguidance cannot run the grammar"
UNSATISFIABLE = "Unsatisfiable schema:"


class GrammarError(ParamError):
    """A grammar llguidance could not compile or run: a 400 naming its problem."""


class GuidanceCache:
    """llguidance grammars of one model's vocabulary: the tokenizer view (vocab_view.py, built
    on first use or ``warm``) and the most recently used compiled grammars, bounded
    by MATCHER_CACHE_SIZE and MATCHER_CACHE_BYTES. ``compile`` may run on any thread but the
    trio thread (a large grammar takes up to a second); ``new_state`` is cheap."""

    def __init__(self, pieces: Sequence[bytes], eog_ids: Collection[int], bos: int | None) -> None:
        self._make_tokenizer = lambda: guidance_tokenizer(pieces, eog_ids, bos)
        # Each token's bytes as the grammar reads them (control tokens spelled out): what a
        # lazy grammar's trigger is searched in.
        self.pieces = pieces
        self.max_piece = max(map(len, pieces), default=1)
        self.n_vocab = len(pieces)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # one tokenizer build, one cache update at a time
        self._matchers: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._bytes = 0
        self.compiles = 0  # grammars compiled (a test counts them)

    def warm(self) -> None:
        """Build the tokenizer view now (a second for a large vocabulary): at load, so the
        first constrained request does not wait for it."""
        self.tokenizer()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def known(self, grammar: OutputGrammar) -> bool:
        return (grammar.syntax, grammar.text) in self._matchers

    def compile(self, grammar: OutputGrammar) -> None:
        """Compile ``grammar`` and keep it (a GrammarError, a 400 naming llguidance's problem
        and the key it came from, when it cannot be)."""
        self._matcher(grammar)

    def new_state(self, grammar: OutputGrammar) -> GuidanceState:
        """A fresh state of ``grammar`` for one request."""
        return GuidanceState(self._matcher(grammar).deep_copy(), self.n_vocab, grammar.param, self.tokenizer())

    def _matcher(self, grammar: OutputGrammar) -> llguidance.LLMatcher:
        key = (grammar.syntax, grammar.text)
        with self._lock:
            found = self._matchers.get(key)
            if found is not None:
                self._matchers.move_to_end(key)
                return found
        tokenizer = self.tokenizer()
        try:
            text = checked(lambda: llguidance.grammar_from(grammar.syntax, grammar.text))
            matcher = checked(
                lambda: llguidance.LLMatcher(tokenizer, text, log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
            )
        except ValueError as exc:
            raise GrammarError(f"{grammar.param}: {UNREADABLE}: {_first_line(str(exc))}", grammar.param) from None
        self.compiles += 1
        if matcher.is_error():
            param, problem = _culprit(grammar, tokenizer) or (grammar.param, matcher.get_error())
            raise GrammarError(f"{param}: {_said(problem, grammar.syntax)}", param)
        relaxed = [*grammar.relaxed, *(_first_line(w) for w in matcher.get_grammar_warnings())]
        if relaxed:  # the schema policy's relaxations, said once per compiled grammar
            log.info("%s: not enforced (relaxed): %s", grammar.param, "; ".join(relaxed))
        with self._lock:
            if key not in self._matchers:
                self._matchers[key] = matcher
                self._bytes += len(grammar.text)
            while len(self._matchers) > MATCHER_CACHE_SIZE or (
                self._bytes > MATCHER_CACHE_BYTES and len(self._matchers) > 1
            ):
                (_, old), _ = self._matchers.popitem(last=False)
                self._bytes -= len(old)
        return matcher


class GuidanceState:
    """One request's grammar state: what the sampler asks of it (does it allow this token,
    which tokens may come next, take this token, take this text) and the error that ended it
    (``failure``: a grammar past LIMITS; the request ends with it)."""

    def __init__(
        self, matcher: llguidance.LLMatcher, n_vocab: int, param: str, tokenizer: llguidance.LLTokenizer
    ) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._tokenizer = tokenizer
        self.param = param
        self._mask = np.zeros((n_vocab + 31) // 32, dtype=np.uint32)

    @property
    def failure(self) -> str | None:
        if not self._matcher.is_error():
            return None
        return (
            f"{self.param}: the grammar is too complex for the engine's per-token bound "
            f"({_first_line(self._matcher.get_error())})"
        )

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

    def feed(self, text: bytes) -> bool:
        """Take text the grammar starts with (a lazy trigger's match); False when the grammar
        refuses it."""
        tokens = self._tokenizer.tokenize_bytes(text)
        return self._matcher.consume_tokens(tokens) and not self._matcher.is_error()


def _culprit(grammar: OutputGrammar, tokenizer: llguidance.LLTokenizer) -> tuple[str, str] | None:
    """The first of a failed grammar's schemas that fails alone: (its key, the error)."""
    for param, expr in grammar.parts:
        try:
            is_error, messages = checked(lambda: llguidance.LLMatcher.validate_grammar_with_warnings(
                llguidance.LLMatcher.grammar_from_lark("start: " + expr), tokenizer  # noqa: B023 (called at once)
            ))
        except ValueError as exc:
            return param, str(exc)
        if is_error:
            return param, messages[0] if messages else "refused"
    return None


def _said(problem: str, syntax: str) -> str:
    """llguidance's error as a client reads it: a schema no value satisfies said so; a
    client's own grammar it cannot run named as llguidance's."""
    line = _first_line(problem)
    if UNSATISFIABLE in line:
        return "no value can satisfy the schema: " + line.split(UNSATISFIABLE, 1)[1].strip()
    line = line.split("failed to compile JSON schema: ", 1)[-1]
    return f"{UNREADABLE}: {line}" if syntax == "gbnf" else line


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "grammar error"
