"""Grammars on llama.cpp: the compile of GBNF on the GPU worker (llama.cpp's grammar
sampler), the bounded cache of compiled grammars, and (llama/schema.py) the JSON-schema converter.

What a request's constraint becomes as GBNF is decided in ``engine/chat/grammar.py`` (pure);
``GrammarCache.compile`` parses that text with llama.cpp once (on the worker) and keeps the
parsed grammar as a template; each request's sampler clones it, so the same schema twice is
converted once and parsed once.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llama_cpp
from llama_cpp.llama_grammar import JSON_GBNF

from ...wire.errors import ParamError

if TYPE_CHECKING:
    from .guidance import GuidanceCache

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

    def __init__(self, vocab: Any, pieces: list[bytes], guidance: GuidanceCache, capacity: int = GRAMMAR_CACHE_SIZE) -> None:
        self._vocab = vocab
        self.pieces = pieces  # each token's bytes: constrained text is also kept valid UTF-8
        self.guidance = guidance  # a client's own GBNF runs there (grammar_engine "llguidance")
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
