"""Where a token is picked from (engine/sample/sampler.py, issue 53): a sampler chain's pick
reads its row in llama.cpp's logits buffer (``llama_sampler_sample``) and picks what the
chain over a NumPy copy of the row (the path before, ``--no-sampling-fast-path``) picks, the
same seeded draws, penalties and bans included; the plain greedy pick is the argmax of the row
and builds no chain."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from hydra_trio.config import settings_from
from hydra_trio.engine.llama import LlamaChain
from hydra_trio.engine.llama.context import LlamaBackend
from hydra_trio.engine.llama.types import StepRequest
from hydra_trio.engine.sample import Sampler, SamplingParams
from hydra_trio.engine.structured import GuidanceCache, OutputGrammar

PROMPT = "<|im_start|>user\nwrite something about the sea<|im_end|>\n<|im_start|>assistant\n"
N_GEN = 32

PARAMS = {
    "seeded": SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=1234),
    "top-k-p-min-p": SamplingParams(temperature=1.2, top_k=40, top_p=0.9, min_p=0.02, seed=7),
    "penalized-greedy": SamplingParams(repeat_penalty=1.3, presence_penalty=0.5),
    "seeded-ignore-eos": SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=99, ignore_eos=True),
}


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> Iterator[LlamaBackend]:
    b = LlamaBackend(str(tiny_model), n_slots=2, n_ctx=512, n_threads=1, n_batch=64)
    yield b
    b.close()


@pytest.fixture
def count_paths(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often each path ran: the chain on llama.cpp's row, the chain over a NumPy copy."""
    seen = {"sample_at": 0, "pick": 0}
    for name in seen:
        original = getattr(LlamaChain, name)

        def counted(self: LlamaChain, *args: object, _name: str = name, _original: object = original) -> object:
            seen[_name] += 1
            return _original(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(LlamaChain, name, counted)
    return seen


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_the_chain_on_llama_s_row_picks_what_it_picks_from_a_copy(
    backend: LlamaBackend, params: SamplingParams, count_paths: dict[str, int]
) -> None:
    """Each step's row is sampled by both paths, each with its own chain of the same seed:
    the same rows and the same history give the same token every time (the decode runs on the
    context path's tokens; the copy's chain is asked about the same row right after)."""
    on_row, on_copy = Sampler(params), Sampler(params, fast_path=False)
    other = Sampler(SamplingParams())  # another stream in the batch: its row comes second
    try:
        prompt = backend.tokenize(PROMPT, add_special=True)
        for slot in (0, 1):
            backend.clear_slot(slot)
        first, _ = backend.eval_chunk(0, prompt, None, sampler=on_row)
        assert first is not None
        assert backend._sample(on_copy, -1) == first  # the prompt's last row, read again
        other_tok, _ = backend.eval_chunk(
            1, backend.tokenize("<|im_start|>user\nthe other stream", add_special=True), None, sampler=other
        )
        tokens = [first]
        for _ in range(N_GEN):
            res_other, res = backend.step([StepRequest(1, other_tok, other), StepRequest(0, tokens[-1], on_row)])
            assert res is not None and res_other is not None
            (tok,), (other_tok,) = res, res_other
            assert backend._sample(on_copy, 0) == tok, f"the paths parted after {tokens}"
            tokens.append(tok)
        if params.ignore_eos:
            assert not set(tokens) & backend.eog_ids
        assert len(set(tokens)) > 3, "the sampler kept to a few tokens: a wrong draw could go unseen"
        # Every pick of the context path read llama.cpp's row; every pick of the other a copy.
        assert count_paths == {"sample_at": N_GEN + 1, "pick": N_GEN + 1}
    finally:
        on_row.close()
        on_copy.close()
        other.close()


def test_a_seeded_chain_on_llama_s_row_is_reproducible(backend: LlamaBackend) -> None:
    """The same seed, prompt and batch shape: the same draws, run after run."""
    params = PARAMS["seeded"]
    prompt = backend.tokenize(PROMPT, add_special=True)
    runs = []
    for _ in range(2):
        sampler = Sampler(params)
        try:
            backend.clear_slot(0)
            tok, _ = backend.eval_chunk(0, prompt, None, sampler=sampler)
            assert tok is not None
            tokens = [tok]
            for _ in range(N_GEN):
                res = backend.step([StepRequest(0, tokens[-1], sampler)])[0]
                assert res is not None
                tokens += res
            runs.append(tokens)
        finally:
            sampler.close()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "path-before"])
def test_plain_greedy_is_the_argmax_of_the_row_with_no_chain(
    backend: LlamaBackend, fast_path: bool, count_paths: dict[str, int]
) -> None:
    """Greedy with nothing else asked is the argmax of llama.cpp's row on either path (the
    fast path's shortcut and the full steps pick the same): no chain is built, the row is not
    copied (an end-of-generation ban goes into the row itself)."""
    plain = Sampler(SamplingParams(), fast_path=fast_path)
    banned = Sampler(SamplingParams(ignore_eos=True), fast_path=fast_path)
    try:
        assert plain._plain == banned._plain == fast_path
        prompt = backend.tokenize(PROMPT, add_special=True)
        backend.clear_slot(0)
        backend.eval_chunk(0, prompt, None, want_logits=True)
        row = backend._logits(-1)
        eos = min(backend.eog_ids)
        row[eos] = 1e9
        assert backend._sample(plain, -1) == eos
        top = backend._sample(banned, -1)
        assert top not in backend.eog_ids and top == int(row.argmax())  # the row itself was banned
        assert plain._chain is None and banned._chain is None
        assert count_paths == {"sample_at": 0, "pick": 0}
        assert plain.n_picked == banned.n_picked == 1
    finally:
        plain.close()
        banned.close()


def test_plain_greedy_steps_equal_on_both_paths(backend: LlamaBackend) -> None:
    """The same prompt in the same batch shape (one stream), greedy under ignore_eos: the
    fast path's tokens are the path before's, token for token."""
    prompt = backend.tokenize(PROMPT, add_special=True)
    runs = []
    for fast_path in (True, False):
        sampler = Sampler(SamplingParams(ignore_eos=True), fast_path=fast_path)
        try:
            backend.clear_slot(0)
            tok, _ = backend.eval_chunk(0, prompt, None, sampler=sampler)
            assert tok is not None
            tokens = [tok]
            for _ in range(N_GEN):
                res = backend.step([StepRequest(0, tokens[-1], sampler)])[0]
                assert res is not None
                tokens += res
            runs.append(tokens)
        finally:
            sampler.close()
    assert runs[0] == runs[1]
    assert not set(runs[0]) & backend.eog_ids


def test_the_setting_reaches_the_sampler() -> None:
    assert settings_from(env={}).sampling_fast_path is True
    assert settings_from(env={"HYDRA_SAMPLING_FAST_PATH": "0"}).sampling_fast_path is False
    assert Sampler(SamplingParams(temperature=0.7))._on_context
    assert not Sampler(SamplingParams(temperature=0.7), fast_path=False)._on_context


def test_a_grammar_s_first_pick_on_llama_s_row_picks_what_it_picks_from_a_copy(
    backend: LlamaBackend, count_paths: dict[str, int]
) -> None:
    """Under a grammar, a seeded chain's first pick (the one the grammar checks) is read on
    llama.cpp's row; a token the grammar refuses is picked again over the masked copy, on both
    paths alike: the same tokens, and the grammar holds."""
    grammar = OutputGrammar('start: /[a-m ]{1,300}/')
    grammars = GuidanceCache(backend.grammar_pieces, backend.eog_ids, backend.info.bos)
    grammars.compile(grammar)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5, grammar=grammar)
    on_row, on_copy = Sampler(params, grammars=grammars), Sampler(params, grammars=grammars, fast_path=False)
    try:
        prompt = backend.tokenize(PROMPT, add_special=True)
        backend.clear_slot(0)
        first, _ = backend.eval_chunk(0, prompt, None, sampler=on_row)
        assert first is not None and backend._sample(on_copy, -1) == first
        tokens = [first]
        for _ in range(N_GEN):
            res = backend.step([StepRequest(0, tokens[-1], on_row)])[0]
            assert res is not None
            (tok,) = res
            assert backend._sample(on_copy, 0) == tok, f"the paths parted after {tokens}"
            tokens.append(tok)
        text = b"".join(backend.grammar_pieces[t] for t in tokens).decode()
        assert re.fullmatch(r"[a-m ]+", text), text
        # Every first pick read the row on the fast path, and the copy on the path before; a
        # refused one was picked again over the masked copy on both (R times each).
        assert count_paths["sample_at"] == N_GEN + 1
        refused, odd = divmod(count_paths["pick"] - (N_GEN + 1), 2)
        assert odd == 0 and refused > 0, "no token was refused: the mask path went untried"
    finally:
        on_row.close()
        on_copy.close()
