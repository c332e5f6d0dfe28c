"""The models of a process over HTTP: the routes that list, load and unload them
(``model_routes``), and their LoRA adapters' default scales (``lora_routes``)."""

from quart import Blueprint

from .lora_routes import bp as lora_bp
from .model_routes import bp as model_bp

BLUEPRINTS: tuple[Blueprint, ...] = (model_bp, lora_bp)

__all__ = ["BLUEPRINTS"]
