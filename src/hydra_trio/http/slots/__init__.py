"""A slot's state over HTTP: its meta, its KV blob out and in, its erase; the upload gate."""

from .state_routes import bp, drain_body, hold_state_uploads

__all__ = ["bp", "drain_body", "hold_state_uploads"]
