"""Output processing: what a request's sampled tokens become (vLLM's output processor).
Tokens -> text (UTF-8 pieces assembled, stop strings cut), the stop decision (end of
generation, a stop string, max_tokens, a full context), what is streamed when
(stream_interval) and the per-token record (timings, logprobs) in GenerationResult."""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from .params import GenerationParams
from .sample import Sampler, TokenLogprobs
from .text import TextAssembler


@dataclass(slots=True)
class GenerationResult:
    prompt_tokens: int = 0
    n_common: int = 0  # prompt tokens found in the slot's KV (not recomputed)
    n_host: int = 0  # of them, those the host prompt cache put back into the slot (--cache-ram-mib)
    n_disk: int = 0  # of them, those the disk tier put back (--cache-disk)
    n_prompt_processed: int = 0  # prompt tokens evaluated by this request
    logits_reused: bool = False  # first token sampled from logits that came with the KV
    completion_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)  # joined on read: appends stay O(1)
    stop_type: str = "limit"  # eos | word | limit | context | cancelled (a cut turn: ``cut`` says why)
    stopping_word: str = ""
    prompt_ms: float = 0.0  # generation start -> first token sampled (prefill of the delta)
    decode_ms: float = 0.0  # first token -> last token
    first_token_at: float | None = None  # perf_counter() when the first token was sampled
    tokens: list[int] = field(default_factory=list)
    # Seconds between consecutive sampled tokens (vllm:inter_token_latency_seconds).
    token_gaps_s: array[float] = field(default_factory=lambda: array("d"))
    # Per generated token (``tokens``), when the request asked for logprobs
    # (engine/sample/token_logprobs.py).
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Speculation (engine/speculation/): draft tokens verified and accepted; None: it did not run.
    spec_drafted: int | None = None
    spec_accepted: int | None = None
    # The turn's receipt (engine/receipts.py): its session, why it was cut (None: it was
    # not), and the positions its slot held when it ended.
    session_id: str | None = None
    cut: str | None = None
    n_past_kept: int | None = None

    @property
    def text(self) -> str:
        if len(self.text_parts) > 1:
            self.text_parts[:] = ["".join(self.text_parts)]
        return self.text_parts[0] if self.text_parts else ""

    @text.setter
    def text(self, value: str) -> None:
        self.text_parts[:] = [value]

    @property
    def finish_reason(self) -> str:
        if self.stop_type == "cancelled":
            return "abort"  # vLLM's word for a request stopped from outside
        return "stop" if self.stop_type in ("eos", "word") else "length"

    @property
    def tokens_per_s(self) -> float:
        if self.completion_tokens <= 1 or self.decode_ms <= 0:
            return 0.0
        return (self.completion_tokens - 1) / (self.decode_ms / 1000.0)


class OutputProcessor:
    """One request's tokens as they are sampled: ``take`` records each one and says whether
    generation ends with it (the one stop decision of every path that generates), ``ready``
    gives the text due to readers now, ``finish`` the rest at the end."""

    def __init__(
        self,
        params: GenerationParams,
        res: GenerationResult,
        sampler: Sampler,
        *,
        is_eog: Callable[[int], bool],
        token_bytes: Callable[[int], bytes],
    ) -> None:
        self._params = params
        self._res = res
        self._sampler = sampler
        self._is_eog = is_eog
        self._token_bytes = token_bytes
        self._assembler = TextAssembler(params.stop)
        self._pending: list[str] = []  # text not handed to readers yet (stream_interval)
        self._unsent = 0  # tokens whose text is in pending
        self._t_last = 0.0

    def started(self, t_start: float) -> None:
        """The first token was sampled now (``t_start``: when the request began)."""
        res = self._res
        res.first_token_at = self._t_last = time.perf_counter()
        res.prompt_ms = (res.first_token_at - t_start) * 1000.0

    def take(self, token: int | None) -> bool:
        """Record ``token`` (None: the context is full); True when generation ends with it."""
        res = self._res
        if token is None:
            res.stop_type = "context"
            return True
        if self._is_eog(token):
            res.stop_type = "eos"
            return True
        res.tokens.append(token)
        if self._params.logprobs is not None:  # recorded by the worker call that sampled it
            res.logprobs.append(self._sampler.picked[res.completion_tokens])
        now = time.perf_counter()
        if res.completion_tokens:
            res.token_gaps_s.append(now - self._t_last)
        self._t_last = now
        res.completion_tokens += 1
        delta = self._assembler.push(self._token_bytes(token))
        if delta:
            res.text_parts.append(delta)
            self._pending.append(delta)
        self._unsent += 1
        if self._assembler.stopped_by is not None:
            res.stop_type = "word"
            res.stopping_word = self._assembler.stopped_by
            return True
        if res.completion_tokens >= self._params.n_predict:
            res.stop_type = "limit"
            return True
        return False

    def ready(self) -> str | None:
        """Text due to readers now: the first token's at once, then every stream_interval."""
        pending = self._pending
        if pending and (self._res.completion_tokens == 1 or self._unsent >= self._params.stream_interval):
            send = pending[0] if len(pending) == 1 else "".join(pending)
            pending.clear()
            self._unsent = 0
            return send
        return None

    def unsent(self) -> str | None:
        """Text taken but not yet handed to readers, at the end of generation."""
        if not self._pending:
            return None
        send = "".join(self._pending)
        self._pending.clear()
        return send

    def finish(self) -> str:
        """What the text assembler still held (bytes of an unfinished character, text held
        back for a possible stop string): part of the reply."""
        tail = self._assembler.finish()
        if tail:
            self._res.text_parts.append(tail)
        return tail

    @property
    def remaining(self) -> int:
        return self._params.n_predict - self._res.completion_tokens
