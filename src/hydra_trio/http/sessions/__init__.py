"""An agent session's end (/finish_session)."""

from .session_routes import bp

__all__ = ["bp"]
