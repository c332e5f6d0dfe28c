"""The prefill side of a P/D hand-off: prefill the prompt in a held slot, sample the one token
the router asked for, copy the slot's KV (and the last logits) out into host memory; once the
slot is free again, keep that copy as an export under a lease (``exports.py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..engine import Engine, GenerationParams, GenerationResult, KvCopy, SlotLease
from ..wire.kvpull import IDENTITY_KEYS
from .exports import Export, ExportStore


@dataclass(slots=True)
class PrefilledSlot:
    result: GenerationResult  # the prompt and the one sampled token, as a completion
    slot_id: int
    copy: KvCopy  # the slot's KV and the last position's logits, in host memory
    prefill_ms: float
    copy_ms: float  # llama_state_seq_get_data into host memory
    slot_held_ms: float  # the slot's work for the export: what it cost normal traffic
    made_under: dict[str, Any]  # beyond the model: the LoRA adapter set (``SlotLease.kv_claims``)


async def prefill_export(lease: SlotLease, tokens: list[int], params: GenerationParams) -> PrefilledSlot:
    """Prefill ``tokens`` in the held slot, sample one token, copy the KV out."""
    t_claim = time.perf_counter()
    # The logits travel with the KV. A slot that still holds the prompt with its logits
    # (an earlier export of it) gives the same ones again.
    res, logits = await lease.sample_first(tokens, params)
    t_prefilled = time.perf_counter()
    copy = await lease.copy_out(logits=logits)
    t_copied = time.perf_counter()
    return PrefilledSlot(
        res, lease.id, copy, res.prompt_ms, (t_copied - t_prefilled) * 1000.0, (t_copied - t_claim) * 1000.0,
        lease.kv_claims(),
    )


async def export_prefill(engine: Engine, exports: ExportStore, out: PrefilledSlot) -> Export | None:
    """Keep the copy as an export, labelled with the model, KV layout and LoRA adapter set
    that made it; None when it is larger than --kv-export-max-bytes on its own."""
    resident = engine.identity
    identity = resident.info_fields()
    made_by = {**{k: identity[k] for k in IDENTITY_KEYS}, "kv_cache": engine.kv_cache_layout, **out.made_under}
    copy = out.copy
    return await exports.put(copy.parts, copy.n_past, await copy.kv_hash(), made_by)
