"""What the model and its context tell and take: the model's description, one slot's share
of a generation step, a prompt part riding in a step batch, and what the backend's steps ask
of the engine's speculation (``Drafter``, ``StepPlanner``: engine/speculation/ implements them)
and of a request's sampler (``TokenSampler``: engine/sample/; ``ChainSettings``, the settings
a llama.cpp sampler chain is built from)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np


class LogitsRow(NamedTuple):
    """Where a row of logits lies in llama.cpp: the context and the output's batch index (as
    ``llama_get_logits_ith`` takes it). A sampler chain reads the row there itself
    (``llama_sampler_sample``), with no copy of the vocabulary into Python."""

    ctx: object  # llama_context_p
    idx: int


class TokenSampler(Protocol):
    """A request's sampler (engine/sample/ ``Sampler``), asked on the worker for each token."""

    def sample(self, logits: np.ndarray, eog_ids: np.ndarray, at: LogitsRow | None = None) -> int:
        """The token picked from one position's ``logits`` (n_vocab f32; a writable view may
        be edited in place); ``eog_ids``: the vocabulary's end-of-generation tokens; ``at``:
        where ``logits`` lie in llama.cpp (None: elsewhere, e.g. a hand-off's blob)."""
        ...

    @property
    def plain(self) -> bool:
        """Whether the token is the argmax of the row, nothing else asked: a step then takes
        the argmax of its plain rows in one call and hands each its own (``take_argmax``)."""
        ...

    def take_argmax(self, token: int, logits: np.ndarray, eog_ids: np.ndarray) -> int:
        """A plain pick: the token, given ``token``, the first argmax of ``logits``."""
        ...

    def close(self) -> None:
        """Free what it holds of llama.cpp (on the worker: ``LlamaBackend.retire``)."""
        ...


class ChainSettings(Protocol):
    """What a llama.cpp sampler chain is built from (engine/sample/ ``SamplingParams``)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repeat_last_n: int
    frequency_penalty: float
    presence_penalty: float
    seed: int

    @property
    def greedy(self) -> bool: ...

    @property
    def penalized(self) -> bool: ...

# A LoRA adapter set: (adapter id, scale) pairs by ascending id, none of scale 0; () is the
# base model alone. llama.cpp applies adapters per context, so one llama_decode runs under
# one set; with its cache_salt, the set is what a slot's KV was computed under.
LoraSet = tuple[tuple[int, float], ...]


class Drafter(Protocol):
    """One request's drafting state (engine/speculation/ ``Speculation``), on the worker."""

    def record(self, n_drafted: int, n_accepted: int) -> None:
        """A verified draft of the candidate last offered: how much of it was accepted."""
        ...


class StepPlanner(Protocol):
    """The speculation the steps run with (engine/speculation/ ``DraftPlanner``)."""

    def drafts(
        self, slots: Sequence[int], streams: Sequence[tuple[Drafter | None, Sequence[int], int, int]], room: int
    ) -> list[list[int]]:
        """The draft each stream of a step verifies: ``streams`` holds each one's drafter (None:
        it does not speculate), its tokens so far, the token the step evaluates, and the most
        it may draft; ``room``: draft positions the batch has left."""
        ...

    def measured(self, slots: Sequence[int], rows: Sequence[int], seconds: float) -> None:
        """A step's llama_decode took ``seconds`` for ``rows`` positions of each slot."""
        ...

    def measured_singles(self, first: int, last: int, n: int, seconds: float) -> None:
        """``measured`` for ``n`` slots from ``first`` to ``last``, one position each."""
        ...

    def verify(self, draft: Sequence[int], pick: Callable[[int], int], is_eog: Callable[[int], bool]) -> list[int]:
        """The accept rule: the picks a step keeps of ``draft`` (``pick(j)``: the sampler's
        pick at the j-th position)."""
        ...


class SlotWatcher(Protocol):
    """Told of every change of what a slot's KV holds (engine/kv/ ``SlotBlocks``: KV events)."""

    def slot_changed(self, slot: int, tokens: Sequence[int], kept: int, salt: str | None, lora: LoraSet = ()) -> None:
        """``slot`` holds ``tokens`` now, computed under ``salt`` and ``lora``, its first ``kept``
        unchanged since last told."""
        ...


# The tokens a vocabulary may give a role (llama_vocab_<role>): sequence marks, padding, and
# the fill-in-the-middle tokens of code models (llama-server's /infill).
TOKEN_ROLES = ("bos", "eos", "eot", "sep", "pad", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")


@dataclass(frozen=True, slots=True)
class TokenRoles:
    """The vocabulary's tokens with a role, and what its tokenizer adds around a text."""

    ids: Mapping[str, int] = field(default_factory=dict)  # role -> token id; absent: none
    add_bos: bool = False
    add_eos: bool = False
    add_sep: bool = False

    def get(self, role: str) -> int | None:
        tid = self.ids.get(role, -1)
        return None if tid < 0 else tid


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The served model's vocabulary as text, read once at load: no llama call, any thread."""

    pieces: Sequence[bytes]  # each token's bytes as generated text (control tokens: none)
    special: Mapping[int, bytes]  # the tokens whose spelled-out text differs (control tokens)
    roles: TokenRoles = TokenRoles()
    # The chat template prompts are rendered with (Jinja; None: a llama.cpp built-in), as an
    # HF tokenizer carries its own (vLLM's /tokenizer_info).
    chat_template: str | None = None

    @property
    def n_vocab(self) -> int:
        return len(self.pieces)

    def special_piece(self, token: int) -> bytes:
        """A token's text with control tokens spelled out (llama-server's /tokenize pieces)."""
        return self.special.get(token, self.pieces[token])

    def token_bytes(self, token: int) -> bytes:
        """The bytes a generated token contributes to the text."""
        return self.pieces[token]

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Tokens -> text, special tokens rendered (llama-server's /detokenize)."""
        special, pieces = self.special, self.pieces
        return b"".join(special.get(t, pieces[t]) for t in tokens).decode("utf-8", "replace")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token sequences share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

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
    # The GGUF's named chat templates (tokenizer.chat_template.NAME: "tool_use", ...) by name.
    chat_template_variants: Mapping[str, str] = field(default_factory=dict)
    roles: TokenRoles = TokenRoles()
    pooling: str | None = None  # the GGUF's own pooling type ({arch}.pooling_type): an embedding model's
    rerank_template: str | None = None  # tokenizer.chat_template.rerank: how a reranker frames a pair

    @property
    def can_roll_back(self) -> bool:
        """Whether positions can be removed from a sequence's end (speculation needs it)."""
        return not (self.recurrent or self.hybrid)


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One sequence's share of a batched generation step."""

    slot: int
    token: int
    sampler: TokenSampler
    n_left: int = 1  # tokens the request may still produce (a draft is capped at n_left - 1)
    spec: Drafter | None = None  # drafts from the request's own tokens (None: no speculation)


@dataclass(slots=True)
class PrefillPart:
    """Prompt tokens of one slot that ride along in a generation-step batch (chunked
    prefill): appended at the slot's end, after dropping its positions >= ``keep``."""

    slot: int
    tokens: Sequence[int]
    keep: int | None = None  # the first part of a prompt: truncate the slot first
    sampler: TokenSampler | None = None  # the last part: sample the next token from its last position
    want_logits: bool = False  # the last part: also return that position's logits


class ImageError(ValueError):
    """An image the projector cannot take (undecodable bytes, a marker count that does not
    match): the request's fault, a 400."""


def image_ids(digest_hex: str, n_positions: int) -> tuple[int, ...]:
    """An image's ids in token lists, one a position: negative (-1 - v, v < 2**31), v's upper
    30 bits from BLAKE2b of the image's SHA-256 and the position, its lowest bit set on the
    first position alone (where the image starts)."""
    ids = []
    for k in range(n_positions):
        h = int.from_bytes(hashlib.blake2b(f"{digest_hex}:{k}".encode(), digest_size=4).digest(), "big") >> 2
        ids.append(-1 - (h << 1 | (k == 0)))
    return tuple(ids)


def is_image_start(token: int) -> bool:
    """Whether ``token`` is the first position of an image (``image_ids``)."""
    return token < 0 and (-1 - token) & 1 == 1


@dataclass(frozen=True, slots=True)
class Span:
    """An image's positions in a token list: [start, end)."""

    start: int
    end: int


def media_spans(tokens: Sequence[int]) -> list[Span]:
    """The image spans of a token list, in order (vision.py's ids: negative, the first of
    an image marked by its lowest bit). A span ends at the next text token or the next
    image's first position; a list cut inside an image (a slot's history) holds its part.
    ValueError: an image position with no start before it."""
    spans: list[Span] = []
    i, n = 0, len(tokens)
    while i < n:
        if tokens[i] >= 0:
            i += 1
            continue
        if not is_image_start(tokens[i]):
            raise ValueError(f"position {i}: an image position with no image start before it")
        end = i + 1
        while end < n and tokens[end] < 0 and not is_image_start(tokens[end]):
            end += 1
        spans.append(Span(i, end))
        i = end
    return spans
