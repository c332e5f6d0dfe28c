"""llama.cpp through llama-cpp-python's low-level API: the only package that imports
llama_cpp, and it imports nothing of the engine above it (what it needs of the engine's
speculation, KV events and samplers it takes as the protocols in types.py). log.py routes its
log; chat.py its built-in chat templates; devices.py the ggml devices, offload and repacking;
chain.py a request's llama.cpp sampler chain; context.py the model and its context (decode,
steps); tokens.py its tokens and their text; model_info.py what the model says of itself;
lora_sets.py its LoRA adapters on the context; embedding.py a second context for pooled
embeddings and rank scores; steps.py the batched steps; kv_state.py a slot's KV state out and
in; checkpoints.py context checkpoints; seqstate.py that state's layout, read without
llama.cpp; statematch.py layouts compared for admission; statesplice.py states spliced for the
prompt cache; vision.py image input through mtmd (--mmproj)."""

from .chain import LlamaChain
from .chat import apply_builtin_chat_template
from .context import LlamaBackend, kv_layout
from .devices import OffloadSettings
from .embedding import POOLING_TYPES, PooledShape, normalize
from .kv_state import DecodeAborted, NoKvSpace, Snapshot
from .statematch import cache_layout_mismatch
from .types import (
    ChainSettings,
    Drafter,
    ImageError,
    LogitsRow,
    LoraSet,
    ModelInfo,
    PrefillPart,
    SlotWatcher,
    Span,
    StepPlanner,
    StepRequest,
    StepResult,
    TokenRoles,
    TokenSampler,
    Vocabulary,
    common_prefix_len,
    image_ids,
    is_image_start,
    media_spans,
)

__all__ = [
    "POOLING_TYPES",
    "ChainSettings",
    "DecodeAborted",
    "Drafter",
    "ImageError",
    "LlamaBackend",
    "LlamaChain",
    "LogitsRow",
    "LoraSet",
    "ModelInfo",
    "NoKvSpace",
    "OffloadSettings",
    "PooledShape",
    "PrefillPart",
    "SlotWatcher",
    "Snapshot",
    "Span",
    "StepPlanner",
    "StepRequest",
    "StepResult",
    "TokenRoles",
    "TokenSampler",
    "Vocabulary",
    "apply_builtin_chat_template",
    "cache_layout_mismatch",
    "common_prefix_len",
    "image_ids",
    "is_image_start",
    "kv_layout",
    "media_spans",
    "normalize",
]
