"""n-gram speculative decoding (engine/speculative.py): drafts from the request's own tokens,
verified in the step batch. Greedy text is the same with and without it, every limit holds
exactly, and the counters say drafts were accepted.

The live tests use tiny_model: its greedy text is a chain of the current token's successor,
so its output soon cycles and n-gram drafts get accepted; its argmax margins are wide, so
its greedy text does not depend on how many positions a batch evaluates (checked below on
many prompts; on a real model the last bits of the logits can differ between a one-token
and a multi-token batch, as with vLLM's and llama-server's speculation). Each comparison
starts both runs from an empty slot with the same prompt (the same computation shape).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import pytest
import trio

from helpers import assert_server_healthy, http, parse_sse, scrape, stream_then_hang_up
from hydra_trio.config import settings_from
from hydra_trio.engine.params import parse_generation, parse_speculative
from hydra_trio.engine.speculative import (
    BACKOFF_STEPS,
    NgramIndex,
    SpecConfig,
    SpecCounts,
    SpecRequest,
    Speculation,
    StepCost,
    spec_config,
    verify,
)
from hydra_trio.wire.errors import ParamError

PROMPTS = [
    "the quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n",
    "hello world",
    "one two three four five six seven eight nine ten " * 3,
]
OFF = {"type": "none"}
ON = {"type": "ngram-simple"}


# ---- the drafter, the accept rule, the config rule (no model) -----------------------------


def test_ngram_lookup_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    ix = NgramIndex(1, 3)
    history = [1, 2, 3, 4, 5, 1, 2]
    assert ix.draft(history, 3, 4) == [4, 5, 1, 2]  # "1 2 3" occurred at 0..2: what followed it
    assert ix.draft(history, 3, 2) == [4, 5]  # capped
    history += [3, 4, 9, 1, 2]
    # "1 2 3" now occurred twice: the latest (7..9 is "3 4 9"; 5..7 is "1 2 3") wins.
    assert ix.draft(history, 3, 3) == [4, 9, 1]
    assert NgramIndex(1, 3).draft([7, 8], 9, 3) == []  # 9 never occurred
    # The longest n that occurred wins over a shorter, more recent one.
    assert NgramIndex(1, 2).draft([5, 6, 7, 0, 6, 8], 6, 2) == [8, 6]  # "8 6" never occurred; "6" did, at 4
    assert NgramIndex(1, 2).draft([5, 6, 7, 0, 6, 8, 5], 6, 2) == [7, 0]  # "5 6" at 0..1 beats "6" at 4
    # The continuation runs into the current token when the match ends the history.
    assert NgramIndex(1, 1).draft([4, 4], 4, 5) == [4]


def test_ngram_index_is_incremental_and_starts_over_on_a_cut() -> None:
    ix = NgramIndex(2, 2)
    h = [1, 2, 3]
    assert ix.draft(h, 1, 4) == []
    h += [1]  # the step accepted 1; "1 2" is now known to be followed by 3
    assert ix.draft(h, 2, 4) == [3, 1, 2]
    assert ix.draft([9, 9], 1, 4) == []  # a shorter history: rebuilt, nothing of the old one


def test_the_accept_rule_keeps_the_matching_prefix_and_one_pick_more() -> None:
    picked: list[int] = []

    def picks(seq: list[int]) -> Callable[[int], int]:
        picked.clear()

        def pick(j: int) -> int:
            picked.append(j)
            return seq[j]

        return pick

    never_eog: Callable[[int], bool] = lambda t: False  # noqa: E731
    assert verify([5, 6, 7], picks([5, 6, 7, 8]), never_eog) == [5, 6, 7, 8]  # all + the bonus
    assert verify([5, 6, 7], picks([5, 9, 7, 8]), never_eog) == [5, 9]  # stops at the mismatch
    assert picked == [0, 1]  # position 2 was never sampled (its grammar and RNG untouched)
    assert verify([5, 6], picks([4, 6, 7]), never_eog) == [4]
    assert verify([], picks([3]), never_eog) == [3]  # no draft: a plain step
    assert verify([5, 0, 7], picks([5, 0, 7, 8]), lambda t: t == 0) == [5, 0]  # nothing after an end


def test_backoff_after_drafts_that_miss_and_the_batch_rule() -> None:
    totals = SpecCounts()
    spec = Speculation(SpecConfig(n_max=4, max_batch=2), totals)
    history = [1, 2, 3, 1, 2, 3, 1, 2]
    assert spec.propose(history, 3, 4, n_generating=3) == []  # more streams than max_batch
    assert spec.propose(history, 3, 4, n_generating=2) == [1, 2, 3]  # after "1 2 3" at 3..5, up to now
    spec.record(3, 0)  # acceptance 0.7 (moving average from 1.0): still drafting
    assert spec.propose(history, 3, 4, n_generating=1) == [1]  # after a miss: one token
    spec.record(1, 1)
    assert spec.propose(history, 3, 4, n_generating=1) == [1, 2, 3]  # 2m + 1 after m accepted
    spec.record(3, 0)  # acceptance below MIN_ACCEPTANCE: a pause of BACKOFF_STEPS steps
    for _ in range(BACKOFF_STEPS):
        assert spec.propose(history, 3, 4, n_generating=1) == []
    assert spec.propose(history, 3, 4, n_generating=1) == [1]  # then a one-token probe
    spec.record(1, 0)  # still low: twice as long a pause
    assert [spec.propose(history, 3, 4, n_generating=1) for _ in range(2 * BACKOFF_STEPS + 1)][-1] == [1]
    assert (totals.drafts, totals.draft_tokens, totals.accepted) == (4, 8, 1)
    assert Speculation(SpecConfig(n_max=4, n_min=3)).propose([1, 2, 1], 2, 4, 1) == []  # [1, 2] is short of n_min
    assert Speculation(SpecConfig(n_max=4)).propose(history, 3, 0, 1) == []  # no room


def test_the_step_cost_is_measured_per_size_and_a_draft_grows_to_a_size_that_can_pay() -> None:
    cost = StepCost()
    assert cost.shortest_paying(1, 16, 1) == 1  # unmeasured: as asked
    # Gemma 3 270M on one thread of a 2-core VM (docs/performance.md; 5, 7, 10, 11, 13-15 not
    # run): the kernels take rows in blocks, so 4 rows cost less than 3.
    for rows, ms in {1: 39, 2: 94, 3: 158, 4: 127, 6: 131, 8: 182, 9: 244, 12: 221, 16: 304}.items():
        cost.add(rows, ms / 1000)
    assert cost.estimate(5) == cost.estimate(4) and cost.estimate(40) == cost.estimate(16)  # unseen: as the size below
    assert cost.estimate(0) is None
    # One stream: 1 and 2 draft tokens cannot pay even if accepted (2 tokens in 94 ms, 3 in 158,
    # against 1 in 39); 3 can (4 in 127).
    assert cost.shortest_paying(1, 16, 1) == 3
    assert cost.shortest_paying(7, 16, 1) == 7
    assert cost.shortest_paying(1, 2, 1) == 0
    # Four streams in 127 ms: 5 rows, unseen, are taken to cost as 4 (the first run tells);
    # measured at 207 ms, one more row cannot pay, two (131 ms for at most 6 tokens) can.
    assert cost.shortest_paying(1, 16, 4) == 1
    cost.add(5, 0.207)
    assert cost.shortest_paying(1, 16, 4) == 2
    cost.add(4, 0.500)  # measured again, slower: its mean moves (by WEIGHT)
    assert cost.estimate(4) == pytest.approx(0.127 + StepCost.WEIGHT * (0.500 - 0.127))


def test_a_request_drafts_only_what_can_pay_at_the_measured_cost() -> None:
    history = list(range(20)) * 2
    asked: list[tuple[int, int]] = []

    def grow_to(k: int) -> Callable[[int, int], int]:
        return lambda n, cap: asked.append((n, cap)) or (max(n, k) if k else 0)

    spec = Speculation(SpecConfig(n_max=16))
    assert len(spec.propose(history[:-1], history[-1], 16, 1, grow_to(3))) == 16  # no draft yet: up to n_max
    spec.record(16, 0)  # a miss: 2m + 1 = 1 next, which grows to what can pay
    assert len(spec.propose(history[:-1], history[-1], 16, 1, grow_to(3))) == 3 and asked[-2] == (1, 16)
    assert spec.propose(history[:-1], history[-1], 16, 1, grow_to(0)) == []  # nothing can pay: no draft
    # A lookup shorter than asked, too short to pay, is not made.
    short = Speculation(SpecConfig(n_max=16))
    assert short.propose([7, 8, 9, 7], 8, 16, 1, lambda n, cap: n if cap >= 4 else 0) == []


def test_the_request_keys_beat_the_servers_and_a_model_that_cannot_roll_back_never_drafts() -> None:
    base: dict[str, Any] = {"n_max": 16, "n_min": 0, "ngram_max": 3, "ngram_min": 1, "max_batch": 4}
    assert spec_config(server_type="none", request=None, can_roll_back=True, **base) is None
    on = spec_config(server_type="none", request=SpecRequest("ngram-simple", 5, 2), can_roll_back=True, **base)
    assert on is not None and (on.n_max, on.n_min) == (5, 2)
    assert spec_config(server_type="ngram", request=SpecRequest(type="none"), can_roll_back=True, **base) is None
    assert spec_config(server_type="ngram-simple", request=None, can_roll_back=False, **base) is None
    assert spec_config(server_type="ngram-simple", request=SpecRequest(n_max=0), can_roll_back=True, **base) is None


def test_request_keys_are_parsed_in_one_place() -> None:
    assert parse_speculative({}) is None
    assert parse_speculative({"speculative": {"type": "none"}}) == SpecRequest(type="none")
    assert parse_speculative({"speculative.n_max": 4, "speculative.n_min": 1}) == SpecRequest(None, 4, 1)
    assert parse_speculative({"speculative": {"draft_n_max": 3}, "speculative.n_max": 9}) == SpecRequest(None, 3, None)
    for bad in ({"speculative": 3}, {"speculative": {"type": "eagle"}}, {"speculative": {"n_max": -1}},
                {"speculative.n_max": "4"}, {"speculative": {"size": 2}}):
        with pytest.raises(ParamError):
            parse_speculative(bad)
    params = parse_generation({"speculative": ON, "max_tokens": 4}, default_n_predict=8, n_ctx=64)
    assert params.speculative == SpecRequest(type="ngram-simple")


def test_bad_flag_values_stop_the_start_with_their_reason() -> None:
    for bad, said in (
        ({"spec_type": "eagle"}, "spec_type must be one of none, ngram-simple, ngram"),
        ({"spec_draft_n_max": 0}, "spec_draft_n_max must be 1..256"),
        ({"spec_draft_n_min": 9, "spec_draft_n_max": 4}, r"spec_draft_n_min \(9\) must not exceed"),
        ({"spec_ngram_size_n": 0}, "spec_ngram_size_n must be 1..64"),
        ({"spec_ngram_min_n": 4}, r"spec_ngram_min_n \(4\) must not exceed spec_ngram_size_n \(3\)"),
    ):
        with pytest.raises(SystemExit, match=said):
            settings_from(None, env={}, **bad)
    assert settings_from(None, env={"HYDRA_SPEC_TYPE": "ngram"}).spec_type == "ngram"


def test_bad_flag_values_exit_non_zero() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for argv, said in (
        (["--spec-type", "eagle"], "--spec-type: invalid choice"),
        (["--spec-draft-n-max", "0"], "spec_draft_n_max must be 1..256"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "hydra_trio.cli", "serve", *argv], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode != 0 and said in proc.stderr, proc.stderr


async def test_a_model_whose_kv_cannot_roll_back_refuses_spec_type(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hydra_trio.engine.engine import Engine
    from hydra_trio.engine.llama import context

    monkeypatch.setattr(context.llama_cpp, "llama_model_is_hybrid", lambda _m: True)
    settings = settings_from(None, env={}, model=str(tiny_model), slots=1, ctx_size=256, threads=1, spec_type="ngram-simple")
    with pytest.raises(SystemExit, match="hybrid model, whose KV cannot drop rejected draft positions"):
        await Engine.load(str(tiny_model), settings)


# ---- live: the same text, the limits, the counters ----------------------------------------


async def _complete(h: httpx.AsyncClient, ep: Any, prompt: str, spec: dict[str, Any], slot_empty: bool = True, **body: Any) -> dict[str, Any]:
    """A greedy completion in slot 0, started from an empty slot (the same shape each time)."""
    if slot_empty:
        await ep.state.engine.clear_slot(0)
    r = await h.post(
        "/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 48, "speculative": spec, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()


def _text(body: dict[str, Any]) -> str:
    return body["choices"][0]["text"]


def kv_positions(engine: Any, slot: int) -> int:
    return int(llama_cpp.llama_memory_seq_pos_max(engine.backend._mem, slot)) + 1


async def test_greedy_text_is_the_same_and_drafts_were_accepted(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, slots=1, spec_type="ngram-simple")
    engine = ep.state.engine
    async with http(ep) as h:
        before = await scrape(h)
        for prompt in PROMPTS:
            for n in (48, 200):
                plain = await _complete(h, ep, prompt, OFF, max_tokens=n)
                spec_run = await _complete(h, ep, prompt, ON, max_tokens=n)
                assert _text(spec_run) == _text(plain), prompt
                assert spec_run["usage"] == plain["usage"]
                assert spec_run["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
                # The slot holds exactly the prompt and every token but the last (rejected
                # positions are gone from the KV and from the history).
                usage = spec_run["usage"]
                assert engine.n_past(0) == kv_positions(engine, 0) == usage["prompt_tokens"] + usage["completion_tokens"] - 1
        after = await scrape(h)

    def grew(name: str) -> float:
        key = (name, (("engine", "0"), ("model_name", engine.identity.model_alias)))
        return after[key] - before.get(key, 0.0)

    drafts = grew("vllm:spec_decode_num_drafts_total")
    drafted = grew("vllm:spec_decode_num_draft_tokens_total")
    accepted = grew("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts >= len(PROMPTS) and drafted >= drafts and 0 < accepted <= drafted
    print("drafts", drafts, "drafted", drafted, "accepted", accepted)
    # Steps of several sizes ran (with and without drafts), each measured.
    by_rows = {int(dict(labels)["rows"]): v for (name, labels), v in after.items() if name == "hydra_step_decode_seconds"}
    assert 1 in by_rows and len(by_rows) > 1 and all(0 < v < 60 for v in by_rows.values())


async def test_steps_are_saved_and_the_request_line_says_so(
    start_engine: Callable[..., Any], tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ep = await start_engine(tiny_model, slots=1)  # off by default; the request turns it on
    batcher = ep.state.engine.batcher
    async with http(ep) as h:
        batches = batcher.batches
        plain = await _complete(h, ep, PROMPTS[0], {}, max_tokens=100)
        plain_batches = batcher.batches - batches
        batches = batcher.batches
        with caplog.at_level("INFO", logger="hydra_trio"):
            spec_run = await _complete(h, ep, PROMPTS[0], ON, max_tokens=100)
        spec_batches = batcher.batches - batches
    assert _text(spec_run) == _text(plain)
    assert plain_batches == 99  # one step per token after the first
    assert spec_batches < plain_batches / 2
    lines = [r for r in caplog.records if getattr(r, "request", None) and r.request["route"] == "completions"]
    assert lines and lines[-1].request["spec_accepted"] > 0
    assert lines[-1].request["spec_drafted"] >= lines[-1].request["spec_accepted"]
    assert "drafted tokens accepted" in lines[-1].getMessage()
    assert all(r.request["spec_drafted"] is None for r in lines[:-1])  # the plain run: no speculation


async def test_max_tokens_and_stop_strings_are_exact(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, slots=1, spec_type="ngram-simple")
    async with http(ep) as h:
        full = _text(await _complete(h, ep, PROMPTS[0], OFF, max_tokens=120))
        for n in (1, 2, 3, 7, 16, 17, 33, 64):
            plain = await _complete(h, ep, PROMPTS[0], OFF, max_tokens=n)
            spec_run = await _complete(h, ep, PROMPTS[0], ON, max_tokens=n)
            assert spec_run["usage"]["completion_tokens"] == n
            assert _text(spec_run) == _text(plain) and full.startswith(_text(spec_run))
        # A long stop string (its first occurrence ends far into the text, where drafts are
        # accepted): cut exactly where it starts, the steps that ran past it dropped.
        stop = full[30:75]
        cut = full.index(stop)
        counts = ep.state.engine.spec_counts
        for spec in (OFF, ON):
            accepted = counts.accepted
            body = await _complete(h, ep, PROMPTS[0], spec, max_tokens=120, stop=[stop])
            assert _text(body) == full[:cut] and body["choices"][0]["finish_reason"] == "stop"
            assert (counts.accepted > accepted) == (spec is ON)
        # ignore_eos and min_tokens: the same as without.
        a = await _complete(h, ep, PROMPTS[1], OFF, max_tokens=40, ignore_eos=True, min_tokens=30)
        b = await _complete(h, ep, PROMPTS[1], ON, max_tokens=40, ignore_eos=True, min_tokens=30)
        assert _text(a) == _text(b) and b["usage"]["completion_tokens"] == 40


async def test_streaming_chunks_logprobs_and_seeded_sampling_are_as_without(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model, slots=1, spec_type="ngram-simple")
    async with http(ep) as h:

        async def chunks(spec: dict[str, Any], interval: int) -> list[str]:
            await ep.state.engine.clear_slot(0)
            body = {"prompt": PROMPTS[0], "temperature": 0, "max_tokens": 60, "speculative": spec,
                    "stream": True, "stream_interval": interval}
            async with h.stream("POST", "/v1/completions", json=body) as r:
                events, done = parse_sse([line async for line in r.aiter_lines()])
            assert done
            return [e["choices"][0]["text"] for e in events if e.get("choices") and e["choices"][0].get("text")]

        for interval in (1, 5):
            plain, spec_run = await chunks(OFF, interval), await chunks(ON, interval)
            assert spec_run == plain  # the same chunks: stream_interval counts tokens as without
        a = await _complete(h, ep, PROMPTS[0], OFF, max_tokens=40, logprobs=3)
        b = await _complete(h, ep, PROMPTS[0], ON, max_tokens=40, logprobs=3)
        la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
        assert la["tokens"] == lb["tokens"] and len(lb["token_logprobs"]) == 40
        assert lb["token_logprobs"] == pytest.approx(la["token_logprobs"], abs=1e-3)
        # Sampling: a pick per kept position only, so the seeded RNG draws as without.
        for seed in (1, 2, 3):
            kw = {"temperature": 0.8, "seed": seed, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 60}
            x = await _complete(h, ep, PROMPTS[3], OFF, **kw)
            y = await _complete(h, ep, PROMPTS[3], ON, **kw)
            assert _text(x) == _text(y)


async def test_grammar_constrained_output_is_the_same(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, slots=1, spec_type="ngram-simple")
    grammar = 'root ::= ("ab" | "c" | " ")+'
    async with http(ep) as h:
        a = await _complete(h, ep, "abab c ab ab c " * 4, OFF, max_tokens=40, grammar=grammar)
        b = await _complete(h, ep, "abab c ab ab c " * 4, ON, max_tokens=40, grammar=grammar)
    assert _text(a) == _text(b) and set(_text(b)) <= set("abc ")


async def test_concurrent_streams_with_speculation_match_each_alone_without(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model, slots=4, ctx_size=4096, spec_type="ngram-simple", spec_max_batch=4)
    engine = ep.state.engine
    async with http(ep) as h:
        alone: list[str] = []
        for prompt in PROMPTS:
            for s in range(4):
                await engine.clear_slot(s)
            r = await h.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 64, "speculative": OFF})
            alone.append(_text(r.json()))
        for s in range(4):
            await engine.clear_slot(s)
        accepted = engine.spec_counts.accepted
        got: dict[int, str] = {}

        async def one(i: int) -> None:
            r = await h.post("/v1/completions", json={"prompt": PROMPTS[i], "temperature": 0, "max_tokens": 64})
            got[i] = _text(r.json())

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
    assert [got[i] for i in range(len(PROMPTS))] == alone
    assert engine.spec_counts.accepted > accepted


async def test_no_drafts_in_a_batch_larger_than_spec_max_batch(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, slots=4, spec_type="ngram-simple", spec_max_batch=1)
    engine = ep.state.engine
    gate = trio.Event()
    async with http(ep) as h:

        async def one(i: int) -> None:
            await gate.wait()
            await h.post("/v1/completions", json={"prompt": PROMPTS[i], "temperature": 0, "max_tokens": 64, "ignore_eos": True})

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
            gate.set()
        together = engine.spec_counts.drafts
        await _complete(h, ep, PROMPTS[0], ON, max_tokens=64)
    assert engine.spec_counts.drafts > together  # alone it drafts


async def test_a_cancelled_stream_leaves_the_engine_healthy(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, slots=1, spec_type="ngram-simple")
    engine = ep.state.engine
    async with http(ep) as h:
        reference = await _complete(h, ep, PROMPTS[0], ON, max_tokens=200)
        await engine.clear_slot(0)
        body = {"prompt": PROMPTS[0], "temperature": 0, "max_tokens": 200}
        await stream_then_hang_up(h, "/v1/completions", body, after=5)
        await assert_server_healthy(ep)
        # The slot's KV and its token list agree, whatever step the cancel met.
        assert engine.n_past(0) == kv_positions(engine, 0)
        again = await _complete(h, ep, PROMPTS[0], ON, max_tokens=200)
    assert _text(again) == _text(reference)


async def test_a_decode_speculates_and_gives_the_chat_text(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    """DECODE (RPC) goes through the same generation loop: its drafts are verified the same
    way, and its text is the chat completion's without speculation."""
    from helpers import MESSAGES, decode_ok, frame, get_result, rpc, text_of

    ep = await start_engine(tiny_model, slots=1, spec_type="ngram-simple")
    engine = ep.state.engine
    async with http(ep) as h:
        await engine.clear_slot(0)
        r = await h.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 80, "temperature": 0, "speculative": OFF})
        plain = r.json()
        await engine.clear_slot(0)
        accepted = engine.spec_counts.accepted
        async with await rpc(ep) as c:
            rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=80))
        body = await get_result(h, rid)
    assert text_of(body) == text_of(plain) and body["usage"]["completion_tokens"] == 80
    assert engine.spec_counts.accepted > accepted
