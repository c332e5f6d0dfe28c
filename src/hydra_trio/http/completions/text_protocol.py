"""OpenAI's text completion shapes: the whole ``text_completion`` (also a stream's last
chunk) and a stream's chunk."""

from __future__ import annotations

from typing import Any

from ...engine import GenerationResult
from ..generation import receipt_fields
from .chat_protocol import timings, usage


def text_chunk(cid: str, created: int, model: str, text: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": None}],
    }


def text_completion_body(
    cid: str,
    created: int,
    model: str,
    slot_id: int | None,
    res: GenerationResult,
    *,
    text: str | None = None,
    logprobs: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The whole completion, or (``text=""``) the last chunk of a stream: finish_reason,
    usage and timings (and ``extra`` fields, e.g. the P/D hand-off's)."""
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "text": res.text if text is None else text,
                "index": 0,
                "logprobs": logprobs,
                "finish_reason": res.finish_reason,
            }
        ],
        "usage": usage(res.prompt_tokens, res.completion_tokens, res.n_common),
        "timings": timings(
            res.n_prompt_processed,
            res.prompt_ms,
            res.completion_tokens,
            res.decode_ms,
            res.n_common,
        ),
        "id_slot": slot_id,
        **receipt_fields(res),
        **extra,
    }
