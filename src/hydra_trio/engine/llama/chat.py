"""The chat templates llama.cpp renders itself (``llama_chat_apply_template``), and the
named templates a GGUF holds."""

from __future__ import annotations

import ctypes
import json
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


def gguf_template_variants(model: llama_cpp.llama_model_p) -> dict[str, str]:
    """The GGUF's named templates: those ``tokenizer.chat_templates`` lists, and
    ``tool_use`` (the one llama.cpp selects) even where the list is missing."""
    names = {"tool_use"}
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_model_meta_val_str(model, b"tokenizer.chat_templates", buf, len(buf))
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        n = llama_cpp.llama_model_meta_val_str(model, b"tokenizer.chat_templates", buf, len(buf))
    if n > 0:
        try:  # llama.cpp prints a string array as ["a", "b"]
            listed = json.loads(buf.value.decode("utf-8", "replace"))
        except ValueError:
            listed = []
        names.update(x for x in listed if isinstance(x, str))
    out: dict[str, str] = {}
    for name in sorted(names):
        ptr = llama_cpp.llama_model_chat_template(model, name.encode())
        if ptr:
            out[name] = ptr.decode("utf-8", "replace")
    return out
