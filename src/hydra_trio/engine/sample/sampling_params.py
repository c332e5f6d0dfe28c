"""A request's sampling settings, as generation reads them: pure values (validated by
engine/params.py) that pickle and compare."""

from __future__ import annotations

from dataclasses import dataclass

from ..structured import OutputGrammar


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0  # OpenAI's, over the last repeat_last_n tokens (llama.cpp's)
    presence_penalty: float = 0.0
    seed: int = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: random
    ignore_eos: bool = False  # end-of-generation tokens are never sampled (benchmarks' convention)
    min_tokens: int = 0  # vLLM's: no end-of-generation token before this many (stop strings still stop)
    # What every sampled token must follow (response_format, json_schema, grammar, tools), as
    # its grammar text and lazy triggers; compiled off the worker (engine/structured/guidance.py).
    grammar: OutputGrammar | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether any repetition penalty changes the logits before the pick."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
