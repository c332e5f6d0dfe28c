"""CONFIGURE T2/T3 applied (configure.py stages them; the reconfigurer runs this once every
slot is idle): the context rebuilt with a new size or cache types, or another model loaded
from --model-dir (its identity and model_hash with it: engine/modelfile.py), warmed up, and
the chat template and speculation planner taken anew."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from ..config import Settings
from ..model.identity import ModelIdentity
from .chat import resolve_chat_template
from .inputs import Inputs
from .kv import HostTiers, kv_fingerprint
from .llama import LlamaBackend
from .modelfile import read_model_identity
from .speculation import DraftPlanner
from .worker import GpuWorker

log = logging.getLogger(__name__)


class Reloadable(Protocol):
    """What a T2/T3 change reads and replaces (the engine's core)."""

    backend: LlamaBackend
    identity: ModelIdentity
    model_path: str
    settings: Settings
    inputs: Inputs
    worker: GpuWorker
    tiers: HostTiers
    t3_reloads: int
    last_t3_reload_ms: float

    def slots_emptied(self, backend: LlamaBackend) -> None: ...


async def apply_staged(core: Reloadable, changes: dict[str, Any]) -> None:
    """Apply staged CONFIGURE T2/T3 changes (configure.py), every slot idle."""
    t0 = time.perf_counter()
    core.tiers.clear()  # states of the old context or model fit neither
    try:
        await _apply(core, changes, t0)
    finally:  # what the disk tier writes from now on is of what serves now
        core.tiers.refit(kv_fingerprint(core.backend, core.identity.fields()))


async def _apply(core: Reloadable, changes: dict[str, Any], t0: float) -> None:
    if "model_path" in changes:
        path = changes["model_path"]
        # Its model_hash first (a thread of its own): the old model serves INFO meanwhile, and
        # the new one is loaded only from a file that could be read whole.
        identity = await read_model_identity(path, alias=core.identity.model_alias if core.settings.alias else None)
        old = core.backend

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
                swa_full=old.swa_full,
                ctx_checkpoints=old.ctx_checkpoints,
                lora_paths=old.lora_paths,  # the adapters go with the model (one that does not fit fails the reload)
                # The projector too: a new model of another width fails the reload, named.
                mmproj=old.projector.path if old.projector is not None else None,
            )
            if core.settings.warmup:  # a kernel that faults on the new model faults here
                new.warmup()
            new.planner = DraftPlanner(new.n_batch, split=not new.kv_unified)
            core.slots_emptied(new)
            return new

        new = await core.worker.run(load)
        core.backend, core.identity, core.model_path = new, identity, path
        # An operator's template stays; a GGUF-derived one follows the new GGUF. Either way
        # the renderer takes the new vocabulary's BOS/EOS text.
        keep = core.inputs.chat_template.source not in ("gguf", "fallback")
        core.inputs.set_chat_template(
            core.inputs.chat_template
            if keep
            else resolve_chat_template(
                name=None, file=None, gguf_template=new.info.chat_template, builtin_names=(),
                gguf_variants=new.info.chat_template_variants,
            )
        )
        await core.worker.call(old.close)
        core.t3_reloads += 1
        core.last_t3_reload_ms = (time.perf_counter() - t0) * 1000.0
        log.info("T3: model reloaded from %s in %.0f ms (%s)", path, core.last_t3_reload_ms, identity.model_name)
    else:
        b = core.backend

        def rebuild(_abort: threading.Event) -> None:
            try:
                b.rebuild_context(
                    n_ctx=changes.get("n_ctx"), type_k=changes.get("cache_type_k"), type_v=changes.get("cache_type_v")
                )
            finally:  # also when it failed: the previous setup was rebuilt, empty
                core.slots_emptied(b)

        await core.worker.run(rebuild)
        log.info("T2: context rebuilt in %.0f ms: %s", (time.perf_counter() - t0) * 1000.0, changes)
