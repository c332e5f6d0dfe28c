"""Generation parameters from a request object (OpenAI names and llama.cpp names): pure
validation, every value's bounds decided here."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..wire import sampling as sampling_keys
from ..wire.errors import bad_param
from ..wire.sampling import SPEC_TYPES
from .chat import ToolRequest, parse_tools
from .llama import LoraSet
from .sample import SamplingParams
from .speculation import SpecRequest
from .structured import Constraint, ThinkGate, ThinkPlan, request_constraint

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256


@dataclass(frozen=True, slots=True)
class GenerationParams:
    n_predict: int
    sampling: SamplingParams
    stop: tuple[str, ...] = field(default=())
    stream: bool = False
    stream_interval: int = 1  # streamed tokens per chunk at most (the first goes alone)
    # Log-probabilities of the sampled tokens with this many top alternatives (0..20);
    # None: not asked (set by the OpenAI routes, which each spell it their own way).
    logprobs: int | None = None
    # vLLM's cache_salt: KV computed under it is reused only by requests with the same one
    # (LlamaBackend.shared_prefix). None: unsalted. Set by the OpenAI routes.
    cache_salt: str | None = None
    # The LoRA adapter set it runs under (engine/adapters.py ``choose``): its KV is that
    # set's too; ``lora_name`` names it (logs; None: the base model). ``model``: the adapter
    # its "model" named, which replies call the model by (None: the served name).
    lora: LoraSet = ()
    lora_name: str | None = None
    model: str | None = None
    # The request's declared tools (tools.py), tool_choice "none" included: what the reply
    # parser and the prompt renderer read. None: it declares none.
    tools: ToolRequest | None = None
    # What its output must follow, as it asked (the grammar it becomes is the chat plan's,
    # in sampling.grammar). None: nothing.
    constraint: Constraint | None = None
    # The request's own speculative-decoding keys (engine/speculation/request.py); None: the
    # server's.
    speculative: SpecRequest | None = None
    # Control tokens whose text the reply shows (a chat template's tool and think syntax,
    # chat/__init__.py ``Chat.shown_tokens``); every other control token adds no text.
    shown_tokens: frozenset[int] = frozenset()
    # The thinking budget in force (llama-server's reasoning_budget_tokens, else
    # --reasoning-budget): -1 unlimited, 0 thinking off, N: at most N tokens of reasoning.
    reasoning_budget: int = -1
    # How generation treats the reply's think block (its budget, and a grammar held until the
    # block closes): set with the rendered prompt (Inputs.think_plan); None: nothing to do.
    thinking: ThinkPlan | None = None

    def think_gate(self, token_bytes: Callable[[int], bytes]) -> ThinkGate | None:
        """One generation's think-block state for its sampler (``token_bytes``: each token's
        shown text); None when the plan asks nothing."""
        return None if self.thinking is None else ThinkGate(self.thinking, token_bytes)


MAX_DRAFT = 256


@dataclass(frozen=True, slots=True)
class Bound:
    """A generation key's type and inclusive range."""

    kind: type  # int or float (a number: an int is taken too)
    lo: float
    hi: float


# Every numeric generation key's bounds, by canonical name: the one validation of a value,
# for requests (HTTP, DECODE) and for CONFIGURE T1 alike (``check_value``).
BOUNDS: dict[str, Bound] = {
    "n_predict": Bound(int, -1, 1 << 30),  # -1: until the context ends
    "seed": Bound(int, -(1 << 63), (1 << 64) - 1),
    "temperature": Bound(float, 0.0, 100.0),
    "top_k": Bound(int, 0, 1 << 20),
    "top_p": Bound(float, 0.0, 1.0),
    "min_p": Bound(float, 0.0, 1.0),
    "repeat_penalty": Bound(float, 0.0, 100.0),
    "repeat_last_n": Bound(int, 0, 1 << 20),
    "frequency_penalty": Bound(float, -2.0, 2.0),
    "presence_penalty": Bound(float, -2.0, 2.0),
    "min_tokens": Bound(int, 0, 1 << 30),
    "stream_interval": Bound(int, 1, 4096),
    "reasoning_budget_tokens": Bound(int, -1, 1 << 30),  # -1: the server's (--reasoning-budget)
    "speculative.n_max": Bound(int, 0, MAX_DRAFT),
    "speculative.n_min": Bound(int, 0, MAX_DRAFT),
}


def check_value(key: str, value: Any, name: str | None = None) -> int | float:
    """``value`` of the canonical generation key ``key`` if it is of its type and range; a
    400 naming the parameter as spelled (``name``) otherwise."""
    name = name or key
    bound = BOUNDS[key]
    if bound.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_param(f"{name} must be an integer", name)
    # (math.isfinite of an int past float's range raises OverflowError: floats only.)
    elif (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise bad_param(f"{name} must be a number", name)
    if not bound.lo <= value <= bound.hi:
        lo, hi = (int(bound.lo), int(bound.hi)) if bound.kind is int else (bound.lo, bound.hi)
        raise bad_param(f"{name} must be between {lo} and {hi}, got {value}", name)
    return value if bound.kind is int else float(value)


def _value(keys: sampling_keys.Layer, key: str, default: Any) -> Any:
    v = keys.get(key)
    return default if v is None else check_value(key, v, keys.name(key))


def _boolean(keys: sampling_keys.Layer, key: str, default: bool) -> bool:
    v = keys.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_param(f"{keys.name(key)} must be a boolean", keys.name(key))
    return v


def parse_stop(value: Any, name: str = "stop") -> tuple[str, ...]:
    """Stop strings (a string or an array of them; empty ones dropped), bounded."""
    if value is None:
        return ()
    if isinstance(value, str):
        stop: tuple[str, ...] = (value,) if value else ()
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
        stop = tuple(s for s in value if s)
    else:
        raise bad_param(f"{name} must be a string or an array of strings", name)
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN for s in stop):
        raise bad_param(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LEN} characters", name)
    return stop


def parse_speculative(req: dict[str, Any]) -> SpecRequest | None:
    """A request's speculative decoding keys, flattened by the one rule (wire/sampling.py):
    ``"speculative": {"type", "n_max", "n_min"}`` (``draft_n_max``/``draft_n_min`` too) or
    llama-server's flat ``speculative.n_max``, ``speculative.n_min``, ``speculative.type``."""
    keys = sampling_keys.flatten(req)
    if keys.get("speculative") is not None:  # an object was flattened away: what is left under this name is no object
        raise bad_param("speculative must be an object (type, n_max, n_min)", "speculative")
    prefix = sampling_keys.SPEC_PREFIX
    found = {k.removeprefix(prefix): k for k in keys if k.startswith(prefix)}
    if not found:
        return None
    unknown = found.keys() - set(sampling_keys.SPEC_KEYS)
    if unknown:
        raise bad_param(f"speculative: unknown keys {sorted(unknown)} (type, n_max, n_min)", "speculative")
    kind = keys.get(prefix + "type")
    if kind is not None and kind not in SPEC_TYPES:
        raise bad_param(f"speculative.type must be one of {', '.join(SPEC_TYPES)}, got {kind!r}", "speculative")
    n_max = _value(keys, prefix + "n_max", None)
    n_min = _value(keys, prefix + "n_min", None)
    return SpecRequest(type=kind, n_max=n_max, n_min=n_min)


def parse_generation(
    req: dict[str, Any],
    *,
    default_n_predict: int,
    n_ctx: int,
    default_stream_interval: int = 1,
    default_reasoning_budget: int = -1,
) -> GenerationParams:
    """Validate and collect generation settings from one layer, or layers merged already
    (``wire.sampling.merge``), by the one precedence rule (wire/sampling.py). The output
    constraint is parsed (what the request asks); its grammar is the chat plan's."""
    if req.get("sampling") is not None and not isinstance(req["sampling"], dict):
        raise bad_param("sampling must be an object", "sampling")
    keys = sampling_keys.flatten(
        req
        if isinstance(req, sampling_keys.Layer)
        else {k: v for k, v in req.items() if not (k == "sampling" and v is None)}
    )

    n_predict = _value(keys, "n_predict", default_n_predict)
    echo_only = req.get("echo") is True and "messages" not in req  # /v1/completions' prompt alone (lm-eval)
    if n_predict == 0 and not echo_only:  # it would still generate a token (there is no prompt echo to return)
        name = keys.name("n_predict")
        raise bad_param(f"{name} must be at least 1 (or -1: until the context ends), got 0", name)
    if n_predict < 0 or n_predict > n_ctx:  # -1 = until the context ends
        n_predict = n_ctx
    seed = _value(keys, "seed", 0xFFFFFFFF)
    tools = parse_tools(keys)
    params = SamplingParams(
        temperature=_value(keys, "temperature", 0.0),
        top_k=_value(keys, "top_k", 40),
        top_p=_value(keys, "top_p", 0.95),
        min_p=_value(keys, "min_p", 0.05),
        repeat_penalty=_value(keys, "repeat_penalty", 1.0),
        repeat_last_n=_value(keys, "repeat_last_n", 64),
        frequency_penalty=_value(keys, "frequency_penalty", 0.0),
        presence_penalty=_value(keys, "presence_penalty", 0.0),
        seed=seed & 0xFFFFFFFF,
        ignore_eos=_boolean(keys, "ignore_eos", False),
        min_tokens=_value(keys, "min_tokens", 0),
    )
    budget = _value(keys, "reasoning_budget_tokens", -1)  # -1: the server's, as llama-server
    if params.min_tokens > n_predict:
        raise bad_param(f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({n_predict})", "min_tokens")
    return GenerationParams(
        n_predict=n_predict,
        sampling=params,
        stop=parse_stop(keys.get("stop"), keys.name("stop")),
        stream=_boolean(keys, "stream", False),
        stream_interval=_value(keys, "stream_interval", default_stream_interval),
        tools=tools,
        constraint=request_constraint(keys, tools),
        speculative=parse_speculative(keys),
        reasoning_budget=default_reasoning_budget if budget == -1 else budget,
    )
