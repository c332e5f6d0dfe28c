"""The engine: one model, N slots, one GPU worker; prefill, generation and state transfer.

Request tasks never call llama.cpp themselves: they ask the engine for work (a prefill
chunk, a generation step). Generation steps of all generating slots are batched into one
llama_decode by the step batcher (``batcher.py``); prefill chunks interleave with those
batches on the one GPU worker. CONFIGURE's per-slot settings and staged rebuilds live in
``reconfigure.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from ..config import CACHE_TYPES, Settings
from ..model.identity import ModelIdentity, read_identity
from ..wire.errors import ErrorCode, ProtocolError, Status
from ..wire.kvblob import KvBlob, encode_blob_head
from ..wire.kvevents import Event
from .batcher import PartOutcome, StepBatcher
from .kvblocks import SlotBlocks
from .llama.chat import apply_builtin_chat_template
from .llama.context import LlamaBackend, PrefillPart, StepRequest
from .llama.devices import OffloadSettings
from .llama.sampling import Sampler
from .llama.state import DecodeAborted, NoKvSpace
from .logprobs import TokenLogprobs
from .params import GenerationParams, parse_generation
from .promptcache import PromptCache
from .reconfigure import Reconfigurer, SlotSettings
from .slots import Slot, SlotTable
from .stats import EngineStats, SlotInfo
from .templates import ChatTemplate, PromptRenderer, resolve_chat_template
from .text import TextAssembler
from .worker import CallTiming, GpuWorker

log = logging.getLogger(__name__)

# The most prompt text per context position: longer text cannot fit a slot with any usual
# vocabulary, so it is refused before it is tokenized (tokenizing holds the GPU worker, and
# a multi-megabyte prompt would stall every stream for seconds).
MAX_PROMPT_BYTES_PER_POSITION = 32
# A token id in a JSON array: up to 7 digits, its comma, and the indentation of a
# pretty-printed body (json.dumps(indent=4) inside an object: 8 spaces and a newline).
MAX_TOKEN_ID_JSON_BYTES = 24

# A slot's history goes to the prompt cache when it would drop at least this many positions
# (a KV-event block), and an entry comes back when it holds at least this many more.
MIN_CACHED_TOKENS = 16

Emit = Callable[[str], Awaitable[None]]


@dataclass(slots=True)
class GenerationResult:
    prompt_tokens: int = 0
    n_common: int = 0  # prompt tokens found in the slot's KV (not recomputed)
    n_prompt_processed: int = 0  # prompt tokens evaluated by this request
    logits_reused: bool = False  # first token sampled from logits that came with the KV
    completion_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)  # joined on read: appends stay O(1)
    stop_type: str = "limit"  # eos | word | limit | context
    stopping_word: str = ""
    prompt_ms: float = 0.0  # generation start -> first token sampled (prefill of the delta)
    decode_ms: float = 0.0  # first token -> last token
    first_token_at: float | None = None  # perf_counter() when the first token was sampled
    tokens: list[int] = field(default_factory=list)
    # Seconds between consecutive sampled tokens (vllm:inter_token_latency_seconds).
    token_gaps_s: array[float] = field(default_factory=lambda: array("d"))
    # Per generated token (``tokens``), when the request asked for logprobs (engine/logprobs.py).
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def text(self) -> str:
        if len(self.text_parts) > 1:
            self.text_parts[:] = ["".join(self.text_parts)]
        return self.text_parts[0] if self.text_parts else ""

    @text.setter
    def text(self, value: str) -> None:
        self.text_parts[:] = [value]

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stop_type in ("eos", "word") else "length"

    @property
    def tokens_per_s(self) -> float:
        if self.completion_tokens <= 1 or self.decode_ms <= 0:
            return 0.0
        return (self.completion_tokens - 1) / (self.decode_ms / 1000.0)


class Engine:
    def __init__(self, backend: LlamaBackend, identity: ModelIdentity, settings: Settings) -> None:
        self.backend = backend
        self.identity = identity
        self.settings = settings
        self.worker = GpuWorker()
        self.slots = SlotTable(backend.n_slots)
        self.model_load_ms = 0.0
        self.warmup_ms: float | None = None  # None: no warm-up ran (--no-warmup)
        # Prompt tokens per step batch: steps first, then a chunk of an arriving prompt.
        budget = min(settings.step_token_budget, backend.n_batch)
        self.batcher = StepBatcher(
            backend.n_slots,
            lambda reqs: self.backend.step(reqs),
            lambda fn: self.worker.call(fn, yields=True),
            self._run_mixed,
            token_budget=budget,
            alone_budget=backend.n_batch,
            worker_free=self.worker.wait_while_busy,
            is_eog=lambda token: self.backend.is_eog(token),
            wants_turn=self.worker.wants_turn,
        )
        self.tokens_generated = 0
        # The slots' KV blocks, for KV events (kvblocks.py); None: nobody subscribes.
        self.kv_blocks: SlotBlocks | None = None
        # Slots' KV kept past the slots (promptcache.py); None: --cache-ram-mib 0.
        self.prompt_cache = PromptCache(settings.cache_ram_mib << 20) if settings.cache_ram_mib > 0 else None
        self._chunk_prompt_tokens = 0  # prompt tokens evaluated in chunks of their own
        self._prefilling_alone = 0  # prompts in a chunk call of their own right now
        # CONFIGURE: T1 settings per slot, and staged T2/T3 changes applied when all are idle.
        self.slot_settings = SlotSettings(self.slots)
        self.reconfigurer = Reconfigurer(self.slots, self._apply_staged)
        # The engine's own tasks run in a scope that outer cancellation cannot reach: the
        # engine outlives its users and is stopped (``stop``) once they have left.
        self._lifetime = trio.CancelScope(shield=True)
        self.t3_reloads = 0
        self.last_t3_reload_ms = 0.0
        self.model_path = backend.model_path
        # Where CONFIGURE T3 may load from: fixed at start, whatever T3 loads later.
        self.model_dir = settings.model_dir or os.path.dirname(os.path.realpath(backend.model_path))
        # The GGUF's own template (else ChatML) until load() applies --chat-template[-file].
        self.set_chat_template(
            resolve_chat_template(name=None, file=None, gguf_template=backend.info.chat_template, builtin_names=())
        )

    # ---- lifecycle ---------------------------------------------------------------------

    @classmethod
    async def load(cls, model_path: str, settings: Settings, *, alias: str | None = None) -> Engine:
        t0 = time.perf_counter()
        identity = await trio.to_thread.run_sync(lambda: read_identity(model_path, alias=alias))
        worker_limiter = trio.CapacityLimiter(1)  # the engine's worker takes over after load
        offload = OffloadSettings(
            n_gpu_layers=settings.n_gpu_layers,
            main_gpu=settings.main_gpu,
            flash_attn=settings.flash_attn,
            kv_offload=not settings.no_kv_offload,
            repack=settings.repack,
        )
        backend = await trio.to_thread.run_sync(
            lambda: LlamaBackend(
                model_path,
                n_slots=settings.slots,
                n_ctx=settings.ctx_size,
                n_threads=settings.threads,
                n_batch=settings.batch_size,
                type_k=CACHE_TYPES[settings.cache_type_k],
                type_v=CACHE_TYPES[settings.cache_type_v],
                offload=offload,
                kv_unified=settings.kv_unified,
            ),
            limiter=worker_limiter,
        )
        try:
            if settings.warmup:
                # Said before the call: if a kernel faults, this is the last line in the log.
                log.info("warming up: one prompt and one step on slot 0 (--no-warmup skips it; weights %s)",
                         "repacked" if backend.repack.enabled else "not repacked")
                t_warm = time.perf_counter()
                await trio.to_thread.run_sync(backend.warmup, limiter=worker_limiter)
                engine_warmup_ms: float | None = (time.perf_counter() - t_warm) * 1000.0
            else:
                engine_warmup_ms = None
            template = resolve_chat_template(
                name=settings.chat_template,
                file=settings.chat_template_file,
                gguf_template=backend.info.chat_template,
                builtin_names=backend.builtin_templates,
            )
        except BaseException:
            await trio.to_thread.run_sync(backend.close, limiter=worker_limiter)
            raise
        engine = cls(backend, identity, settings)
        engine.set_chat_template(template)
        engine.model_load_ms = (time.perf_counter() - t0) * 1000.0
        engine.warmup_ms = engine_warmup_ms
        log.info(
            "model loaded in %.0f ms: %s (%s, %s), %d slots, n_ctx %d, KV cache %s (a slot holds up to %d; %s), %d threads",
            engine.model_load_ms,
            identity.model_name,
            identity.model_quant,
            identity.tokenizer,
            backend.n_slots,
            backend.n_ctx,
            engine.kv_layout,
            backend.n_ctx_slot,
            ", ".join(f"{k} {v}" for k, v in backend.cache_layout.items()) or "layout not read",
            backend.n_threads,
        )
        assert backend.offload is not None
        log.info("offload: %s", backend.offload.summary())
        log.info("chat template: %s (%s)", template.name, template.source)
        return engine

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the step batcher and the reconfigurer until ``stop()``, then close the model.

        Cancelling the caller does not stop them: whoever owns the engine calls ``stop()``
        after everything that uses the engine has ended, so no request is left waiting on a
        step of a closed engine."""
        with self._lifetime:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.batcher.run)
                nursery.start_soon(self.reconfigurer.run)
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
    def kv_layout(self) -> str:
        return "unified" if self.backend.kv_unified else "split"

    @property
    def n_vocab(self) -> int:
        return self.backend.info.n_vocab

    def stats(self) -> EngineStats:
        """A snapshot for metrics, logs and /health: no reader counts slots itself."""
        slots, batcher, worker = self.slots, self.batcher, self.worker
        return EngineStats(
            slots=len(slots),
            slots_busy=slots.n_busy,
            requests_waiting=slots.waiting,
            kv_cells_total=self.n_ctx,
            kv_cells_used=self.backend.cells_in_use(),
            kv_cells_running=sum(self.backend.n_past(s.id) for s in slots.slots if s.busy),
            tokens_generated=self.tokens_generated,
            prompt_tokens_processed=self.prompt_tokens_processed,
            tokens_evaluated=self.tokens_evaluated,
            step_batches=batcher.batches,
            step_tokens=batcher.tokens,
            step_prompt_tokens=batcher.prompt_tokens,
            worker_busy_s=worker.busy_s,
            worker_calls=worker.calls,
            llama_decode_s=self.backend.decode_s,
            model_load_s=self.model_load_ms / 1000.0,
        )

    def slot_info(self, slot_id: int) -> SlotInfo:
        """The one description of a slot (/slots, STATE_META); NO_SLOT for an unknown id."""
        slot = self.slots.get(slot_id)
        return SlotInfo(
            slot.id, slot.owner, slot.transferring, self.n_past(slot_id), self.n_ctx_slot, self.state_size(slot_id)
        )

    def publish_kv_events(self, publish: Callable[[list[Event]], None], block_size: int) -> SlotBlocks:
        """From now on, every change of what the slots hold goes to ``publish`` as KV events,
        after the GPU-worker call that made it (on the trio thread)."""
        blocks = self.kv_blocks = SlotBlocks(self.backend.n_slots, block_size)
        self.backend.watcher = blocks
        self.worker.after_call = lambda: publish(blocks.take()) if blocks.pending else None
        return blocks

    async def resync_kv_events(self) -> None:
        """Tell everything the slots hold anew (for a new subscriber), between worker calls."""
        if self.kv_blocks is not None:
            await self.worker.call(self.kv_blocks.resync)

    def _slots_emptied(self, backend: LlamaBackend) -> None:
        """On the worker, once a T2/T3 change has emptied every slot (``backend`` serves now)."""
        if self.kv_blocks is not None:
            backend.watcher = self.kv_blocks
            self.kv_blocks.all_cleared()

    # ---- CONFIGURE T2/T3 ---------------------------------------------------------------

    async def _apply_staged(self, changes: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        if self.prompt_cache is not None:
            self.prompt_cache.clear()  # states of the old context or model fit neither
        if "model_path" in changes:
            path = changes["model_path"]
            identity = await trio.to_thread.run_sync(lambda: read_identity(path, alias=self.identity.model_alias if self.settings.alias else None))
            old = self.backend

            def load(_abort: threading.Event) -> LlamaBackend:
                new = LlamaBackend(
                    path,
                    n_slots=old.n_slots,
                    n_ctx=changes.get("n_ctx", old.n_ctx),
                    n_threads=old.n_threads,
                    n_batch=old.n_batch,
                    type_k=changes.get("cache_type_k", old.type_k),
                    type_v=changes.get("cache_type_v", old.type_v),
                    offload=old.offload_settings,
                    kv_unified=old.kv_unified,
                )
                if self.settings.warmup:  # a kernel that faults on the new model faults here
                    new.warmup()
                self._slots_emptied(new)
                return new

            new = await self.worker.run(load)
            self.backend, self.identity, self.model_path = new, identity, path
            # An operator's template stays; a GGUF-derived one follows the new GGUF. Either way
            # the renderer takes the new vocabulary's BOS/EOS text.
            keep = self.chat_template.source not in ("gguf", "fallback")
            self.set_chat_template(
                self.chat_template
                if keep
                else resolve_chat_template(name=None, file=None, gguf_template=new.info.chat_template, builtin_names=())
            )
            await self.worker.call(old.close)
            self.t3_reloads += 1
            self.last_t3_reload_ms = (time.perf_counter() - t0) * 1000.0
            log.info("T3: model reloaded from %s in %.0f ms (%s)", path, self.last_t3_reload_ms, identity.model_name)
        else:
            b = self.backend

            def rebuild(_abort: threading.Event) -> None:
                try:
                    b.rebuild_context(
                        n_ctx=changes.get("n_ctx"), type_k=changes.get("cache_type_k"), type_v=changes.get("cache_type_v")
                    )
                finally:  # also when it failed: the previous setup was rebuilt, empty
                    self._slots_emptied(b)

            await self.worker.run(rebuild)
            log.info("T2: context rebuilt in %.0f ms: %s", (time.perf_counter() - t0) * 1000.0, changes)

    # ---- prompts -----------------------------------------------------------------------

    def set_chat_template(self, template: ChatTemplate) -> None:
        info = self.backend.info
        self.chat_template = template
        self._prompts = PromptRenderer(
            template,
            bos_token=info.bos_text,
            eos_token=info.eos_text,
            tokenizer_adds_bos=info.add_bos,
            run_on_worker=self.worker.call,
            apply_builtin=apply_builtin_chat_template,
        )

    def runtime_fields(self) -> dict[str, Any]:
        """Where the model runs (ggml devices, layers offloaded, flash attention), how its KV
        cache is laid out and which chat template renders prompts: for /version and INFO."""
        offload = self.backend.offload
        assert offload is not None, "set when the context is built"
        return {
            **offload.as_dict(),
            "kv_unified": self.backend.kv_unified,
            "n_ctx_slot": self.n_ctx_slot,
            "kv_cache": self.backend.cache_layout,  # type_k, type_v, v_trans
            "chat_template": self.chat_template.as_dict(),
        }

    def generation_params(self, request: dict[str, Any]) -> GenerationParams:
        """A request's generation settings, with this engine's defaults and limits."""
        s = self.settings
        return parse_generation(
            request, default_n_predict=s.default_n_predict, n_ctx=self.n_ctx_slot, default_stream_interval=s.stream_interval
        )

    async def render_prompt(self, request: dict[str, Any]) -> str:
        """The prompt text of a request (chat template or plain prompt); refuses bad shapes."""
        return await self._prompts.render(request)

    async def tokenize_request(self, request: dict[str, Any]) -> list[int]:
        return await self.tokenize_text(await self.render_prompt(request))

    @property
    def max_request_json_bytes(self) -> int:
        """The largest prompt-route JSON body worth parsing: the longest text a slot can take
        (MAX_PROMPT_BYTES_PER_POSITION a position), three times over for JSON's escapes
        (a six-byte \\u escape for a 2- or 3-byte character, two for a 4-byte one), plus 1 MiB for the rest
        of the request (messages' structure, a tool schema, sampling fields). Token-id arrays
        take at most 8 bytes an id."""
        return 3 * MAX_PROMPT_BYTES_PER_POSITION * self.n_ctx_slot + (1 << 20)

    @property
    def max_token_ids_json_bytes(self) -> int:
        """The largest /detokenize body worth parsing: an array of at most n_ctx ids (what all
        slots hold together; more is refused anyway), MAX_TOKEN_ID_JSON_BYTES an id, plus
        64 KiB for the rest. Parsing holds the GIL even on another thread, so a body this
        route refuses must never cost more to parse than the largest one it serves (a
        12 MB array of 4 M ids: 0.2-0.4 s of every stream's time)."""
        return MAX_TOKEN_ID_JSON_BYTES * self.n_ctx + (64 << 10)

    def check_text_fits(self, text: str) -> None:
        """Refuse text too long for a slot before any per-token work (see
        MAX_PROMPT_BYTES_PER_POSITION)."""
        limit = MAX_PROMPT_BYTES_PER_POSITION * self.n_ctx_slot
        if len(text) <= limit // 4:  # 4 UTF-8 bytes a character at most: no need to encode
            return
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        if n_bytes > limit:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"text of {n_bytes} bytes: a slot holds {self.n_ctx_slot} positions, "
                f"and text over {MAX_PROMPT_BYTES_PER_POSITION} bytes a position is refused untokenized",
                status=Status.BAD_REQUEST,
            )

    async def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        """Text -> tokens on the GPU worker, bounded: text no slot could hold is refused first."""
        self.check_text_fits(text)
        try:
            return await self.worker.call(
                lambda: self.backend.tokenize(text, add_special=add_special, parse_special=parse_special)
            )
        except UnicodeEncodeError:  # JSON's "\ud800": a str, but no UTF-8 (benchmarks/hostile.py)
            raise ProtocolError(
                ErrorCode.BAD_JSON, "text holds a lone surrogate (U+D800..U+DFFF): not valid Unicode", status=Status.BAD_REQUEST
            ) from None

    async def tokenize_text(self, text: str) -> list[int]:
        """Prompt text -> tokens, refusing prompts that cannot fit."""
        tokens = await self.tokenize(text, add_special=True)
        if not tokens:
            raise ProtocolError(ErrorCode.BAD_JSON, "prompt is empty", status=Status.BAD_REQUEST)
        self.check_prompt_fits(len(tokens))
        return tokens

    def _slot_room(self) -> str:
        """What a prompt or blob refused for its length is told of the slots."""
        return (
            f"a slot holds {self.n_ctx_slot} with room for one generated token "
            f"({self.kv_layout} KV cache of {self.n_ctx} cells, {self.backend.n_slots} slots)"
        )

    def check_prompt_fits(self, n_tokens: int) -> None:
        """Refuse a prompt no slot can hold (with room for one generated token)."""
        if n_tokens >= self.n_ctx_slot:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"prompt has {n_tokens} tokens; {self._slot_room()}",
                status=Status.BAD_REQUEST,
            )

    # ---- prefill -----------------------------------------------------------------------

    def reuse_plan(self, slot: int, tokens: Sequence[int], salt: str | None = None) -> tuple[int, bytes | None]:
        """How much of the slot's KV a prompt continues from: the one prefix-reuse policy of
        every path that continues a slot (generation, the P/D export).

        Returns ``(n_keep, logits)``. With logits, the slot holds exactly the prompt and the
        logits of its last position: nothing is evaluated, the first token is sampled from
        them. Otherwise keep ``n_keep`` positions and evaluate the rest: at least the last
        prompt token (for its logits), and nothing of a sliding window the slot has dropped.
        """
        backend = self.backend
        cached = backend.seq_tokens[slot]
        n_common = backend.shared_prefix(slot, tokens, salt)
        if n_common == len(tokens):
            logits = backend.tail_logits[slot]
            if logits is not None and n_common == len(cached):
                return n_common, logits
            n_common -= 1  # re-evaluate the last prompt token for its logits
        return backend.reusable_prefix(slot, n_common), None

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
        and its logits (with ``want_logits``).
        """
        backend = self.backend
        rest = list(tokens[n_keep:])
        if not rest:
            raise ValueError("prefill needs at least one token to evaluate")
        # The slot keeps n_keep of its positions and drops the rest: what it will hold beyond
        # what it holds now is len(tokens) - n_past.
        await self.make_room(len(tokens) - backend.n_past(slot), exclude=slot)
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

                def call(abort: threading.Event, chunk: list[int] = chunk, keep: int = keep, last: bool = last) -> tuple[int | None, bytes | None]:
                    backend.truncate_slot(slot, keep)
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

    async def first_token(
        self,
        slot: int,
        tokens: Sequence[int],
        sampler: Sampler,
        res: GenerationResult,
        *,
        want_logits: bool = False,
        salt: str | None = None,
    ) -> tuple[int | None, bytes | None]:
        """Bring the slot to hold the prompt (``reuse_plan``) under the request's cache
        ``salt`` and sample the token after it (None: the context is full); with
        ``want_logits`` also the logits it came from. The plan goes into ``res`` first, so a
        cancelled prefill still reports its work."""
        await self._swap_in(slot, tokens, salt)
        res.n_common, logits = self.reuse_plan(slot, tokens, salt)
        res.logits_reused = logits is not None
        await self._keep_history(slot, res.n_common)
        await self._adopt_salt(slot, salt)
        if logits is not None:
            reused = logits
            token = await self.worker.call(lambda: self.backend.sample_from_logits(sampler, reused))
            return token, logits
        res.n_prompt_processed = len(tokens) - res.n_common
        return await self.prefill(slot, tokens, res.n_common, sampler=sampler, want_logits=want_logits)

    # ---- generation steps (batched) ----------------------------------------------------

    async def _run_mixed(self, reqs: Sequence[StepRequest], parts: Sequence[PrefillPart]) -> tuple[list[int | None], list[PartOutcome]]:
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
        sampler = Sampler(params.sampling, logprobs=params.logprobs)  # built inside its first GPU-worker call
        assembler = TextAssembler(params.stop)
        t_start = time.perf_counter()
        try:
            token, _ = await self.first_token(slot, prompt_tokens, sampler, res, salt=params.cache_salt)
            t_first = t_last = time.perf_counter()
            res.first_token_at = t_first
            res.prompt_ms = (t_first - t_start) * 1000.0
            self.batcher.generating += 1
            pending: list[str] = []  # text not handed to readers yet (stream_interval)
            unsent = 0  # tokens whose text is in pending
            try:
                while True:
                    if token is None:
                        res.stop_type = "context"
                        break
                    if backend.is_eog(token):
                        res.stop_type = "eos"
                        break
                    res.tokens.append(token)
                    if params.logprobs is not None:  # recorded by the worker call that sampled it
                        res.logprobs.append(sampler.picked[res.completion_tokens])
                    now = time.perf_counter()
                    if res.completion_tokens:
                        res.token_gaps_s.append(now - t_last)
                    t_last = now
                    res.completion_tokens += 1
                    self.tokens_generated += 1
                    delta = assembler.push(backend.token_bytes(token))
                    if delta:
                        res.text_parts.append(delta)
                        pending.append(delta)
                    unsent += 1
                    if assembler.stopped_by is not None:
                        res.stop_type = "word"
                        res.stopping_word = assembler.stopped_by
                        break
                    if res.completion_tokens >= params.n_predict:
                        res.stop_type = "limit"
                        break
                    # The first token goes out at once, then every stream_interval tokens.
                    send = None
                    if pending and (res.completion_tokens == 1 or unsent >= params.stream_interval):
                        send = pending[0] if len(pending) == 1 else "".join(pending)
                        pending.clear()
                        unsent = 0
                    # Pipelined: the next token is computed while this text goes to readers.
                    job = self.batcher.submit(slot, token, sampler, params.n_predict - res.completion_tokens)
                    token = await self.batcher.result(job, emit(send) if send else None)
                if pending:
                    await emit("".join(pending))
                res.decode_ms = (time.perf_counter() - t_first) * 1000.0
            finally:
                self.batcher.generating -= 1
                await self.batcher.drop_ahead(slot)
            tail = assembler.finish()
            if tail:
                res.text_parts.append(tail)
                await emit(tail)
            return res
        finally:
            backend.retire(sampler)

    # ---- state transfer ----------------------------------------------------------------

    async def state_get(self, slot: int) -> tuple[bytes, bytearray, int]:
        """(blob head, llama state, n_past) of the slot; the blob is head + state (+ logits)."""
        state, tokens = await self.worker.call(lambda: self.backend.state_get(slot))
        return encode_blob_head(len(tokens), tokens), state, len(tokens)

    async def state_restore(
        self, slot: int, blob: KvBlob, timing: CallTiming | None = None, *, salt: str | None = None
    ) -> None:
        """Restore a parsed v2 blob into the slot, all-or-nothing, as ``salt``'s history (the
        cache_salt of the request it serves; None: unsalted). Trailing logits become the
        slot's tail logits (``reuse_plan``)."""
        if blob.checkpoint is not None and not self.backend.info.recurrent:
            raise ProtocolError(
                ErrorCode.BAD_FRAME,
                "kv blob carries a recurrent-state checkpoint; the resident model is not recurrent",
            )
        if blob.n_past >= self.n_ctx_slot:
            raise ProtocolError(
                ErrorCode.RESTORE_FAILED,
                f"blob holds {blob.n_past} positions; {self._slot_room()}",
            )
        await self.make_room(blob.n_past, exclude=slot)

        def call(abort: threading.Event) -> None:
            self.backend.state_restore(slot, blob.state, blob.tokens, blob.n_past, abort, blob=blob.raw, salt=salt)

        try:
            await self.worker.run(call, timing)
        except DecodeAborted:
            await trio.lowlevel.checkpoint()
            raise

    async def make_room(self, needed: int, *, exclude: int) -> None:
        """Free the KV of idle slots (least recently used first) until ``needed`` more cells
        fit in the shared cache. A victim is claimed while it is cleared, so no request can
        start on it halfway."""
        backend = self.backend
        while backend.pool_is_tight(needed):
            idle = [
                s for s in self.slots.slots
                if not s.busy and s.id != exclude and backend.n_past(s.id) > 0
            ]
            if not idle:
                return  # nothing to free: llama.cpp reports the shortage
            victim = min(idle, key=lambda s: s.last_used)
            self.slots.claim(victim.id, "evict")
            try:
                log.info("KV cache full: evicting idle slot %d (%d positions)", victim.id, backend.n_past(victim.id))
                await self.worker.call(lambda v=victim.id: backend.clear_slot(v))
            finally:
                self.slots.release(victim)

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

    def slot_claim(self, slot_id: int, owner: str) -> Slot:
        return self.slots.claim(slot_id, owner)

    def release(self, slot: Slot) -> None:
        self.slots.release(slot)

    async def claim_for_prompt(self, prompt_tokens: Sequence[int], owner: str, salt: str | None = None) -> Slot:
        """A free slot for the prompt under ``salt`` (``slot_rank``); waits for one for as
        long as the caller's scope allows."""
        return await self.slots.claim_any(owner, lambda i: self.slot_rank(i, prompt_tokens, salt))

    def slot_rank(self, slot: int, prompt: Sequence[int], salt: str | None = None) -> tuple[int, int]:
        """The slot-choice policy (higher is better; claim_any breaks ties by least recently
        used): a slot whose KV shares at least ``--slot-prompt-similarity`` of the prompt,
        the longest shared prefix first; then an empty slot; then any. A 9-token chat
        template head does not make a prompt take over another session's history."""
        held = self.backend.seq_tokens[slot]
        n_common = self.backend.shared_prefix(slot, prompt, salt)
        share = self.settings.slot_prompt_similarity
        reuse = n_common if n_common and n_common >= share * len(prompt) else 0
        return reuse, int(not held)

    # ---- the prompt cache (slots' KV in host memory) -----------------------------------

    async def _keep_history(self, slot: int, n_keep: int) -> None:
        """Before the slot drops what it holds past ``n_keep``: copy it into the prompt
        cache, when that is a block's worth or more."""
        cache = self.prompt_cache
        if cache is None or self.backend.n_past(slot) - n_keep < MIN_CACHED_TOKENS:
            return
        snap = await self.worker.call(lambda: self.backend.snapshot(slot))
        if cache.put(snap):
            log.debug("prompt cache: kept slot %d's %d positions (%d entries, %d bytes)", slot, len(snap.tokens), len(cache), cache.nbytes)

    async def _adopt_salt(self, slot: int, salt: str | None) -> None:
        """Make the slot's history ``salt``'s. A request under another salt than the slot's
        continues none of it (``shared_prefix`` gave 0, and the prompt cache has it now), so
        the slot is emptied before it is relabelled: no position computed under one salt
        ever carries another (a prefill cancelled before its first chunk would leave them)."""
        backend = self.backend
        if backend.seq_salt[slot] == salt:
            return
        if backend.seq_tokens[slot]:
            await self.worker.call(lambda: backend.clear_slot(slot))
        backend.seq_salt[slot] = salt

    async def _swap_in(self, slot: int, prompt: Sequence[int], salt: str | None = None) -> None:
        """When the prompt cache holds more of the prompt (under the request's ``salt``) than
        the slot does, put that entry into the slot (the slot's own history goes to the
        cache first)."""
        cache = self.prompt_cache
        if cache is None:
            return
        hit = cache.best(prompt, salt)
        held = self.backend.shared_prefix(slot, prompt, salt)
        if hit is None or hit.n_common < held + MIN_CACHED_TOKENS:
            return
        await self._keep_history(slot, held)
        snap = cache.take(hit.key)
        await self.make_room(len(snap.tokens), exclude=slot)
        view = memoryview(snap.buf)

        def call(abort: threading.Event) -> None:
            self.backend.state_restore(
                slot, view[snap.offset :], snap.tokens, len(snap.tokens), abort, blob=view, salt=snap.salt
            )

        try:
            await self.worker.run(call)
        except DecodeAborted:
            await trio.lowlevel.checkpoint()
            raise
        except ProtocolError as err:  # our own state: only a full shared pool refuses it
            log.warning("prompt cache: entry of %d positions not restored into slot %d: %s", len(snap.tokens), slot, err.message)
            return
        log.debug("prompt cache: slot %d continues %d cached positions", slot, len(snap.tokens))
