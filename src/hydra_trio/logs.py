"""The process's log output (``--log-format``, ``--log-requests``, ``--log-level``), and the
request and throughput lines every path writes.

A request line is an ordinary log record that also carries ``request`` (a dict of
``REQUEST_FIELDS``): text output shows its message, JSON output adds the fields, and
``--no-log-requests`` drops it at the handler, wherever it was logged from. A throughput line
carries ``stats`` (``STATS_FIELDS``) the same way.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from .config import Settings
    from .engine.engine import Engine, GenerationResult

BASE_FIELDS = ("ts", "level", "logger", "msg")
# Every request line has all of these in JSON (null where they do not apply), whatever its path.
REQUEST_FIELDS = (
    "request_id",  # the client's X-Request-Id / RPC trace, else this engine's own id
    "route",  # chat | completions | kv_export | decode | PREFILL | STATE_GET | ...
    "status",  # done | cancelled | failed | ... (DECODE: its final state)
    "slot",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "finish_reason",  # stop | length (OpenAI's); abort when cancelled
    "ttft_ms",
    "e2e_ms",
    "tokens_per_s",
    "error",  # the failure's cause, when it failed
)
STATS_FIELDS = ("prompt_tokens_per_s", "generation_tokens_per_s", "running", "waiting", "kv_cache_usage")

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
stats_log = logging.getLogger("hydra_trio.stats")


def request_extra(**fields: Any) -> dict[str, Any]:
    """``extra=`` for a request line: unknown names are a bug, so they raise here."""
    unknown = fields.keys() - set(REQUEST_FIELDS)
    if unknown:
        raise TypeError(f"not request fields: {sorted(unknown)}")
    return {"request": {name: fields.get(name) for name in REQUEST_FIELDS}}


def generation_fields(res: GenerationResult, *, outcome: str, queue_s: float = 0.0) -> dict[str, Any]:
    """The request fields a finished (or stopped) generation fills in."""
    started = res.first_token_at is not None
    return {
        "status": outcome,
        "prompt_tokens": res.prompt_tokens,
        "cached_tokens": res.n_common,
        "completion_tokens": res.completion_tokens,
        "finish_reason": res.finish_reason if outcome == "done" else "abort" if outcome == "cancelled" else None,
        "ttft_ms": round(queue_s * 1000.0 + res.prompt_ms, 3) if started else None,
        "e2e_ms": round(queue_s * 1000.0 + res.prompt_ms + res.decode_ms, 3) if started else None,
        "tokens_per_s": round(res.tokens_per_s, 2),
    }


class JsonFormatter(logging.Formatter):
    """One JSON object per line: BASE_FIELDS always, REQUEST_FIELDS on request lines,
    STATS_FIELDS on throughput lines, ``exc`` when the record has a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("request", "stats"):
            extra = getattr(record, key, None)
            if isinstance(extra, dict):
                out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class _DropRequestLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not hasattr(record, "request")


def configure_logging(settings: Settings, stream: IO[str] | None = None) -> logging.Handler:
    """Route every log record to ``stream`` (stderr) as the settings say; returns the
    handler (tests remove it again). llama.cpp's own lines arrive at DEBUG unless they are
    warnings or errors (engine/llama/log.py); Hypercorn's access chatter is off."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else logging.Formatter(_TEXT_FORMAT))
    if not settings.log_requests:
        handler.addFilter(_DropRequestLines())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(getattr(logging, settings.log_level.upper(), logging.INFO))
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    return handler


# ---- the periodic throughput line (vLLM's "Avg prompt throughput: ...") ---------------------


def requests_running(engine: Engine) -> int:
    """Requests holding a slot: from its claim to its release (prefill, generation, export)."""
    return sum(1 for s in engine.slots.slots if s.busy)


def kv_cache_usage(engine: Engine) -> float:
    """KV held by running requests, of all cells (0..1). An idle slot's KV is a prefix cache
    that make_room() evicts on demand, as vLLM counts its cached-but-free blocks as free."""
    held = sum(engine.n_past(s.id) for s in engine.slots.slots if s.busy)
    return min(1.0, held / engine.n_ctx)


async def log_stats(engine: Engine, interval_s: float) -> None:
    """Every ``interval_s``, one throughput line, when the interval saw tokens or requests;
    runs until cancelled (it belongs to the engine's front-end nursery, app.py)."""
    last_t = trio.current_time()
    last_prompt, last_gen = engine.prompt_tokens_processed, engine.tokens_generated
    while True:
        await trio.sleep(interval_s)
        now = trio.current_time()
        prompt, gen = engine.prompt_tokens_processed, engine.tokens_generated
        running, waiting = requests_running(engine), engine.slots.waiting
        elapsed = max(now - last_t, 1e-9)
        if prompt != last_prompt or gen != last_gen or running or waiting:
            stats = {
                "prompt_tokens_per_s": round((prompt - last_prompt) / elapsed, 1),
                "generation_tokens_per_s": round((gen - last_gen) / elapsed, 1),
                "running": running,
                "waiting": waiting,
                "kv_cache_usage": round(kv_cache_usage(engine), 4),
            }
            stats_log.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                stats["prompt_tokens_per_s"], stats["generation_tokens_per_s"], running, waiting,
                100.0 * stats["kv_cache_usage"], extra={"stats": stats},
            )
        last_t, last_prompt, last_gen = now, prompt, gen
