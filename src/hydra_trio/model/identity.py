"""Model identity from a GGUF file (spec §5) and the DECODE identity gate (spec §4.2). The
GGUF's key/value section is read by gguf_meta.py."""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .gguf_meta import GgufMeta, MetaArray, model_quant, tokenizer_digest

__all__ = [
    "CAPABILITY_NAMES",
    "CAP_CODE",
    "CAP_MTP",
    "CAP_REASONING",
    "CAP_TOOL_USE",
    "CAP_VISION",
    "REJECTING_CAPABILITIES",
    "IdentityMatch",
    "ModelIdentity",
    "capabilities_from_metadata",
    "capability_names",
    "compare_identity",
    "file_sha256",
    "read_identity",
    "split_words",
]

CAP_MTP = 0x01
CAP_VISION = 0x02
CAP_REASONING = 0x04
CAP_TOOL_USE = 0x08
CAP_CODE = 0x10

CAPABILITY_NAMES: dict[int, str] = {
    CAP_MTP: "MTP",
    CAP_VISION: "VISION",
    CAP_REASONING: "REASONING",
    CAP_TOOL_USE: "TOOL_USE",
    CAP_CODE: "CODE",
}

# A KV cache built with/without these cannot be decoded by the other model (spec §4.2).
REJECTING_CAPABILITIES = CAP_MTP | CAP_VISION

_U32_MAX = 0xFFFFFFFF


def capability_names(bits: int) -> list[str]:
    """Names of the set bits, lowest first; bits without a name come out as ``BIT<n>``."""
    if not isinstance(bits, int) or bits <= 0:
        return []
    names: list[str] = []
    i = 0
    while bits >> i:
        bit = 1 << i
        if bits & bit:
            names.append(CAPABILITY_NAMES.get(bit, f"BIT{i}"))
        i += 1
    return names


# --------------------------------------------------------------------------------------------
# Identity


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    model_alias: str
    model_path: str
    tokenizer: str
    tokenizer_hash: str
    model_name: str
    model_quant: str
    model_capabilities: int
    architecture: str
    # SHA-256 of the GGUF file's bytes, 64 lowercase hex ("": not computed; the engine always
    # computes it at load: engine/modelfile.py).
    model_hash: str = ""

    def fields(self) -> dict[str, Any]:
        """The identity fields of spec §2 (STATE_* / PREFILL meta, INFO, hydra_metrics):
        ``model_hash`` among them once computed."""
        out: dict[str, Any] = {
            "model_alias": self.model_alias,
            "model_path": self.model_path,
            "tokenizer": self.tokenizer,
            "model_name": self.model_name,
            "model_quant": self.model_quant,
            "model_capabilities": self.model_capabilities,
        }
        if self.model_hash:
            out["model_hash"] = self.model_hash
        return out

    def with_hash(self, model_hash: str) -> ModelIdentity:
        return replace(self, model_hash=model_hash)

    def info_fields(self) -> dict[str, Any]:
        """Identity fields plus the INFO-only extras (ours)."""
        out = self.fields()
        out["tokenizer_hash"] = self.tokenizer_hash
        out["model_capabilities_names"] = capability_names(self.model_capabilities)
        return out


def read_identity(
    path: str | os.PathLike[str], *, alias: str | None = None, vision_projector: bool = False
) -> ModelIdentity:
    """Read a GGUF file's identity (spec §5) from its metadata only.

    ``alias`` is ``--alias`` (default: the file stem); ``vision_projector`` says a projector
    (mmproj) is loaded next to the model, which sets VISION. Raises ``OSError`` when the file
    cannot be opened and ``ValueError`` when it is not a readable GGUF file.
    """
    model_path = os.fspath(path)
    stem = Path(model_path).stem
    try:
        with open(model_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            meta = GgufMeta(mm)
            tokenizer_hash = tokenizer_digest(meta)
            quant = model_quant(meta)
            tags = meta.get_str_list("general.tags") or []
    except OSError:
        raise
    except (ValueError, struct.error, OverflowError, MemoryError) as e:
        # mmap of an empty file, bad magic, truncation: one error type for callers.
        raise ValueError(f"{model_path}: not a readable GGUF file: {e}") from e

    general_name = meta.get_str("general.name")
    base_name = meta.get_str("general.base_model.0.name")
    model_name = base_name or general_name or stem

    tok_model = meta.get_str("tokenizer.ggml.model") or "none"  # llama.cpp's "no vocab" spelling
    tok_pre = meta.get_str("tokenizer.ggml.pre")
    tokenizer = f"{tok_model}/{tok_pre}" if tok_pre else tok_model

    # The stem is only a display name when the file carries none.
    display_names = [n for n in (general_name, base_name) if n] or [stem]
    caps = capabilities_from_metadata(
        meta.scalars,
        tags=tags,
        display_names=display_names,
        vision_projector=vision_projector,
    )
    return ModelIdentity(
        model_alias=alias or stem,
        model_path=model_path,
        tokenizer=tokenizer,
        tokenizer_hash=tokenizer_hash,
        model_name=model_name,
        model_quant=quant,
        model_capabilities=caps,
        architecture=meta.get_str("general.architecture") or "unknown",
    )


_HASH_CHUNK = 8 << 20  # hashlib releases the GIL for each update this large


def file_sha256(path: str | os.PathLike[str], *, between_chunks: Callable[[], None] | None = None) -> str:
    """The SHA-256 of a file's bytes, 64 lowercase hex (``model_hash``). Read in 8 MiB chunks
    into one buffer; ``between_chunks`` runs after each (a caller's cancellation check)."""
    digest = hashlib.sha256()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            if between_chunks is not None:
                between_chunks()
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Capabilities

_TOOL_TAGS = frozenset({"tool", "tools", "tool-use", "function-calling"})
_CODE_TAGS = frozenset({"code", "coding", "coder", "codes"})
_TOOL_WORDS = frozenset({"tool", "tools", "tooluse", "functioncalling"})
_CODE_WORDS = frozenset({"code", "coding", "coder", "codes"})
_TOOL_PHRASES = (("function", "calling"),)  # "function calling", "FunctionCalling", ...
_TAG_SEPARATORS = re.compile(r"[\s_\-]+")
_NON_WORD = re.compile(r"[\W_]+")  # anything but letters and digits separates words


def split_words(text: str) -> list[str]:
    """Split a display name into words (original case).

    Words are runs of letters/digits; inside a run, a lower→upper change, a letter↔digit
    change, and the last capital of a capital run followed by a lowercase letter
    ("HTMLParser" → HTML, Parser) are boundaries too. "Qwen2.5-Coder-7B" → Qwen, 2, 5, Coder,
    7, B; "CodeLlama" → Code, Llama; "Decoder" stays one word.
    """
    words: list[str] = []
    for chunk in _NON_WORD.split(text):
        if not chunk:
            continue
        kinds = [_char_kind(ch) for ch in chunk]
        start = 0
        for i in range(1, len(chunk)):
            prev, cur = kinds[i - 1], kinds[i]
            if (
                (prev == "d") != (cur == "d")
                or (prev == "l" and cur == "u")
                or (prev == "u" and cur == "u" and i + 1 < len(chunk) and kinds[i + 1] == "l")
            ):
                words.append(chunk[start:i])
                start = i
        words.append(chunk[start:])
    return words


def _char_kind(ch: str) -> str:
    if ch.isupper():
        return "u"
    if ch.isalpha():
        return "l"  # lowercase, and caseless letters (CJK, ...) behave like lowercase
    return "d"  # digits and other numeric characters


def _name_has(
    words: list[str], singles: frozenset[str], phrases: Iterable[tuple[str, ...]]
) -> bool:
    if any(w in singles for w in words):
        return True
    for phrase in phrases:
        n = len(phrase)
        if any(tuple(words[i : i + n]) == phrase for i in range(len(words) - n + 1)):
            return True
    return False


def _truthy(value: Any) -> bool:
    if isinstance(value, MetaArray):
        return value.count > 0
    return bool(value)


def capabilities_from_metadata(
    kv: Mapping[str, Any],
    *,
    tags: Iterable[str],
    display_names: Iterable[str],
    vision_projector: bool = False,
) -> int:
    """Capability bits (spec §5) from GGUF metadata values, tags and display names.

    VISION rules (the spec only says "declares vision keys"): a projector is loaded; or
    ``general.architecture`` is ``clip``/``mmproj`` (an mmproj file) unless
    ``clip.has_vision_encoder`` is explicitly false (audio-only projector); or a key has a
    non-final dotted segment ``vision`` (``clip.vision.*``, ``<arch>.vision.*``); or a key with
    a segment ``vision``, starting with ``has_vision`` or containing ``mmproj`` holds a
    true/non-zero/non-empty value (``clip.has_vision_encoder = true``).
    """
    caps = 0
    for key, value in kv.items():
        parts = key.split(".")
        last = parts[-1]
        if (
            last == "nextn_predict_layers"
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value > 0
        ):
            caps |= CAP_MTP
        if "vision" in parts[:-1] or (
            any(p == "vision" or p.startswith("has_vision") or "mmproj" in p for p in parts)
            and _truthy(value)
        ):
            caps |= CAP_VISION
    arch = kv.get("general.architecture")
    if (
        isinstance(arch, str)
        and arch.casefold() in ("clip", "mmproj")
        and kv.get("clip.has_vision_encoder") is not False
    ):
        caps |= CAP_VISION
    if vision_projector:
        caps |= CAP_VISION

    # Tags: separators are equivalent ("tool_use" == "tool-use" == "tool use").
    norm_tags = [_TAG_SEPARATORS.sub("-", t.strip().casefold()) for t in tags if isinstance(t, str)]
    if any("reasoning" in t for t in norm_tags):
        caps |= CAP_REASONING
    if any(t in _TOOL_TAGS for t in norm_tags):
        caps |= CAP_TOOL_USE
    if any(t in _CODE_TAGS for t in norm_tags):
        caps |= CAP_CODE

    for name in display_names:
        words = [w.casefold() for w in split_words(name)]
        if _name_has(words, _TOOL_WORDS, _TOOL_PHRASES):
            caps |= CAP_TOOL_USE
        if _name_has(words, _CODE_WORDS, ()):
            caps |= CAP_CODE
    return caps


# --------------------------------------------------------------------------------------------
# Identity gate (spec §4.2)


@dataclass(frozen=True, slots=True)
class IdentityMatch:
    tokenizer_match: bool
    tokenizer_hash_match: bool | None  # None: the KV side sent no tokenizer_hash
    model_hash_match: bool | None  # None: the KV side sent no model_hash (or none is known here)
    model_name_match: bool
    model_quant_match: bool
    model_capabilities_match: bool
    model_alias_match: bool
    capabilities_xor: int
    capabilities_diff_bits: tuple[str, ...]
    accepted: bool
    reason: str  # every failing check, "; "-separated; "" when accepted
    # The LoRA adapter set the KV claims (``lora``; none claimed: the base model) is the
    # request's; None: not checked (no request set given: the engine's own slot KV).
    lora_match: bool | None = None

    def as_meta(self) -> dict[str, Any]:
        """The ``match`` object of DECODE replies."""
        return {
            "tokenizer_match": self.tokenizer_match,
            "tokenizer_hash_match": self.tokenizer_hash_match,
            "model_hash_match": self.model_hash_match,
            "model_name_match": self.model_name_match,
            "model_quant_match": self.model_quant_match,
            "model_capabilities_match": self.model_capabilities_match,
            "model_alias_match": self.model_alias_match,
            "capabilities_xor": self.capabilities_xor,
            "capabilities_diff_bits": list(self.capabilities_diff_bits),
            **({} if self.lora_match is None else {"lora_match": self.lora_match}),
        }


def _short(value: Any, limit: int = 80) -> str:
    """repr() cut to ``limit`` characters: reasons quote coordinator input, which may be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kv_str(kv: Mapping[Any, Any], key: str) -> tuple[str | None, str]:
    """(value, problem): value when ``kv[key]`` is a string, else a description of what it is."""
    if key not in kv:
        return None, f"kv_metadata.{key} missing"
    value = kv[key]
    if value is None:
        return None, f"kv_metadata.{key} is null"
    if not isinstance(value, str):
        return None, f"kv_metadata.{key} is not a string ({type(value).__name__})"
    return value, ""


def compare_identity(
    resident: ModelIdentity,
    kv_meta: Mapping[str, Any] | None,
    *,
    header_model: str | None,
    lora: Sequence[Mapping[str, Any]] | None = None,
) -> IdentityMatch:
    """Check a DECODE's ``kv_metadata`` (+ header ``model``) against the resident model, and
    (``lora``: the request's LoRA adapter set as KV claims carry it, engine/adapters.py
    ``claims``) the adapter set the KV claims against the request's: KV made under one set
    never continues under another (different weights made it).

    Never raises: ``kv_meta`` comes from a coordinator's JSON and may hold anything.
    """
    reasons: list[str] = []
    kv: Mapping[Any, Any]
    if isinstance(kv_meta, Mapping):
        kv = kv_meta
    else:
        kv = {}
        reasons.append(f"kv_metadata is not an object ({type(kv_meta).__name__})")
    alias = resident.model_alias

    tok, problem = _kv_str(kv, "tokenizer")
    tokenizer_match = tok == resident.tokenizer
    if problem:
        reasons.append(problem)
    elif not tokenizer_match:
        reasons.append(f"tokenizer mismatch: kv {_short(tok)}, resident {resident.tokenizer!r}")

    # The hash is ours: checked only when the KV side sent one (null counts as not sent).
    tokenizer_hash_match: bool | None = None
    if kv.get("tokenizer_hash") is not None:
        kv_hash = kv["tokenizer_hash"]
        tokenizer_hash_match = isinstance(kv_hash, str) and kv_hash == resident.tokenizer_hash
        if not tokenizer_hash_match:
            reasons.append(
                f"tokenizer_hash mismatch: kv {_short(kv_hash)}, "
                f"resident {resident.tokenizer_hash!r}"
            )

    # The GGUF file's SHA-256, checked when the KV side sent one: KV made by exactly that file
    # (one quantisation; a sender allowing mixed quantisation leaves it out).
    model_hash_match: bool | None = None
    if kv.get("model_hash") is not None and resident.model_hash:
        kv_model_hash = kv["model_hash"]
        model_hash_match = isinstance(kv_model_hash, str) and kv_model_hash.lower() == resident.model_hash
        if not model_hash_match:
            reasons.append(
                f"model_hash mismatch: kv {_short(kv_model_hash)}, resident {resident.model_hash!r}"
            )

    kv_alias = kv.get("model_alias")
    model_alias_match = (isinstance(kv_alias, str) and kv_alias == alias) or (
        isinstance(header_model, str) and header_model == alias
    )
    name, name_problem = _kv_str(kv, "model_name")
    model_name_match = name == resident.model_name or model_alias_match
    if not model_name_match:
        what = (
            name_problem
            or f"model_name mismatch: kv {_short(name)}, resident {resident.model_name!r}"
        )
        reasons.append(f"{what} (and neither kv model_alias nor header model is {alias!r})")

    quant, _ = _kv_str(kv, "model_quant")
    model_quant_match = quant == resident.model_quant  # reported only: mixed quant is allowed

    raw_caps = kv.get("model_capabilities")
    caps_note = ""
    if isinstance(raw_caps, int) and not isinstance(raw_caps, bool) and 0 <= raw_caps <= _U32_MAX:
        kv_caps = raw_caps
    else:
        kv_caps = 0
        caps_note = (
            "kv_metadata.model_capabilities missing, treated as 0"
            if raw_caps is None
            else f"kv_metadata.model_capabilities invalid ({_short(raw_caps, 40)}), treated as 0"
        )
    xor = (kv_caps ^ resident.model_capabilities) & _U32_MAX
    diff_bits = tuple(capability_names(xor))
    rejecting = xor & REJECTING_CAPABILITIES
    if rejecting:
        reasons.append(
            f"capability mismatch on {', '.join(capability_names(rejecting))}: "
            f"kv 0x{kv_caps:02x}, resident 0x{resident.model_capabilities:02x}"
            + (f" ({caps_note})" if caps_note else "")
        )

    lora_match = None
    if lora is not None:
        claimed, problem = _lora_claim(kv.get("lora"))
        lora_match = claimed == _lora_key(lora)
        if problem:
            reasons.append(problem)
        elif not lora_match:
            reasons.append(
                f"LoRA adapter set mismatch: kv {_short(_lora_names(kv.get('lora')))}, request "
                f"{_short(_lora_names(lora))}"
            )
    accepted = not reasons
    return IdentityMatch(
        tokenizer_match=tokenizer_match,
        tokenizer_hash_match=tokenizer_hash_match,
        model_hash_match=model_hash_match,
        model_name_match=model_name_match,
        model_quant_match=model_quant_match,
        model_capabilities_match=xor == 0,
        model_alias_match=model_alias_match,
        capabilities_xor=xor,
        capabilities_diff_bits=diff_bits,
        accepted=accepted,
        reason="; ".join(reasons),
        lora_match=lora_match,
    )


def _lora_key(adapters: Sequence[Mapping[str, Any]]) -> list[tuple[str, float]]:
    """A set as compared: (file digest, scale) pairs, sorted (ids and names are local)."""
    return sorted((str(a["digest"]), float(a["scale"])) for a in adapters)


def _lora_claim(value: Any) -> tuple[list[tuple[str, float]] | None, str]:
    """The set ``kv_metadata.lora`` claims (absent or null: none, the base model), or why it
    is malformed."""
    if value is None:
        return [], ""
    ok = isinstance(value, list) and all(
        isinstance(a, Mapping) and isinstance(a.get("digest"), str)
        and isinstance(a.get("scale"), int | float) and not isinstance(a.get("scale"), bool)
        for a in value
    )
    if not ok:
        return None, f"kv_metadata.lora is not a list of {{name, digest, scale}} objects ({_short(value, 40)})"
    return _lora_key(value), ""


def _lora_names(value: Any) -> list[str]:
    if not isinstance(value, list):
        return []
    return [f"{a.get('name', a.get('digest'))}*{a.get('scale')}" for a in value if isinstance(a, Mapping)]
