"""The vocabulary of LlamaBackend's model (context.py) as tokens and text: tokenizing, each
token's piece read once at load (as generated text, and spelled out for control tokens), the
end-of-generation tokens, and the views the engine reads them through (``vocabulary``,
``text_of``).

Kept apart from the context because it changes with the tokenizer, not with the context's
lifecycle. It uses the context's attributes, declared here and set by LlamaBackend.
``tokenize`` runs on the GPU worker; what load reads here is read on any thread after.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import llama_cpp
import numpy as np

from .types import ModelInfo, Vocabulary


class VocabTokens:
    """The tokens half of LlamaBackend."""

    _vocab: llama_cpp.llama_vocab_p
    info: ModelInfo

    def _read_tokens(self) -> None:
        """Read the vocabulary's pieces and end-of-generation ids (at load, on the worker)."""
        # Text pieces and end-of-generation ids of the whole vocabulary, read once here (on
        # the GPU worker) so the token loop needs no llama call on the trio thread.
        self.pieces: list[bytes] = [self._piece(t) for t in range(self.info.n_vocab)]
        # The few tokens (control tokens) whose spelled-out text differs: with these, showing
        # tokens (/tokenize pieces, /detokenize) needs no llama call and no GPU worker.
        self._special_text = {
            t: special for t in range(self.info.n_vocab) if (special := self._piece(t, special=True)) != self.pieces[t]
        }
        self.eog_ids = frozenset(t for t in range(self.info.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t))
        self._eog_index = np.fromiter(sorted(self.eog_ids), dtype=np.intp)  # ignore_eos masks these
        # Each token's bytes as a grammar reads them: control tokens spelled out, as llama.cpp's
        # grammars read them (so a template's markup matches its grammar's literals whether
        # the model writes it as one special token or as text pieces).
        self.grammar_pieces = [self._special_text.get(t, piece) for t, piece in enumerate(self.pieces)]

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        arr = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), arr, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            arr = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), arr, n_max, add_special, parse_special)
        return list(arr[:n])

    def _piece(self, token: int, *, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    @property
    def vocabulary(self) -> Vocabulary:
        """The vocabulary as text (special pieces, detokenize), for any thread."""
        return Vocabulary(self.pieces, self._special_text, self.info.roles)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a generated token contributes to the text (control tokens: none)."""
        return self.pieces[token]

    def text_of(self, shown: frozenset[int]) -> Callable[[int], bytes]:
        """``token_bytes``, with the control tokens in ``shown`` spelled out (a chat
        template's syntax tokens: the reply parser reads their text)."""
        if not shown:
            return self.token_bytes
        special, pieces = self._special_text, self.pieces
        return lambda token: special[token] if token in shown else pieces[token]

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids
