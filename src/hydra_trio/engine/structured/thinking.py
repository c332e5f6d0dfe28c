"""A reply's think block as generation sees it: the thinking budget (llama-server's
--reasoning-budget / ``reasoning_budget_tokens``) and the output grammar held until the block
closes. ``ThinkPlan`` is the request's (pure, made with the rendered prompt); ``ThinkGate`` is
one generation's state, advanced by every token its sampler picks, on the GPU worker.

As llama.cpp's reasoning-budget sampler (common/reasoning-budget.cpp): once the block has had
its budget of tokens (and the text is whole UTF-8), the close tag's tokens are forced, one a
pick, as real generated tokens (decoded, counted in usage, read by the reply parser). Unlike
llama-server, a grammar (response_format, a forced tool call) is held while the block is open
and starts after the close tag, so the model reasons first and its reply still follows the
grammar (llama-server applies it from the first token: ggml-org/llama.cpp#22537); an end of
generation inside the block, where a grammar waits, is turned into the close tag.

The block's tags are matched in the generated text (each token's shown bytes), not as token
ids: a model may write ``</think>`` as one special token or as pieces.
"""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class ThinkPlan:
    open_text: bytes  # the template's think tags, as generated text
    close_text: bytes
    open_tokens: tuple[int, ...]  # the tags tokenized (special tokens parsed): what is forced
    close_tokens: tuple[int, ...]
    budget: int = -1  # reasoning tokens at most; -1: unlimited, 0: the block closes at once
    starts_in_reasoning: bool = False  # the prompt ended inside an open block
    force_open: bool = False  # the reply is made to open the block (a grammar waits after it)
    holds_grammar: bool = False  # the request's grammar starts after the close tag


class ThinkGate:
    """One generation's think block: where the reply is (before the block, in it, past it),
    the reasoning tokens it has had, and the tokens still to be forced."""

    def __init__(self, plan: ThinkPlan, token_bytes: Callable[[int], bytes]) -> None:
        self.plan = plan
        self._bytes = token_bytes
        self.state: Literal["before", "think", "done"] = "think" if plan.starts_in_reasoning else "before"
        self.n_reasoning = 0  # tokens generated inside the block (forced ones not counted)
        self._forced: deque[int] = deque(plan.open_tokens if plan.force_open and not plan.starts_in_reasoning else ())
        self._tail = b""  # the generated text's end, long enough to find a tag split over tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        if self.state == "think":
            self._opened()

    @property
    def holds_grammar(self) -> bool:
        """Whether the grammar still waits (the block is to come or open)."""
        return self.plan.holds_grammar and self.state != "done"

    def forced(self) -> int | None:
        """The token the next pick must be (a tag being written), or None: the model's pick."""
        return self._forced[0] if self._forced else None

    def close_instead(self) -> int | None:
        """An end of generation was picked inside the block while a grammar waits: the close
        tag's first token instead (the rest follow), so the reply still gets its answer."""
        if not self.holds_grammar or self.state != "think" or self._forced:
            return None
        self._forced.extend(self.plan.close_tokens)
        return self._forced[0] if self._forced else None

    def accept(self, token: int) -> None:
        """The pick ``token`` (forced or the model's) is generated: advance the state."""
        forced = bool(self._forced) and self._forced[0] == token
        if forced:
            self._forced.popleft()
        if self.state == "done":
            return
        piece = self._bytes(token)
        text = self._tail + piece
        if self.state == "before":
            at = text.find(self.plan.open_text)
            if at < 0:
                self._tail = text[-(len(self.plan.open_text) - 1):] if len(self.plan.open_text) > 1 else b""
                return
            self.state = "think"
            text = text[at + len(self.plan.open_text):]
            self._tail = b""
            self._opened()
            if not text:
                return
        if self.plan.close_text in text:
            self.state = "done"
            self._forced.clear()
            return
        keep = len(self.plan.close_text) - 1
        self._tail = text[-keep:] if keep else b""
        if forced:
            return
        self.n_reasoning += 1
        self._utf8.decode(piece)
        budget = self.plan.budget
        # The close is forced once the budget is spent and no character is cut in two.
        if 0 <= budget <= self.n_reasoning and not self._forced and not self._utf8.getstate()[0]:
            self._forced.extend(self.plan.close_tokens)

    def _opened(self) -> None:
        self.n_reasoning = 0
        if self.plan.budget == 0:
            self._forced.extend(self.plan.close_tokens)
