"""Chat templates (--chat-template NAME, --chat-template-file, the GGUF's own) used alike by
HTTP chat, PREFILL and DECODE, and llama-server's /tokenize, /detokenize, /apply-template."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers import (
    ENGINE,
    MESSAGES,
    OTHER_MESSAGES,
    assert_openai_error,
    assert_server_healthy,
    decode_ok,
    frame,
    get_result,
    http,
    kv_meta,
    prefill,
    rpc,
    text_of,
)
from hydra_trio.engine.chat import resolve_chat_template
from hydra_trio.wire import parse_kv_blob

CHATML_HELLO = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
GEMMA_HELLO = "<start_of_turn>user\nhello world<end_of_turn>\n<start_of_turn>model\n"


async def apply_template(c: Any, messages: list[dict[str, Any]], **extra: Any) -> str:
    r = await c.post("/apply-template", json={"messages": messages, **extra})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


async def tokenize(c: Any, content: str, **extra: Any) -> list[Any]:
    r = await c.post("/tokenize", json={"content": content, **extra})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


async def test_gguf_template_and_token_routes(engine: Any) -> None:
    async with http(engine) as c:
        assert await apply_template(c, MESSAGES) == CHATML_HELLO
        assert await apply_template(
            c, MESSAGES, add_generation_prompt=False
        ) == CHATML_HELLO.removesuffix("<|im_start|>assistant\n")
        version = (await c.get("/version")).json()
        assert version["chat_template"] == {"name": "gguf", "source": "gguf"}

        plain = await tokenize(c, CHATML_HELLO)
        with_bos = await tokenize(c, CHATML_HELLO, add_special=True)
        bos = engine.state.engine._core.backend.info.bos
        assert with_bos == [bos, *plain]
        # Special tokens are parsed by default (one id for <|im_start|>), not when asked not to.
        assert len(await tokenize(c, "<|im_start|>", parse_special=False)) > len(
            await tokenize(c, "<|im_start|>")
        )

        pieces = await tokenize(c, CHATML_HELLO, with_pieces=True)
        assert [p["id"] for p in pieces] == plain
        assert all(isinstance(p["piece"], str) for p in pieces)
        text = "".join(p["piece"] for p in pieces)
        assert "<|im_start|>" in text and "hello" in text

        r = await c.post("/detokenize", json={"tokens": plain})
        assert r.status_code == 200, r.text
        assert r.json() == {"content": text, "prompt": text}  # llama-server's key and vLLM's
        assert (await c.post("/detokenize", json={"tokens": []})).json() == {"content": "", "prompt": ""}

        # HTTP chat counts exactly the tokens of the rendered prompt (BOS included).
        chat = (
            await c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        ).json()
        assert chat["usage"]["prompt_tokens"] == len(with_bos)


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/tokenize", {}, "content must be a string"),
        ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
        ("/tokenize", {"content": "x", "with_pieces": 1}, "with_pieces"),
        ("/detokenize", {"tokens": "abc"}, "tokens must be"),
        ("/detokenize", {"tokens": [-1]}, "outside the vocabulary"),
        ("/apply-template", {}, "messages is required"),
        ("/apply-template", {"messages": []}, "non-empty"),
        ("/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ],
)
async def test_token_route_errors(
    engine: Any, path: str, body: dict[str, Any], needle: str
) -> None:
    async with http(engine) as c:
        err = assert_openai_error(await c.post(path, json=body), 400)
        assert needle in err["error"]["message"], err


async def _same_prompt_everywhere(
    ep: Any, messages: list[dict[str, Any]], expected_prompt: str
) -> None:
    """/apply-template, HTTP chat, PREFILL and DECODE (in the slot, and with the blob in the
    other slot) all use the configured template: same prompt tokens, same greedy text."""
    async with http(ep) as c:
        assert await apply_template(c, messages) == expected_prompt
        n_prompt = len(await tokenize(c, expected_prompt, add_special=True))
        chat = (
            await c.post(
                "/v1/chat/completions",
                json={"messages": messages, "max_tokens": 8, "temperature": 0},
            )
        ).json()
        assert chat["usage"]["prompt_tokens"] == n_prompt
        async with await rpc(ep) as r:
            pre = await prefill(r, 0, messages)
            assert pre.meta["n_past"] == n_prompt
            in_slot = await get_result(c, await decode_ok(r, 0, frame(messages, n_predict=8)))
            moved = await get_result(
                c,
                await decode_ok(
                    r, 1, frame(messages, pre.payload, n_predict=8, kv_metadata=kv_meta(pre))
                ),
            )
        for res in (in_slot, moved):
            assert text_of(res) == chat["choices"][0]["message"]["content"]
            assert res["usage"]["prompt_tokens"] == n_prompt
            assert res["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"]


async def test_builtin_template_used_by_chat_prefill_and_decode(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    ep = await start_engine(tiny_model_ctx, chat_template="gemma", **ENGINE)
    async with http(ep) as c:
        assert (await c.get("/version")).json()["chat_template"] == {
            "name": "gemma",
            "source": "builtin",
        }
        # Built-in templates render role/content only: tools are described in a system
        # message (the generic format), which Gemma's turns fold into the first user turn.
        r = await c.post("/apply-template", json={"messages": MESSAGES, "tools": [{"type": "function"}]})
        assert assert_openai_error(r, 400)["error"]["param"] == "tools[0].function"
        tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
        r = await c.post("/apply-template", json={"messages": MESSAGES, "tools": [tool]})
        assert r.status_code == 200, r.text
        prompt = r.json()["prompt"]
        assert prompt.startswith("<start_of_turn>user\nYou "
                                 "can call the following tools") and '"name": "lookup"' in prompt
    await _same_prompt_everywhere(ep, MESSAGES, GEMMA_HELLO)


async def test_template_file_used_by_chat_prefill_and_decode(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, tmp_path: Path
) -> None:
    tpl = tmp_path / "plain.jinja"
    tpl.write_text(
        "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    )
    ep = await start_engine(tiny_model_ctx, chat_template_file=str(tpl), **ENGINE)
    async with http(ep) as c:
        assert (await c.get("/version")).json()["chat_template"] == {
            "name": str(tpl),
            "source": "file",
        }
    await _same_prompt_everywhere(
        ep, OTHER_MESSAGES, "SYSTEM: be brief\nUSER: tell me a story\nASSISTANT:"
    )


def test_resolve_chat_template_choices_and_errors(tmp_path: Path) -> None:
    builtins = ["chatml", "gemma", "llama3"]
    assert (
        resolve_chat_template(
            name=None, file=None, gguf_template=None, builtin_names=builtins
        ).source
        == "fallback"
    )
    assert (
        resolve_chat_template(
            name=None, file=None, gguf_template="{{ x }}", builtin_names=builtins
        ).source
        == "gguf"
    )
    got = resolve_chat_template(
        name="llama3", file=None, gguf_template="{{ x }}", builtin_names=builtins
    )
    assert (got.name, got.source, got.builtin, got.jinja) == ("llama3", "builtin", "llama3", None)
    inline = resolve_chat_template(
        name="{{ messages[0]['content'] }}", file=None, gguf_template=None, builtin_names=builtins
    )
    assert inline.source == "inline" and inline.jinja
    with pytest.raises(
        SystemExit, match=r"not a llama\.cpp built-in template; built-ins: chatml, gemma, llama3"
    ):
        resolve_chat_template(name="nope", file=None, gguf_template=None, builtin_names=builtins)
    with pytest.raises(SystemExit, match="cannot read it"):
        resolve_chat_template(
            name=None,
            file=str(tmp_path / "missing.jinja"),
            gguf_template=None,
            builtin_names=builtins,
        )
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(SystemExit, match="not a valid Jinja template"):
        resolve_chat_template(name=None, file=str(bad), gguf_template=None, builtin_names=builtins)


async def test_template_bos_is_not_doubled(
    start_engine: Callable[..., Any], tiny_model: Path, tmp_path: Path
) -> None:
    """A template that writes BOS itself (as Gemma's and Llama 3's do) on a tokenizer that adds
    BOS: the prompt holds exactly one BOS."""
    tpl = tmp_path / "bos.jinja"
    tpl.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    ep = await start_engine(tiny_model, chat_template_file=str(tpl), **ENGINE)
    bos = ep.state.engine._core.backend.info.bos
    async with http(ep) as c:
        assert await apply_template(c, MESSAGES) == "hello world\n"
        async with await rpc(ep) as r:
            pre = await prefill(r, 0, MESSAGES)
    tokens = parse_kv_blob(pre.payload[: len(pre.payload) - 4 * ep.state.engine.n_vocab]).tokens
    assert tokens[0] == bos and bos not in tokens[1:]


async def test_work_per_request_is_bounded_before_it_starts(start_engine: Any, tiny_model: Path) -> None:
    """What no slot could hold is refused before any per-token work: a /detokenize of more
    ids than all slots hold (413), text longer than a slot could ever take at 32 bytes a
    position (/tokenize, a completion: 413 TOO_LARGE, nothing tokenized), and a chunked body
    over --max-json-bytes, counted as it arrives (413)."""
    ep = await start_engine(tiny_model, max_json_bytes=1 << 20)
    engine = ep.state.engine
    async with http(ep) as c:
        calls = engine._core.worker.calls
        r = await c.post("/detokenize", json={"tokens": [1] * (engine.n_ctx + 1)})
        assert_openai_error(r, 413)
        too_long = "x" * (32 * engine.n_ctx_slot + 1)
        for path, body in (("/tokenize", {"content": too_long}), ("/v1/completions", {"prompt": too_long})):
            err = assert_openai_error(await c.post(path, json=body), 413)
            assert "refused untokenized" in err["error"]["message"], err
        assert engine._core.worker.calls == calls  # no GPU-worker call for any of them
        # Detokenizing a slot's worth needs no GPU-worker call either.
        ids = [t["id"] for t in await tokenize(c, "hello world <|im_start|>", with_pieces=True)]
        back = (await c.post("/detokenize", json={"tokens": ids})).json()["content"]
        assert back.lstrip() == "hello world <|im_start|>"  # the control token spelled out

        async def chunked() -> Any:
            for _ in range(40):
                yield b" " * 65536  # 2.5 MB of whitespace, no Content-Length

        r = await c.post("/tokenize", content=chunked(), headers={"Content-Type": "application/json"})
        assert_openai_error(r, 413)
    await assert_server_healthy(ep)


async def test_vllm_render_and_tokenize_give_the_tokens_a_completion_runs(engine: Any) -> None:
    """vllm-router's kv_aware policy asks for the token ids of a request (the render routes,
    else vLLM's /tokenize shape): exactly the prompt the completion then runs."""
    other = [{"role": "user", "content": "what does the slot hold"}]
    async with http(engine) as c:
        chat = (await c.post("/v1/chat/completions", json={"messages": other, "max_tokens": 2})).json()
        done = (await c.post("/v1/completions", json={"prompt": "the slot cache", "max_tokens": 2})).json()
        rendered = (await c.post("/v1/chat/completions/render", json={"model": "m", "messages": other})).json()
        text = (await c.post("/v1/completions/render", json={"model": "m", "prompt": "the slot cache"})).json()
        assert len(rendered["token_ids"]) == rendered["count"] == chat["usage"]["prompt_tokens"]
        assert len(text["token_ids"]) == done["usage"]["prompt_tokens"]
        assert rendered["max_model_len"] == engine.state.engine.n_ctx_slot
        vllm = (await c.post("/tokenize", json={"model": "m", "messages": other})).json()
        assert vllm["tokens"] == rendered["token_ids"] and vllm["count"] == len(vllm["tokens"])
        assert (await c.post("/tokenize", json={"prompt": "the slot cache"})).json()["tokens"] == text["token_ids"]
        # llama-server's shape is unchanged; /detokenize answers both shapes' key.
        assert await tokenize(c, "the slot cache", add_special=True) == text["token_ids"]
        back = (await c.post("/detokenize", json={"model": "m", "tokens": text["token_ids"][1:]})).json()
        assert back["prompt"] == back["content"] and "slot cache" in back["prompt"]
        for path, body in (
            ("/v1/chat/completions/render", {"prompt": "x"}),
            ("/v1/completions/render", {"messages": other}),
        ):
            assert_openai_error(await c.post(path, json=body), 400)
