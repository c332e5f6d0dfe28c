"""GET and DELETE /v1/decode/{id}: a DECODE's result, replayed and live (SSE) or whole (JSON), and its cancel."""

from .decode_routes import bp

__all__ = ["bp"]
