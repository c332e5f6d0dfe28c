"""How many prompt tokens a step beside running streams carries: as many as keep the step,
and so the streams' inter-token latency, under a target (``--itl-target-ms``).

A step's time is modelled as the streams' own step (measured: steps without prompt tokens,
per number of streams) plus a cost per prompt token (measured: each step with prompt tokens,
what it took beyond the streams' step, per token). The cost per prompt token grows as the
prompt gets longer (attention reads every earlier position), so it follows the latest steps
closely. Until both are measured, a step carries ``--step-token-budget`` prompt tokens.

The default target (``--itl-target-ms 0``) is the machine's own: ``AUTO_STEPS`` times a
one-stream step as measured here. A prompt part then costs the prefill little beyond its
own compute (each part also runs the streams' step: about 1 / AUTO_STEPS more), so a long
prompt beside a stream is ready about as soon as alone, while the stream still gets a
token every target; a GPU's short steps give a short target, a CPU's long ones a long one.

A prompt part is never sized below ``EFFICIENT_CHUNK`` tokens under the default target: on a
CPU a part's cost per token depends on its size (matmul efficiency). Measured (Gemma 3 270M,
1 thread, 4k deep, a loaded machine) a 16- or 32-token part costs ~14 ms a token against ~9.4
for 64 to 511; at 8k a 128-token budget cost the prompt ~5% against 512 (docs/performance.md).
Sized by time alone, parts fell to ~32 tokens at 16k depth and the prompt took 1.8x its time
alone. The split into ubatches is not the cause: with split KV llama.cpp's split_equal runs
a stream token and a part as two ubatches ({stream, 1 prompt token}, then the rest), and the
stream's token so costs about one stream step on top of the part (measured), as assumed.
So the default target is the larger of ``AUTO_STEPS`` one-stream steps
and a step with an ``EFFICIENT_CHUNK``-token part beside one stream, as measured lately (it
grows with the prompt's depth). A given target is kept as given. Pure Python, trio thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AUTO_STEPS", "EFFICIENT_CHUNK", "ChunkSizer", "ChunkingStats"]

AUTO_STEPS = 20  # the default ITL target, in one-stream steps (see the module's docstring)
# The smallest prompt part whose cost a token is within ~5% of a full batch's (see above).
EFFICIENT_CHUNK = 128
_STEP_WEIGHT = 0.2  # the latest steps-only step's weight in its stream count's mean
_TOKEN_WEIGHT = 0.5  # the latest prompt step's weight in the cost per prompt token
_AIM = 0.9  # steps are sized for this share of the target: the cost per token rises as it goes


@dataclass(frozen=True, slots=True)
class ChunkingStats:
    """What the sizer has measured and the target in force (/metrics): None until measured."""

    itl_target_s: float | None
    one_stream_step_s: float | None
    prompt_token_s: float | None
    part_floor_tokens: int


class ChunkSizer:
    """The prompt tokens of the next step beside ``n`` streams (``chunk``), from the step
    times the batcher reports (``steps_ran``, ``prompt_ran``)."""

    def __init__(self, target_s: float, *, budget: int, n_batch: int) -> None:
        self.configured_s = target_s  # 0: the machine's own (AUTO_STEPS one-stream steps)
        self.budget = max(1, budget)
        self.floor = max(1, self.budget // 4)  # a prompt progresses whatever the streams cost
        self.n_batch = n_batch
        self._step_s: dict[int, float] = {}  # streams -> mean seconds of a step of only theirs
        self._token_s: float | None = None  # seconds per prompt token beside streams, lately

    @property
    def target_s(self) -> float | None:
        """The ITL target in force; None while the default is not measured yet."""
        if self.configured_s > 0:
            return self.configured_s
        one = self._step_s.get(1)
        if one is None:
            return None
        if self._token_s is None:
            return AUTO_STEPS * one
        return max(AUTO_STEPS * one, (one + EFFICIENT_CHUNK * self._token_s) / _AIM)

    @property
    def part_floor(self) -> int:
        """The fewest prompt tokens a step carries once measured: under the default target,
        an efficient part; under a given one, a quarter of the token budget."""
        return self.floor if self.configured_s > 0 else max(self.floor, EFFICIENT_CHUNK)

    def steps_ran(self, n: int, seconds: float) -> None:
        """A step of ``n`` streams and no prompt tokens took ``seconds``."""
        mean = self._step_s.get(n)
        self._step_s[n] = seconds if mean is None else mean + _STEP_WEIGHT * (seconds - mean)

    def prompt_ran(self, n: int, n_prompt: int, seconds: float) -> None:
        """A step of ``n`` streams and ``n_prompt`` prompt tokens took ``seconds``."""
        base = self.step_s(n)
        if base is None or n_prompt <= 0:
            return
        per_token = max(seconds - base, 0.0) / n_prompt
        last = self._token_s
        self._token_s = per_token if last is None else last + _TOKEN_WEIGHT * (per_token - last)

    def step_s(self, n: int) -> float | None:
        """A step of ``n`` streams: as measured, else as the nearest count measured (more
        streams cost at least as much: from below it is a lower bound)."""
        if n in self._step_s:
            return self._step_s[n]
        if not self._step_s:
            return None
        nearest = min(self._step_s, key=lambda m: (abs(m - n), -m))
        return self._step_s[nearest]

    def chunk(self, n: int) -> int:
        """Prompt tokens for the next step beside ``n`` streams (n >= 1)."""
        room = max(1, self.n_batch - n)
        target, base, per_token = self.target_s, self.step_s(n), self._token_s
        if target is None or base is None or per_token is None:
            return min(room, max(self.budget - n, self.floor))  # not measured yet
        left = _AIM * target - base
        if left <= 0:
            return min(room, self.part_floor)  # the streams' own step is over the target already
        if per_token <= 0:
            return room
        return min(room, max(int(left / per_token), self.part_floor))

    def report(self) -> ChunkingStats:
        """What it has measured, for /metrics and the docs' figures."""
        return ChunkingStats(self.target_s, self._step_s.get(1), self._token_s, self.part_floor)
