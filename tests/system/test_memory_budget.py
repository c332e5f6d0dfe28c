"""Memory only inside the budgets: with the payload of every slot held at once (HTTP state
uploads and RPC STATE_PUTs, each stalled one byte short of its end), the engine's peak RSS
stays within model + KV cache + --max-inflight-bytes + RSS_OVERHEAD (docs/operations.md,
"Memory").

The engine runs as its own process (`hydra-trio serve`), so /proc/<pid>/status measures
it alone, not the test's client."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from hydra_trio.model.synthetic import PRESETS
from hydra_trio.wire import Op
from hydra_trio.wire.protocol import encode_request_header

pytestmark = pytest.mark.slow  # starts a `hydra-trio serve` process and fills every slot

MiB = 1 << 20
# What the engine holds besides model, KV cache and payloads: the interpreter and its
# libraries, llama.cpp's compute buffers, per-connection state. Documented in docs/operations.md ("Memory").
RSS_OVERHEAD = 256 * MiB
SLOTS = 4
PAYLOAD = 80 * MiB  # per slot: above 64 MiB a payload buffer is a mapping faulted in as it fills
CTX = 4096
CHUNK = b"\x00" * MiB


def _status(pid: int, key: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    assert match, text
    return int(match.group(1)) * 1024


def _poll(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _start(model: Path, log: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    args = [
        sys.executable, "-m", "hydra_trio.cli", "serve", "--model", str(model), "--port", "0", "--rpc-port", "0",
        "--slots", str(SLOTS), "--ctx-size", str(CTX), "--threads", "1", "--batch-size", "64",
        "--max-kv-bytes", str(PAYLOAD), "--max-inflight-bytes", str(SLOTS * PAYLOAD),
        "--upload-grace-s", "60",  # the stalled uploads are held on purpose
    ]  # fmt: skip
    out = log.open("wb")
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    ports: list[int] = []

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        found = re.search(r"ready: HTTP port (\d+), RPC port (\d+)", log.read_text())
        if found:
            ports[:] = [int(found.group(1)), int(found.group(2))]
        return bool(found)

    try:
        _poll(ready, 60, "the engine to start")
    except BaseException:
        proc.kill()
        raise
    return proc, ports[0], ports[1]


def _send_all_but_one_byte(sock: socket.socket, head: bytes) -> None:
    sock.sendall(head)
    left = PAYLOAD - 1
    while left:
        n = min(left, len(CHUNK))
        sock.sendall(CHUNK[:n])
        left -= n


def test_rss_stays_within_model_kv_and_payload_budget_with_every_slot_held(
    tiny_model: Path, tmp_path: Path
) -> None:
    proc, http_port, rpc_port = _start(tiny_model, tmp_path / "engine.log")
    base = f"http://127.0.0.1:{http_port}"
    held: list[socket.socket] = []
    try:
        with httpx.Client(base_url=base, timeout=30) as h:
            # Warm up (first generation's allocations) before the baseline.
            r = h.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
            assert r.status_code == 200, r.text
            baseline = _status(proc.pid, "VmRSS")

            def held_bytes() -> float:
                text = h.get("/metrics").text
                return float(re.search(r"^hydra_payload_bytes_held (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]

            for slot in range(SLOTS):
                sock = socket.create_connection(
                    ("127.0.0.1", http_port if slot % 2 == 0 else rpc_port)
                )
                held.append(sock)
                if slot % 2 == 0:
                    head = (
                        f"PUT /slots/{slot}/state HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n"
                        f"content-length: {PAYLOAD}\r\n\r\n"
                    ).encode()
                else:
                    key = str(slot).encode()
                    head = (
                        encode_request_header(Op.STATE_PUT, key_len=len(key), payload_len=PAYLOAD)
                        + key
                    )
                _send_all_but_one_byte(sock, head)
            _poll(lambda: held_bytes() == SLOTS * PAYLOAD, 10, "every payload to take its budget")
            # Resident, not only reserved: the buffers fill as the bytes arrive.
            _poll(
                lambda: _status(proc.pid, "VmRSS") >= baseline + 0.9 * SLOTS * PAYLOAD,
                10,
                "the payloads to arrive",
            )
            peak = _status(proc.pid, "VmHWM")
            model = tiny_model.stat().st_size
            p = PRESETS["tiny"]
            kv_cache = (
                2 * p.n_layer * CTX * (p.n_embd // p.n_head * p.n_head_kv) * 2
            )  # K and V, f16
            bound = model + kv_cache + SLOTS * PAYLOAD + RSS_OVERHEAD
            assert peak <= bound, (peak / MiB, bound / MiB, baseline / MiB)
            # The tighter view: held payloads add their own size and little more (no second copy).
            assert peak - baseline <= SLOTS * PAYLOAD + 32 * MiB, (
                (peak - baseline) / MiB,
                baseline / MiB,
            )
            for sock in held:
                sock.close()
            held.clear()
            _poll(lambda: held_bytes() == 0, 10, "the budget to be released")
            assert h.get("/health").status_code == 200
    finally:
        for sock in held:
            sock.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
