"""All settings in one place: each flag of `hydra-trio serve` and its HYDRA_* variable."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any

_MiB = 1024 * 1024
_GiB = 1024 * _MiB


@dataclass(frozen=True, slots=True)
class Settings:
    model: str | None = None  # None: the synthetic demo model from the user cache
    alias: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080  # HTTP; 0 = ephemeral
    rpc_port: int = 9504  # binary RPC; 0 = ephemeral
    slots: int = 4
    ctx_size: int = 4096  # KV cells shared by all slots (unified cache); also the per-slot limit
    threads: int = max(1, min(8, os.cpu_count() or 1))
    batch_size: int = 512  # prefill chunk: one cancellable GPU-worker call
    default_n_predict: int = 512  # when a request names no max_tokens / n_predict
    slot_wait_s: float = 30.0  # chat completions wait this long for a free slot, then 503
    # RPC transport (spec §1)
    max_connections: int = 64
    idle_timeout_s: float = 120.0
    drain_limit_bytes: int = 64 * _MiB
    max_kv_bytes: int = 4 * _GiB
    max_json_bytes: int = 64 * _MiB
    max_decode_header_bytes: int = 32 * 1024
    max_inflight_bytes: int = 8 * _GiB  # payload bytes held by all RPC connections together
    # DECODE lifecycle (spec §4, §6.4)
    decode_validate_timeout_s: float = 30.0
    decode_result_ttl_s: float = 300.0
    decode_result_max: int = 1024
    shutdown_grace_s: float = 10.0
    # P/D hand-off through a router's kv_transfer_params (docs/protocol-extensions.md)
    advertise_host: str | None = None  # None: the bind host
    kv_export_max_bytes: int = 2 * _GiB
    kv_export_ttl_s: float = 30.0
    kv_pull_timeout_s: float = 30.0
    log_level: str = "INFO"


# flag name -> (env var, help). The env var is read when the flag is not given.
_HELP: dict[str, str] = {
    "model": "GGUF model path (default: a synthetic random-weight demo model)",
    "alias": "model alias reported in identity (default: the file stem)",
    "host": "address to bind HTTP and RPC",
    "port": "HTTP port (0 = ephemeral)",
    "rpc_port": "binary RPC port (0 = ephemeral)",
    "slots": "number of slots (llama sequences)",
    "ctx_size": "KV cells shared by all slots; also the most one slot can hold",
    "threads": "CPU threads for llama.cpp",
    "batch_size": "prefill chunk size in tokens (each chunk is one cancellable call)",
    "default_n_predict": "tokens to generate when a request does not say",
    "slot_wait_s": "seconds a chat completion waits for a free slot before 503",
    "max_connections": "open RPC connections at most (more wait)",
    "idle_timeout_s": "an idle RPC connection closes after this many seconds",
    "drain_limit_bytes": "a refused request's payload up to this size is drained, larger closes",
    "max_kv_bytes": "largest KV blob accepted",
    "max_json_bytes": "largest JSON payload accepted",
    "max_decode_header_bytes": "largest DECODE control header accepted",
    "max_inflight_bytes": "payload bytes all RPC connections may hold at once (more wait)",
    "decode_validate_timeout_s": "deadline for DECODE validate + restore",
    "decode_result_ttl_s": "seconds a finished decode result stays readable",
    "decode_result_max": "decode results kept at most",
    "shutdown_grace_s": "seconds running decodes get to finish on shutdown",
    "advertise_host": "RPC host a decode engine pulls KV exports from (default: --host)",
    "kv_export_max_bytes": "bytes all KV exports may hold; past it the oldest are evicted",
    "kv_export_ttl_s": "seconds a KV export waits to be pulled before it is dropped",
    "kv_pull_timeout_s": "deadline for pulling a KV export from a prefill engine",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
}

# Spec §6.4 names these two variables; the rest follow HYDRA_<FLAG>.
_ENV_OVERRIDES = {
    "decode_result_ttl_s": "HYDRA_DECODE_RESULT_TTL_S",
    "decode_result_max": "HYDRA_DECODE_RESULT_MAX",
}


def env_name(field_name: str) -> str:
    return _ENV_OVERRIDES.get(field_name, "HYDRA_" + field_name.upper())


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _convert(kind: type, raw: str, name: str) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"{name}: expected {kind.__name__}, got {raw!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    for f in fields(Settings):
        kind = type(getattr(defaults, f.name)) if getattr(defaults, f.name) is not None else str
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            type=kind,
            default=None,
            help=f"{_HELP[f.name]} [env {env_name(f.name)}; default {getattr(defaults, f.name)}]",
        )


def settings_from(args: argparse.Namespace | None = None, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
    """Flags win over HYDRA_* variables, which win over defaults."""
    env = dict(os.environ) if env is None else env
    defaults = Settings()
    values: dict[str, Any] = {}
    for f in fields(Settings):
        default = getattr(defaults, f.name)
        kind = type(default) if default is not None else str
        given = getattr(args, f.name, None) if args is not None else None
        if given is not None:
            values[f.name] = given
        elif env.get(env_name(f.name)):
            values[f.name] = _convert(kind, env[env_name(f.name)], env_name(f.name))
    values.update(overrides)
    settings = Settings(**{**{f.name: getattr(defaults, f.name) for f in fields(Settings)}, **values})
    validate(settings)
    return settings


def validate(s: Settings) -> None:
    problems = []
    if not 1 <= s.slots <= 256:
        problems.append("slots must be 1..256")
    if s.ctx_size < 64:
        problems.append("ctx_size must be at least 64")
    if not 1 <= s.batch_size <= 8192:
        problems.append("batch_size must be 1..8192")
    if s.threads < 1:
        problems.append("threads must be >= 1")
    for name in ("port", "rpc_port"):
        if not 0 <= getattr(s, name) <= 65535:
            problems.append(f"{name} must be 0..65535")
    if s.kv_export_max_bytes < 1 or s.kv_export_ttl_s <= 0 or s.kv_pull_timeout_s <= 0:
        problems.append("kv_export_max_bytes, kv_export_ttl_s and kv_pull_timeout_s must be positive")
    if s.decode_result_max < 1:
        problems.append("decode_result_max must be >= 1")
    if problems:
        raise SystemExit("invalid settings: " + "; ".join(problems))


def settings_table() -> str:
    """Markdown table of every setting (README's reference)."""
    rows = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    defaults = Settings()
    for f in fields(Settings):
        rows.append(f"| `{flag_name(f.name)}` | `{env_name(f.name)}` | `{getattr(defaults, f.name)}` | {_HELP[f.name]} |")
    return "\n".join(rows)
