"""The front ends' shared layer: what the HTTP and RPC front ends share (``app_state.py``:
``AppState``, ``Endpoints``), and the slot-state use cases both serve over the engine's face
(``slot_state.py``: snapshot, restore, meta, erase). Nothing here imports a front end."""

from . import slot_state
from .app_state import AppState, Endpoints

__all__ = ["AppState", "Endpoints", "slot_state"]
