"""How an engine starts: the model file's identity, the LoRA adapters (--lora), the model and
its context loaded with the offload asked for, the warm-up, what a change of adapter set
costs, the chat template picked, and the start-up log lines that say what was loaded.

Kept apart from the core (core.py) because it changes with how an engine starts, not with
running requests in slots. A T2/T3 change later (reload.py) rebuilds from what this loaded.
"""

from __future__ import annotations

import logging
import time

import trio

from ..config import CACHE_TYPES, Settings
from ..model.lora import adapter_specs
from .adapters import LoraAdapters
from .chat import resolve_chat_template
from .core import EngineCore
from .llama import LlamaBackend, OffloadSettings, kv_layout
from .modelfile import read_model_identity
from .worker import WorkerLane

log = logging.getLogger(__name__)


async def load_core(
    model_path: str, settings: Settings, *, alias: str | None = None, lane: WorkerLane | None = None
) -> EngineCore:
    """Load the model on the GPU worker's ``lane`` (one of its own if None), warm it up, and
    make the engine's core over it; a failed warm-up or template frees the model."""
    t0 = time.perf_counter()
    identity = await read_model_identity(model_path, alias=alias)  # with its SHA-256, in a thread of its own
    lane = lane or WorkerLane()  # the engine's worker takes it over after load
    adapters = await LoraAdapters.read(
        adapter_specs(settings.lora, settings.lora_scaled, init_without_apply=settings.lora_init_without_apply)
    )
    offload = OffloadSettings(
        n_gpu_layers=settings.n_gpu_layers,
        main_gpu=settings.main_gpu,
        flash_attn=settings.flash_attn,
        kv_offload=not settings.no_kv_offload,
        repack=settings.repack,
    )
    backend = await lane.run_sync(
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
            swa_full=settings.swa_full,
            ctx_checkpoints=settings.ctx_checkpoints,
            lora_paths=adapters.paths,
            mmproj=settings.mmproj,
        )
    )
    try:
        if settings.warmup:
            # Said before the call: if a kernel faults, this is the last line in the log.
            log.info("warming up: one prompt and one step on slot 0 (--no-warmup skips it; weights %s)",
                     "repacked" if backend.repack.enabled else "not repacked")
            t_warm = time.perf_counter()
            await lane.run_sync(backend.warmup)
            engine_warmup_ms: float | None = (time.perf_counter() - t_warm) * 1000.0
        else:
            engine_warmup_ms = None
        await lane.run_sync(backend.measure_lora_switch)  # sets' turns (batcher.py)
        template = resolve_chat_template(
            name=settings.chat_template,
            file=settings.chat_template_file,
            gguf_template=backend.info.chat_template,
            builtin_names=backend.builtin_templates,
            gguf_variants=backend.info.chat_template_variants,
        )
    except BaseException:
        with trio.CancelScope(shield=True):  # a load cancelled during its warm-up still frees the model
            await lane.run_sync(backend.close)
        raise
    if settings.spec_type != "none" and not backend.info.can_roll_back:
        await lane.run_sync(backend.close)
        kind = "recurrent" if backend.info.recurrent else "hybrid"
        raise SystemExit(
            f"--spec-type {settings.spec_type}: {identity.model_name} is a {kind} model, whose KV cannot drop "
            "rejected draft positions; serve it with --spec-type none"
        )
    engine = EngineCore(backend, identity, settings, lane, adapters)
    await engine.tiers.open()  # the disk tier's folder cleaned and indexed
    engine.inputs.set_chat_template(template)
    engine.model_load_ms = (time.perf_counter() - t0) * 1000.0
    engine.warmup_ms = engine_warmup_ms
    log.info(
        "model loaded in %.0f ms: %s (%s, %s), %d slots, n_ctx "
        "%d, KV cache %s (a slot holds up to %d; %s), %d threads",
        engine.model_load_ms, identity.model_name, identity.model_quant, identity.tokenizer,
        backend.n_slots, backend.n_ctx, kv_layout(backend), backend.n_ctx_slot,
        ", ".join(f"{k} {v}" for k, v in backend.cache_layout.items()) or "layout not read", backend.n_threads,
    )
    if adapters:
        log.info("LoRA adapters: %s; a change of set adds %.2f ms to "
                 "a decode (a set's turn while others wait: %.0f ms)",
                 ", ".join(f"{a['id']} {a['name']} "
                           f"({a['path']}, scale {a['scale']:g})" for a in adapters.listing()),
                 backend.lora_switch_s * 1000, engine.batcher.turn_s * 1000)
    assert backend.offload is not None
    log.info("offload: %s", backend.offload.summary())
    log.info("chat template: %s", template.describe())
    return engine
