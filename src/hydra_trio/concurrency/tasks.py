"""Background work with an owner: each task lives in a nursery and has its own cancel scope."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, NoReturn, TypeVar

import trio

log = logging.getLogger(__name__)
T = TypeVar("T")


class OwnedTask:
    """A handle to cancel a task and wait until it has really stopped."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.scope = trio.CancelScope()
        self.finished = trio.Event()

    async def cancel_and_wait(self) -> None:
        self.scope.cancel()
        await self.finished.wait()


class Started:
    """The one stand-in for a ``trio.TaskStatus``: records that ``started()`` was called
    (``event``) and passes the value on to ``forward`` (the real task status, when there is
    one)."""

    def __init__(self, forward: Callable[[Any], None] | None = None) -> None:
        self.event = trio.Event()
        self._forward = forward

    def started(self, value: Any = None) -> None:
        self.event.set()
        if self._forward is not None:
            self._forward(value)


async def start_service(nursery: trio.Nursery, run: Callable[..., Awaitable[None]]) -> None:
    """Start a service that shields its own lifetime (it ends by its ``stop()``), and wait
    until it is ready. Not ``nursery.start``: from a caller cancelled meanwhile (a SIGTERM
    while the model loads), trio leaves a task that calls ``started()`` where it is, under
    the caller, and the caller then waits for it forever, since its ``stop()`` comes after."""
    ready = Started()
    nursery.start_soon(partial(run, task_status=ready))
    await ready.event.wait()


async def start_owned(
    nursery: trio.Nursery,
    name: str,
    fn: Callable[..., Awaitable[None]],
    *args: Any,
) -> tuple[OwnedTask, Any]:
    """Start ``fn(task_status, *args)`` in ``nursery`` like ``nursery.start``.

    Errors before ``task_status.started()`` reach the caller; errors after it are logged
    (a failing request must not take down its owner). Returns (handle, started value).
    """
    handle = OwnedTask(name)

    async def runner(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        status = Started(task_status.started)
        try:
            with handle.scope:
                await fn(status, *args)
        except Exception:
            if not status.event.is_set():
                raise
            log.exception("background task %s failed", name)
        finally:
            handle.finished.set()

    value = await nursery.start(runner)
    return handle, value


# From this many bytes on, CPU work on a payload (hashing, JSON, token lists) runs in a thread:
# JSON parses at ~2-5 ms per MB and would stall every other connection and stream on the trio
# thread; below it, a thread hop (~0.1-0.3 ms under load) costs more than the work (measured:
# STATE_PUT of 1 MB fell from 0.81x to 0.53x a raw loopback copy with a 1 MiB threshold).
CPU_OFFLOAD_MIN_BYTES = 4 << 20


async def run_cpu_bound(fn: Callable[[], T], nbytes: int) -> T:
    """``fn()`` on a worker thread when it works on ``nbytes >= CPU_OFFLOAD_MIN_BYTES`` (not the
    GPU worker: this needs no llama.cpp), else inline (a thread hop costs ~100 us)."""
    if nbytes >= CPU_OFFLOAD_MIN_BYTES:
        return await trio.to_thread.run_sync(fn)
    await trio.lowlevel.checkpoint()
    return fn()


def leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaves(sub)]
    return [exc]


def raise_single(group: BaseExceptionGroup) -> NoReturn:  # type: ignore[type-arg]
    """Re-raise what a small helper nursery wrapped (trio wraps even one exception in a
    group): a lone exception, or one Cancelled when all are Cancelled, so callers can catch
    ``ProtocolError`` or ``trio.Cancelled`` as usual."""
    found = leaves(group)
    if len(found) == 1 or all(isinstance(e, trio.Cancelled) for e in found):
        raise found[0] from None
    others = [e for e in found if not isinstance(e, trio.Cancelled)]
    if len(others) == 1:  # the scope stays cancelled: the next checkpoint delivers it
        raise others[0] from None
    raise group
