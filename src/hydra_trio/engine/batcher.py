"""The step batcher: the next token of every generating slot goes into one llama_decode,
and so do the prompt tokens of requests that arrive meanwhile (chunked prefill).

Request tasks hand in a step (slot, token, sampler) or a prompt (slot, tokens) and wait for
the result. Each batch holds every step handed in by the time the last batch's requests have
come back, plus as many prompt tokens as fit in the per-step token budget: a long prompt is
spread over several batches, so the running streams keep their pace while it is prefilled
(as vLLM and llama-server do), instead of waiting behind a whole prompt chunk.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import outcome
import trio

from ..wire.errors import ErrorCode, ProtocolError, Status
from .backend import PrefillPart, Sampler, StepRequest

log = logging.getLogger(__name__)

RunSteps = Callable[[Sequence[StepRequest]], Awaitable[list[int | None]]]
PartOutcome = outcome.Outcome[tuple[int | None, bytes | None]]
RunMixed = Callable[[Sequence[StepRequest], PrefillPart], Awaitable[tuple[list[int | None], PartOutcome]]]


@dataclass(slots=True, eq=False)
class _Job:
    done: trio.Event = field(default_factory=trio.Event, kw_only=True)
    error: BaseException | None = field(default=None, kw_only=True)
    cancelled: bool = field(default=False, kw_only=True)


@dataclass(slots=True, eq=False)
class StepJob(_Job):
    slot: int
    token: int
    sampler: Sampler
    result: int | None = None


@dataclass(slots=True, eq=False)
class PrefillJob(_Job):
    slot: int
    tokens: Sequence[int]
    keep: int  # the slot keeps its first ``keep`` positions, then ``tokens`` follow
    sampler: Sampler | None = None
    want_logits: bool = False
    offset: int = 0  # tokens evaluated so far
    result: tuple[int | None, bytes | None] = (None, None)


class StepBatcher:
    def __init__(
        self, n_slots: int, run_steps: RunSteps, run_mixed: RunMixed, *, token_budget: int, alone_budget: int
    ) -> None:
        # A slot has at most one job outstanding: the channel never holds more than n_slots.
        self._send, self._recv = trio.open_memory_channel[StepJob | PrefillJob](n_slots)
        self._run_steps = run_steps
        self._run_mixed = run_mixed
        self.token_budget = max(1, token_budget)
        self.alone_budget = max(self.token_budget, alone_budget)  # a prompt part with no steps
        self._prompts: deque[PrefillJob] = deque()  # handed in, not finished
        self.generating = 0  # requests inside their token loop (a batch waits for them)
        self.batches = 0
        self.tokens = 0  # tokens evaluated by batched steps
        self.prompt_tokens = 0  # prompt tokens evaluated inside step batches
        self.prompt_parts = 0  # prompt parts evaluated inside step batches
        self._stopped = False

    # ---- request side ------------------------------------------------------------------

    def submit(self, slot: int, token: int, sampler: Sampler) -> StepJob:
        """Hand a step to the batcher without waiting (the caller must await ``result``)."""
        job = StepJob(slot, token, sampler)
        self._hand_in(job)
        return job

    async def result(self, job: StepJob, during: Awaitable[None] | None = None) -> int | None:
        """Wait for a submitted step, after awaiting ``during`` (work overlapped with it).

        If cancelled, a step the batcher has not taken is skipped, and one it has taken is
        waited for, so nothing runs for the request after this returns."""
        await _wait(job, during)
        return job.result

    async def prefill(
        self, slot: int, tokens: Sequence[int], keep: int, *, sampler: Sampler | None, want_logits: bool
    ) -> tuple[int | None, bytes | None]:
        """Evaluate a prompt inside the step batches, a budget's worth per batch.

        Cancellable between batches: a cancelled prompt stops after the batch in flight, and
        this returns only once nothing more runs for it."""
        job = PrefillJob(slot, tokens, keep, sampler, want_logits)
        self._hand_in(job)
        await _wait(job)
        return job.result

    def _hand_in(self, job: StepJob | PrefillJob) -> None:
        if self._stopped:
            raise ProtocolError(ErrorCode.INTERNAL, "engine is stopped", status=Status.BUSY)
        self._send.send_nowait(job)

    # ---- the batching task -------------------------------------------------------------

    async def run(self) -> None:
        """Batch until cancelled; work handed in after that fails at once."""
        steps: list[StepJob] = []
        try:
            while True:
                steps = await self._gather()
                live = [j for j in steps if not _finish_if_cancelled(j)]
                part_job = self._next_prompt()
                if part_job is not None:
                    await self._run_with_prompt(live, part_job)
                elif live:
                    await self._run_steps_only(live)
                steps = []
        finally:
            self._stopped = True
            stopped = ProtocolError(ErrorCode.INTERNAL, "engine is stopped", status=Status.BUSY)
            left: list[StepJob | PrefillJob] = [*steps, *self._prompts]
            while True:
                try:
                    left.append(self._recv.receive_nowait())
                except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                    break
            for job in left:
                if not job.done.is_set():
                    job.error = job.error or stopped
                    job.done.set()

    async def _gather(self) -> list[StepJob]:
        """The steps of the next batch (prompts go to ``self._prompts``)."""
        steps: list[StepJob] = []
        if not self._prompts:
            self._take(await self._recv.receive(), steps)
        # Let the other generating requests hand in their step so they share the batch: they
        # were woken together by the last batch and need one tick.
        for _ in range(3):
            while True:
                try:
                    self._take(self._recv.receive_nowait(), steps)
                except trio.WouldBlock:
                    break
            if len(steps) >= self.generating:
                break
            await trio.lowlevel.checkpoint()
        return steps

    def _take(self, job: StepJob | PrefillJob, steps: list[StepJob]) -> None:
        if isinstance(job, PrefillJob):
            self._prompts.append(job)
        else:
            steps.append(job)

    def _next_prompt(self) -> PrefillJob | None:
        while self._prompts:
            job = self._prompts[0]
            if not _finish_if_cancelled(job):
                return job
            self._prompts.popleft()
        return None

    async def _run_steps_only(self, jobs: list[StepJob]) -> None:
        reqs = [StepRequest(j.slot, j.token, j.sampler) for j in jobs]
        try:
            with trio.CancelScope(shield=True):  # finish the batch even on shutdown
                results = await self._run_steps(reqs)
        except Exception as exc:  # a failed batch fails its requests, not the engine
            log.exception("generation step failed")
            for job in jobs:
                job.error = exc
        else:
            self._count(jobs, results)
        for job in jobs:
            job.done.set()

    async def _run_with_prompt(self, jobs: list[StepJob], prompt: PrefillJob) -> None:
        # The steps go first; the prompt gets the rest of the budget, and at least a quarter
        # of it so that it progresses however many streams run. With no step to share the
        # batch with (the streams ended meanwhile), it takes a whole prefill chunk.
        if jobs:
            room = max(self.token_budget - len(jobs), self.token_budget // 4, 1)
        else:
            room = self.alone_budget
        end = min(len(prompt.tokens), prompt.offset + room)
        last = end == len(prompt.tokens)
        part = PrefillPart(
            prompt.slot,
            prompt.tokens[prompt.offset : end],
            keep=prompt.keep if prompt.offset == 0 else None,
            sampler=prompt.sampler if last else None,
            want_logits=prompt.want_logits and last,
        )
        reqs = [StepRequest(j.slot, j.token, j.sampler) for j in jobs]
        try:
            with trio.CancelScope(shield=True):  # finish the batch even on shutdown
                results, part_outcome = await self._run_mixed(reqs, part)
        except Exception as exc:
            log.exception("generation step with a prompt part failed")
            for job in jobs:
                job.error = exc
            prompt.error = exc
        else:
            self._count(jobs, results)
            if isinstance(part_outcome, outcome.Error):
                prompt.error = part_outcome.error
            else:
                self.prompt_tokens += end - prompt.offset
                self.prompt_parts += 1
                prompt.offset = end
                if last:
                    prompt.result = part_outcome.unwrap()
        for job in jobs:
            job.done.set()
        if prompt.error is not None or last:
            self._prompts.popleft()
            prompt.done.set()

    def _count(self, jobs: list[StepJob], results: list[int | None]) -> None:
        for job, res in zip(jobs, results, strict=True):
            job.result = res
        if jobs:
            self.batches += 1
            self.tokens += len(jobs)


def _finish_if_cancelled(job: StepJob | PrefillJob) -> bool:
    if job.cancelled:
        job.done.set()
    return job.cancelled


async def _wait(job: StepJob | PrefillJob, during: Awaitable[None] | None = None) -> None:
    """Wait for ``job`` (after awaiting ``during``, work overlapped with it); raise its error.

    If cancelled, marks the job cancelled and still waits for the batch that may be running
    it, so nothing runs for the caller after this returns."""
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
