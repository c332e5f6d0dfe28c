"""Which chat template the engine uses.

Sources, first match wins: ``--chat-template-file PATH`` (Jinja), ``--chat-template NAME``
(a llama.cpp built-in name, rendered by llama_chat_apply_template on the GPU worker; or Jinja
source given inline), the GGUF's ``tokenizer.chat_template``, else ChatML.

A GGUF may carry named variants beside its default (``tokenizer.chat_template.NAME``, the names
listed in ``tokenizer.chat_templates``, as HF's dict-valued ``chat_template`` is converted).
As llama.cpp's ``common_chat_templates_init`` and ``_apply_jinja``: only the GGUF's own
templates have variants (an operator's template replaces them all); ``tool_use`` renders every
request that declares tools; a GGUF with no default but a ``tool_use`` serves that for all;
a ``tool_use`` that does not compile is ignored with a warning. ``ChatTemplate.for_request``
is the one place that choice is made.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jinja2

from .jinja import FALLBACK_TEMPLATE, compile_template

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    name: str  # what /version reports: a built-in name, the file path, "gguf", "chatml-fallback"
    source: str  # file | builtin | inline | gguf | fallback
    jinja: str | None = None  # Jinja source (None: a llama.cpp built-in renders it)
    builtin: str | None = None
    fallback_reason: str | None = None  # why the model's own template is not the one served
    variant: str = "default"  # which of the GGUF's named templates this is
    # The GGUF's tokenizer.chat_template.tool_use, for requests that declare tools.
    tool_use: ChatTemplate | None = None
    variants: tuple[str, ...] = ()  # every name the GGUF's tokenizer.chat_templates lists

    def for_request(self, declares_tools: bool) -> ChatTemplate:
        """The template a request renders through: the tool_use variant when it declares
        tools and the model has one (llama.cpp: ``tools.is_array() && template_tool_use``;
        HF transformers picks "tool_use" by the same rule), else this one."""
        return self.tool_use if declares_tools and self.tool_use is not None else self

    def describe(self) -> str:
        """One line for the start-up log: which template, and which variant serves tools."""
        text = f"{self.name} ({self.source}, {self.variant})"
        if self.tool_use is not None:
            text += f"; requests with tools: {self.tool_use.name} ({self.tool_use.variant})"
        return text

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "source": self.source}
        if self.variant != "default" or self.variants or self.tool_use is not None:
            out["variant"] = self.variant  # the GGUF has named templates: which this is
        if self.fallback_reason:
            out["fallback_reason"] = self.fallback_reason
        if self.variants:
            out["variants"] = list(self.variants)
        if self.tool_use is not None:
            out["tool_use"] = {"name": self.tool_use.name, "source": self.tool_use.source,
                               "variant": self.tool_use.variant}
        return out


def resolve_chat_template(
    *,
    name: str | None,
    file: str | None,
    gguf_template: str | None,
    builtin_names: Sequence[str],
    gguf_variants: Mapping[str, str] | None = None,
) -> ChatTemplate:
    """The template to serve with; SystemExit with one clear line for a bad name or file.
    ``gguf_variants``: the GGUF's named templates (``tokenizer.chat_template.NAME`` by NAME)."""
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
    variants = dict(gguf_variants or {})
    tool_use = _gguf_variant(variants.get("tool_use"))
    if not gguf_template and tool_use is not None:
        # llama.cpp: a GGUF with no default template serves its tool_use one for everything.
        return replace(tool_use, variants=tuple(sorted(variants)))
    if gguf_template:
        try:
            compile_template(gguf_template)
        except jinja2.exceptions.TemplateError as exc:
            # The model's own template is not ours to fix: serve ChatML, say so in the log
            # and in /version's chat_template, rather than refuse to start.
            reason = f"the GGUF's tokenizer.chat_template does not compile ({exc}); serving ChatML"
            log.warning("%s", reason)
            return ChatTemplate(name="chatml-fallback", source="fallback", jinja=FALLBACK_TEMPLATE,
                                fallback_reason=reason, tool_use=tool_use, variants=tuple(sorted(variants)))
        return ChatTemplate(name="gguf", source="gguf", jinja=gguf_template, tool_use=tool_use,
                            variants=tuple(sorted(variants)))
    return ChatTemplate(name="chatml-fallback", source="fallback", jinja=FALLBACK_TEMPLATE)


def _gguf_variant(text: str | None) -> ChatTemplate | None:
    """The GGUF's tool_use template, or None: absent, or (as llama.cpp) ignored with a
    warning when it does not compile."""
    if not text:
        return None
    try:
        compile_template(text)
    except jinja2.exceptions.TemplateError as exc:
        log.warning("the GGUF's tokenizer.chat_template.tool_use does not compile (%s); ignoring it", exc)
        return None
    return ChatTemplate(name="gguf:tool_use", source="gguf", jinja=text, variant="tool_use")


def _checked(text: str, what: str) -> str:
    try:
        compile_template(text)
    except jinja2.exceptions.TemplateError as exc:
        raise SystemExit(f"{what}: not a valid Jinja template ({exc})") from None
    return text
