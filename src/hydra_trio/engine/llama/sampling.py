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
from .grammar import GrammarCache

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

    def __init__(self, params: SamplingParams, *, logprobs: int | None = None, grammars: GrammarCache | None = None) -> None:
        self.params = params
        self.logprobs = logprobs
        self.picked: list[TokenLogprobs] = []
        self.n_picked = 0  # tokens picked so far (on the worker): min_tokens counts them
        self._chain: ctypes.c_void_p | None = None
        # With params.grammar: the request's own grammar state (cloned from the compiled
        # grammar on first use), advanced by every token this sampler picks.
        if params.grammar is not None and grammars is None:
            raise ValueError("a grammar needs the model's GrammarCache")
        self._grammars = grammars
        self._grammar: ctypes.c_void_p | None = None
        self._one = np.zeros(1, dtype=_TOKEN_DATA)  # the one-candidate grammar check's array
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
        if self.params.grammar is not None:
            token, shown = self._pick_constrained(logits, eog_ids)
        else:
            shown = logits.copy() if self.logprobs is not None and self.bans_eog and logits.flags.writeable else logits
            token = self._pick(logits, eog_ids)
        if self.logprobs is not None:
            self.picked.append(token_logprobs(shown, token, self.logprobs))
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
        candidates, cur = _candidates(logits)
        return self._run_chain(candidates, cur)

    def _run_chain(self, candidates: np.ndarray, cur: llama_cpp.llama_token_data_array) -> int:
        """The chain's pick from ``candidates`` (accepted by the chain: penalties' history)."""
        chain = self.chain(len(candidates))
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(cur))
        if not 0 <= cur.selected < cur.size:
            raise RuntimeError("sampler selected no token")
        token = int(cur.data[cur.selected].id)
        llama_cpp.llama_sampler_accept(chain, token)
        return token

    # ---- constrained (a grammar) -------------------------------------------------------

    def _grammar_state(self) -> ctypes.c_void_p:
        if self._closed:
            raise RuntimeError("sampler already closed")
        if self._grammar is None:
            assert self._grammars is not None and self.params.grammar is not None
            self._grammar = self._grammars.new_state(self.params.grammar)
        return self._grammar

    def _allows(self, token: int) -> bool:
        """Whether the grammar's state allows ``token`` next (one candidate through it)."""
        one = self._one
        one["id"], one["logit"] = token, 0.0
        cur = llama_cpp.llama_token_data_array(
            data=one.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=1, selected=-1, sorted=False
        )
        llama_cpp.llama_sampler_apply(self._grammar_state(), ctypes.byref(cur))
        return bool(np.isfinite(one["logit"][0]))

    def _pick_constrained(self, logits: np.ndarray, eog_ids: np.ndarray) -> tuple[int, np.ndarray]:
        """The pick under the grammar, and the logits its log-probabilities are read from
        (the constrained distribution: tokens the grammar refuses at -inf).

        As llama-server: the unconstrained pick first, checked against the grammar with one
        candidate; only when the grammar refuses it is the whole vocabulary run through the
        grammar (greedy: the argmax of the allowed tokens; else the chain over them). The
        result is the same as masking first (greedy: the first allowed argmax; sampling: a
        refused draw redrawn from the allowed tokens is a draw from them), and a model
        that follows the grammar pays one check a token. Log-probabilities need the mask,
        so with them the whole vocabulary always goes through the grammar.

        The grammar's end wins over an end-of-generation ban (ignore_eos, min_tokens): once
        it allows nothing but the end, the reply is complete and ends. A token the grammar
        refuses is never accepted into it (llama.cpp aborts the process on that)."""
        grammar = self._grammar_state()
        if self.logprobs is None:
            banned = logits
            if self.bans_eog and len(eog_ids):
                banned = logits.copy()
                banned[eog_ids] = -np.inf
            if self.is_argmax:
                token = int(banned.argmax())
                if np.isfinite(banned[token]) and self._allows(token):
                    llama_cpp.llama_sampler_accept(grammar, token)
                    return token, logits
            else:
                candidates, cur = _candidates(banned)
                chain = self.chain(len(candidates))
                llama_cpp.llama_sampler_apply(chain, ctypes.byref(cur))
                if 0 <= cur.selected < cur.size:
                    token = int(cur.data[cur.selected].id)
                    if np.isfinite(banned[token]) and self._allows(token):
                        llama_cpp.llama_sampler_accept(chain, token)
                        llama_cpp.llama_sampler_accept(grammar, token)
                        return token, logits
        candidates, cur = _candidates(logits)
        llama_cpp.llama_sampler_apply(grammar, ctypes.byref(cur))
        masked = candidates["logit"].copy()  # the constrained distribution (before a ban)
        allowed = np.isfinite(masked)
        if not allowed.any():
            # Nothing can follow (a grammar no token of this vocabulary can continue): end
            # the reply rather than accept a refused token.
            if not len(eog_ids):
                raise RuntimeError("the grammar allows no token and the vocabulary has no end-of-generation token")
            return int(eog_ids[0]), logits
        if self.bans_eog and len(eog_ids) and allowed.sum() > np.isin(np.flatnonzero(allowed), eog_ids).sum():
            candidates["logit"][eog_ids] = -np.inf  # something but the end is allowed: ban holds
        if self.is_argmax:
            token = int(candidates["logit"].argmax())
        else:
            token = self._run_chain(candidates, cur)
        llama_cpp.llama_sampler_accept(grammar, token)
        return token, masked

    def close(self) -> None:
        """Free the chain and the grammar state (on the thread that runs llama calls)."""
        self._closed = True
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None


def _candidates(logits: np.ndarray) -> tuple[np.ndarray, llama_cpp.llama_token_data_array]:
    """The whole vocabulary as llama candidates (ids, logits), and the array over them."""
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
    return candidates, cur
