"""GET and DELETE /v1/decode/{id}: a DECODE's result, replayed and live (SSE) or whole (JSON), and its cancel."""

from quart import Blueprint

from .decode_routes import bp

BLUEPRINTS: tuple[Blueprint, ...] = (bp,)

__all__ = ["BLUEPRINTS"]
