"""One table of spellings and one precedence for generation keys (wire/sampling.py), the same
over HTTP bodies, DECODE frames and CONFIGURE T1: a layer's ``sampling`` object beats its
top-level keys, later layers beat earlier ones, the canonical spelling beats an alias."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_trio.engine.configure import SlotSettings
from hydra_trio.engine.params import parse_generation
from hydra_trio.engine.slots import SlotTable
from hydra_trio.wire import sampling
from hydra_trio.wire.errors import ParamError
from hydra_trio.wire.frames import encode_decode_frame_v3, merged_generation, parse_decode_frame


def _http(body: dict[str, Any]) -> Any:
    return parse_generation(body, default_n_predict=16, n_ctx=512).sampling


def _decode(generation: dict[str, Any] | None, request: dict[str, Any]) -> Any:
    header: dict[str, Any] = {} if generation is None else {"generation": generation}
    frame = parse_decode_frame(encode_decode_frame_v3(header, request, b""))
    return parse_generation(merged_generation(frame), default_n_predict=16, n_ctx=512).sampling


def test_a_sampling_object_beats_top_level_keys_on_both_paths() -> None:
    body = {"temperature": 0.9, "top_k": 7, "sampling": {"temperature": 0.0}}
    assert _http(body).temperature == 0.0 and _http(body).top_k == 7
    assert _decode(None, body) == _http(body)
    assert _decode(body, {}) == _http(body)  # the same in the header's generation layer


def test_later_layers_win_and_aliases_count_as_their_canonical_key() -> None:
    generation = {"sampling": {"temp": 0.3, "repetition_penalty": 1.3}}
    request = {"temperature": 0.7}
    got = _decode(generation, request)
    assert got.temperature == 0.7  # the request's layer beats the header's
    assert got.repeat_penalty == 1.3  # vLLM's spelling, renamed
    # Within one object the canonical spelling beats its alias, whatever the order.
    assert _http({"temperature": 0.2, "temp": 0.8}).temperature == 0.2
    assert _http({"temp": 0.8, "temperature": 0.2}).temperature == 0.2


def test_configure_t1_is_the_first_layer() -> None:
    slots = SlotSettings(SlotTable(1))
    slots.apply(0, {"seed": 5, "sampling": {"temp": 0.4, "seed": 6}})
    slots.apply(0, {"sampling": {"temperature": 0.6}})  # replaces the earlier temp
    defaults = slots.generation_defaults(0)
    assert defaults == {"seed": 6, "temperature": 0.6}  # sampling.seed beats the top-level seed
    merged = sampling.merge(defaults, {"temperature": 0.1})
    assert parse_generation(merged, default_n_predict=16, n_ctx=512).sampling.temperature == 0.1


_KEYS = st.sampled_from(["temperature", "temp", "top_k", "top_p", "repeat_penalty", "penalty_repeat", "repetition_penalty", "seed", "min_p"])
_VALUES = st.one_of(st.integers(0, 5), st.floats(0.0, 1.0))
_LAYER = st.dictionaries(_KEYS, _VALUES, max_size=5)


@settings(max_examples=200, deadline=None)
@given(top=_LAYER, nested=st.one_of(st.none(), _LAYER), generation=st.one_of(st.none(), _LAYER))
def test_http_and_decode_agree_on_any_layers(top: dict[str, Any], nested: dict[str, Any] | None, generation: dict[str, Any] | None) -> None:
    body = dict(top)
    if nested is not None:
        body["sampling"] = nested
    try:
        alone = _http(body)
    except ParamError as exc:  # a value out of range is refused the same on both paths
        try:
            _decode(None, body)
        except ParamError as again:
            assert type(again) is type(exc) and str(again) == str(exc)
            return
        raise AssertionError(f"HTTP refused {body} but DECODE took it") from exc
    assert _decode(None, body) == alone
    if generation is not None:  # a header layer under it changes only the keys the body lacks
        try:
            under = _decode(generation, body)
        except ParamError:
            return  # the header's own value is out of range: refused, as it must be
        flat = sampling.flatten(body)
        for name in ("temperature", "top_k", "top_p", "repeat_penalty", "min_p"):
            if name in flat:
                assert getattr(under, name) == getattr(alone, name)
