"""The step batcher: the next token of every generating slot goes into one llama_decode.

Request tasks hand in a step (slot, token, sampler) and wait for its result; the batcher
takes every step handed in by the time the last batch's requests have come back and runs
them as one GPU-worker call (continuous batching).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import trio

from ..wire.errors import ErrorCode, ProtocolError, Status
from .backend import Sampler, StepRequest

log = logging.getLogger(__name__)

RunBatch = Callable[[Sequence[StepRequest]], Awaitable[list[int | None]]]


@dataclass(slots=True)
class StepJob:
    slot: int
    token: int
    sampler: Sampler
    done: trio.Event = field(default_factory=trio.Event)
    result: int | None = None
    error: BaseException | None = None
    cancelled: bool = False


class StepBatcher:
    def __init__(self, n_slots: int, run_batch: RunBatch) -> None:
        # The channel holds one job per slot, and a slot has at most one step outstanding.
        self._send, self._recv = trio.open_memory_channel[StepJob](n_slots)
        self._run_batch = run_batch
        self.generating = 0  # requests inside their token loop (a batch waits for them)
        self.batches = 0
        self.tokens = 0  # tokens evaluated by batched steps
        self._stopped = False

    def submit(self, slot: int, token: int, sampler: Sampler) -> StepJob:
        """Hand a step to the batcher without waiting (the caller must await ``result``)."""
        if self._stopped:
            raise ProtocolError(ErrorCode.INTERNAL, "engine is stopped", status=Status.BUSY)
        job = StepJob(slot, token, sampler)
        self._send.send_nowait(job)
        return job

    async def result(self, job: StepJob, during: Awaitable[None] | None = None) -> int | None:
        """Wait for a submitted step, after awaiting ``during`` (work overlapped with it).

        If cancelled, a step the batcher has not taken is skipped, and one it has taken is
        waited for, so nothing runs for the request after this returns."""
        try:
            if during is not None:
                await during
            await job.done.wait()
        except BaseException:
            job.cancelled = True
            with trio.CancelScope(shield=True):
                await job.done.wait()
            raise
        if job.error is not None:
            raise job.error
        return job.result

    async def run(self) -> None:
        """Batch steps until cancelled; steps handed in after that fail at once."""
        pending: list[StepJob] = []
        try:
            while True:
                pending = await self._gather()
                jobs = []
                for job in pending:
                    if job.cancelled:
                        job.done.set()
                    else:
                        jobs.append(job)
                if jobs:
                    await self._run(jobs)
                pending = []
        finally:
            self._stopped = True
            stopped = ProtocolError(ErrorCode.INTERNAL, "engine is stopped", status=Status.BUSY)
            for job in pending:
                job.error = job.error or stopped
                job.done.set()
            while True:
                try:
                    job = self._recv.receive_nowait()
                except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                    break
                job.error = stopped
                job.done.set()

    async def _gather(self) -> list[StepJob]:
        pending = [await self._recv.receive()]
        # Let the other generating requests hand in their step so they share the batch: they
        # were woken together by the last batch and need one tick.
        for _ in range(3):
            while True:
                try:
                    pending.append(self._recv.receive_nowait())
                except trio.WouldBlock:
                    break
            if len(pending) >= self.generating:
                break
            await trio.lowlevel.checkpoint()
        return pending

    async def _run(self, jobs: list[StepJob]) -> None:
        reqs = [StepRequest(j.slot, j.token, j.sampler) for j in jobs]
        try:
            with trio.CancelScope(shield=True):  # finish the batch even on shutdown
                results = await self._run_batch(reqs)
        except Exception as exc:  # a failed batch fails its requests, not the engine
            log.exception("generation step failed")
            for job in jobs:
                job.error = exc
        else:
            for job, res in zip(jobs, results, strict=True):
                job.result = res
            self.batches += 1
            self.tokens += len(jobs)
        for job in jobs:
            job.done.set()
