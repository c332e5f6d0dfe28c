"""Chat: the served template and everything that follows from it. What a template can do
(``TemplateCaps``), prompts rendered from chat requests, a request's tools and output
constraint as GBNF in the template's tool syntax, and the model's reply read back into
content, reasoning and tool calls. The engine's input processing holds one ``Chat`` per
served template; nothing outside this package reaches its modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...config import REASONING_FORMATS
from ...wire.errors import bad_param
from .caps import TemplateCaps, template_caps
from .grammar import Constraint, constraint_gbnf, parse_constraint, request_constraint
from .parser import ReplyDelta, ReplyParser, ToolCall, parse_reply
from .render import ApplyBuiltin, ChatRequestError, PromptRenderer, RunOnWorker, render_prompt
from .templates import ChatTemplate, resolve_chat_template
from .tools import ToolRequest, parse_tools

__all__ = [
    "Chat",
    "ChatRequestError",
    "ChatTemplate",
    "Constraint",
    "ReplyDelta",
    "ReplyParser",
    "TemplateCaps",
    "ToolCall",
    "ToolRequest",
    "parse_constraint",
    "parse_reply",
    "parse_tools",
    "render_jinja",
    "request_constraint",
    "resolve_chat_template",
    "template_caps",
]


class Chat:
    """One served chat template: renders requests, turns constraints into its grammar, and
    makes the parsers that read its replies."""

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
    ) -> None:
        self.template = template
        self.caps = template_caps(template, tool_call_parser)
        self._reasoning_format = reasoning_format
        self._renderer = PromptRenderer(
            template,
            self.caps,
            bos_token=bos_token,
            eos_token=eos_token,
            tokenizer_adds_bos=tokenizer_adds_bos,
            run_on_worker=run_on_worker,
            apply_builtin=apply_builtin,
        )

    async def render(self, request: dict[str, Any]) -> str:
        """The prompt text of a request (``messages`` through the template, or a plain
        ``prompt``); a 400 for a bad shape or a template that raises."""
        return await self._renderer.render(request)

    def to_gbnf(self, constraint: Constraint) -> tuple[str, tuple[str, ...]]:
        """A request's output constraint as GBNF and lazy triggers, tools in this template's syntax."""
        return constraint_gbnf(constraint, self.caps.tool_format)

    def reply_parsers(
        self, tools: ToolRequest | None, request: dict[str, Any], prompt: str
    ) -> Callable[[], ReplyParser] | None:
        """How a chat reply is read: a factory of fresh parsers of its tool calls (tools asked
        with a tool_choice other than none, in this template's format) and its reasoning
        (``reasoning_format``: the request's, else --reasoning-format); None when the text is
        the content as it stands (text completions, and chat asking neither)."""
        if "messages" not in request:
            return None
        calls = tools if tools is not None and tools.choice != "none" else None
        mode = request.get("reasoning_format")
        if mode is None:
            mode = self._reasoning_format
        elif mode not in REASONING_FORMATS:
            raise bad_param(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}", "reasoning_format")
        # A prompt that ends inside an open think block (DeepSeek-R1's and Qwen3's templates)
        # starts the reply in its reasoning; auto splits only for templates with think tags.
        opened = prompt.rstrip().endswith(self.caps.think_tags[0])
        reasoning = mode == "deepseek" or (mode == "auto" and (self.caps.thinks or opened))
        fmt, tags = self.caps.tool_format, self.caps.think_tags
        if calls is None and not reasoning and not fmt.harmony:  # harmony's markup is always read
            return None
        return lambda: ReplyParser(
            fmt,
            parse_tools=calls is not None,
            reasoning=reasoning,
            starts_in_reasoning=reasoning and opened,
            tools=calls,
            think_tags=tags,
        )


def render_jinja(request: dict[str, Any], source: str | None, *, bos_token: str, eos_token: str) -> str:
    """A request's prompt through the Jinja template ``source`` (ChatML when None), as the
    engine renders it: for tools that count prompts outside an engine (benchmarks)."""
    template = ChatTemplate(name="given", source="inline", jinja=source) if source else ChatTemplate(
        name="chatml-fallback", source="fallback", jinja=None
    )
    return render_prompt(request, source, template_caps(template), bos_token=bos_token, eos_token=eos_token)
