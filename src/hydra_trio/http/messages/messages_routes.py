"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API on
the one dialect route (http/generation/dialect.py): its codec and its names
(messages_protocol.py), its answer (messages_serving.py), and its error shape on every
path under /v1/messages."""

from __future__ import annotations

from ..generation import Dialect
from .messages_protocol import error_reply, param_names, to_chat
from .messages_serving import answer_messages

MESSAGES = Dialect(
    "messages", "/v1/messages", "msg_", answer_messages, codec=to_chat, names=param_names, error_shape=error_reply,
    count_rule="/v1/messages/count_tokens", count_reply=lambda n: {"input_tokens": n},
)
