"""Anthropic's Messages API as a codec over the chat pipeline."""

from .messages_protocol import (
    MessageEvents,
    bp,
    error_shape,
    message_body,
    on_messages_path,
    to_chat,
)

__all__ = ["MessageEvents", "bp", "error_shape", "message_body", "on_messages_path", "to_chat"]
