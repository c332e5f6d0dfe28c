"""Write a LoRA adapter GGUF for a base GGUF (tests, demos, benchmarks): random low-rank
deltas on every attention and feed-forward matrix of the base, in the format llama.cpp's
``llama_adapter_lora_init`` loads (src/llama-adapter.cpp) and convert_lora_to_gguf.py writes.

What llama.cpp checks, and so what this writes: ``general.type`` "adapter",
``general.architecture`` the base's, ``adapter.type`` "lora", ``adapter.lora.alpha`` (the
delta is scaled by alpha / rank, times the request's scale), and for each adapted weight
``NAME.lora_a`` (ggml shape [n_in, rank]) and ``NAME.lora_b`` ([rank, n_out]) where NAME is
a tensor of the base with shape [n_in, n_out].
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

# The base's matrices an adapter changes: what PEFT's usual target_modules map to.
_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_lora_adapter(
    base: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    rank: int = 8,
    alpha: float | None = None,
    strength: float = 1.0,
    name: str | None = None,
) -> Path:
    """Write an adapter for the GGUF at ``base`` to ``path`` and return its path.

    ``alpha`` defaults to ``rank`` (scale 1 applies the delta as written). ``strength``
    scales the deltas: at 1.0 they move a synthetic model's greedy text within a few tokens,
    so a test tells an adapted reply from the base's."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    reader = gguf.GGUFReader(str(base))
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ValueError(f"{base}: no general.architecture (not a model GGUF)")
    arch = str(bytes(arch_field.parts[arch_field.data[0]]), "utf-8")
    targets = [
        (t.name, int(t.shape[0]), int(t.shape[1]))  # ggml order: [n_in, n_out]
        for t in reader.tensors
        if len(t.shape) == 2 and t.name.startswith("blk.") and t.name.split(".")[2] in _TARGETS
    ]
    if not targets:
        raise ValueError(f"{base}: no attention or feed-forward matrices to adapt ({arch})")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_name(name or f"{Path(base).stem} LoRA s{seed}")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank if alpha is None else alpha))
    rng = np.random.default_rng(seed)
    for tensor_name, n_in, n_out in targets:
        stem = tensor_name.removesuffix(".weight")
        # numpy shapes are ggml's reversed: A is (rank, n_in), B is (n_out, rank).
        a = (rng.standard_normal((rank, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float32)
        b = (rng.standard_normal((n_out, rank), dtype=np.float32) * (strength / np.sqrt(rank))).astype(np.float32)
        writer.add_tensor(f"{stem}.weight.lora_a", a)
        writer.add_tensor(f"{stem}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)  # atomic, as write_model
    return out
