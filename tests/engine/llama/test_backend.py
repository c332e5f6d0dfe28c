"""LlamaBackend used directly (sync, no engine): the KV blob round trip between two backend
instances, and restore refusals that must leave the slot clean and usable."""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
import trio
import trio.testing

from helpers import wait_until
from hydra_trio.engine import SamplingParams
from hydra_trio.engine.llama import DecodeAborted, LlamaBackend, StepRequest
from hydra_trio.engine.sample import Sampler
from hydra_trio.wire import ErrorCode, ProtocolError, encode_kv_blob, parse_kv_blob

PROMPT = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
N_GEN = 24


def new_backend(model: Path, n_slots: int = 2, *, kv_unified: bool = True) -> LlamaBackend:
    n_ctx = 512 if kv_unified else 512 * n_slots  # the same 512 positions a slot either way
    return LlamaBackend(str(model), n_slots=n_slots, n_ctx=n_ctx, n_threads=1, n_batch=64, kv_unified=kv_unified)


def greedy_from(backend: LlamaBackend, slot: int, first: int, n: int = N_GEN) -> list[int]:
    """``first`` plus the next n-1 greedy tokens, stepping the slot."""
    sampler = Sampler(SamplingParams())
    try:
        out = [first]
        tok = first
        for _ in range(n - 1):
            res = backend.step([StepRequest(slot, tok, sampler)])[0]
            assert res is not None
            (nxt,) = res
            out.append(nxt)
            tok = nxt
        return out
    finally:
        sampler.close()


def continue_slot(backend: LlamaBackend, slot: int, n: int = N_GEN) -> list[int]:
    """Greedy continuation of what the slot holds, re-evaluating its last token (no logits),
    then put the slot back as it was."""
    held = list(backend.seq_tokens[slot])
    backend.truncate_slot(slot, len(held) - 1)
    sampler = Sampler(SamplingParams())
    try:
        first, _ = backend.eval_chunk(slot, [held[-1]], None, sampler=sampler)
    finally:
        sampler.close()
    assert first is not None
    out = greedy_from(backend, slot, first, n)
    backend.truncate_slot(slot, len(held))
    assert backend.seq_tokens[slot] == held
    return out


def assert_slot_clean(backend: LlamaBackend, slot: int) -> None:
    """The bookkeeping describes exactly what the KV holds, and the scratch sequence (of a
    unified cache) is empty."""
    mem = llama_cpp.llama_get_memory(backend._ctx)
    assert llama_cpp.llama_memory_seq_pos_max(mem, slot) + 1 == len(backend.seq_tokens[slot])
    if backend.seq_tokens[slot]:
        assert llama_cpp.llama_memory_seq_pos_min(mem, slot) == 0
    if backend.kv_unified:
        assert llama_cpp.llama_memory_seq_pos_max(mem, backend.scratch_seq) == -1
    state, tokens = backend.state_get(slot)
    assert tokens == backend.seq_tokens[slot]
    assert len(state) == backend.state_size_for(len(tokens))


@dataclass
class Reference:
    prompt: list[int]
    continuation: list[int]  # greedy tokens after the prompt, from a fresh prefill
    # The same, but with the last prompt position evaluated again alone (a batch of one
    # rounds differently from the whole prompt's batch): what a slot without logits gives.
    reeval_continuation: list[int]
    state: bytes  # llama state of the prompt alone
    logits: bytes  # last prompt position's logits

    @property
    def blob(self) -> bytes:
        return encode_kv_blob(len(self.prompt), self.prompt, self.state, self.logits)


@pytest.fixture(scope="module")
def model(tiny_model_ctx: Path) -> Path:
    """The context-sensitive tiny model: its greedy continuation depends on the whole KV,
    so "same continuation" really means "same KV" (see test_continuation_depends_on_the_kv)."""
    return tiny_model_ctx


@pytest.fixture(scope="module")
def reference(model: Path) -> Iterator[Reference]:
    b = new_backend(model, n_slots=1)
    try:
        prompt = b.tokenize(PROMPT, add_special=True)
        sampler = Sampler(SamplingParams())
        first, logits = b.eval_chunk(0, prompt, None, sampler=sampler, want_logits=True)
        sampler.close()
        assert first is not None and logits is not None
        assert len(logits) == 4 * b.info.n_vocab
        b.truncate_slot(0, len(prompt))
        state, tokens = b.state_get(0)  # before generating: the prompt's KV alone
        assert tokens == prompt
        continuation = greedy_from(b, 0, first)
        b.truncate_slot(0, len(prompt))
        reeval_continuation = continue_slot(b, 0)
        yield Reference(prompt, continuation, reeval_continuation, bytes(state), logits)
    finally:
        b.close()


@pytest.fixture(params=["unified", "split"])
def backend(model: Path, request: pytest.FixtureRequest) -> Iterator[LlamaBackend]:
    """Both KV layouts; the reference blob comes from a one-slot (unified) backend, so the
    split one also rewrites every blob into its own streams."""
    b = new_backend(model, kv_unified=request.param == "unified")
    yield b
    b.close()


def test_prefill_is_deterministic_across_instances(model: Path, reference: Reference) -> None:
    b = new_backend(model, n_slots=1)
    try:
        assert b.tokenize(PROMPT, add_special=True) == reference.prompt
        sampler = Sampler(SamplingParams())
        first, logits = b.eval_chunk(0, reference.prompt, None, sampler=sampler, want_logits=True)
        sampler.close()
        assert logits == reference.logits
        assert greedy_from(b, 0, first) == reference.continuation  # type: ignore[arg-type]
    finally:
        b.close()


def test_blob_round_trip_with_logits(backend: LlamaBackend, reference: Reference) -> None:
    blob = parse_kv_blob(reference.blob)
    assert blob.n_past == len(reference.prompt) and blob.tokens == reference.prompt
    assert backend.state_restore(0, blob.state, blob.tokens, blob.n_past) is True
    logits = backend.tail_logits[0]
    assert logits is not None and logits == reference.logits
    assert backend.seq_tokens[0] == reference.prompt
    assert_slot_clean(backend, 0)
    # Same bytes out as in: nothing lost or reordered by the restore.
    state, tokens = backend.state_get(0)
    assert tokens == reference.prompt and bytes(state) == reference.state
    sampler = Sampler(SamplingParams())
    first = backend.sample_from_logits(sampler, logits)
    sampler.close()
    assert greedy_from(backend, 0, first) == reference.continuation


def test_blob_round_trip_without_logits(backend: LlamaBackend, reference: Reference) -> None:
    """A STATE_GET-style blob (no logits): the last token is re-evaluated, with the text that
    evaluation gives on the slot that made the KV."""
    raw = encode_kv_blob(len(reference.prompt), reference.prompt, reference.state)
    blob = parse_kv_blob(raw)
    assert backend.state_restore(1, blob.state, blob.tokens, blob.n_past) is False
    assert backend.tail_logits[1] is None
    assert_slot_clean(backend, 1)
    assert continue_slot(backend, 1) == reference.reeval_continuation
    assert backend.n_past(0) == 0  # the other slot was not touched


def test_continuation_depends_on_the_kv(backend: LlamaBackend, reference: Reference) -> None:
    """Sanity check of the test model: another prompt ending in the same tokens (the chat
    template's assistant header) continues differently, so the round-trip tests above would
    notice a KV that was lost or mangled."""
    other = backend.tokenize(PROMPT.replace("hello world", "tell me a story"), add_special=True)
    assert other[-5:] == reference.prompt[-5:]
    backend.eval_chunk(0, other, None)
    assert continue_slot(backend, 0) != reference.reeval_continuation
    # Same prompt, the last layer's V rows zeroed (llama.cpp cannot notice): a different
    # continuation.
    mangled = bytearray(reference.state)
    tail = len(mangled) // 8
    mangled[-tail:] = bytes(tail)
    backend.state_restore(1, memoryview(mangled), reference.prompt, len(reference.prompt))
    assert continue_slot(backend, 1) != reference.reeval_continuation


def _bad_magic(state: bytes) -> bytes:
    return struct.pack("<I", 0x12345678) + state[4:]


def _corrupt_layer_count(state: bytes) -> bytes:
    # n_stream (offset 8) set to 7: llama.cpp refuses the stream count.
    return state[:8] + struct.pack("<I", 7) + state[12:]


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "bad-state-magic": _bad_magic,
    "bad-stream-count": _corrupt_layer_count,
    "truncated-half": lambda s: s[: len(s) // 2],
    "truncated-last-byte": lambda s: s[:-1],
    "truncated-to-10-bytes": lambda s: s[:10],
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_restore_refusal_leaves_slot_clean_and_usable(backend: LlamaBackend, reference: Reference, kind: str) -> None:
    bad = CORRUPTIONS[kind](reference.state)
    # Slot 0 already holds the prompt (restored from the good blob); slot 1 is empty.
    backend.state_restore(0, memoryview(reference.state), reference.prompt, len(reference.prompt))
    for slot in (0, 1):
        before = list(backend.seq_tokens[slot])
        with pytest.raises(ProtocolError) as exc:
            backend.state_restore(slot, memoryview(bytearray(bad)), reference.prompt, len(reference.prompt))
        assert exc.value.code == ErrorCode.RESTORE_FAILED
        # All-or-nothing: the slot holds what it held before, or (spec §2.2) was cleared.
        assert backend.seq_tokens[slot] in (before, [])
        assert_slot_clean(backend, slot)
    # Usable: a good restore into the refused slot works and continues with the same text.
    for slot in (0, 1):
        backend.state_restore(slot, memoryview(reference.state), reference.prompt, len(reference.prompt))
        assert_slot_clean(backend, slot)
        assert continue_slot(backend, slot) == reference.reeval_continuation


def test_restore_refuses_n_past_and_token_count_mismatch(backend: LlamaBackend, reference: Reference) -> None:
    n = len(reference.prompt)
    with pytest.raises(ProtocolError) as exc:
        backend.state_restore(0, memoryview(reference.state), reference.prompt, n + 1)
    assert exc.value.code == ErrorCode.RESTORE_FAILED
    assert_slot_clean(backend, 0)
    assert backend.n_past(0) == 0
    with pytest.raises(ProtocolError) as exc:
        backend.state_restore(0, memoryview(reference.state), reference.prompt[:-1], n)
    assert exc.value.code == ErrorCode.RESTORE_FAILED
    assert_slot_clean(backend, 0)
    assert backend.n_past(0) == 0


def test_state_size_prediction_matches_llama(backend: LlamaBackend, reference: Reference) -> None:
    """STATE_META reports state_size without a llama call: it must equal the real size."""
    assert backend.state_size_for(0) == backend.state_size(0)
    backend.state_restore(0, memoryview(reference.state), reference.prompt, len(reference.prompt))
    assert backend.state_size_for(len(reference.prompt)) == backend.state_size(0) == len(reference.state)


# ---- the GPU worker -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [ProtocolError(ErrorCode.RESTORE_FAILED, "refused"), DecodeAborted(), ValueError("x")],
    ids=["protocol-error", "decode-aborted", "value-error"],
)
async def test_gpu_worker_raises_the_call_s_own_exception(exc: Exception) -> None:
    """What a worker call raises reaches the caller as itself (not wrapped in an
    ExceptionGroup by the worker's helper nursery), so ``except ProtocolError`` /
    ``except DecodeAborted`` / ``except NoKvSpace`` around ``worker.run`` work."""
    from hydra_trio.engine.worker import GpuWorker

    def fail(_abort: object) -> None:
        raise exc

    with pytest.raises(type(exc)):
        await GpuWorker().run(fail)


async def test_gpu_worker_returns_and_counts() -> None:
    from hydra_trio.engine.worker import GpuWorker

    w = GpuWorker()
    assert await w.run(lambda abort: abort.is_set()) is False
    assert w.calls == 1


async def test_gpu_worker_cancel_sets_abort_flag() -> None:
    """A running call sees its abort flag once the caller is cancelled."""
    import threading

    from hydra_trio.engine.worker import GpuWorker

    started = threading.Event()
    seen: list[bool] = []

    def call(abort: threading.Event) -> None:
        started.set()
        seen.append(abort.wait(10.0))

    async def wait_started() -> None:
        await trio.to_thread.run_sync(started.wait, 10.0)

    w = GpuWorker()
    with trio.move_on_after(10) as outer:
        async with trio.open_nursery() as n:
            scope = trio.CancelScope()

            async def run() -> None:
                with scope:
                    await w.run(call)

            n.start_soon(run)
            await wait_started()
            scope.cancel()
    assert not outer.cancelled_caught
    assert seen == [True]


def test_several_prompt_parts_and_a_step_in_one_batch(model: Path, reference: Reference) -> None:
    """Two prompts split into parts, riding in one llama_decode with another slot's step:
    each slot ends with the same KV (same greedy continuation) as when evaluated alone."""
    from hydra_trio.engine.llama import PrefillPart

    b = new_backend(model, n_slots=3)
    sampler = Sampler(SamplingParams())
    try:
        prompt = reference.prompt
        first, _ = b.eval_chunk(0, prompt, None, sampler=sampler)  # slot 0 generates
        assert first == reference.continuation[0]
        half = len(prompt) // 2
        s1, s2 = Sampler(SamplingParams()), Sampler(SamplingParams())
        try:
            results, outcomes = b.step_mixed(
                [StepRequest(0, first, sampler)],
                [PrefillPart(1, prompt[:half], keep=0), PrefillPart(2, prompt[:half], keep=0)],
            )
            assert results == [(reference.continuation[1],)]
            assert [o.unwrap() for o in outcomes] == [(None, None), (None, None)]
            results, outcomes = b.step_mixed(
                [StepRequest(0, reference.continuation[1], sampler)],
                [
                    PrefillPart(1, prompt[half:], sampler=s1),
                    PrefillPart(2, prompt[half:], sampler=s2, want_logits=True),
                ],
            )
            assert results == [(reference.continuation[2],)]
            (tok1, logits1), (tok2, logits2) = (o.unwrap() for o in outcomes)
            assert tok1 == tok2 == reference.continuation[0]
            assert logits1 is None and logits2 is not None and len(logits2) == len(reference.logits)
        finally:
            s1.close()
            s2.close()
        for slot in (1, 2):
            assert b.seq_tokens[slot] == prompt
            assert_slot_clean(b, slot)
            assert continue_slot(b, slot) == reference.continuation
    finally:
        sampler.close()
        b.close()


class _ChainGreedy(Sampler):
    """Greedy through llama's sampler chain (what the argmax shortcut must equal)."""

    is_argmax = False  # type: ignore[assignment]


def test_greedy_argmax_picks_what_llama_greedy_sampler_picks(backend: LlamaBackend) -> None:
    fast, chain = Sampler(SamplingParams()), _ChainGreedy(SamplingParams())
    assert fast.is_argmax and not chain.is_argmax
    assert not Sampler(SamplingParams(repeat_penalty=1.1)).is_argmax  # penalties need the chain
    try:
        prompt = backend.tokenize(PROMPT, add_special=True)
        a, _ = backend.eval_chunk(0, prompt, None, sampler=fast)
        b, _ = backend.eval_chunk(1, prompt, None, sampler=chain)
        assert a is not None and a == b
        seq_a, seq_b = [a], [b]
        for _ in range(N_GEN):  # both slots in one batch: each reads its own output's logits
            ra, rb = backend.step([StepRequest(0, seq_a[-1], fast), StepRequest(1, seq_b[-1], chain)])
            assert ra is not None and rb is not None
            seq_a += ra
            seq_b += rb
        assert seq_a == seq_b
        logits = np.random.default_rng(0).standard_normal(backend.info.n_vocab).astype("<f4").tobytes()
        assert backend.sample_from_logits(fast, logits) == backend.sample_from_logits(chain, logits)
        assert fast._chain is None  # no llama sampler chain was built for the argmax
    finally:
        fast.close()
        chain.close()


@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "split"])
def test_each_stream_of_a_step_reads_its_own_logits(model: Path, kv_unified: bool) -> None:
    """A step reads every stream's logits as rows of one view of llama.cpp's buffer: each
    request gets the argmax of its own output (llama_get_logits_ith, the per-output accessor,
    read after the same decode), whatever order the requests come in, and a llama sampler
    chain in the same batch picks what the argmax of its row picks."""
    b = new_backend(model, n_slots=4, kv_unified=kv_unified)
    samplers = [
        Sampler(SamplingParams()),
        Sampler(SamplingParams()),
        _ChainGreedy(SamplingParams()),
        Sampler(SamplingParams()),
    ]
    try:
        tokens = {}
        for slot in range(4):
            prompt = b.tokenize(f"<|im_start|>user\nprompt number {slot * 7919} of four<|im_end|>\n", add_special=True)
            tokens[slot], _ = b.eval_chunk(slot, prompt, None, sampler=samplers[slot])
        order = [2, 0, 3, 1]  # not slot order: outputs come in slot order (_live_in_slot_order)
        seen: set[tuple[int, ...]] = set()
        for _ in range(N_GEN):
            results = b.step([StepRequest(slot, tokens[slot], samplers[slot]) for slot in order])
            for i, slot in enumerate(order):
                own = int(b._logits(sorted(order).index(slot)).argmax())
                assert results[i] == (own,), f"slot {slot} got {results[i]}, its own output's argmax is {own}"
                tokens[slot] = own
            seen.add(tuple(results))  # type: ignore[arg-type]
        assert any(len(set(r)) > 1 for r in seen), "every stream sampled the same token: a swap would go unseen"
    finally:
        for s in samplers:
            s.close()
        b.close()


@pytest.mark.parametrize("sampler_class", [Sampler, _ChainGreedy])
def test_ignore_eos_never_samples_an_end_of_generation_token(
    backend: LlamaBackend, sampler_class: type[Sampler]
) -> None:
    """Logits whose maximum is an end-of-generation token: picked without ignore_eos, masked
    with it, through the argmax and the llama chain alike; in llama.cpp's buffer and from a
    hand-off's logits (which keep the model's own values)."""
    eos = min(backend.eog_ids)
    values = np.random.default_rng(1).standard_normal(backend.info.n_vocab).astype("<f4")
    values[eos] = 100.0
    logits = values.tobytes()
    plain, banned = sampler_class(SamplingParams()), sampler_class(SamplingParams(ignore_eos=True))
    try:
        assert backend.sample_from_logits(plain, logits) == eos
        picked = backend.sample_from_logits(banned, logits)
        assert picked not in backend.eog_ids and values[picked] == max(
            v for t, v in enumerate(values) if t not in backend.eog_ids
        )
        assert logits == values.tobytes()  # the caller's logits are untouched
        # In llama.cpp's buffer: the prompt's last logits with EOS forced to the top.
        prompt = backend.tokenize(PROMPT, add_special=True)
        backend.eval_chunk(0, prompt, None, want_logits=True)
        backend._logits(-1)[eos] = 1e9
        assert backend._sample(plain, -1) == eos
        assert backend._sample(banned, -1) not in backend.eog_ids
    finally:
        plain.close()
        banned.close()


def test_token_text_tables_equal_llama_cpp(backend: LlamaBackend) -> None:
    """/tokenize pieces and /detokenize read tables built at load instead of calling llama.cpp
    per token: the tables hold exactly what llama.cpp says, control tokens spelled out."""
    for t in range(backend.info.n_vocab):
        assert backend.vocabulary.special_piece(t) == backend._piece(t, special=True)
        assert backend.token_bytes(t) == backend._piece(t)


async def test_a_call_that_comes_while_the_worker_closes_is_refused() -> None:
    """The close (freeing the model) is the last call: one that asks while it runs is
    refused at once, not queued behind it to run on a freed model."""
    import threading

    from hydra_trio.engine.worker import GpuWorker

    w = GpuWorker()
    closing, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def free_model() -> None:
        closing.set()
        release.wait(10)
        ran.append("close")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(w.close, free_model)
        await trio.to_thread.run_sync(closing.wait, 10)
        with pytest.raises(ProtocolError, match="engine is stopped"):
            await w.call(lambda: ran.append("late"))
        release.set()
    assert ran == ["close"]


def _gated_calls(*names: str) -> tuple[dict[str, threading.Event], list[str], Callable[[str], None]]:
    """Worker calls held until their gate is set: (the gates, the names in the order the calls
    ran, the call to hand the worker)."""
    gates = {name: threading.Event() for name in names}
    ran: list[str] = []

    def call(name: str) -> None:
        gates[name].wait(10)
        ran.append(name)

    return gates, ran, call


async def test_gpu_worker_waits_for_the_calls_queued_ahead() -> None:
    """``wait_for_calls_ahead`` returns once the running call and those queued behind it
    have run (a batch composed then takes in what they brought), and says how many were
    queued; with nothing queued it returns at once."""
    from hydra_trio.engine.worker import GpuWorker

    w = GpuWorker()
    assert await w.wait_for_calls_ahead(1.0) == 0
    gates, ran, call = _gated_calls("running", "queued-1", "queued-2")
    waited: list[tuple[int, list[str]]] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(w.call, lambda: call("running"))
            await wait_until(lambda: w._in_call)
            for name in ("queued-1", "queued-2"):
                n.start_soon(w.call, lambda name=name: call(name))
            await wait_until(lambda: w.limiter.statistics().tasks_waiting == 2)

            async def waiter() -> None:
                got = await w.wait_for_calls_ahead(5.0)
                waited.append((got, list(ran)))

            n.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            gates["running"].set()
            await wait_until(lambda: ran == ["running"] and w._in_call)  # a queued call runs now
            await trio.testing.wait_all_tasks_blocked()
            assert not waited, "returned with calls still queued ahead"
            gates["queued-1"].set()
            gates["queued-2"].set()
    # The two queued calls started in one tick: trio may queue them in either order.
    assert waited == [(2, ran)] and ran[0] == "running" and sorted(ran[1:]) == ["queued-1", "queued-2"]


async def test_gpu_worker_on_a_shared_lane_waits_for_the_running_call_only() -> None:
    """Two engines on one lane: a call queued ahead may be the other model's run of steps,
    which yields only once a call is queued, so the batch is composed (and queued) as soon
    as the running call returns."""
    from hydra_trio.engine.worker import GpuWorker, WorkerLane

    lane = WorkerLane()
    mine, other = GpuWorker(lane), GpuWorker(lane)
    assert lane.shared
    gates, ran, call = _gated_calls("running", "queued")
    waited: list[tuple[int, list[str]]] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(mine.call, lambda: call("running"))
            await wait_until(lambda: mine._in_call)
            n.start_soon(other.call, lambda: call("queued"))
            await wait_until(lambda: lane.limiter.statistics().tasks_waiting == 1)

            async def waiter() -> None:
                got = await mine.wait_for_calls_ahead(5.0)
                waited.append((got, list(ran)))

            n.start_soon(waiter)
            gates["running"].set()
            await wait_until(lambda: bool(waited))
            gates["queued"].set()
    assert waited == [(0, ["running"])]
    assert lane.calls_ended == 2
