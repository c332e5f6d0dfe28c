"""The disk tier (engine/kv/disktier.py, ``--cache-disk``): crash-safe writes, checked reads
(a torn or altered file is never read back), a bound, a folder cleaned at start, and keys
salted so that no file names a prompt or a tenant."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio

from helpers import http, scrape, wait_until
from hydra_trio.engine.kv import DiskTier, Retention
from hydra_trio.engine.kv.disktier import SUFFIX, TMP_PREFIX
from hydra_trio.engine.llama import Snapshot

FP = b"f" * 32


def _snap(tokens: list[int], fill: int, salt: str | None = None, size: int = 1000) -> Snapshot:
    buf = bytearray(8) + bytearray([fill]) * size  # 8 bytes of room before the state, as snapshots have
    return Snapshot(tokens, buf, 8, True, salt)


async def _tier(folder: Path, max_bytes: int = 1 << 20, fingerprint: bytes = FP) -> DiskTier:
    tier = DiskTier(folder, max_bytes, fingerprint, Retention("session", trio.current_time))
    await tier.open()
    return tier


async def _written(tier: DiskTier, *snaps: Snapshot) -> None:
    """Hand ``snaps`` to the I/O task and run it until what is indexed is on disk (and what
    was queued for deletion is deleted)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tier.run)
        for snap in snaps:
            tier.spill(snap, None)
        await wait_until(lambda: not tier._pending and not tier._doomed, 10)
        await trio.sleep(0.05)  # the last deletion's thread call
        nursery.cancel_scope.cancel()


async def _counter(h: Any, name: str, at_least: float) -> bool:
    return (await scrape(h))[(name, ())] >= at_least


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(SUFFIX))


async def test_an_entry_comes_back_whole_and_only_for_its_salt(tmp_path: Path) -> None:
    tier = await _tier(tmp_path / "kv")
    await _written(tier, _snap([1, 2, 3, 4], 7, salt="tenant-a"))
    (name,) = _files(tmp_path / "kv")
    # a keyed hash (+ a write's own): no tokens, no salt
    assert name.endswith(SUFFIX) and len(name) == 32 + 1 + 8 + len(SUFFIX)
    raw = (tmp_path / "kv" / name).read_bytes()
    assert b"tenant-a" not in raw  # the salt is kept as its keyed hash only
    assert tier.best([1, 2, 3, 4, 5], "tenant-b") is None and tier.best([1, 2, 3, 4, 5], None) is None
    hit = tier.best([1, 2, 3, 4, 5], "tenant-a")
    assert hit is not None and hit.n_common == 4
    snap = await tier.load(hit.key, "tenant-a")
    assert snap is not None and snap.tokens == [1, 2, 3, 4] and snap.salt == "tenant-a" and snap.has_logits
    assert bytes(snap.buf[snap.offset :]) == bytes([7]) * 1000
    await _written(tier)  # the I/O task deletes what was taken
    assert _files(tmp_path / "kv") == [] and len(tier) == 0
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "kv" / ".key").stat().st_mode) == 0o600


async def test_an_entry_comes_back_only_under_its_lora_set(tmp_path: Path) -> None:
    """A history computed under a LoRA adapter set is the set's alone, as in RAM: its key
    is the keyed hash of the salt and the set, and a restart in the same process's set
    order reads it back under that set."""
    tier = await _tier(tmp_path / "kv")
    lora = ((0, 1.0),)
    await _written(tier, replace(_snap([1, 2, 3, 4], 7), lora=lora), _snap([1, 2, 3, 4, 5, 6], 9, salt="t"))
    assert tier.best([1, 2, 3, 4, 5], None) is None  # the base model's run holds nothing
    assert tier.best([1, 2, 3, 4, 5], None, ((0, 0.5),)) is None  # another scale: another set
    assert tier.best([1, 2, 3, 4, 5, 6, 7], "t", lora) is None  # the salt's history is the base model's
    hit = tier.best([1, 2, 3, 4, 5], None, lora)
    assert hit is not None and hit.n_common == 4
    reopened = await _tier(tmp_path / "kv")  # a restart: indexed from the files
    again = reopened.best([1, 2, 3, 4, 5], None, lora)
    assert again is not None and again.n_common == 4 and reopened.best([1, 2, 3, 4, 5], None) is None
    snap = await tier.load(hit.key, None, lora)
    assert snap is not None and snap.lora == lora and snap.salt is None


@pytest.mark.parametrize("damage", ["truncate", "payload", "header", "swap"])
async def test_a_torn_or_altered_file_is_never_read_back(tmp_path: Path, damage: str) -> None:
    folder = tmp_path / "kv"
    tier = await _tier(folder)
    await _written(tier, _snap([5, 6, 7], 1), _snap([8, 9], 2))
    names = _files(folder)
    target = folder / names[0]
    raw = bytearray(target.read_bytes())
    if damage == "truncate":
        target.write_bytes(raw[:-10])
    elif damage == "payload":
        raw[-3] ^= 0xFF
        target.write_bytes(raw)
    elif damage == "header":
        raw[12] ^= 0x01
        target.write_bytes(raw)
    else:  # another entry's bytes under this name
        target.write_bytes((folder / names[1]).read_bytes())
    (tokens,) = [e.tokens for _, e in tier.items() if e.name == names[0]]
    hit = tier.best([*tokens, 1], None)
    assert hit is not None
    assert await tier.load(hit.key, None) is None  # checked before any byte is used
    assert tier.stats.rejected == 1
    await _written(tier)
    assert names[0] not in _files(folder)  # and removed


async def test_the_folder_is_cleaned_at_start(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    tier = await _tier(folder)
    await _written(tier, _snap([1, 2], 1), _snap([3, 4], 2), _snap([5, 6], 3))
    names = _files(folder)
    (folder / f"{TMP_PREFIX}deadbeef").write_bytes(b"half an entry")  # a write a crash cut
    (folder / names[0]).write_bytes((folder / names[0]).read_bytes()[:40])  # torn (as no write here leaves one)
    (folder / "notes.txt").write_text("not ours")
    again = await _tier(folder)
    assert again.stats.cleaned == 2 and len(again) == 2
    assert _files(folder) == names[1:] and (folder / "notes.txt").exists()
    assert not any(p.name.startswith(TMP_PREFIX) for p in folder.iterdir())
    other = await _tier(folder, fingerprint=b"o" * 32)  # another model or KV layout: removed
    assert len(other) == 0 and _files(folder) == []


async def test_the_tier_is_bounded(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    tier = await _tier(folder, max_bytes=3000)  # two entries of ~1 KB and their headers
    await _written(tier, *[_snap([i, i + 1], i) for i in range(1, 6)])
    assert len(tier) == 2 and sum((folder / n).stat().st_size for n in _files(folder)) <= 3000
    assert len(_files(folder)) == 2
    assert tier.retention.evictions[("disk", "one_off")] == 3


def _headers(i: int) -> dict[str, str]:
    return {"x-session-id": f"s{i}"}


async def test_histories_ram_drops_come_back_from_disk_and_after_a_restart(
    run_engine: Callable[..., Any], tiny_model: Path, tmp_path: Path
) -> None:
    """One slot and 1 MiB of RAM (three ~1300-token histories): six sessions, so two go to
    disk; a session's next turn reads its history back from there, also after a restart."""
    folder = tmp_path / "kv"
    prompts = [f"session {i} works on its own long task about topic {i} " * 40 for i in range(6)]
    async with run_engine(tiny_model, slots=1, cache_ram_mib=1, cache_disk=str(folder)) as ep, http(ep) as h:
        for i, p in enumerate(prompts):
            r = await h.post("/v1/completions", json={"prompt": p, "max_tokens": 1}, headers=_headers(i))
            assert r.status_code == 200
        await wait_until(lambda: _counter(h, "hydra_disk_cache_written_total", 2), 30)  # by the I/O task, after them
    names = _files(folder)
    assert len(names) >= 2
    async with run_engine(tiny_model, slots=1, cache_ram_mib=1, cache_disk=str(folder)) as ep, http(ep) as h:
        m = await scrape(h)
        assert m[("hydra_disk_cache_entries", ())] == len(names) and m[("hydra_disk_cache_cleaned_total", ())] == 0
        served = 0
        for i, p in enumerate(prompts):  # the sessions whose histories went to disk find them there
            r = await h.post("/v1/completions", json={"prompt": p + " and more", "max_tokens": 1}, headers=_headers(i))
            served += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1200
        assert served == len(names)
        m = await scrape(h)
        assert (
            m[("hydra_disk_cache_loaded_total", ())] == len(names) and m[("hydra_disk_cache_rejected_total", ())] == 0
        )
    assert os.listdir(folder)  # what was kept stays for the next start


async def _spill_first(h: Any, prompts: list[str], headers: list[dict[str, str]]) -> None:
    """Turns of each session in order (one slot, 1 MiB of RAM, least recently used first):
    the first session's history ends up on disk."""
    for p, hd in zip(prompts, headers, strict=True):
        r = await h.post("/v1/completions", json={"prompt": p, "max_tokens": 1}, headers=hd)
        assert r.status_code == 200, r.text
    await wait_until(lambda: _counter(h, "hydra_disk_cache_written_total", 1), 30)


async def test_a_waiting_request_finds_its_history_brought_back_to_ram(
    start_engine: Callable[..., Any], tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While a request waits for the one slot, its session's history comes from disk into RAM:
    when the slot frees, the turn restores it from memory."""
    ep = await start_engine(tiny_model, slots=1, cache_ram_mib=1, cache_disk=str(tmp_path / "kv"), session_policy="lru")
    prompts = [f"session {i} works on its own long task about topic {i} " * 40 for i in range(5)]
    async with http(ep) as h:
        await _spill_first(h, prompts, [_headers(i) for i in range(5)])
        async with trio.open_nursery() as nursery:
            busy = trio.Event()

            async def hold_the_slot() -> None:  # a long generation holds the slot
                async with h.stream(
                    "POST",
                    "/v1/completions",
                    json={"prompt": "hold", "max_tokens": 300, "ignore_eos": True, "stream": True},
                ) as r:
                    async for _ in r.aiter_lines():
                        busy.set()

            nursery.start_soon(hold_the_slot)
            await busy.wait()
            caplog.clear()
            with caplog.at_level("INFO", logger="hydra_trio"):
                r = await h.post(
                    "/v1/completions", json={"prompt": prompts[0] + " next", "max_tokens": 1}, headers=_headers(0)
                )
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1200
        (line,) = [
            rec.request for rec in caplog.records if getattr(rec, "request", None) and rec.request["session_id"] == "s0"
        ]
        assert line["host_cached_tokens"] >= 1200 and line["disk_cached_tokens"] == 0  # from RAM: prefetched
        m = await scrape(h)
        assert m[("hydra_disk_cache_prefetched_total", ())] == 1


async def test_a_subagents_last_turn_brings_its_parents_history_back(
    start_engine: Callable[..., Any], tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A blocking subagent's last turn (``expected_resume: false``) says its parent resumes:
    the parent's history, on disk, comes back to RAM before the parent's next turn."""
    ep = await start_engine(tiny_model, slots=1, cache_ram_mib=1, cache_disk=str(tmp_path / "kv"), session_policy="lru")
    prompts = [f"session {i} works on its own long task about topic {i} " * 40 for i in range(5)]
    root = {"x-claude-code-session-id": "S"}
    async with http(ep) as h:
        await _spill_first(h, prompts, [root] + [_headers(i) for i in range(1, 5)])
        last = {"vllm_xargs": {"agentic_context": {"task_id": "S", "agent_id": "worker", "expected_resume": False}}}
        r = await h.post(
            "/v1/completions", json={"prompt": "the subagent's answer", "max_tokens": 1, **last}, headers=root
        )
        assert r.status_code == 200
        await wait_until(lambda: _counter(h, "hydra_disk_cache_prefetched_total", 1), 30)
        caplog.clear()
        with caplog.at_level("INFO", logger="hydra_trio"):
            r = await h.post("/v1/completions", json={"prompt": prompts[0] + " next", "max_tokens": 1}, headers=root)
        (line,) = [
            rec.request
            for rec in caplog.records
            if getattr(rec, "request", None) and rec.request["session_id"] == "S:lead"
        ]
        assert line["host_cached_tokens"] >= 1200 and line["disk_cached_tokens"] == 0


async def test_a_rewritten_history_survives_the_deletion_of_its_older_copy(tmp_path: Path) -> None:
    """The same history spilled twice: the older copy's deletion, queued meanwhile, must not
    remove the newer file (each write has a name of its own)."""
    tier = await _tier(tmp_path / "kv")
    await _written(tier, _snap([1, 2, 3], 1), _snap([1, 2, 3], 2))
    assert len(tier) == 1 and len(_files(tmp_path / "kv")) == 1
    hit = tier.best([1, 2, 3, 4], None)
    assert hit is not None
    snap = await tier.load(hit.key, None)
    assert snap is not None and bytes(snap.buf[snap.offset :]) == bytes([2]) * 1000 and tier.stats.rejected == 0


async def test_an_entry_not_written_yet_is_served_from_memory(tmp_path: Path) -> None:
    """Indexed when RAM drops it, before its write: a turn that comes meanwhile finds it, and
    its write is skipped."""
    tier = await _tier(tmp_path / "kv")
    tier.spill(_snap([4, 5, 6], 9), None)  # the I/O task is not running: not written
    hit = tier.best([4, 5, 6, 7], None)
    assert hit is not None
    snap = await tier.load(hit.key, None)
    assert snap is not None and bytes(snap.buf[snap.offset :]) == bytes([9]) * 1000
    await _written(tier)
    assert _files(tmp_path / "kv") == [] and tier.stats.written == 0 and tier.stats.loaded == 1
