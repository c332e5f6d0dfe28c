"""The engine's status: /health, /version, /metrics."""

from quart import Blueprint

from .status_routes import bp, health_reply

BLUEPRINTS: tuple[Blueprint, ...] = (bp,)

__all__ = ["BLUEPRINTS", "health_reply"]
