"""LoRA adapters on LlamaBackend's context (context.py): loading them with the model
(--lora: an adapter's id is its place in ``lora_paths``) and putting a batch's adapter set on
the context before its decode.

Kept apart from the context because it is its own subject: llama.cpp applies adapters per
context, not per sequence, so the set a decode runs under is the one of its slots (the step
batcher groups slots by set), and a change is only made when the set differs from the one
applied. It uses the context's attributes, declared here and set by LlamaBackend. Worker only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp

from .log import captured
from .types import LoraSet


class LoraSets:
    """The LoRA half of LlamaBackend."""

    _model: llama_cpp.llama_model_p | None
    _ctx: llama_cpp.llama_context_p | None
    n_slots: int
    seq_lora: list[LoraSet]  # per slot: the adapter set its history was computed under
    _adapters: list[ctypes.c_void_p]  # loaded with the model, in --lora order
    _lora_applied: LoraSet  # the set on the context now (a new context applies none)

    def _load_adapter(self, path: str) -> ctypes.c_void_p:
        adapter, said = captured(lambda: llama_cpp.llama_adapter_lora_init(self._model, path.encode()))
        if not adapter:
            llama_cpp.llama_model_free(self._model)  # with the adapters loaded so far
            self._model = None
            why = "; ".join(
                line.strip() for line in said if "lora" in line.lower() and ("fail" in line or "error" in line.lower())
            )
            raise RuntimeError(f"llama.cpp could not load LoRA adapter {path!r}" + (f": {why}" if why else ""))
        return adapter

    def _use_lora(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """Put the adapter set of the entries' slots on the context (llama.cpp applies adapters
        per context, not per sequence, and reserves its graph again after a change)."""
        lora = self.seq_lora[entries[0][0]] if entries[0][0] < self.n_slots else ()
        if any(e[0] < self.n_slots and self.seq_lora[e[0]] != lora for e in entries):
            raise RuntimeError("one llama_decode would mix LoRA adapter sets (the step batcher groups slots by set)")
        if lora != self._lora_applied:
            n = len(lora)
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * max(n, 1))(*(self._adapters[i] for i, _ in lora))
            scales = (ctypes.c_float * max(n, 1))(*(scale for _, scale in lora))
            llama_cpp.llama_set_adapters_lora(self._ctx, adapters, n, scales)
            self._lora_applied = lora
