"""OpenAI's chat and text completions (and, for now, /health, /version, /slots)."""

from .chat_serving import bp as chat_bp
from .chat_serving import completion_body, final_chunk, health_reply
from .text_serving import bp as text_bp

__all__ = ["chat_bp", "completion_body", "final_chunk", "health_reply", "text_bp"]
