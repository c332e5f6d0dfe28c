"""The process's log output (``--log-format``, ``--log-requests``, ``--log-level``), and the
request and throughput lines every path writes.

A request line is an ordinary log record that also carries ``request`` (a dict of
``REQUEST_FIELDS``): text output shows its message, JSON output adds the fields, and
``--no-log-requests`` drops it at the handler, wherever it was logged from. A throughput line
carries ``stats`` (``STATS_FIELDS``) the same way.

Log lines carry client-supplied text (a ``remote_host``, an RPC trace, a peer's error
words, a request id). It is escaped in one place, ``escape``, applied by the formatters to
every record whatever its origin: in text output a message is one line, and the lines of a
traceback are indented, so no client text can start a line that passes for a record (or
steer a terminal). JSON output escapes through ``json.dumps``, plus the line separators it
leaves alone.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from ..config import Settings
    from ..engine import Engine, GenerationResult

BASE_FIELDS = ("ts", "level", "logger", "msg")
# Every request line has all of these in JSON (null where they do not apply), whatever its path.
REQUEST_FIELDS = (
    "request_id",  # the client's X-Request-Id / RPC trace, else this engine's own id
    "route",  # chat | completions | kv_export | decode | PREFILL | STATE_GET | ...
    "model",  # the model that served it (its served name)
    "status",  # done | cancelled | failed | ... (DECODE: its final state)
    "slot",
    "prompt_tokens",
    "cached_tokens",
    "host_cached_tokens",  # of cached_tokens, those the host prompt cache (RAM) gave back
    "disk_cached_tokens",  # of cached_tokens, those the disk tier (--cache-disk) gave back
    "completion_tokens",
    "finish_reason",  # stop | length (OpenAI's); abort when cancelled
    "ttft_ms",
    "e2e_ms",
    "tokens_per_s",
    "spec_drafted",  # speculation's draft tokens verified (null: it did not run)
    "spec_accepted",  # and accepted
    "lora",  # the LoRA adapter set it ran under (engine/adapters.py ``label``; null: the base model)
    "error",  # the failure's cause, when it failed
    "session_id",  # the agent session's id (as its client named it), when it named one
    "receipt",  # a cut turn's receipt (engine/receipts.py): what it generated, computed, kept
)
STATS_FIELDS = ("prompt_tokens_per_s", "generation_tokens_per_s", "running", "waiting", "kv_cache_usage")

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
stats_log = logging.getLogger("hydra_trio.stats")

# What must never reach a log line raw: C0 and C1 controls (line feeds, carriage returns,
# ESC of terminal sequences, NUL) and DEL; every other character str.splitlines() breaks
# lines at (U+2028, U+2029); the bidirectional overrides that reorder what a reader sees.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_JSON_UNSAFE = re.compile(r"[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")  # json.dumps did C0


def _escaped(m: re.Match[str]) -> str:
    c = ord(m.group())
    return {0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}.get(c) or (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}")


def escape(text: str) -> str:
    """``text`` with every character that could break or disguise a log line written as an
    escape (``\\n``, ``\\x1b``, ``\\u2028``): the one function every log line's text goes through."""
    return _UNSAFE.sub(_escaped, text)


class TextFormatter(logging.Formatter):
    """The text output: the message escaped into one line, a traceback's lines indented
    (and escaped each), so whatever a client put in either cannot pass for another record.
    The traceback is formatted here, never taken from ``record.exc_text``: another handler
    may have cached it there unescaped."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        out = self.formatMessage(record)
        if record.exc_info:
            out += "\n" + self.formatException(record.exc_info)
        elif record.exc_text:
            out += "\n" + _indented(record.exc_text)
        if record.stack_info:
            out += "\n" + self.formatStack(record.stack_info)
        return out

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join("    " + escape(line) for line in text.split("\n"))


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
        "host_cached_tokens": res.n_host,
        "disk_cached_tokens": res.n_disk,
        "completion_tokens": res.completion_tokens,
        "finish_reason": res.finish_reason if outcome == "done" else "abort" if outcome == "cancelled" else None,
        "ttft_ms": round(queue_s * 1000.0 + res.prompt_ms, 3) if started else None,
        "e2e_ms": round(queue_s * 1000.0 + res.prompt_ms + res.decode_ms, 3) if started else None,
        "tokens_per_s": round(res.tokens_per_s, 2),
        "spec_drafted": res.spec_drafted,
        "spec_accepted": res.spec_accepted,
    }


def receipt_note(receipt: dict[str, Any] | None) -> str:
    """The request line's words for a cut turn's receipt ("" when it was not cut)."""
    if receipt is None:
        return ""
    cached, kept = receipt["prompt_tokens_cached"], receipt["kept"]
    return (
        f", cut ({receipt['cut']}): {receipt['prompt_tokens_computed']} prompt tokens computed, cached "
        f"{cached['slot']} slot / {cached['ram']} RAM / {cached['disk']} disk, kept {kept['n_past']} ({kept['tier']})"
    )


def spec_note(res: GenerationResult) -> str:
    """The request line's words for speculation ("" when it did not run)."""
    if res.spec_drafted is None:
        return ""
    return f", {res.spec_accepted} of {res.spec_drafted} drafted tokens accepted"


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
        # These occur only inside JSON strings, where a \\u escape of their code point stands
        # for the same character.
        return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(out, ensure_ascii=False, default=str))


class _DropRequestLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not hasattr(record, "request")


def configure_logging(settings: Settings, stream: IO[str] | None = None) -> logging.Handler:
    """Route every log record to ``stream`` (stderr) as the settings say; returns the
    handler (tests remove it again). llama.cpp's own lines arrive at DEBUG unless they are
    warnings or errors (engine/llama/log.py); Hypercorn's access chatter is off."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter(_TEXT_FORMAT))
    if not settings.log_requests:
        handler.addFilter(_DropRequestLines())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(getattr(logging, settings.log_level.upper(), logging.INFO))
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    return handler


# ---- the periodic throughput line (vLLM's "Avg prompt throughput: ...") ---------------------


async def log_stats(engine: Engine, interval_s: float) -> None:
    """Every ``interval_s``, one throughput line, when the interval saw tokens or requests;
    runs until cancelled (it belongs to the engine's front-end nursery, app.py)."""
    last_t = trio.current_time()
    first = engine.stats()
    last_prompt, last_gen = first.prompt_tokens_processed, first.tokens_generated
    while True:
        await trio.sleep(interval_s)
        now = trio.current_time()
        snap = engine.stats()
        prompt, gen = snap.prompt_tokens_processed, snap.tokens_generated
        running, waiting = snap.slots_busy, snap.requests_waiting
        elapsed = max(now - last_t, 1e-9)
        if prompt != last_prompt or gen != last_gen or running or waiting:
            stats = {
                "prompt_tokens_per_s": round((prompt - last_prompt) / elapsed, 1),
                "generation_tokens_per_s": round((gen - last_gen) / elapsed, 1),
                "running": running,
                "waiting": waiting,
                "kv_cache_usage": round(snap.kv_cache_usage, 4),
            }
            stats_log.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                stats["prompt_tokens_per_s"], stats["generation_tokens_per_s"], running, waiting,
                100.0 * stats["kv_cache_usage"], extra={"stats": stats},
            )
        last_t, last_prompt, last_gen = now, prompt, gen
