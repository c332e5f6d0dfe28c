"""A request's own GBNF (``grammar``) on llguidance instead of llama.cpp's grammar engine.

llama.cpp's grammar sampler expands its parse stacks inside one C call per token with no
bound: an ambiguous grammar (``s ::= "a" s p | "a" s q | ""``) held the step loop, and every
other stream, for 265 s. llguidance's Earley parser bounds each token's work
(``LIMITS``): a grammar past the bound ends its own request with a clear error, and the
step goes on. Measured on the 2-core VM, Gemma 3 270M's 262k vocabulary, the ambiguous
grammar above: llguidance's default limits let one token's mask take 346 ms; with
``step_max_items`` 20000 and ``step_lexer_fuel`` 100000 the worst token took 42-67 ms before
the grammar ended itself (997 tokens, "Current row has 2001 items"). Both its compile and
its mask computation release the GIL.

The grammars the engine builds itself (schemas, tools, json_object) stay on llama.cpp's
engine: they are not ambiguous, they compile in under 0.1 ms, and their lazy triggers
(tool_choice auto) are llama.cpp's. Only text a client wrote goes here.

The tokenizer view llguidance needs (each token's bytes, control tokens marked) is built
once per model on first use, off the GPU worker (1.5 s for 262k tokens; it releases the GIL).
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import llama_cpp
import llguidance
import numpy as np

from .grammar import GrammarError

# Per token: at most this many Earley items, this much lexer work (see the module docstring).
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
