"""Concurrency primitives every layer shares, on trio: owned background tasks and work off
the trio thread (``tasks.py``), grant lines, first come first served or cheapest first (``grants.py``), the
payload byte budget over it (``budget.py``), and whose turn it is to write a streamed body
(``writeturn.py``). It imports nothing of the package but ``wire/``."""

from .budget import ByteBudget
from .grants import CheapestFirstGrants, FifoGrants
from .tasks import (
    CPU_OFFLOAD_MIN_BYTES,
    OwnedTask,
    Started,
    leaves,
    raise_single,
    run_cpu_bound,
    start_owned,
    start_service,
)
from .writeturn import WriterTurn, Wrote

__all__ = [
    "CPU_OFFLOAD_MIN_BYTES",
    "ByteBudget",
    "CheapestFirstGrants",
    "FifoGrants",
    "OwnedTask",
    "Started",
    "WriterTurn",
    "Wrote",
    "leaves",
    "raise_single",
    "run_cpu_bound",
    "start_owned",
    "start_service",
]
