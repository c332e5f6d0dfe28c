"""What eval harnesses send (issue 51): /v1/completions with ``echo`` and the prompt's
logprobs, checked against the logprobs the same tokens get when generated; vLLM's
/tokenizer_info, /tokenize and /detokenize fields; and the requests lm-eval's
``local-completions`` model sent (captured from a real run, tests/data/lm_eval_requests.json)
replayed and read as lm-eval reads them."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import assert_server_healthy, http

PROMPT = "the model is a slot cache"


async def complete(h: Any, **body: Any) -> dict[str, Any]:
    r = await h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_echoed_prompt_logprobs_equal_the_generated_ones(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    """Generate 12 tokens greedily with logprobs; then send prompt + those tokens with echo and
    max_tokens 0: each generated token's logprob (and its top alternatives) comes back for
    its prompt position within 1e-3 (a batch of prompt rows rounds otherwise than steps)."""
    ep = await start_engine(tiny_model_ctx)
    async with http(ep) as h:
        # Tokens named by id (vLLM's return_tokens_as_token_ids): a byte token's text alone is "\ufffd".
        gen = await complete(h, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3, ignore_eos=True,
                             return_tokens_as_token_ids=True)
        lp = gen["choices"][0]["logprobs"]
        gen_ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        prompt_ids = (await h.post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
        echo = await complete(h, prompt=[prompt_ids + gen_ids], max_tokens=0, logprobs=3, echo=True,
                              return_tokens_as_token_ids=True)
        choice = echo["choices"][0]
        elp = choice["logprobs"]
        assert choice["finish_reason"] == "length" and echo["usage"]["completion_tokens"] == 0
        assert len(elp["tokens"]) == len(prompt_ids) + len(gen_ids)
        assert elp["token_logprobs"][0] is None and elp["top_logprobs"][0] is None
        assert all(isinstance(x, float) for x in elp["token_logprobs"][1:])
        tail = slice(len(prompt_ids), None)
        assert elp["tokens"][tail] == lp["tokens"]
        for got, want in zip(elp["token_logprobs"][tail], lp["token_logprobs"], strict=True):
            assert abs(got - want) < 1e-3, (got, want)
        for got, want in zip(elp["top_logprobs"][tail], lp["top_logprobs"], strict=True):
            assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-3 for k in got)
        # lm-eval's shape: echo with max_tokens 1. The completion's token is the greedy pick of
        # the prompt's last logits, which the echo computed: the generated run's first token.
        one = await complete(h, prompt=[prompt_ids], max_tokens=1, logprobs=1, echo=True, temperature=0,
                             return_tokens_as_token_ids=True)
        olp = one["choices"][0]["logprobs"]
        assert olp["tokens"][-1] == lp["tokens"][0] and abs(olp["token_logprobs"][-1] - lp["token_logprobs"][0]) < 1e-3
        assert olp["token_logprobs"][: len(prompt_ids)] == elp["token_logprobs"][: len(prompt_ids)]
        # Echo without logprobs: the prompt text as sent, then the completion.
        plain = await complete(h, prompt=PROMPT, max_tokens=4, echo=True, temperature=0, ignore_eos=True)
        assert plain["choices"][0]["text"].startswith(PROMPT) and plain["choices"][0]["logprobs"] is None
    await assert_server_healthy(ep)


async def test_echo_streams_the_prompt_first_and_refuses_what_it_cannot(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h:
        chunks: list[str] = []
        async with h.stream(
            "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "echo": True, "stream": True}
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
        assert chunks[0] == PROMPT and len("".join(chunks)) > len(PROMPT)
        for body, words in (
            ({"echo": "yes"}, "boolean"),
            ({"echo": True, "logprobs": 1, "stream": True}, "not streamed"),
            ({"echo": True, "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ):
            r = await h.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, **body})
            assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
            assert r.json()["error"]["param"] == "echo"
    await assert_server_healthy(ep)


async def test_vllm_tokenizer_routes(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h:
        info = (await h.get("/tokenizer_info")).json()
        assert info["bos_token"] == "<s>" and info["eos_token"] == "<|im_end|>" and info["pad_token"] is None
        assert info["add_bos_token"] is True and info["add_eos_token"] is False
        assert info["model_max_length"] == 2048 and info["vocab_size"] == 512
        assert "<|im_start|>" in info["chat_template"]
        with_bos = (await h.post("/tokenize", json={"prompt": "hello world"})).json()
        without = (await h.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False})).json()
        assert with_bos["tokens"][0] == 1 and with_bos["tokens"][1:] == without["tokens"]
        assert without["count"] == len(without["tokens"]) and without["max_model_len"] == 2048
        # lm-eval finds the EOS id by tokenizing eos_token: one token, the special one.
        assert (await h.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})).json()[
            "tokens"
        ] == [4]
        strs = (await h.post("/tokenize", json={"prompt": "hello", "return_token_strs": True})).json()["token_strs"]
        assert strs[0] == "<s>" and "".join(strs[1:]).strip() == "hello"
        back = (await h.post("/detokenize", json={"tokens": without["tokens"]})).json()
        assert back["prompt"].strip() == "hello world" and back["content"] == back["prompt"]
        r = await h.post("/tokenize", json={"prompt": "x", "add_special_tokens": "no"})
        assert r.status_code == 400 and "boolean" in r.json()["error"]["message"]


async def test_lm_eval_requests_replayed(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    """What lm-eval 0.4.13 sent to this engine on the tiny preset in
    examples/lm_eval_offline.py (``--capture``: its tokenizer calls, loglikelihood requests
    with echo on token ids, generation requests with stop strings), replayed, and each
    answer checked for what lm-eval's parse_logprobs and parse_generations read of it."""
    captured = json.loads((Path(__file__).parents[1] / "data" / "lm_eval_requests.json").read_text())
    ep = await start_engine(tiny_model)
    kinds: set[str] = set()
    async with http(ep) as h:
        for req in captured["requests"]:
            method, path, body = req["method"], req["path"], req.get("body")
            r = await (h.get(path) if method == "GET" else h.post(path, json=body))
            assert r.status_code == 200, (path, body, r.text)
            out = r.json()
            if path == "/v1/completions" and body.get("echo"):
                kinds.add("loglikelihood")
                [prompt] = body["prompt"]
                [choice] = out["choices"]
                lp = choice["logprobs"]  # lm-eval's parse_logprobs reads [ctxlen:-1] of both lists
                assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + body["max_tokens"]
                assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
                for name, tok, top in zip(
                    lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True
                ):
                    # Keyed by text (OpenAI's legacy shape): the token's own entry, unless
                    # the top token has the same text (byte tokens all read "\ufffd").
                    assert math.isfinite(tok) and tok <= 0 and tok <= max(top.values()) and name in top
            elif path == "/v1/completions":
                kinds.add("generate_until")
                assert isinstance(out["choices"][0]["text"], str)  # parse_generations
                assert all(s not in out["choices"][0]["text"] for s in body.get("stop") or [])
            else:
                kinds.add(path)
    assert {"loglikelihood", "generate_until", "/tokenizer_info", "/tokenize"} <= kinds
