"""The one GPU worker: every llama.cpp call runs here, one at a time, off the trio thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import outcome
import trio

from ..concurrency import raise_single
from ..wire.errors import ErrorCode, ProtocolError, Status

T = TypeVar("T")

# The most a batch waits, before it is composed, for the worker calls queued ahead of it to run
# (GpuWorker.wait_for_calls_ahead): a burst's tokenizations take well under a millisecond each.
CALLS_AHEAD_MAX_S = 0.05


@dataclass(slots=True)
class CallTiming:
    queue_wait_s: float = 0.0  # waiting for the worker (other calls ahead)
    run_s: float = 0.0  # inside llama.cpp


class WorkerLane:
    """The one GPU worker's lane: its ``CapacityLimiter(1)``, shared by every engine of the
    process (each model's ``GpuWorker``), so no two llama.cpp calls ever run at once, loads
    included. A call that waits for the lane asks every engine's run of look-ahead steps to
    yield (``want_turn``), not only its own engine's."""

    def __init__(self) -> None:
        self.limiter = trio.CapacityLimiter(1)
        self._turn_flags: list[threading.Event] = []
        # Every call on the lane, any engine's, counted and signalled as it returns (on the
        # trio thread): what GpuWorker.wait_for_calls_ahead waits on.
        self.calls_ended = 0
        self.call_ended = trio.Event()

    @property
    def shared(self) -> bool:
        """More than one engine's worker is on the lane."""
        return len(self._turn_flags) > 1

    def ended(self) -> None:
        self.calls_ended += 1
        self.call_ended.set()
        self.call_ended = trio.Event()

    def join(self, flag: threading.Event) -> None:
        self._turn_flags.append(flag)

    def leave(self, flag: threading.Event) -> None:
        if flag in self._turn_flags:
            self._turn_flags.remove(flag)

    def want_turn(self, but: threading.Event | None = None) -> None:
        """Ask every engine's run of steps (``but`` its own: a caller whose run polls it) to
        yield after its current step."""
        for flag in self._turn_flags:
            if flag is not but:
                flag.set()

    async def run_sync(self, fn: Callable[[], T]) -> T:
        """``fn`` on the lane, when it is no engine's worker call (a model's load, warm-up or
        failed load's close): its wait asks the running steps to yield as any call's does."""
        self.want_turn()
        try:
            return await trio.to_thread.run_sync(fn, limiter=self.limiter)
        finally:
            self.ended()


class GpuWorker:
    """Serialises llama.cpp calls through ``trio.to_thread.run_sync`` with a CapacityLimiter(1)
    (``lane``: shared with the process's other engines; none given, one of its own).

    Waiting for the worker is cancellable (the call never starts). Once a call runs, the
    thread cannot be abandoned (llama.cpp state would race), so cancellation instead raises
    an abort flag the call polls: llama_decode stops within milliseconds through the abort
    callback, and other calls check the flag before committing their effect.
    """

    def __init__(self, lane: WorkerLane | None = None) -> None:
        self.lane = lane or WorkerLane()
        self.limiter = self.lane.limiter
        self.busy_s = 0.0  # total seconds the worker spent in calls (utilisation metric)
        self.calls = 0
        self._closed = False
        self.running = False  # a call is inside llama.cpp now
        self._in_call = False  # a call's function runs in the worker thread now
        self._call_ended = trio.Event()  # set (and replaced) whenever a call returns
        # Set by every call that waits for the worker: a long call that ``yields`` (a run of
        # generation steps) polls it and returns early.
        self.wants_turn = threading.Event()
        self.lane.join(self.wants_turn)
        # Run on the trio thread after every call (the KV events of what the call changed).
        self.after_call: Callable[[], None] | None = None

    async def wait_while_busy(self) -> None:
        """Return once the call running now, if any, has returned (a caller about to compose
        work can then include what arrived meanwhile)."""
        if self._in_call:
            await self._call_ended.wait()

    async def wait_for_calls_ahead(self, max_s: float = CALLS_AHEAD_MAX_S) -> int:
        """Return once the call running now and the calls waiting for the worker now have
        returned (their count), or after ``max_s`` once the running one has: a batch composed
        then includes what those calls bring, e.g. the prompts of a burst of requests whose
        tokenizations queued behind a prefill (else the first prompts of a burst go alone and
        the rest join their streams' steps, issue 53). Those calls run before a call asked for
        now anyway (the limiter is FIFO); the deadline bounds a wait for a waiting call that
        is cancelled and never runs. On a lane shared with other engines, only the running
        call: a call ahead may be another model's run of steps, which yields only once a call
        is queued (as before issue 53's change)."""
        await self.wait_while_busy()
        if self.lane.shared:
            return 0
        stats = self.limiter.statistics()
        ahead = stats.tasks_waiting + stats.borrowed_tokens  # queued, and one the worker passed to
        if not ahead:
            return 0
        lane = self.lane  # the limiter is the lane's: the calls ahead may be another engine's
        done = lane.calls_ended + ahead
        with trio.move_on_after(max_s):
            while lane.calls_ended < done:
                stats = self.limiter.statistics()
                if not (stats.tasks_waiting or stats.borrowed_tokens):
                    break
                await lane.call_ended.wait()
        return ahead

    def idle(self) -> bool:
        """No call runs or waits for the worker: one asked for now gets it at once."""
        stats = self.limiter.statistics()
        return stats.borrowed_tokens < stats.total_tokens and stats.tasks_waiting == 0

    def _ended(self) -> None:
        self.lane.ended()
        self._call_ended.set()
        self._call_ended = trio.Event()
        if self.after_call is not None:
            self.after_call()

    def _refuse_when_closed(self) -> None:
        if self._closed:
            raise ProtocolError(ErrorCode.INTERNAL, "engine is stopped", status=Status.BUSY)

    async def close(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (freeing the model) as the last call. Closed first: a call that comes
        while ``fn`` waits or runs is refused, never run on a freed model (calls that came
        before are ahead of it in the limiter's FIFO)."""
        self._closed = True
        try:
            await self._call(fn, yields=False)
        finally:
            self.lane.leave(self.wants_turn)

    async def call(self, fn: Callable[[], T], *, yields: bool = False) -> T:
        """A short call that needs no abort flag (a generation step, tokenizing, clearing a
        slot): the plain to_thread hop, without the watcher task ``run`` adds. Every call asks
        for the worker through ``wants_turn``, except one that ``yields``: its function polls
        that flag and returns early when another call waits."""
        self._refuse_when_closed()
        return await self._call(fn, yields=yields)

    async def _call(self, fn: Callable[[], T], *, yields: bool) -> T:
        # A run of steps that yields to its own engine's calls still asks the other engines'
        # runs to yield: models sharing the lane take turns step by step.
        self.lane.want_turn(but=self.wants_turn if yields else None)

        def timed() -> T:
            start = time.perf_counter()
            self._in_call = True
            try:
                return fn()
            finally:
                self._in_call = False
                self.busy_s += time.perf_counter() - start
                self.calls += 1

        try:
            return await trio.to_thread.run_sync(timed, limiter=self.limiter)
        finally:
            self._ended()

    async def run(self, fn: Callable[[threading.Event], T], timing: CallTiming | None = None) -> T:
        """Run ``fn(abort)`` on the worker; ``abort`` is set if the caller is cancelled."""
        self._refuse_when_closed()
        self.lane.want_turn()
        abort = threading.Event()
        submitted = time.perf_counter()

        def timed() -> T:
            if abort.is_set():  # cancelled after the limiter was granted but before we ran
                raise _AbortedBeforeStart
            start = time.perf_counter()
            if timing is not None:
                timing.queue_wait_s = start - submitted
            self.running = self._in_call = True
            try:
                return fn(abort)
            finally:
                self.running = self._in_call = False
                elapsed = time.perf_counter() - start
                self.busy_s += elapsed
                self.calls += 1
                if timing is not None:
                    timing.run_s = elapsed

        # The call's own outcome is captured inside the helper nursery and re-raised outside
        # it, so callers see DecodeAborted / ProtocolError / Cancelled, not a group.
        result: outcome.Outcome[T] | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_raise_flag_on_cancel, abort)
                try:
                    result = await outcome.acapture(trio.to_thread.run_sync, timed, limiter=self.limiter)
                finally:
                    self._ended()
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise_single(group)
        assert result is not None
        if isinstance(result, outcome.Error) and isinstance(result.error, _AbortedBeforeStart):
            await trio.lowlevel.checkpoint()  # delivers the pending Cancelled
            raise RuntimeError("GPU call aborted without cancellation")
        return result.unwrap()


class _AbortedBeforeStart(Exception):
    pass


async def _raise_flag_on_cancel(flag: threading.Event) -> None:
    try:
        await trio.sleep_forever()
    finally:
        flag.set()
