"""A request's sampler: its llama sampler chain and the one rule that turns a row of logits
into a token (end-of-generation bans, the greedy shortcut, the chain, log-probabilities).

Logits come from two places: llama.cpp's output buffer after a decode, and the logits a KV
blob carried (a hand-off's last position). Both go through ``Sampler.sample``, so a token is
picked the same way wherever its logits came from.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from ..logprobs import TokenLogprobs, token_logprobs
from ..params import SamplingParams

# llama_token_data as numpy lays it out (id, logit, p), for llama_sampler_apply.
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)


class Sampler:
    """A llama sampler chain; one per request.

    Made on the trio side but built lazily on first use, which happens inside a GPU-worker
    call; its owner hands it back with LlamaBackend.retire() so the free runs there too.

    With ``logprobs`` (top alternatives wanted, 0..20), every pick also appends the token's
    log-probabilities to ``picked``, in pick order, in the worker call that sampled it (the
    logits are gone after the next decode). The sampler rides in every StepRequest and
    PrefillPart of its request, so steps, look-ahead steps and batches need no other channel;
    the request reads entry i once its i-th token is back (the step's done event orders it).
    """

    def __init__(self, params: SamplingParams, *, logprobs: int | None = None) -> None:
        self.params = params
        self.logprobs = logprobs
        self.picked: list[TokenLogprobs] = []
        self.n_picked = 0  # tokens picked so far (on the worker): min_tokens counts them
        self._chain: ctypes.c_void_p | None = None
        self._closed = False

    def _build(self, n_vocab: int) -> ctypes.c_void_p:
        params = self.params
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = llama_cpp.llama_sampler_chain_add
        if params.penalized:
            add(
                chain,
                # This llama.cpp's signature still starts with n_vocab (it called with the
                # newer 4 arguments, any repeat_penalty failed the step with a TypeError).
                llama_cpp.llama_sampler_init_penalties(
                    n_vocab, params.repeat_last_n, params.repeat_penalty, params.frequency_penalty, params.presence_penalty
                ),
            )
        if params.greedy:
            add(chain, llama_cpp.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
            add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
            add(chain, llama_cpp.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))
        return chain

    @property
    def bans_eog(self) -> bool:
        """Whether the next pick may not end the generation (ignore_eos, or min_tokens not
        reached yet)."""
        return self.params.ignore_eos or self.n_picked < self.params.min_tokens

    @property
    def is_argmax(self) -> bool:
        """Greedy with nothing before it: the token is the argmax of the logits (the first
        of equal maxima, as llama's greedy sampler picks), and no chain is needed."""
        return self.params.greedy and not self.params.penalized

    def chain(self, n_vocab: int) -> ctypes.c_void_p:
        """The llama chain, built on first use (on the worker) for a vocabulary of n_vocab."""
        if self._closed:
            raise RuntimeError("sampler already closed")
        if self._chain is None:
            self._chain = self._build(n_vocab)
        return self._chain

    def sample(self, logits: np.ndarray, eog_ids: np.ndarray) -> int:
        """The token this request picks from one position's ``logits`` (n_vocab f32), with
        its log-probabilities recorded when the request asked (only then: a softmax over the
        vocabulary per token is the cost of asking). ``eog_ids``: the vocabulary's
        end-of-generation tokens, which a ban masks.

        A writable ``logits`` (a view of llama.cpp's buffer) may be edited in place by a ban;
        a read-only one (a blob's) is copied first. Log-probabilities are always those of the
        model's own logits, before any ban."""
        raw = logits.copy() if self.logprobs is not None and self.bans_eog and logits.flags.writeable else logits
        token = self._pick(logits, eog_ids)
        if self.logprobs is not None:
            self.picked.append(token_logprobs(raw, token, self.logprobs))
        self.n_picked += 1
        return token

    def _pick(self, logits: np.ndarray, eog_ids: np.ndarray) -> int:
        """A plain greedy pick reads the argmax straight from the logits: a chain first copies
        all n_vocab logits into a candidate array, which cost 273 us a token with Gemma 3's
        262k vocabulary against 59 us for the argmax (34 against 13 us at 32k), eight times
        per step at eight streams."""
        if self.bans_eog:
            if not logits.flags.writeable:
                logits = logits.copy()
            logits[eog_ids] = -np.inf
        if self.is_argmax:
            return int(logits.argmax())
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
        chain = self.chain(n_vocab)
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(cur))
        if not 0 <= cur.selected < cur.size:
            raise RuntimeError("sampler selected no token")
        token = int(cur.data[cur.selected].id)
        llama_cpp.llama_sampler_accept(chain, token)
        return token

    def close(self) -> None:
        """Free the chain (on the thread that runs llama calls)."""
        self._closed = True
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
