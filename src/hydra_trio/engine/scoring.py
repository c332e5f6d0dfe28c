"""Prompt logprobs (text completions' ``echo`` with ``logprobs``, what lm-eval's loglikelihood
tasks read): the prompt evaluated into the claimed slot with every position's logits, each
prompt token's log-probability (and the top alternatives) given the tokens before it.

The whole prompt is evaluated anew (the slot's history goes to the prompt cache first): a
position reused from cache has no logits to read. Its last position's logits stay with the
slot, so a generation that follows samples its first token from them, as a restored hand-off
does (``SlotScheduler.reuse_plan``): the echoed prompt and the completion are one computation.
The parts are cancellable worker calls, as a prefill's chunks: --batch-size tokens, or
--step-token-budget while streams generate (between two parts every waiting step runs, so
their pace holds). The log-softmax of each row is taken in the call (the next decode
overwrites the logits), row by row: a part's rows are never copied out whole.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import trio

from ..wire.errors import ErrorCode, ProtocolError
from .llama import DecodeAborted, NoKvSpace, TokenLogprobs, token_logprobs

if TYPE_CHECKING:
    from .core import EngineCore


async def score_prompt(
    core: EngineCore, slot: int, tokens: Sequence[int], top_n: int, *, salt: str | None
) -> list[TokenLogprobs]:
    """The log-probability of each of ``tokens[1:]`` given those before it, with its
    ``top_n`` most likely alternatives; the slot then holds the prompt and its last
    position's logits (under the request's cache ``salt``)."""
    backend, scheduler = core.backend, core.scheduler
    await scheduler.keep_history(slot, 0)
    await scheduler.adopt_salt(slot, salt)
    await scheduler.make_room(len(tokens) - backend.n_past(slot), exclude=slot)
    out: list[TokenLogprobs] = []
    done = 0
    while done < len(tokens):
        budget = core.settings.step_token_budget if core.batcher.generating > 0 else backend.n_batch
        part = list(tokens[done : done + min(budget, backend.n_batch)])
        after = list(tokens[done + 1 : done + len(part) + 1])  # each row's next token
        last = done + len(part) == len(tokens)

        def rows(logits: np.ndarray, after: list[int] = after) -> None:
            out.extend(token_logprobs(logits[i], t, top_n) for i, t in enumerate(after))

        def call(abort: threading.Event, part: list[int] = part, keep: int = done, last: bool = last) -> None:
            if backend.truncate_slot(slot, keep) != keep:
                raise ProtocolError(ErrorCode.INTERNAL, f"slot {slot}: its KV could not be cut back to {keep} positions")
            backend.eval_chunk(slot, part, abort, want_logits=last, rows=rows)

        try:
            await core.worker.run(call)
        except DecodeAborted:
            await trio.lowlevel.checkpoint()  # the cancellation that raised the flag
            raise
        except NoKvSpace:
            raise ProtocolError(ErrorCode.INTERNAL, f"KV cache full: the prompt needs {len(tokens)} positions in slot {slot}") from None
        done += len(part)
        core._chunk_prompt_tokens += len(part)  # the engine's prompt figures count them
    return out
