"""OpenAI's logprobs shapes from the engine's TokenLogprobs (engine/sample/token_logprobs.py):
chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` and text completions' legacy
``{tokens, token_logprobs, top_logprobs, text_offset}``. The values are the model's raw
distribution at each position (before temperature and the other sampler transforms)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from ...engine import TokenLogprobs, Vocabulary

# JSON has no -Infinity: a token the model rules out (a -inf logit) reads as OpenAI's floor.
_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if value > _FLOOR else _FLOOR


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", "replace")


def _chat_token(vocab: Vocabulary, token: int, logprob: float) -> dict[str, Any]:
    piece = vocab.special_piece(token)
    return {"token": _text(piece), "logprob": _lp(logprob), "bytes": list(piece)}


def chat_logprobs(vocab: Vocabulary, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion, or of one chunk of its stream."""
    return {
        "content": [
            {
                **_chat_token(vocab, e.token, e.logprob),
                "top_logprobs": [_chat_token(vocab, t, lp) for t, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


class CompletionLogprobs:
    """Text completions' ``logprobs`` for successive runs of tokens (a stream's chunks, or the
    whole completion at once): ``text_offset`` is each token's character offset in the
    completion text, counted on across calls. Each dict of ``top_logprobs`` holds the N most
    likely tokens and the sampled one (up to N + 1, as OpenAI's legacy API)."""

    def __init__(self, vocab: Vocabulary, *, token_ids: bool = False) -> None:
        self._vocab = vocab
        # vLLM's return_tokens_as_token_ids: each token named "token_id:N" (text that does not
        # decode alone, such as a byte token, cannot be told apart otherwise).
        self._name = (lambda t: f"token_id:{t}") if token_ids else (lambda t: _text(vocab.special_piece(t)))
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # as the text's
        self._offset = 0

    def echo(self, tokens: Sequence[int], scores: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """An echoed prompt's part: its first token has no logprob (null, as vLLM), each
        other token's ``scores`` entry (engine scoring: given the tokens before it)."""
        vocab = self._vocab
        first = {"tokens": [self._name(tokens[0])], "token_logprobs": [None], "top_logprobs": [None],
                 "text_offset": [self._offset]}
        self._offset += len(self._decoder.decode(vocab.token_bytes(tokens[0])))
        return self.merge(first, self.take(scores))

    @staticmethod
    def merge(*parts: dict[str, Any]) -> dict[str, Any]:
        """Runs of ``take`` (or ``echo``) one after the other, as one."""
        return {
            key: [x for part in parts for x in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }

    def take(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        vocab = self._vocab
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top_logprobs: list[dict[str, float]] = []
        text_offset: list[int] = []
        for e in entries:
            tokens.append(self._name(e.token))
            token_logprobs.append(_lp(e.logprob))
            top = {self._name(t): _lp(lp) for t, lp in e.top}
            top.setdefault(tokens[-1], _lp(e.logprob))
            top_logprobs.append(top)
            text_offset.append(self._offset)
            self._offset += len(self._decoder.decode(vocab.token_bytes(e.token)))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }
