"""llama.cpp through llama-cpp-python's low-level API: the only package that imports
llama_cpp, and it imports nothing of the engine above it (what it needs of the engine's
speculation and KV events it takes as the protocols in types.py). log.py routes its log;
chat.py its built-in chat templates; devices.py the ggml devices, offload and repacking;
sampling.py a request's sampler; thinking.py its reply's think block (the thinking budget,
a grammar held until the block closes); grammar.py compiled grammars (with GuidanceCache: a
client's GBNF on llguidance, bounded per token); context.py the model and its
context (decode, steps, tokens); steps.py the batched steps; state.py a slot's KV state out
and in; seqstate.py that state's layout, read without llama.cpp."""

from .chat import apply_builtin_chat_template
from .context import LlamaBackend, kv_layout
from .devices import OffloadSettings
from .grammar import (
    JSON_OBJECT_GBNF,
    MAX_GBNF_CHARS,
    MAX_GBNF_NESTING,
    GrammarCache,
    GrammarError,
    Triggers,
)
from .logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from .sampling import Sampler, SamplingParams
from .schema import convert_schema, int_bounds, number_bounds, number_range
from .seqstate import cache_layout_mismatch
from .state import DecodeAborted, NoKvSpace, Snapshot
from .thinking import ThinkGate, ThinkPlan
from .types import (
    Drafter,
    LoraSet,
    ModelInfo,
    PrefillPart,
    SlotWatcher,
    StepPlanner,
    StepRequest,
    StepResult,
    Vocabulary,
    common_prefix_len,
)

__all__ = [
    "JSON_OBJECT_GBNF",
    "MAX_GBNF_CHARS",
    "MAX_GBNF_NESTING",
    "MAX_TOP_LOGPROBS",
    "DecodeAborted",
    "Drafter",
    "GrammarCache",
    "GrammarError",
    "LlamaBackend",
    "LoraSet",
    "ModelInfo",
    "NoKvSpace",
    "OffloadSettings",
    "PrefillPart",
    "Sampler",
    "SamplingParams",
    "SlotWatcher",
    "Snapshot",
    "StepPlanner",
    "StepRequest",
    "StepResult",
    "ThinkGate",
    "ThinkPlan",
    "TokenLogprobs",
    "Triggers",
    "Vocabulary",
    "apply_builtin_chat_template",
    "cache_layout_mismatch",
    "common_prefix_len",
    "convert_schema",
    "int_bounds",
    "kv_layout",
    "number_bounds",
    "number_range",
]
