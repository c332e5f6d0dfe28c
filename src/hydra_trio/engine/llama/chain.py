"""A request's llama.cpp sampler chain: repetition penalties, then greedy or top-k, top-p,
min-p, temperature and the seeded draw. The only sampling llama.cpp does for the engine; the
rest of a pick (bans, the grammar's mask, log-probabilities) is engine/sample/'s.

Built lazily on first use, which happens inside a GPU-worker call; freed there too (its owner
hands the sampler back with ``LlamaBackend.retire``)."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from .types import ChainSettings, LogitsRow

# llama_token_data as numpy lays it out (id, logit, p), for llama_sampler_apply.
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)


class LlamaChain:
    """One request's chain over a vocabulary of ``n_vocab`` (built on first use)."""

    def __init__(self, settings: ChainSettings) -> None:
        self._settings = settings
        self._ptr: ctypes.c_void_p | None = None
        self._closed = False

    def _chain(self, n_vocab: int) -> ctypes.c_void_p:
        if self._closed:
            raise RuntimeError("sampler chain already closed")
        if self._ptr is None:
            self._ptr = _build(self._settings, n_vocab)
        return self._ptr

    def pick(self, logits: np.ndarray) -> int | None:
        """The chain's pick from one row of ``logits``, not yet accepted (None: it selected
        nothing)."""
        n_vocab = len(logits)
        candidates = np.empty(n_vocab, dtype=_TOKEN_DATA)
        candidates["id"] = np.arange(n_vocab, dtype=np.int32)
        candidates["logit"] = logits
        candidates["p"] = 0.0
        cur = llama_cpp.llama_token_data_array(
            data=candidates.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
            size=n_vocab,
            selected=-1,
            sorted=False,
        )
        llama_cpp.llama_sampler_apply(self._chain(n_vocab), ctypes.byref(cur))
        return int(cur.data[cur.selected].id) if 0 <= cur.selected < cur.size else None

    def sample_at(self, at: LogitsRow, n_vocab: int) -> int:
        """The chain's pick from the row ``at`` in llama.cpp's logits buffer, accepted
        (``llama_sampler_sample``): llama.cpp writes the candidates into the chain's own
        buffer, where ``pick`` first copies the row into a new NumPy array (Gemma 3's 262k
        vocabulary, one stream: 515 against 876 us of CPU a token, docs/performance.md). The same
        candidates in the same order: the same token, and the same state after, as ``pick``
        then ``accept``."""
        return int(llama_cpp.llama_sampler_sample(self._chain(n_vocab), at.ctx, at.idx))

    def accept(self, token: int, n_vocab: int) -> None:
        """The picked ``token`` enters the chain's history (its penalties, its RNG's state)."""
        llama_cpp.llama_sampler_accept(self._chain(n_vocab), token)

    def close(self) -> None:
        self._closed = True
        if self._ptr is not None:
            llama_cpp.llama_sampler_free(self._ptr)
            self._ptr = None


def _build(s: ChainSettings, n_vocab: int) -> ctypes.c_void_p:
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = llama_cpp.llama_sampler_chain_add
    if s.penalized:
        # This llama.cpp's signature still starts with n_vocab (called with the newer 4
        # arguments, any repeat_penalty failed the step with a TypeError).
        add(chain, llama_cpp.llama_sampler_init_penalties(
            n_vocab, s.repeat_last_n, s.repeat_penalty, s.frequency_penalty, s.presence_penalty
        ))
    if s.greedy:
        add(chain, llama_cpp.llama_sampler_init_greedy())
    else:
        if s.top_k > 0:
            add(chain, llama_cpp.llama_sampler_init_top_k(s.top_k))
        if s.top_p < 1.0:
            add(chain, llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
        if s.min_p > 0.0:
            add(chain, llama_cpp.llama_sampler_init_min_p(s.min_p, 1))
        add(chain, llama_cpp.llama_sampler_init_temp(s.temperature))
        add(chain, llama_cpp.llama_sampler_init_dist(s.seed & 0xFFFFFFFF))
    return chain
