"""llama-server's slot routes: the slots listed (``slot_routes``), one erased, and a slot's
state (``state_routes``: its meta, its KV blob out and in, the upload gate)."""

from quart import Blueprint

from .slot_routes import bp as slot_bp
from .state_routes import bp as state_bp
from .state_routes import hold_state_uploads

BLUEPRINTS: tuple[Blueprint, ...] = (slot_bp, state_bp)

__all__ = ["BLUEPRINTS", "hold_state_uploads"]
