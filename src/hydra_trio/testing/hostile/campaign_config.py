"""What the campaign runs (Config, SHORT: the CI form), what counts as a finding, and the
ledger of what happened."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

DOCUMENTED_5XX = {503, 507}  # busy/draining, and "insufficient storage" (budget) replies
# What the engine may use past model + KV cache + the byte budgets: the Python runtime,
# llama.cpp, Quart and Hypercorn (the tiny model's engine idles at ~80 MB RSS, of which
# model + KV are ~4 MB), with some slack. Request bodies are not in it: that is the point.
RUNTIME_ALLOWANCE_MIB = 96
GOAL_GAP_MS = 250.0
NOTABLE_GAP_MS = 50.0  # gaps above this are attributed to what was in flight
BIG = 12_000_000  # the issue's 12 MB shapes
# Schemas a client may send to size or wedge the grammar (issues 40, 49): each is refused (no value
# satisfies it) or served within the per-token bound, what cannot be enforced relaxed (strict: a 400).
HOSTILE_SCHEMAS: dict[str, Any] = {
    "min_length_1e8": {"type": "string", "minLength": 100_000_000},
    "max_items_1e9": {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000_000},
    "pattern_repeat_1e7": {"type": "string", "pattern": "^a{10000000}$"},
    "lengths_add_up": {"type": "object",
                       "properties": {f"p{i}": {"type": "string", "maxLength": 2000} for i in range(20)}},
    "min_over_max": {"type": "string", "minLength": 5, "maxLength": 2},
    "all_of_string_integer": {"allOf": [{"type": "string"}, {"type": "integer"}]},
    "required_not_allowed": {"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False},
    "pattern_bad_range": {"type": "string", "pattern": "^[z-a]$"},
    "empty_integer_range": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4},
}
# Grammars a client may send that llama.cpp's grammar engine could not bound per token
# (issue 40: this one held every stream for 265 s): on llguidance, each is served within the
# per-token bound or ends its own request with a 400 past it, while the streams go on.
HOSTILE_GRAMMARS: dict[str, str] = {
    "ambiguous": 'root ::= s\ns ::= "a" s p | "a" s q | ""\np ::= "a"\nq ::= "a"\n',
    # ~210 KB: llama.cpp's parse of it held the worker ~1 s, a token's pass took minutes.
    "alternatives_20k": "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000)) + "\n",
}
MAX_REPLY = 64 << 20  # read at most this much of any reply
MESSAGES = [{"role": "user", "content": "hello world"}]
STOPPED = "stopped: the campaign ended"
# kv_transfer_params fuzzed field by field (issue 28, 1.7): each field of a real export's
# params gets each value in turn. Any of them must give a 200 that falls back (or, for the
# rare one that still names the export, restores), never a 5xx.
KV_PARAM_FIELDS = (
    "remote_host", "remote_port", "hydra", "hydra.v", "hydra.export_id", "hydra.n_past",
    "hydra.kv_hash", "hydra.kv_bytes", "hydra.kv_cache", "hydra.kv_cache.type_k", "hydra.shm",
    "hydra.shm.probe", "hydra.shm.token", "hydra.tokenizer", "hydra.model_name",
)  # fmt: skip
KV_PARAM_VALUES: tuple[Any, ...] = (
    None, True, -1, 0, 2**62, 2**70, 1.5, "", ".", "a..b", "a" * 64, "é" * 300, "x\n2099-01-01 INFO forged",
    "/dev/shm/hydra-kv-0-1-0badcafe-probe\x00", "\udcff", [], {}, {"probe": 1}, ["127.0.0.1"],
)  # fmt: skip
KV_PARAM_REASONS = {
    "bad_params", "not_allowed", "pull_failed", "not_found", "refused", "too_large", "timeout",
    "identity_mismatch", "layout_mismatch", "hash_mismatch", "prompt_mismatch", "restore_failed",
}  # fmt: skip
KV_PARAM_BATCH = 12  # mutations per round of the shape, sent together


# ---- what happened -----------------------------------------------------------------------


@dataclass
class Ledger:
    """Every hostile request: its kind, outcome and time span; and the findings."""

    counts: Counter[str] = field(default_factory=Counter)  # "kind status"
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # kind, t0, t1 (monotonic)
    findings: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    health_ms: list[float] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def record(self, kind: str, outcome: str, t0: float) -> None:
        self.counts[f"{kind} {outcome}"] += 1
        self.spans.append((kind, t0, time.monotonic()))

    def find(self, what: str, detail: str) -> None:
        if len(self.findings[what]) < 50:
            self.findings[what].append(detail[:400])
        self.counts[f"FINDING {what}"] += 1


@dataclass
class Config:
    duration_s: float = 60.0
    hang_s: float = 30.0
    seed: int = 0
    http_fuzzers: int = 2
    drippers: int = 4
    drip_interval_s: float = 0.05
    stalled_readers: int = 2
    stall_s: float = 10.0
    idle_connections: int = 200
    streams: int = 2
    stream_tokens: int = 1500
    shape_pause_s: float = 0.5
    solo_s: float = 45.0  # then each shape alone beside the streams, this long at most (0: none)
    min_fuzz_requests: int = 0  # per HTTP fuzzer, even past the deadline
    rpc_frames: int = 0  # RPC frames to send, even past the deadline (0: until the deadline)


SHORT = Config(
    duration_s=5.0,
    hang_s=20.0,
    http_fuzzers=2,
    drippers=2,
    drip_interval_s=0.002,
    stalled_readers=1,
    stall_s=2.0,
    idle_connections=100,
    streams=2,
    stream_tokens=150,
    shape_pause_s=0.1,
    solo_s=0.0,
    min_fuzz_requests=40,
    rpc_frames=150,
)
