"""Tool-call syntaxes that are not one JSON object per call: the model families whose calls
are blocks of their own markup (Qwen3-Coder's and Seed-OSS's ``<function=...>``, GLM's
``<arg_key>``, Kimi K2's and DeepSeek's special-token sections, MiniMax's and DeepSeek
V3.2's ``<invoke>``). Each ``Block`` holds both readers of its syntax: ``read`` (one block's
text -> calls, for ``parser.py``) and ``call_rule`` (one tool's call as llguidance's Lark, for
``call_grammar.tools_grammar``), so what the grammar makes a model write is what the parser reads.
The formats built on them are in ``formats.py``. Pure.

The shapes and expected parses restate llama.cpp's tests (tests/test-chat.cpp) for the
templates of its corpus (models/templates/)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..structured import SchemaExpr, literal, regex, seq
from .tools import Tool

Call = tuple[str, dict[str, Any], str | None]  # (name, arguments, the id the model wrote or None)
Props = Mapping[str, Mapping[str, Any]]  # a tool's parameters' properties: name -> schema
Reader = Callable[[str, str, Callable[[str], Props | None]], list[Call] | None]
# One call's grammar: (tool, its index, its schemas' expressions) -> (the call's expression, rules)
CallRule = Callable[[Tool, int, SchemaExpr], tuple[str, list[str]]]


@dataclass(frozen=True)
class Block:
    """A region of calls: it starts at one of ``openers`` and ends at ``closer`` (then an
    optional ``tail``, with whitespace before it, is part of it too). ``read`` gets the text
    between opener and closer and the opener; it returns the calls, or None when the region
    is not valid calls (its text is then content)."""

    openers: tuple[str, ...]
    closer: str
    read: Reader
    tail: str = ""
    closers: tuple[str, ...] = ()  # when given: the closer of each opener (DSML's two spellings)
    call_rule: CallRule | None = None  # one call's grammar
    # A block of several calls: what ends each call in it, and what closes the calls' list
    # after one (a JSON list's "]"): a block the length cap cut is read up to its last whole
    # call (``salvage``). "": a block holds one call.
    call_end: str = ""
    list_close: str = ""

    def salvage(self, body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
        """The whole calls of a block cut before its closer (the length cap): its text up to
        the last call that ends, read as if the block closed there; None: none is whole."""
        end = len(body)
        for _ in range(MAX_SALVAGE_TRIES):
            k = body.rfind(self.call_end, 0, end) if self.call_end else -1
            if k < 0:
                return None
            calls = self.read(body[: k + len(self.call_end)] + self.list_close, opener, props_of)
            if calls:
                return calls
            end = k
        return None


def _json_args(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _json_items(text: str) -> list[Any] | None:
    """A non-empty JSON list (a family's calls), else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, list) and value else None


def _trim_nl(text: str) -> str:
    """A parameter's value without the one newline each side the XML forms put around it."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    return text


def typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """An XML parameter's text as the argument's value: as written for a string parameter
    (or one the tool does not declare as another type); else its JSON value, the text when
    it is not JSON (as llama.cpp's XML parsers do)."""
    kind = schema.get("type") if schema is not None else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _xml_args(pairs: list[tuple[str, str]], props: Props | None) -> dict[str, Any]:
    return {k: typed_value(_trim_nl(v), (props or {}).get(k)) for k, v in pairs}


# -- Qwen3-Coder and Seed-OSS: <tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>

_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _read_function(body: str, opener: str, props_of: Callable[[str], Props | None], fn: str) -> list[Call] | None:
    """One ``<function=NAME>...`` call; the opener is the tool-call tag (then the function
    tag follows it) or, as some models write it, the function tag itself."""
    if opener != fn:
        body = body.lstrip()
        if not body.startswith(fn):
            return None
        body = body[len(fn):]
    name, sep, rest = body.partition(">")
    name = name.strip()
    if not sep or not name:
        return None
    pairs = [(m.group(1).strip(), m.group(2)) for m in _PARAM.finditer(rest)]
    if _PARAM.sub("", rest).strip():
        return None  # text outside the parameters: not a call
    return [(name, _xml_args(pairs, props_of(name)), None)]


MAX_SALVAGE_TRIES = 64  # places a cut block's last whole call is looked for (a nested "}" is no call's end)
MAX_TEXT_COUNT = 1 << 16  # a text parameter's length bound written into its regex (past it: unbounded)


def _xml_param_rules(
    tool: Tool,
    i: int,
    schema: SchemaExpr,
    write: Callable[[str], tuple[str, str]],
    padded: bool = False,
) -> tuple[str, list[str]]:
    """A tool's parameters as a sequence of XML parameters in the schema's order (required
    ones always, others optional): a string's value is text without ``<``, others their
    schema's JSON. ``write(key)``: the literal before and after a parameter's value."""
    props = tool.parameters.get("properties") if isinstance(tool.parameters, dict) else None
    required = set(tool.parameters.get("required") or ()) if isinstance(tool.parameters, dict) else set()
    rules: list[str] = []
    parts: list[str] = []
    for j, (key, prop) in enumerate((props or {}).items()):
        value = f"t{i}-p{j}"
        if isinstance(prop, dict) and prop.get("type") == "string":
            # A string is written as text (typed_value reads it so): no "<" (it would end
            # the value) and, where no newline is written around it, no newline at its edges.
            lo, hi = prop.get("minLength"), prop.get("maxLength")
            lo = lo if isinstance(lo, int) and not isinstance(lo, bool) and 0 <= lo <= MAX_TEXT_COUNT else 0
            bounded = isinstance(hi, int) and not isinstance(hi, bool) and lo <= hi <= MAX_TEXT_COUNT
            count = f"{{{lo},{hi}}}" if bounded else f"{{{lo},}}" if lo else "*"
            chars = "[^<]" if padded else "[^<\\n]"
            rules.append(f"{value}: {regex(chars + count)}")
        else:
            rules.append(f"{value}: {schema(prop, f'tools[{i}].function.parameters.properties.{key}')}")
        before, after = write(key)
        part = seq(literal(before), value, literal(after))
        parts.append(part if key in required else f"({part})?")
    return seq(*parts), rules


def _qwen_rule(call_open: str, call_close: str) -> CallRule:
    def rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
        params, rules = _xml_param_rules(tool, i, schema, lambda k: (f"<parameter={k}>\n", "\n</parameter>\n"), True)
        head = literal(f"{call_open}\n<function={tool.name}>\n")
        return seq(head, params, literal(f"</function>\n{call_close}")), rules

    return rule


QWEN_XML = Block(
    openers=("<tool_call>", "<function="),
    closer="</function>",
    tail="</tool_call>",
    read=lambda body, opener, props: _read_function(body, opener, props, "<function="),
    call_rule=_qwen_rule("<tool_call>", "</tool_call>"),
)
SEED_XML = Block(
    openers=("<seed:tool_call>", "<function="),
    closer="</function>",
    tail="</seed:tool_call>",
    read=lambda body, opener, props: _read_function(body, opener, props, "<function="),
    call_rule=_qwen_rule("<seed:tool_call>", "</seed:tool_call>"),
)


# -- GLM-4.5/4.6/4.7: <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>; Tencent Hy3:
#    ":opensource" in each tag, <tool_sep:opensource> after the name (its section's tags are formats.HY3's)


def _arg_tags(s: str, sep: str) -> tuple[Reader, CallRule]:
    """One call's reader and rule: ``s`` its tags' suffix, ``sep`` what ends the name."""
    arg = re.compile(rf"<arg_key{s}>(.*?)</arg_key{s}>\s*<arg_value{s}>(.*?)</arg_value{s}>", re.S)

    def read(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
        k = body.find(f"<arg_key{s}>")
        name, rest = (body, "") if k < 0 else (body[:k], body[k:])
        name = name.strip().removesuffix(sep.strip()).strip()
        if not name or "<" in name or "{" in name:
            return None
        pairs = [(m.group(1).strip(), m.group(2)) for m in arg.finditer(rest)]
        if arg.sub("", rest).strip():
            return None
        return [(name, _xml_args(pairs, props_of(name)), None)]

    def rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
        params, rules = _xml_param_rules(
            tool, i, schema, lambda k: (f"<arg_key{s}>{k}</arg_key{s}>\n<arg_value{s}>", f"</arg_value{s}>\n")
        )
        return seq(literal(f"<tool_call{s}>{tool.name}{sep}"), params, literal(f"</tool_call{s}>")), rules

    return read, rule


_read_glm, _glm_rule = _arg_tags("", "\n")
GLM_XML = Block(openers=("<tool_call>",), closer="</tool_call>", read=_read_glm, call_rule=_glm_rule)
_read_hy3, _hy3_rule = _arg_tags(":opensource", "<tool_sep:opensource>\n")
HY3 = Block(openers=("<tool_call:opensource>",), closer="</tool_call:opensource>", read=_read_hy3, call_rule=_hy3_rule)


# -- JSON arguments between special tokens: Kimi K2 and DeepSeek V3.x/R1


def _json_rule(head: Callable[[Tool], str], tail: str) -> CallRule:
    def rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
        args = f"t{i}-args: {schema(tool.parameters, f'tools[{i}].function.parameters')}"
        return seq(head(tool), f"t{i}-args", literal(tail)), [args]

    return rule


KIMI_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>\s*(?:functions\.)?([^<:\s]+)(:\d+)?\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S
)


def _read_kimi(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    """Kimi K2's calls; its id is the name as written, ``functions.NAME:IDX``."""
    calls: list[Call] = []
    pos = 0
    for m in KIMI_CALL.finditer(body):
        if m.start() != pos:
            return None
        args = _json_args(m.group(3))
        if args is None:
            return None
        name = m.group(1)
        calls.append((name, args, f"functions.{name}{m.group(2) or ':' + str(len(calls))}"))
        pos = m.end()
    return calls if calls and not body[pos:].strip() else None


KIMI = Block(
    openers=("<|tool_calls_section_begin|>",),
    closer="<|tool_calls_section_end|>",
    read=_read_kimi,
    call_end="<|tool_call_end|>",
    call_rule=_json_rule(
        lambda t: seq(literal("<|tool_call_begin|>functions." + t.name + ":"), regex("[0-9]{1,5}"), literal("<|tool_call_argument_begin|>")),
        "<|tool_call_end|>",
    ),
)

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL = re.compile(
    r"\s*<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>([^\n<]+)\n```(?:json)?\n?(.*?)```|([^<]+?)<｜tool▁sep｜>(.*?))\s*<｜tool▁call▁end｜>",
    re.S,
)


def _read_deepseek(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    """DeepSeek V3.1's ``NAME<｜tool▁sep｜>{json}`` and R1's ``function<｜tool▁sep｜>NAME\\n```json\\n{json}```"""
    calls: list[Call] = []
    pos = 0
    for m in DS_CALL.finditer(body):
        if m.start() != pos:
            return None
        name, text = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
        args = _json_args(text)
        if args is None:
            return None
        calls.append((name.strip(), args, None))
        pos = m.end()
    return calls if calls and not body[pos:].strip() else None


DEEPSEEK = Block(
    openers=(DS_BEGIN,),
    closer=DS_END,
    read=_read_deepseek,
    call_end="<｜tool▁call▁end｜>",
    call_rule=_json_rule(lambda t: literal(f"<｜tool▁call▁begin｜>{t.name}<｜tool▁sep｜>"), "<｜tool▁call▁end｜>"),
)


# -- <invoke name="N"><parameter name="K">V</parameter></invoke>: MiniMax M2 and DeepSeek V3.2 (DSML)


def _invoke_reader(p: str) -> Reader:
    invoke = re.compile(rf'\s*<{p}invoke name="([^"]+)">(.*?)</{p}invoke>', re.S)
    param = re.compile(rf'<{p}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{p}parameter>', re.S)

    def read(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
        calls: list[Call] = []
        pos = 0
        for m in invoke.finditer(body):
            if m.start() != pos:
                return None
            name, inner = m.group(1), m.group(2)
            if param.sub("", inner).strip():
                return None
            props = props_of(name) or {}
            args: dict[str, Any] = {}
            for pm in param.finditer(inner):
                key, is_string, text = pm.group(1), pm.group(2), _trim_nl(pm.group(3))
                args[key] = text if is_string == "true" else typed_value(text, None if is_string else props.get(key))
            calls.append((name, args, None))
            pos = m.end()
        return calls if calls and not body[pos:].strip() else None

    return read


def _invoke_rule(p: str, dsml: bool) -> CallRule:
    def rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
        props = tool.parameters.get("properties") or {} if isinstance(tool.parameters, dict) else {}

        def write(k: str) -> tuple[str, str]:
            s = props.get(k)
            flag = (' string="true"' if isinstance(s, dict) and s.get("type") == "string" else ' string="false"') if dsml else ""
            return f'<{p}parameter name="{k}"{flag}>', f"</{p}parameter>\n"

        params, rules = _xml_param_rules(tool, i, schema, write)
        head = literal(f'\n<{p}invoke name="{tool.name}">\n')
        return seq(head, params, literal(f"</{p}invoke>\n")), rules

    return rule


MINIMAX = Block(
    openers=("<minimax:tool_call>",),
    closer="</minimax:tool_call>",
    read=_invoke_reader(""),
    call_rule=_invoke_rule("", False),
    call_end="</invoke>",
)
DSML = Block(
    openers=("<｜DSML｜function_calls>", "<｜DSML｜tool_calls>"),  # V3.2's, V4's
    closer="</｜DSML｜function_calls>",
    closers=("</｜DSML｜function_calls>", "</｜DSML｜tool_calls>"),
    read=_invoke_reader("｜DSML｜"),
    call_rule=_invoke_rule("｜DSML｜", True),
    call_end="</｜DSML｜invoke>",
)


# -- Gemma 4: <|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>

GEMMA_QUOTE = '<|"|>'
_GEMMA_STRING = re.compile(r'<\|"\|>(.*?)<\|"\|>|"(?:[^"\\]|\\.)*"', re.S)
_GEMMA_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w.-]*)\s*:")


def gemma_args(text: str) -> dict[str, Any] | None:
    """Gemma 4's argument object (bare keys, strings between ``<|"|>``) as a dict."""
    strings: list[str] = []

    def hold(m: re.Match[str]) -> str:
        strings.append(json.dumps(m.group(1)) if m.group(1) is not None else m.group(0))
        return f"\x00{len(strings) - 1}\x00"

    held = _GEMMA_STRING.sub(hold, text)
    held = _GEMMA_KEY.sub(lambda m: f'{m.group(1)}"{m.group(2)}":', held)
    held = re.sub(r",\s*([}\]])", r"\1", held)  # the grammar writes a comma after each argument
    return _json_args(re.sub(r"\x00(\d+)\x00", lambda m: strings[int(m.group(1))], held))


def _read_gemma(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    body = body.strip()
    if not body.startswith("call:"):
        return None
    name, brace, rest = body[len("call:"):].partition("{")
    args = gemma_args(brace + rest) if brace else None
    return [(name.strip(), args, None)] if name.strip() and args is not None else None


def _gemma_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    props = tool.parameters.get("properties") or {} if isinstance(tool.parameters, dict) else {}

    def write(k: str) -> tuple[str, str]:
        s = props.get(k)
        quoted = isinstance(s, dict) and s.get("type") == "string"
        return (f"{k}:{GEMMA_QUOTE}" if quoted else f"{k}:"), (f"{GEMMA_QUOTE}," if quoted else ",")

    params, rules = _xml_param_rules(tool, i, schema, write)
    return seq(literal(f"<|tool_call>call:{tool.name}{{"), params, literal("}<tool_call|>")), rules


GEMMA4 = Block(openers=("<|tool_call>",), closer="<tool_call|>", read=_read_gemma, call_rule=_gemma_rule)


# -- Cohere Command R7B and Cohere2MoE: <|START_ACTION|>[{"tool_call_id": "0", "tool_name": N, "parameters": {...}}]<|END_ACTION|>


def _read_cohere(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    """Cohere's JSON list of calls; its id is the model's ``tool_call_id``."""
    if (items := _json_items(body)) is None:
        return None
    calls: list[Call] = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name, args, given = item.get("tool_name"), item.get("parameters", {}), item.get("tool_call_id")
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            return None
        calls.append((name, args, str(given) if given is not None else None))
    return calls


def _cohere_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    args = f"t{i}-args: {schema(tool.parameters, f'tools[{i}].function.parameters')}"
    head = seq(literal('{"tool_call_id": "'), regex("[0-9]{1,3}"), literal(f'", "tool_name": "{tool.name}", "parameters": '))
    return seq(head, f"t{i}-args", literal("}")), [args]


COHERE = Block(
    openers=("<|START_ACTION|>",), closer="<|END_ACTION|>", read=_read_cohere, call_rule=_cohere_rule, call_end="}", list_close="]"
)


def _object_args(value: Any) -> dict[str, Any] | None:
    """A call's arguments: an object, or (as templates that print them ``| tojson`` show a
    string's) a JSON string of one."""
    if isinstance(value, str):
        return _json_args(value)
    return value if isinstance(value, dict) else None


# -- MiniMax M1: <tool_calls>\n{"name": N, "arguments": {...}}\n{...}\n</tool_calls> (one JSON object a line)


def _read_json_lines(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    decoder = json.JSONDecoder()
    calls: list[Call] = []
    pos = 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos == len(body):
            break
        try:
            item, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        if not isinstance(item, dict) or set(item) - {"name", "arguments"}:
            return None
        name, args = item.get("name"), _object_args(item.get("arguments", {}))
        if not isinstance(name, str) or not name or args is None:
            return None
        calls.append((name, args, None))
    return calls or None


MINIMAX_M1 = Block(
    openers=("<tool_calls>",),
    closer="</tool_calls>",
    read=_read_json_lines,
    call_end="}",
    call_rule=_json_rule(lambda t: literal(f'{{"name": "{t.name}", "arguments": '), "}"),
)


# -- Apertus: <|tools_prefix|>[{"NAME": {...arguments...}}, ...]<|tools_suffix|> (the name as the key)


def _read_name_keyed(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    if (items := _json_items(body)) is None:
        return None
    calls: list[Call] = []
    for item in items:
        if not isinstance(item, dict) or len(item) != 1:
            return None
        ((name, value),) = item.items()
        args = _object_args(value)
        if not name or args is None:
            return None
        calls.append((name, args, None))
    return calls


APERTUS = Block(
    openers=("<|tools_prefix|>",),
    closer="<|tools_suffix|>",
    read=_read_name_keyed,
    call_end="}",
    list_close="]",
    call_rule=_json_rule(lambda t: literal(f'{{"{t.name}": '), "}"),
)


# -- MiniCPM5: <function name="N"><param name="K">V</param>...</function> (a value may be <![CDATA[...]]>)

_MINICPM_NAME = re.compile(r'([^"<>\n]+)">')
_MINICPM_PARAM = re.compile(r'\s*<param name="([^"]+)">(?:<!\[CDATA\[(.*?)\]\]>|(.*?))</param>', re.S)


def _read_minicpm(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    m = _MINICPM_NAME.match(body)
    if m is None:
        return None
    name, props = m.group(1).strip(), props_of(m.group(1).strip()) or {}
    args: dict[str, Any] = {}
    pos = m.end()
    for pm in _MINICPM_PARAM.finditer(body, pos):
        if pm.start() != pos:
            return None
        key = pm.group(1)
        text = pm.group(2) if pm.group(2) is not None else pm.group(3)
        args[key] = text if pm.group(2) is not None else typed_value(text, props.get(key))
        pos = pm.end()
    if body[pos:].strip():
        return None
    return [(name, args, None)] if name else None


def _minicpm_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    params, rules = _xml_param_rules(tool, i, schema, lambda k: (f'<param name="{k}">', "</param>"))
    return seq(literal(f'<function name="{tool.name}">'), params, literal("</function>")), rules


MINICPM5 = Block(openers=('<function name="',), closer="</function>", read=_read_minicpm, call_rule=_minicpm_rule)


# -- Upstage Solar Open: <|tool_calls|><|tool_call:begin|>ID<|tool_call:name|>N<|tool_call:args|>{...}<|tool_call:end|>...

SOLAR_BEGIN, SOLAR_END = "<|tool_call:begin|>", "<|tool_call:end|>"


def _read_solar(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    """One call; its id is the model's (the grammar writes a call index, as Cohere's)."""
    given, sep, rest = body.partition("<|tool_call:name|>")
    name, sep2, args_text = rest.partition("<|tool_call:args|>")
    args = _json_args(args_text) if sep and sep2 else None
    if args is None or not name.strip() or "<" in given:
        return None
    return [(name.strip(), args, given.strip() or None)]


def _solar_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    args = f"t{i}-args: {schema(tool.parameters, f'tools[{i}].function.parameters')}"
    head = seq(literal(SOLAR_BEGIN), regex("[0-9]{1,3}"), literal("<|tool_call:name|>" + tool.name + "<|tool_call:args|>"))
    return seq(head, f"t{i}-args", literal(SOLAR_END)), [args]


SOLAR = Block(openers=("<|tool_calls|>" + SOLAR_BEGIN, SOLAR_BEGIN), closer=SOLAR_END, read=_read_solar, call_rule=_solar_rule)


# -- Kimi K3: <|open|>tools<|sep|><|open|>call tool="N" index="1"<|sep|><|open|>argument key="K" type="T"<|sep|>V
#    <|close|>argument<|sep|>...<|close|>call<|sep|>...<|close|>tools<|sep|> (its XTML tags)

K3_CALL = re.compile(r'<\|open\|>call tool="([^"]+)"(?: index="[^"]*")?<\|sep\|>(.*?)<\|close\|>call<\|sep\|>', re.S)
K3_ARG = re.compile(r'<\|open\|>argument key="([^"]+)"(?: type="([^"]*)")?<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>', re.S)
K3_JSON = re.compile(r'\s*<\|open\|>json(?: type="object")?<\|sep\|>(.*?)<\|close\|>json<\|sep\|>\s*', re.S)
_K3_TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null",
             "object": "object", "array": "array"}


def _unescape_attr(text: str) -> str:
    return text.replace("&quot;", '"').replace("&amp;", "&")


def _read_kimi_k3(body: str, opener: str, props_of: Callable[[str], Props | None]) -> list[Call] | None:
    calls: list[Call] = []
    pos = 0
    for m in K3_CALL.finditer(body):
        if body[pos:m.start()].strip():
            return None
        name, inner = _unescape_attr(m.group(1)), m.group(2)
        whole = K3_JSON.fullmatch(inner)
        if whole is not None:
            args = _json_args(whole.group(1))
            if args is None:
                return None
        else:
            if K3_ARG.sub("", inner).strip():
                return None
            args = {}
            for am in K3_ARG.finditer(inner):
                kind, text = am.group(2), am.group(3)
                args[_unescape_attr(am.group(1))] = text if kind == "string" else typed_value(text, None)
        calls.append((name, args, None))
        pos = m.end()
    return calls if calls and not body[pos:].strip() else None


def _k3_rule(tool: Tool, i: int, schema: SchemaExpr) -> tuple[str, list[str]]:
    props = tool.parameters.get("properties") or {} if isinstance(tool.parameters, dict) else {}

    def write(k: str) -> tuple[str, str]:
        s = props.get(k)
        kind = _K3_TYPES.get(s.get("type"), "object") if isinstance(s, dict) and isinstance(s.get("type"), str) else "object"
        return f'<|open|>argument key="{k}" type="{kind}"<|sep|>', "<|close|>argument<|sep|>"

    params, rules = _xml_param_rules(tool, i, schema, write)
    call_open = '<|open|>call tool="' + tool.name + '" index="'
    head = seq(literal(call_open), regex("[1-9][0-9]?"), literal('"<|sep|>'))
    return seq(head, params, literal("<|close|>call<|sep|>")), rules


KIMI_K3 = Block(
    openers=("<|open|>tools<|sep|>",), closer="<|close|>tools<|sep|>", read=_read_kimi_k3, call_rule=_k3_rule,
    call_end="<|close|>call<|sep|>",
)


# -- Cohere Command R+: Action:\n```json\n[{"tool_name": N, "parameters": {...}}, ...]\n``` (Cohere's list, no ids)

COMMAND_R_PLUS = Block(
    openers=("Action:\n```json",),
    closer="```",
    read=_read_cohere,
    call_end="}",
    list_close="]",
    call_rule=_json_rule(lambda t: literal(f'{{"tool_name": "{t.name}", "parameters": '), "}"),
)
