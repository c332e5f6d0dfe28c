"""The model's own metadata (issue 41): the GGUF's named chat templates (a request with tools
renders through ``tokenizer.chat_template.tool_use``), every end-of-generation token the
vocabulary marks (not only EOS) stops generation, and a template's special tokens reach the
reply parser as text whether the model writes them as one token or as text pieces."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from helpers import chat_plan, http
from hydra_trio.engine import SamplingParams
from hydra_trio.engine.chat import Chat, ChatTemplate, resolve_chat_template
from hydra_trio.engine.llama import LlamaBackend
from hydra_trio.engine.sample import Sampler
from hydra_trio.model.synthetic import BOS_ID, IM_END_ID, IM_START_ID, write_model

# ChatML with a mark saying which template rendered; the tool_use one lists the tools and
# teaches Hermes' <tool_call> syntax (so its caps differ from the default's).
_CHATML = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
DEFAULT_TPL = "{{ 'DEFAULT-TEMPLATE\\n' }}" + _CHATML
TOOL_USE_TPL = (
    "{{ 'TOOL-USE-TEMPLATE\\n' }}{%- if tools %}{{ '<|im_start|>system\\n<tools>' }}"
    "{%- for t in tools %}{{ t | tojson }}{%- endfor %}"
    "{{ '</tools>\\nCall as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}{%- endif %}"
    + _CHATML
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
# Word-piece ids respelled as the model's special tokens (the seed's weights stay).
TOOL_CALL_ID, TOOL_CALL_END_ID = 500, 501


@pytest.fixture(scope="module")
def variant_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("meta") / "variants.gguf", "tiny", chat_template=[
        {"name": "default", "template": DEFAULT_TPL}, {"name": "tool_use", "template": TOOL_USE_TPL}])


def _special_model(path: Path, seed: int = 0) -> Path:
    """<tool_call> and </tool_call> as control tokens, as in models whose tokenizer marks them
    special; its template teaches Hermes' syntax."""
    return write_model(path, "tiny", seed=seed, chat_template=TOOL_USE_TPL,
                       control_tokens={TOOL_CALL_ID: "<tool_call>", TOOL_CALL_END_ID: "</tool_call>"})


@pytest.fixture(scope="module")
def special_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _special_model(tmp_path_factory.mktemp("meta") / "special.gguf")


# ---- the GGUF's named templates ------------------------------------------------------


def test_gguf_carries_the_variants_as_llama_cpp_reads_them(variant_model: Path) -> None:
    import gguf

    fields = gguf.GGUFReader(variant_model).fields
    assert fields["tokenizer.chat_template"].contents() == DEFAULT_TPL
    assert fields["tokenizer.chat_template.tool_use"].contents() == TOOL_USE_TPL
    assert fields["tokenizer.chat_templates"].contents() == ["tool_use"]


def test_resolution_follows_llama_cpp() -> None:
    both = resolve_chat_template(name=None, file=None, gguf_template=DEFAULT_TPL, builtin_names=(),
                                 gguf_variants={"tool_use": TOOL_USE_TPL})
    assert both.for_request(False) is both and both.for_request(True).jinja == TOOL_USE_TPL
    # No default: the tool_use template serves everything.
    only = resolve_chat_template(name=None, file=None, gguf_template=None, builtin_names=(),
                                 gguf_variants={"tool_use": TOOL_USE_TPL})
    assert only.jinja == TOOL_USE_TPL and only.for_request(False) is only
    # A tool_use that does not compile is ignored (llama.cpp logs and ignores it).
    broken = resolve_chat_template(name=None, file=None, gguf_template=DEFAULT_TPL, builtin_names=(),
                                   gguf_variants={"tool_use": "{% if %}"})
    assert broken.tool_use is None and broken.for_request(True) is broken
    # An operator's template replaces the GGUF's, variants and all.
    inline = resolve_chat_template(name=_CHATML, file=None, gguf_template=DEFAULT_TPL, builtin_names=(),
                                   gguf_variants={"tool_use": TOOL_USE_TPL})
    assert inline.for_request(True) is inline


async def test_requests_with_tools_render_through_tool_use(
    start_engine: Any, variant_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="hydra_trio.engine.startup"):
        ep = await start_engine(variant_model, slots=1)
    assert "chat template: gguf (gguf, default); requests with tools: gguf:tool_use (tool_use)" in caplog.text
    async with http(ep) as h:
        plain = (await h.post("/apply-template", json={"messages": MESSAGES})).json()["prompt"]
        tools = (await h.post("/apply-template", json={"messages": MESSAGES, "tools": TOOLS})).json()["prompt"]
        empty = (await h.post("/apply-template", json={"messages": MESSAGES, "tools": []})).json()["prompt"]
        assert plain.startswith("DEFAULT-TEMPLATE") and empty.startswith("DEFAULT-TEMPLATE")
        assert tools.startswith("TOOL-USE-TEMPLATE") and '"get_weather"' in tools
        info = (await h.get("/version")).json()["chat_template"]
        assert info["variant"] == "default" and info["variants"] == ["tool_use"]
        assert info["tool_use"] == {"name": "gguf:tool_use", "source": "gguf", "variant": "tool_use"}
        # The call is written and read in the tool_use template's syntax (Hermes), not the
        # default's (generic JSON): forced, it parses into a call with JSON arguments.
        r = await h.post("/v1/chat/completions", json={
            "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 0})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        call = choice["message"]["tool_calls"][0]["function"]
        assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)


async def test_an_operator_template_has_no_tool_use_variant(
    start_engine: Any, variant_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / "mine.jinja"
    path.write_text("{{ 'MINE\\n' }}" + _CHATML)
    ep = await start_engine(variant_model, slots=1, chat_template_file=str(path))
    async with http(ep) as h:
        tools = (await h.post("/apply-template", json={"messages": MESSAGES, "tools": TOOLS})).json()["prompt"]
        assert tools.startswith("MINE")
        assert "tool_use" not in (await h.get("/version")).json()["chat_template"]


# ---- end-of-generation tokens ----------------------------------------------------------


def _backend(model: Path) -> LlamaBackend:
    return LlamaBackend(str(model), n_slots=1, n_ctx=256, n_threads=1, n_batch=64, kv_unified=True)


def _first_greedy(model: Path, prompt: list[int]) -> int:
    b = _backend(model)
    sampler = Sampler(SamplingParams())
    try:
        token, _ = b.eval_chunk(0, prompt, None, sampler=sampler)
        assert token is not None
        return token
    finally:
        sampler.close()
        b.close()


def test_the_vocabulary_s_named_eog_tokens_are_eog(tmp_path: Path) -> None:
    """llama_vocab_is_eog's set, read at load: EOS, and the turn ends llama.cpp knows by name."""
    names = {400: "<|eot_id|>", 401: "<|eom_id|>", 402: "<end_of_turn>", 403: "<|not_an_end|>"}
    b = _backend(write_model(tmp_path / "eog.gguf", "tiny", control_tokens=names))
    try:
        assert b.info.eos == IM_END_ID
        assert {IM_END_ID, 400, 401, 402} <= b.eog_ids and 403 not in b.eog_ids and IM_START_ID not in b.eog_ids
    finally:
        b.close()


@pytest.fixture(scope="module")
def eog_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], int]:
    """A model, a prompt (token ids) and the word piece it generates first: that piece is
    marked as an EOG token in the models of the test (the weights stay the seed's)."""
    d = tmp_path_factory.mktemp("eog")
    base = write_model(d / "base.gguf", "tiny")
    b = _backend(base)
    try:
        for text in ("hello world", "the model", "a request", "server stream", "tool code"):
            prompt = b.tokenize(text, add_special=True)
            first = _first_greedy(base, prompt)
            if first >= 261 + 5:  # a word piece, not a control or byte token
                return base, prompt, first
    finally:
        b.close()
    raise AssertionError("no prompt starts with a word piece")


@pytest.mark.parametrize("how", ["named <|eot_id|>", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.eot_token_id"])
async def test_generation_stops_on_an_eog_token_that_is_not_eos(
    start_engine: Any, eog_case: tuple[Path, list[int], int], tmp_path: Path, how: str
) -> None:
    base, prompt, first = eog_case
    if how.startswith("named"):
        marked = write_model(tmp_path / "m.gguf", "tiny", control_tokens={first: "<|eot_id|>"})
    else:
        marked = write_model(tmp_path / "m.gguf", "tiny", extra_kv={how: first})
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    ep_base = await start_engine(base, slots=1)
    async with http(ep_base) as h:
        unmarked = (await h.post("/v1/completions", json=body)).json()
    assert unmarked["usage"]["completion_tokens"] == 8  # the same first token does not stop it
    ep = await start_engine(marked, slots=1)
    async with http(ep) as h:
        r = (await h.post("/v1/completions", json=body)).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 0, r


# ---- special tokens in the tool syntax -------------------------------------------------


def _chat(backend: LlamaBackend, template: ChatTemplate) -> Chat:
    async def no_worker(fn: Any) -> str:
        return fn()

    return Chat(template, tool_call_parser="auto", reasoning_format="auto", bos_token="<s>", eos_token="<|im_end|>",
                tokenizer_adds_bos=True, run_on_worker=no_worker, apply_builtin=lambda *_: "",
                special_text=backend.vocabulary.special, unshown=backend.eog_ids | {backend.info.bos})


@pytest.mark.parametrize("as_one_token", [True, False])
def test_tool_syntax_parses_as_one_special_token_or_as_text_pieces(special_model: Path, as_one_token: bool) -> None:
    b = _backend(special_model)
    try:
        template = resolve_chat_template(name=None, file=None, gguf_template=b.info.chat_template, builtin_names=())
        chat = _chat(b, template)
        request = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
        plan = chat_plan(chat, request)
        shown = plan.shown_tokens
        # The syntax tokens are shown; turn markers, BOS and EOG are not.
        assert {TOOL_CALL_ID, TOOL_CALL_END_ID} <= shown
        assert IM_START_ID not in shown and BOS_ID not in shown and IM_END_ID not in shown
        reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        tokens = b.tokenize(reply, add_special=False, parse_special=as_one_token)
        assert (TOOL_CALL_ID in tokens) is as_one_token
        make = plan.replies
        assert make is not None

        def calls(text_of: Any) -> list[Any]:
            parser = make()
            text = b"".join(text_of(t) for t in tokens).decode()
            return [(c.name, c.arguments) for c in (*parser.feed(text).tool_calls, *parser.finish().tool_calls)]

        assert calls(b.text_of(shown)) == [("get_weather", '{"city":"Paris"}')]
        if as_one_token:
            # Without the template's syntax tokens shown, the special token adds no text and
            # the call is lost: what this engine did before.
            assert calls(b.token_bytes) == []
    finally:
        b.close()


# A forced call's opening literal is written as the template's one special token: llguidance
# lets a forced literal through only as the vocabulary spells it (the view's longest token for
# its bytes), which is the spelling the model was trained on. A model that writes the markup as
# text pieces, unforced, is read the same (the test above).
@pytest.mark.parametrize("seed", [0, 37])
async def test_a_forced_call_parses_on_a_model_with_special_tool_tokens(
    start_engine: Any, tmp_path: Path, seed: int
) -> None:
    ep = await start_engine(_special_model(tmp_path / "special.gguf", seed), slots=1)
    async with http(ep) as h:
        r = await h.post("/v1/chat/completions", json={
            "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 200, "temperature": 0, "logprobs": True})
        choice = r.json()["choices"][0]
        first = choice["logprobs"]["content"][0]
        assert first["token"] == "<tool_call>" and first["logprob"] == 0.0  # the one token the grammar allows
        assert choice["finish_reason"] == "tool_calls", choice
        call = choice["message"]["tool_calls"][0]["function"]
        assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)
