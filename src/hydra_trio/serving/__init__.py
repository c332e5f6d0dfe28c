"""The front ends' shared layer: what the HTTP and RPC front ends share (``app_state.py``:
``AppState``, ``Endpoints``), and the slot-state use cases both serve over the engine's face
(``slot_state.py``: snapshot, restore, meta, erase), and the models of a process by name
(``model_pool.py``: ``ModelPool``, loaded on demand, evicted, put to sleep). Nothing here
imports a front end."""

from . import slot_state
from .app_state import AppState, Endpoints
from .model_pool import (
    ModelBusy,
    ModelEntry,
    ModelError,
    ModelLoadFailed,
    ModelPool,
    ModelRefused,
    ModelState,
)

__all__ = [
    "AppState",
    "Endpoints",
    "ModelBusy",
    "ModelEntry",
    "ModelError",
    "ModelLoadFailed",
    "ModelPool",
    "ModelRefused",
    "ModelState",
    "slot_state",
]
