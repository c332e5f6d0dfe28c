"""The step batcher: the next token of every generating slot goes into one llama_decode,
and so do the prompt tokens of requests that arrive meanwhile (chunked prefill).

Request tasks hand in a step (slot, token, sampler) or a prompt (slot, tokens) and wait for
the result. Each batch holds every step handed in by the time the last batch's requests have
come back, plus as many prompt tokens as keep the step under the inter-token latency target
(``chunks.py``): a long prompt is spread over several batches, so the running streams keep
a pace while it is prefilled (as vLLM and llama-server do), instead of waiting behind a whole
prompt chunk, and the prompt goes nearly as fast as alone.

llama.cpp applies LoRA adapters per context, not per sequence, so a batch holds the slots of
one adapter set only (``lora_of``), as llama-server's ``can_batch_with`` refuses to batch
slots whose sets differ. Where llama-server lets the first slot's set go first until it has
no more work, here the sets take turns: a turn goes to the set with work that was served
longest ago, and lasts TURN_SWITCHES times what a change of set costs (llama.cpp reserves its
compute graph again after one: measured at load, ``lora_switch_s``), so that switching takes
at most a ninth of the worker's time; the other sets' steps wait for their turn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import outcome
import trio

from ...wire.errors import ErrorCode, ProtocolError, Status
from ..llama import LoraSet, PrefillPart, StepRequest, StepResult, TokenSampler
from ..speculation import Speculation
from .chunks import ChunkSizer
from .handover import Handover

log = logging.getLogger(__name__)

MAX_STEPS_PER_CALL = 256  # a run of steps returns to trio at least this often
TURN_SWITCHES = 8  # an adapter set's turn lasts at least this many changes of set cost

# One llama step, on the worker; the callable is run once, just before its llama_decode.
StepSync = Callable[[Sequence[StepRequest], Callable[[], None]], list[StepResult]]
RunOnWorker = Callable[[Callable[[], None]], Awaitable[None]]  # run a function as one worker call
PartOutcome = outcome.Outcome[tuple[int | None, bytes | None]]
RunMixed = Callable[
    [Sequence[StepRequest], Sequence[PrefillPart]], Awaitable[tuple[list[StepResult], list[PartOutcome]]]
]


@dataclass(slots=True, eq=False)
class _Job:
    done: trio.Event = field(default_factory=trio.Event, kw_only=True)
    error: BaseException | None = field(default=None, kw_only=True)
    cancelled: bool = field(default=False, kw_only=True)


@dataclass(slots=True, eq=False)
class StepJob(_Job):
    slot: int
    token: int
    sampler: TokenSampler
    n_left: int = 1  # tokens the request may still produce, the one this step samples included
    asked: bool = True  # handed in by the request (False: a look-ahead it has not taken yet)
    spec: Speculation | None = None  # the request's drafting (None: no speculation)
    result: StepResult = None

    def request(self) -> StepRequest:
        return StepRequest(self.slot, self.token, self.sampler, self.n_left, self.spec)


@dataclass(slots=True, eq=False)
class PrefillJob(_Job):
    slot: int
    tokens: Sequence[int]
    keep: int  # the slot keeps its first ``keep`` positions, then ``tokens`` follow
    sampler: TokenSampler | None = None
    want_logits: bool = False
    offset: int = 0  # tokens evaluated so far
    result: tuple[int | None, bytes | None] = (None, None)


class StepBatcher:
    def __init__(
        self,
        n_slots: int,
        step_sync: StepSync,
        run_on_worker: RunOnWorker,
        run_mixed: RunMixed,
        *,
        token_budget: int,
        alone_budget: int,
        worker_free: Callable[[], Awaitable[int | None]],
        is_eog: Callable[[int], bool],
        wants_turn: threading.Event,
        lora_of: Callable[[int], LoraSet] | None = None,
        lora_switch_s: float = 0.0,
        itl_target_s: float = 0.0,
    ) -> None:
        # A slot has at most one job outstanding: the channel never holds more than n_slots.
        self._send, self._recv = trio.open_memory_channel[StepJob | PrefillJob](n_slots)
        self._step_sync = step_sync
        self._run_on_worker = run_on_worker
        self._run_mixed = run_mixed
        # Set when anything else wants the worker (a call waiting for it, work handed in, a
        # request stopping): a run of steps on the worker returns after its current step.
        self._wants_turn = wants_turn
        self._worker_free = worker_free
        self._is_eog = is_eog
        # Look-ahead: a step whose sampled token the request will surely feed back (not an
        # end of generation, within its token limit) is followed at once by that token's
        # step, in the next batch, before the request task has even run: the worker goes
        # on without waiting for the trio side. The request picks its step up in ``submit``,
        # or drops it (``drop_ahead``) if it stops for a reason only it knows (a stop word,
        # cancellation); a dropped step that already ran leaves one more token in the
        # slot's KV, consistently recorded.
        self._ahead: dict[int, StepJob] = {}  # slot -> its next step, started by the batcher
        self._next_steps: list[StepJob] = []  # look-ahead steps of the next batch
        self.ahead_used = 0
        self.ahead_dropped = 0
        self.runs = 0  # worker calls that ran steps only (each one or more steps)
        self.token_budget = max(1, token_budget)
        self.alone_budget = max(self.token_budget, alone_budget)  # a prompt part with no steps
        # The prompt tokens of a step beside streams, by the ITL target (0: the machine's own).
        self.chunks = ChunkSizer(itl_target_s, budget=self.token_budget, n_batch=self.alone_budget)
        self._prompts: deque[PrefillJob] = deque()  # handed in, not finished
        self.generating = 0  # requests inside their token loop (a batch waits for them)
        self.batches = 0
        self.tokens = 0  # tokens evaluated by batched steps
        self.prompt_tokens = 0  # prompt tokens evaluated inside step batches
        self.prompt_parts = 0  # prompt parts evaluated inside step batches
        self._stopped = False
        self._handover: Handover | None = None  # step results from the worker (while ``run`` runs)
        # A slot's LoRA adapter set (None: no adapters are loaded, every slot runs the base
        # model); the sets in the order they were last served, the least recently first.
        self._lora_of = lora_of
        self._turns: list[LoraSet] = []
        self.turn_s = TURN_SWITCHES * lora_switch_s  # an adapter set's turn, while others wait
        self._turn_ends = 0.0  # time.perf_counter() when the set served now yields its turn
        self.set_switches = 0  # batches whose set differs from the batch before

    # ---- request side ------------------------------------------------------------------

    def submit(
        self, slot: int, token: int, sampler: TokenSampler, n_left: int = 1, spec: Speculation | None = None
    ) -> StepJob:
        """Hand a step to the batcher without waiting (the caller must await ``result``):
        evaluate ``token`` in ``slot`` and sample the next one, the first of the ``n_left``
        tokens the request may still produce (with ``spec``, a draft's accepted tokens
        follow it). The step may already be under way (look-ahead)."""
        job = self._ahead.pop(slot, None)
        if job is not None:
            if job.token == token and job.sampler is sampler:
                self.ahead_used += 1
                job.asked = True
                return job
            raise RuntimeError(f"slot {slot}: a look-ahead step for another token is outstanding")
        job = StepJob(slot, token, sampler, n_left, spec=spec)
        self._hand_in(job)
        return job

    async def drop_ahead(self, slot: int) -> None:
        """The request of ``slot`` leaves its token loop: drop the step the batcher started
        for it, waiting for it if it runs, so that nothing runs for the request afterwards."""
        job = self._ahead.pop(slot, None)
        if job is None:
            return
        self.ahead_dropped += 1
        job.cancelled = True
        self._wants_turn.set()
        with trio.CancelScope(shield=True):
            await job.done.wait()

    async def result(self, job: StepJob, during: Awaitable[None] | None = None) -> StepResult:
        """Wait for a submitted step, after awaiting ``during`` (work overlapped with it).

        If cancelled, a step the batcher has not taken is skipped, and one it has taken is
        waited for, so nothing runs for the request after this returns."""
        await _wait(job, during, self._wants_turn)
        return job.result

    async def prefill(
        self, slot: int, tokens: Sequence[int], keep: int, *, sampler: TokenSampler | None, want_logits: bool
    ) -> tuple[int | None, bytes | None]:
        """Evaluate a prompt inside the step batches, a budget's worth per batch.

        Cancellable between batches: a cancelled prompt stops after the batch in flight, and
        this returns only once nothing more runs for it."""
        job = PrefillJob(slot, tokens, keep, sampler, want_logits)
        self._hand_in(job)
        await _wait(job, None, self._wants_turn)
        return job.result

    def _hand_in(self, job: StepJob | PrefillJob) -> None:
        if self._stopped:
            raise ProtocolError(ErrorCode.INTERNAL, "engine is stopped", status=Status.BUSY)
        self._send.send_nowait(job)
        self._wants_turn.set()

    # ---- the batching task -------------------------------------------------------------

    async def run(self) -> None:
        """Batch until cancelled; work handed in after that fails at once."""
        self._handover = handover = Handover()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(handover.run)
                await self._batch_until_cancelled()
        finally:
            handover.close()  # every worker call has returned: nothing sends any more

    async def _batch_until_cancelled(self) -> None:
        steps: list[StepJob] = []
        try:
            while True:
                steps = await self._gather()
                live = [j for j in steps if not _finish_if_cancelled(j)]
                lora, others = self._choose_set(live)
                if others:  # another set's steps wait for their turn
                    self._next_steps.extend(j for j in live if self._lora_of(j.slot) != lora)  # type: ignore[misc]
                    live = [j for j in live if self._lora_of(j.slot) == lora]  # type: ignore[misc]
                prompts = self._next_prompts(len(live), lora)
                if prompts:
                    await self._run_with_prompts(live, prompts)
                elif live:
                    await self._run_steps_only(live, until=self._turn_ends if others else None)
                steps = []
        finally:
            self._stopped = True
            stopped = ProtocolError(ErrorCode.INTERNAL, "engine is stopped", status=Status.BUSY)
            left: list[StepJob | PrefillJob] = [*steps, *self._next_steps, *self._prompts]
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
        steps, self._next_steps = self._next_steps, []
        if not self._prompts and not steps:
            self._take(await self._recv.receive(), steps)
        # Let the other generating requests hand in their step so they share the batch: they
        # were woken together by the last batch and need one tick.
        for _ in range(3):
            self._take_waiting(steps)
            if len(steps) >= self.generating:
                break
            await trio.lowlevel.checkpoint()
        # Compose the batch when the worker can run it: what arrives while another call
        # runs (requests that come together, each prefilled alone otherwise) joins it, and
        # so do the prompts of the calls that were queued for the worker (a burst's
        # tokenizations): their requests hand them in a tick or two after those return.
        if await self._worker_free():
            for _ in range(3):
                self._take_waiting(steps)
                await trio.lowlevel.checkpoint()
        self._take_waiting(steps)
        return steps

    def _take_waiting(self, steps: list[StepJob]) -> None:
        while True:
            try:
                self._take(self._recv.receive_nowait(), steps)
            except trio.WouldBlock:
                return

    def _take(self, job: StepJob | PrefillJob, steps: list[StepJob]) -> None:
        if isinstance(job, PrefillJob):
            self._prompts.append(job)
        else:
            steps.append(job)

    def _choose_set(self, steps: list[StepJob]) -> tuple[LoraSet | None, bool]:
        """The adapter set of the next batch, and whether another set has work waiting (None,
        False: no adapters are loaded). The set whose turn it is keeps it until the turn ends
        or it has no work; then the set served longest ago gets the next (a set new to the
        turns before them)."""
        lora_of = self._lora_of
        if lora_of is None:
            return None, False
        self._prompts = deque(j for j in self._prompts if not _finish_if_cancelled(j))
        waiting = {lora_of(j.slot) for j in steps} | {lora_of(j.slot) for j in self._prompts}
        if not waiting:
            return None, False
        turns = self._turns
        current = turns[-1] if turns else None
        if current in waiting and (len(waiting) == 1 or time.perf_counter() < self._turn_ends):
            chosen = current
        else:
            served = {s: i for i, s in enumerate(turns)}
            chosen = min(waiting, key=lambda s: served.get(s, -1))
            self._turn_ends = time.perf_counter() + self.turn_s
            if current is not None and chosen != current:
                self.set_switches += 1
        # Only sets with work keep a place: one that comes back later goes first then.
        self._turns = [s for s in turns if s in waiting and s != chosen] + [chosen]
        return chosen, len(waiting) > 1

    def _next_prompts(self, n_steps: int, lora: LoraSet | None = None) -> list[tuple[PrefillJob, int]]:
        """The prompts that get a part in the next batch, each with the end of its part
        (``lora``: of that adapter set only; None: any).

        The steps go first. The first waiting prompt gets as many tokens as keep the step
        under the ITL target (``ChunkSizer.chunk``: at least a quarter of the token budget, so
        that it progresses however many streams run); each further waiting prompt advances
        by up to a token budget too, so that prompts which arrive together start together
        (the batch grows with the queue, up to n_batch). With no step to share the batch
        with, the prompts fill a whole prefill chunk (n_batch)."""
        self._prompts = deque(j for j in self._prompts if not _finish_if_cancelled(j))
        if n_steps and self._prompts and self.chunks.step_s(n_steps) is None:
            return []  # one step of the streams alone first: their step time, measured
        left = self.alone_budget - n_steps
        # A stream whose step is not in this batch (its task was slow to hand it in) waits
        # for the batch all the same: the part is sized for it too.
        streams = max(n_steps, self.generating)
        chosen: list[tuple[PrefillJob, int]] = []
        for job in self._prompts:
            if lora is not None and self._lora_of is not None and self._lora_of(job.slot) != lora:
                continue  # another adapter set's: its own turn
            if streams == 0:
                room = left
            elif not chosen:
                room = self.chunks.chunk(streams)
            else:
                room = self.token_budget
            room = min(room, left)
            if room <= 0:
                break
            end = min(len(job.tokens), job.offset + room)
            chosen.append((job, end))
            left -= end - job.offset
        return chosen

    async def _run_steps_only(self, jobs: list[StepJob], *, until: float | None = None) -> None:
        """Run the steps, then, in the same worker call, the look-ahead steps of the tokens
        they sampled, and so on while every request keeps up and nothing else wants the
        worker (``until``: the time.perf_counter() when their adapter set's turn ends, another
        set waiting): the worker goes from one step to the next without a trip through trio.

        Each step's results reach trio as the next step's decode starts (``Handover``, in
        order, and before this returns), so the requests hand out their text meanwhile."""
        handover = self._handover
        assert handover is not None  # inside ``run``
        if not self._prompts:  # else one step only: a prompt waits for the next batch
            self._wants_turn.clear()  # what wanted the worker before is in this batch, or ahead of it
        # A step's results go to trio just before the next step's llama_decode, which runs
        # without the GIL: trio hands out the text while the model computes (handover.py).
        pending: list[tuple[list[StepJob], list[StepResult], list[StepJob]]] = []
        timed: list[tuple[int, float]] = []  # (steps, seconds) of each step: the ITL model's

        def hand_over() -> None:
            if pending:
                handover.send(self._deliver, *pending.pop())

        def run_steps() -> None:
            cur = jobs
            for n in range(1, MAX_STEPS_PER_CALL + 1):
                t0 = time.perf_counter()
                try:
                    results = self._step_sync([j.request() for j in cur], hand_over)
                except Exception as exc:
                    hand_over()
                    handover.send(self._deliver_error, cur, exc)
                    return
                hand_over()  # a step that did not decode (no slot had room)
                timed.append((len(cur), time.perf_counter() - t0))
                nxt: list[StepJob] = []
                if (
                    n < MAX_STEPS_PER_CALL
                    and not self._wants_turn.is_set()
                    and (until is None or time.perf_counter() < until)
                ):
                    # Read on the worker thread: flags trio may be setting now. A stale
                    # "asked" only ends the run early; a missed "cancelled" is dropped by the
                    # request (drop_ahead), which waits for the step.
                    nxt = [_next_step(j, r) for j, r in zip(cur, results, strict=True) if self._goes_on(j, r)]
                if not nxt:
                    handover.send(self._deliver, cur, results, nxt)
                    return
                pending.append((cur, results, nxt))
                cur = nxt

        self.runs += 1
        with trio.CancelScope(shield=True):  # finish the steps even on shutdown
            await self._run_on_worker(run_steps)
        handover.drain()  # what the run's last steps sent
        for n_steps, seconds in timed:
            self.chunks.steps_ran(n_steps, seconds)

    def _goes_on(self, job: StepJob, res: StepResult) -> bool:
        """Whether the last token ``job`` sampled (``res``) surely gets its own step (the
        ones before it are accepted drafts: none ends the generation)."""
        return (
            job.asked and not job.cancelled and res is not None and job.n_left > len(res) and not self._is_eog(res[-1])
        )

    def _deliver(self, jobs: list[StepJob], results: list[StepResult], running: list[StepJob]) -> None:
        """On trio: a step's results; ``running``: the look-ahead steps already under way
        (none after the last step of a run: look-ahead then goes into the next batch)."""
        self._count(jobs, results, running or None)
        for job in jobs:
            job.done.set()

    def _deliver_error(self, jobs: list[StepJob], exc: Exception) -> None:
        log.error("generation step failed", exc_info=exc)
        for job in jobs:  # a failed batch fails its requests, not the engine
            job.error = exc
            job.done.set()

    async def _run_with_prompts(self, jobs: list[StepJob], prompts: list[tuple[PrefillJob, int]]) -> None:
        parts = [
            PrefillPart(
                job.slot,
                job.tokens[job.offset : end],
                keep=job.keep if job.offset == 0 else None,
                sampler=job.sampler if end == len(job.tokens) else None,
                want_logits=job.want_logits and end == len(job.tokens),
            )
            for job, end in prompts
        ]
        reqs = [j.request() for j in jobs]
        t0 = time.perf_counter()
        try:
            with trio.CancelScope(shield=True):  # finish the batch even on shutdown
                results, part_outcomes = await self._run_mixed(reqs, parts)
        except Exception as exc:
            log.exception("generation step with prompt parts failed")
            for job in jobs:
                job.error = exc
            part_outcomes = [outcome.Error(exc)] * len(prompts)
        else:
            self._count(jobs, results)
            if jobs:
                self.chunks.prompt_ran(len(jobs), sum(len(p.tokens) for p in parts), time.perf_counter() - t0)
        for job in jobs:
            job.done.set()
        for (prompt, end), part_outcome in zip(prompts, part_outcomes, strict=True):
            if isinstance(part_outcome, outcome.Error):
                prompt.error = part_outcome.error
            else:
                self.prompt_tokens += end - prompt.offset
                self.prompt_parts += 1
                prompt.offset = end
                if end == len(prompt.tokens):
                    prompt.result = part_outcome.unwrap()
            if prompt.error is not None or end == len(prompt.tokens):
                self._prompts.remove(prompt)
                prompt.done.set()

    def _count(self, jobs: list[StepJob], results: list[StepResult], running: list[StepJob] | None = None) -> None:
        """Record a batch's results and its look-ahead steps: ``running`` (already under way
        on the worker), or else those this creates for the next batch."""
        for job, res in zip(jobs, results, strict=True):
            job.result = res
            # One step ahead at most: a look-ahead step the request has not taken yet (it is
            # slow, or blocked handing out text) gets no look-ahead of its own.
            if running is None and self._goes_on(job, res):
                nxt = _next_step(job, res)
                self._ahead[job.slot] = nxt
                self._next_steps.append(nxt)
        for nxt in running or ():
            self._ahead[nxt.slot] = nxt
        if jobs:
            self.batches += 1
            # Each step's token and the drafts it accepted: what stays in the KV.
            self.tokens += sum(len(res) if res else 1 for res in results)


def _next_step(job: StepJob, res: StepResult) -> StepJob:
    """The look-ahead step of the last token ``job`` sampled."""
    assert res is not None
    return StepJob(job.slot, res[-1], job.sampler, job.n_left - len(res), asked=False, spec=job.spec)


def _finish_if_cancelled(job: StepJob | PrefillJob) -> bool:
    if job.cancelled:
        job.done.set()
    return job.cancelled


async def _wait(job: StepJob | PrefillJob, during: Awaitable[None] | None, wants_turn: threading.Event) -> None:
    """Wait for ``job`` (after awaiting ``during``, work overlapped with it); raise its error.

    If cancelled, marks the job cancelled and still waits for the batch that may be running
    it (a run of steps ends after its current one), so nothing runs for the caller after
    this returns."""
    try:
        if during is not None:
            await during
        await job.done.wait()
    except BaseException:
        job.cancelled = True
        wants_turn.set()
        with trio.CancelScope(shield=True):
            await job.done.wait()
        raise
    if job.error is not None:
        raise job.error
