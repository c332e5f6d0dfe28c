"""POST /infill (issue 51) on the synthetic fim preset: llama-server's format_prompt_infill
from the model's FIM tokens, its response shapes, and its refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import assert_server_healthy, http
from hydra_trio.model.synthetic import FIM_TOKENS, PRESETS

N_VOCAB = PRESETS["fim"].n_vocab
FIM = {key: N_VOCAB - len(FIM_TOKENS) + i for i, key in enumerate(FIM_TOKENS)}  # the preset's last ids
BOS = 1


async def pieces(h: Any, text: str) -> list[int]:
    r = await h.post("/tokenize", json={"content": text, "add_special": False, "parse_special": False})
    return r.json()["tokens"]


async def detok(h: Any, tokens: list[int]) -> str:
    return (await h.post("/detokenize", json={"tokens": tokens})).json()["content"]


async def test_the_prompt_is_llama_servers(start_engine: Callable[..., Any], fim_model: Path) -> None:
    ep = await start_engine(fim_model, batch_size=256)  # nothing cut: a quarter of a batch holds the suffix
    body = {
        "input_prefix": "def add(a, b):\n    ",
        "input_suffix": "\n\nprint(add(1, 2))\n",
        "input_extra": [{"filename": "util.py", "text": "import os\n"}, {"text": "x = 1\n"}],
        "prompt": "return",
        "n_predict": 4,
        "temperature": 0,
    }
    async with http(ep) as h:
        r = await h.post("/infill", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        extra = [FIM["fim_rep"], *await pieces(h, "myproject\n")]
        extra += [FIM["fim_sep"], *await pieces(h, "util.py\n"), *await pieces(h, "import os\n")]
        extra += [FIM["fim_sep"], *await pieces(h, "tmp\n"), *await pieces(h, "x = 1\n")]
        extra += [FIM["fim_sep"], *await pieces(h, "filename\n")]
        prompt = (await h.post("/tokenize", json={"content": "return", "add_special": False})).json()["tokens"]
        head = [BOS, FIM["fim_pre"], *await pieces(h, body["input_prefix"]), *prompt]
        tail = [FIM["fim_suf"], *await pieces(h, body["input_suffix"])]
        want = [*extra, *head, *tail, FIM["fim_mid"]]
        assert out["tokens_evaluated"] == len(want)
        assert out["prompt"] == await detok(h, want)
        assert out["stop"] is True and out["tokens_predicted"] == 4 and out["stop_type"] == "limit"
        assert isinstance(out["content"], str) and out["model"] == "fim" and "timings" in out
        assert out["generation_settings"]["n_predict"] == 4
        # Editors send llama-server's sampler order: ignored, not refused.
        r = await h.post("/infill", json={**body, "samplers": ["top_k", "top_p", "infill"]})
        assert r.status_code == 200 and r.json()["prompt"] == out["prompt"]
    await assert_server_healthy(ep)


async def test_spm_order_and_the_cuts(start_engine: Callable[..., Any], fim_model: Path) -> None:
    """--spm-infill puts the suffix part first; a long prefix keeps its last 3/4 of a batch
    and a long suffix its first quarter less the prompt's (2 + its tokens)."""
    ep = await start_engine(fim_model, batch_size=64, spm_infill=True)
    prefix, suffix = "the " * 80, "of " * 80
    async with http(ep) as h:
        out = (await h.post("/infill", json={"input_prefix": prefix, "input_suffix": suffix, "n_predict": 1})).json()
        p, s = await pieces(h, prefix), await pieces(h, suffix)
        assert len(p) > 48 and len(s) > 14
        sep = [FIM["fim_sep"], *await pieces(h, "filename\n")]
        rep = [FIM["fim_rep"], *await pieces(h, "myproject\n")]
        want = [*rep, *sep, BOS, FIM["fim_suf"], *s[:14], FIM["fim_pre"], *p[-48:], FIM["fim_mid"]]
        assert out["prompt"] == await detok(h, want)


async def test_streamed_in_llama_servers_shape(start_engine: Callable[..., Any], fim_model: Path) -> None:
    ep = await start_engine(fim_model)
    async with http(ep) as h:
        events: list[dict[str, Any]] = []
        async with h.stream("POST", "/infill", json={"input_prefix": "a = ", "input_suffix": "\n", "n_predict": 5,
                                                    "stream": True, "ignore_eos": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))  # [DONE] would not parse: llama-server sends none
        assert all(e["stop"] is False and "content" in e for e in events[:-1])
        assert events[-1]["stop"] is True and events[-1]["content"] == "" and events[-1]["tokens_predicted"] == 5


async def test_refusals(start_engine: Callable[..., Any], fim_model: Path, tiny_model: Path) -> None:
    ep = await start_engine(fim_model)
    async with http(ep) as h:
        for body, param, words in (
            ({"input_suffix": "b"}, "input_prefix", "required"),
            ({"input_prefix": "a"}, "input_suffix", "required"),
            ({"input_prefix": "a", "input_suffix": 3}, "input_suffix", "required"),
            ({"input_prefix": "a", "input_suffix": "b", "prompt": 5}, "prompt", "string"),
            ({"input_prefix": "a", "input_suffix": "b", "input_extra": {}}, "input_extra", "array"),
            ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "x"}]}, "input_extra", '"text"'),
            ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": "t", "filename": 1}]}, "input_extra",
             "filename"),
            ({"input_prefix": "a", "input_suffix": "b", "n": 2}, "n", "n must be 1"),
        ):
            r = await h.post("/infill", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], (body, r.text)
    await assert_server_healthy(ep)
    other = await start_engine(tiny_model)
    async with http(other) as h:
        r = await h.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "Infill is not supported by this model: prefix token is "
            "missing. suffix token is missing. middle token is missing."
        )
