"""A cut turn's receipt: what it did and what it left, the same in the reply, the decode record
and the log line (docs/operations.md, "Agent sessions"). A turn is cut when its deadline
passes, its session's tree is finished, its parent's request is cancelled, or its client
leaves (then only the log line reads it). A later turn that continues the cut one (its
prompt extends what was generated) finds ``kept`` in its slot, or wherever the retention
order moved it."""

from __future__ import annotations

from typing import Any

from .output import GenerationResult


def prompt_tokens_computed(res: GenerationResult) -> int:
    """Prompt tokens this request evaluated: its plan, or, when it was cut before its first
    token, the part of the plan its slot holds (a cancelled chunk's cells are removed)."""
    if res.first_token_at is not None or res.n_past_kept is None:
        return res.n_prompt_processed
    return max(0, min(res.n_prompt_processed, res.n_past_kept - res.n_common))


def turn_receipt(res: GenerationResult) -> dict[str, Any] | None:
    """The receipt of a cut turn (None: it was not cut)."""
    if res.cut is None:
        return None
    kept = res.n_past_kept or 0
    tier = "slot" if kept else "none"
    if res.cut == "finish_session":  # its tree's KV was released after it stopped
        kept, tier = 0, "released"
    return {
        "cut": res.cut,
        "session_id": res.session_id,
        "completion_tokens": res.completion_tokens,
        "prompt_tokens": res.prompt_tokens,
        "prompt_tokens_computed": prompt_tokens_computed(res),
        "prompt_tokens_cached": {
            "slot": max(0, res.n_common - res.n_host - res.n_disk),
            "ram": res.n_host,
            "disk": res.n_disk,
        },
        "kept": {"n_past": kept, "tier": tier},
    }
