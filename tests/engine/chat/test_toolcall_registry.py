"""The roster of tool-call families (engine/chat/families/): every family the engine knows is
registered there and read from there only. The order templates are told apart in is the
roster's, the first thirty families' rules exactly as caps.py held them by hand; a name or a
priority is registered once; --tool-call-parser takes every registered name and lists them
all in its help, and an unknown one stops the start with a clear error. Pure, bar one CLI
process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hydra_trio.cli import CHOICES, build_parser
from hydra_trio.config import settings_from
from hydra_trio.engine import TOOL_CALL_PARSERS as FACE_PARSERS
from hydra_trio.engine.chat import TOOL_CALL_PARSERS, ChatTemplate, template_caps
from hydra_trio.engine.chat.caps import detect_format
from hydra_trio.engine.chat.families import (
    Detect,
    ToolFormat,
    by_name,
    detection_order,
    formats,
    register,
)
from hydra_trio.engine.chat.formats import FORMATS, GENERIC

ROOT = Path(__file__).resolve().parents[3]

# caps.py's hand-kept marker list before the roster (most specific first), then its llama3
# fallback: the roster holds these rules in this order, whatever families come between them.
BEFORE_THE_ROSTER: list[tuple[tuple[str, ...], str]] = [
    (("<|channel|>", "<|message|>"), "harmony"),
    (("<atem:function_calls>", "<|eom|>"), "muse_glimmer"),
    (("<|tool_calls_section_begin|>",), "kimi_k2"),
    (("<|open|>", "<|close|>", "<|end_of_msg|>"), "kimi_k3"),
    (("｜DSML｜",), "deepseek_dsml"),
    (("<｜tool▁calls▁begin｜>",), "deepseek"),
    (("<minimax:tool_call>",), "minimax"),
    (("<|START_ACTION|>", "<|END_ACTION|>"), "cohere"),
    (("directly-answer", "Action:", "```json"), "command_r_plus"),
    (("<|tools_prefix|>", "<|tools_suffix|>"), "apertus"),
    (("<|tool_call:begin|>", "<|tool_call:name|>"), "solar"),
    (("<|tool_list_start|>", "<|tool_list_end|>"), "lfm2"),
    (("List of tools: [",), "lfm2"),
    (("<|tool_call>", "<tool_call|>"), "gemma4"),
    (("<seed:tool_call>",), "seed_oss"),
    (("Tool usage guidelines:", '<function name="', '<param name="'), "minicpm5"),
    (("<tool_sep{}>", "<arg_key{}>", ":opensource"), "hy3"),
    (("<arg_key>", "<arg_value>"), "glm"),
    (("<function=", "<parameter="), "qwen3_coder"),
    (("<TOOLCALL>[",), "nemotron"),
    (("functools[",), "firefunction"),
    ((">>>all", ">>>${recipient}"), "functionary"),
    (("<|function_call|>", "<|role_sep|>"), "gigachat3_1"),
    (("<|role_sep|>", "<|message_sep|>", "function call"), "gigachat3"),
    (("</tool_calls><end_of_sentence>",), "minimax_m1"),
    (("<tool_calls>[",), "apriel"),
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|tool_call|>",), "granite"),
    (("<|python_tag|>",), "llama3"),
    (("ipython", "parameters"), "llama3"),
]
FIRST_FAMILIES = {name for _, name in BEFORE_THE_ROSTER} | {"generic"}


def test_the_first_families_rules_keep_their_order() -> None:
    order = [(rule.marks, fmt.name) for rule, fmt in detection_order()]
    assert [r for r in order if r in BEFORE_THE_ROSTER] == BEFORE_THE_ROSTER
    assert FIRST_FAMILIES <= set(FORMATS)


def test_the_detection_order_is_the_priorities_and_each_is_one_rules() -> None:
    priorities = [rule.priority for rule, _ in detection_order()]
    assert priorities == sorted(priorities) and len(set(priorities)) == len(priorities)
    # a source holding every family's marks picks the first rule's family; none: generic
    everything = " ".join(m for rule, _ in detection_order() for m in rule.marks)
    assert detect_format(everything) is detection_order()[0][1]
    assert detect_format("{{ messages }}") is GENERIC


def test_a_name_or_a_priority_is_registered_once() -> None:
    before = dict(formats())
    with pytest.raises(ValueError, match="registered twice"):
        register(ToolFormat("hermes", "arguments"))
    taken = detection_order()[0][0].priority
    with pytest.raises(ValueError, match="priority"):
        register(ToolFormat("a_family_of_this_test", "arguments", detect=(Detect(taken, ("x",)),)))
    with pytest.raises(ValueError, match="priority"):
        register(ToolFormat("a_family_of_this_test", "arguments", detect=(Detect(1, ("x",)), Detect(1, ("y",)))))
    assert formats() == before  # a refused family leaves the roster as it was


def test_the_format_table_and_the_parsers_are_the_rosters() -> None:
    assert FORMATS == formats() and all(by_name(name) is fmt for name, fmt in FORMATS.items())
    assert TOOL_CALL_PARSERS == FACE_PARSERS == ("auto", *sorted(FORMATS))
    assert tuple(CHOICES["tool_call_parser"]) == TOOL_CALL_PARSERS


@pytest.mark.parametrize("name", TOOL_CALL_PARSERS)
def test_every_registered_name_is_a_tool_call_parser(name: str) -> None:
    args = build_parser().parse_args(["serve", "--tool-call-parser", name])
    assert args.tool_call_parser == name
    assert settings_from(args, env={}, choices=CHOICES).tool_call_parser == name
    caps = template_caps(ChatTemplate(name="t", source="inline", jinja="{{ messages }}"), name)
    assert caps.tool_format is (detect_format("{{ messages }}") if name == "auto" else FORMATS[name])


def test_the_help_names_every_family(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["serve", "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    flag = text[text.index("  --tool-call-parser"):text.index("  --reasoning-format")]
    said = " ".join(flag.split())  # the help's words, unwrapped
    assert all(f" {name}," in said or f" {name}:" in said for name in TOOL_CALL_PARSERS), said


def test_an_unknown_name_stops_the_start_with_a_clear_error() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cli = [sys.executable, "-m", "hydra_trio.cli", "serve"]
    flag = subprocess.run([*cli, "--tool-call-parser", "nope"], capture_output=True, text=True, env=env, timeout=120)
    assert flag.returncode == 2 and "--tool-call-parser: invalid choice: 'nope'" in flag.stderr, flag.stderr
    assert "hermes" in flag.stderr  # the known names are listed
    # the variable, which argparse does not see, is held to the same names
    with pytest.raises(SystemExit, match=r"tool_call_parser must be one of auto, .*hermes"):
        settings_from(None, env={"HYDRA_TOOL_CALL_PARSER": "nope"}, choices=CHOICES)
    # settings made without the CLI's words: the engine's own lookup refuses it by name
    with pytest.raises(ValueError, match=r"no tool-call family 'nope'; known: auto, .*hermes"):
        template_caps(ChatTemplate(name="t", source="inline", jinja="{{ messages }}"), "nope")
