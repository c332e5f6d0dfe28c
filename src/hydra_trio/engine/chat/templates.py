"""Which chat template the engine uses.

Sources, first match wins: ``--chat-template-file PATH`` (Jinja), ``--chat-template NAME``
(a llama.cpp built-in name, rendered by llama_chat_apply_template on the GPU worker; or Jinja
source given inline), the GGUF's ``tokenizer.chat_template``, else ChatML.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
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

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "source": self.source}
        if self.fallback_reason:
            out["fallback_reason"] = self.fallback_reason
        return out


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
        try:
            compile_template(gguf_template)
        except jinja2.exceptions.TemplateError as exc:
            # The model's own template is not ours to fix: serve ChatML, say so in the log
            # and in /version's chat_template, rather than refuse to start.
            reason = f"the GGUF's tokenizer.chat_template does not compile ({exc}); serving ChatML"
            log.warning("%s", reason)
            return ChatTemplate(name="chatml-fallback", source="fallback", jinja=FALLBACK_TEMPLATE,
                                fallback_reason=reason)
        return ChatTemplate(name="gguf", source="gguf", jinja=gguf_template)
    return ChatTemplate(name="chatml-fallback", source="fallback", jinja=FALLBACK_TEMPLATE)


def _checked(text: str, what: str) -> str:
    try:
        compile_template(text)
    except jinja2.exceptions.TemplateError as exc:
        raise SystemExit(f"{what}: not a valid Jinja template ({exc})") from None
    return text
