"""``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI's chat and text
completions, each the one dialect route (http/generation/dialect.py) with its own answer.
Their body is the engine's request as it is (no codec), its names OpenAI's, and their errors
in OpenAI's shape, every route's."""

from __future__ import annotations

from ..generation import Dialect
from .chat_serving import answer_chat
from .text_serving import answer_text

CHAT = Dialect("chat", "/v1/chat/completions", "chatcmpl-", answer_chat)
TEXT = Dialect("completions", "/v1/completions", "cmpl-", answer_text, prepares_as="completions")
