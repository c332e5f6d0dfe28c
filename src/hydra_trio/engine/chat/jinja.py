"""The Jinja environment chat templates render in: the globals and filters templates expect
of their host (``raise_exception``, ``tojson``), sandboxed; and the ChatML fallback."""

from __future__ import annotations

import json
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a GGUF carries no template: ChatML, the most common convention.
FALLBACK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    """``template``'s source compiled (jinja2's TemplateError for bad syntax)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    return env.from_string(template)
