"""Which chat template the engine uses, and rendering requests with it.

Sources, first match wins: ``--chat-template-file PATH`` (Jinja), ``--chat-template NAME``
(a llama.cpp built-in name, rendered by llama_chat_apply_template on the GPU worker; or Jinja
source given inline), the GGUF's ``tokenizer.chat_template``, else ChatML. HTTP chat,
PREFILL and DECODE all render through ``PromptRenderer.render``, so they see the same text.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from .chat import (
    FALLBACK_TEMPLATE,
    ChatRequestError,
    compile_template,
    normalise_messages,
    render_prompt,
    tool_messages,
)
from .tools import parse_tools


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    name: str  # what /version reports: a built-in name, the file path, "gguf", "chatml-fallback"
    source: str  # file | builtin | inline | gguf | fallback
    jinja: str | None = None  # Jinja source (None: a llama.cpp built-in renders it)
    builtin: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source}


def resolve_chat_template(
    *, name: str | None, file: str | None, gguf_template: str | None, builtin_names: Sequence[str]
) -> ChatTemplate:
    """The template to serve with; SystemExit with one clear line for a bad name or file."""
    if file:
        path = Path(file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"--chat-template-file {file}: cannot read it ({exc})") from None
        return ChatTemplate(
            name=str(path), source="file", jinja=_checked(text, f"--chat-template-file {file}")
        )
    if name:
        if name in builtin_names:
            return ChatTemplate(name=name, source="builtin", builtin=name)
        if "{{" in name or "{%" in name:  # Jinja source given inline, as llama-server allows
            return ChatTemplate(
                name="inline", source="inline", jinja=_checked(name, "--chat-template")
            )
        raise SystemExit(
            f"--chat-template {name!r} is not a llama.cpp built-in template; built-ins: "
            + ", ".join(sorted(builtin_names))
            + " (or pass a Jinja file with --chat-template-file)"
        )
    if gguf_template:
        return ChatTemplate(name="gguf", source="gguf", jinja=gguf_template)
    return ChatTemplate(name="chatml-fallback", source="fallback", jinja=FALLBACK_TEMPLATE)


def _checked(text: str, what: str) -> str:
    try:
        compile_template(text)
    except jinja2.exceptions.TemplateError as exc:
        raise SystemExit(f"{what}: not a valid Jinja template ({exc})") from None
    return text


RunOnWorker = Callable[[Callable[[], str]], Awaitable[str]]
ApplyBuiltin = Callable[[str, Sequence[tuple[str, str]], bool], str]


class PromptRenderer:
    """Request (``messages`` or a plain ``prompt``) -> prompt text with the engine's template.

    Jinja renders on the trio thread (pure Python); a built-in template is a llama.cpp call,
    so it runs on the GPU worker (``run_on_worker``)."""

    def __init__(
        self,
        template: ChatTemplate,
        *,
        bos_token: str,
        eos_token: str,
        tokenizer_adds_bos: bool,
        run_on_worker: RunOnWorker,
        apply_builtin: ApplyBuiltin,
        describe_tools: bool = False,
    ) -> None:
        self.template = template
        # The generic tool format is in use: requests' tools are described in a system message.
        self._describe_tools = describe_tools
        self._bos = bos_token
        self._eos = eos_token
        # Prompts are tokenized with add_special: when the tokenizer adds BOS itself, a
        # template's own leading BOS text would make two (llama-server strips it the same way).
        self._strip_bos = tokenizer_adds_bos and bool(bos_token)
        self._run = run_on_worker
        self._apply_builtin = apply_builtin

    async def render(self, request: dict[str, Any]) -> str:
        tpl = self.template
        if "messages" not in request:
            return render_prompt(request, tpl.jinja, bos_token=self._bos, eos_token=self._eos)  # a plain prompt
        if tpl.jinja is not None:
            text = render_prompt(
                request, tpl.jinja, bos_token=self._bos, eos_token=self._eos, describe_tools=self._describe_tools
            )
            return text.removeprefix(self._bos) if self._strip_bos else text
        builtin = tpl.builtin
        assert builtin is not None
        # A built-in renders role and content only: tools are described in a system message
        # and earlier calls written as the generic format's JSON (chat.tool_messages).
        messages = tool_messages(
            normalise_messages(request["messages"]), None, parse_tools(request), describe=self._describe_tools
        )
        add_gen = request.get("add_generation_prompt", True)
        if not isinstance(add_gen, bool):
            raise ChatRequestError("add_generation_prompt must be a boolean")
        pairs = [(m["role"], m["content"]) for m in messages]
        try:
            return await self._run(lambda: self._apply_builtin(builtin, pairs, add_gen))
        except ValueError as exc:
            raise ChatRequestError(str(exc)) from None
