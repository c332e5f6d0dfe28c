"""Chat: the served template and everything that follows from it. What a template can do
(``TemplateCaps``), and a request's chat side decided once (``Chat.plan`` -> ``ChatPlan``,
as llama.cpp's ``common_chat_templates_apply`` returns one ``common_chat_params``): its
prompt, its output grammar (tools in the template's syntax), the control tokens its reply
shows, its think block's plan and the parser that reads its reply, all from one choice of
template variant. The engine's input processing holds one ``Chat`` per served template;
nothing outside this package reaches its modules. Imports nothing of engine/llama/."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ...config import REASONING_FORMATS
from ...wire.errors import bad_param
from ..structured import Constraint, OutputGrammar, ThinkPlan
from .call_grammar import constraint_grammar
from .caps import TemplateCaps, template_caps
from .formats import GENERIC, TOOL_CALL_PARSERS
from .parser import ReplyDelta, ReplyParser, parse_reply
from .render import (
    BUDGET_KEYS,
    ApplyBuiltin,
    ChatRequestError,
    PromptRenderer,
    RunOnWorker,
    render_prompt,
    thinking_on,
)
from .scanner import ToolCall
from .templates import ChatTemplate, resolve_chat_template
from .tools import ToolRequest, parse_tools

__all__ = [
    "BUDGET_KEYS",
    "TOOL_CALL_PARSERS",
    "Chat",
    "ChatPlan",
    "ChatRequestError",
    "ChatTemplate",
    "ReplyDelta",
    "ReplyParser",
    "TemplateCaps",
    "ToolCall",
    "ToolRequest",
    "constraint_grammar",
    "parse_reply",
    "parse_tools",
    "render_jinja",
    "resolve_chat_template",
    "template_caps",
]

T = TypeVar("T")
OffLoop = Callable[[Callable[[], T]], Awaitable[T]]  # runs CPU-bound work off the trio thread


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """A request's chat side, decided once (``Chat.plan``) and read everywhere after."""

    prompt: str | None  # the prompt text (chat template, or a plain prompt); None: token ids, or none
    grammar: OutputGrammar | None  # what the reply must follow (not compiled yet)
    shown_tokens: frozenset[int]  # control tokens whose text the reply shows (its template's syntax)
    think: ThinkPlan | None  # the reply's think block (its tags' tokens left to the engine)
    replies: Callable[[], ReplyParser] | None  # a fresh parser of the reply; None: its text is the content


class _Served:
    """One template as served: what it can do and its renderer."""

    def __init__(
        self,
        template: ChatTemplate,
        tool_call_parser: str,
        renderer: Callable[[ChatTemplate, TemplateCaps], PromptRenderer],
    ) -> None:
        self.template = template
        self.caps = template_caps(template, tool_call_parser)
        self.renderer = renderer(template, self.caps)


class Chat:
    """One served chat template (with the GGUF's tool_use variant, when it has one): renders
    requests, turns constraints into its grammar, and makes the parsers that read its replies.
    Which of the two a request goes through is ``ChatTemplate.for_request``'s decision.

    ``special_text``: the vocabulary's control tokens spelled out (id -> bytes) and ``unshown``
    those never shown (BOS, EOG): from them, which control tokens a chat reply shows as text."""

    def __init__(
        self,
        template: ChatTemplate,
        *,
        tool_call_parser: str,
        reasoning_format: str,
        bos_token: str,
        eos_token: str,
        tokenizer_adds_bos: bool,
        run_on_worker: RunOnWorker,
        apply_builtin: ApplyBuiltin,
        special_text: Mapping[int, bytes] | None = None,
        unshown: frozenset[int] = frozenset(),
    ) -> None:
        self.template = template

        def renderer(tpl: ChatTemplate, caps: TemplateCaps) -> PromptRenderer:
            return PromptRenderer(
                tpl,
                caps,
                bos_token=bos_token,
                eos_token=eos_token,
                tokenizer_adds_bos=tokenizer_adds_bos,
                run_on_worker=run_on_worker,
                apply_builtin=apply_builtin,
            )

        self._default = _Served(template, tool_call_parser, renderer)
        self._tool_use = _Served(template.tool_use, tool_call_parser, renderer) if template.tool_use else None
        self._reasoning_format = reasoning_format
        self._shown = {
            served.template.variant: _shown_tokens(served, special_text or {}, unshown)
            for served in (self._default, self._tool_use)
            if served is not None
        }

    @property
    def caps(self) -> TemplateCaps:
        """What the default template can do (the tool_use variant's: ``_served(True).caps``)."""
        return self._default.caps

    def _served(self, declares_tools: bool) -> _Served:
        chosen = self.template.for_request(declares_tools)
        return self._tool_use if chosen is not self.template and self._tool_use is not None else self._default

    async def render(self, request: dict[str, Any]) -> str:
        """The prompt text of a request (``messages`` through the template, or a plain
        ``prompt``); a 400 for a bad shape or a template that raises."""
        declares = "messages" in request and parse_tools(request) is not None
        return await self._served(declares).renderer.render(request)

    async def plan(
        self,
        request: dict[str, Any],
        *,
        tools: ToolRequest | None,
        constraint: Constraint | None,
        budget: int,
        off_loop: OffLoop[Any],
    ) -> ChatPlan:
        """The request's chat side (``tools`` and ``constraint`` as parsed from it; ``budget``:
        the thinking budget in force), from one choice of template variant: the tool_use
        variant when it declares tools and the model has one. Its grammar is written off the
        trio thread (``off_loop``: schemas of a long tool list take milliseconds)."""
        chat = "messages" in request
        served = self._served(chat and tools is not None)
        fmt = served.caps.tool_format if chat else GENERIC
        grammar = None if constraint is None else await off_loop(lambda: constraint_grammar(constraint, fmt))
        rendered = _with_budget(request, budget)
        has_prompt = chat or isinstance(request.get("prompt"), str)
        prompt = await served.renderer.render(rendered) if has_prompt else None
        if not chat:
            return ChatPlan(prompt, grammar, frozenset(), None, None)
        return ChatPlan(
            prompt,
            grammar,
            self._shown[served.template.variant],
            _think_plan(served.caps, rendered, prompt or "", budget=budget, grammar=grammar),
            self._reply_parsers(served.caps, tools, request, prompt or ""),
        )

    def _reply_parsers(
        self, caps: TemplateCaps, tools: ToolRequest | None, request: dict[str, Any], prompt: str
    ) -> Callable[[], ReplyParser] | None:
        """How a chat reply is read: a factory of fresh parsers of its tool calls (tools asked
        with a tool_choice other than none, in this template's format) and its reasoning
        (``reasoning_format``: the request's, else --reasoning-format); None when the text is
        the content as it stands (chat asking neither)."""
        calls = tools if tools is not None and tools.choice != "none" else None
        mode = request.get("reasoning_format")
        if mode is None:
            mode = self._reasoning_format
        elif mode not in REASONING_FORMATS:
            raise bad_param(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}", "reasoning_format")
        # A prompt that ends inside an open think block (DeepSeek-R1's and Qwen3's templates)
        # starts the reply in its reasoning; auto splits only for templates with think tags.
        opened = _opens_think(prompt, caps)
        reasoning = mode == "deepseek" or (mode == "auto" and (caps.thinks or opened))
        fmt, tags = caps.tool_format, caps.think_tags
        # a channel dialect's markup is always read, and content's markup of a format that has some
        if calls is None and not reasoning and not fmt.channels and not (fmt.dropped or fmt.recipient):
            return None
        # Apriel 1.6's prompt opens its reasoning with words of it, which the reasoning keeps
        lead = prompt[prompt.rfind(tags[0]):] if reasoning and opened and caps.think_lead else ""
        return lambda: ReplyParser(
            fmt,
            parse_tools=calls is not None,
            reasoning=reasoning,
            starts_in_reasoning=reasoning and opened,
            tools=calls,
            think_tags=tags,
            reasoning_lead=lead,
        )


def _with_budget(request: dict[str, Any], budget: int) -> dict[str, Any]:
    """A chat request as its prompt is rendered: the thinking budget in force (its own, else
    --reasoning-budget) written under its key, so a budget of 0 turns the template's thinking
    off (render.py ``thinking_on``)."""
    key = BUDGET_KEYS[0]
    if "messages" not in request or request.get(key, -1) == budget:
        return request
    return {**request, key: budget}


def _think_plan(
    caps: TemplateCaps, request: dict[str, Any], prompt: str, *, budget: int, grammar: OutputGrammar | None
) -> ThinkPlan | None:
    """What generation does with a chat reply's think block (structured/thinking.py), its
    tags' tokens left to the caller; None: nothing. ``request`` as rendered (the budget in
    force written in); ``budget``: -1 unlimited, else the most reasoning tokens.

    The block is the reply's when the prompt opened it, or when the template thinks and
    thinking is on (the model opens it). A grammar the reply must follow starts after the
    close tag: the model reasons first and its answer still follows it. Where the prompt did
    not open the block but thinking is on, the engine opens it (a grammar from the first
    token would leave no room to think), except for a lazy grammar (tool_choice auto: the
    model may call at once) and a grammar that spells the close tag itself (it covers the
    reasoning: it holds from the first token, as llama-server's)."""
    if caps.tool_format.channels:  # gpt-oss and Muse Glimmer reason in a channel, not a think block
        return None
    open_tag, close_tag = caps.think_tags
    held = grammar is not None and close_tag not in grammar.text
    lazy = grammar is not None and bool(grammar.triggers)
    opened = _opens_think(prompt, caps)
    # A prompt ending in a closed block (a template's empty one) leaves the reply none.
    thinks = caps.thinks and thinking_on(request, caps) and not prompt.rstrip().endswith(close_tag)
    force_open = not opened and thinks and held and not lazy
    if not (opened or force_open or (thinks and budget > 0)):
        return None
    if not held and budget < 0:
        return None
    return ThinkPlan(
        open_text=open_tag.encode(), close_text=close_tag.encode(), open_tokens=(), close_tokens=(),
        budget=budget, starts_in_reasoning=opened, force_open=force_open, holds_grammar=held and (opened or force_open),
    )


def _opens_think(prompt: str, caps: TemplateCaps) -> bool:
    """Whether the prompt ends inside an open think block (its generation prompt opened it)."""
    return prompt.rstrip().endswith(caps.think_tags[0])


def _shown_tokens(served: _Served, special_text: Mapping[int, bytes], unshown: frozenset[int]) -> frozenset[int]:
    """A template's syntax tokens: control tokens of its tool format's literals or its think
    tags, or spelled in its source but not in a plain conversation's render (so tool and
    think markup, not turn markers such as ``<|im_start|>``, which stay unshown as in
    llama-server). BOS and EOG never reach a reply's text."""
    caps = served.caps
    syntax = "\n".join((*caps.tool_format.syntax_text(), *caps.think_tags))
    source = served.template.jinja or ""
    shown = set()
    for token, raw in special_text.items():
        text = raw.decode("utf-8", "replace")
        if token in unshown or not text:
            continue
        if text in syntax or (text in source and text not in caps.turn_text):
            shown.add(token)
    return frozenset(shown)


def render_jinja(request: dict[str, Any], source: str | None, *, bos_token: str, eos_token: str) -> str:
    """A request's prompt through the Jinja template ``source`` (ChatML when None), as the
    engine renders it: for tools that count prompts outside an engine (benchmarks)."""
    template = ChatTemplate(name="given", source="inline", jinja=source) if source else ChatTemplate(
        name="chatml-fallback", source="fallback", jinja=None
    )
    return render_prompt(request, source, template_caps(template), bos_token=bos_token, eos_token=eos_token)
