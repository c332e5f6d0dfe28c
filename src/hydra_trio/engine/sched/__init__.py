"""Scheduling: which slot a request takes and what of its KV it continues (scheduler.py),
slot claims in line (slots.py), agent sessions and their turns' cancel scopes
(session_tree.py), continuous batching of steps and prompt parts (batcher.py),
and step results handed from the worker to trio (handover.py). Nothing outside this package
reaches its modules."""

from .batcher import PartOutcome, StepBatcher
from .chunks import ChunkingStats
from .scheduler import SlotScheduler
from .session_tree import Finished, Session, SessionStats, SessionTree, TenantSessions, Turn
from .slots import Slot, SlotTable

__all__ = [
    "ChunkingStats",
    "Finished",
    "PartOutcome",
    "Session",
    "SessionStats",
    "SessionTree",
    "Slot",
    "SlotScheduler",
    "SlotTable",
    "StepBatcher",
    "TenantSessions",
    "Turn",
]
