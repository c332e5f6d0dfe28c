"""What the model and its context tell and take: the model's description, one slot's share
of a generation step, and a prompt part riding in a step batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .sampling import Sampler


@dataclass(frozen=True, slots=True)
class ModelInfo:
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    bos: int
    eos: int
    add_bos: bool
    chat_template: str | None
    recurrent: bool
    bos_text: str  # what chat templates see as bos_token / eos_token
    eos_text: str


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One sequence's share of a batched generation step."""

    slot: int
    token: int
    sampler: Sampler


@dataclass(slots=True)
class PrefillPart:
    """Prompt tokens of one slot that ride along in a generation-step batch (chunked
    prefill): appended at the slot's end, after dropping its positions >= ``keep``."""

    slot: int
    tokens: Sequence[int]
    keep: int | None = None  # the first part of a prompt: truncate the slot first
    sampler: Sampler | None = None  # the last part: sample the next token from its last position
    want_logits: bool = False  # the last part: also return that position's logits
