"""The engine's face: what the front ends (HTTP, RPC, DECODE, the P/D hand-off, metrics) may
use of the engine, as vLLM's ``EngineClient`` is theirs. Everything behind it (the backend,
the worker, the slots, the batcher, the scheduler, the prompt cache) is the core's
(core.py). A slot's life is ``async with engine.claim(...) as lease`` (lease.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, overload

import trio

from ..concurrency import raise_single
from ..config import Settings
from ..model.identity import ModelIdentity
from ..wire import sampling as sampling_keys
from ..wire.errors import ErrorCode, ProtocolError, bad_param
from ..wire.kvevents import Event
from .adapters import LoraAdapters
from .chat import ReplyParser
from .configure import ConfigureOutcome, configure
from .core import EngineCore
from .embedder import Embedder, embeddings_wanted
from .kv import Admitted, admit_blob
from .lease import SlotLease
from .llama import LoraSet, Vocabulary
from .params import GenerationParams
from .readout import KvEvents, Readout
from .requests import Route, cache_salt, check_request
from .sched import Slot, TenantSessions, Turn
from .startup import load_core
from .stats import EngineStats, SlotInfo
from .worker import WorkerLane

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request made ready for a slot: its parameters by the one request policy, its
    prompt rendered and tokenized, and how its reply is read."""

    params: GenerationParams
    prompt: str | None  # the prompt text (chat template or plain); None: token ids, or none
    tokens: list[int] | None  # None: not tokenized (a DECODE tokenizes after its restore)
    replies: Callable[[], ReplyParser] | None  # None: the text is the content


class Engine:
    """One model, N slots, one GPU worker."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._readout = Readout(core)  # what readers see: figures, slots, runtime, KV events
        on, pooling = embeddings_wanted(core.settings, core.backend.info.pooling)
        self._embedder = (
            Embedder(lambda: core.backend, core.worker, core.settings, pooling=pooling,
                     streams_running=lambda: core.batcher.generating > 0)
            if on else None
        )

    # ---- lifecycle -------------------------------------------------------------------------

    @classmethod
    async def load(
        cls, model_path: str, settings: Settings, *, alias: str | None = None, lane: WorkerLane | None = None
    ) -> Engine:
        """Load the model (on the GPU worker's ``lane``: the process's one when it serves
        several models, else one of its own), warm it up, and pick the chat template; with
        embeddings, make their context (a model it cannot serve fails the start)."""
        engine = cls(await load_core(model_path, settings, alias=alias, lane=lane))
        if engine._embedder is not None:
            core = engine._core
            try:
                shape = await engine._embedder.open()
            except BaseException:
                with trio.CancelScope(shield=True):
                    await core.worker.close(core.backend.close)
                raise
            log.info("embeddings: pooling %s, %d floats an input%s, calls of up to %d inputs and %d tokens",
                     shape.pooling, shape.n_out, f" (rank labels {', '.join(shape.labels)})" if shape.labels else "",
                     shape.n_seq_max, shape.n_batch)
        return engine

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``stop()``, then free the model (its users have left by then)."""
        also = () if self._embedder is None else (self._embedder.run,)  # its pump
        await self._core.run(also=also, task_status=task_status)

    def stop(self) -> None:
        """End ``run``: late work is refused with a clear error."""
        self._core.stop()

    # ---- what it serves --------------------------------------------------------------------

    @property
    def identity(self) -> ModelIdentity:
        """The resident model's identity (a T3 reload replaces it)."""
        return self._core.identity

    @property
    def served_name(self) -> str:
        """The name clients call the model by (``model`` in replies)."""
        return self._core.identity.model_alias

    @property
    def n_ctx(self) -> int:
        """KV cells all slots hold together."""
        return self._core.n_ctx

    @property
    def n_ctx_slot(self) -> int:
        """The most positions one slot can hold."""
        return self._core.n_ctx_slot

    @property
    def n_slots(self) -> int:
        return self._core.n_slots

    @property
    def n_vocab(self) -> int:
        return self._core.n_vocab

    @property
    def kv_cache_layout(self) -> dict[str, Any]:
        """K/V cache types and V transposition, as blobs made here carry them."""
        return self._core.kv_cache_layout

    @property
    def adapters(self) -> LoraAdapters:
        """The LoRA adapters loaded with the model (--lora): their default scales, names, use."""
        return self._core.adapters

    @property
    def vocab(self) -> Vocabulary:
        """The vocabulary as text (token pieces, detokenize), its tokens with a role (BOS,
        EOS, FIM, ...) and the chat template prompts render with: read without a llama call."""
        core = self._core
        return replace(core.backend.vocabulary, chat_template=core.inputs.chat_template.jinja)

    @property
    def pooling(self) -> Embedder | None:
        """Embeddings and rerank scores (engine/embedder.py); None: not served (--embeddings)."""
        return self._embedder

    def json_body_limit(self, *, token_ids: bool = False) -> int:
        """The largest JSON body worth parsing for a prompt route (``token_ids``: a body of
        token ids, /detokenize): anything larger could not fit a slot."""
        inputs = self._core.inputs
        return inputs.max_token_ids_json_bytes if token_ids else inputs.max_request_json_bytes

    def runtime_fields(self) -> dict[str, Any]:
        """Where the model runs, how its KV cache is laid out, which chat template renders,
        and the embedding context's pooling (None: no embeddings)."""
        shape = None if self._embedder is None else self._embedder.shape
        return {**self._readout.runtime_fields(), "pooling": None if shape is None else shape.pooling}

    # ---- figures -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return self._readout.stats()

    def slot_info(self, slot_id: int) -> SlotInfo:
        """The one description of a slot; NO_SLOT for an id this engine does not have."""
        return self._readout.slot_info(slot_id)

    async def wait_slot_released(self) -> None:
        """Until any slot is released (the drain watches the slots empty)."""
        await self._core.slots.wait_released()

    def kv_events(self, publish: Callable[[list[Event]], None], block_size: int) -> KvEvents:
        """From now on, every change of what the slots hold goes to ``publish`` as KV events;
        the handle's ``resync`` tells everything anew (for a new subscriber)."""
        return self._readout.kv_events(publish, block_size)

    # ---- requests --------------------------------------------------------------------------

    async def prepare(
        self, route: Route, body: dict[str, Any], *, slot: int | None = None, tokenize: bool = True
    ) -> Prepared:
        """A request under the one request policy (engine/requests.py) of its ``route``:
        refused (400 naming the parameter) when it asks what this engine cannot honour; its
        parameters (``slot``: over that slot's CONFIGURE T1 settings, by the one precedence);
        its chat side decided once (``Chat.plan``: prompt, grammar, shown tokens, think
        block, reply parser); its grammar compiled and its prompt (``tokenize``) tokenized:
        all before any slot is claimed."""
        core = self._core
        inputs = core.inputs
        layers = body if slot is None else sampling_keys.merge(core.slot_settings.generation_defaults(slot), body)
        n_logprobs = check_request(route, layers)
        params = await inputs.generation_params_off_loop(layers)
        params = core.adapters.choose(params, layers, route, core.identity)  # its LoRA adapter set
        layers, images = await inputs.read_images(layers)  # image parts: placeholders in the text
        plan = await inputs.plan(layers, params)
        await inputs.compile_grammar(plan.grammar)
        params = replace(
            params,
            sampling=replace(params.sampling, grammar=plan.grammar),
            logprobs=n_logprobs,
            cache_salt=cache_salt(layers),
            shown_tokens=plan.shown_tokens,
            thinking=await inputs.think_plan(plan.think, plan.shown_tokens),
        )
        tokens: list[int] | None = None
        if tokenize:
            if images and plan.prompt is not None:
                tokens = await inputs.tokenize_with_images(plan.prompt, images)
            else:
                tokens = (
                    await inputs.tokenize_text(plan.prompt)
                    if plan.prompt is not None
                    else await inputs.prompt_tokens(layers.get("prompt"))
                )
        elif images:
            raise bad_param("images are served on the HTTP chat routes, not in a DECODE's prompt")
        return Prepared(params, plan.prompt, tokens, plan.replies)

    async def render(self, body: dict[str, Any]) -> str:
        """A request's prompt text (``messages`` through the chat template, or its ``prompt``)."""
        return await self._core.inputs.render_prompt(body)

    async def prompt_tokens(self, source: dict[str, Any] | str) -> list[int]:
        """Prompt tokens of a request body (``messages``, or a ``prompt`` of text or token
        ids) or of prompt text; refused when no slot could hold them."""
        inputs = self._core.inputs
        return await inputs.tokenize_text(source) if isinstance(source, str) else await inputs.tokenize_request(source)

    @overload
    async def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]: ...

    @overload
    async def tokenize(
        self, text: Sequence[str], *, add_special: bool, parse_special: bool = True
    ) -> list[list[int]]: ...

    async def tokenize(
        self, text: str | Sequence[str], *, add_special: bool, parse_special: bool = True
    ) -> list[int] | list[list[int]]:
        """Text -> tokens (the tokenizer routes), bounded by what a slot could hold; several
        texts in one worker call (a prompt built of parts: /infill)."""
        inputs = self._core.inputs
        if isinstance(text, str):
            return await inputs.tokenize(text, add_special=add_special, parse_special=parse_special)
        texts = list(text)
        for t in texts:
            inputs.check_text_fits(t)
        backend = self._core.backend
        try:
            return await self._core.worker.call(
                lambda: [backend.tokenize(t, add_special=add_special, parse_special=parse_special) for t in texts]
            )
        except UnicodeEncodeError:  # JSON's "\ud800": a str, but no UTF-8
            raise bad_param("text holds a lone surrogate (U+D800..U+DFFF): not valid Unicode") from None

    async def configure(self, slot_id: int, body: dict[str, Any]) -> ConfigureOutcome:
        """CONFIGURE: T1 applied to the slot, T2/T3 staged until every slot is idle."""
        core = self._core
        return await configure(core, slot_id, body, core.settings)

    async def admit(
        self,
        raw: memoryview | bytes | None,
        claims: Mapping[str, Any] | None = None,
        *,
        header_model: str | None = None,
        lora: LoraSet | None = None,
    ) -> Admitted:
        """KV from elsewhere: ``raw`` parsed (BAD_FRAME; no longer than a slot) and ``claims``
        (identity fields, ``kv_cache``, ``lora``) held against the resident model (engine/kv/)
        and, with ``lora``, the LoRA adapter set of the request that would continue it."""
        core = self._core
        return await admit_blob(
            raw, claims, resident=core.identity, kv_cache_layout=core.kv_cache_layout,
            max_tokens=core.n_ctx_slot, header_model=header_model,
            lora=None if lora is None else core.adapters.claims(lora),
        )

    # ---- slots -----------------------------------------------------------------------------

    async def _in_line(self, owner: str, prompt: Sequence[int], salt: str | None, lora: LoraSet) -> Slot:
        core = self._core
        if prompt and (core.slots.waiting or core.slots.n_busy == core.n_slots) and core.tiers.disk is not None:
            return await _wait_and_prefetch(core, owner, prompt, salt, lora)
        return await _claim_any(core, owner, prompt, salt, lora)

    def sessions(self, tenant: str) -> TenantSessions:
        """The agent sessions of ``tenant`` (the caller's API key): a request's turn, and
        ``finish`` (engine/sched/session_tree.py). No tenant reaches another's."""
        return TenantSessions(self._core.sessions, tenant)

    @asynccontextmanager
    async def claim(
        self,
        owner: str,
        *,
        slot: int | None = None,
        prompt: Sequence[int] = (),
        salt: str | None = None,
        lora: LoraSet = (),
        wait_s: float = math.inf,
        turn: Turn | None = None,
    ) -> AsyncIterator[SlotLease]:
        """Hold a slot for the block: ``slot`` that one, at once (SLOT_BUSY when it is taken,
        NO_SLOT when there is none); else the free slot the slot-choice policy ranks best for
        ``prompt`` under ``salt`` and the LoRA adapter set ``lora``, waiting in line (first
        come, first served) up to ``wait_s`` (then SLOT_BUSY, the one "busy, retry" refusal)
        within the caller's scope. The adapters of ``lora`` count as waiting, then running
        (vllm:lora_requests_info). ``turn``: the agent session's turn the claim serves; what
        the slot holds at the end is that session's history (the retention order's to keep or
        drop)."""
        core = self._core
        if not core.backend.generates:
            raise ProtocolError(ErrorCode.NOT_IMPLEMENTED, f"{core.identity.model_name} has "
                                "no KV cache (an encoder such as "
                                "BERT): it serves /v1/embeddings, not generation or slots")
        if slot is not None:
            held = core.slots.claim(slot, owner)
        else:
            with trio.move_on_after(wait_s) as waited, core.adapters.waiting(lora):
                held = await self._in_line(owner, prompt, salt, lora)
            if waited.cancelled_caught:
                raise ProtocolError(ErrorCode.SLOT_BUSY, f"all slots are busy (waited {wait_s:g} s)")
        lease = SlotLease(core, held.id, turn)
        if (blocks := self._readout.kv_blocks) is not None:  # the KV events of its stores name its session
            blocks.sessions[held.id] = None if turn is None else turn.session_id
        try:
            with core.adapters.running(lora):
                yield lease
        finally:
            lease._end()
            if lease.touched:
                core.scheduler.settle(held.id, None if turn is None else turn.session)
            core.slots.release(held)


async def _claim_any(core: EngineCore, owner: str, prompt: Sequence[int], salt: str | None, lora: LoraSet) -> Slot:
    """A free slot by the slot-choice policy; a request that waits for one is served by the
    prompt tokens it would compute (the scheduler's ``work_left``), least first."""
    scheduler = core.scheduler
    return await core.slots.claim_any(
        owner, scheduler.slot_rank(prompt, salt, lora), lambda: scheduler.work_left(prompt, salt, lora)
    )


async def _wait_and_prefetch(
    core: EngineCore, owner: str, prompt: Sequence[int], salt: str | None, lora: LoraSet
) -> Slot:
    """Wait in line for a slot while the prompt's history, if the disk holds it, comes back
    into RAM (kv/tiers.py ``promote``): the turn then waits for a memory copy, not a read."""
    slot: list[Slot] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(core.tiers.promote, prompt, salt, lora)
            slot.append(await _claim_any(core, owner, prompt, salt, lora))
    except BaseExceptionGroup as group:
        raise_single(group)
    return slot[0]
