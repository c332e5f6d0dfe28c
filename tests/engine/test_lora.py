"""LoRA adapters without an engine: the --lora specs, an adapter file's identity, which set a
request runs under, how a set leaves the engine (KV events, claims, the identity gate), and
the step batcher's one rule for adapters (a batch holds one set's slots; the sets take turns)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from helpers import Recorder, no_wait
from hydra_trio.engine import GenerationParams, LoraAdapters
from hydra_trio.engine.adapters import LoadedAdapter
from hydra_trio.engine.kv import HostBlocks, PromptCache, SlotBlocks
from hydra_trio.engine.kv.blocks import chain_root
from hydra_trio.engine.llama import Snapshot
from hydra_trio.engine.sched import StepBatcher
from hydra_trio.model.identity import compare_identity, read_identity
from hydra_trio.model.lora import AdapterMeta, AdapterSpec, adapter_specs, read_adapter
from hydra_trio.model.synthetic_lora import write_lora_adapter
from hydra_trio.wire import ProtocolError, Status
from hydra_trio.wire.errors import ParamError


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from hydra_trio.model.synthetic import write_model

    d = tmp_path_factory.mktemp("lora")
    base = write_model(d / "base.gguf", "tiny", seed=0)
    return {
        "base": base,
        "a": write_lora_adapter(base, d / "style-a.gguf", seed=1),
        "b": write_lora_adapter(base, d / "style-b.gguf", seed=2, rank=4, alpha=2.0),
    }


def _table(n: int = 2, scales: tuple[float, ...] = (1.0, 0.0)) -> LoraAdapters:
    return LoraAdapters(
        [
            LoadedAdapter(
                i, AdapterSpec(name, f"/x/{name}.gguf", scales[i]), AdapterMeta("llama", 8.0, "", "", f"xxh3:{i:016x}")
            )
            for i, name in enumerate(("alpha", "beta")[:n])
        ]
    )


def _params() -> GenerationParams:
    from hydra_trio.engine.sample import SamplingParams

    return GenerationParams(n_predict=4, sampling=SamplingParams())


# ---- the command line and the files ------------------------------------------------------------


def test_specs_name_scale_and_order_adapters_as_llama_server_and_vllm_do(files: dict[str, Path]) -> None:
    a, b = str(files["a"]), str(files["b"])
    specs = adapter_specs([a, f"mine={b}"], [f"half={b}:-0.5"])
    # ids: --lora in order, then --lora-scaled; a name is the file stem unless NAME= gives it.
    assert [(s.name, s.path, s.scale) for s in specs] == [("style-a", a, 1.0), ("mine", b, 1.0), ("half", b, -0.5)]
    assert [s.scale for s in adapter_specs([a], [f"half={b}:0.5"], init_without_apply=True)] == [0.0, 0.0]


@pytest.mark.parametrize(
    ("lora", "scaled", "says"),
    [
        (["/no/such.gguf"], [], "no such file"),
        ([], ["{a}"], "PATH:SCALE"),
        ([], ["{a}:nan"], "finite number"),
        ([], ["{a}:fast"], "finite number"),
        (["{a}", "{a}"], [], "is empty or taken"),
        (["={a}"], [], "is empty or taken"),
    ],
)
def test_a_malformed_spec_stops_startup_naming_its_flag(
    files: dict[str, Path], lora: list[str], scaled: list[str], says: str
) -> None:
    a = str(files["a"])
    with pytest.raises(SystemExit) as exc:
        adapter_specs([x.format(a=a) for x in lora], [x.format(a=a) for x in scaled])
    assert says in str(exc.value) and ("--lora-scaled" if scaled else "--lora") in str(exc.value)


def test_serve_refuses_a_bad_lora_flag_with_its_reason() -> None:
    import argparse

    from hydra_trio.config import add_arguments, settings_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exc:
        settings_from(parser.parse_args(["--lora", "/no/such/adapter.gguf"]), env={})
    assert "--lora '/no/such/adapter.gguf': no such file" in str(exc.value)


def test_an_adapter_file_says_what_it_is_and_its_digest_names_its_bytes(files: dict[str, Path]) -> None:
    meta = read_adapter(files["a"])
    assert meta.architecture == "llama" and meta.alpha == 8.0 and meta.digest.startswith("xxh3:")
    assert read_adapter(files["b"]).alpha == 2.0
    assert read_adapter(files["b"]).digest != meta.digest
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        read_adapter(files["base"])  # a model is not an adapter


def test_the_synthetic_adapter_has_a_pair_for_every_matrix_it_adapts(files: dict[str, Path]) -> None:
    import gguf

    reader = gguf.GGUFReader(str(files["a"]))
    base = {t.name: [int(x) for x in t.shape] for t in gguf.GGUFReader(str(files["base"])).tensors}
    pairs = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    assert pairs and len(pairs) % 2 == 0
    for name, (n_in, n_out) in ((n, base[n]) for n in {p.rsplit(".", 1)[0] for p in pairs}):
        assert pairs[f"{name}.lora_a"] == [n_in, 8] and pairs[f"{name}.lora_b"] == [8, n_out]
    assert read_identity(files["base"]).model_name  # the base is untouched


def test_make_model_writes_an_adapter_for_a_base(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hydra_trio import cli

    out = tmp_path / "cli-adapter.gguf"
    assert cli.main(["make-model", "--lora", str(files["base"]), str(out), "--seed", "3", "--lora-rank", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert read_adapter(out).alpha == 2.0
    assert cli.main(["make-model", "--lora", str(tmp_path / "missing.gguf"), str(tmp_path / "x.gguf")]) == 2


# ---- a request's set ---------------------------------------------------------------------------


def test_a_request_runs_under_its_list_else_the_adapter_its_model_names_else_the_defaults() -> None:
    resident = _resident()
    table = _table()
    p = table.choose(_params(), {"lora": [{"id": 1, "scale": 0.5}, {"id": 0, "scale": 0}]}, "chat", resident)
    assert p.lora == ((1, 0.5),) and p.lora_name == "beta*0.5" and p.model is None  # unlisted and 0: off
    p = table.choose(_params(), {"model": "beta"}, "completions", resident)
    assert p.lora == ((1, 1.0),) and p.lora_name == "beta" and p.model == "beta"
    p = table.choose(_params(), {"model": resident.model_alias}, "chat", resident)
    assert p.lora == ((0, 1.0),) and p.model is None  # the defaults: alpha at 1, beta at 0
    # llama-server's reading: an empty list asks nothing (the defaults); every adapter at 0 is the base.
    assert table.choose(_params(), {"lora": []}, "chat", resident).lora == ((0, 1.0),)
    assert table.choose(_params(), {"lora": [{"id": 0, "scale": 0}]}, "chat", resident).lora == ()
    table.set_scales([{"id": 1, "scale": 0.25}])  # llama-server's POST: alpha, unlisted, goes to 0
    assert table.default_set() == ((1, 0.25),) and [a["scale"] for a in table.listing()] == [0.0, 0.25]
    assert table.choose(_params(), {"lora": None}, "chat", resident).lora == ((1, 0.25),)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"lora": {"id": 0}}, "must be an array"),
        ({"lora": [7]}, "must be an object"),
        ({"lora": [{"id": 2, "scale": 1}]}, "no LoRA adapter 2"),
        ({"lora": [{"id": -1, "scale": 1}]}, "no LoRA adapter -1"),
        ({"lora": [{"id": True, "scale": 1}]}, "no LoRA adapter True"),
        ({"lora": [{"id": 0}]}, "scale must be a number"),
        ({"lora": [{"id": 0, "scale": "1"}]}, "scale must be a number"),
        ({"lora": [{"id": 0, "scale": 1e9}]}, "scale must be a number"),
        ({"lora": [{"id": 0, "scale": 1}, {"id": 0, "scale": 2}]}, "listed twice"),
        ({"lora": [{"id": 0, "scale": 1}], "model": "alpha"}, "give one"),
        ({"model": 7}, "model must be a string"),
    ],
)
def test_a_bad_adapter_choice_is_a_400_naming_it(body: dict[str, Any], says: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        _table().choose(_params(), body, "chat", _resident())
    err = exc.value
    assert isinstance(err, ParamError) and err.status == Status.BAD_REQUEST and says in err.message
    assert err.param in ("lora", "model")


def test_an_unknown_model_is_a_404_over_http_and_served_over_rpc() -> None:
    table, resident = _table(), _resident()
    with pytest.raises(ProtocolError) as exc:
        table.choose(_params(), {"model": "gpt-4o"}, "chat", resident)
    assert exc.value.status == Status.NOT_FOUND and "gpt-4o" in exc.value.message
    # The spec's model_fallback: an RPC request naming another model is served by this one.
    assert table.choose(_params(), {"model": "gpt-4o"}, "decode", resident).lora == ((0, 1.0),)
    # Without adapters the model field is ignored, as before (llama-server's way).
    assert LoraAdapters().choose(_params(), {"model": "gpt-4o"}, "chat", resident).lora == ()
    with pytest.raises(ProtocolError, match="no LoRA adapters are loaded"):
        LoraAdapters().choose(_params(), {"lora": [{"id": 0, "scale": 1}]}, "chat", resident)


def test_use_is_counted_by_adapter_for_vllm_s_gauge() -> None:
    table = _table()
    with table.waiting(((1, 0.5),)), table.running(((0, 1.0), (1, 1.0))), table.running(((0, 1.0),)):
        assert table.in_use() == (["alpha", "beta"], ["beta"])
    assert table.in_use() == ([], [])


# ---- a set as it leaves the engine ---------------------------------------------------------------


def test_sets_are_named_claimed_and_told_by_name_scale_and_digest() -> None:
    table = _table()
    assert table.label(()) is None and table.label(((0, 1.0),)) == "alpha"
    assert table.label(((0, 0.5), (1, 1.0))) == "alpha*0.5,beta*1"
    assert table.event_fields(((1, 1.0),)) == (1, "beta") and table.event_fields(((0, 1.0), (1, 1.0)))[0] is None
    assert table.claims(((1, 0.5),)) == [{"name": "beta", "digest": "xxh3:0000000000000001", "scale": 0.5}]


def test_the_identity_gate_refuses_kv_of_another_adapter_set() -> None:
    resident, table = _resident(), _table()
    base_claims = resident.fields()
    under_beta = {**base_claims, "lora": table.claims(((1, 0.5),))}
    ok = compare_identity(resident, under_beta, header_model=None, lora=table.claims(((1, 0.5),)))
    assert ok.accepted and ok.lora_match is True and ok.as_meta()["lora_match"] is True
    # Another scale, another adapter, the base model: refused, and the reason says so.
    for kv, asked in (
        (under_beta, ((1, 1.0),)),
        (under_beta, ((0, 0.5),)),
        (under_beta, ()),
        (base_claims, ((1, 0.5),)),
    ):
        m = compare_identity(resident, kv, header_model=None, lora=table.claims(asked))
        assert not m.accepted and m.lora_match is False and "LoRA adapter set mismatch" in m.reason
    # Names and ids are local: the digest and the scale are what is compared.
    renamed = {**base_claims, "lora": [{"name": "other-name", "digest": "xxh3:0000000000000001", "scale": 0.5}]}
    assert compare_identity(resident, renamed, header_model=None, lora=table.claims(((1, 0.5),))).accepted
    bad = compare_identity(resident, {**base_claims, "lora": "beta"}, header_model=None, lora=[])
    assert not bad.accepted and "kv_metadata.lora is not a list" in bad.reason
    # No set to check (the slot's own KV): nothing said, as before.
    unchecked = compare_identity(resident, under_beta, header_model=None)
    assert unchecked.accepted and unchecked.lora_match is None and "lora_match" not in unchecked.as_meta()


def test_kv_events_name_the_set_and_chain_it_apart_from_the_base_model() -> None:
    table = _table()
    tokens = list(range(32))
    sb = SlotBlocks(2, 16, table.event_fields)
    sb.slot_changed(0, tokens, 0)
    sb.slot_changed(1, tokens, 0, None, ((1, 1.0),))
    stored = [e for e in sb.take() if e["type"] == "BlockStored"]
    assert [(e["lora_id"], e["lora_name"]) for e in stored] == [(None, None), (1, "beta")]
    assert not set(stored[0]["block_hashes"]) & set(stored[1]["block_hashes"])  # two chains
    assert sb.n_held == 4
    # A resync tells each chain with its set again.
    sb.resync()
    assert [(e.get("lora_id"), e.get("lora_name")) for e in sb.take() if e["type"] == "BlockStored"] == [
        (None, None),
        (1, "beta"),
    ]
    # The salted chain of the base model is the one it always was; a salt and a set mix.
    assert chain_root("t") == chain_root("t", None) != chain_root("t", "beta") != chain_root(None, "beta")
    assert chain_root(None) is None
    told: list[Any] = []
    hb = HostBlocks(16, told.extend, table.event_fields)
    hb.entry_stored(3, tokens, None, ((0, 0.5), (1, 1.0)))
    assert [(e["lora_id"], e["lora_name"]) for e in told] == [(None, "alpha*0.5,beta*1")]
    assert [(e["lora_name"]) for e in hb.resync_events()] == ["alpha*0.5,beta*1"]


def test_kv_events_carry_the_set_and_the_session_together() -> None:
    """An agent session's stores under an adapter set name both (map encoding), on every
    medium: the slots', RAM's and the disk tier's."""
    table = _table()
    tokens = list(range(32))
    sb = SlotBlocks(1, 16, table.event_fields)
    sb.sessions[0] = "sess-1"
    sb.slot_changed(0, tokens, 0, None, ((1, 1.0),))
    (ev,) = [e for e in sb.take() if e["type"] == "BlockStored"]
    assert (ev["lora_id"], ev["lora_name"], ev["session_id"], ev["medium"]) == (1, "beta", "sess-1", "GPU")
    for medium in ("CPU", "DISK"):
        told: list[Any] = []
        hb = HostBlocks(16, told.extend, table.event_fields, medium=medium)
        hb.entry_stored(3, tokens, None, ((1, 1.0),), "sess-1")
        assert [(e["lora_id"], e["lora_name"], e["session_id"], e["medium"]) for e in told] == [
            (1, "beta", "sess-1", medium)
        ]


def test_the_prompt_cache_keeps_each_sets_entries_apart() -> None:
    cache = PromptCache(10_000)
    prompt = list(range(40))
    assert cache.put(Snapshot(prompt[:30], bytearray(100), 8, False, None, ((0, 1.0),)))
    assert cache.best(prompt) is None and cache.best(prompt, None, ((0, 0.5),)) is None
    hit = cache.best(prompt, None, ((0, 1.0),))
    assert hit is not None and hit.n_common == 30
    assert cache.put(Snapshot(prompt[:20], bytearray(100), 8, False))  # the base model's: another entry
    assert len(cache) == 2
    found = cache.best(prompt)
    assert found is not None and found.n_common == 20
    assert cache.put(Snapshot(prompt, bytearray(100), 8, False, None, ((0, 1.0),)))  # replaces its own set's only
    assert len(cache) == 2 and cache.best(prompt, None, ((0, 1.0),)).n_common == 40  # type: ignore[union-attr]


# ---- the step batcher: one set per batch, the sets in turn -------------------------------------------


SET_A: Any = ((0, 1.0),)
SET_B: Any = ((1, 0.5),)


def _set_of(slot: int) -> Any:
    return SET_A if slot < 2 else SET_B


async def test_a_batch_holds_one_sets_slots_and_the_sets_take_turns() -> None:
    rec = Recorder()
    batcher = StepBatcher(
        4, rec.step_sync, rec.run_on_worker, rec.run_mixed, token_budget=8, alone_budget=64,
        worker_free=no_wait, is_eog=lambda t: False, wants_turn=threading.Event(), lora_of=_set_of,
    )
    sampler: Any = object()

    async def stream(slot: int) -> None:
        token = 1
        for _ in range(6):
            res = await batcher.result(batcher.submit(slot, token, sampler, 100))
            assert res is not None
            token = res[-1]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(batcher.run)
        batcher.generating = 4
        async with trio.open_nursery() as streams:
            for slot in range(4):
                streams.start_soon(stream, slot)
        nursery.cancel_scope.cancel()
    sets = [{_set_of(s) for s in slots} for slots, _ in rec.batches]
    assert all(len(s) == 1 for s in sets), rec.batches  # never two sets in one llama_decode
    runs = [next(iter(s)) for s in sets]
    # The slots of one set share their batches, and a set that waits gets the next batch.
    assert any(len(slots) == 2 for slots, _ in rec.batches)
    both = [i for i in range(1, len(runs)) if {runs[i - 1], runs[i]} == {SET_A, SET_B}]
    assert len(both) >= 4 and batcher.set_switches >= 4
    assert all(runs[i] != runs[i - 1] for i in range(1, len(runs)) if _both_waited(rec.batches, i))


def _both_waited(batches: list[Any], i: int) -> bool:
    """Whether both sets still had steps left when batch ``i`` ran (6 steps per stream)."""
    done = {s: sum(s in slots for slots, _ in batches[:i]) for s in range(4)}
    return any(done[s] < 6 for s in (0, 1)) and any(done[s] < 6 for s in (2, 3))


async def test_a_prompt_rides_only_in_its_own_sets_batches() -> None:
    rec = Recorder()
    batcher = StepBatcher(
        4, rec.step_sync, rec.run_on_worker, rec.run_mixed, token_budget=8, alone_budget=64,
        worker_free=no_wait, is_eog=lambda t: False, wants_turn=threading.Event(), lora_of=_set_of,
    )
    got: list[Any] = []
    both_done = trio.Event()
    async with trio.open_nursery() as nursery:
        batcher.generating = 2
        jobs = [batcher.submit(slot, 1, object(), 1) for slot in (0, 1)]  # type: ignore[arg-type]

        async def prompt(slot: int) -> None:
            got.append(await batcher.prefill(slot, list(range(20)), 0, sampler=None, want_logits=False))
            if len(got) == 2:
                both_done.set()

        nursery.start_soon(prompt, 2)  # set B's, while set A's streams run
        nursery.start_soon(prompt, 3)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(batcher.run)
        for job in jobs:
            assert await batcher.result(job) == (2,)
        batcher.generating = 0  # set A's streams end (else the batcher waits for their next steps)
        # Event-based: the batcher's runs go through worker threads, which
        # wait_all_tasks_blocked does not wait for (under load it returned before B's turn).
        with trio.fail_after(30):
            await both_done.wait()
        nursery.cancel_scope.cancel()
    for slots, parts in rec.batches:
        assert len({_set_of(s) for s in slots} | {_set_of(s) for s, _ in parts}) == 1, rec.batches
    # Set B's prompts went together, in batches of their own (no steps of theirs to share):
    # whole once A's streams ended, or in parts if B's turn came while they still ran.
    with_parts = [(slots, parts) for slots, parts in rec.batches if parts]
    assert with_parts and all(not slots for slots, _ in with_parts), rec.batches
    assert sorted(slot for slot, _ in with_parts[0][1]) == [2, 3], rec.batches
    for slot in (2, 3):
        assert sum(n for _, parts in with_parts for s, n in parts if s == slot) == 20, rec.batches
    assert got == [(7, None), (7, None)]


def _resident() -> Any:
    from hydra_trio.model.identity import ModelIdentity

    return ModelIdentity(
        model_alias="tiny", model_path="/m/tiny.gguf", tokenizer="llama", model_name="Hydra Synthetic Tiny",
        model_quant="F32", model_capabilities=0, tokenizer_hash="xxh3:0000000000000000", architecture="llama",
    )
