"""Generation keys: their spellings and the one precedence rule, for HTTP bodies, DECODE
frames and CONFIGURE T1 alike (docs/rpc-protocol.md, "Generation parameters").

1. Layers, the later wins: a slot's CONFIGURE T1 settings, then a DECODE header's
   ``generation``, then the request itself (the prompt segment, or the HTTP body).
2. Within a layer, an object under ``"sampling"`` is flattened into the layer, and its keys
   beat the layer's own top-level keys of the same name: the object that says it is the
   sampling configuration is the more specific.
3. Every key has one canonical name; its aliases (llama.cpp's, the spec's) are renamed to
   it, and within one object the canonical spelling beats an alias.
"""

from __future__ import annotations

from typing import Any

# alias -> canonical name. The canonical names are what parse_generation reads.
ALIASES: dict[str, str] = {
    "temp": "temperature",
    "penalty_repeat": "repeat_penalty",
    "repetition_penalty": "repeat_penalty",  # vLLM's
    "penalty_last_n": "repeat_last_n",
    "penalty_freq": "frequency_penalty",
    "penalty_present": "presence_penalty",
}

# Speculative decoding's kinds, by llama-server's names (--spec-type and a request's
# "speculative": {"type"}): "ngram" is an alias of ngram-simple.
SPEC_TYPES = ("none", "ngram-simple", "ngram")

# The sampling keys CONFIGURE T1 may set per slot (spec §2.4), by canonical name.
T1_SAMPLING_KEYS = frozenset({"temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed"})


def canonical(layer: dict[str, Any]) -> dict[str, Any]:
    """``layer`` with aliases renamed; the canonical spelling, given too, beats its alias."""
    out: dict[str, Any] = {}
    for key, value in layer.items():
        name = ALIASES.get(key, key)
        if name != key and name in layer:
            continue
        out[name] = value
    return out


def flatten(layer: dict[str, Any]) -> dict[str, Any]:
    """One layer as flat canonical keys: its ``"sampling"`` object's keys beat its own. A
    non-object ``"sampling"`` is left in place for the consumer to refuse."""
    sampling = layer.get("sampling")
    if not isinstance(sampling, dict):
        return canonical(layer)
    top = canonical({k: v for k, v in layer.items() if k != "sampling"})
    return top | canonical(sampling)


def merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """Layers flattened and merged, the later winning (rule 1). Inputs are not mutated."""
    out: dict[str, Any] = {}
    for layer in layers:
        out |= flatten(layer)
    return out
