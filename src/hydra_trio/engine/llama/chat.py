"""The chat templates llama.cpp renders itself (``llama_chat_apply_template``)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp


def builtin_chat_templates() -> list[str]:
    """Names of the chat templates llama.cpp renders itself (llama_chat_apply_template)."""
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    arr = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(arr, n)
    return [name.decode("utf-8") for name in arr[:n] if name]


def apply_builtin_chat_template(name: str, messages: Sequence[tuple[str, str]], add_assistant: bool) -> str:
    """Render (role, content) messages with a built-in llama.cpp template."""
    encoded = [(role.encode("utf-8"), content.encode("utf-8")) for role, content in messages]
    chat = (llama_cpp.llama_chat_message * len(encoded))()
    for i, (role, content) in enumerate(encoded):
        chat[i].role = role
        chat[i].content = content
    size = max(256, 2 * sum(len(r) + len(c) for r, c in encoded) + 256)
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode("utf-8"), chat, len(encoded), add_assistant, buf, size)
        if n < 0:
            raise ValueError(f"llama.cpp cannot render chat template {name!r}")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n  # the buffer was short: n is the size it needs
    raise RuntimeError("llama_chat_apply_template kept growing")
