"""`hydra-trio serve` as a real process: SIGTERM/SIGINT stop it cleanly, and running decodes
are drained (given time to finish) before it exits."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from hydra_trio.rpc.client import SyncRpcClient, build_decode_frame, prefill_call
from hydra_trio.testing.net import free_port
from hydra_trio.wire import Status

pytestmark = pytest.mark.slow  # starts `hydra-trio serve` processes and signals them


def _start(model: Path, *extra: str) -> tuple[subprocess.Popen[bytes], int, int]:
    http, rpc = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hydra_trio.cli", "serve", "--model", str(model), "--port", str(http),
         "--rpc-port", str(rpc), "--slots", "1", "--ctx-size", "2048", "--threads", "1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        try:
            if httpx.get(f"http://127.0.0.1:{http}/health", timeout=1).status_code == 200:
                return proc, http, rpc
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError("engine did not become healthy")


def test_sigterm_stops_an_idle_engine_cleanly(tiny_model: Path) -> None:
    proc, _, _ = _start(tiny_model)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode()
    assert b"received SIGTERM" in out and b"stopped" in out
    assert b"Traceback" not in out


def test_sigint_drains_a_running_decode_before_exit(tiny_model: Path) -> None:
    proc, _, rpc = _start(tiny_model, "--shutdown-grace-s", "30")
    request = {"messages": [{"role": "user", "content": "a long story"}], "max_tokens": 1500}
    with SyncRpcClient("127.0.0.1", rpc) as client:
        rid = client.decode(0, build_decode_frame(request, b"")).meta["decode_request_id"]
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    text = out.decode()
    assert proc.returncode == 0, text
    # The signal arrived while it generated (1500 tokens take ~0.5 s here, the signal
    # follows the ack within milliseconds); it then ran to its end before the exit.
    assert f"decode {rid} done" in text, text
    assert text.index("received SIGINT") < text.index(f"decode {rid} done") < text.index("stopped")


def test_sigusr1_writes_what_runs_and_the_engine_goes_on(tiny_model: Path) -> None:
    """For a hang: SIGUSR1 logs every trio task with the line it waits on and every thread's
    stack, and the engine goes on serving."""
    proc, http, _ = _start(tiny_model)
    assert proc.stdout is not None
    seen: list[str] = []
    dumped = threading.Event()

    def read_all() -> None:  # every line to the end (communicate() would miss what it buffered)
        left = -1
        for raw in proc.stdout:  # type: ignore[union-attr]
            line = raw.decode()
            seen.append(line)
            if "what runs now (" in line:
                left = int(line.split("what runs now (")[1].split()[0])
            elif left > 0 and "| " in line:
                left -= 1
                if left == 0:
                    dumped.set()

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    proc.send_signal(signal.SIGUSR1)
    assert dumped.wait(30), "".join(seen)
    assert httpx.get(f"http://127.0.0.1:{http}/health", timeout=30).json()["status"] == "ok"
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    reader.join(30)
    text = "".join(seen)
    assert proc.returncode == 0, text
    dump = text[text.index("SIGUSR1: ") : text.index("received SIGTERM")]
    assert dump.startswith("SIGUSR1: ") and "; what runs now (" in dump.splitlines()[0], dump[:200]
    assert "trio tasks:" in dump and "thread MainThread" in dump
    assert "hydra_trio/" in dump.split("thread MainThread")[0]  # tasks waiting in the engine's code
    assert "Traceback" not in text


def _serve_once(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "hydra_trio.cli", "serve", "--log-level", "WARNING", *args],
        capture_output=True,
        timeout=60,
    )


def test_startup_errors_are_one_clear_line(tiny_model: Path, tmp_path: Path) -> None:
    missing = _serve_once("--model", str(tmp_path / "nope.gguf"), "--port", "0", "--rpc-port", "0")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"hydra-trio: model file not found: {tmp_path / 'nope.gguf'} (named models: gemma3-270m)".encode()
    ]

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    broken = _serve_once("--model", str(bad), "--port", "0", "--rpc-port", "0")
    assert broken.returncode == 1
    assert b"not a readable GGUF" in broken.stderr and b"Traceback" not in broken.stderr

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = _serve_once("--model", str(tiny_model), "--port", str(port), "--rpc-port", "0")
        assert busy.returncode == 1
        assert f"HTTP 127.0.0.1:{port}".encode() in busy.stderr and b"Traceback" not in busy.stderr
        # A taken RPC port is said before the model loads (its log line never comes).
        rpc_busy = subprocess.run(
            [sys.executable, "-m", "hydra_trio.cli", "serve", "--model", str(tiny_model), "--port", "0",
             "--rpc-port", str(port), "--log-level", "INFO"],
            capture_output=True, timeout=60,
        )
    assert rpc_busy.returncode == 1
    assert f"RPC 127.0.0.1:{port}".encode() in rpc_busy.stderr and b"Traceback" not in rpc_busy.stderr
    assert b"model loaded" not in rpc_busy.stderr


async def test_the_engine_outlives_its_users_and_refuses_late_work(run_engine: Any, tiny_model: Path) -> None:
    """On shutdown the front ends end first, then the running requests, and only then is the
    model freed: no slot is held when it is. Work that comes later gets a clear error."""
    from helpers import MESSAGES, decode_ok, entry_of, frame, rpc
    from hydra_trio.wire import ProtocolError

    held_at_close: list[list[str | None]] = []
    async with run_engine(tiny_model) as ep:
        engine = ep.state.engine
        real_close = engine._core.backend.close

        def close() -> None:
            held_at_close.append([s.owner for s in engine._core.slots.slots if s.busy])
            real_close()

        engine._core.backend.close = close
        async with await rpc(ep) as c:
            rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=100_000))
        entry = entry_of(ep, rid)
        assert entry.running
    assert held_at_close == [[]]  # freed once, after the request had let its slot go
    assert entry.state.value == "cancelled"
    with pytest.raises(ProtocolError, match="engine is stopped"):
        await engine._core.worker.call(lambda: None)
    with pytest.raises(ProtocolError, match="engine is stopped"):
        engine._core.batcher.submit(0, 1, None)  # type: ignore[arg-type]


def test_sigterm_drains_a_streaming_completion_and_refuses_new_work(tiny_model: Path) -> None:
    """A rolling restart: after SIGTERM the front ends keep answering, /health says draining
    (503) so a load balancer stops sending, new completions and PREFILLs are refused with
    Retry-After / BUSY, and the completion already streaming runs to its end; then exit 0."""
    proc, http, rpc = _start(tiny_model, "--shutdown-grace-s", "60", "--slots", "2", "--ctx-size", "8192")
    base = f"http://127.0.0.1:{http}"
    body = {"prompt": "a long story", "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(base_url=base, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert "text_completion" in first
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (h := c.get("/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert h.status_code == 503 and h.json()["status"] == "draining", h.text
        refused = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
        with SyncRpcClient("127.0.0.1", rpc) as client:
            busy = client.call(prefill_call(1, {"prompt": "x"}), check=False)
        assert busy.status == Status.BUSY and busy.meta["error_code"] == "SLOT_BUSY", busy.meta
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    final = next(line for line in reversed(rest) if '"usage"' in line)
    assert '"completion_tokens":3000' in final
    out, _ = proc.communicate(timeout=60)
    text = out.decode()
    assert proc.returncode == 0, text
    assert text.index("received SIGTERM") < text.index("stopped")
    assert "stopping what still runs" not in text


async def test_a_stop_while_the_model_loads_ends_serve(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    """A SIGTERM while llama.cpp loads the model cancels serve() while the load (an
    uncancellable thread) finishes. The engine then still starts its shielded tasks; serve
    must stop them and return, not wait for them forever (it did: nursery.start from a
    cancelled caller never hands the started task over)."""
    import threading

    import trio

    from conftest import test_settings
    from hydra_trio import app
    from hydra_trio.engine import core as engine_module

    loading = threading.Event()
    real_backend = engine_module.LlamaBackend

    class SlowBackend(real_backend):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            loading.set()
            time.sleep(0.3)  # the cancellation arrives during the load
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_module, "LlamaBackend", SlowBackend)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(app.serve, test_settings(tiny_model))
            await trio.to_thread.run_sync(loading.wait, 10)
            nursery.cancel_scope.cancel()
