"""Log-probabilities of sampled tokens, for requests that ask for them (OpenAI ``logprobs``).

Pure numpy, importable without llama_cpp. The distribution is the model's own: the
log-softmax of the raw logits at the sampled position, before any sampler transform
(temperature, top-k/p, min-p, penalties, ignore_eos), as vLLM returns by default; under a
grammar, the constrained distribution (the refused tokens masked), as llama-server reports. It is
computed on the GPU worker in the call that samples (the logits buffer is overwritten by the
next decode), and only for requests that asked: the normal path never computes a softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs (and vLLM's default max_logprobs)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token: its log-probability and the ``top_n`` most likely tokens at its
    position, most likely first (equal logits: lower token id first, as the greedy pick)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The full log-distribution of one logits row (float64: exp of it sums to 1 closely)."""
    x = logits.astype(np.float64, copy=False)
    m = float(x.max())
    return x - (m + float(np.log(np.exp(x - m).sum())))


def token_logprobs(logits: np.ndarray, token: int, top_n: int) -> TokenLogprobs:
    """``token``'s log-probability under ``logits`` (raw, one row) and the top ``top_n``."""
    lp = log_softmax(logits)
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        n = min(top_n, lp.shape[0])
        cut = lp[np.argpartition(-lp, n - 1)[n - 1]]  # the n-th largest value
        cand = np.flatnonzero(lp >= cut)  # n or more: every token tied at the cut included
        # Ties broken by id, so the top-1 is the token greedy sampling picks (first argmax).
        order = cand[np.lexsort((cand, -lp[cand]))][:n]
        # Under a grammar the tokens it refuses are at -inf: never alternatives.
        top = tuple((int(t), float(lp[t])) for t in order if lp[t] > -np.inf)
    return TokenLogprobs(int(token), float(lp[token]), top)
