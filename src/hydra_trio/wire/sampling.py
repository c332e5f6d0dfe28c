"""Generation keys: their spellings and the one precedence rule, for HTTP bodies, DECODE
frames and CONFIGURE T1 alike (docs/rpc-protocol.md, "Generation parameters").

1. Layers, the later wins, key by key: a slot's CONFIGURE T1 settings, then a DECODE
   header's ``generation``, then the request itself (the prompt segment, or the HTTP body).
2. Within a layer, an object under ``"sampling"`` is flattened into the layer, and its keys
   beat the layer's own top-level keys of the same name: the object that says it is the
   sampling configuration is the more specific. The ``"speculative"`` object is flattened the
   same way, as ``speculative.<key>``, and beats llama-server's flat ``speculative.<key>``
   spellings of its layer.
3. Every key has one canonical name; its aliases (llama.cpp's, OpenAI's, the spec's) are
   renamed to it. Within one object the canonical spelling beats an alias, and of two aliases
   the one listed first in ``ALIASES`` (OpenAI's ``max_completion_tokens`` beats its older
   ``max_tokens``).

A flattened layer remembers how each key was spelled (``Layer.spelled``), so a refusal names
the parameter the client sent.
"""

from __future__ import annotations

from typing import Any

# alias -> canonical name, in rank order within a canonical name (earlier beats later). The
# canonical names are what parse_generation reads.
ALIASES: dict[str, str] = {
    "max_completion_tokens": "n_predict",  # OpenAI's
    "max_tokens": "n_predict",  # OpenAI's older name, and the spec's
    "temp": "temperature",
    "penalty_repeat": "repeat_penalty",
    "repetition_penalty": "repeat_penalty",  # vLLM's
    "penalty_last_n": "repeat_last_n",
    "penalty_freq": "frequency_penalty",
    "penalty_present": "presence_penalty",
    "thinking_budget_tokens": "reasoning_budget_tokens",  # llama-server's other spelling
}
_RANK = {alias: i + 1 for i, alias in enumerate(ALIASES)}  # canonical names rank 0

# The speculative object's keys (``"speculative": {...}``), by canonical name; its aliases.
SPEC_KEYS = ("type", "n_max", "n_min")
SPEC_ALIASES = {"draft_n_max": "n_max", "draft_n_min": "n_min"}
SPEC_PREFIX = "speculative."

# Speculative decoding's kinds, by llama-server's names (--spec-type and a request's
# "speculative": {"type"}): "ngram" is an alias of ngram-simple.
SPEC_TYPES = ("none", "ngram-simple", "ngram")

# The sampling keys CONFIGURE T1 may set per slot (spec §2.4), by canonical name.
T1_SAMPLING_KEYS = frozenset({"temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed"})


class Layer(dict[str, Any]):
    """Flat canonical keys, with how each was spelled where it came from."""

    __slots__ = ("spelled",)

    def __init__(self, items: dict[str, Any] | None = None, spelled: dict[str, str] | None = None) -> None:
        super().__init__(items or {})
        self.spelled: dict[str, str] = dict(spelled or {})

    def name(self, key: str) -> str:
        """The parameter as the client spelled it (for errors)."""
        return self.spelled.get(key, key)

    def update_from(self, other: Layer) -> None:
        """``other``'s keys win (a later layer, or a more specific object)."""
        self.update(other)
        self.spelled.update(other.spelled)


def canonical(obj: dict[str, Any], prefix: str = "", aliases: dict[str, str] = ALIASES) -> Layer:
    """``obj`` with aliases renamed (and ``prefix`` put before every name): of the spellings
    of one key, the canonical one wins, then the alias listed first."""
    out = Layer()
    rank: dict[str, int] = {}
    for key, value in obj.items():
        name = aliases.get(key, key)
        r = 0 if name == key else _RANK.get(key, len(_RANK) + 1)
        if name in rank and rank[name] <= r:
            continue
        full = prefix + name
        rank[name] = r
        out[full] = value
        out.spelled[full] = prefix + key if prefix else key
    return out


def flatten(layer: dict[str, Any]) -> Layer:
    """One layer as flat canonical keys (rule 2). An object under ``"sampling"`` or
    ``"speculative"`` that is not an object is left in place for the consumer to refuse."""
    if isinstance(layer, Layer):
        return layer
    sampling, spec = layer.get("sampling"), layer.get("speculative")
    nested = {k for k, v in (("sampling", sampling), ("speculative", spec)) if isinstance(v, dict)}
    out = canonical({k: v for k, v in layer.items() if k not in nested})
    if "speculative" in nested:
        out.update_from(canonical(spec, SPEC_PREFIX, SPEC_ALIASES))  # type: ignore[arg-type]  # a dict, checked above
    if "sampling" in nested:
        inner = canonical(sampling)  # type: ignore[arg-type]  # a dict, checked above
        inner.spelled = {k: f"sampling.{v}" for k, v in inner.spelled.items()}
        out.update_from(inner)
    return out


def merge(*layers: dict[str, Any]) -> Layer:
    """Layers flattened and merged key by key, the later winning (rule 1). Inputs are not
    mutated."""
    out = Layer()
    for layer in layers:
        out.update_from(flatten(layer))
    return out
