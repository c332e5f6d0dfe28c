"""Embeddings and rerank over the engine's embedding context (engine/embedder.py):
OpenAI's POST /v1/embeddings, llama-server's /embeddings (its own shape, token vectors with
pooling none), and the rerank routes (/v1/rerank, /rerank, /v1/reranking, /reranking) in
Jina's shape (``results[{index, relevance_score, document?}]``) or, given ``texts``, in
TEI's (``[{index, score, text?}]``), as llama-server answers them."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Awaitable
from typing import Any

import numpy as np
import orjson
from quart import Blueprint, Response

from ...engine import Embedder, Engine, Pooled
from ...observability import request_extra
from ...wire.errors import bad_param
from ..plumbing import (
    HttpError,
    app_state,
    client_request_id,
    json_response,
    routed_json,
)

bp = Blueprint("embed_routes", __name__)
log = logging.getLogger(__name__)


def _pooling(engine: Engine, *, rank: bool) -> Embedder:
    """The engine's pooled requests, or the 501 llama-server answers without them."""
    pooling = engine.pooling
    shape = None if pooling is None else pooling.shape
    if rank and (shape is None or shape.pooling != "rank"):
        raise HttpError(
            501, "This server does not support reranking: it needs a model with a rank head served with rank pooling "
            f"(--reranking){'' if shape is None else f'; this one pools with {shape.pooling}'}", "not_supported_error",
        )
    if pooling is None or shape is None:
        raise HttpError(501, "This server does not support embeddings. Start it with "
                        "`--embeddings`", "not_supported_error")
    return pooling


def _inputs(value: Any, name: str) -> list[str | list[int]]:
    """OpenAI's input forms: a string, an array of strings, an array of token ids (one
    input), an array of such arrays; llama-server's mixed arrays are not taken."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return [value]
        if all(isinstance(x, str) for x in value) or all(isinstance(x, list) for x in value):
            return list(value)
    raise bad_param(f"{name} must be a non-empty string, array of "
                    "strings, array of token ids, or array of such arrays", name)


def _normalize(body: dict[str, Any]) -> int | None:
    norm = body.get("embd_normalize")
    if norm is not None and (isinstance(norm, bool) or not isinstance(norm, int) or not -1 <= norm <= 64):
        raise bad_param("embd_normalize must be an integer from -1 to "
                        "64 (-1 none, 0 max-abs, 2 Euclidean, p: p-norm)", "embd_normalize")
    return norm


def _logged(route: str, n_inputs: int, pooled: Pooled | None, t0: float, error: str | None = None) -> None:
    ms = (time.perf_counter() - t0) * 1000.0
    tokens = 0 if pooled is None else pooled.prompt_tokens
    log.info("%s: %d inputs, %d "
             "tokens, %s in %.1f ms", route, n_inputs, tokens, "done" if error is None else f"failed: {error}", ms,
             extra=request_extra(request_id=client_request_id() or None, route=route, prompt_tokens=tokens,
                                 status="done" if error is None else "failed", e2e_ms=round(ms, 3), error=error))


async def _run(route: str, n_inputs: int, compute: Awaitable[Pooled]) -> Pooled:
    state, t0 = app_state(), time.perf_counter()
    try:
        pooled = await compute
    except Exception as exc:
        _logged(route, n_inputs, None, t0, getattr(exc, "message", type(exc).__name__))
        raise
    _logged(route, n_inputs, pooled, t0)
    state.metrics.record_pooled(route, n_inputs, pooled.prompt_tokens)
    return pooled


def _vectors_response(obj: Any) -> Response:
    """A reply of float vectors, written by orjson: json's encoder spends ~2 us a float in
    Python's float repr (1.1 ms for one 512-float vector, a third of the trio thread's work
    for a request), orjson ~0.1 us. The same shortest round-trip digits of each float64
    (``1e-05`` written ``0.00001``: the same number), so a client reads back the very floats;
    a NaN or infinity is written null, as llama-server writes it (json wrote ``NaN``, which
    strict parsers refuse). Every string here passed the tokenizer, so is valid UTF-8."""
    return Response(orjson.dumps(obj), content_type="application/json")


def _usage(pooled: Pooled) -> dict[str, int]:
    return {"prompt_tokens": pooled.prompt_tokens, "total_tokens": pooled.prompt_tokens}


@bp.post("/v1/embeddings")
async def embeddings_oai() -> Response:
    return await _embeddings(oai=True)


@bp.post("/embeddings")
async def embeddings_native() -> Response:
    return await _embeddings(oai=False)


async def _embeddings(*, oai: bool) -> Response:
    engine, body = await routed_json(pooled=True)  # the model its ``model`` names
    pooling = _pooling(engine, rank=False)
    if "input" not in body and "content" in body:  # llama-server's own key: its own shape
        oai, source = False, body["content"]
    elif "input" in body:
        source = body["input"]
    else:
        raise bad_param('"input" (or llama-server\'s "content") is required', "input")
    assert pooling.shape is not None
    shape = pooling.shape
    if shape.pooling == "rank":
        raise bad_param("this model pools with rank (a reranker): it scores query-document pairs at "
                        "/v1/rerank", "input")
    if oai and shape.pooling == "none":
        raise bad_param("pooling none gives a vector per token, which OpenAI's shape has no room for: use "
                        "/embeddings", "input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_param('encoding_format must be "float" or "base64"', "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and dims != shape.n_out:
        raise bad_param(f"dimensions is not supported: this model's embeddings have {shape.n_out} dimensions, "
                        "and shortening them is not offered", "dimensions")
    norm = _normalize(body)
    inputs = _inputs(source, "input" if "input" in body else "content")
    pooled = await _run("embeddings", len(inputs), pooling.embed(inputs, wait_s=app_state().settings.slot_wait_s))
    vectors = [v if shape.pooling == "none" else pooling.normalized(v, norm) for v in pooled.vectors]
    if not oai:  # llama-server's /embeddings: a list of rows per input (one row when pooled)
        return _vectors_response(
            [{"index": i, "embedding": (v if v.ndim == 2 else v[None, :]).tolist()} for i, v in enumerate(vectors)]
        )
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
            if fmt == "base64"
            else v.tolist(),
        }
        for i, v in enumerate(vectors)
    ]
    return _vectors_response({"object": "list", "data": data, "model": engine.served_name, "usage": _usage(pooled)})


@bp.post("/v1/rerank")
@bp.post("/rerank")
@bp.post("/v1/reranking")
@bp.post("/reranking")
async def rerank() -> Response:
    engine, body = await routed_json(pooled=True)
    pooling = _pooling(engine, rank=True)
    query = body.get("query")
    if not isinstance(query, str):
        raise bad_param('"query" must be a string', "query")
    tei = "documents" not in body and "texts" in body  # Hugging Face TEI's shape
    key = "texts" if tei else "documents"
    docs = body.get(key)
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise bad_param(f'"{key}" must be a non-empty array of strings', key)
    top_n = body.get("top_n", len(docs))
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise bad_param("top_n must be a non-negative integer", "top_n")
    with_docs = body.get("return_text" if tei else "return_documents", False)
    if not isinstance(with_docs, bool):
        raise bad_param(f"{'return_text' if tei else 'return_documents'} must be a boolean", "return_documents")
    pooled = await _run("rerank", len(docs), pooling.rerank(query, docs, wait_s=app_state().settings.slot_wait_s))
    # The rank head's first label's score (Qwen3-Reranker's "yes", softmaxed), as llama-server reads it.
    scores = [float(v[0]) for v in pooled.vectors]
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:top_n]  # stable: equal scores by index
    if tei:
        return json_response(
            [{"index": i, "score": scores[i], **({"text": docs[i]} if with_docs else {})} for i in order]
        )
    results = [
        {"index": i, "relevance_score": scores[i], **({"document": {"text": docs[i]}} if with_docs else {})}
        for i in order
    ]
    return json_response({"model": engine.served_name, "object": "list", "usage": _usage(pooled), "results": results})
