"""Embeddings and rerank over HTTP on the synthetic embed and rerank presets (issue 51): the
routes' shapes, their refusals, batching that changes nothing, generation beside them, and
the engine healthy after every refusal."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import trio

from helpers import assert_server_healthy, http, scrape

TEXTS = ["the model is a slot cache", "hello world", "what is the cache server", "a b c d e f g h"]


def cos(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


async def embed(h: Any, **body: Any) -> dict[str, Any]:
    r = await h.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_embeddings_in_openai_shape(start_engine: Callable[..., Any], embed_model: Path) -> None:
    ep = await start_engine(embed_model)
    async with http(ep) as h:
        one = await embed(h, input=TEXTS[0], model="anything")
        assert one["object"] == "list" and one["model"] == "embed"
        [item] = one["data"]
        assert item["object"] == "embedding" and item["index"] == 0 and len(item["embedding"]) == 64
        assert abs(np.linalg.norm(item["embedding"]) - 1.0) < 1e-5  # Euclidean by default
        tokens = (await h.post("/tokenize", json={"content": TEXTS[0], "add_special": True})).json()["tokens"]
        assert one["usage"] == {"prompt_tokens": len(tokens), "total_tokens": len(tokens)}

        many = await embed(h, input=TEXTS)
        assert [d["index"] for d in many["data"]] == [0, 1, 2, 3]
        assert cos(many["data"][0]["embedding"], item["embedding"]) > 1 - 1e-5
        # Inputs differ, so do their vectors.
        assert cos(many["data"][0]["embedding"], many["data"][1]["embedding"]) < 0.999
        # Token ids give what their text gives; an array of arrays is several inputs.
        by_ids = await embed(h, input=tokens)
        assert cos(by_ids["data"][0]["embedding"], item["embedding"]) > 1 - 1e-5
        two = await embed(h, input=[tokens, tokens[:3]])
        assert len(two["data"]) == 2 and two["usage"]["prompt_tokens"] == len(tokens) + 3

        b64 = await embed(h, input=TEXTS[:2], encoding_format="base64")
        floats = await embed(h, input=TEXTS[:2])  # the same call's shape: the same bits
        for d, f in zip(b64["data"], floats["data"], strict=True):
            assert np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist() == f["embedding"]
        raw = await embed(h, input=TEXTS[0], embd_normalize=-1)
        assert cos(raw["data"][0]["embedding"], item["embedding"]) > 1 - 1e-5
        assert abs(np.linalg.norm(raw["data"][0]["embedding"]) - 1.0) > 1e-3  # not normalised
        assert (await embed(h, input=TEXTS[0], dimensions=64))["data"][0]["embedding"] == item["embedding"]

        native = await h.post("/embeddings", json={"content": TEXTS[:2]})
        assert native.status_code == 200
        assert [len(x["embedding"]) for x in native.json()] == [1, 1]
        assert cos(native.json()[0]["embedding"][0], item["embedding"]) > 1 - 1e-5
        samples = await scrape(h)
        assert (
            samples.get(("hydra_pooled_inputs_total", (("path", "embeddings"),))) == 1 + 4 + 1 + 2 + 2 + 2 + 1 + 1 + 2
        )
    await assert_server_healthy(ep)


async def test_embedding_refusals_leave_the_engine_healthy(start_engine: Callable[..., Any], embed_model: Path) -> None:
    ep = await start_engine(embed_model, batch_size=64)
    async with http(ep) as h:
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({}, "input", "required"),
            ({"input": ""}, "input", "empty string"),
            ({"input": []}, "input", "non-empty"),
            ({"input": ["a", 5]}, "input", "non-empty string"),
            ({"input": [[1, 2], "a"]}, "input", "non-empty string"),
            ({"input": [1, 100000]}, "input", "token ids"),
            ({"input": "x", "dimensions": 8}, "dimensions", "64 dimensions"),
            ({"input": "x", "encoding_format": "int8"}, "encoding_format", "base64"),
            ({"input": "x", "embd_normalize": "2"}, "embd_normalize", "integer"),
            ({"input": " the" * 80}, "input", "at most 64"),  # an input over --batch-size tokens
        ]
        for body, param, words in cases:
            r = await h.post("/v1/embeddings", json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], (body, err)
        r = await h.post("/v1/rerank", json={"query": "a", "documents": ["b"]})
        assert r.status_code == 501 and "pools with mean" in r.json()["error"]["message"]
        assert (await embed(h, input="still fine"))["data"]
    await assert_server_healthy(ep)


async def test_no_embeddings_without_a_pooling_model(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h:
        for path in ("/v1/embeddings", "/embeddings"):
            r = await h.post(path, json={"input": "x"})
            assert r.status_code == 501 and "--embeddings" in r.json()["error"]["message"]
        assert (await h.get("/version")).json()["pooling"] is None


async def test_any_model_embeds_with_the_flag(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, pooling="last")
    async with http(ep) as h:
        assert (await h.get("/version")).json()["pooling"] == "last"
        a = (await embed(h, input="hello world"))["data"][0]["embedding"]
        b = (await embed(h, input="hello world, and more"))["data"][0]["embedding"]
        assert len(a) == 64 and cos(a, b) < 0.9999


async def test_pooling_none_gives_a_vector_per_token(start_engine: Callable[..., Any], embed_model: Path) -> None:
    ep = await start_engine(embed_model, pooling="none")
    async with http(ep) as h:
        r = await h.post("/v1/embeddings", json={"input": "hello world"})
        assert r.status_code == 400 and "/embeddings" in r.json()["error"]["message"]
        tokens = (await h.post("/tokenize", json={"content": "hello world", "add_special": True})).json()["tokens"]
        r = await h.post("/embeddings", json={"content": ["hello world", "a"]})
        assert r.status_code == 200
        rows = r.json()[0]["embedding"]
        assert len(rows) == len(tokens) and all(len(row) == 64 for row in rows)
        # The mean pooling of the same model is the mean of these rows (unnormalised).
    ep2 = await start_engine(embed_model)
    async with http(ep2) as h:
        pooled = (await embed(h, input="hello world", embd_normalize=-1))["data"][0]["embedding"]
    assert np.allclose(np.mean(rows, axis=0), pooled, atol=1e-4)


async def test_batched_inputs_equal_each_alone(start_engine: Callable[..., Any], embed_model: Path) -> None:
    """Many concurrent requests share calls; each vector is its input's alone (a pooled vector
    never takes another input's tokens), up to the rounding of another batch shape."""
    ep = await start_engine(embed_model, embd_batch_inputs=8)
    texts = [f"{TEXTS[i % 4]} number {i}" for i in range(24)]
    async with http(ep) as h:
        alone = [(await embed(h, input=t))["data"][0]["embedding"] for t in texts]
        got: dict[int, Any] = {}

        async def one(i: int) -> None:
            got[i] = (await embed(h, input=texts[i]))["data"][0]["embedding"]

        async with trio.open_nursery() as n:
            for i in range(len(texts)):
                n.start_soon(one, i)
        together = (await embed(h, input=texts))["data"]
    for i in range(len(texts)):
        assert cos(got[i], alone[i]) > 1 - 1e-5, i
        assert cos(together[i]["embedding"], alone[i]) > 1 - 1e-5, i
    stats = ep.state.engine.pooling
    assert stats.calls < stats.inputs_done  # calls were shared


async def test_generation_goes_on_beside_embeddings(start_engine: Callable[..., Any], embed_model: Path) -> None:
    """A stream and a burst of embeddings on one engine: both finish, and the stream's text is
    what it is alone (its computation does not touch the embedding context)."""
    ep = await start_engine(embed_model, step_token_budget=8)
    body = {"prompt": "the model is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    async with http(ep) as h:
        alone = (await h.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        texts: list[str] = []

        async def stream() -> None:
            async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        import json

                        texts.append(json.loads(line[6:])["choices"][0]["text"])

        async def burst() -> None:
            for _ in range(6):
                await embed(h, input=[t * 3 for t in TEXTS])

        async with trio.open_nursery() as n:
            n.start_soon(stream)
            n.start_soon(burst)
    assert "".join(texts) == alone


async def test_rerank_in_jina_and_tei_shapes(start_engine: Callable[..., Any], rerank_model: Path) -> None:
    ep = await start_engine(rerank_model, batch_size=256)  # the rerank template alone is ~100 tokens here
    docs = ["a cache keeps data", "the boy went home", "slot cache server", "water"]
    async with http(ep) as h:
        assert (await h.get("/version")).json()["pooling"] == "rank"
        r = await h.post("/v1/rerank", json={"query": "what is a cache", "documents": docs, "return_documents": True})
        assert r.status_code == 200, r.text
        out = r.json()
        results = out["results"]
        scores = [x["relevance_score"] for x in results]
        assert sorted(x["index"] for x in results) == [0, 1, 2, 3]
        assert scores == sorted(scores, reverse=True) and all(0.0 < s < 1.0 for s in scores)  # softmaxed
        assert len(set(scores)) == 4
        assert all(x["document"] == {"text": docs[x["index"]]} for x in results)
        assert out["object"] == "list" and out["usage"]["prompt_tokens"] > 0
        # Aliases and top_n; one pair at a time scores the same.
        for path in ("/rerank", "/v1/reranking", "/reranking"):
            top = (await h.post(path, json={"query": "what is a cache", "documents": docs, "top_n": 2})).json()[
                "results"
            ]
            assert [x["index"] for x in top] == [x["index"] for x in results[:2]] and "document" not in top[0]
        best = results[0]
        single = (
            await h.post("/v1/rerank", json={"query": "what is a cache", "documents": [docs[best["index"]]]})
        ).json()
        assert abs(single["results"][0]["relevance_score"] - best["relevance_score"]) < 1e-5
        tei = (await h.post("/rerank", json={"query": "what is a cache", "texts": docs, "return_text": True})).json()
        assert [(x["index"], x["text"]) for x in tei] == [(x["index"], docs[x["index"]]) for x in results]
        assert all(abs(x["score"] - y["relevance_score"]) < 1e-5 for x, y in zip(tei, results, strict=True))
        for body, param in (
            ({"documents": ["a"]}, "query"),
            ({"query": "q", "documents": []}, "documents"),
            ({"query": "q", "documents": ["a", 3]}, "documents"),
            ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ):
            r = await h.post("/v1/rerank", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = await h.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 400 and "/v1/rerank" in r.json()["error"]["message"]
        samples = await scrape(h)
        assert samples.get(("hydra_pooled_inputs_total", (("path", "rerank"),))) == 4 + 3 * 4 + 1 + 4
    await assert_server_healthy(ep)


async def test_a_rerank_pair_is_the_rerank_template(start_engine: Callable[..., Any], rerank_model: Path) -> None:
    """The pair's tokens are the GGUF's rerank template with query and document filled in,
    without BOS (llama-server's format_prompt_rerank): usage counts exactly those."""
    from hydra_trio.model.synthetic import RERANK_TEMPLATE

    ep = await start_engine(rerank_model, batch_size=256)
    async with http(ep) as h:
        r = await h.post("/v1/rerank", json={"query": "q" * 300, "documents": ["short"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
        assert "document 0 has" in r.json()["error"]["message"] and "with the query" in r.json()["error"]["message"]
        text = RERANK_TEMPLATE.replace("{query}", "q one").replace("{document}", "doc two")
        tokens = (await h.post("/tokenize", json={"content": text, "add_special": False})).json()["tokens"]
        out = (await h.post("/v1/rerank", json={"query": "q one", "documents": ["doc two"]})).json()
        assert out["usage"]["prompt_tokens"] == len(tokens)


async def test_an_encoder_embeds_and_refuses_generation(start_engine: Callable[..., Any], bert_model: Path) -> None:
    """BERT (no KV cache): embeddings by itself (its GGUF's pooling), [CLS] and [SEP] around
    each text; generation and slots refused with 501, the engine healthy after."""
    ep = await start_engine(bert_model)
    async with http(ep) as h:
        tokens = (await h.post("/tokenize", json={"content": "hello world", "add_special": True})).json()["tokens"]
        assert tokens[0] == 2 and tokens[-1] == 3 and len(tokens) == 4  # [CLS] hello world [SEP]
        out = await embed(h, input=["hello world", "the model"])
        assert (
            out["usage"]["prompt_tokens"] == 8 and cos(out["data"][0]["embedding"], out["data"][1]["embedding"]) < 0.999
        )
        for path, body in (
            ("/v1/completions", {"prompt": "hello"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            r = await h.post(path, json=body)
            assert r.status_code == 501 and "no KV cache" in r.json()["error"]["message"], r.text
        assert (await embed(h, input="still fine"))["data"]
