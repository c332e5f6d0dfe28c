"""Pooled requests on the embedding context: embeddings and rerank."""

from quart import Blueprint

from .embed_routes import bp

BLUEPRINTS: tuple[Blueprint, ...] = (bp,)

__all__ = ["BLUEPRINTS"]
