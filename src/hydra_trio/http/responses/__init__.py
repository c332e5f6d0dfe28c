"""OpenAI's Responses API as a codec over the chat pipeline; nothing stored."""

from .responses_protocol import ResponseEvents, Shell, bp, response_body, to_chat

__all__ = ["ResponseEvents", "Shell", "bp", "response_body", "to_chat"]
