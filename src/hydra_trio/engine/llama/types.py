"""What the model and its context tell and take: the model's description, one slot's share
of a generation step, and a prompt part riding in a step batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..speculative import Speculation
from .sampling import Sampler

# What one step sampled for a sequence, in order: its pick, then (speculation) a pick per
# accepted draft position; the last is the token the next step evaluates. None: no room.
StepResult = tuple[int, ...] | None


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
    hybrid: bool  # recurrent and attention layers (its recurrent state cannot drop positions either)
    bos_text: str  # what chat templates see as bos_token / eos_token
    eos_text: str

    @property
    def can_roll_back(self) -> bool:
        """Whether positions can be removed from a sequence's end (speculation needs it)."""
        return not (self.recurrent or self.hybrid)


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One sequence's share of a batched generation step."""

    slot: int
    token: int
    sampler: Sampler
    n_left: int = 1  # tokens the request may still produce (a draft is capped at n_left - 1)
    spec: Speculation | None = None  # drafts from the request's own tokens (None: no speculation)


@dataclass(slots=True)
class PrefillPart:
    """Prompt tokens of one slot that ride along in a generation-step batch (chunked
    prefill): appended at the slot's end, after dropping its positions >= ``keep``."""

    slot: int
    tokens: Sequence[int]
    keep: int | None = None  # the first part of a prompt: truncate the slot first
    sampler: Sampler | None = None  # the last part: sample the next token from its last position
    want_logits: bool = False  # the last part: also return that position's logits
