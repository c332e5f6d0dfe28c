"""llama-server's fill-in-the-middle (/infill) for code editors."""

from quart import Blueprint

from .infill_routes import bp

BLUEPRINTS: tuple[Blueprint, ...] = (bp,)

__all__ = ["BLUEPRINTS"]
