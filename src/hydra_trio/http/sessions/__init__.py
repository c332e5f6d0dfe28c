"""An agent session's end (/finish_session)."""

from quart import Blueprint

from .session_routes import bp

BLUEPRINTS: tuple[Blueprint, ...] = (bp,)

__all__ = ["BLUEPRINTS"]
