"""The tokenizer and render routes: a prompt's tokens, a template's text."""

from quart import Blueprint

from .tokenizer_routes import bp

BLUEPRINTS: tuple[Blueprint, ...] = (bp,)

__all__ = ["BLUEPRINTS"]
