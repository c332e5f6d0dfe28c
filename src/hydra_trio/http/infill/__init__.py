"""llama-server's fill-in-the-middle (/infill) for code editors."""

from .infill_routes import bp

__all__ = ["bp"]
