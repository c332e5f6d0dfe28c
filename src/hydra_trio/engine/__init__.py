"""The engine: one model, N slots, one GPU worker. Its face is what this package exports:
``Engine`` (and a slot's ``SlotLease``), the parameter, result and stats types the front ends
read, the chat room's reply types and the tool-call families' names (--tool-call-parser).
Nothing outside engine/ reaches its modules.

Nineteen modules stand here beside the rooms (chat, kv, llama, sample, sched, speculation,
structured): the request's path through one engine (requests, params, inputs, media, core,
lease, output, receipts), what its readers see of it (readout, stats) and the engine's
lifecycle around it (engine, configure, reload, modelfile, worker, adapters, embedder,
slices, text). Each is the one home of a step
that the rooms below share; grouping them again would add a room that every room imports."""

from .adapters import LoraAdapters
from .chat import TOOL_CALL_PARSERS, ReplyDelta, ReplyParser, ToolCall
from .embedder import Embedder, Pooled
from .engine import Engine, Prepared
from .kv import Admitted, KvCopy
from .lease import Emit, SlotLease
from .llama import POOLING_TYPES, DecodeAborted, LoraSet, Vocabulary
from .output import GenerationResult
from .params import GenerationParams
from .readout import KvEvents
from .receipts import turn_receipt
from .requests import REASONING_EFFORTS, Route, cache_salt
from .sample import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs
from .sched import Finished, TenantSessions, Turn
from .stats import EngineStats, SlotInfo
from .worker import CallTiming, WorkerLane

__all__ = [
    "MAX_TOP_LOGPROBS",
    "POOLING_TYPES",
    "REASONING_EFFORTS",
    "TOOL_CALL_PARSERS",
    "Admitted",
    "CallTiming",
    "DecodeAborted",
    "Embedder",
    "Emit",
    "Engine",
    "EngineStats",
    "Finished",
    "GenerationParams",
    "GenerationResult",
    "KvCopy",
    "KvEvents",
    "LoraAdapters",
    "LoraSet",
    "Pooled",
    "Prepared",
    "ReplyDelta",
    "ReplyParser",
    "Route",
    "SamplingParams",
    "SlotInfo",
    "SlotLease",
    "TenantSessions",
    "TokenLogprobs",
    "ToolCall",
    "Turn",
    "Vocabulary",
    "WorkerLane",
    "cache_salt",
    "turn_receipt",
]
