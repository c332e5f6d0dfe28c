"""Pooled requests on the embedding context: embeddings and rerank."""

from .embed_routes import bp

__all__ = ["bp"]
