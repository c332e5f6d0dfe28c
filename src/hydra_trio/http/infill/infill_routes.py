"""POST /infill: llama-server's fill-in-the-middle for code editors (llama.vim, llama.vscode):
``input_prefix``, ``input_suffix``, ``input_extra`` (other files' text) and an optional
``prompt`` written around the model's FIM tokens as llama-server's ``format_prompt_infill``
writes them, then a text completion on the usual generation path, answered in llama-server's
own (non-OpenAI) shape: ``content``, ``stop``, ``tokens_predicted``, ``prompt``, ... or a
stream of such events (no ``[DONE]``, as llama-server)."""

from __future__ import annotations

import secrets
from typing import Any

from quart import Blueprint, Response

from ...engine import Engine, GenerationResult, Vocabulary
from ...wire.errors import bad_param
from ..completions import timings
from ..generation import Answer, Exchange, StreamEvents, respond
from ..plumbing import (
    HttpError,
    app_state,
    generation_owner,
    routed_json,
    sse_event,
)

bp = Blueprint("infill", __name__)

_OWN_KEYS = ("input_prefix", "input_suffix", "input_extra", "prompt")
# Editors send llama-server's sampler order with its "infill" sampler: the chain here is the usual one.
_IGNORED = ("samplers",)
_SNIPPET = "\n\n--- snippet ---\n\n"  # llama-server's separator of extra chunks without a FIM_SEP token
_STOP_TYPES = {"eos": "eos", "word": "word", "limit": "limit", "context": "limit"}


def _fim_tokens(vocab: Vocabulary) -> tuple[int, int, int]:
    roles = vocab.roles
    pre, suf, mid = roles.get("fim_pre"), roles.get("fim_suf"), roles.get("fim_mid")
    if pre is None or suf is None or mid is None:
        missing = " ".join(
            f"{name} token is missing." for name, t in (("prefix", pre), ("suffix", suf), ("middle", mid)) if t is None
        )
        raise HttpError(400, f"Infill is not supported by this model: {missing}", "invalid_request_error")
    return pre, suf, mid


def _extra_chunks(body: dict[str, Any]) -> list[tuple[str, str]]:
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise bad_param('"input_extra" must be an array of {"filename": string, "text": string}', "input_extra")
    chunks = []
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise bad_param('an input_extra chunk must have a "text" field with a string value', "input_extra")
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise bad_param('an input_extra chunk\'s "filename" must be a string', "input_extra")
        chunks.append((name, chunk["text"]))
    return chunks


async def infill_tokens(engine: Engine, body: dict[str, Any], *, n_batch: int, spm: bool) -> list[int]:
    """llama-server's format_prompt_infill: [extra files] [BOS] FIM_PRE prefix prompt FIM_SUF
    suffix FIM_MID (``spm``: the suffix part first); the prefix keeps its last 3/4 of a batch,
    the suffix its first quarter less the prompt, the extra files what else fits the slot."""
    vocab = engine.vocab
    pre, suf, mid = _fim_tokens(vocab)
    for key in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(key), str):
            raise bad_param(f'"{key}" is required (a string)', key)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise bad_param('"prompt" must be a string', "prompt")
    chunks = _extra_chunks(body)
    roles = vocab.roles
    rep, sep = roles.get("fim_rep"), roles.get("fim_sep")
    texts = [body["input_prefix"], body["input_suffix"], "myproject\n", "filename\n", _SNIPPET]
    for name, text in chunks:
        texts += [name + "\n", text]
    tokens = await engine.tokenize(texts, add_special=False, parse_special=False)
    prefix, suffix, repo, current, snippet = tokens[:5]
    prompt_tokens = await engine.tokenize(prompt, add_special=False) if prompt else []
    extra: list[int] = [rep, *repo] if rep is not None else []
    for i in range(len(chunks)):
        name_tokens, text_tokens = tokens[5 + 2 * i], tokens[6 + 2 * i]
        extra += [sep, *name_tokens] if sep is not None else snippet
        extra += text_tokens
    if sep is not None:
        extra += [sep, *current]
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt_tokens))))
    # llama-server leaves 2 * n_predict for the reply, with its default n_predict of -1.
    n_extra = min(max(0, engine.n_ctx_slot - n_batch + 2), len(extra))
    head = [pre, *prefix[len(prefix) - n_prefix :], *prompt_tokens]
    tail = [suf, *suffix[:n_suffix]]
    first, second = (tail, head) if spm else (head, tail)
    bos = roles.get("bos")
    if roles.add_bos and bos is not None:
        first = [bos, *first]
    return [*extra[len(extra) - n_extra :], *first, *second, mid]


@bp.post("/infill")
async def infill() -> Response:
    state = app_state()
    engine, body = await routed_json()  # the model its ``model`` names (several models)
    _fim_tokens(engine.vocab)  # a model without them says so, whatever else the body holds
    tokens = await infill_tokens(engine, body, n_batch=state.settings.batch_size, spm=state.settings.spm_infill)
    request = {k: v for k, v in body.items() if k not in _OWN_KEYS and k not in _IGNORED}
    request["prompt"] = tokens
    prepared = await engine.prepare("completions", request)
    params = prepared.params
    assert prepared.tokens is not None, "tokenized"
    tokens = prepared.tokens
    cid = "infill-" + secrets.token_hex(12)
    owner = generation_owner(cid)
    model = engine.served_name
    vocab = engine.vocab
    shown = vocab.detokenize(tokens)  # llama-server's "prompt": the tokens, specials spelled out

    def final(slot_id: int | None, res: GenerationResult, content: str) -> dict[str, Any]:
        return {
            "index": 0, "content": content, "tokens": [], "id_slot": slot_id, "stop": True, "model": model,
            "tokens_predicted": res.completion_tokens, "tokens_evaluated": res.prompt_tokens,
            "generation_settings": {"n_predict": params.n_predict, "seed": params.sampling.seed,
                                    "temperature": params.sampling.temperature, "top_k": params.sampling.top_k,
                                    "top_p": params.sampling.top_p, "min_p": params.sampling.min_p,
                                    "stop": list(params.stop), "stream": params.stream},
            "prompt": shown, "has_new_line": "\n" in res.text, "truncated": False,
            "stop_type": _STOP_TYPES.get(res.stop_type, "none"), "stopping_word": res.stopping_word,
            "tokens_cached": res.prompt_tokens + res.completion_tokens,
            "timings": timings(res.n_prompt_processed, res.prompt_ms, res.completion_tokens, res.decode_ms,
                               res.n_common),
        }

    ex = Exchange(state, engine, body, request, prepared, None, "infill", cid, owner)
    return await respond(
        ex,
        Answer(
            body=lambda slot_id, res: final(slot_id, res, res.text),
            events=lambda stream: StreamEvents(
                head=b"",
                delta=lambda text: sse_event({"index": 0, "content": text, "tokens": [], "stop": False,
                                              "id_slot": stream.slot_id}),
                done=lambda res: sse_event(final(stream.slot_id, res, "")),
                end=b"",  # llama-server's own stream ends with its final event
            ),
        ),
    )
