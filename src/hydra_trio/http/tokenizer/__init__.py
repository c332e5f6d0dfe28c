"""The tokenizer and render routes: a prompt's tokens, a template's text."""

from .tokenizer_routes import bp

__all__ = ["bp"]
