"""Anthropic's Messages API as a codec over the chat pipeline: its routes
(``messages_routes``: the dialect), its protocol (``messages_protocol``: the request as the
chat request, a whole message, the error shape) and its serving (``messages_serving``: a
generation answered, whole or as its event stream)."""

from .messages_protocol import error_shape, message_body, to_chat
from .messages_routes import MESSAGES
from .messages_serving import MessageTable, message_events

__all__ = ["MESSAGES", "MessageTable", "error_shape", "message_body", "message_events", "to_chat"]
