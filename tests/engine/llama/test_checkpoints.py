"""The context checkpoints' bookkeeping (engine/llama/checkpoints.py): where a prefill stops
for one, how many a slot keeps, which one a cut resumes from, and what a change forgets."""

from __future__ import annotations

from hydra_trio.engine.llama.checkpoints import Checkpoint, Checkpoints


def cp(n: int) -> Checkpoint:
    return Checkpoint(n_tokens=n, swa_low=max(0, n - 512), data=bytes(n % 7 + 1))


def test_a_prefill_stops_a_batch_and_four_tokens_before_the_end() -> None:
    c = Checkpoints(n_slots=1, per_slot=8, n_batch=512)
    assert c.cuts(2000, 0) == [1488, 1996]
    assert c.cuts(2000, 1490) == [1996]  # the slot already holds past the first stop
    assert c.cuts(2000, 1996) == []
    assert c.cuts(3, 0) == []  # nothing to evaluate before the end: no stop
    assert Checkpoints(n_slots=1, per_slot=0, n_batch=512).cuts(2000, 0) == []  # off


def test_a_slot_keeps_its_latest_checkpoints_and_a_cut_resumes_from_the_last_before_it() -> None:
    c = Checkpoints(n_slots=2, per_slot=3, n_batch=512)
    for n in (100, 200, 300, 400):
        c.add(0, cp(n))
    assert c.count(0) == 3 and c.count(1) == 0
    assert c.best(0, 100) is None  # the oldest went
    best = c.best(0, 350)
    assert best is not None and best.n_tokens == 300
    assert c.best(1, 350) is None
    c.add(0, cp(250))  # a shorter history replaced the longer ones past it
    assert [c.best(0, n).n_tokens for n in (260, 1000)] == [250, 250]  # type: ignore[union-attr]
    assert c.nbytes == sum(len(cp(n).data) for n in (200, 250))


def test_a_history_cut_or_cleared_forgets_what_lay_past_it() -> None:
    c = Checkpoints(n_slots=1, per_slot=8, n_batch=512)
    for n in (100, 200, 300):
        c.add(0, cp(n))
    c.forget(0, above=250)
    assert c.count(0) == 2
    assert c.best(0, 1000).n_tokens == 200  # type: ignore[union-attr]
    c.forget(0)
    assert c.count(0) == 0
