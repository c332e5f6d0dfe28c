"""OpenAI's Responses API as a codec over the chat pipeline, nothing stored: its routes
(``responses_routes``: the dialect), its protocol (``responses_protocol``: the request as
the chat request, a whole response object) and its serving (``responses_serving``: a
generation answered, whole or as its event stream)."""

from .responses_protocol import Shell, response_body, to_chat
from .responses_routes import RESPONSES
from .responses_serving import ResponseTable, response_events

__all__ = ["RESPONSES", "ResponseTable", "Shell", "response_body", "response_events", "to_chat"]
