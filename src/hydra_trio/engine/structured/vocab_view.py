"""The vocabulary as llguidance reads it. Each token is its bytes, with control tokens
spelled as their text, as llama.cpp's own grammars read them: a template's markup
(``<tool_call>``, ``<|python_tag|>``) then matches a grammar's literal whether the model writes
it as one special token or as pieces (llama-server's ``preserved_tokens``). End-of-generation
tokens (llguidance's EOS) and BOS carry a 0xFF prefix instead: never text, so no grammar
matches them inside a string.

Text the grammar is fed (a lazy trigger's match, llguidance's forced bytes) is tokenized here
by the longest token that spells its next bytes: byte-faithful by construction. The model's
own tokenizer is not: a SentencePiece vocabulary reads U+2581 as its space marker, so
``llama_tokenize`` turned DeepSeek's ``<｜tool▁call▁begin｜>`` into tokens spelling spaces, and
llguidance, trusting them, broke the grammar mid-call."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import llguidance


class _ByteTokenizer:
    """What llguidance's TokenizerWrapper asks of a tokenizer: the tokens' bytes, EOS/BOS,
    and bytes -> tokens."""

    def __init__(self, tokens: list[bytes], eos: int, bos: int | None) -> None:
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = bos
        self.special_token_ids: list[int] = []
        self._ids: dict[bytes, int] = {}
        for t, piece in enumerate(tokens):
            if piece and not piece.startswith(b"\xff"):
                self._ids.setdefault(piece, t)  # the first token of a spelling, as a vocabulary lists it
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: bytes) -> list[int]:
        out: list[int] = []
        i, n = 0, len(text)
        while i < n:
            for size in range(min(self._longest, n - i), 0, -1):
                token = self._ids.get(text[i:i + size])
                if token is not None:
                    out.append(token)
                    i += size
                    break
            else:
                raise ValueError(f"no token spells byte {text[i]:#04x}")
        return out


def guidance_tokenizer(
    grammar_pieces: Sequence[bytes], eog_ids: Collection[int], bos: int | None
) -> llguidance.LLTokenizer:
    """The tokenizer view of a vocabulary (built once per model: about a second for 262k
    tokens). ``grammar_pieces``: each token's bytes, control tokens spelled out."""
    unshown = set(eog_ids) | ({bos} if bos is not None and bos >= 0 else set())
    tokens = [b"\xff" + piece if t in unshown else piece for t, piece in enumerate(grammar_pieces)]
    eos = sorted(eog_ids)
    wrapper = llguidance.TokenizerWrapper(_ByteTokenizer(tokens, eos[0] if eos else 0, bos))
    return llguidance.LLTokenizer(wrapper, n_vocab=len(tokens), eos_token=eos, slices=None)
