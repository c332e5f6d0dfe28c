"""The settings' rules: the words a setting may take, the ranges it must lie in, and
``validate``, which holds a ``Settings`` from any source (flags, variables, a caller's
overrides) to them and to the rules between settings."""

from __future__ import annotations

import os
import string
from collections.abc import Collection, Mapping

import gguf

from ..model.lora import adapter_specs
from ..wire.sampling import SPEC_TYPES
from .settings import Settings

FLASH_ATTN_MODES = ("on", "off", "auto")
LOG_FORMATS = ("text", "json")
REASONING_FORMATS = ("auto", "deepseek", "none")
# KV cache types by llama-server's names (-ctk/-ctv) -> ggml type ids, as gguf numbers them.
CACHE_TYPES = {
    name: int(gguf.GGMLQuantizationType[name.upper()])
    for name in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
}
UNQUANTIZED_CACHE_TYPES = frozenset({"f32", "f16", "bf16"})
# Settings that take one of a few words: argparse offers them, validate() holds any source to them.
# Words a layer above decides are handed in by the caller (``Choices``): the settings are below
# engine/, so the CLI gives tool_call_parser the engine's tool-call families (their roster,
# engine/chat/families/), and this module keeps no list of them.
Choices = Mapping[str, Collection[str]]
CHOICES: dict[str, tuple[str, ...]] = {
    "flash_attn": FLASH_ATTN_MODES,
    "cache_type_k": tuple(CACHE_TYPES),
    "cache_type_v": tuple(CACHE_TYPES),
    "log_format": LOG_FORMATS,
    "reasoning_format": REASONING_FORMATS,
    "spec_type": SPEC_TYPES,
    "kv_events_encoding": ("auto", "map", "array"),
    "session_policy": ("session", "lru"),
    "pooling": ("model", "none", "mean", "cls", "last", "rank"),
}


# Settings that must lie in a closed range.
_RANGES: dict[str, tuple[float, float]] = {
    "slots": (1, 256),
    "batch_size": (1, 8192),
    "step_token_budget": (1, 8192),
    "itl_target_ms": (0.0, 600_000.0),
    "slot_prompt_similarity": (0.0, 1.0),
    "slot_overtakes": (0, 1_000_000),
    "stream_interval": (1, 4096),
    "kv_events_block_size": (1, 4096),
    "kv_events_hwm": (1, 10_000_000),
    "kv_events_replay_bytes": (0, 1 << 40),
    "kv_events_replay_rate": (0.01, 1e6),
    "kv_events_resync_interval_s": (0.0, 86400.0),
    "spec_draft_n_max": (1, 256),
    "spec_draft_n_min": (0, 256),
    "spec_ngram_size_n": (1, 64),
    "spec_ngram_min_n": (1, 64),
    "spec_max_batch": (0, 256),
    "models_max": (1, 1024),
    "model_wait_s": (0.001, 1e6),
    "embd_batch_inputs": (1, 256),  # llama.cpp's LLAMA_MAX_SEQ
    "embd_max_waiting": (1, 1 << 20),
    "embd_normalize": (-1, 64),
}


def cache_type_problem(cache_type_v: str, flash_attn: str) -> str | None:
    """The one cache-type rule, for start-up and CONFIGURE T2 alike: llama.cpp refuses a
    context whose V cache is quantized without flash attention (only flash attention reads
    one). ``flash_attn``: on | off | auto (auto may turn it on)."""
    if cache_type_v in UNQUANTIZED_CACHE_TYPES or flash_attn != "off":
        return None
    return (
        f"cache_type_v {cache_type_v} is quantized, which needs flash attention: set --flash-attn on or auto, or an "
        "unquantized --cache-type-v (f16, bf16, f32)"
    )


def _topic_problem(topic: str) -> str | None:
    """A KV events topic names no placeholder but {pod} and {model} (kvevents.expand_topic)."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(topic) if name is not None}
    except ValueError as exc:
        return f"kv_events_topic: {exc} (write a brace as {{{{ or }}}})"
    if names - {"pod", "model"}:
        return f"kv_events_topic may name {{pod}} and {{model}} only, not {', '.join(sorted(names - {'pod', 'model'}))}"
    return None


def validate(s: Settings, choices: Choices | None = None) -> None:
    """SystemExit naming every problem; ``choices``: the words of settings a layer above
    decides (a setting not given its words here is held to them where it is used)."""
    problems = [
        f"{name} must be {lo:g}..{hi:g}" for name, (lo, hi) in _RANGES.items() if not lo <= getattr(s, name) <= hi
    ]
    if s.ctx_size < 64:
        problems.append("ctx_size must be at least 64")
    if s.slots > s.batch_size:
        # llama.cpp aborts the process (GGML_ASSERT n_outputs_max) when the slots' steps
        # cannot all go into one batch.
        problems.append(f"slots ({s.slots}) must not exceed batch_size ({s.batch_size}): every generating slot's step "
                        "goes into one batch (--slots, --batch-size)")
    if not set(s.configure_tier_set()) <= {"T1", "T2", "T3"}:
        problems.append("configure_tiers must be a comma list of T1, T2, T3")
    if s.cache_ram_mib < 0:
        problems.append("cache_ram_mib must be >= 0 (0 = off)")
    if s.cache_disk is not None and (not s.cache_disk.strip() or s.cache_ram_mib == 0):
        problems.append("cache_disk must name a folder and needs cache_ram_mib > 0 (the disk takes what RAM drops)")
    if not 0 < s.cache_disk_gib <= 1 << 20 or not 0 <= s.session_ttl_s <= 7 * 86400:
        problems.append("cache_disk_gib must be > 0 and session_ttl_s 0..604800")
    if not s.kv_unified and s.slots >= 1 and s.ctx_size // s.slots < 16:  # slots < 1: the range says so
        problems.append(f"ctx_size ({s.ctx_size}) gives each of {s.slots} slots fewer than 16 cells with a split KV "
                        "cache (--ctx-size, --slots, --kv-unified)")
    if s.threads < 1:
        problems.append("threads must be >= 1")
    if s.max_http_connections < 0 or s.min_upload_bytes_per_s < 0:
        problems.append("max_http_connections and min_upload_bytes_per_s "
                        "must be >= 0 (0 = the default bound / no floor)")
    if s.upload_grace_s <= 0 or s.download_grace_s <= 0:
        problems.append("upload_grace_s and download_grace_s must be positive")
    if s.min_download_bytes_per_s < 0:
        problems.append("min_download_bytes_per_s must be >= 0 (0 = no floor)")
    for name in ("port", "rpc_port"):
        if not 0 <= getattr(s, name) <= 65535:
            problems.append(f"{name} must be 0..65535")
    if s.kv_export_max_bytes < 1 or s.kv_export_ttl_s <= 0 or s.kv_pull_timeout_s <= 0:
        problems.append("kv_export_max_bytes, kv_export_ttl_s and kv_pull_timeout_s must be positive")
    if s.decode_result_max < 1:
        problems.append("decode_result_max must be >= 1")
    if s.api_key is not None and s.api_key_file is not None:
        problems.append("give api_key or api_key_file, not both")
    if s.api_key is not None and not s.api_key.strip():
        problems.append("api_key must not be empty")
    if s.admin_api_key is not None and s.admin_api_key_file is not None:
        problems.append("give admin_api_key or admin_api_key_file, not both")
    if s.admin_api_key is not None and not s.admin_api_key.strip():
        problems.append("admin_api_key must not be empty")
    if s.rpc_allow is not None and not s.rpc_allow.strip():
        problems.append("rpc_allow must name at least one network")
    if s.n_gpu_layers is not None and s.n_gpu_layers < -1:
        problems.append("n_gpu_layers must be -1 (all) or >= 0")
    if s.main_gpu < 0:
        problems.append("main_gpu must be >= 0")
    for name, words in {**CHOICES, **(choices or {})}.items():
        if getattr(s, name) not in words:
            problems.append(f"{name} must be one of {', '.join(words)}")
    if (problem := cache_type_problem(s.cache_type_v, s.flash_attn)) is not None:
        problems.append(problem)
    if s.ctx_checkpoints < 0:
        problems.append("ctx_checkpoints must be >= 0 (0 = off)")
    if s.reasoning_budget < -1:
        problems.append("reasoning_budget must be -1 (unlimited), 0 (thinking off) or a number of tokens, got "
                        f"{s.reasoning_budget}")
    if s.log_stats_interval_s < 0:
        problems.append("log_stats_interval_s must be >= 0 (0 = off)")
    if s.kv_events_replay_endpoint and not s.kv_events_endpoint:
        problems.append("kv_events_replay_endpoint needs kv_events_endpoint (the replays are of its batches)")
    if (problem := _topic_problem(s.kv_events_topic)) is not None:
        problems.append(problem)
    if s.kv_events_curve_allowed_keys_file and not s.kv_events_curve_secret_key_file:
        problems.append("kv_events_curve_allowed_keys_file needs kv_events_curve_secret_key_file (CURVE on)")
    if s.spec_draft_n_min > s.spec_draft_n_max:
        problems.append(f"spec_draft_n_min ({s.spec_draft_n_min}) must not exceed spec_draft_n_max "
                        f"({s.spec_draft_n_max})")
    if s.spec_ngram_min_n > s.spec_ngram_size_n:
        problems.append(f"spec_ngram_min_n ({s.spec_ngram_min_n}) must not exceed spec_ngram_size_n "
                        f"({s.spec_ngram_size_n})")
    if s.reranking and s.pooling not in ("model", "rank"):
        problems.append(f"reranking is rank pooling: it cannot go with pooling {s.pooling}")
    if s.embeddings is False and (s.reranking or s.pooling != "model"):
        problems.append("no_embeddings cannot go with pooling or reranking (they serve embeddings)")
    if s.chat_template and s.chat_template_file:
        problems.append("give chat_template or chat_template_file, not both")
    adapter_specs(s.lora, s.lora_scaled)  # a malformed or missing adapter stops startup here, named
    if s.mmproj is not None and not os.path.isfile(s.mmproj):
        problems.append(f"mmproj {s.mmproj!r}: no such file")
    if s.media_path is not None and not os.path.isdir(s.media_path):
        problems.append(f"media_path {s.media_path!r}: no such folder")
    problems.extend(f"media_url_prefix {p!r} must start with http:// or https://" for p in s.media_url_prefix
                    if not p.startswith(("http://", "https://")))
    if problems:
        raise SystemExit("invalid settings: " + "; ".join(problems))
    # An unreadable key file or a bad CIDR stops startup here, with its reason.
    plain, admin = s.http_api_key(), s.http_admin_api_key()
    if plain is not None and plain == admin:
        raise SystemExit("invalid settings: api_key and admin_api_key must differ (one key cannot hold two roles)")
    s.rpc_networks()
    s.kv_pull_networks()
