"""A request's sampler: its llama sampler chain and the one rule that turns a row of logits
into a token (end-of-generation bans, the greedy shortcut, the chain, log-probabilities).

Logits come from two places: llama.cpp's output buffer after a decode, and the logits a KV
blob carried (a hand-off's last position). Both go through ``Sampler.sample``, so a token is
picked the same way wherever its logits came from.
"""

from __future__ import annotations

import codecs
import ctypes
from dataclasses import dataclass, field
from typing import Literal

import llama_cpp
import numpy as np

from .grammar import GrammarCache, GrammarError, GuidanceState, TriggerWatch
from .logprobs import TokenLogprobs, token_logprobs
from .thinking import ThinkGate


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0  # OpenAI's, over the last repeat_last_n tokens (llama.cpp's)
    presence_penalty: float = 0.0
    seed: int = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: random
    ignore_eos: bool = False  # end-of-generation tokens are never sampled (benchmarks' convention)
    min_tokens: int = 0  # vLLM's: no end-of-generation token before this many (stop strings still stop)
    # GBNF every sampled token must follow (response_format, json_schema, grammar, tools), as text:
    # a pure value that pickles and compares; compiled on the GPU worker (llama/grammar.py).
    grammar: str | None = None
    # A lazy grammar's trigger patterns (tool_choice "auto": free text until the model starts
    # a call; llama/grammar.py's trigger_pattern); (): the grammar holds from the first token.
    grammar_triggers: tuple[str, ...] = ()
    grammar_param: str = field(default="grammar", compare=False)  # the key it came from: errors name it
    # Which engine runs the grammar: llama.cpp's, or llguidance's (a client's own GBNF, whose
    # per-token work llama.cpp cannot bound: llama/grammar.py, GuidanceCache).
    grammar_engine: Literal["llama", "llguidance"] = "llama"

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether any repetition penalty changes the logits before the pick."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


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

    def __init__(
        self,
        params: SamplingParams,
        *,
        logprobs: int | None = None,
        grammars: GrammarCache | None = None,
        think: ThinkGate | None = None,
    ) -> None:
        self.params = params
        # The reply's think block (llama/thinking.py): tags it forces, a grammar it holds.
        self.think = think
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
        self._guided: GuidanceState | None = None  # grammar_engine "llguidance": its state instead
        # A lazy grammar (tool_choice auto) waits for its trigger here, out of llama.cpp's
        # per-token regex over the whole reply (llama/grammar.py TriggerWatch).
        self._watch = (
            TriggerWatch(params.grammar_triggers, grammars.max_piece) if params.grammar_triggers and grammars is not None else None
        )
        # Why the grammar ended this request (llguidance past its per-token bound): the
        # sampler then picks an end-of-generation token and the request reports this.
        self.failure: str | None = None
        self._one = np.zeros(1, dtype=_TOKEN_DATA)  # the one-candidate grammar check's array
        # The generated bytes' unfinished UTF-8 character: llama.cpp's grammar decodes UTF-8
        # without checking continuation bytes, so a sampled run of byte tokens could pass it
        # and still be invalid text (U+FFFD in the reply, a string too long for its schema).
        self._utf8_tail = b""
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
        think = self.think
        if think is not None and (forced := think.forced()) is not None:
            token, shown = forced, logits  # a think tag being written: the model's logits are not asked
            if not self.is_argmax:
                llama_cpp.llama_sampler_accept(self.chain(len(logits)), token)  # penalties' history
        elif self.params.grammar is not None and not (think is not None and think.holds_grammar):
            token, shown = self._pick_constrained(logits, eog_ids)
        else:
            shown = logits.copy() if self.logprobs is not None and self.bans_eog and logits.flags.writeable else logits
            token = self._pick(logits, eog_ids)
            if think is not None and think.holds_grammar and token in eog_ids and (close := think.close_instead()) is not None:
                token = close
        if think is not None:
            think.accept(token)
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
        token = self._chain_pick(logits)
        if token is None:
            raise RuntimeError("sampler selected no token")
        llama_cpp.llama_sampler_accept(self.chain(len(logits)), token)  # penalties' history
        return token

    def _chain_pick(self, logits: np.ndarray) -> int | None:
        """The chain's pick from ``logits``, not yet accepted into it (None: it selected
        nothing)."""
        candidates, cur = _candidates(logits)
        llama_cpp.llama_sampler_apply(self.chain(len(candidates)), ctypes.byref(cur))
        return int(cur.data[cur.selected].id) if 0 <= cur.selected < cur.size else None

    # ---- constrained (a grammar) -------------------------------------------------------

    def _grammar_state(self) -> ctypes.c_void_p:
        if self._closed:
            raise RuntimeError("sampler already closed")
        if self._grammar is None:
            assert self._grammars is not None and self.params.grammar is not None
            self._grammar = self._grammars.new_state(self.params.grammar, self.params.grammar_triggers)
        return self._grammar

    def _guidance_state(self) -> GuidanceState | None:
        """The llguidance state when the grammar runs there (None: llama.cpp's grammar)."""
        if self.params.grammar_engine != "llguidance":
            return None
        if self._guided is None:
            assert self._grammars is not None and self.params.grammar is not None
            self._guided = self._grammars.guidance.new_state(self.params.grammar, self.params.grammar_param)
        return self._guided

    @property
    def _waiting(self) -> bool:
        """A lazy grammar whose trigger has not appeared yet: it allows anything."""
        return self._watch is not None and not self._watch.fired

    def _allows(self, token: int) -> bool:
        """Whether the grammar's state allows ``token`` next (one candidate through it)."""
        if self._waiting:
            return True
        if (guided := self._guidance_state()) is not None:
            return guided.allows(token)
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
        if self.failure is not None:  # ended already (a step may sample once more)
            return self._end(eog_ids), logits
        guided = self._guidance_state()
        waiting = self._waiting
        grammar = None if guided is not None or waiting else self._grammar_state()
        if self.logprobs is None:
            banned = logits
            if self.bans_eog and len(eog_ids):
                banned = logits.copy()
                banned[eog_ids] = -np.inf
            if self.is_argmax:
                token = int(banned.argmax())
                if np.isfinite(banned[token]) and self._allows(token) and self._utf8_ok(token, eog_ids):
                    self._accept(grammar, token)
                    return token, logits
            else:
                token = self._chain_pick(banned)
                if token is not None and np.isfinite(banned[token]) and self._allows(token) and self._utf8_ok(token, eog_ids):
                    llama_cpp.llama_sampler_accept(self.chain(len(banned)), token)
                    self._accept(grammar, token)
                    return token, logits
        if waiting:
            masked = np.array(logits, dtype=np.float32)  # everything allowed (a copy: a ban edits pick)
        elif guided is not None:
            masked = np.where(guided.allowed(), logits, np.float32(-np.inf))
            if (failure := guided.failure) is not None:
                self._failed(failure)
                return self._end(eog_ids), logits
        else:
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
        pick = masked.copy()
        if self.bans_eog and len(eog_ids) and allowed.sum() > np.isin(np.flatnonzero(allowed), eog_ids).sum():
            pick[eog_ids] = -np.inf  # something but the end is allowed: the ban holds
        token = self._pick_valid_utf8(pick, eog_ids)
        if token is None:
            return int(eog_ids[0]) if len(eog_ids) else 0, logits
        self._accept(grammar, token)
        return token, masked

    def _pick_valid_utf8(self, pick: np.ndarray, eog_ids: np.ndarray) -> int | None:
        """The greedy or chain pick from the grammar-masked ``pick`` (edited) whose bytes keep
        the text valid UTF-8: a refused pick is masked and the pick redone (rare: only byte
        tokens can break it). None: nothing allowed is left."""
        for _ in range(int(np.isfinite(pick).sum())):
            picked = int(pick.argmax()) if self.is_argmax else self._chain_pick(pick)
            if picked is None:
                raise RuntimeError("sampler selected no token")
            token = picked
            if not np.isfinite(pick[token]):
                return None
            if self._utf8_ok(token, eog_ids):
                if not self.is_argmax:
                    llama_cpp.llama_sampler_accept(self.chain(len(pick)), token)
                return token
            pick[token] = -np.inf
        return None

    def _utf8_ok(self, token: int, eog_ids: np.ndarray) -> bool:
        """Whether ``token``'s bytes continue the generated text as valid UTF-8."""
        assert self._grammars is not None
        piece = self._grammars.pieces[token]
        if not self._utf8_tail and (piece.isascii() or token in eog_ids):
            return True  # the usual case, without a decoder
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        try:
            decoder.decode(self._utf8_tail + piece)
        except UnicodeDecodeError:
            return False
        return True

    def raise_failure(self) -> None:
        """End the request with the grammar's error (a 400 naming its param), if it failed."""
        if self.failure is not None:
            raise GrammarError(self.failure, self.params.grammar_param)

    def _failed(self, failure: str) -> None:
        self.failure = f"{self.params.grammar_param}: the grammar is too complex for the engine's per-token bound ({failure})"

    def _end(self, eog_ids: np.ndarray) -> int:
        if not len(eog_ids):
            raise RuntimeError(self.failure or "the vocabulary has no end-of-generation token")
        return int(eog_ids[0])

    def _accept(self, grammar: ctypes.c_void_p | None, token: int) -> None:
        """Advance the grammar and the UTF-8 tail past the picked ``token``."""
        if self._waiting:
            assert self._watch is not None and self._grammars is not None
            replay = self._watch.push(token, self._grammars.grammar_pieces[token])
            if replay is not None:  # triggered: a fresh lazy state finds it in the short text
                state = self._grammar_state()
                for t in replay:
                    llama_cpp.llama_sampler_accept(state, t)
        elif grammar is None:
            assert self._guided is not None
            self._guided.accept(token)
            if (failure := self._guided.failure) is not None:  # the end comes at the next pick
                self._failed(failure)
        else:
            llama_cpp.llama_sampler_accept(grammar, token)
        assert self._grammars is not None
        piece = self._grammars.pieces[token]
        if piece and (self._utf8_tail or not piece.isascii()):
            decoder = codecs.getincrementaldecoder("utf-8")("strict")
            decoder.decode(self._utf8_tail + piece)
            self._utf8_tail = decoder.getstate()[0]

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
