"""The tokenizer routes coordinators, routers and eval harnesses use: llama-server's POST
/tokenize, /detokenize and /apply-template, vLLM's shapes of /tokenize and /detokenize (told
apart by their keys: llama-server's ``content``, vLLM's ``prompt`` or ``messages``), vLLM's
GET /tokenizer_info (lm-eval's remote tokenizer reads it), and vLLM's render routes (the
token ids a completion would run; vllm-router's kv_aware policy reads them). Tokenizing is a
llama.cpp call, so it runs on the GPU worker."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, request

from ...wire.errors import bad_param
from ..plumbing import (
    HttpError,
    app_state,
    hold_model,
    json_response,
    needs_no_slot,
    require_engine,
    routed_json,
)

bp = Blueprint("tokens", __name__)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_param(f"{name} must be a boolean")
    return value


def _piece_json(piece: bytes) -> str | list[int]:
    """A piece as text, or as its bytes when it is not valid UTF-8 on its own (a partial
    multi-byte character), as llama-server does."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


async def _vllm_tokens(engine: Any, body: dict[str, Any]) -> list[int]:
    """The tokens of a vLLM-shaped request: ``messages`` through the chat template as the
    chat route renders them, a ``prompt`` as the text-completion route takes it, or with
    ``add_special_tokens: false`` (vLLM's: true for a prompt) without its BOS (what lm-eval's
    remote tokenizer asks). A chat's special tokens come from its template, as in vLLM."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) and not _flag(body, "add_special_tokens", True):
        return await engine.tokenize(prompt, add_special=False)
    return await engine.prompt_tokens(body)  # what the chat and text-completion routes run


def _vllm_reply(engine: Any, tokens: list[int], body: dict[str, Any] | None = None) -> dict[str, Any]:
    reply: dict[str, Any] = {"tokens": tokens, "count": len(tokens), "max_model_len": engine.n_ctx_slot}
    if body is not None and _flag(body, "return_token_strs", False):
        vocab = engine.vocab
        piece = vocab.special_piece
        reply["token_strs"] = [piece(t).decode("utf-8", "replace") for t in tokens]
    return reply


async def _render(required: str) -> Response:
    """vLLM's render routes: the prompt token ids the completion route would run."""
    engine, body = await routed_json()
    if required not in body:
        raise bad_param(f"{required} is required")
    tokens = await _vllm_tokens(engine, body)
    return json_response({"token_ids": tokens, **_vllm_reply(engine, tokens)})


@bp.post("/v1/chat/completions/render")
@needs_no_slot
async def render_chat() -> Response:
    return await _render("messages")


@bp.post("/v1/completions/render")
@needs_no_slot
async def render_completion() -> Response:
    return await _render("prompt")


@bp.post("/tokenize")
@needs_no_slot
async def tokenize() -> Response:
    engine, body = await routed_json()
    if "content" not in body and ("prompt" in body or "messages" in body):  # vLLM's shape
        return json_response(_vllm_reply(engine, await _vllm_tokens(engine, body), body))
    content = body.get("content")
    if not isinstance(content, str):
        raise bad_param("content must be a string")
    add_special = _flag(body, "add_special", False)
    parse_special = _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)

    tokens = await engine.tokenize(content, add_special=add_special, parse_special=parse_special)
    if with_pieces:
        vocab = engine.vocab
        piece = vocab.special_piece
        return json_response({"tokens": [{"id": t, "piece": _piece_json(piece(t))} for t in tokens]})
    return json_response({"tokens": tokens})


@bp.post("/detokenize")
@needs_no_slot
async def detokenize() -> Response:
    engine, body = await routed_json(token_ids=True)  # one model: refused unparsed past what n_ctx ids take
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list):
        raise bad_param("tokens must be an array of token ids")
    if len(tokens) > engine.n_ctx:  # what all slots hold together: checked before each id is
        raise HttpError(413, f"{len(tokens)} tokens; at most "
                        f"{engine.n_ctx} (the KV cells of all slots)", "invalid_request_error")
    n_vocab = engine.n_vocab
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_param("tokens must be an array of token ids")
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise bad_param(f"token ids outside the vocabulary (0..{n_vocab - 1}): {bad[:5]}")
    # Pieces from the table read at load: no llama call, no GPU worker. llama-server names
    # the text "content", vLLM "prompt": both, so either client reads its own.
    vocab = engine.vocab
    text = vocab.detokenize(tokens)
    return json_response({"content": text, "prompt": text})


@bp.post("/apply-template")
@needs_no_slot
async def apply_template() -> Response:
    engine, body = await routed_json()
    if "messages" not in body:
        raise bad_param("messages is required")
    return json_response({"prompt": await engine.render(body)})


@bp.get("/tokenizer_info")
async def tokenizer_info() -> Response:
    """vLLM's GET /tokenizer_info: the tokenizer's configuration as tokenizer_config.json
    has it (special tokens' text, what it adds, the longest input, the chat template); with
    several models, ``?model=`` names one (else the default)."""
    state = app_state()
    engine = require_engine()
    if state.models is not None and state.models.strict and (name := request.args.get("model")) is not None:
        engine = await hold_model(state, state.models, name)
    vocab = engine.vocab
    roles = vocab.roles

    def text(role: str) -> str | None:
        tid = roles.get(role)
        return None if tid is None else vocab.special_piece(tid).decode("utf-8", "replace")

    info: dict[str, Any] = {
        "tokenizer_class": "LlamaCppTokenizer",  # llama.cpp's own, from the GGUF
        "bos_token": text("bos"),
        "eos_token": text("eos"),
        "pad_token": text("pad"),
        "add_bos_token": roles.add_bos,
        "add_eos_token": roles.add_eos,
        "model_max_length": engine.n_ctx_slot,
        "vocab_size": engine.n_vocab,
    }
    if vocab.chat_template is not None:
        info["chat_template"] = vocab.chat_template
    return json_response(info)
