"""A request's sampler: the one rule that turns a row of logits into a token, as separate
steps: a think tag being forced (structured/thinking.py), the logit bans (end of generation
under ``ignore_eos``/``min_tokens``), the grammar (its lazy trigger, then its mask), the pick
(the argmax, or the llama.cpp chain), and the log-probabilities.

Logits come from two places: llama.cpp's output buffer after a decode, and the logits a KV
blob carried (a hand-off's last position). Both go through ``Sampler.sample``, so a token is
picked the same way wherever its logits came from. Everything here runs on the GPU worker.

Where the logits are read, by what a request asks (issue 53: no copy of the vocabulary into
Python for a token that needs none):

- greedy, nothing else asked: the argmax of the row, a NumPy view of llama.cpp's buffer (the
  fastest pick measured: llama.cpp's greedy chain first writes all n_vocab candidates, 7x
  slower with Gemma 3's 262k vocabulary);
- a chain's pick (temperature, top-k/p, min-p, seed; penalties): llama.cpp's chain on the row
  where it lies (``llama_sampler_sample``), an end-of-generation ban written into the row
  first; under a grammar, the first pick it checks (without penalties) too;
- a token the grammar refused, the log-probabilities' mask, or logits from a blob: over a
  NumPy copy of the row.

No UTF-8 guard is needed: llguidance's lexer admits a byte token only where valid UTF-8 can
continue it, so constrained text is always whole characters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ..llama import LlamaChain, LogitsRow
from ..structured import GrammarError, GuidanceCache, GuidanceState, ThinkGate, TriggerWatch
from .sampling_params import SamplingParams
from .token_logprobs import TokenLogprobs, token_logprobs

log = logging.getLogger("hydra_trio.structured")


class Chain(Protocol):
    """The llama.cpp sampler chain a non-greedy or penalized pick runs (llama/chain.py)."""

    def pick(self, logits: np.ndarray) -> int | None: ...

    def sample_at(self, at: LogitsRow, n_vocab: int) -> int: ...

    def accept(self, token: int, n_vocab: int) -> None: ...

    def close(self) -> None: ...


class Sampler:
    """One request's picks. ``chain``: makes its llama.cpp chain (on first use, on the
    worker; llama/chain.py); ``grammars``: the model's compiled grammars, needed with ``params.grammar``;
    ``think``: the reply's think block (tags it forces, a grammar it holds); ``logprobs``:
    top alternatives wanted (0..20), each pick's log-probabilities then appended to
    ``picked``, in the worker call that sampled it (the logits are gone after the next
    decode). ``fast_path``: pick where the logits are (the module's list); False: the path
    before, every pick through every step, a chain's over a NumPy copy of the row (kept to
    measure one against the other: ``--no-sampling-fast-path``)."""

    def __init__(
        self,
        params: SamplingParams,
        *,
        chain: Callable[[SamplingParams], Chain] = LlamaChain,
        grammars: GuidanceCache | None = None,
        think: ThinkGate | None = None,
        logprobs: int | None = None,
        fast_path: bool = True,
    ) -> None:
        self.params = params
        self.think = think
        self.logprobs = logprobs
        self.picked: list[TokenLogprobs] = []
        self.n_picked = 0  # tokens picked so far (on the worker): min_tokens counts them
        self._make_chain = chain
        self._chain: Chain | None = None
        grammar = params.grammar
        if grammar is not None and grammars is None:
            raise ValueError("a grammar needs the model's GuidanceCache")
        self._grammars = grammars
        self._state: GuidanceState | None = None  # made on first use (on the worker)
        # A lazy grammar (tool_choice auto) waits for its trigger here.
        self._watch = (
            TriggerWatch(grammar.triggers, grammars.max_piece)
            if grammar is not None and grammar.triggers and grammars
            else None
        )
        self._dropped = False  # the grammar refused its own trigger's text: the reply goes on free
        # Why the grammar ended this request (past its per-token bound): the sampler then
        # picks an end-of-generation token and the request reports this.
        self.failure: str | None = None
        self._on_context = fast_path  # a chain picks on llama.cpp's row when it is given
        # Greedy with nothing else asked (the common case): the argmax alone (``sample``).
        self._plain = fast_path and self.is_argmax and grammar is None and think is None and logprobs is None
        self._eog: tuple[np.ndarray, frozenset[int]] | None = None  # _eog_set's

    @property
    def plain(self) -> bool:
        """Whether the pick is the argmax of the row and nothing else is asked (greedy, no
        penalty, grammar, think block or log-probabilities): a step may then take the argmax
        of many such rows in one call and hand each its own (``take_argmax``)."""
        return self._plain

    def take_argmax(self, token: int, logits: np.ndarray, eog_ids: np.ndarray) -> int:
        """A plain pick (``plain``) given ``token``, the argmax of ``logits`` (the first of
        equal maxima): the token, after the end-of-generation ban. The ban changes the
        argmax only when it is an end-of-generation token (the first of equal maxima stays
        the first): the row is edited then alone."""
        if token in self._eog_set(eog_ids) and self.bans_eog:
            token = int(self._banned(logits, eog_ids).argmax())
        self.n_picked += 1
        return token

    @property
    def bans_eog(self) -> bool:
        """Whether the next pick may not end the generation (ignore_eos, or min_tokens not
        reached yet)."""
        return self.params.ignore_eos or self.n_picked < self.params.min_tokens

    @property
    def is_argmax(self) -> bool:
        """Greedy with nothing before it: the token is the argmax of the logits (the first
        of equal maxima, as llama's greedy sampler picks), and no chain is needed. A chain
        first writes all n_vocab logits into a candidate array, even on llama.cpp's row: 492
        against 67 us a token with Gemma 3's 262k vocabulary, once a stream a step."""
        return self.params.greedy and not self.params.penalized

    def sample(self, logits: np.ndarray, eog_ids: np.ndarray, at: LogitsRow | None = None) -> int:
        """The token this request picks from one position's ``logits`` (n_vocab f32), with
        its log-probabilities recorded when the request asked (only then: a softmax over the
        vocabulary per token is the cost of asking). A writable ``logits`` (a view of
        llama.cpp's buffer) may be edited in place by a ban; a read-only one (a blob's) is
        copied first. ``at``: where ``logits`` lie in llama.cpp (a chain then reads them
        there). Log-probabilities are those of the model's own logits (under a grammar, the
        constrained distribution), before any ban."""
        if self._plain:  # what the steps below come to for it, with nothing to ask
            return self.take_argmax(int(logits.argmax()), logits, eog_ids)
        think = self.think
        if think is not None and (forced := think.forced()) is not None:
            token, shown = forced, logits  # a think tag being written: the model's logits are not asked
            self._accept_chain(token, len(logits))
        elif self._constrained_now():
            token, shown = self._constrained(logits, eog_ids, at)
        else:
            shown = logits.copy() if self.logprobs is not None and self.bans_eog and logits.flags.writeable else logits
            token = self._free(logits, eog_ids, at)
            if (
                think is not None
                and think.holds_grammar
                and token in eog_ids
                and (close := think.close_instead()) is not None
            ):
                token = close
        if think is not None:
            think.accept(token)
        if self.logprobs is not None:
            self.picked.append(token_logprobs(shown, token, self.logprobs))
        self.n_picked += 1
        return token

    # ---- the steps ------------------------------------------------------------------------

    def _constrained_now(self) -> bool:
        """Whether the grammar picks this token (not held by an open think block)."""
        if self.params.grammar is None or self._dropped:
            return False
        return not (self.think is not None and self.think.holds_grammar)

    def _eog_set(self, eog_ids: np.ndarray) -> frozenset[int]:
        """``eog_ids`` as a set (the vocabulary's, the same array at every pick)."""
        if self._eog is None or self._eog[0] is not eog_ids:
            self._eog = (eog_ids, frozenset(eog_ids.tolist()))
        return self._eog[1]

    def _banned(self, logits: np.ndarray, eog_ids: np.ndarray) -> np.ndarray:
        """The ban step: end-of-generation tokens at -inf while the request may not end."""
        if not self.bans_eog or not len(eog_ids):
            return logits
        if not logits.flags.writeable:
            logits = logits.copy()
        logits[eog_ids] = -np.inf
        return logits

    def _pick(self, logits: np.ndarray) -> int | None:
        """The pick step, not yet accepted: the argmax, or the chain's."""
        return int(logits.argmax()) if self.is_argmax else self._the_chain().pick(logits)

    def _accept_chain(self, token: int, n_vocab: int) -> None:
        if not self.is_argmax:
            self._the_chain().accept(token, n_vocab)

    def _free(self, logits: np.ndarray, eog_ids: np.ndarray, at: LogitsRow | None = None) -> int:
        """A pick with no grammar (or a lazy one still waiting for its trigger)."""
        banned = self._banned(logits, eog_ids)
        if at is not None and banned is logits and self._on_context and not self.is_argmax:
            # The chain reads the row in llama.cpp's buffer, the ban written there: picked
            # and accepted in one call.
            token = self._the_chain().sample_at(at, len(logits))
        else:
            picked = self._pick(banned)
            if picked is None:
                raise RuntimeError("sampler selected no token")
            token = picked
            self._accept_chain(token, len(logits))
        if self._watch is not None and not self._watch.fired and not self._dropped:
            self._watch_trigger(token)
        return token

    def _watch_trigger(self, token: int) -> None:
        assert self._watch is not None and self._grammars is not None
        matched = self._watch.push(self._grammars.pieces[token])
        if matched is not None and not self._grammar_state().feed(matched):
            # The trigger's text is a beginning of the grammar by construction (triggers.py);
            # should it not be, the reply goes on unconstrained rather than fail.
            log.warning("%s: the grammar refused its trigger's text %r; the reply goes on "
                        "unconstrained", self._grammar_param, matched)
            self._dropped = True

    def _constrained(
        self, logits: np.ndarray, eog_ids: np.ndarray, at: LogitsRow | None = None
    ) -> tuple[int, np.ndarray]:
        """The pick under the grammar, and the logits its log-probabilities are read from
        (the constrained distribution: tokens the grammar refuses at -inf).

        As llama-server: the unconstrained pick first, checked against the grammar alone;
        only when the grammar refuses it is the mask computed (greedy: the argmax of the
        allowed tokens; else the chain over them). The result is the same as masking first
        (a refused draw redrawn from the allowed tokens is a draw from them), and a model that
        follows the grammar pays one check a token. Log-probabilities need the mask, so with
        them it is always computed. The grammar's end wins over an end-of-generation ban: once
        it allows nothing but the end, the reply is complete and ends."""
        if self._watch is not None and not self._watch.fired:
            return self._free(logits, eog_ids, at), logits
        if self.failure is not None:  # ended already (a step may sample once more)
            return _end(eog_ids, self.failure), logits
        state = self._grammar_state()
        if self.logprobs is None:
            token = self._first_pick(logits, eog_ids, at)
            if token is not None and np.isfinite(logits[token]) and state.allows(token):
                return self._take(state, token, len(logits)), logits
        allowed = state.allowed()
        if (failure := state.failure) is not None:
            self.failure = failure
            return _end(eog_ids, failure), logits
        masked = np.where(allowed, logits, np.float32(-np.inf))
        if not allowed.any():  # nothing can follow: end the reply rather than break the grammar
            return _end(eog_ids, "the grammar allows no token"), logits
        pick = masked.copy()
        if self.bans_eog and len(eog_ids) and allowed.sum() > np.count_nonzero(allowed[eog_ids]):
            pick[eog_ids] = -np.inf  # something but the end is allowed: the ban holds
        token = self._pick(pick)
        if token is None or not np.isfinite(pick[token]):
            return _end(eog_ids, "the grammar allows no token"), logits
        return self._take(state, token, len(logits)), masked

    def _first_pick(self, logits: np.ndarray, eog_ids: np.ndarray, at: LogitsRow | None) -> int | None:
        """The unconstrained pick the grammar checks first, not yet accepted. On llama.cpp's
        row when accepting changes nothing in the chain (no penalties: top-k/p, min-p,
        temperature and the draw keep no history), since ``llama_sampler_sample`` accepts
        what it picks, and a refused token must not enter a penalty's history."""
        banned = self._banned(logits, eog_ids)
        if (
            at is not None
            and banned is logits
            and self._on_context
            and not self.is_argmax
            and not self.params.penalized
        ):
            return self._the_chain().sample_at(at, len(logits))
        return self._pick(banned)

    def _take(self, state: GuidanceState, token: int, n_vocab: int) -> int:
        self._accept_chain(token, n_vocab)
        state.accept(token)
        if (failure := state.failure) is not None:  # the end comes at the next pick
            self.failure = failure
        return token

    def _grammar_state(self) -> GuidanceState:
        if self._state is None:
            assert self._grammars is not None and self.params.grammar is not None
            self._state = self._grammars.new_state(self.params.grammar)
        return self._state

    @property
    def _grammar_param(self) -> str:
        return self.params.grammar.param if self.params.grammar is not None else "grammar"

    def _the_chain(self) -> Chain:
        if self._chain is None:
            self._chain = self._make_chain(self.params)
        return self._chain

    def raise_failure(self) -> None:
        """End the request with the grammar's error (a 400 naming its param), if it failed."""
        if self.failure is not None:
            raise GrammarError(self.failure, self._grammar_param)

    def close(self) -> None:
        """Free the chain (on the thread that runs llama calls)."""
        if self._chain is not None:
            self._chain.close()
            self._chain = None


def _end(eog_ids: Sequence[int] | np.ndarray, why: str) -> int:
    if not len(eog_ids):
        raise RuntimeError(f"{why}, and the vocabulary has no end-of-generation token")
    return int(eog_ids[0])
