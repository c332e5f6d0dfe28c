"""The engine's core: one model, N slots, one GPU worker; its components, lifecycle,
prefill, generation, KV copies and CONFIGURE's apply step. How it starts (the model loaded
and warmed up, the start-up log) is startup.py's. Internal to engine/: front ends use the
face (engine.py ``Engine``, lease.py ``SlotLease``); what readers see of the core (figures,
slot descriptions, runtime fields, KV events) is readout.py's.

Request tasks never call llama.cpp themselves: they ask the engine for work (a prefill
chunk, a generation step). Generation steps of all generating slots are batched into one
llama_decode by the step batcher (``batcher.py``); prefill chunks interleave with those
batches on the one GPU worker. CONFIGURE's per-slot settings and staged rebuilds live in
``configure.py``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import trio

from ..config import Settings
from ..model.identity import ModelIdentity
from ..wire.errors import ErrorCode, ProtocolError, Status
from .adapters import LoraAdapters
from .chat import resolve_chat_template
from .configure import Reconfigurer, SlotSettings
from .inputs import Inputs
from .kv import (
    HostTiers,
    Retention,
    kv_fingerprint,
)
from .llama import (
    DecodeAborted,
    LlamaBackend,
    NoKvSpace,
    PrefillPart,
    Span,
    StepRequest,
    media_spans,
)
from .output import GenerationResult, OutputProcessor
from .params import GenerationParams
from .reload import apply_staged
from .sample import Sampler
from .sched import PartOutcome, SessionTree, SlotScheduler, SlotTable, StepBatcher
from .speculation import DraftPlanner, NgramMemories, SpecCounts, request_speculation
from .worker import GpuWorker, WorkerLane

Emit = Callable[[str], Awaitable[None]]


async def _emit_all(emit: Emit, sends: Sequence[str]) -> None:
    for send in sends:
        await emit(send)


class EngineCore:
    """The components and what spans them (engine.py's ``Engine`` is the face over it)."""

    def __init__(
        self, backend: LlamaBackend, identity: ModelIdentity, settings: Settings, lane: WorkerLane | None = None,
        adapters: LoraAdapters | None = None,
    ) -> None:
        self.backend = backend
        self.identity = identity
        self.settings = settings
        self.worker = GpuWorker(lane)
        self.slots = SlotTable(backend.n_slots, compact=not backend.kv_unified, overtakes=settings.slot_overtakes)
        self.inputs = Inputs(lambda: self.backend, self.worker, settings)
        self.adapters = adapters or LoraAdapters()  # --lora: read at start (startup.py)
        self.model_load_ms = 0.0
        self.warmup_ms: float | None = None  # None: no warm-up ran (--no-warmup)
        budget = min(settings.step_token_budget, backend.n_batch)  # before the ITL target's costs are measured
        self.batcher = StepBatcher(
            backend.n_slots,
            lambda reqs, before_decode: self.backend.step(reqs, before_decode=before_decode),
            lambda fn: self.worker.call(fn, yields=True),
            self._run_mixed,
            token_budget=budget,
            alone_budget=backend.n_batch,
            worker_free=self.worker.wait_for_calls_ahead,
            is_eog=lambda token: self.backend.is_eog(token),
            wants_turn=self.worker.wants_turn,
            lora_of=(lambda slot: self.backend.seq_lora[slot]) if self.adapters else None,
            lora_switch_s=backend.lora_switch_s,
            itl_target_s=settings.itl_target_ms / 1000.0,
        )
        self.tokens_generated = 0
        # The speculation the backend's steps run with: the draft policy and what a forward
        # pass costs by rows on this machine (engine/speculation/); a model reload gets its own.
        backend.planner = DraftPlanner(backend.n_batch, split=not backend.kv_unified)
        self.spec_counts = SpecCounts()  # vllm:spec_decode_* (every request's drafts)
        self.ngram_memories = NgramMemories(settings.spec_ngram_size_n)  # drafts from earlier requests, per salt
        # Told on the worker once a T2/T3 change has emptied every slot: the KV events' watch
        # (readout.py) looks at the new context. None: nobody subscribes.
        self.slots_emptied_watch: Callable[[LlamaBackend], None] | None = None
        # Slots' KV kept past the slots, in RAM (None: --cache-ram-mib 0) and on disk (kv/tiers.py),
        # what leaves first (retention.py), and the agent sessions that own it (session_tree.py).
        self.retention = Retention(settings.session_policy, trio.current_time)
        self.tiers = HostTiers(settings, self.retention, kv_fingerprint(backend, identity.fields()))
        self.prompt_cache = self.tiers.ram
        self.scheduler = SlotScheduler(
            lambda: self.backend, self.worker, self.slots, settings, self.tiers, self.retention
        )
        self.sessions = SessionTree(
            ttl_s=settings.session_ttl_s, release=self.scheduler.release, resuming=self.tiers.want
        )
        self._chunk_prompt_tokens = 0  # prompt tokens evaluated in chunks of their own
        self._prefilling_alone = 0  # prompts in a chunk call of their own right now
        # CONFIGURE: T1 settings per slot, and staged T2/T3 changes applied when all are idle.
        self.slot_settings = SlotSettings(self.slots)
        self.reconfigurer = Reconfigurer(self.slots, partial(apply_staged, self))
        # The engine's own tasks run in a scope that outer cancellation cannot reach: the
        # engine outlives its users and is stopped (``stop``) once they have left.
        self._lifetime = trio.CancelScope(shield=True)
        self.t3_reloads = 0
        self.last_t3_reload_ms = 0.0
        self.model_path = backend.model_path
        # Where CONFIGURE T3 may load from: fixed at start, whatever T3 loads later.
        self.model_dir = settings.model_dir or os.path.dirname(os.path.realpath(backend.model_path))
        # The GGUF's own template (else ChatML) until startup.py applies --chat-template[-file].
        self.inputs.set_chat_template(
            resolve_chat_template(
                name=None, file=None, gguf_template=backend.info.chat_template, builtin_names=(),
                gguf_variants=backend.info.chat_template_variants,
            )
        )

    # ---- lifecycle ---------------------------------------------------------------------

    async def run(
        self, *, also: Sequence[Callable[[], Awaitable[object]]] = (),
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the step batcher and the reconfigurer (and ``also``: the face's own tasks, the
        embedder's pump) until ``stop()``, then close the model.

        Cancelling the caller does not stop them: whoever owns the engine calls ``stop()``
        after everything that uses the engine has ended, so no request is left waiting on a
        step of a closed engine."""
        with self._lifetime:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.batcher.run)
                nursery.start_soon(self.reconfigurer.run)
                nursery.start_soon(self.sessions.run)
                nursery.start_soon(self.tiers.run)
                nursery.start_soon(self.inputs.warm_grammars)
                for task in also:
                    nursery.start_soon(task)
                task_status.started()
        with trio.CancelScope(shield=True):
            await self.worker.close(self.backend.close)

    def stop(self) -> None:
        """End ``run``: late steps and GPU calls are refused with a clear error."""
        self._lifetime.cancel()

    @property
    def prompt_tokens_processed(self) -> int:
        """Prompt tokens evaluated for requests: in chunks of their own or in step batches."""
        return self._chunk_prompt_tokens + self.batcher.prompt_tokens

    @property
    def tokens_evaluated(self) -> int:
        """Every token llama.cpp has evaluated for requests: prompt chunks + generation steps."""
        return self.prompt_tokens_processed + self.batcher.tokens

    @property
    def n_ctx(self) -> int:
        """KV cells all slots hold together."""
        return self.backend.n_ctx

    @property
    def n_ctx_slot(self) -> int:
        """The most positions one slot can hold: all of n_ctx with a unified cache, its own
        stream's share with a split one."""
        return self.backend.n_ctx_slot

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def kv_cache_layout(self) -> dict[str, Any]:
        """K/V cache types and V transposition, as blobs made here carry them."""
        return dict(self.backend.cache_layout)

    @property
    def n_vocab(self) -> int:
        return self.backend.info.n_vocab

    def slots_emptied(self, backend: LlamaBackend) -> None:
        """On the worker, once a T2/T3 change has emptied every slot (``backend`` serves now)."""
        if self.slots_emptied_watch is not None:
            self.slots_emptied_watch(backend)

    # ---- CONFIGURE T2/T3 ---------------------------------------------------------------

    @property
    def flash_attn_applied(self) -> str:
        """on | off: what the context uses (CONFIGURE T2 checks cache types against it)."""
        assert self.backend.offload is not None, "set when the context is built"
        return self.backend.offload.flash_attn

    # ---- prefill -----------------------------------------------------------------------

    async def prefill(
        self,
        slot: int,
        tokens: Sequence[int],
        n_keep: int,
        *,
        sampler: Sampler | None = None,
        want_logits: bool = False,
    ) -> tuple[int | None, bytes | None]:
        """Keep the slot's first ``n_keep`` positions and evaluate ``tokens[n_keep:]``.

        While other requests generate, the prompt rides along in their step batches, a token
        budget's worth per batch, so their streams keep their pace. Otherwise it runs in
        ``--batch-size`` chunks, each one cancellable GPU-worker call (the abort flag stops a
        running chunk). Returns the token sampled from the last position (with ``sampler``)
        and its logits (with ``want_logits``)."""
        spans = self._image_spans(tokens)
        # Stops for the context checkpoints of a sliding-window or recurrent model (llama/checkpoints.py);
        # never inside an image (its positions are evaluated in one call).
        for cut in self.backend.checkpoints.cuts(len(tokens), n_keep):
            if any(s.start < cut < s.end for s in spans):
                continue
            await self._evaluate(slot, tokens[:cut], n_keep, sampler=None, want_logits=False)
            await self.worker.call(lambda: self.backend.take_checkpoint(slot))
            n_keep = cut
        return await self._evaluate(slot, tokens, n_keep, sampler=sampler, want_logits=want_logits)

    def _image_spans(self, tokens: Sequence[int]) -> list[Span]:
        """The image spans of a prompt (none without a projector, or in a text prompt)."""
        projector = self.backend.projector
        if projector is None or min(tokens, default=0) >= 0:
            return []
        return media_spans(tokens)

    async def _evaluate(
        self, slot: int, tokens: Sequence[int], n_keep: int, *, sampler: Sampler | None, want_logits: bool
    ) -> tuple[int | None, bytes | None]:
        spans = [s for s in self._image_spans(tokens) if s.end > n_keep]
        if spans:
            return await self._evaluate_images(slot, tokens, n_keep, spans, sampler=sampler, want_logits=want_logits)
        backend = self.backend
        rest = list(tokens[n_keep:])
        if not rest:
            raise ValueError("prefill needs at least one token to evaluate")
        # The slot keeps n_keep of its positions and drops the rest: what it will hold beyond
        # what it holds now is len(tokens) - n_past.
        await self.scheduler.make_room(len(tokens) - backend.n_past(slot), exclude=slot)
        done = 0
        result: tuple[int | None, bytes | None] = (None, None)
        try:
            while done < len(rest):
                keep = n_keep + done  # after the first chunk: what the slot holds already
                # With streams to keep pace with, or another prompt being prefilled alone
                # (requests that arrive together), the prompt goes into the shared batches.
                if self.batcher.generating > 0 or (self._prefilling_alone and done == 0):
                    return await self.batcher.prefill(
                        slot, rest[done:], keep, sampler=sampler, want_logits=want_logits
                    )
                chunk = rest[done : done + backend.n_batch]
                last = done + len(chunk) == len(rest)

                def call(
                    abort: threading.Event, chunk: list[int] = chunk, keep: int = keep, last: bool = last
                ) -> tuple[int | None, bytes | None]:
                    if backend.truncate_slot(slot, keep) != keep:  # first_token cut it already: a no-op
                        raise ProtocolError(ErrorCode.INTERNAL, f"slot {slot}: its KV could not "
                                            f"be cut back to {keep} positions")
                    return backend.eval_chunk(
                        slot, chunk, abort, sampler=sampler if last else None, want_logits=want_logits and last
                    )

                self._prefilling_alone += 1
                try:
                    result = await self.worker.run(call)
                except DecodeAborted:
                    await trio.lowlevel.checkpoint()  # the cancellation that raised the flag
                    raise
                finally:
                    self._prefilling_alone -= 1
                self._chunk_prompt_tokens += len(chunk)
                done += len(chunk)
        except NoKvSpace:
            raise ProtocolError(
                ErrorCode.INTERNAL,
                f"KV cache full: the prompt needs {len(tokens)} positions in slot {slot}; "
                + (
                    f"{self.n_ctx} cells are shared by all slots and the others are in use"
                    if self.backend.kv_unified
                    else f"a slot holds {self.n_ctx_slot} (split KV cache)"
                ),
            ) from None
        return result

    async def _evaluate_images(
        self,
        slot: int,
        tokens: Sequence[int],
        n_keep: int,
        spans: Sequence[Span],
        *,
        sampler: Sampler | None,
        want_logits: bool,
    ) -> tuple[int | None, bytes | None]:
        """A prompt with images: its text runs as any prompt's (chunks, or the step batches),
        each image in a GPU-worker call of its own (mtmd encodes it and decodes its
        embeddings), in order. A slot that holds part of an image continues from its start."""
        if spans[0].start < n_keep:
            n_keep = spans[0].start
        if spans[-1].end >= len(tokens):
            raise ProtocolError(ErrorCode.BAD_JSON, "a prompt cannot end with an image: its last position must be text",
                                status=Status.BAD_REQUEST)
        backend = self.backend
        at = n_keep
        for span in spans:
            if at < span.start:  # the text before it
                await self._evaluate(slot, tokens[: span.start], at, sampler=None, want_logits=False)
            await self.scheduler.make_room(span.end - backend.n_past(slot), exclude=slot)

            def call(
                _abort: threading.Event, keep: int = span.start, ids: Sequence[int] = tokens[span.start : span.end]
            ) -> int:
                if backend.truncate_slot(slot, keep) != keep:
                    raise ProtocolError(ErrorCode.INTERNAL, f"slot {slot}: its KV could not "
                                        f"be cut back to {keep} positions")
                return backend.eval_image(slot, ids)

            try:
                self._chunk_prompt_tokens += await self.worker.run(call)
            except NoKvSpace:
                raise ProtocolError(ErrorCode.INTERNAL, f"KV cache full: the prompt needs {len(tokens)} positions in "
                                    f"slot {slot}") from None
            except KeyError:
                raise ProtocolError(ErrorCode.SLOT_BUSY, "an image of this prompt was dropped before its turn (too "
                                    "many images "
                                    "waiting at once); send it again") from None
            at = span.end
        return await self._evaluate(slot, tokens, at, sampler=sampler, want_logits=want_logits)

    async def first_token(
        self,
        slot: int,
        tokens: Sequence[int],
        sampler: Sampler,
        res: GenerationResult,
        params: GenerationParams,
        *,
        want_logits: bool = False,
    ) -> tuple[int | None, bytes | None]:
        """Bring the slot to hold the prompt (``reuse_plan``) under the request's cache salt
        and LoRA adapter set and sample the token after it (None: the context is full); with
        ``want_logits`` also the logits it came from. The plan goes into ``res`` first, so a
        cancelled prefill still reports its work."""
        logits = await self.scheduler.bring(slot, tokens, params.cache_salt, params.lora, res)
        if logits is not None:
            reused = logits
            token = await self.worker.call(lambda: self.backend.sample_from_logits(sampler, reused))
            return token, logits
        return await self.prefill(slot, tokens, res.n_common, sampler=sampler, want_logits=want_logits)

    def new_sampler(self, params: GenerationParams, *, logprobs: int | None = None) -> Sampler:
        """A request's sampler (engine/sample/), its grammar compiled already (prepare)."""
        backend = self.backend
        grammars = self.inputs.grammars if params.sampling.grammar is not None else None
        think = params.think_gate(backend.text_of(params.shown_tokens))
        return Sampler(
            params.sampling,
            grammars=grammars,
            think=think,
            logprobs=logprobs,
            fast_path=self.settings.sampling_fast_path,
        )

    async def sample_first(
        self, slot: int, tokens: Sequence[int], params: GenerationParams
    ) -> tuple[GenerationResult, bytes]:
        """Bring the slot to hold the prompt and sample the one token a P/D prefill answers
        with, by generation's own rules (OutputProcessor: stop decision, text, counts);
        returns it as a completion, with the logits it came from (they travel with the KV)."""
        res = GenerationResult(prompt_tokens=len(tokens))
        sampler = self.new_sampler(params)
        one = replace(params, n_predict=1, logprobs=None)
        out = OutputProcessor(
            one, res, sampler, is_eog=self.backend.is_eog, token_bytes=self.backend.text_of(params.shown_tokens)
        )
        t_start = time.perf_counter()
        try:
            token, logits = await self.first_token(slot, tokens, sampler, res, params, want_logits=True)
        finally:
            self.backend.retire(sampler)
        assert token is not None and logits is not None, "a prompt that fits leaves room for one token"
        sampler.raise_failure()
        out.started(t_start)
        out.take(token)  # ends it: one token at most
        if res.completion_tokens:
            self.tokens_generated += 1
        out.finish()
        return res, logits

    # ---- generation steps (batched) ----------------------------------------------------

    async def _run_mixed(
        self, reqs: Sequence[StepRequest], parts: Sequence[PrefillPart]
    ) -> tuple[list[int | None], list[PartOutcome]]:
        return await self.worker.call(lambda: self.backend.step_mixed(reqs, parts))

    # ---- generation --------------------------------------------------------------------

    async def generate(
        self,
        slot: int,
        prompt_tokens: Sequence[int],
        params: GenerationParams,
        emit: Emit,
        *,
        result: GenerationResult | None = None,
    ) -> GenerationResult:
        """Prefill what the slot lacks of the prompt, then sample until a stop condition.

        ``result`` is filled in as generation goes (callers read it even if cancelled).
        When the slot holds exactly the prompt with its last position's logits (a restored
        hand-off, or a PREFILL on this engine), the first token is sampled from them without
        recomputing anything.
        """
        res = result if result is not None else GenerationResult()
        res.prompt_tokens = len(prompt_tokens)
        backend = self.backend
        sampler = self.new_sampler(params, logprobs=params.logprobs)
        out = OutputProcessor(
            params, res, sampler, is_eog=backend.is_eog, token_bytes=backend.text_of(params.shown_tokens)
        )
        spec = request_speculation(
            self.settings, params.speculative, self.backend.info.can_roll_back, self.spec_counts,
            self.ngram_memories.for_salt(params.cache_salt),
        )
        t_start = time.perf_counter()
        try:
            token, _ = await self.first_token(slot, prompt_tokens, sampler, res, params)
            out.started(t_start)
            self.batcher.generating += 1
            try:
                run: tuple[int | None, ...] = (token,)  # what the last step sampled, in order
                while True:
                    # Each token as if it came alone: the stop decision and stream_interval's
                    # chunks are those of one token per step; only the chunks' sending waits
                    # for the next step to be handed in.
                    sends: list[str] = []
                    ended = False
                    for tok in run:
                        if out.take(tok):
                            ended = True
                            break
                        self.tokens_generated += 1
                        if (send := out.ready()) is not None:
                            sends.append(send)
                    if ended:
                        break
                    last = run[-1]
                    assert last is not None
                    # Pipelined: the next token is computed while this text goes to readers.
                    job = self.batcher.submit(slot, last, sampler, out.remaining, spec)
                    run = await self.batcher.result(job, _emit_all(emit, sends) if sends else None) or (None,)
                for send in sends:
                    await emit(send)
                sampler.raise_failure()  # a grammar that ended it: an error, not a reply
                if res.stop_type not in ("eos", "context"):
                    self.tokens_generated += 1  # the last token, which ended it
                if (send := out.unsent()) is not None:
                    await emit(send)
                assert res.first_token_at is not None
                res.decode_ms = (time.perf_counter() - res.first_token_at) * 1000.0
            finally:
                self.batcher.generating -= 1
                await self.batcher.drop_ahead(slot)
                if spec is not None:
                    res.spec_drafted, res.spec_accepted = spec.counts.draft_tokens, spec.counts.accepted
            tail = out.finish()
            if tail:
                await emit(tail)
            return res
        finally:
            backend.retire(sampler)

    # ---- a slot's KV (copy-out and restore: lease.py) -------------------------------------

    async def clear_slot(self, slot: int) -> None:
        await self.worker.call(lambda: self.backend.clear_slot(slot))

    def n_past(self, slot: int) -> int:
        return self.backend.n_past(slot)

    def slot_tokens(self, slot: int) -> list[int]:
        """The tokens the slot's KV holds (a copy)."""
        return list(self.backend.seq_tokens[slot])

    def state_size(self, slot: int) -> int:
        """Exact serialized size without a GPU-worker call (STATE_META must stay cheap)."""
        return self.backend.slot_state_size(slot)

