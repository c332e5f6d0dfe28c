"""One table of spellings and one precedence for generation keys (wire/sampling.py), the same
over HTTP bodies, DECODE frames and CONFIGURE T1: later layers beat earlier ones key by key,
a layer's ``sampling`` object beats its top-level keys (its ``speculative`` object beats the
flat ``speculative.*`` spellings), and within one object the canonical spelling beats an
alias, the alias listed first beating the later ones. And one validation of every value,
for requests and CONFIGURE T1 alike."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.engine import GenerationParams
from hydra_trio.engine.configure import SlotSettings, _validate_t1
from hydra_trio.engine.params import BOUNDS, parse_generation
from hydra_trio.engine.sched import SlotTable
from hydra_trio.wire import (
    ProtocolError,
    encode_decode_frame_v3,
    merged_generation,
    parse_decode_frame,
    sampling,
)
from hydra_trio.wire.errors import ParamError

N_CTX = 4096


def _http(body: dict[str, Any]) -> GenerationParams:
    return parse_generation(body, default_n_predict=16, n_ctx=N_CTX)


def _decode(t1: dict[str, Any] | None, generation: dict[str, Any] | None, request: dict[str, Any]) -> GenerationParams:
    header: dict[str, Any] = {} if generation is None else {"generation": generation}
    frame = parse_decode_frame(encode_decode_frame_v3(header, request, b""))
    defaults = sampling.Layer()
    if t1 is not None:
        slots = SlotSettings(SlotTable(1))
        keys, _ = _validate_t1(t1)
        slots.apply(0, keys)
        defaults = slots.generation_defaults(0)
    return parse_generation(sampling.merge(defaults, merged_generation(frame)), default_n_predict=16, n_ctx=N_CTX)


# Every numeric generation key, each spelling it has, and how to read it back.
SPELLINGS: dict[str, list[str]] = {key: [key] for key in BOUNDS}
for alias, name in sampling.ALIASES.items():
    SPELLINGS[name].append(alias)
# The rank of a key's spellings, stated here rather than read from ALIASES' order.
SPELLINGS["n_predict"] = ["n_predict", "max_completion_tokens", "max_tokens"]
SPELLINGS["repeat_penalty"] = ["repeat_penalty", "penalty_repeat", "repetition_penalty"]
assert {a for s in SPELLINGS.values() for a in s[1:]} == set(sampling.ALIASES)
SPEC_SPELLINGS = {"speculative.n_max": ["n_max", "draft_n_max"], "speculative.n_min": ["n_min", "draft_n_min"]}


def read(params: GenerationParams, key: str) -> Any:
    if key == "n_predict":
        return params.n_predict
    if key == "stream_interval":
        return params.stream_interval
    if key == "reasoning_budget_tokens":
        return params.reasoning_budget
    if key.startswith("speculative."):
        spec = params.speculative
        return None if spec is None else getattr(spec, key.removeprefix("speculative."))
    value = getattr(params.sampling, key)
    return value


def valid(key: str) -> st.SearchStrategy[Any]:
    if key == "n_predict":
        return st.integers(3, 100)  # min_tokens stays below it
    if key == "min_tokens":
        return st.integers(0, 2)
    if key == "seed":
        return st.integers(0, 0xFFFFFFFF)
    bound = BOUNDS[key]
    if bound.kind is int:
        return st.integers(int(bound.lo), min(int(bound.hi), 1000))
    return st.floats(bound.lo, bound.hi, allow_nan=False).map(lambda v: round(v, 3))


@st.composite
def layers(draw: Any) -> dict[str, Any]:
    """A layer: top-level keys (any spelling, llama-server's flat speculative.* too), maybe a
    sampling object and a speculative object."""
    def obj(spellings: dict[str, list[str]], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in draw(st.lists(st.sampled_from(sorted(spellings)), max_size=4, unique=True)):
            for spelled in draw(st.lists(st.sampled_from(spellings[key]), min_size=1, max_size=2, unique=True)):
                out[prefix + spelled] = draw(valid(key))
        return out
    layer = obj({k: v for k, v in SPELLINGS.items() if not k.startswith("speculative.")})
    layer |= obj({k: [k] for k in SPEC_SPELLINGS})
    if draw(st.booleans()):
        layer["sampling"] = obj({k: v for k, v in SPELLINGS.items() if not k.startswith("speculative.")})
    if draw(st.booleans()):
        layer["speculative"] = obj(SPEC_SPELLINGS)
    return layer


def expected(key: str, stack: list[dict[str, Any]]) -> Any:
    """The rule restated, independently of wire/sampling.py: the latest layer that sets the key;
    in it the sampling (or speculative) object before the top level; in an object the
    canonical spelling, then the aliases in ALIASES' order."""
    def pick(obj: dict[str, Any], spellings: list[str]) -> Any:
        for spelled in spellings:
            if spelled in obj:
                return obj[spelled]
        return None

    for layer in reversed(stack):
        if key.startswith("speculative."):
            places = [(layer.get("speculative") or {}, SPEC_SPELLINGS[key]), (layer, [key])]
        else:
            places = [(layer.get("sampling") or {}, SPELLINGS[key]), (layer, SPELLINGS[key])]
        for obj, spellings in places:
            found = pick(obj, spellings)
            if found is not None:
                return found
    return None


def check(params: GenerationParams, stack: list[dict[str, Any]]) -> None:
    for key in BOUNDS:
        want = expected(key, stack)
        if want is None:
            continue
        got = read(params, key)
        if key == "seed":
            want &= 0xFFFFFFFF
        assert got == want, (key, got, want, stack)


@settings(max_examples=300, deadline=None)
@given(body=layers())
def test_http_follows_the_rule_for_every_key(body: dict[str, Any]) -> None:
    check(_http(body), [body])


@settings(max_examples=300, deadline=None)
@given(t1=st.one_of(st.none(), layers()), generation=st.one_of(st.none(), layers()), request=layers())
def test_decode_and_configure_follow_the_rule_for_every_key(
    t1: dict[str, Any] | None, generation: dict[str, Any] | None, request: dict[str, Any]
) -> None:
    stack = [layer for layer in (t1, generation) if layer is not None] + [request]
    check(_decode(t1, generation, request), stack)
    # One layer alone gives the same on every path.
    assert _decode(None, None, request) == _http(request)
    if t1 is not None:  # CONFIGURE T1 alone: a DECODE that sets nothing of its own
        check(_decode(t1, None, {}), [t1])


def test_a_prompt_segments_n_predict_beats_the_headers_max_tokens() -> None:
    assert _decode(None, {"max_tokens": 5}, {"n_predict": 50}).n_predict == 50
    assert _decode(None, {"n_predict": 50}, {"max_tokens": 5}).n_predict == 5
    # Within one object: n_predict, then max_completion_tokens, then max_tokens.
    assert _http({"max_tokens": 7, "max_completion_tokens": 9}).n_predict == 9
    assert _http({"max_tokens": 7, "n_predict": 3}).n_predict == 3


def test_speculative_keys_merge_key_by_key_across_layers() -> None:
    got = _decode(None, {"speculative": {"n_max": 4}}, {"speculative": {"type": "none"}}).speculative
    assert got is not None and (got.type, got.n_max) == ("none", 4)


BAD = [
    ("n_predict", -7), ("n_predict", "5"), ("temperature", -1), ("top_p", 1.5), ("top_k", 2.5),
    ("seed", True), ("repeat_penalty", 101), ("min_p", float("nan")),
]


@pytest.mark.parametrize(("key", "value"), BAD)
def test_configure_t1_refuses_what_every_request_refuses(key: str, value: Any) -> None:
    for body in ({key: value}, {"sampling": {key: value}}):
        with pytest.raises(ParamError) as http:
            _http(body)
        with pytest.raises(ProtocolError) as t1:
            _validate_t1(body)
        assert t1.value.message == http.value.message


def test_configure_t1_reports_what_it_does_not_apply() -> None:
    keys, unused = _validate_t1(
        {"temperature": 0.5, "batch": 512, "ctx": 4096, "n_keep": 4, "bogus": 1, "sampling": {"temp": 0.2}}
    )
    assert dict(keys) == {"temperature": 0.2}  # the sampling object's spelling beats the top level
    assert set(unused) == {"batch", "ctx", "n_keep", "bogus"} and all(unused.values())
    slots = SlotSettings(SlotTable(1))
    assert slots.apply(0, keys) == {"sampling": {"temp": 0.2}}  # echoed as spelled
