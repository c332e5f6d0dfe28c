"""The disk tier survives ``kill -9`` during its writes (issue 52): an engine whose RAM tier is
too small for its sessions spills to disk; it is killed the moment a write is under way (a
temporary file exists), twenty times. After each kill every entry name in the folder holds a
whole entry (its header and payload checksums hold); after each restart the unfinished
writes are gone, and an entry altered behind the engine's back is refused when read, never
restored."""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest
import xxhash

from hydra_trio.engine.kv.disktier import _CHECK, _HEAD, MAGIC, SUFFIX, TMP_PREFIX
from hydra_trio.testing.metrics_reader import metric_samples
from hydra_trio.testing.process import EngineProcess

pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("HYDRA_TEST_KILLS", "20"))
PROMPTS = [f"session {i} reads file {i} and plans the change for module {i} " * 30 for i in range(8)]


def _whole(path: Path) -> bool:
    """What the engine checks before restoring: the header and payload checksums."""
    raw = path.read_bytes()
    if len(raw) < _HEAD.size + _CHECK.size or raw[:8] != MAGIC:
        return False
    head = raw[: _HEAD.size]
    if struct.unpack("<Q", raw[_HEAD.size : _HEAD.size + 8])[0] != xxhash.xxh3_64_intdigest(head):
        return False
    _, head_bytes, _, _, _, _, _, payload_len, checksum = _HEAD.unpack(head)
    payload = raw[head_bytes:]
    return len(payload) == payload_len and xxhash.xxh3_64_intdigest(payload) == checksum


def _tokens(path: Path) -> list[int]:
    """The positions an entry holds, from its header."""
    raw = path.read_bytes()
    _, _, _, n_tokens, _, _, salt_len, _, _ = _HEAD.unpack(raw[: _HEAD.size])
    at = _HEAD.size + _CHECK.size + salt_len
    return list(struct.unpack(f"<{n_tokens}i", raw[at : at + 4 * n_tokens]))


def _engine(model: Path, folder: Path) -> EngineProcess:
    return EngineProcess(
        str(model), slots=1, ctx_size=4096, threads=1,
        extra=["--cache-ram-mib", "1", "--cache-disk", str(folder), "--cache-disk-gib", "0.05"],
    )


def _metrics(url: str) -> dict[str, float]:
    samples = metric_samples(httpx.get(url + "/metrics", timeout=30).text)
    return {
        name: value for (name, labels), value in samples.items() if name.startswith("hydra_disk_cache") and not labels
    }


def _turns(url: str, stop: threading.Event, errors: list[str]) -> None:
    """Sessions taking turns, each a history RAM cannot hold with the others: spills."""
    with httpx.Client(base_url=url, timeout=60) as client:
        i = 0
        while not stop.is_set():
            try:
                client.post(
                    "/v1/completions",
                    json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 1},
                    headers={"x-session-id": f"s{i % len(PROMPTS)}"},
                )
            except httpx.HTTPError:
                return  # killed
            i += 1


def test_kill_9_during_writes_never_serves_a_torn_entry(tiny_model: Path, tmp_path: Path) -> None:
    """Each round starts an engine on the folder the last one was killed in: it checks what
    it found, then spills until a write is under way and is killed there."""
    folder = tmp_path / "kv"
    mid_write = 0
    victim: Path | None = None
    names: list[Path] = []
    for kill in range(KILLS + 1):
        eng = _engine(tiny_model, folder).start(tmp_path, f"engine-{kill}")
        try:
            assert not any(p.name.startswith(TMP_PREFIX) for p in folder.iterdir())  # cleaned at start
            with httpx.Client(base_url=eng.url, timeout=60) as client:
                # Each entry's own continuation (its tokens and one more), the altered one first.
                for path in sorted(names, key=lambda p: p != victim):
                    if not path.exists():
                        continue  # over the bound at start
                    tokens = _tokens(path)
                    r = client.post("/v1/completions", json={"prompt": [*tokens, 7], "max_tokens": 1})
                    assert r.status_code == 200, r.text
                    if path == victim:  # refused before any byte was restored: recomputed
                        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] < len(tokens)
            m = _metrics(eng.url)
            assert m["hydra_disk_cache_rejected_total"] == (1 if victim else 0)  # the altered one, and only it
            deadline = time.monotonic() + 10
            while victim is not None and victim.exists() and time.monotonic() < deadline:  # removed by the I/O task
                time.sleep(0.01)
            assert victim is None or not victim.exists()
            if kill == KILLS:
                break
            stop, errors = threading.Event(), []
            client_thread = threading.Thread(target=_turns, args=(eng.url, stop, errors))
            client_thread.start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # kill -9 the moment a write is under way
                if any(name.startswith(TMP_PREFIX) for name in os.listdir(folder)):
                    mid_write += 1
                    break
            assert eng.proc is not None
            eng.proc.kill()
            eng.proc.wait()
            stop.set()
            client_thread.join()
        finally:
            eng.stop()
        names = [p for p in folder.iterdir() if p.name.endswith(SUFFIX)]
        # A name holds a whole entry or nothing: the rename comes after the fsync.
        assert all(_whole(p) for p in names), [p.name for p in names if not _whole(p)]
        victim = None
        if names:  # an entry altered behind the engine's back (a disk fault): refused when read
            victim = sorted(names)[kill % len(names)]
            raw = bytearray(victim.read_bytes())
            raw[-5] ^= 0xFF
            victim.write_bytes(raw)
    print(f"{mid_write} of {KILLS} kills came during a write")
    assert mid_write >= KILLS // 2, f"only {mid_write} of {KILLS} kills came during a write"
