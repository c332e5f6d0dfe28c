"""OpenAI's chat and text completions: their routes (``completions_routes``: the two
dialects), their shapes (``chat_protocol``, ``text_protocol``, ``logprobs``), how a
generation of each is answered (``chat_serving``, ``text_serving``), and the P/D hand-off's
hooks both call (``kv_transfer``)."""

from .chat_protocol import ReplyEvents, completion_body, completion_chunk, final_chunk, timings
from .completions_routes import CHAT, TEXT

__all__ = ["CHAT", "TEXT", "ReplyEvents", "completion_body", "completion_chunk", "final_chunk", "timings"]
