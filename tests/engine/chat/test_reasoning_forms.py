"""Reasoning written other than between a pair of think tags (issue 41): Apriel 1.6's
reasoning before ``[BEGIN FINAL RESPONSE]``, opened by its prompt's "Here are my reasoning
steps:", and Upstage Solar Open's ``<|think|>…<|end|>`` before a repeated assistant header
and its ``<|content|>…<|end|>`` wrapper. Each reply is read through the chat room made from a
template with the corpus template's markers (caps, reply parser, think plan), whole and
streamed split anywhere; the expected outputs restate llama.cpp's tests where it has them.
Granite 3.3's ``<response>`` is left in content as llama.cpp leaves it (its test of the
wrapper is pending), so it has no case here. Pure."""

from __future__ import annotations

import json
from typing import Any

import pytest

from helpers import chat_plan
from hydra_trio.engine.chat import Chat, ChatTemplate
from hydra_trio.engine.chat.caps import detect_think_tags

# The corpus templates' markers, in the places they have them there.
APRIEL_16 = (
    "{{ '<|begin_system|>\\nAnalyze each question carefully, then provide the final response after the marker "
    "[BEGIN FINAL RESPONSE].' }}{% if tools %}Return calls within <tool_calls>[{\"name\": ..., \"arguments\": "
    "...}]</tool_calls>"
    "{% endif %}{% set reasoning_asst_turn_start = 'Here are my reasoning steps:\\n' %}"
    "{% for m in messages %}{% if m.role == 'user' %}{{ '\\n<|begin_user|>\\n' + m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n<|begin_assistant|>\\n' + reasoning_asst_turn_start }}{% endif %}"
)
APRIEL_15 = (  # names the final response's markers too, but its prompt opens no reasoning
    "{{ '<|system|>\\nprovide the final solution in the following format: [BEGIN FINAL RESPONSE] ... [END FINAL "
    "RESPONSE].' }}"
    "{% if tools %}<tool_calls>[{\"name\": ...}]</tool_calls>{% endif %}"
    "{% for m in messages %}{{ '<|user|>\\n' + m.content + '\\n<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SOLAR = (
    "{% for m in messages %}{{ '<|begin|>' + m.role + '<|content|>' + m.content + '<|end|>' }}{% endfor %}"
    "{% if tools %}<|tool_call:begin|><tool-call-id><|tool_call:name|><tool-name><|tool_call:args|>{% endif %}"
    "{% if add_generation_prompt %}{% if reasoning_effort in ['low', 'minimal'] %}"
    "{{ '<|begin|>assistant<|think|><|end|>' }}{% endif %}{{ '<|begin|>assistant' }}{% endif %}"
)
USER = [{"role": "user", "content": "Hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "special_function",
            "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"}}},
        },
    }
]
ONE = [("special_function", {"arg1": 1})]


async def _no_worker(fn: Any) -> Any:
    return fn()


def _no_builtin(*_: Any) -> str:
    raise AssertionError("Jinja only")


def chat_for(source: str) -> Chat:
    return Chat(
        ChatTemplate(name="t", source="inline", jinja=source),
        tool_call_parser="auto",
        reasoning_format="auto",
        bos_token="",
        eos_token="",
        tokenizer_adds_bos=False,
        run_on_worker=_no_worker,
        apply_builtin=_no_builtin,
    )


def read(source: str, reply: str, *, tools: bool = False, **req: Any) -> tuple[str, str, list[Any]]:
    """(content, reasoning, calls) of ``reply`` to a request rendered through ``source``, the
    same whole, a character at a time and split in two anywhere."""
    chat = chat_for(source)
    body = {"messages": USER, **({"tools": TOOLS} if tools else {}), **req}
    make = chat_plan(chat, body).replies
    if make is None:  # nothing to read: the text is the content as it stands
        return reply, "", []
    results = set()
    for pieces in [[reply], list(reply), *([reply[:k], reply[k:]] for k in range(len(reply) + 1))]:
        parser = make()
        deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
        calls = tuple((c.name, c.arguments) for d in deltas for c in d.tool_calls)
        results.add(("".join(d.content for d in deltas), "".join(d.reasoning for d in deltas), calls))
    assert len(results) == 1, results
    content, reasoning, calls = results.pop()
    return content, reasoning, [(n, json.loads(a)) for n, a in calls]


# ---- Apriel 1.6 -------------------------------------------------------------------------------

LEAD = "Here are my reasoning steps:"


def test_apriel_16s_reasoning_is_what_comes_before_its_final_response() -> None:
    """llama.cpp's "reasoning-only support" test: the prompt ends with "Here are my reasoning
    steps:\\n", the reply goes on with the reasoning and ``[BEGIN FINAL RESPONSE]`` starts the
    answer; llama.cpp reads the generation prompt with the reply, so the reasoning reported
    begins with the prompt's words."""
    assert read(APRIEL_16, "I'm\nthinking\n[BEGIN FINAL RESPONSE]\nHello, world!\nWhat's up?") == (
        "Hello, world!\nWhat's up?", LEAD + "\nI'm\nthinking", [])
    # its reasoning, then a call (llama.cpp's second case)
    assert read(APRIEL_16, 'I\'m\nthinking\n[BEGIN FINAL RESPONSE]\n<tool_calls>[{"name": "special_function", '
                '"arguments": '
                '{"arg1": 1}}]</tool_calls>', tools=True) == ("", LEAD + "\nI'm\nthinking", ONE)
    # ours: no reasoning of its own (the lead alone, trimmed as llama.cpp trims reasoning), and
    # a reply cut inside the reasoning (all of it reasoning)
    assert read(APRIEL_16, "[BEGIN FINAL RESPONSE]\nHi") == ("Hi", LEAD, [])
    assert read(APRIEL_16, "Still thinking") == ("", LEAD + "\nStill thinking", [])
    # reasoning_format none: the text as written
    assert read(APRIEL_16, "I'm\nthinking\n[BEGIN FINAL RESPONSE]\nHi", reasoning_format="none") == (
        "I'm\nthinking\n[BEGIN FINAL RESPONSE]\nHi", "", [])


def test_apriel_15_has_no_reasoning_split() -> None:
    """Apriel 1.5's template names the markers in its system prompt, but its prompt opens no
    reasoning: llama.cpp reads its reply as content, and so do we."""
    assert detect_think_tags(APRIEL_15) is None
    assert detect_think_tags(APRIEL_16) == (LEAD, "[BEGIN FINAL RESPONSE]")
    assert read(APRIEL_15, "Hello, world!\nWhat's up?") == ("Hello, world!\nWhat's up?", "", [])


def test_a_forced_apriel_16_call_waits_for_the_final_response() -> None:
    """The prompt opens the reasoning: a forced call's grammar is held until the model (or the
    budget) writes ``[BEGIN FINAL RESPONSE]`` (llama/thinking.py)."""
    chat = chat_for(APRIEL_16)
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    plan = chat_plan(chat, body, budget=24).think
    assert plan is not None and plan.starts_in_reasoning and plan.holds_grammar
    assert plan.close_text == b"[BEGIN FINAL RESPONSE]"


# ---- Upstage Solar Open --------------------------------------------------------------------------

def test_solars_reasoning_and_content_wrapper() -> None:
    """Solar's reply after ``<|begin|>assistant``: ``<|think|>`` reasoning ``<|end|>``, then
    the assistant header again and ``<|content|>`` answer ``<|end|>`` (or its calls). llama.cpp
    derives the content wrapper (its analysis finds ``<|content|>`` … ``<|end|>`` around
    content) and drops it; its reasoning it does not find (the template prints an earlier
    turn's ``message.reasoning``, which llama.cpp never sets), so llama-server leaves the think
    block in content. Ours splits it: the template's own form."""
    said = "<|think|>I'm\nthinking<|end|><|begin|>assistant<|content|>Hello, world!\nWhat's up?<|end|>"
    assert read(SOLAR, said) == ("Hello, world!\nWhat's up?", "I'm\nthinking", [])
    assert read(SOLAR, "<|content|>Hello, world!<|end|>") == ("Hello, world!", "", [])
    assert read(SOLAR, "<|content|>Hello, world!<|end|>", reasoning_format="none") == ("Hello, world!", "", [])
    call = (
        '<|tool_calls|><|tool_call:begin|>a1b2c3d4e5<|tool_call:name|>special_function<|tool_call:args|>{"arg1": '
        "1}<|tool_call:end|>"
    )
    assert read(SOLAR, "<|think|>plan<|end|><|begin|>assistant" + call, tools=True) == ("", "plan", ONE)
    assert read(SOLAR, "<|content|>On it.<|end|><|begin|>assistant" + call, tools=True) == ("On it.", "", ONE)
    # reasoning_effort low: the prompt closes an empty think block and asks for the answer
    assert read(SOLAR, "<|content|>Hi<|end|>", reasoning_effort="low") == ("Hi", "", [])


def test_solars_think_tag_is_not_gemma_4s() -> None:
    """Gemma 4's templates name ``<|think|>`` too; theirs stays their thought channel."""
    assert detect_think_tags(SOLAR) == ("<|think|>", "<|end|>")
    assert detect_think_tags("{{ '<|think|>' }}{{ '<|channel>thought\\n' "
                             "+ r + '<channel|>' }}") == ("<|channel>thought", "<channel|>")


@pytest.mark.parametrize("thinking", [False, True])
def test_a_forced_solar_call_parses_with_thinking_on_or_off(thinking: bool) -> None:
    """Forced (``required``): without thinking the grammar writes the calls from the first
    token; with ``enable_thinking`` the engine opens ``<|think|>`` and holds the grammar until
    ``<|end|>``; either reply is read back as its calls."""
    chat = chat_for(SOLAR)
    body: dict[str, Any] = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    if thinking:
        body["chat_template_kwargs"] = {"enable_thinking": True}
    plan = chat_plan(chat, body).think
    call = (
        '<|tool_calls|><|tool_call:begin|>1<|tool_call:name|>special_function<|tool_call:args|>{"arg1": '
        "1}<|tool_call:end|>"
    )
    if thinking:
        assert plan is not None and plan.force_open and plan.holds_grammar and plan.close_text == b"<|end|>"
        assert read(SOLAR, "<|think|>plan<|end|>" + call, tools=True, tool_choice="required",
                    chat_template_kwargs={"enable_thinking": True}) == ("", "plan", ONE)
    else:
        assert plan is None
        assert read(SOLAR, call, tools=True, tool_choice="required") == ("", "", ONE)
