"""The hand-over of step results from the GPU worker to trio, woken without giving up the GIL.

``TrioToken.run_sync_soon`` wakes trio with a socket send, which releases the GIL: the
trio thread, asleep in epoll, takes it at once, and the worker, back from the send, waits
for it until trio next blocks, a whole turn of handing out text (a quarter of the worker's
time at one stream, measured with py-spy: docs/performance.md, the one-stream token path).
Here the wake-up is a one-byte pipe write made while the worker keeps the GIL (a ctypes
``PyDLL`` call does not release it), and the worker sends it just before its next
llama_decode, which does release it: trio then hands out the text while the model computes.

Calls run on the trio thread in the order sent, from ``run`` or from ``drain``.
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["Handover"]


def _write_keeping_gil() -> Callable[[int, bytes, int], int]:
    libc = ctypes.PyDLL(None)  # the process's own symbols (libc's write among them)
    write = libc.write
    write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t
    return write  # type: ignore[no-any-return]


class Handover:
    """Calls sent from the worker thread, run on the trio thread (``run``'s task).

    Bounded by its sender: a run of steps sends one call per step and returns to trio, which
    drains what is left (``drain``), at least every MAX_STEPS_PER_CALL steps (batcher.py)."""

    def __init__(self) -> None:
        self._calls: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._read_fd, self._write_fd = os.pipe()  # not inherited by child processes
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)  # a full pipe fails the write: trio is awake then
        self._write = _write_keeping_gil()

    def send(self, fn: Callable[..., None], *args: Any) -> None:
        """From the worker thread: run ``fn(*args)`` on the trio thread. A full pipe (the
        write fails) already wakes trio."""
        self._calls.append((fn, args))
        self._write(self._write_fd, b"\0", 1)

    def drain(self) -> None:
        """On the trio thread: run every call sent so far, in order."""
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            fn(*args)

    async def run(self) -> None:
        """Run calls as they are sent, until cancelled."""
        while True:
            await trio.lowlevel.wait_readable(self._read_fd)
            try:
                os.read(self._read_fd, 4096)
            except BlockingIOError:
                pass
            self.drain()

    def close(self) -> None:
        """Once nothing can send any more (the worker's calls have returned) and ``run`` has
        ended: a write to a closed descriptor could reach whatever file reuses its number."""
        os.close(self._read_fd)
        os.close(self._write_fd)
