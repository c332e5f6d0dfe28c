"""Slot choice keeps the busy slots contiguous in a split KV cache.

llama.cpp puts only consecutive sequence ids into one ubatch of a split cache, and each
ubatch is a forward pass of its own: a step over busy slots 0, 2, 4, ... costs one pass per
slot. With more slots configured than streams run, the least-recently-used choice scatters
the streams over all of them, so a step's cost followed the configured slots. These count
the runs of consecutive busy slots (the ubatches of a step), never time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.config import Settings
from hydra_trio.engine.kv import Retention
from hydra_trio.engine.llama import common_prefix_len
from hydra_trio.engine.sched import SlotScheduler, SlotTable


def busy_runs(table: SlotTable) -> int:
    """Runs of consecutive busy slots: the ubatches of a step over all of them (split KV)."""
    slots = table.slots
    return sum(s.busy and (s.id == 0 or not slots[s.id - 1].busy) for s in slots)


def scattered(compact: bool, n_slots: int = 128) -> SlotTable:
    """Every slot used once, their last uses in an order that spreads the oldest ones over
    the whole table (as streams that ended at different times leave them)."""
    table = SlotTable(n_slots, compact=compact)
    held = [table.claim(i, "first wave") for i in range(n_slots)]
    for rank, i in enumerate(sorted(range(n_slots), key=lambda i: (i * 37) % n_slots)):
        table.release(held[i])
        table.slots[i].last_used = float(rank)  # deterministic order, not the clock's
    return table


async def test_streams_fill_a_run_of_slots_not_the_least_recently_used_spread() -> None:
    for compact, most_runs in ((True, 1), (False, 128)):
        table = scattered(compact)
        for k in range(64):
            await table.claim_any(f"stream {k}", lambda _i: (0,))
        assert sum(s.busy for s in table.slots) == 64
        runs = busy_runs(table)
        if compact:
            assert runs == 1
        else:  # the plain least-recently-used choice: the contrast this guards against
            assert 10 < runs <= most_runs


async def test_a_freed_slot_between_busy_ones_is_taken_first() -> None:
    table = SlotTable(16, compact=True)
    held = [table.claim(i, "stream") for i in range(8)]
    for i in (2, 5):
        table.release(held[i])
    table.slots[2].last_used = table.slots[5].last_used = 1e9  # the most recently used
    assert busy_runs(table) == 3
    for k in range(2):
        slot = await table.claim_any(f"new {k}", lambda _i: (0,))
        assert slot.id in (2, 5)
    assert busy_runs(table) == 1


async def test_the_policy_score_still_comes_first() -> None:
    """A slot whose KV the prompt continues (a higher score) wins over a gap to fill."""
    table = SlotTable(8, compact=True)
    held = [table.claim(i, "stream") for i in range(4)]
    table.release(held[1])
    slot = await table.claim_any("reuser", lambda i: (1 if i == 6 else 0,))
    assert slot.id == 6


async def test_a_split_cache_engine_packs_its_streams_a_unified_one_keeps_lru(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    for unified in (False, True):
        ep = await start_engine(tiny_model, slots=8, ctx_size=8 * 256, kv_unified=unified)
        eng = ep.state.engine
        assert eng._core.slots.compact is not unified
        core = eng._core

        async def claim(tokens: list[int], owner: str, core: Any = core) -> Any:
            return await core.slots.claim_any(owner, core.scheduler.slot_rank(tokens))

        first = [await claim([1, 2, 3 + i], f"a{i}") for i in range(8)]
        for i in (1, 3, 5, 7, 0, 2, 4, 6):  # the oldest: every other slot
            eng._core.slots.release(first[i])
        again = [await claim([1, 2, 20 + i], f"b{i}") for i in range(4)]
        ids = sorted(s.id for s in again)
        if unified:
            assert ids == [1, 3, 5, 7]  # least recently used
        else:
            assert ids == [ids[0] + k for k in range(4)]  # one run: one ubatch a step
        for s in again:
            eng._core.slots.release(s)


class _Held:
    """The two things the slot choice reads of a backend: each slot's tokens and the
    shared-prefix rule (salts and adapter sets aside: one of each here)."""

    def __init__(self, seq_tokens: list[list[int]]) -> None:
        self.seq_tokens = seq_tokens

    def shared_prefix(self, slot: int, tokens: Sequence[int], salt: str | None, lora: object = ()) -> int:
        return common_prefix_len(self.seq_tokens[slot], tokens)

    def reusable_prefix(self, slot: int, n_keep: int) -> int:
        return n_keep  # no sliding window: all of a shared prefix can be continued


# Recency alone: the scores below are the slot-choice rule's own (the retention order only
# breaks ties among slots it would overwrite: tests/engine/kv/test_session_retention.py).
_LRU = Retention("lru", lambda: 0.0)


@settings(max_examples=300, deadline=None)
@given(
    held=st.lists(st.lists(st.integers(1, 3), max_size=9), min_size=1, max_size=8),
    prompt=st.lists(st.integers(1, 3), max_size=9),
    share=st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 1.0]),
)
def test_the_slot_score_settles_slots_by_their_head_as_the_plain_rule_would(
    held: list[list[int]], prompt: list[int], share: float
) -> None:
    """The score compares a slot's first tokens before its whole shared prefix (it runs for
    every free slot of every claim); it gives what the rule says: the shared prefix when it
    is at least ``share`` of the prompt (and not empty), 0 otherwise, and an empty slot next."""
    backend = _Held(held)
    scheduler = SlotScheduler(
        lambda: backend, None, SlotTable(len(held)), replace(Settings(), slot_prompt_similarity=share), None, _LRU
    )  # type: ignore[arg-type]
    score = scheduler.slot_rank(prompt)
    for slot, tokens in enumerate(held):
        n = common_prefix_len(tokens, prompt)
        assert score(slot) == ((n if n and n >= share * len(prompt) else 0), 0 if tokens else 1)


class _Windowed(_Held):
    """Slot 0's sliding window has dropped what its shared prefix needs (no checkpoint)."""

    def reusable_prefix(self, slot: int, n_keep: int) -> int:
        return 0 if slot == 0 else n_keep


async def test_a_slot_whose_window_dropped_the_shared_prefix_loses_to_an_empty_one() -> None:
    """Sharing a prefix the slot can no longer continue is worth nothing: the prompt takes the
    empty slot and leaves that slot's history to its own session."""
    prompt = [1, 2, 3, 4, 5, 6]
    backend = _Windowed([[1, 2, 3, 4, 5, 9, 9], []])
    table = SlotTable(2)
    scheduler = SlotScheduler(lambda: backend, None, table, replace(Settings(), slot_prompt_similarity=0.1), None, _LRU)  # type: ignore[arg-type]
    score = scheduler.slot_rank(prompt)
    assert score(0) == (0, 0) and score(1) == (0, 1)
    assert (await table.claim_any("turn", score)).id == 1
    plain = _Held(backend.seq_tokens)  # the same slots without a window: the shared prefix wins
    rank = SlotScheduler(lambda: plain, None, SlotTable(2), replace(Settings(), slot_prompt_similarity=0.1), None, _LRU)  # type: ignore[arg-type]
    assert rank.slot_rank(prompt)(0) == (5, 0)
