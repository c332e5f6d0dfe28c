"""The models of a process over HTTP: which one serves a request (``routed_json``), the
routes that list, load and unload them, and their LoRA adapters' default scales."""

from .lora_routes import bp as lora_bp
from .model_routes import bp, hold_model, routed_json

__all__ = ["bp", "hold_model", "lora_bp", "routed_json"]
