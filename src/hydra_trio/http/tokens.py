"""llama-server's tokenizer routes, which coordinators use: POST /tokenize, /detokenize and
/apply-template. Tokenizing is a llama.cpp call, so it runs on the GPU worker."""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from ..engine.params import bad_param
from .common import app_state, json_response, read_json_body, require_engine

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


@bp.post("/tokenize")
async def tokenize() -> Response:
    state = app_state()
    engine = require_engine()
    body = await read_json_body(state.settings.max_json_bytes)
    content = body.get("content")
    if not isinstance(content, str):
        raise bad_param("content must be a string")
    add_special = _flag(body, "add_special", False)
    parse_special = _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)

    def run() -> tuple[list[int], list[bytes]]:
        backend = engine.backend  # read on the worker: a model reload (T3) cannot race it
        tokens = backend.tokenize(content, add_special=add_special, parse_special=parse_special)
        pieces = [backend.special_piece(t) for t in tokens] if with_pieces else []
        return tokens, pieces

    tokens, pieces = await engine.worker.call(run)
    if with_pieces:
        return json_response(
            {
                "tokens": [
                    {"id": t, "piece": _piece_json(p)} for t, p in zip(tokens, pieces, strict=True)
                ]
            }
        )
    return json_response({"tokens": tokens})


@bp.post("/detokenize")
async def detokenize() -> Response:
    state = app_state()
    engine = require_engine()
    body = await read_json_body(state.settings.max_json_bytes)
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise bad_param("tokens must be an array of token ids")
    n_vocab = engine.n_vocab
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise bad_param(f"token ids outside the vocabulary (0..{n_vocab - 1}): {bad[:5]}")
    content = await engine.worker.call(lambda: engine.backend.detokenize(tokens))
    return json_response({"content": content})


@bp.post("/apply-template")
async def apply_template() -> Response:
    state = app_state()
    engine = require_engine()
    body = await read_json_body(state.settings.max_json_bytes)
    if "messages" not in body:
        raise bad_param("messages is required")
    return json_response({"prompt": await engine.render_prompt(body)})
