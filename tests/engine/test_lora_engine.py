"""LoRA adapters on a live engine: an adapter changes the text, scale 0 and an unloaded
engine give the base's, a request picks its set (``lora``, or the adapter its ``model``
names), the defaults move with ``POST /lora-adapters``, concurrent requests of different
sets never share a llama_decode (each gives the text it gives alone), no KV made under one
set is continued under another (slots, the host prompt cache, DECODE, a P/D hand-off), and
the KV events, /v1/models and vLLM's gauge say which adapters run.

Every compared pair of texts is the same computation: each request gets its own
``cache_salt``, so its prompt is evaluated whole, in one batch, never partly from a slot."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from helpers import (
    assert_error,
    decode,
    decode_ok,
    frame,
    gate,
    get_result,
    http,
    kv_meta,
    prefill,
    rpc,
    scrape,
    text_of,
)
from hydra_trio.wire import Status

PROMPT = "tell me about the river and the old mill and why they matter"
_salts = itertools.count()


@pytest.fixture(scope="session")
def adapters(model_dir: Path, tiny_model: Path) -> dict[str, Path]:
    from hydra_trio.model.synthetic_lora import write_lora_adapter

    return {
        "a": write_lora_adapter(tiny_model, model_dir / "style-a.gguf", seed=1),
        "b": write_lora_adapter(tiny_model, model_dir / "style-b.gguf", seed=2),
    }


def _served(adapters: dict[str, Path], **extra: Any) -> dict[str, Any]:
    """An engine with both adapters loaded, at default scale 0: requests choose them."""
    return {"lora": (str(adapters["a"]), str(adapters["b"])), "lora_init_without_apply": True, **extra}


async def complete(h: Any, *, fresh: bool = True, status: int = 200, **body: Any) -> dict[str, Any]:
    """A greedy text completion of PROMPT; ``fresh``: under a salt of its own (its prompt is
    evaluated whole in a slot, one batch, whatever the slots hold)."""
    req: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **body}
    if fresh:
        req.setdefault("cache_salt", f"s{next(_salts)}")
    r = await h.post("/v1/completions", json=req)
    assert r.status_code == status, r.text
    return r.json()


def _text(body: dict[str, Any]) -> str:
    return body["choices"][0]["text"]


def _cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_an_adapter_changes_the_text_and_scale_zero_is_the_base_model(
    start_engine: Callable[..., Any], tiny_model: Path, adapters: dict[str, Path]
) -> None:
    plain = await start_engine(tiny_model)
    ep = await start_engine(tiny_model, **_served(adapters))
    async with http(plain) as hp, http(ep) as h:
        base = _text(await complete(hp))
        assert _text(await complete(h)) == base  # loaded, at scale 0: the base model's text
        assert _text(await complete(h, lora=[])) == base
        assert _text(await complete(h, lora=[{"id": 0, "scale": 0}, {"id": 1, "scale": 0.0}])) == base
        full = _text(await complete(h, lora=[{"id": 0, "scale": 1}]))
        half = _text(await complete(h, lora=[{"id": 0, "scale": 0.5}]))
        other = _text(await complete(h, lora=[{"id": 1, "scale": 1}]))
        assert len({base, full, half, other}) == 4, (base, full, half, other)
        # The same set gives the same text again, whichever slot it lands in.
        assert _text(await complete(h, lora=[{"id": 0, "scale": 0.5}])) == half


async def test_a_request_selects_an_adapter_by_its_model_name_as_vllm_does(
    start_engine: Callable[..., Any], tiny_model: Path, adapters: dict[str, Path]
) -> None:
    ep = await start_engine(tiny_model, **_served(adapters, lora=(f"style-a={adapters['a']}", str(adapters["b"]))))
    async with http(ep) as h:
        by_name = await complete(h, model="style-a")
        assert by_name["model"] == "style-a"
        assert _text(by_name) == _text(await complete(h, lora=[{"id": 0, "scale": 1}]))
        assert _text(await complete(h, model="style-b")) == _text(await complete(h, lora=[{"id": 1, "scale": 1}]))
        chat = await h.post("/v1/chat/completions", json={
            "model": "style-b", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0,
        })
        assert chat.status_code == 200 and chat.json()["model"] == "style-b"
        # The served model's own name runs the defaults (here: none), and the reply says so.
        served = ep.state.engine.served_name
        assert (await complete(h, model=served))["model"] == served
        models = (await h.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(served, None), ("style-a", served), ("style-b", served)]
        assert models[1]["root"] == str(adapters["a"])


async def test_lora_adapters_lists_them_and_post_sets_the_defaults(
    start_engine: Callable[..., Any], tiny_model: Path, adapters: dict[str, Path]
) -> None:
    ep = await start_engine(tiny_model, lora=(str(adapters["a"]),), lora_scaled=(f"{adapters['b']}:0.5",))
    async with http(ep) as h:
        listed = (await h.get("/lora-adapters")).json()
        assert [(a["id"], a["path"], a["scale"], a["name"]) for a in listed] == [
            (0, str(adapters["a"]), 1.0, "style-a"), (1, str(adapters["b"]), 0.5, "style-b"),
        ]
        assert all(a["digest"].startswith("xxh3:") and a["task_name"] == "" for a in listed)
        assert (await h.get("/version")).json()["lora_adapters"] == listed  # and INFO: a coordinator's view
        # Without a lora list a request runs under the defaults: --lora at 1, --lora-scaled's.
        both = [{"id": 0, "scale": 1}, {"id": 1, "scale": 0.5}]
        assert _text(await complete(h)) == _text(await complete(h, lora=both))
        # llama-server's POST: the listed scales, every other adapter at 0.
        r = await h.post("/lora-adapters", json=[{"id": 1, "scale": 1}])
        assert r.status_code == 200 and r.json() == {"success": True}
        assert [a["scale"] for a in (await h.get("/lora-adapters")).json()] == [0.0, 1.0]
        assert _text(await complete(h)) == _text(await complete(h, lora=[{"id": 1, "scale": 1}]))
        for bad in ({"id": 0, "scale": 1}, [{"id": 5, "scale": 1}], [{"id": 0, "scale": "x"}]):
            r = await h.post("/lora-adapters", json=bad)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert [a["scale"] for a in (await h.get("/lora-adapters")).json()] == [0.0, 1.0]  # unchanged


async def test_bad_choices_get_each_apis_error_and_leave_the_engine_serving(
    start_engine: Callable[..., Any], tiny_model: Path, adapters: dict[str, Path]
) -> None:
    ep = await start_engine(tiny_model, **_served(adapters))
    async with http(ep) as h:
        for body, status, param in (
            ({"lora": [{"id": 9, "scale": 1}]}, 400, "lora"),
            ({"lora": [{"id": 0, "scale": 1000}]}, 400, "lora"),
            ({"lora": "style-a"}, 400, "lora"),
            ({"model": "no-such-adapter"}, 404, "model"),
        ):
            err = (await complete(h, status=status, **body))["error"]
            assert err["code"] == status and err["param"] == param and err["type"] == "invalid_request_error"
        r = await h.post("/v1/messages", json={
            "model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "lora": [{"id": 9, "scale": 1}],
        })
        assert r.status_code == 400 and r.json()["type"] == "error", r.text  # Anthropic's shape
        r = await h.post("/v1/messages", json={  # its own model names are ignored; lora is honoured
            "model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "lora": [{"id": 0, "scale": 1}],
        })
        assert r.status_code == 200 and r.json()["model"] == "claude-x"
        assert (await h.get("/health")).json()["status"] == "ok"
        assert _text(await complete(h, lora=[{"id": 0, "scale": 1}]))


async def test_concurrent_requests_of_different_sets_each_give_their_own_text(
    start_engine: Callable[..., Any], tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """llama.cpp applies adapters per context: were two sets' slots ever decoded in one
    batch, one request would run under the other's adapters and its text would change."""
    ep = await start_engine(tiny_model, **_served(adapters), slots=3, default_n_predict=24)
    sets = ([], [{"id": 0, "scale": 1}], [{"id": 1, "scale": 0.5}])
    async with http(ep) as h:
        alone = [_text(await complete(h, lora=s, max_tokens=24)) for s in sets]
        assert len(set(alone)) == 3
        batcher = ep.state.engine._core.batcher
        switches = batcher.set_switches
        for _ in range(3):
            got: dict[int, str] = {}

            async def one(i: int, got: dict[int, str] = got) -> None:
                got[i] = _text(await complete(h, lora=sets[i], max_tokens=24))

            # All three hold their slots before any of them computes: they run at once.
            async with gate(ep) as g, trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
                while ep.state.engine.stats().slots_busy < 3:
                    await g.step()
                g.open()
            assert [got[i] for i in range(3)] == alone
        assert batcher.set_switches >= switches + 6  # in turns: at least two changes of set a round


async def test_kv_made_under_one_set_is_never_continued_under_another(
    start_engine: Callable[..., Any], tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """One slot, so every request meets the same KV; the host prompt cache keeps what a
    change of set drops, for that set only."""
    ep = await start_engine(tiny_model, **_served(adapters), slots=1, cache_ram_mib=64)
    a, half = [{"id": 0, "scale": 1}], [{"id": 0, "scale": 0.5}]
    async with http(ep) as h:
        first = await complete(h, fresh=False, lora=a)
        n = first["usage"]["prompt_tokens"]
        assert _cached(first) == 0
        assert _cached(await complete(h, fresh=False, lora=a)) >= n - 1  # the slot's, same set
        assert _cached(await complete(h, fresh=False)) == 0  # the base model: nothing reused
        assert _cached(await complete(h, fresh=False, lora=half)) == 0  # another scale: another set
        assert _cached(await complete(h, fresh=False, model="style-b")) == 0
        # Each set's history comes back from the host cache, to that set only.
        assert _cached(await complete(h, fresh=False, lora=a)) >= n - 1
        assert _cached(await complete(h, fresh=False, lora=half)) >= n - 1
        assert _cached(await complete(h, fresh=False)) >= n - 1
        backend = ep.state.engine._core.backend
        assert backend.seq_lora[0] == () and backend.seq_salt[0] is None


async def test_kv_events_and_the_gauge_say_which_adapters_run(
    start_engine: Callable[..., Any], tiny_model: Path, adapters: dict[str, Path]
) -> None:
    ep = await start_engine(tiny_model, **_served(adapters))
    events: list[dict[str, Any]] = []
    ep.state.engine.kv_events(events.extend, 16)
    async with http(ep) as h:
        await complete(h, model="style-a")
        await complete(h)
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert {(e["lora_id"], e["lora_name"]) for e in stored} == {(0, "style-a"), (None, None)}
        m = await scrape(h)
        gauge = [labels for (name, labels) in m if name == "vllm:lora_requests_info"]
        assert gauge == [(("max_lora", "2"), ("running_lora_adapters", ""), ("waiting_lora_adapters", ""))]
        # Requests held in their slots (the GPU worker held by the test, one call at a time let
        # through until both hold one): the one under style-b runs, the base model's is not counted.
        adapters_in_use = ep.state.engine.adapters
        async with gate(ep) as g, trio.open_nursery() as nursery:
            nursery.start_soon(complete, h)
            nursery.start_soon(lambda: complete(h, model="style-b"))
            while adapters_in_use.in_use() != (["style-b"], []) or ep.state.engine.stats().slots_busy < 2:
                await g.step()
            gauge = [labels for (name, labels) in await scrape(h) if name == "vllm:lora_requests_info"]
            assert gauge == [(("max_lora", "2"), ("running_lora_adapters", "style-b"), ("waiting_lora_adapters", ""))]
            g.open()


async def test_decode_refuses_kv_made_under_another_set(
    start_engine: Callable[..., Any], tiny_model: Path, adapters: dict[str, Path]
) -> None:
    ep = await start_engine(tiny_model, **_served(adapters))
    messages = [{"role": "user", "content": PROMPT}]
    async with await rpc(ep) as c:
        pre = await prefill(c, 0, messages, lora=[{"id": 0, "scale": 1}])
        assert pre.meta["lora"] == [
            {"name": "style-a", "digest": ep.state.engine.adapters.listing()[0]["digest"], "scale": 1.0}
        ]
        meta = kv_meta(pre)
        assert meta["lora"] == pre.meta["lora"]  # what a coordinator forwards
        blob = bytes(pre.payload)
        # Under its own set: accepted, and the gate says the sets matched.
        rid = await decode_ok(c, 1, frame(messages, blob, kv_metadata=meta, lora=[{"id": 0, "scale": 1}], n_predict=4))
        async with http(ep) as h:
            assert text_of(await get_result(h, rid))
        for kv_metadata, asked in (
            (meta, {}),  # the base model continuing style-a's KV
            (meta, {"lora": [{"id": 0, "scale": 0.5}]}),  # another scale
            # KV said to be the base's
            ({k: v for k, v in meta.items() if k != "lora"}, {"lora": [{"id": 0, "scale": 1}]}),
        ):
            resp = await decode(c, 1, frame(messages, blob, kv_metadata=kv_metadata, n_predict=4, **asked))
            assert_error(resp, Status.ERROR, "CAP_MISMATCH")
            assert resp.meta["match"]["lora_match"] is False and "LoRA adapter set mismatch" in resp.meta["reason"]
        # The slot's own KV (no blob, no claims) is held to its set by prefix reuse instead.
        await decode_ok(c, 0, frame(None, n_predict=2))
        # A PREFILL whose model names an adapter is served by it: no model_fallback.
        named = await prefill(c, 1, messages, model="style-b")
        assert named.meta["model_fallback"] is False and [a["name"] for a in named.meta["lora"]] == ["style-b"]
        assert (await prefill(c, 1, messages, model="another-model")).meta["model_fallback"] is True


async def test_a_hand_off_falls_back_when_the_export_was_made_under_another_set(
    start_engine: Callable[..., Any], tiny_model: Path, adapters: dict[str, Path]
) -> None:
    from helpers import PREFILL_PARAMS

    p = await start_engine(tiny_model, **_served(adapters))
    d = await start_engine(tiny_model, **_served(adapters), kv_pull_timeout_s=5.0)
    messages = [{"role": "user", "content": PROMPT}]

    async def chat(h: Any, **body: Any) -> dict[str, Any]:
        r = await h.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()

    async with http(p) as hp, http(d) as hd:
        reference = (await chat(hp, model="style-a"))["choices"][0]["message"]["content"]
        exported = await chat(hp, model="style-a", max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
        params = exported["kv_transfer_params"]
        assert [a["name"] for a in params["hydra"]["lora"]] == ["style-a"]
        wrong = await chat(hd, kv_transfer_params=params)  # the base model: refused before any pull
        assert wrong["kv_transfer"]["status"] == "fallback" and wrong["kv_transfer"]["reason"] == "lora_mismatch"
        exported = await chat(hp, model="style-a", max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
        right = await chat(hd, model="style-a", kv_transfer_params=exported["kv_transfer_params"])
        assert right["kv_transfer"]["status"] == "restored", right["kv_transfer"]
        # The pulled KV and logits continue as the prefill engine's own computation did.
        assert right["choices"][0]["message"]["content"] == reference


@pytest.mark.slow
def test_an_adapter_for_another_base_stops_the_load_with_llama_cpps_reason(
    tiny_model: Path, wide_kv_model: Path, model_dir: Path
) -> None:
    from hydra_trio.engine.llama import LlamaBackend
    from hydra_trio.model.synthetic_lora import write_lora_adapter

    other = write_lora_adapter(wide_kv_model, model_dir / "for-wide-kv.gguf", seed=1)  # 256 wide, not 64
    with pytest.raises(RuntimeError, match=r"could not load LoRA adapter .*for-wide-kv.gguf.*shape"):
        LlamaBackend(str(tiny_model), n_slots=1, n_ctx=256, n_threads=1, lora_paths=[str(other)])
