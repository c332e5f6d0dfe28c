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

import random
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
from hydra_trio.engine.speculation import (
    DraftPlanner,
    NgramMemories,
    NgramMemory,
    SpecConfig,
    SpecCounts,
    SpecRequest,
    Speculation,
    spec_config,
)
from hydra_trio.engine.speculation.drafter import MEMORY_KIND, PRIOR_SURVIVAL, NgramIndex
from hydra_trio.engine.speculation.policy import plan_drafts, verify
from hydra_trio.engine.speculation.stepcost import BatchCost, StepCost, batch_counts, ubatch_rows
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


def test_ngram_lookup_takes_the_occurrence_whose_context_matches_furthest_back() -> None:
    ix = NgramIndex(1, 12)
    history = [1, 2, 3, 4, 5, 1, 2]
    assert ix.draft(history, 3, 4) == ([4, 5, 1, 2], 3)  # "1 2 3" at 0..2: what followed it
    assert ix.draft(history, 3, 2) == ([4, 5], 3)  # capped
    history += [3, 4, 9, 1, 2]
    # "1 2 3" occurred twice, both with 3 tokens of matching context: the latest wins.
    assert ix.draft(history, 3, 3) == ([4, 9, 1], 3)
    # "0 0 7 2 3" matches 5 tokens back at 7..11, only "2 3" (2) at the later 19..20.
    h = [0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 2, 3, 8, 8, 0, 0, 0, 0, 0, 2, 3, 6, 6, 0, 0, 7, 2]
    # compared over 2 at most
    assert NgramIndex(1, 12).draft(h, 3, 2) == ([8, 8], 5) and NgramIndex(1, 2).draft(h, 3, 2) == ([6, 6], 2)
    assert NgramIndex(1, 12).draft([5, 6], 7, 4) == ([], 0)  # never occurred
    # A match that runs into the present repeats itself: a cycle is drafted on.
    assert NgramIndex(2, 12).draft([9, 5, 6, 9], 5, 5) == ([6, 9, 5, 6, 9], 2)


def test_ngram_index_is_incremental_and_starts_over_on_a_cut() -> None:
    ix = NgramIndex(1, 3)
    history = [5, 6, 7]
    assert ix.draft(history, 5, 2) == ([6, 7], 1)
    history += [5, 6]
    assert ix.draft(history, 7, 2) == ([5, 6], 3)  # the new tokens were indexed
    assert ix.draft([8, 9], 8, 2) == ([9, 8], 1)  # a shorter history: the index starts over


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


def test_a_candidates_chance_is_learned_per_match_length_from_runs_cut_by_their_first_miss() -> None:
    totals = SpecCounts()
    spec = Speculation(SpecConfig(n_max=4), totals)
    history = [1, 2, 3, 1, 2, 3, 1, 2]
    draft, p = spec.candidate(history, 3, 8)
    assert draft == [1, 2, 3, 1] and p == pytest.approx(PRIOR_SURVIVAL[2])  # n_max; 5 tokens matched: the 4-7 prior
    assert spec.candidate(history, 3, 2)[0] == [1, 2]  # the room caps it
    spec.record(4, 1)  # 2 positions tried, 1 failed
    _, p1 = spec.candidate(history, 3, 8)
    assert p1 < PRIOR_SURVIVAL[2]
    spec.record(4, 4)  # 4 tried, none failed: the chance rises again
    _, p2 = spec.candidate(history, 3, 8)
    assert p1 < p2
    # A one-token match is its own kind: its prior, untouched by the drafts above.
    draft, p = spec.candidate([9, 4, 6], 4, 8)
    assert draft == [6, 4, 6, 4] and p == pytest.approx(PRIOR_SURVIVAL[0])
    assert (totals.drafts, totals.draft_tokens, totals.accepted) == (2, 8, 5)
    assert Speculation(SpecConfig(n_max=4, n_min=3)).candidate(history, 3, 2) == ([], 0.0)  # room short of n_min
    assert Speculation(SpecConfig(n_max=4)).candidate([5, 6], 7, 4) == ([], 0.0)  # nothing matched


def test_a_request_drafts_what_an_earlier_request_of_its_salt_generated() -> None:
    memories = NgramMemories(3)
    earlier = Speculation(SpecConfig(n_max=4, ngram_max=3), memory=memories.for_salt(None))
    reply = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    for k in range(4, len(reply)):  # the earlier request generates, step by step
        earlier.candidate(reply[:k], reply[k], 4)
    # A new request with the same start: its own tokens match nothing yet, the memory does.
    again = Speculation(SpecConfig(n_max=4, ngram_max=3), memory=memories.for_salt(None))
    draft, p = again.candidate([1, 2], 3, 4)
    assert draft == [4, 5, 6, 7] and p == pytest.approx(PRIOR_SURVIVAL[MEMORY_KIND])
    other = Speculation(SpecConfig(n_max=4, ngram_max=3), memory=memories.for_salt("tenant-b"))
    assert other.candidate([1, 2], 3, 4) == ([], 0.0)  # another salt: nothing of the first's
    # Its own full-length match wins over the memory.
    own = Speculation(SpecConfig(n_max=2, ngram_max=3), memory=memories.for_salt(None))
    assert own.candidate([7, 1, 2, 3, 9, 9, 7, 1, 2], 3, 2)[0] == [9, 9]


def test_the_memory_is_bounded() -> None:
    memory = NgramMemory(2)
    memory.MAX_ENTRIES = 10
    memory.add(list(range(8)), 0)
    assert len(memory) == 6 and memory.draft([3, 4], 3) == [5, 6, 7]
    memory.add(list(range(100, 108)), 0)  # would pass the bound: it starts over
    assert len(memory) == 6 and memory.draft([3, 4], 3) == []
    memories = NgramMemories(2)
    first = memories.for_salt("a")
    for salt in range(NgramMemories.MAX_SALTS):
        memories.for_salt(str(salt))
    assert memories.for_salt("a") is not first  # the least recently used salt was forgotten


def test_a_batch_splits_into_passes_as_llama_cpp_splits_it() -> None:
    # A split KV cache: equal tokens from a run of consecutive sequences per pass (measured on
    # Gemma 3 270M: [9, 1 x 7] cost 212 ms against 109 for [1 x 8], docs/performance.md).
    assert ubatch_rows([1] * 8, 512, split=True) == [8]
    assert ubatch_rows([9] + [1] * 7, 512, split=True) == [8, 8]
    assert ubatch_rows([9, 9, 9, 9, 1, 1, 1, 1], 512, split=True) == [8, 32]
    assert ubatch_rows([9, 1, 9, 1, 9, 1, 9, 1], 512, split=True) == [8, 8, 8, 8, 8]
    assert ubatch_rows([3, 0, 3], 512, split=True) == [3, 3]  # a gap between slots splits
    assert ubatch_rows([5] * 8, 16, split=True) == [16, 16, 8]  # at most n_ubatch rows a pass
    assert ubatch_rows([9, 1, 9], 512, split=False) == [19]  # a unified cache: one pass
    assert batch_counts([2, 3, 5], [1, 4, 2]) == [1, 4, 0, 2]


@pytest.mark.parametrize("split", [True, False], ids=["split", "unified"])
def test_a_step_of_single_rows_is_measured_as_its_counts_would_be(split: bool) -> None:
    """``measured_singles`` (a step without drafts, measured in constant time) counts a
    decode into the same pass size as ``measured`` over the step's counts, or drops it alike
    (a gap between slots under a split cache, more rows than a ubatch)."""
    rng = random.Random(7)
    by_counts, by_singles = DraftPlanner(6, split=split), DraftPlanner(6, split=split)
    cases = [[0, 1, 2], [3], [0, 2], list(range(6)), list(range(7)), [4, 5, 6, 7]]
    cases += [sorted(rng.sample(range(12), rng.randint(1, 9))) for _ in range(200)]
    for k, slots in enumerate(cases):
        seconds = 0.001 * (k % 13 + 1)
        by_counts.measured(slots, [1] * len(slots), seconds)
        by_singles.measured_singles(slots[0], slots[-1], len(slots), seconds)
        assert by_singles.step_cost.measured() == by_counts.step_cost.measured(), slots
    assert by_counts.step_cost.steps == by_singles.step_cost.steps > 20
    assert (3 in by_counts.step_cost.measured()) is True
    assert (7 in by_counts.step_cost.measured()) is False  # past a ubatch: never one pass


# Gemma 3 270M Q4_K_M, one thread, an Intel Xeon 2-core VM: ms of a pass by rows
# (docs/performance.md): rows in blocks of 4 and 8 are cheap.
GEMMA_MS = {1: 44, 2: 64, 3: 73, 4: 85, 5: 130, 6: 135, 7: 146, 8: 134, 9: 173, 10: 168, 11: 195, 12: 172, 13: 227,
            14: 239, 15: 248, 16: 227, 17: 261, 18: 266, 19: 254, 20: 269, 21: 301, 22: 326, 23: 335, 24: 276, 25: 314,
            26: 318, 27: 329, 28: 331, 29: 405, 30: 379, 31: 421, 32: 402, 33: 401, 40: 472, 48: 583, 64: 738,
            96: 994, 128: 1437, 192: 2274, 256: 2832}


def gemma_cost() -> StepCost:
    cost = StepCost()
    for rows, ms in GEMMA_MS.items():
        cost.add(rows, ms / 1000 * 1.5)  # a size's first decode also sizes llama.cpp's buffers: held back
        cost.add(rows, ms / 1000)
    return cost


def test_the_step_cost_is_measured_per_size() -> None:
    cost = gemma_cost()
    assert cost.estimate(36) == pytest.approx(0.401 + (0.472 - 0.401) * 3 / 7)  # unseen: between its neighbours
    assert cost.estimate(500) == cost.estimate(256)  # up to twice the largest: as the largest (the plan goes to see)
    assert cost.estimate(1024) == pytest.approx(2 * 2.832)  # and in proportion past that
    assert cost.estimate(0) is None and StepCost().estimate(4) is None
    cost.add(4, 0.500)  # measured again, slower: its mean moves (by WEIGHT)
    assert cost.estimate(4) == pytest.approx(0.085 + StepCost.WEIGHT * (0.500 - 0.085))
    assert cost.estimate(5) == pytest.approx(0.130)
    cost.add(36, 0.1)
    assert 36 not in cost.measured() and cost.estimate(36) == pytest.approx(0.401 + (0.472 - 0.401) * 3 / 7)
    cost.add(36, 0.2)  # its second decode: the lower of the two starts its mean
    assert cost.estimate(37) == pytest.approx(0.1 + (0.472 - 0.1) / 4)  # the new neighbour


def test_the_plan_drafts_what_makes_the_most_tokens_per_second() -> None:
    one = BatchCost(gemma_cost(), 512, split=True)
    # One stream, a draft of 31 that is surely right: the size with the most tokens per
    # second if accepted (24 rows: 24 tokens in 276 ms), not the longest.
    assert plan_drafts([0], [(31, 1.0, 0)], one, 511) == [23]
    # Likely right: short (2 draft tokens, 3 rows: 2.19 tokens expected in 73 ms).
    assert plan_drafts([0], [(31, 0.7, 0)], one, 511) == [2]
    assert plan_drafts([0], [(31, 0.4, 0)], one, 511) == [0]  # unlikely: no position pays
    assert plan_drafts([0], [(31, 1.0, 0)], one, 7) == [7]  # the batch's room
    assert plan_drafts([0], [(2, 1.0, 3)], one, 511) == [0]  # shorter than its n_min
    # Eight streams: the same length for each (one pass), less than alone.
    alone = plan_drafts([0], [(31, 0.95, 0)], one, 511)
    eight = plan_drafts(list(range(8)), [(31, 0.95, 0)] * 8, one, 504)
    assert len(set(eight)) == 1 and 0 < eight[0] < alone[0]
    # Streams in slots 0 and 2 with a gap: each draft is a pass of its own.
    assert plan_drafts([0, 2], [(31, 1.0, 0), (0, 0.0, 0)], one, 510) == [23, 0]
    # The step without drafts not measured yet: measured first; then the sizes up to twice
    # the largest measured are taken to cost as much (so the plan grows them by doublings).
    fresh = StepCost()
    assert plan_drafts([0], [(31, 0.95, 0)], BatchCost(fresh, 512, split=True), 511) == [0]
    fresh.add(1, 0.044)
    fresh.add(1, 0.044)
    assert plan_drafts([0], [(31, 0.95, 0)], BatchCost(fresh, 512, split=True), 511) == [1]
    fresh.add(2, 0.064)
    fresh.add(2, 0.064)
    assert plan_drafts([0], [(31, 0.95, 0)], BatchCost(fresh, 512, split=True), 511) == [3]


def test_the_request_keys_beat_the_servers_and_a_model_that_cannot_roll_back_never_drafts() -> None:
    base: dict[str, Any] = {"n_max": 16, "n_min": 0, "ngram_max": 12, "ngram_min": 1, "max_batch": 4}
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
        ({"spec_ngram_min_n": 13}, r"spec_ngram_min_n \(13\) must not exceed spec_ngram_size_n \(12\)"),
    ):
        with pytest.raises(SystemExit, match=said):
            settings_from(None, env={}, **bad)
    assert settings_from(None, env={"HYDRA_SPEC_TYPE": "ngram"}).spec_type == "ngram"


@pytest.mark.slow  # starts the CLI twice
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
            [sys.executable, "-m", "hydra_trio.cli", "serve", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode != 0 and said in proc.stderr, proc.stderr


async def test_a_model_whose_kv_cannot_roll_back_refuses_spec_type(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hydra_trio.engine import Engine
    from hydra_trio.engine.llama import context

    monkeypatch.setattr(context.llama_cpp, "llama_model_is_hybrid", lambda _m: True)
    settings = settings_from(
        None, env={}, model=str(tiny_model), slots=1, ctx_size=256, threads=1, spec_type="ngram-simple"
    )
    with pytest.raises(SystemExit, match="hybrid model, whose KV cannot drop rejected draft positions"):
        await Engine.load(str(tiny_model), settings)


# ---- live: the same text, the limits, the counters ----------------------------------------


class PinnedCost(StepCost):
    """The draft plan's costs fixed at GEMMA_MS, so that drafts of likely runs pay whatever
    this machine's load (on the tiny model a decode is a fraction of a millisecond, and its
    measured cost is mostly noise); the engine's own measurements still go where /metrics
    reads them."""

    def __init__(self) -> None:
        super().__init__()
        self._table = gemma_cost()

    def estimate(self, rows: int) -> float | None:
        return self._table.estimate(rows)


async def pinned(start_engine: Callable[..., Any], model: Path, **settings: Any) -> Any:
    """An engine whose draft plan prices steps with ``PinnedCost``."""
    ep = await start_engine(model, **settings)
    backend = ep.state.engine._core.backend
    backend.planner = DraftPlanner(backend.n_batch, split=not backend.kv_unified, step_cost=PinnedCost())
    return ep


async def _complete(
    h: httpx.AsyncClient, ep: Any, prompt: str, spec: dict[str, Any], slot_empty: bool = True, **body: Any
) -> dict[str, Any]:
    """A greedy completion in slot 0, started from an empty slot (the same shape each time)."""
    if slot_empty:
        await ep.state.engine._core.clear_slot(0)
    r = await h.post(
        "/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 48, "speculative": spec, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()


def _text(body: dict[str, Any]) -> str:
    return body["choices"][0]["text"]


def kv_positions(engine: Any, slot: int) -> int:
    return int(llama_cpp.llama_memory_seq_pos_max(engine._core.backend._mem, slot)) + 1


async def test_greedy_text_is_the_same_and_drafts_were_accepted(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await pinned(start_engine, tiny_model, slots=1, spec_type="ngram-simple")
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
                assert (
                    engine._core.n_past(0)
                    == kv_positions(engine, 0)
                    == usage["prompt_tokens"] + usage["completion_tokens"] - 1
                )
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
    by_rows = {
        int(dict(labels)["rows"]): v for (name, labels), v in after.items() if name == "hydra_step_decode_seconds"
    }
    assert 1 in by_rows and len(by_rows) > 1 and all(0 < v < 60 for v in by_rows.values())


async def test_steps_are_saved_and_the_request_line_says_so(
    start_engine: Callable[..., Any], tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ep = await pinned(start_engine, tiny_model, slots=1)  # off by default; the request turns it on
    batcher = ep.state.engine._core.batcher
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
    ep = await pinned(start_engine, tiny_model, slots=1, spec_type="ngram-simple")
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
        counts = ep.state.engine._core.spec_counts
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
    ep = await pinned(start_engine, tiny_model, slots=1, spec_type="ngram-simple")
    async with http(ep) as h:

        async def chunks(spec: dict[str, Any], interval: int) -> list[str]:
            await ep.state.engine._core.clear_slot(0)
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
    ep = await pinned(start_engine, tiny_model, slots=1, spec_type="ngram-simple")
    grammar = 'root ::= ("ab" | "c" | " ")+'
    async with http(ep) as h:
        a = await _complete(h, ep, "abab c ab ab c " * 4, OFF, max_tokens=40, grammar=grammar)
        b = await _complete(h, ep, "abab c ab ab c " * 4, ON, max_tokens=40, grammar=grammar)
    assert _text(a) == _text(b) and set(_text(b)) <= set("abc ")


async def test_concurrent_streams_with_speculation_match_each_alone_without(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await pinned(start_engine, tiny_model, slots=4, ctx_size=4096, spec_type="ngram-simple", spec_max_batch=4)
    engine = ep.state.engine
    async with http(ep) as h:
        alone: list[str] = []
        for prompt in PROMPTS:
            for s in range(4):
                await engine._core.clear_slot(s)
            r = await h.post(
                "/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 64, "speculative": OFF}
            )
            alone.append(_text(r.json()))
        for s in range(4):
            await engine._core.clear_slot(s)
        accepted = engine._core.spec_counts.accepted
        got: dict[int, str] = {}

        async def one(i: int) -> None:
            r = await h.post("/v1/completions", json={"prompt": PROMPTS[i], "temperature": 0, "max_tokens": 64})
            got[i] = _text(r.json())

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
    assert [got[i] for i in range(len(PROMPTS))] == alone
    assert engine._core.spec_counts.accepted > accepted


async def test_no_drafts_in_a_batch_larger_than_spec_max_batch(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await pinned(start_engine, tiny_model, slots=4, spec_type="ngram-simple", spec_max_batch=1)
    engine = ep.state.engine
    gate = trio.Event()
    async with http(ep) as h:

        async def one(i: int) -> None:
            await gate.wait()
            await h.post(
                "/v1/completions", json={"prompt": PROMPTS[i], "temperature": 0, "max_tokens": 64, "ignore_eos": True}
            )

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
            gate.set()
        together = engine._core.spec_counts.drafts
        await _complete(h, ep, PROMPTS[0], ON, max_tokens=64)
    assert engine._core.spec_counts.drafts > together  # alone it drafts


async def test_a_cancelled_stream_leaves_the_engine_healthy(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await pinned(start_engine, tiny_model, slots=1, spec_type="ngram-simple")
    engine = ep.state.engine
    async with http(ep) as h:
        reference = await _complete(h, ep, PROMPTS[0], ON, max_tokens=200)
        await engine._core.clear_slot(0)
        body = {"prompt": PROMPTS[0], "temperature": 0, "max_tokens": 200}
        await stream_then_hang_up(h, "/v1/completions", body, after=5)
        await assert_server_healthy(ep)
        # The slot's KV and its token list agree, whatever step the cancel met.
        assert engine._core.n_past(0) == kv_positions(engine, 0)
        again = await _complete(h, ep, PROMPTS[0], ON, max_tokens=200)
    assert _text(again) == _text(reference)


async def test_a_decode_speculates_and_gives_the_chat_text(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    """DECODE (RPC) goes through the same generation loop: its drafts are verified the same
    way, and its text is the chat completion's without speculation."""
    from helpers import MESSAGES, decode_ok, frame, get_result, rpc, text_of

    ep = await pinned(start_engine, tiny_model, slots=1, spec_type="ngram-simple")
    engine = ep.state.engine
    async with http(ep) as h:
        await engine._core.clear_slot(0)
        r = await h.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 80, "temperature": 0, "speculative": OFF}
        )
        plain = r.json()
        await engine._core.clear_slot(0)
        accepted = engine._core.spec_counts.accepted
        async with await rpc(ep) as c:
            rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=80))
        body = await get_result(h, rid)
    assert text_of(body) == text_of(plain) and body["usage"]["completion_tokens"] == 80
    assert engine._core.spec_counts.accepted > accepted


async def test_a_requests_tokens_go_to_its_salts_memory(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await pinned(start_engine, tiny_model, slots=1, spec_type="ngram-simple")
    memories = ep.state.engine._core.ngram_memories
    async with http(ep) as h:
        await _complete(h, ep, PROMPTS[1], ON, max_tokens=32, cache_salt="tenant-a")
        await _complete(h, ep, PROMPTS[1], OFF, max_tokens=32, cache_salt="tenant-b")  # no speculation: nothing kept
    assert len(memories.for_salt("tenant-a")) > 32
    assert len(memories.for_salt("tenant-b")) == 0 and len(memories.for_salt(None)) == 0
