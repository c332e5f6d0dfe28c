"""The prefill side of a P/D hand-off: prefill the prompt in a slot, sample the one token
the router asked for, copy the slot's KV (and the last logits) out into host memory as an
export under a lease (``exports.py``), and free the slot at once."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..engine.engine import Engine
from ..engine.output import GenerationResult
from ..engine.params import GenerationParams
from ..engine.slots import Slot
from ..wire.kvpull import IDENTITY_KEYS
from .exports import Export, ExportStore


@dataclass(slots=True)
class ExportedPrefill:
    result: GenerationResult  # the prompt and the one sampled token, as a completion
    slot_id: int
    export: Export | None  # None: larger than --kv-export-max-bytes on its own
    prefill_ms: float
    copy_ms: float  # llama_state_seq_get_data into host memory
    slot_held_ms: float  # claim to release: what the export cost normal traffic


async def prefill_export(
    engine: Engine, exports: ExportStore, slot: Slot, tokens: list[int], params: GenerationParams
) -> ExportedPrefill:
    """Prefill ``tokens`` in ``slot`` (claimed by the caller; released here, however this
    ends), sample one token, copy the KV out as an export."""
    t_claim = time.perf_counter()
    try:
        # The logits travel with the KV. A slot that still holds the prompt with its logits
        # (an earlier export of it) gives the same ones again.
        res, logits = await engine.sample_first(slot.id, tokens, params)
        t_prefilled = time.perf_counter()
        copy = await engine.kv.copy_out(slot.id, logits=logits)
        copy_ms = (time.perf_counter() - t_prefilled) * 1000.0
    finally:
        engine.release(slot)
    slot_held_ms = (time.perf_counter() - t_claim) * 1000.0
    identity = engine.identity.info_fields()
    made_by = {**{k: identity[k] for k in IDENTITY_KEYS}, "kv_cache": engine.kv_cache_layout}
    export = await exports.put(copy.parts, copy.n_past, await copy.kv_hash(), made_by)
    return ExportedPrefill(res, slot.id, export, res.prompt_ms, copy_ms, slot_held_ms)
