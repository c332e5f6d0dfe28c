"""Probes for benchmarks.hostwork: a token's host work by part, timed inside the engine process.

``install()`` wraps the functions each part runs in with a timer that keeps exclusive time (a
probe's time less the probes it calls), per thread; ``serve(argv, dump)`` installs them and
runs ``hydra-trio serve``, writing the totals to ``dump`` (JSON) on every SIGUSR1. The parts:

worker thread (every llama.cpp call; what a GPU would wait for):
  llama_decode      the model's compute (llama_cpp.llama_decode)
  batch fill        the llama_batch written before it (_decode_batch)
  step composition  a step's entries, the slots' order, the rows read back, accepted tokens
                    into the slot's history (BatchSteps.step / step_mixed less the above)
  logits read       the logits as arrays (llama_get_logits views)
  sampling          Sampler.sample less the constraint: argmax or the llama chain, bans
  constraint        a grammar's pick (Sampler._constrained: llguidance's check or mask)
  prefill           prompt chunks alone (eval_chunk less its decode): not a token's work
trio thread (overlapped with llama_decode, which releases the GIL; it competes for it after):
  detokenize        the token's bytes, UTF-8 and stop strings (token_bytes, TextAssembler.push)
  stop check        OutputProcessor.take less the above: EOG, limits, counts
  stream-out        stream_interval's chunking (OutputProcessor.ready) and the emit of each
                    chunk (SSE framing, the socket write or the reader's channel)
  scheduling        the batcher's side: a step handed in, its results counted and delivered,
                    look-ahead steps made (StepBatcher.submit/_take_waiting/_count/_deliver/
                    _next_prompts, Handover.drain)

Times are the thread's CPU time (a probe costs about 1 us: two CLOCK_THREAD_CPUTIME_ID reads
and a list); hostwork.py runs the same load on an engine without probes beside it, so that
cost shows. An outermost probe also keeps its wall time and how much of that wall time the
worker spent inside llama_decode meanwhile (``(outermost, during decode)``): for the trio
thread's parts, the share that overlapped the model's compute.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_totals: dict[str, list[int]] = {}  # part -> [exclusive ns, calls]
_lock = threading.Lock()
_local = threading.local()


def _stack() -> list[list[Any]]:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


# A part's time is its thread's CPU time (CLOCK_THREAD_CPUTIME_ID), not the wall clock: on a
# shared machine a thread waits for a core for longer than it computes, and that wait is the
# machine's, not the part's. An outermost probe also keeps its wall time: wall less CPU is
# what its thread waited (for a core, or for the GIL).
_clock = time.thread_time_ns

# The worker's time inside llama_decode up to now, as [ns of the calls that returned, start of
# the one running (0: none)]: the measure of the decode intervals up to a moment, so that an
# interval's overlap with them is the difference of two readings. Written by the worker, read
# by the trio thread, both holding the GIL.
_decoding = [0, 0]


def _decode_ns(now: int) -> int:
    done, start = _decoding
    return done + (now - start if start else 0)


def _timed_decode(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        _decoding[1] = time.perf_counter_ns()
        try:
            return fn(*args, **kw)
        finally:
            now = time.perf_counter_ns()
            _decoding[0] += now - _decoding[1]
            _decoding[1] = 0

    return wrapper


def _enter(part: str) -> list[Any]:
    stack = _stack()
    wall = None if stack else time.perf_counter_ns()
    # part, start, nested, wall start, decode then
    frame = [part, _clock(), 0, wall, None if wall is None else _decode_ns(wall)]
    stack.append(frame)
    return frame


def _leave(frame: list[Any]) -> None:
    elapsed = _clock() - frame[1]
    stack = _stack()
    stack.pop()
    if stack:
        stack[-1][2] += elapsed
    else:
        now = time.perf_counter_ns()
        _add(f"{frame[0]} (outermost, wall)", now - frame[3])
        _add(f"{frame[0]} (outermost, cpu)", elapsed)
        _add(f"{frame[0]} (outermost, during decode)", _decode_ns(now) - frame[4])
    _add(frame[0], elapsed - frame[2])


def _add(part: str, ns: int) -> None:
    row = _totals.get(part)
    if row is None:
        with _lock:
            row = _totals.setdefault(part, [0, 0])
    row[0] += ns
    row[1] += 1


def timed(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        frame = _enter(part)
        try:
            return fn(*args, **kw)
        finally:
            _leave(frame)

    return wrapper


def _patch(owner: Any, name: str, part: str) -> None:
    setattr(owner, name, timed(part, getattr(owner, name)))


def install() -> None:
    import llama_cpp

    from hydra_trio.engine.core import EngineCore
    from hydra_trio.engine.llama.context import LlamaBackend
    from hydra_trio.engine.llama.steps import BatchSteps
    from hydra_trio.engine.output import OutputProcessor
    from hydra_trio.engine.sample import Sampler
    from hydra_trio.engine.sched.batcher import StepBatcher
    from hydra_trio.engine.sched.handover import Handover
    from hydra_trio.engine.text import TextAssembler

    llama_cpp.llama_decode = _timed_decode(llama_cpp.llama_decode)
    _patch(llama_cpp, "llama_decode", "llama_decode")
    _patch(LlamaBackend, "_decode_batch", "batch fill")
    _patch(BatchSteps, "step", "step composition")
    _patch(BatchSteps, "step_mixed", "step composition")
    _patch(LlamaBackend, "_first_logits", "logits read")
    _patch(LlamaBackend, "_logits", "logits read")
    _patch(Sampler, "sample", "sampling")
    _patch(Sampler, "_constrained", "constraint")
    _patch(LlamaBackend, "eval_chunk", "prefill")
    _patch(LlamaBackend, "token_bytes", "detokenize")
    _patch(TextAssembler, "push", "detokenize")
    _patch(OutputProcessor, "take", "stop check")
    _patch(OutputProcessor, "ready", "stream-out")
    for name in ("submit", "_take_waiting", "_count", "_deliver", "_next_prompts"):
        _patch(StepBatcher, name, "scheduling")
    _patch(Handover, "drain", "scheduling")

    generate = EngineCore.generate

    @functools.wraps(generate)
    async def generate_timed(self: Any, slot: int, prompt_tokens: Any, params: Any, emit: Any, **kw: Any) -> Any:
        async def emit_timed(delta: str) -> None:
            # Off the probe stack: another task's emit may start while this one waits (its
            # CPU time then counts that task's work too: an emit rarely waits).
            t0, w0 = _clock(), time.perf_counter_ns()
            d0 = _decode_ns(w0)
            try:
                await emit(delta)
            finally:
                _add("stream-out", _clock() - t0)
                now = time.perf_counter_ns()
                _add("stream-out (outermost, wall)", now - w0)
                _add("stream-out (outermost, during decode)", _decode_ns(now) - d0)

        return await generate(self, slot, prompt_tokens, params, emit_timed, **kw)

    EngineCore.generate = generate_timed  # type: ignore[method-assign]


def snapshot() -> dict[str, list[int]]:
    with _lock:
        return {k: list(v) for k, v in _totals.items()}


def serve(argv: list[str], dump: Path) -> int:
    """``hydra-trio serve argv`` with the probes in; SIGUSR1 writes their totals to ``dump``."""
    install()

    def on_usr1(_sig: int, _frame: Any) -> None:
        tmp = dump.with_suffix(".tmp")
        tmp.write_text(json.dumps({"t": time.perf_counter(), "parts": snapshot()}))
        os.replace(tmp, dump)

    signal.signal(signal.SIGUSR1, on_usr1)
    from hydra_trio.cli import main

    return main(["serve", *argv])
