"""Generation parameters from a request object (OpenAI names and llama.cpp names): pure
validation, every value's bounds decided here."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..wire import sampling as sampling_keys
from ..wire.errors import bad_param
from .chat import Constraint, ToolRequest, parse_tools, request_constraint
from .speculative import SPEC_TYPES, SpecRequest

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0  # OpenAI's, over the last repeat_last_n tokens (llama.cpp's)
    presence_penalty: float = 0.0
    seed: int = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: random
    ignore_eos: bool = False  # end-of-generation tokens are never sampled (benchmarks' convention)
    min_tokens: int = 0  # vLLM's: no end-of-generation token before this many (stop strings still stop)
    # GBNF every sampled token must follow (response_format, json_schema, grammar, tools), as text:
    # a pure value that pickles and compares; compiled on the GPU worker (llama/grammar.py).
    grammar: str | None = None
    # A lazy grammar's trigger patterns (tool_choice "auto": free text until the model starts
    # a call; llama/grammar.py's trigger_pattern); (): the grammar holds from the first token.
    grammar_triggers: tuple[str, ...] = ()
    grammar_param: str = field(default="grammar", compare=False)  # the key it came from: errors name it

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether any repetition penalty changes the logits before the pick."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


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
    # The request's declared tools (tools.py), tool_choice "none" included: what the reply
    # parser and the prompt renderer read. None: it declares none.
    tools: ToolRequest | None = None
    # The request's own speculative-decoding keys (engine/speculative.py); None: the server's.
    speculative: SpecRequest | None = None


MAX_DRAFT = 256


def parse_speculative(req: dict[str, Any]) -> SpecRequest | None:
    """A request's speculative decoding keys: ``"speculative": {"type", "n_max", "n_min"}``
    (``draft_n_max``/``draft_n_min`` too) or llama-server's flat ``speculative.n_max``,
    ``speculative.n_min``, ``speculative.type``; the object's keys beat the flat ones."""
    obj = req.get("speculative")
    if obj is not None and not isinstance(obj, dict):
        raise bad_param("speculative must be an object (type, n_max, n_min)", "speculative")
    flat = {k.removeprefix("speculative."): v for k, v in req.items() if k.startswith("speculative.")}
    keys = flat | {{"draft_n_max": "n_max", "draft_n_min": "n_min"}.get(k, k): v for k, v in (obj or {}).items()}
    if not keys:
        return None
    unknown = keys.keys() - {"type", "n_max", "n_min"}
    if unknown:
        raise bad_param(f"speculative: unknown keys {sorted(unknown)} (type, n_max, n_min)", "speculative")
    kind = keys.get("type")
    if kind is not None and kind not in SPEC_TYPES:
        raise bad_param(f"speculative.type must be one of {', '.join(SPEC_TYPES)}, got {kind!r}", "speculative")
    named = {f"speculative.{k}": v for k, v in keys.items()}
    n_max = _integer(named, ("speculative.n_max",), -1, 0, MAX_DRAFT)
    n_min = _integer(named, ("speculative.n_min",), -1, 0, MAX_DRAFT)
    return SpecRequest(type=kind, n_max=None if n_max < 0 else n_max, n_min=None if n_min < 0 else n_min)


def _number(req: dict[str, Any], names: tuple[str, ...], default: float, lo: float, hi: float) -> float:
    for name in names:
        if name in req and req[name] is not None:
            v = req[name]
            # (math.isfinite of an int past float's range raises OverflowError: floats only.)
            if isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, float) and not math.isfinite(v)):
                raise bad_param(f"{name} must be a number", name)
            if not lo <= v <= hi:
                raise bad_param(f"{name} must be between {lo} and {hi}, got {v}", name)
            return float(v)
    return default


def _integer(req: dict[str, Any], names: tuple[str, ...], default: int, lo: int, hi: int) -> int:
    for name in names:
        if name in req and req[name] is not None:
            v = req[name]
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad_param(f"{name} must be an integer", name)
            if not lo <= v <= hi:
                raise bad_param(f"{name} must be between {lo} and {hi}, got {v}", name)
            return v
    return default


def _boolean(req: dict[str, Any], name: str, default: bool) -> bool:
    v = req.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_param(f"{name} must be a boolean", name)
    return v


def parse_generation(
    req: dict[str, Any],
    *,
    default_n_predict: int,
    n_ctx: int,
    default_stream_interval: int = 1,
    to_gbnf: Callable[[Constraint], tuple[str, tuple[str, ...]]] | None = None,
) -> GenerationParams:
    """Validate and collect generation settings: one layer, flattened by the one precedence
    rule (wire/sampling.py: ``req["sampling"]`` keys beat ``req``'s own, aliases renamed).
    ``to_gbnf``: the engine's conversion of an output constraint to GBNF and its lazy
    triggers (llama/grammar.py; without it a constraint is refused)."""
    if req.get("sampling") is not None and not isinstance(req["sampling"], dict):
        raise bad_param("sampling must be an object", "sampling")
    merged = sampling_keys.flatten({k: v for k, v in req.items() if not (k == "sampling" and v is None)})

    n_predict = _integer(merged, ("max_completion_tokens", "max_tokens", "n_predict"), default_n_predict, -1, 1 << 30)
    if n_predict < 0 or n_predict > n_ctx:  # -1 = until the context ends
        n_predict = n_ctx
    seed = _integer(merged, ("seed",), 0xFFFFFFFF, -(1 << 63), (1 << 64) - 1)
    tools = parse_tools(merged)
    constraint = request_constraint(merged, tools)
    if constraint is not None and to_gbnf is None:
        raise bad_param(f"{constraint.param} is not supported here", constraint.param)
    grammar, triggers = (None, ()) if constraint is None or to_gbnf is None else to_gbnf(constraint)
    params = SamplingParams(
        temperature=_number(merged, ("temperature",), 0.0, 0.0, 100.0),
        top_k=_integer(merged, ("top_k",), 40, 0, 1 << 20),
        top_p=_number(merged, ("top_p",), 0.95, 0.0, 1.0),
        min_p=_number(merged, ("min_p",), 0.05, 0.0, 1.0),
        repeat_penalty=_number(merged, ("repeat_penalty",), 1.0, 0.0, 100.0),
        repeat_last_n=_integer(merged, ("repeat_last_n",), 64, 0, 1 << 20),
        frequency_penalty=_number(merged, ("frequency_penalty",), 0.0, -2.0, 2.0),
        presence_penalty=_number(merged, ("presence_penalty",), 0.0, -2.0, 2.0),
        seed=seed & 0xFFFFFFFF,
        ignore_eos=_boolean(merged, "ignore_eos", False),
        min_tokens=_integer(merged, ("min_tokens",), 0, 0, 1 << 30),
        grammar=grammar,
        grammar_triggers=triggers,
        grammar_param="grammar" if constraint is None else constraint.param,
    )
    if params.min_tokens > n_predict:
        raise bad_param(f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({n_predict})", "min_tokens")
    stop_raw = merged.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(s for s in stop_raw if s)
    else:
        raise bad_param("stop must be a string or an array of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN for s in stop):
        raise bad_param(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LEN} characters", "stop")
    stream = _boolean(merged, "stream", False)
    interval = _integer(merged, ("stream_interval",), default_stream_interval, 1, 4096)
    return GenerationParams(
        n_predict=n_predict,
        sampling=params,
        stop=stop,
        stream=stream,
        stream_interval=interval,
        tools=tools,
        speculative=parse_speculative(merged),
    )
