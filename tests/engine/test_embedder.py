"""The embedding line (engine/embedder.py) without a model: how inputs are batched into
calls, the step budget while streams generate, admission, a cancelled request's inputs, and
llama.cpp's normalisation (engine/llama/embedding.py ``normalize``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from hydra_trio.config import Settings
from hydra_trio.engine import Embedder, Engine
from hydra_trio.engine.embedder import embeddings_wanted
from hydra_trio.engine.llama import PooledShape, TokenRoles, normalize
from hydra_trio.engine.worker import GpuWorker
from hydra_trio.wire import ProtocolError, Status


@dataclass
class FakeContext:
    shape: PooledShape
    calls: list[list[list[int]]] = field(default_factory=list)
    gate: threading.Event | None = None  # set: calls may run
    entered: threading.Event = field(default_factory=threading.Event)

    def run(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        self.calls.append([list(x) for x in inputs])
        # Each vector names its input: its first token, its length.
        return [np.array([x[0], len(x)], dtype=np.float32) for x in inputs]


@dataclass
class FakeInfo:
    n_vocab: int = 1000
    roles: TokenRoles = field(default_factory=lambda: TokenRoles({"bos": 1, "eos": 2}, add_bos=True, add_eos=True))
    rerank_template: str | None = None


class FakeBackend:
    def __init__(self, ctx: FakeContext) -> None:
        self.ctx = ctx
        self.info = FakeInfo()

    def embedding_context(self, pooling: str | None, n_seq_max: int) -> FakeContext:
        return self.ctx

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        ids = [100 + len(w) for w in text.split()]
        return [1, *ids, 2] if add_special else ids


def make(
    nursery: trio.Nursery | None, n_batch: int = 64, n_seq: int = 4, *, streams: bool = False, **settings: Any
) -> tuple[Embedder, FakeContext]:
    """An embedder on a fake context, its pump running in ``nursery`` (the engine's, there;
    None: the caller runs it)."""
    ctx = FakeContext(PooledShape("mean", 2, n_batch, n_seq, ()))
    backend = FakeBackend(ctx)
    s = replace(Settings(step_token_budget=8, warmup=False), **settings)
    emb = Embedder(lambda: backend, GpuWorker(), s, pooling=None, streams_running=lambda: streams)  # type: ignore[arg-type, return-value]
    if nursery is not None:
        nursery.start_soon(emb.run)
    return emb, ctx


async def test_inputs_that_wait_together_share_calls_in_order(nursery: trio.Nursery) -> None:
    emb, ctx = make(nursery, n_batch=64, n_seq=4)
    await emb.open()
    ctx.gate = threading.Event()
    results: dict[int, Any] = {}

    async def one(i: int, inputs: list[list[int]]) -> None:
        results[i] = await emb.embed(inputs)

    async with trio.open_nursery() as n:
        n.start_soon(one, 0, [[10, 11]])
        await trio.to_thread.run_sync(ctx.entered.wait)  # the first call runs, alone
        n.start_soon(one, 1, [[20], [21, 22, 23]])
        await trio.testing.wait_all_tasks_blocked()  # in line first
        n.start_soon(one, 2, [[30], [31], [32]])
        await trio.testing.wait_all_tasks_blocked()
        ctx.gate.set()
    assert ctx.calls[0] == [[10, 11]]
    # The next call takes the oldest four (the line's order), the last one the rest.
    assert ctx.calls[1:] == [[[20], [21, 22, 23], [30], [31]], [[32]]]
    assert [v[0] for v in results[2].vectors] == [30, 31, 32]
    assert results[1].n_tokens == [1, 3] and results[1].prompt_tokens == 4


async def test_a_call_carries_a_step_budget_while_streams_generate(nursery: trio.Nursery) -> None:
    emb, ctx = make(nursery, n_batch=64, n_seq=8, streams=True)  # --step-token-budget 8
    await emb.open()
    pooled = await emb.embed([[1] * 5, [2] * 5, [3] * 20, [4] * 3])
    # 5 + 5 > 8: one input a call, but one always goes (the 20-token one alone).
    assert [[x[0] for x in call] for call in ctx.calls] == [[1], [2], [3], [4]]
    assert [int(v[1]) for v in pooled.vectors] == [5, 5, 20, 3]
    emb2, ctx2 = make(nursery, n_batch=64, n_seq=8, streams=False)
    await emb2.open()
    await emb2.embed([[1] * 5, [2] * 5, [3] * 20, [4] * 3])
    assert len(ctx2.calls) == 1  # no streams: the whole batch


async def test_the_line_is_bounded_and_a_full_line_is_busy(nursery: trio.Nursery) -> None:
    emb, ctx = make(nursery, n_batch=64, n_seq=2, embd_max_waiting=4)
    await emb.open()
    with pytest.raises(ProtocolError) as too_many:
        await emb.embed([[1]] * 5)
    assert too_many.value.status == Status.BAD_REQUEST and "at most 4" in too_many.value.message
    ctx.gate = threading.Event()
    async with trio.open_nursery() as n:
        n.start_soon(emb.embed, [[1], [2]])
        await trio.to_thread.run_sync(ctx.entered.wait)  # 2 taken into the running call
        n.start_soon(emb.embed, [[3], [4], [5]])
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(ProtocolError) as busy:
            await emb.embed([[6], [7]])  # 3 waiting + 2 > 4
        assert busy.value.status == Status.BUSY
        ctx.gate.set()


async def test_refusals_name_the_input(nursery: trio.Nursery) -> None:
    emb, _ = make(nursery, n_batch=8)
    await emb.open()
    for inputs, words in (
        ([[1] * 9], "input 0 has 9 tokens; an input holds at most 8"),
        (["a", ""], "input 1 is an empty string"),
        ([[1, 5000]], "array of token ids (0..999)"),
        ([[1], "a b c d e f g h i j"], "input 1 has 12 tokens"),  # known only once tokenized, in its call
    ):
        with pytest.raises(ProtocolError) as err:
            await emb.embed(inputs)
        assert words in err.value.message and err.value.param == "input"  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError) as err:
        await emb.rerank("q", ["fine", "a b c d e f g"])
    assert "document 1 has 11 tokens with the query" in err.value.message


async def test_a_cancelled_request_leaves_the_line_and_the_others_are_served(nursery: trio.Nursery) -> None:
    emb, ctx = make(nursery, n_batch=64, n_seq=2)
    await emb.open()
    ctx.gate = threading.Event()
    done: list[Any] = []

    async def served() -> None:
        done.append(await emb.embed([[7], [8]]))

    async with trio.open_nursery() as n:
        n.start_soon(emb.embed, [[1], [2]])
        await trio.to_thread.run_sync(ctx.entered.wait)
        gone = trio.CancelScope()

        async def leaves() -> None:
            with gone:
                await emb.embed([[3], [4]])

        n.start_soon(leaves)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(served)
        await trio.testing.wait_all_tasks_blocked()
        gone.cancel()
        await trio.testing.wait_all_tasks_blocked()
        ctx.gate.set()
    assert [[x[0] for x in call] for call in ctx.calls] == [[1, 2], [7, 8]]  # [3], [4] never ran
    assert not emb._line


async def test_open_warms_the_context_up_with_one_input(nursery: trio.Nursery) -> None:
    emb, ctx = make(nursery, warmup=True)
    shape = await emb.open()
    assert shape.pooling == "mean" and ctx.calls == [[[1]]]  # BOS alone


async def test_texts_are_tokenized_in_the_call_that_computes_them(nursery: trio.Nursery) -> None:
    """One trip to the worker a call: texts are tokenized there (with BOS/EOS), token ids kept;
    a text that turns out not to fit the call's budget goes back to the line's head, tokenized."""
    emb, ctx = make(nursery, n_batch=8, n_seq=4)
    await emb.open()
    calls = emb._worker.calls
    pooled = await emb.embed(["ab c", [5, 6], "a b c d e"])
    assert ctx.calls == [[[1, 102, 101, 2], [5, 6]], [[1, 101, 101, 101, 101, 101, 2]]]
    assert emb._worker.calls - calls == 2 and pooled.n_tokens == [4, 2, 7]
    # llama-server's pair: [BOS] query [EOS] (no SEP here) document [EOS]
    rr = await emb.rerank("q", ["dd", "e"])
    assert ctx.calls[-2:] == [[[1, 101, 2, 102, 2]], [[1, 101, 2, 101, 2]]] and rr.prompt_tokens == 10  # 5 + 5 > 8


def test_normalize_is_llama_cpps() -> None:
    v = np.array([3.0, -4.0, 0.0], dtype=np.float32)
    assert np.allclose(normalize(v, 2), [0.6, -0.8, 0.0])
    assert np.allclose(normalize(v, -1), v)
    assert np.allclose(normalize(v, 0), v * (32760.0 / 4.0))
    assert np.allclose(normalize(v, 1), v / 7.0)
    assert np.allclose(normalize(v, 3), v / (27 + 64) ** (1 / 3))
    assert not normalize(np.zeros(3, dtype=np.float32), 2).any()


def test_which_models_get_embeddings() -> None:
    base = Settings()
    assert embeddings_wanted(base, None) == (False, None)
    assert embeddings_wanted(base, "mean") == (True, None)  # an embedding model: by itself
    assert embeddings_wanted(base, "none") == (False, None)
    assert embeddings_wanted(replace(base, embeddings=True), None) == (True, None)
    assert embeddings_wanted(replace(base, embeddings=False), "rank") == (False, None)
    assert embeddings_wanted(replace(base, pooling="last"), None) == (True, "last")
    assert embeddings_wanted(replace(base, reranking=True), None) == (True, "rank")


async def test_the_wait_is_for_a_turn_not_for_the_work(nursery: trio.Nursery) -> None:
    """wait_s bounds the wait until a request's first input is in a call (busy: 503); once
    one is, the request runs to its end however long its calls take."""
    emb, ctx = make(nursery, n_batch=64, n_seq=1)
    await emb.open()
    ctx.gate = threading.Event()
    async with trio.open_nursery() as n:
        n.start_soon(emb.embed, [[1]])
        await trio.to_thread.run_sync(ctx.entered.wait)  # [1] runs, held
        with pytest.raises(ProtocolError) as busy:
            await emb.embed([[2]], wait_s=0.05)  # its turn never comes in time
        ctx.gate.set()
    assert busy.value.status == Status.BUSY and "waited" in busy.value.message
    assert not emb._line  # [2] left the line
    ctx.entered.clear()
    ctx.gate = threading.Event()
    async with trio.open_nursery() as n:
        n.start_soon(lambda: emb.embed([[3], [4]], wait_s=0.05))  # two calls: the second well past 0.05 s
        await trio.to_thread.run_sync(ctx.entered.wait)
        await trio.sleep(0.2)
        ctx.gate.set()
    assert [c[0][0] for c in ctx.calls[-2:]] == [3, 4]


class Gated(FakeContext):
    """A call at a time: each waits for its own go (``go[i]`` for the i-th call)."""

    def __init__(self, shape: PooledShape, n: int) -> None:
        super().__init__(shape)
        self.go = [threading.Event() for _ in range(n)]
        self.started = [threading.Event() for _ in range(n)]

    def run(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        i = len(self.calls)
        self.started[i].set()
        assert self.go[i].wait(10)
        return super().run(inputs)


def gated(nursery: trio.Nursery, n_batch: int, n_seq: int, calls: int) -> tuple[Embedder, Gated]:
    emb, ctx = make(nursery, n_batch=n_batch, n_seq=n_seq)
    gated_ctx = Gated(ctx.shape, calls)
    emb._backend().ctx = gated_ctx  # type: ignore[attr-defined]
    return emb, gated_ctx


async def step(ctx: Gated, i: int) -> None:
    """Let call ``i`` run, and wait until the next one has started."""
    ctx.go[i].set()
    await trio.to_thread.run_sync(ctx.started[i + 1].wait)
    await trio.testing.wait_all_tasks_blocked()


async def test_a_request_computed_in_anothers_call_answers_at_once(nursery: trio.Nursery) -> None:
    """Its wait for the turn is lifted by the call that settles its last input: it answers
    while the next call runs, not once the turn has come round to it."""
    emb, ctx = gated(nursery, n_batch=64, n_seq=1, calls=5)
    await emb.open()
    done: list[str] = []

    async def one(name: str, inputs: list[list[int]]) -> None:
        await emb.embed(inputs)
        done.append(name)

    with trio.fail_after(10):
        await _answers_at_once(ctx, one, done)
    assert [c[0][0] for c in ctx.calls] == [1, 2, 3, 4, 5] and sorted(done) == ["a", "b", "c", "d"]


async def _answers_at_once(ctx: Gated, one: Any, done: list[str]) -> None:
    async with trio.open_nursery() as n:
        n.start_soon(one, "a", [[1]])
        await trio.to_thread.run_sync(ctx.started[0].wait)
        for name, inputs in (("b", [[2], [3]]), ("c", [[4]]), ("d", [[5]])):
            n.start_soon(one, name, inputs)
            await trio.testing.wait_all_tasks_blocked()
        await step(ctx, 0)  # [1]; b leads [2], then waits for the turn behind c and d
        await step(ctx, 1)  # c leads the next call: the line's head, b's [3]
        await step(ctx, 2)  # d leads [4] (c's), held
        assert done == ["a", "b"]  # b answered while d's call runs
        ctx.go[3].set()
        ctx.go[4].set()


async def test_inputs_put_back_survive_a_request_leaving_during_the_call(nursery: trio.Nursery) -> None:
    """A text that does not fit its call goes back to the line's head after the call; a
    request cancelled while that call ran leaves the line, and the text is still there."""
    emb, ctx = gated(nursery, n_batch=8, n_seq=4, calls=4)
    await emb.open()
    served: list[Any] = []

    async def one(inputs: list[Any]) -> None:
        served.append(await emb.embed(inputs))

    with trio.fail_after(10):  # the text lost from the line: its request would spin for its turn
        await _put_back(ctx, emb, one)
    assert [[x[0] for x in call] for call in ctx.calls] == [[9], [1], [1]] and len(served) == 3
    assert not emb._line


async def _put_back(ctx: Gated, emb: Embedder, one: Any) -> None:
    async with trio.open_nursery() as n:
        n.start_soon(one, [[9]])
        await trio.to_thread.run_sync(ctx.started[0].wait)
        n.start_soon(one, ["ab c"])  # 4 tokens
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(one, ["a b c d e"])  # 7: not with the 4, back to the line after the call
        await trio.testing.wait_all_tasks_blocked()
        await step(ctx, 0)
        gone = trio.CancelScope()

        async def leaves() -> None:
            with gone:
                await emb.embed([[7]])

        n.start_soon(leaves)
        await trio.testing.wait_all_tasks_blocked()
        gone.cancel()  # leaves the line while the call runs
        await trio.testing.wait_all_tasks_blocked()
        for go in ctx.go[1:]:
            go.set()


# ---- the pump ------------------------------------------------------------------------------


async def test_the_next_call_computes_while_the_last_ones_requests_reply(nursery: trio.Nursery) -> None:
    """The pump hands the worker the next call before the requests of the call before are
    woken: a request that holds the trio thread for its reply (as writing one does) finds
    the next call already computing. When requests led calls in turn, the next one waited
    for that reply: the trio thread was the next leader's too."""
    emb, ctx = gated(nursery, n_batch=64, n_seq=1, calls=2)
    await emb.open()
    seen: list[tuple[bool, int]] = []
    replied = trio.Event()

    async def a() -> None:
        await emb.embed([[1]])
        # Its reply, on the trio thread: nothing else of trio runs meanwhile.
        seen.append((ctx.started[1].wait(5), len(ctx.calls)))
        replied.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(a)
            await trio.to_thread.run_sync(ctx.started[0].wait)
            n.start_soon(emb.embed, [[2]])
            await trio.testing.wait_all_tasks_blocked()
            ctx.go[0].set()
            await replied.wait()
            ctx.go[1].set()
    assert seen == [(True, 1)]  # the second call was running, not yet done, as [1]'s reply was written


async def test_a_call_waiting_for_the_worker_wakes_the_last_ones_requests_at_once(nursery: trio.Nursery) -> None:
    """The worker is first come, first served: a step batch that waits when a call ends runs
    before the next call, and the requests of the call that ended answer without waiting
    for it."""
    emb, ctx = gated(nursery, n_batch=64, n_seq=1, calls=2)
    await emb.open()
    step_go, step_in = threading.Event(), threading.Event()
    answered = trio.Event()

    def step_batch() -> None:
        step_in.set()
        assert step_go.wait(10)

    async def a() -> None:
        await emb.embed([[1]])
        answered.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(a)
            await trio.to_thread.run_sync(ctx.started[0].wait)
            n.start_soon(emb.embed, [[2]])
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(emb._worker.call, step_batch)  # waits behind the call running
            await trio.testing.wait_all_tasks_blocked()
            ctx.go[0].set()
            await trio.to_thread.run_sync(step_in.wait)
            await trio.testing.wait_all_tasks_blocked()
            # The step holds the worker, the next call waits behind it, and [1]'s request has answered.
            assert answered.is_set() and not ctx.started[1].is_set()
            step_go.set()
            ctx.go[1].set()
    assert [c[0][0] for c in ctx.calls] == [1, 2]


async def test_a_request_cancelled_while_its_inputs_compute_is_dropped(nursery: trio.Nursery) -> None:
    """Its inputs in the running call are computed and dropped; the one that did not fit
    that call is not put back; the line goes on with the others'."""
    emb, ctx = gated(nursery, n_batch=8, n_seq=4, calls=3)
    await emb.open()
    served: list[Any] = []
    gone = trio.CancelScope()

    async def leaves() -> None:
        with gone:
            await emb.embed(["ab c", "a b c d e"])  # 4 + 7 tokens: the second not in the first's call

    async def stays() -> None:
        served.append(await emb.embed([[5]]))

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(stays)  # [5] first, held
            await trio.to_thread.run_sync(ctx.started[0].wait)
            n.start_soon(leaves)
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(stays)
            await trio.testing.wait_all_tasks_blocked()
            await step(ctx, 0)  # the second call: "ab c" (and, untokenized, "a b c d e" and [5])
            gone.cancel()  # leaves while its inputs compute
            await trio.testing.wait_all_tasks_blocked()
            assert not emb._line  # nothing of its was left there
            ctx.go[1].set()
            await trio.to_thread.run_sync(ctx.started[2].wait)
            ctx.go[2].set()
    # "a b c d e" did not fit the second call and was not put back: the third is [5] alone.
    assert [[x[0] for x in call] for call in ctx.calls] == [[5], [1], [5]]
    assert len(served) == 2 and not emb._line


async def test_the_pump_ends_with_the_engine() -> None:
    """Stopping the engine cancels the pump: a call running then finishes and answers its
    inputs (its thread cannot be abandoned); those still in line are refused, and so is
    every request after; the pump re-raises its Cancelled (its owner's scope catches it)."""
    emb, ctx = make(None, n_batch=64, n_seq=1)
    results: dict[str, Any] = {}
    engine = trio.CancelScope()  # the engine's lifetime
    ended = trio.Event()

    async def pump() -> None:
        with engine:
            await emb.run()
        ended.set()

    async def one(name: str, inputs: list[list[int]]) -> None:
        try:
            results[name] = await emb.embed(inputs)
        except ProtocolError as exc:
            results[name] = exc

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(pump)
            await emb.open()
            ctx.gate = threading.Event()
            n.start_soon(one, "running", [[1]])
            await trio.to_thread.run_sync(ctx.entered.wait)
            n.start_soon(one, "waiting", [[2]])
            await trio.testing.wait_all_tasks_blocked()
            engine.cancel()  # the engine stops while [1] computes
            await trio.testing.wait_all_tasks_blocked()
            assert not results and not ended.is_set()  # the pump waits for its call
            ctx.gate.set()
            await ended.wait()
    assert engine.cancelled_caught
    assert [v[0] for v in results["running"].vectors] == [1]
    assert results["waiting"].status == Status.BUSY and "engine is stopped" in results["waiting"].message
    assert ctx.calls == [[[1]]] and not emb._line
    with pytest.raises(ProtocolError, match="engine is stopped"):
        await emb.embed([[3]])


async def test_the_engine_runs_and_stops_its_pump(embed_model: Path) -> None:
    """On a real engine: the pump is one of its tasks (embeddings served while it runs), and
    ``stop()`` ends ``run`` with it."""
    from conftest import test_settings  # (imported here: at the top, pytest would collect it)

    engine = await Engine.load(str(embed_model), test_settings(embed_model))
    pooling = engine.pooling
    assert pooling is not None
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(engine.run)
            pooled = await pooling.embed(["hello world", [5, 6, 7]])
            assert len(pooled.vectors) == 2 and pooled.calls == 1
            engine.stop()
    with pytest.raises(ProtocolError, match="engine is stopped"):
        await pooling.embed(["hello"])
