"""The batched generation steps of LlamaBackend (context.py): every generating slot's next
token in one llama_decode, with the drafts of requests that speculate as extra positions,
verified and rolled back (the engine's ``StepPlanner``, engine/speculation/), steps that share a decode with parts
of prompts (chunked prefill), and what a change of LoRA adapter set between steps costs.

Kept apart from the context because it is its own subject: what one step's batch holds and
how its rows are read back. It uses the context's attributes, declared here, and the
context's decode and sampling methods (``_decode_batch``, ``_first_logits``, ``_sample``,
``_advanced``, ``truncate_slot``, ``eval_chunk``, ``logits_bytes``, ``is_eog``). Worker only.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence

import llama_cpp
import numpy as np
import outcome

from .kv_state import NoKvSpace
from .types import LoraSet, ModelInfo, PrefillPart, StepPlanner, StepRequest, StepResult

# A step without drafts tells the planner its decode time once in this many (see _measure).
MEASURE_EVERY = 4


class BatchSteps:
    """The steps half of LlamaBackend."""

    _steps_seen = 0  # steps decoded (one in MEASURE_EVERY without drafts is measured)

    _mem: ctypes.c_void_p
    n_batch: int
    kv_unified: bool
    n_ctx_slot: int
    n_swa: int
    seq_tokens: list[list[int]]
    _swa_low: list[int]
    decode_s: float
    planner: StepPlanner | None  # the engine's speculation: drafts, accept rule, pass costs (None: no drafts)
    info: ModelInfo
    seq_lora: list[LoraSet]
    _adapters: list[ctypes.c_void_p]
    _eog_index: np.ndarray  # the vocabulary's end-of-generation ids (TokenSampler.sample's eog_ids)
    lora_switch_s: float  # what a change of adapter set adds to a decode (measure_lora_switch)

    def step(
        self, requests: Sequence[StepRequest], *, drafts: bool = True, before_decode: Callable[[], None] | None = None
    ) -> list[StepResult]:
        """One generation step for several slots in one llama_decode (continuous batching),
        with the drafts of the requests that speculate as extra positions (``verify_steps``).
        ``before_decode`` runs just before the llama_decode (the batcher hands the last
        step's results to trio there); it must bear being run again (a retry).

        Returns what each request sampled (``StepResult``), or None for a slot that hit the
        end of its context or the shared KV pool.
        """
        results: list[StepResult] = [None] * len(requests)
        live = self._live_in_slot_order(requests)
        if not live:
            return results
        entries, proposed = self._step_entries(requests, live, self.n_batch - len(live) if drafts else 0)
        if before_decode is not None:
            before_decode()
        decode_s = self.decode_s
        try:
            self._decode_batch(entries, None)
        except NoKvSpace:
            if any(proposed):  # the drafts may be what does not fit: try without them
                return self.step(requests, drafts=False)
            if len(live) == 1:
                return results
            # Shared pool is tight: let each sequence try alone so those that fit go on.
            for i in live:
                results[i] = self.step([requests[i]], drafts=False)[0]
            return results
        if self.planner is not None:
            self._measure(requests, live, proposed, self.decode_s - decode_s)
        cuts = self._verify_steps(requests, live, proposed, len(entries), results)
        if cuts:
            self._roll_back(cuts)
        for i in live:
            self._advanced(requests[i].slot)
        return results

    def _step_entries(
        self, requests: Sequence[StepRequest], live: Sequence[int], room: int
    ) -> tuple[list[tuple[int, int, int, bool]], list[list[int]]]:
        """The batch entries of the live steps (each slot's token, then its draft, all with
        logits, slots in order) and each live step's draft; ``room``: draft positions the
        batch has left. The drafts are ``step_drafts``': each capped by its request's tokens
        left and its slot's room."""
        seq_tokens = self.seq_tokens
        planner = self.planner
        # No request of the step speculates (the common case): no plan to ask for (its
        # arguments alone were a tenth of a one-stream step's host work, profiled).
        drafts = (
            [[] for _ in live]
            if planner is None or room <= 0 or all(requests[i].spec is None for i in live)
            else planner.drafts(
                [requests[i].slot for i in live],
                [
                    (r.spec, seq_tokens[r.slot], r.token,
                     min(r.n_left - 1, self.n_ctx_slot - len(seq_tokens[r.slot]) - 1))
                    for r in (requests[i] for i in live)
                ],
                room,
            )
        )
        entries: list[tuple[int, int, int, bool]] = []
        for i, draft in zip(live, drafts, strict=True):
            r = requests[i]
            pos = len(seq_tokens[r.slot])
            entries.append((r.slot, r.token, pos, True))
            if draft:
                entries += [(r.slot, t, pos + 1 + j, True) for j, t in enumerate(draft)]
        return entries, drafts

    def _measure(
        self, requests: Sequence[StepRequest], live: Sequence[int], proposed: Sequence[list[int]], seconds: float
    ) -> None:
        """Tell the planner a step's decode time (the cost it prices drafts with): every step
        that carried drafts, and one in ``MEASURE_EVERY`` of the others (the plan needs their
        cost measured before a request speculates; each measure's pricing of the batch's
        passes was a tenth of a one-stream step's host work, profiled)."""
        if self.planner is None:
            return
        self._steps_seen += 1
        if any(proposed):
            self.planner.measured([requests[i].slot for i in live], [1 + len(d) for d in proposed], seconds)
        elif self._steps_seen % MEASURE_EVERY == 0:  # one row a slot: no counts to build
            self.planner.measured_singles(requests[live[0]].slot, requests[live[-1]].slot, len(live), seconds)

    def _verify_steps(
        self,
        requests: Sequence[StepRequest],
        live: Sequence[int],
        proposed: Sequence[list[int]],
        n_rows: int,
        results: list[StepResult],
    ) -> list[tuple[int, int, int]]:
        """After the decode of ``_step_entries``: each live step's picks (``verify``: the
        draft's matching prefix and one more) and the accepted tokens into the slot's
        history; returns the rejected positions, for ``_roll_back`` once every row of the
        decode is read (nothing may come between a decode and the reading of its logits)."""
        rows = self._first_logits(n_rows)  # the steps come first in the batch
        best = self._plain_argmax(requests, live, proposed, rows)
        eog = self._eog_index
        row = 0
        cuts: list[tuple[int, int, int]] = []  # (slot, first rejected position, positions evaluated)
        for i, draft in zip(live, proposed, strict=True):
            r = requests[i]
            history = self.seq_tokens[r.slot]
            pos = len(history)
            sampler = r.sampler
            if draft:
                base = row
                assert self.planner is not None, "drafts come from the planner"
                picks = self.planner.verify(
                    draft, lambda k, s=sampler, base=base: self._sample(s, base + k, rows[base + k]), self.is_eog
                )
                n_ok = len(picks) - 1
                history.append(r.token)
                history.extend(draft[:n_ok])
                assert r.spec is not None
                r.spec.record(len(draft), n_ok)
                if n_ok < len(draft):
                    cuts.append((r.slot, pos + 1 + n_ok, pos + 1 + len(draft)))
                results[i] = tuple(picks)
            else:
                history.append(r.token)
                token = best[row]
                if token is None:
                    token = self._sample(sampler, row, rows[row])
                else:
                    token = sampler.take_argmax(token, rows[row], eog)
                results[i] = (token,)
            row += 1 + len(draft)
        return cuts

    @staticmethod
    def _plain_argmax(
        requests: Sequence[StepRequest], live: Sequence[int], proposed: Sequence[list[int]], rows: np.ndarray
    ) -> list[int | None]:
        """The argmax of each plain step's row (``TokenSampler.plain``: greedy, nothing else
        asked, no draft), None for the other rows: one ``argmax(axis=1)`` over each run of
        adjacent plain rows (a view of llama.cpp's buffer, no copy), instead of a call per
        row (at 64 streams, the per-row calls were a third of the worker's Python per token
        with a small vocabulary, profiled). Ties go to the first of equal maxima, as a row's
        own argmax."""
        best: list[int | None] = [None] * len(rows)
        row = 0
        start = -1  # the first row of the run of plain rows being read (-1: none)
        for i, draft in zip(live, proposed, strict=True):
            if not draft and requests[i].sampler.plain:
                if start < 0:
                    start = row
            elif start >= 0:
                best[start:row] = rows[start:row].argmax(axis=1).tolist()
                start = -1
            row += 1 + len(draft)
        if start >= 0:
            best[start:row] = rows[start:row].argmax(axis=1).tolist()
        return best

    def _roll_back(self, cuts: Sequence[tuple[int, int, int]]) -> None:
        """Remove rejected draft positions from the KV: (slot, first rejected position,
        positions evaluated). The slot's history never held them."""
        for slot, first, evaluated in cuts:
            llama_cpp.llama_memory_seq_rm(self._mem, slot, first, -1)
            if self.n_swa:
                # The SWA layers advanced to the last position evaluated: count their window
                # from there (the prefix reuse rule), not from the shorter kept history.
                self._swa_low[slot] = max(self._swa_low[slot], evaluated - self.n_swa)

    def _live_in_slot_order(self, requests: Sequence[StepRequest]) -> list[int]:
        """Indexes of the requests whose slot has room, in slot order. The order matters
        (measured, cause not pinned down): on the bare llama API, 8 streams at positions
        200-280 of a unified cache stepped ~1.5x slower with the slots in a new order each
        step than in the same order."""
        seq_tokens, room = self.seq_tokens, self.n_ctx_slot
        live = [i for i, r in enumerate(requests) if len(seq_tokens[r.slot]) < room]
        slots = [requests[i].slot for i in live]
        if slots != sorted(slots):  # the batcher sends them in order: no key to call per request
            live.sort(key=lambda i: requests[i].slot)
        return live

    def step_mixed(
        self, requests: Sequence[StepRequest], parts: Sequence[PrefillPart]
    ) -> tuple[list[StepResult], list[outcome.Outcome[tuple[int | None, bytes | None]]]]:
        """One llama_decode holding the generation steps and parts of prompts (each of its
        own slot).

        Returns the steps' results (as ``step``) and each part's outcome (as ``eval_chunk``:
        the sampled token and logits, or the error, e.g. NoKvSpace, that only concerns it).
        """
        for part in parts:
            if part.keep is not None:
                # No cut is left to make here (Engine.first_token cut the slot to its plan),
                # so a memory that refuses partial removal never fails a shared batch.
                self.truncate_slot(part.slot, part.keep)
        live = self._live_in_slot_order(requests)
        fits = [p for p in parts if len(self.seq_tokens[p.slot]) + len(p.tokens) <= self.n_ctx_slot]
        n_part_tokens = sum(len(p.tokens) for p in fits)
        n_entries = len(live) + n_part_tokens
        if len(fits) < len(parts) or n_entries > self.n_batch or n_entries == len(live):
            return self._step_then_parts(requests, parts)
        # No drafts beside prompt parts: a prompt being prefilled is a stream about to join,
        # and drafts would delay it (measured: docs/performance.md, speculative decoding).
        entries, proposed = self._step_entries(requests, live, 0)
        n_step_entries = len(entries)
        ends: list[int] = []  # each part's last entry
        for part in parts:
            start = len(self.seq_tokens[part.slot])
            need_logits = part.sampler is not None or part.want_logits
            last = len(part.tokens) - 1
            entries += [(part.slot, t, start + k, need_logits and k == last) for k, t in enumerate(part.tokens)]
            ends.append(len(entries) - 1)
        try:
            self._decode_batch(entries, None)
        except NoKvSpace:  # the shared pool is tight: each goes alone, those that fit go on
            return self._step_then_parts(requests, parts)
        results: list[StepResult] = [None] * len(requests)
        cuts = self._verify_steps(requests, live, proposed, n_step_entries, results)
        outcomes: list[outcome.Outcome[tuple[int | None, bytes | None]]] = []
        tails: dict[int, bytes | None] = {requests[i].slot: None for i in live}
        for part, idx in zip(parts, ends, strict=True):
            self.seq_tokens[part.slot].extend(part.tokens)
            logits = self.logits_bytes(idx) if part.want_logits else None
            token = self._sample(part.sampler, idx) if part.sampler else None
            outcomes.append(outcome.Value((token, logits)))
            tails[part.slot] = logits
        # After every sample: _advanced may call llama (SWA state size), and the roll-back
        # does, which must not come between a decode and the reading of its logits.
        self._roll_back(cuts)
        for slot, logits in tails.items():
            self._advanced(slot, logits)
        return results, outcomes

    def _step_then_parts(
        self, requests: Sequence[StepRequest], parts: Sequence[PrefillPart]
    ) -> tuple[list[StepResult], list[outcome.Outcome[tuple[int | None, bytes | None]]]]:
        results = self.step(requests)
        return results, [
            outcome.capture(self.eval_chunk, p.slot, p.tokens, None, sampler=p.sampler, want_logits=p.want_logits)
            for p in parts
        ]

    def measure_lora_switch(self) -> float:
        """Seconds a change of adapter set adds to the next llama_decode (llama.cpp reserves
        its compute graph again after one): one-token decodes on slot 0 right after a change,
        less those without one, the least of three. 0 without adapters."""
        if not self._adapters:
            return 0.0
        token = self.info.bos if 0 <= self.info.bos < self.info.n_vocab else 0
        one: LoraSet = ((0, 1.0),)
        extra: list[float] = []
        try:
            for rep in range(3):
                took = []
                for pos, lora in enumerate(((), one, one, (), ())):  # a change at the 2nd and 4th
                    self.seq_lora[0] = lora
                    t0 = time.perf_counter()
                    self._decode_batch([(0, token, 5 * rep + pos, False)], None)
                    took.append(time.perf_counter() - t0)
                extra.append(max(0.0, (took[1] - took[2] + took[3] - took[4]) / 2))
        finally:
            self.seq_lora[0] = ()
            llama_cpp.llama_memory_seq_rm(self._mem, 0, -1, -1)
            self.decode_s = 0.0
        self.lora_switch_s = min(extra)
        return self.lora_switch_s
