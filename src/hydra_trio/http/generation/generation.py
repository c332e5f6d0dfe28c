"""One way for HTTP routes to run a generation: hold a slot (``Engine.claim``), generate in
it (the entry point every path shares, so requests join the same continuous batches).

Every API differs only in how it shapes the result: each answers through
``generate_buffered`` or ``start_stream`` and ``sse_body`` (http/generation/dialect.py's
``respond``), its stream written as its ``StreamEvents``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from ...concurrency import WriterTurn, Wrote, start_owned
from ...engine import (
    GenerationParams,
    GenerationResult,
    SlotLease,
    TokenLogprobs,
    Turn,
    turn_receipt,
)
from ...observability import generation_fields, receipt_note, request_extra, spec_note
from ...wire.errors import ProtocolError
from ..plumbing import (
    OPEN_TENANT,
    SSE_DONE,
    RequestSession,
    chunk_writer,
    client_request_id,
    error_body,
    http_status,
    request_nursery,
    sse_event,
)

if TYPE_CHECKING:
    from ...concurrency import OwnedTask
    from ...engine import Engine
    from ...serving import AppState

log = logging.getLogger(__name__)


# Runs in the claimed slot before generation (e.g. restoring a handed-off KV, whose logits
# then stay with the slot for the first token).
Prepare = Callable[[SlotLease], Awaitable[None]]


def error_event_body(exc: BaseException) -> dict[str, Any]:
    """The SSE error event that ends a stream which failed after its 200 was sent."""
    if isinstance(exc, ProtocolError):
        status = http_status(exc)
        kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
        return error_body(status, exc.message, kind, error_code=str(exc.code))
    return error_body(500, f"internal error: {type(exc).__name__}", "server_error", error_code="INTERNAL")


def slot_for(
    state: AppState,
    engine: Engine,
    tokens: Sequence[int],
    owner: str,
    params: GenerationParams,
    turn: Turn | None = None,
) -> Any:
    """The claim of an HTTP generation: the free slot that holds the longest prefix of the
    prompt under the request's cache salt and LoRA adapter set, waited for up to
    --slot-wait-s (then the one "busy, retry" refusal: 503 with Retry-After), for the agent
    session's ``turn``."""
    return engine.claim(
        owner, prompt=tokens, salt=params.cache_salt, lora=params.lora, wait_s=state.settings.slot_wait_s, turn=turn
    )


def session_turn(engine: Engine, session: RequestSession | None, salt: str | None) -> AbstractAsyncContextManager[Turn]:
    """The request's turn in its agent session (a one-off request's own, without one): the
    cancel scope its tree, its deadline and ``/finish_session`` cut it with."""
    if session is None:
        return engine.sessions(OPEN_TENANT).turn(None, salt)
    return engine.sessions(session.tenant).turn(session.hint, salt)


def mark_cut(res: GenerationResult, turn: Turn) -> None:
    """A turn its scope cut ended early, without an error: say so in its result (the
    receipt in its reply, its request line, ``finish_reason`` abort)."""
    if turn.cut is not None:
        res.cut = turn.cut
        res.stop_type = "cancelled"
    res.session_id = turn.session_id


async def _discard(_delta: str) -> None:
    return None


@dataclass(slots=True)
class _Line:
    """What one request line says besides the result: filled in as the request goes."""

    owner: str
    path: str
    model: str
    lora: str | None  # the LoRA adapter set's name (None: the base model)
    slot: int | None = None
    queue_s: float = 0.0
    turn: Turn | None = None


@dataclass(frozen=True, slots=True)
class Run:
    """One generation to run: a prepared request's tokens and parameters, whose it is
    (``owner``; ``path``: its route in request lines and metrics), what runs in its claimed
    slot first (``prepare``), its agent session, and whether it generates at all
    (``prompt_only``: the slot held for ``prepare`` alone, as an echo with max_tokens 0)."""

    state: AppState
    engine: Engine
    tokens: Sequence[int]
    params: GenerationParams
    owner: str
    path: str
    prepare: Prepare | None = None
    session: RequestSession | None = None
    prompt_only: bool = False

    def line(self) -> _Line:
        return _Line(self.owner, self.path, self.engine.served_name, self.params.lora_name)

    def recorded(self, res: GenerationResult, line: _Line) -> None:
        """Its metrics, once it has ended (not for a refusal before its slot)."""
        self.state.metrics.record_generation(
            self.path, res, model=self.engine.served_name, queue_s=line.queue_s, aborted=res.cut is not None
        )


async def generate_buffered(run: Run) -> tuple[int | None, GenerationResult]:
    """(slot id, result) of a whole generation; a turn cut before it held a slot has none."""
    line = run.line()
    res = GenerationResult(prompt_tokens=len(run.tokens))
    with _logged(line, res):
        await _in_a_slot(run, line, res, _discard)
    run.recorded(res, line)
    return line.slot, res


async def _in_a_slot(
    run: Run,
    line: _Line,
    res: GenerationResult,
    emit: Callable[[str], Awaitable[None]],
    *,
    held: Callable[[int], None] | None = None,
    last: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """The one generation of every route, whole or streamed: its turn in its agent session,
    the slot claimed for it (``held(slot id)``), ``prepare`` run there, its tokens generated
    into ``res`` (each delta to ``emit``; ``prompt_only``: none), then ``last`` in the slot;
    a turn its session's scope cut says so in ``res``. ``line`` records what it got."""
    engine, tokens, params = run.engine, run.tokens, run.params
    t_arrived = trio.current_time()
    async with session_turn(engine, run.session, params.cache_salt) as turn:
        line.turn = turn
        async with slot_for(run.state, engine, tokens, run.owner, params, turn) as lease:
            line.slot, line.queue_s = lease.id, trio.current_time() - t_arrived
            if held is not None:
                held(lease.id)
            if run.prepare is not None:
                await run.prepare(lease)
            if run.prompt_only:
                res.prompt_tokens = res.n_prompt_processed = len(tokens)
            else:
                await lease.generate(tokens, params, emit, result=res)
            if last is not None:
                await last()
    mark_cut(res, turn)


@contextmanager
def _logged(line: _Line, res: GenerationResult) -> Iterator[None]:
    """One request line per HTTP generation, however it ends: done, cut (its receipt),
    cancelled (the client left), or failed, with its tokens, timings, model, LoRA adapter set
    (its name; None: the base model) and session (observability/logs.py: its JSON fields). A refusal before any slot was
    held (busy: 503) is the route's."""
    outcome, error = "done", None
    # The client's X-Request-Id, else the completion id (the owner names it then, alone).
    request_id = client_request_id() or line.owner.removeprefix("http:")
    try:
        yield
    except trio.Cancelled:
        outcome = "cancelled"
        res.cut = res.cut or (line.turn.cut if line.turn is not None else None) or "cancelled"
        raise
    except BaseException as exc:
        outcome, error = "failed", exc.message if isinstance(exc, ProtocolError) else type(exc).__name__
        raise
    finally:
        if res.cut is not None:
            outcome = "cancelled"
        if line.slot is not None or res.cut is not None:
            _log_line(line, res, outcome, error, request_id)


def _log_line(line: _Line, res: GenerationResult, outcome: str, error: str | None, request_id: str) -> None:
    fields = generation_fields(res, outcome=outcome, queue_s=line.queue_s)
    session_id = line.turn.session_id if line.turn is not None else None
    receipt = turn_receipt(res)
    slot = "-" if line.slot is None else str(line.slot)
    log.info(
        "%s %s model %s slot %s %s: %d prompt (%d cached), %d generated, %s, ttft %.1f ms, %.1f tok/s%s%s%s%s",
        line.path, line.owner, line.model, slot, outcome if error is None else f"failed: {error}", res.prompt_tokens,
        res.n_common,
        res.completion_tokens, res.stop_type if outcome == "done" else "-", fields["ttft_ms"] or 0.0, res.tokens_per_s,
        spec_note(res), "" if line.lora is None else f", LoRA {line.lora}",
        "" if session_id is None else f", session {session_id}", receipt_note(receipt),
        extra=request_extra(
            request_id=request_id, route=line.path, model=line.model, slot=line.slot, error=error, lora=line.lora,
            session_id=session_id,
            receipt=receipt, **fields,
        ),
    )


@dataclass(slots=True, frozen=True)
class Delta:
    """A text delta for the reader to send (its event)."""

    text: str


@dataclass(slots=True, frozen=True)
class Logprobs:
    """The tokens' logprobs of the ``Delta`` that follows (a request that asked)."""

    entries: Sequence[TokenLogprobs]


@dataclass(slots=True, frozen=True)
class Rest:
    """Here, in order, goes the rest of a chunk the producer began (``WriterTurn.rest``)."""


@dataclass(slots=True, frozen=True)
class Done:
    result: GenerationResult


@dataclass(slots=True, frozen=True)
class Failed:
    error: BaseException


StreamItem = Delta | Logprobs | Rest | Done | Failed
_REST = Rest()


@dataclass(slots=True)
class GenerationStream:
    """A generation running in its HTTP request's own nursery; ``items`` receives ``Delta``
    items (each after a ``Logprobs`` when the request asked), then ``Done`` or ``Failed``.
    The reader must ``close()`` it.

    While the reader waits with nothing queued, everything it was given has been sent, so
    the producer writes a delta's event itself in its ``turn`` (``WriterTurn``) instead of
    waking it; a write the socket took only in part queues ``Rest``, where the reader sends
    the rest of that chunk, first in line."""

    task: OwnedTask
    slot_id: int | None  # None: its turn was cut before it held a slot
    items: trio.MemoryReceiveChannel[StreamItem]
    turn: WriterTurn
    line: _Line | None = None  # its request line's facts, the agent session's turn among them

    async def batches(self) -> AsyncIterator[list[StreamItem]]:
        """The items, each batch everything that was ready when the reader got to it: under
        backlog several tokens share one write, and a reader that keeps up gets each token
        as it comes (nothing waits for a batch to fill)."""
        while True:
            try:
                first = self.items.receive_nowait()
            except trio.WouldBlock:
                # All sent, nothing queued: the producer writes until it queues something.
                self.turn.hand_over()
                try:
                    first = await self.items.receive()
                except trio.EndOfChannel:
                    return
            except trio.EndOfChannel:
                return
            batch = [first]
            while True:
                try:
                    batch.append(self.items.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            yield batch

    async def close(self) -> None:
        """Stop generation (client gone or stream over) and wait until it has stopped."""
        with trio.CancelScope(shield=True):
            # The client left (or the stream is over): its subagents' requests stop now, in
            # the same pass, not after this one's step in flight has been waited for.
            turn = self.line.turn if self.line is not None else None
            if turn is not None and not turn.ended.is_set():
                turn.cancel_subagents()
            # Cancel before closing the channel: a producer that ran in between would find
            # it closed and end as a failure, where the client had left (a cancellation).
            await self.task.cancel_and_wait()
            await self.items.aclose()


@dataclass(frozen=True, slots=True)
class StreamEvents:
    """What a streamed reply is written as: ``head``, an event per text delta (``delta``;
    ``logprobs(text, entries)`` instead for a request that asked for logprobs), the final
    event (``done``), then ``end`` (OpenAI's ``[DONE]``; the agents' dialects end with their
    own last event: b""); ``error``: the event of a failure after the 200 (None: OpenAI's
    error chunk). ``direct=False``: the producer never writes deltas itself (a parsed reply's
    event may be empty, or depend on what came before). An empty event writes nothing."""

    head: bytes
    delta: Callable[[str], bytes]
    done: Callable[[GenerationResult], bytes]
    logprobs: Callable[[str, Sequence[TokenLogprobs]], bytes] | None = None
    direct: bool = True
    end: bytes = SSE_DONE
    error: Callable[[BaseException], bytes] | None = None


async def sse_body(stream: GenerationStream, events: StreamEvents) -> AsyncIterator[bytes]:
    """The SSE body of a streamed generation (``events``: what it is written as): what is
    ready goes out in one write. Leaving (the client went away, or the stream ended) stops
    the generation before this returns. A request that asked for logprobs gets ``Logprobs``
    before each delta: that delta's event is then ``events.logprobs(text, entries)``."""
    delta_event, logprobs_event, error_event = events.delta, events.logprobs, events.error
    held: Sequence[TokenLogprobs] | None = None

    def failure(exc: BaseException) -> bytes:
        if error_event is not None:
            try:
                return error_event(exc)
            except Exception:  # the dialect's own error event failed too: OpenAI's
                log.exception("streaming reply: the error event could not be built")
        return sse_event(error_event_body(exc))

    def event_of(item: StreamItem) -> bytes:
        nonlocal held
        if isinstance(item, Delta):
            text, entries, held = item.text, held, None
            return delta_event(text) if entries is None or logprobs_event is None else logprobs_event(text, entries)
        if isinstance(item, Logprobs):
            held = item.entries
            return b""
        if isinstance(item, Done):
            return events.done(item.result)
        assert isinstance(item, Failed)
        return failure(item.error)

    try:
        if events.head:
            yield events.head
        # The head is out (Quart sent the response head before asking for the body).
        writer = chunk_writer()
        if writer is not None and logprobs_event is None and events.direct:
            stream.turn.attach(writer, delta_event)
        ended = False
        async for batch in stream.batches():
            out: list[bytes] = []
            for item in batch:
                if isinstance(item, Rest):  # of a chunk the producer began: nothing may come between
                    if out:
                        yield b"".join(out)
                        out = []
                    await stream.turn.send_rest()
                    continue
                try:
                    out.append(event_of(item))
                except Exception as exc:
                    # An event that cannot be built (a reply's parser, a shape) ends the stream
                    # as any failure after the 200 does: its error event, then the end.
                    log.exception("streaming reply: an event could not be built")
                    out.append(failure(exc))
                    ended = True
                    break
            if out:
                yield b"".join(out)
            if ended:
                break
        if events.end:
            yield events.end
    finally:
        await stream.close()


async def start_stream(run: Run) -> GenerationStream:
    """Claim a slot and start generating into a channel (the claim's refusal is raised here).
    A turn cut before it held a slot streams its end (and receipt) alone: slot id None."""
    params, owner = run.params, run.owner
    send, recv = trio.open_memory_channel[StreamItem](64)
    stall_s = run.state.settings.slot_wait_s
    turn = WriterTurn()
    res = GenerationResult(prompt_tokens=len(run.tokens))

    async def put(item: StreamItem) -> None:
        turn.take_back()  # the reader writes what is queued, in order
        # The common case (room in the channel) needs no deadline: a cancel scope per
        # token was a tenth of the trio thread's work per streamed token (profiled).
        try:
            send.send_nowait(item)
            return
        except trio.WouldBlock:
            pass
        # A reader that stops reading without disconnecting must not hold the slot forever.
        with trio.fail_after(stall_s):
            await send.send(item)

    sent_lp = 0  # entries of res.logprobs handed out: each goes with its chunk's text

    async def emit(delta: str) -> None:
        nonlocal sent_lp
        if params.logprobs is not None:  # the tokens whose text this delta is
            await put(Logprobs(res.logprobs[sent_lp:]))
            sent_lp = len(res.logprobs)
        elif turn.direct:
            wrote = turn.write(delta)
            if wrote is Wrote.ALL:
                return
            if wrote is Wrote.PART:
                await put(_REST)
                return
        await put(Delta(delta))

    line = run.line()

    async def flush_logprobs() -> None:
        if len(res.logprobs) > sent_lp:  # tokens whose text never came (a stop string's)
            await emit("")

    async def produce(task_status: Any) -> None:
        # The slot is free before the channel closes: a reader that saw the end sees it free.
        async with send:
            try:
                with _logged(line, res):
                    await _in_a_slot(run, line, res, emit, held=task_status.started, last=flush_logprobs)
                if line.slot is None:  # cut while it waited for a slot
                    task_status.started(None)
                run.recorded(res, line)
                await put(Done(res))
            except (trio.TooSlowError, trio.BrokenResourceError) as exc:
                # The reader stopped reading or left: nobody to tell.
                log.info("streaming generation %s ended: reader gone or stalled (%r)", owner, exc)
            except Exception as exc:
                if line.slot is None:
                    raise  # refused before its 200 (no slot): the route answers
                if not isinstance(exc, ProtocolError):
                    log.exception("streaming generation %s failed", owner)
                else:
                    log.info("streaming generation %s ended early: %s", owner, exc.message)
                # The reader is told, unless it stalls for the whole stall deadline too.
                turn.take_back()
                with trio.move_on_after(stall_s):
                    await send.send(Failed(exc))

    # The producer belongs to its request: it runs in the request's own nursery, which ends
    # when the client goes away or the response is sent.
    task, slot_id = await start_owned(request_nursery(), owner, produce)
    return GenerationStream(task, slot_id, recv, turn, line)
