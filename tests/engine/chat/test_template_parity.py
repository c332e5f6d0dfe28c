"""Templates render as llama-server renders them (issue 41): one small inline template of
our own per class of difference found against llama.cpp's corpus. Pure: no engine, no model."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest

from hydra_trio.engine.chat import ChatRequestError, ChatTemplate, template_caps
from hydra_trio.engine.chat.render import render_prompt

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def render(source: str, **request: Any) -> str:
    caps = template_caps(ChatTemplate(name="t", source="inline", jinja=source))
    return render_prompt(request, source, caps, bos_token="<s>", eos_token="</s>")


def test_arguments_go_as_an_object_where_the_template_iterates_them() -> None:
    # Walking ``arguments.items()`` on text was a 500 TypeError (Qwen3-Coder, GLM, MiniMax).
    src = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
           "{% for k, v in c.function.arguments.items() %}<{{ k }}={{ v }}>{% endfor %}{% endfor %}{% endfor %}")
    out = render(
        src, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    )
    assert out == "<city=Paris>"
    assert template_caps(ChatTemplate(name="t", source="inline", jinja=src)).object_arguments


def test_arguments_stay_text_where_the_template_prints_them() -> None:
    src = "{% for m in messages %}{% for c in m.tool_calls or [] %}[{{ c.function.arguments }}]{% endfor %}{% endfor %}"
    out = render(
        src, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    )
    assert out == '[{"city": "Paris"}]'


def test_strftime_now_and_todays_dates() -> None:
    src = "{{ strftime_now('%Y-%m-%d') }}|{{ date_string }}|{{ datetime }}"
    out = render(src, messages=[{"role": "user", "content": "hi"}])
    today = datetime.now()
    assert out.split("|")[0] == today.strftime("%Y-%m-%d")
    assert out.split("|")[1] == today.strftime("%d %b %Y")


def test_chat_template_kwargs_and_enable_thinking_reach_the_template() -> None:
    src = "{{ 'T' if enable_thinking else 'F' }}{{ flavour | default('-') }}"
    msgs = [{"role": "user", "content": "hi"}]
    assert render(src, messages=msgs) == "F-"  # no reasoning form: off by default, as llama-server
    assert render(src, messages=msgs, chat_template_kwargs={"enable_thinking": True, "flavour": "x"}) == "Tx"
    with pytest.raises(ChatRequestError):
        render(src, messages=msgs, chat_template_kwargs=["no"])


def test_enable_thinking_defaults_on_for_a_template_with_a_reasoning_form() -> None:
    src = ("{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
           "{{ m.content }}{% endfor %}{{ 'T' if enable_thinking else 'F' }}")
    assert render(src, messages=[{"role": "user", "content": "hi"}]).endswith("T")
    # Earlier reasoning is kept (llama-server's preserve_reasoning default).
    keep = ("{% for m in messages %}{% if not clear_thinking and m.reasoning_content %}"
            "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}{% endfor %}")
    out = render(
        keep,
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}],
    )
    assert out == "q<think>r</think>a"


def test_tools_in_llama_servers_order_and_only_when_given() -> None:
    src = "{% if tools is defined %}{{ tools | tojson }}{% else %}none{% endif %}"
    assert render(src, messages=[{"role": "user", "content": "hi"}]) == "none"
    out = json.loads(render(src, messages=[{"role": "user", "content": "hi"}], tools=TOOLS))
    assert list(out[0]) == ["type", "function"] and list(out[0]["function"]) == ["name", "description", "parameters"]


def test_the_jinja_llama_cpp_offers() -> None:
    # break/continue, {% generation %}, list.append, | safe without HTML escaping, tojson options.
    src = ("{% set xs = [] %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
           "{% generation %}{{ m.content }}{% endgeneration %}{% do xs.append(1) if false %}{% endfor %}"
           "{% set ys = [] %}{{ ys.append(2) or '' }}{{ ys | length }}"
           "{{ 'a' | safe + {'k': 'é'} | tojson }}{{ {'k': 'é'} | tojson(ensure_ascii=True) }}"
           "{{ messages | map(attribute='role') | tojson }}")
    out = render(src.replace("{% do xs.append(1) if false %}", ""),
                 messages=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    assert out == 'one1a{"k": "é"}{"k": "\\u00e9"}["user", "user"]'


def test_a_system_message_the_template_refuses_opens_the_next() -> None:
    src = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
           "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}")
    out = render(src, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert out == "[user:be brief\nhi]"


def test_no_generic_description_for_a_template_of_the_models_own() -> None:
    # A Jinja template that lists the tools renders with nothing of ours added.
    src = (
        "{% for t in tools or [] %}<tool>{{ t.function.name }}</tool>{% endfor %}{% for m in messages %}{{ m.content "
        "}}{% endfor %}"
    )
    out = render(src, messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    assert out == "<tool>get_weather</tool>hi"
    # The ChatML fallback (no template at all) still describes them.
    fallback = template_caps(ChatTemplate(name="chatml-fallback", source="fallback", jinja=None))
    assert fallback.describes_tools


def test_a_gguf_template_that_does_not_compile_falls_back_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    from hydra_trio.engine.chat import resolve_chat_template

    tpl = resolve_chat_template(name=None, file=None, gguf_template="{% if %}", builtin_names=())
    assert tpl.source == "fallback" and tpl.jinja is not None
    assert "does not compile" in tpl.as_dict()["fallback_reason"]
    assert "serving ChatML" in caplog.text
    assert (
        render(tpl.jinja, messages=[{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


THOUGHT = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
    {"role": "user", "content": "and 3+3?"},
]


def test_lfm2_templates_read_the_reasoning_as_thinking() -> None:
    """llama.cpp's LFM2/LFM2.5 handler copies reasoning_content to ``thinking`` (the field the
    template reads); it knows the template by its tool-list markup."""
    src = ("{# List of tools: [ #}{% for m in messages %}{% if m.thinking is defined %}<think>{{ m.thinking }}</think>"
           "{% endif %}{{ m.content }}|{% endfor %}")
    assert render(src, messages=THOUGHT) == "2+2?|<think>Two and two.</think>4|and 3+3?|"
    plain = src.replace("{# List of tools: [ #}", "")
    assert render(plain, messages=THOUGHT) == "2+2?|4|and 3+3?|"  # another template: as given


def test_ministral3_templates_read_content_as_blocks_with_a_thinking_block_first() -> None:
    """llama.cpp's Ministral / Magistral Large 3 handler hands system and assistant content as
    blocks, the reasoning as a ``thinking`` block before the text, and no reasoning_content."""
    src = ("{# [SYSTEM_PROMPT] [TOOL_CALLS] [ARGS] #}{% for m in messages %}{% if m.content is string %}{{ m.content }}"
           "{% else %}{% for b in m.content %}{% if b.type == 'thinking' %}[THINK]{{ b.thinking }}[/THINK]"
           "{% else %}{{ b.text }}{% endif %}{% endfor %}{% endif %}{{ m.reasoning_content is defined }}|{% endfor %}")
    assert render(src, messages=THOUGHT) == "2+2?False|[THINK]Two and two.[/THINK]4False|and 3+3?False|"
    mistral32 = src.replace("[ARGS] #}", "[ARGS] [CALL_ID] #}")  # Mistral Small 3.2: not this handler's
    assert render(mistral32, messages=THOUGHT) == "2+2?False|4True|and 3+3?False|"


def test_gemma4s_older_templates_read_a_calls_results_from_the_model_turn() -> None:
    """llama.cpp's workaround for Gemma 4 templates without the OpenAI-compatible header:
    the call, its results and the reply after them are one assistant turn with tool_responses."""
    src = ("{# '<|tool_call>call:' #}{% for m in messages %}{{ m.role }}:{{ m.content or '' }}"
           "{% for r in m.tool_responses or [] %}<{{ r.name }}={{ r.response.t }}>{% endfor %}|{% endfor %}")
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"t": 21}'},
        {"role": "assistant", "content": "21 C"},
    ]
    assert render(src, messages=msgs) == "user:weather?|assistant:21 C<get_weather=21>|"
    newer = src.replace("#}", "{#- OpenAI Chat Completions: #}")  # the current template reads role tool itself
    assert render(newer, messages=msgs) == "user:weather?|assistant:|tool:{\"t\": 21}|assistant:21 C|"
