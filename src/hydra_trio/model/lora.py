"""LoRA adapter files: the ``--lora`` / ``--lora-scaled`` specs (names, paths, default
scales) and what identifies an adapter GGUF wherever it is loaded (its metadata, and the
xxh3 of its bytes: two engines that load the same file under other names or ids agree on
it, so a KV made under it is recognised on either, and one made under another file is not).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..wire.hashing import format_tag
from .gguf_meta import GgufMeta


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One adapter as the command line names it; its id is its place in ``adapter_specs``."""

    name: str  # what a request's ``model`` selects it by (vLLM's), unique
    path: str
    scale: float  # the default scale: what requests without a ``lora`` list get


def adapter_specs(
    lora: Sequence[str], lora_scaled: Sequence[str], *, init_without_apply: bool = False
) -> tuple[AdapterSpec, ...]:
    """``--lora [NAME=]PATH`` (scale 1) then ``--lora-scaled [NAME=]PATH:SCALE``, in that order
    (their ids); NAME defaults to the file stem. SystemExit naming the flag for a malformed
    spec, a missing file or a name given twice (llama-server's flags, vLLM's names)."""
    out: list[AdapterSpec] = []
    for spec, scaled in [(x, False) for x in lora] + [(x, True) for x in lora_scaled]:
        flag = "--lora-scaled" if scaled else "--lora"
        text, scale = spec.strip(), 1.0
        if scaled:
            text, colon, raw = text.rpartition(":")
            try:
                scale = float(raw) if colon else math.nan
            except ValueError:
                scale = math.nan
            if not math.isfinite(scale):
                raise SystemExit(f"{flag} {spec!r}: expected [NAME=]PATH:SCALE with a finite number as SCALE")
        name, eq, path = text.partition("=")
        if not eq or "/" in name:  # no NAME= (a path may hold a '=' after a '/')
            name, path = Path(text).stem, text
        if not path or not os.path.isfile(path):
            raise SystemExit(f"{flag} {spec!r}: no such file {path!r}")
        if not name or any(a.name == name for a in out):
            raise SystemExit(f"{flag} {spec!r}: the adapter name {name!r} is empty or taken: give NAME=PATH")
        out.append(AdapterSpec(name, path, 0.0 if init_without_apply else scale))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class AdapterMeta:
    """What an adapter GGUF says of itself (llama-server's /lora-adapters fields), and its digest."""

    architecture: str
    alpha: float  # adapter.lora.alpha (0: the delta is applied unscaled by the rank)
    task_name: str
    prompt_prefix: str
    digest: str  # "xxh3:<16 hex>" of the file's bytes: the adapter's identity across engines


def read_adapter(path: str | os.PathLike[str]) -> AdapterMeta:
    """Read an adapter GGUF's metadata and digest (reads the whole file: run it off the trio
    thread). ValueError when it is not a LoRA adapter GGUF; OSError when it cannot be read."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            meta = GgufMeta(mm)
            digest = format_tag(xxhash.xxh3_64_intdigest(mm))
    except (ValueError, struct.error, OverflowError, MemoryError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file: {exc}") from exc
    kind, adapter = meta.get_str("general.type"), meta.get_str("adapter.type")
    if kind != "adapter" or adapter != "lora":
        raise ValueError(f"{path}: not a LoRA adapter (general.type {kind!r}, adapter.type {adapter!r}; a model GGUF "
                         "goes to --model)")
    alpha = meta.scalars.get("adapter.lora.alpha")
    return AdapterMeta(
        architecture=meta.get_str("general.architecture") or "",
        alpha=float(alpha) if isinstance(alpha, int | float) and not isinstance(alpha, bool) else 0.0,
        task_name=meta.get_str("adapter.lora.task_name") or "",
        prompt_prefix=meta.get_str("adapter.lora.prompt_prefix") or "",
        digest=digest,
    )
