"""Engines as subprocesses on loopback, statistics, and small timing helpers."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# Shared with the tests (hydra_trio.testing); re-exported for the benchmarks' one import.
from hydra_trio.testing.metrics import sample_value as sample_value
from hydra_trio.testing.net import free_port as free_port
from hydra_trio.testing.sse import delta_text, sse_chunk


@dataclass
class EngineProcess:
    """`hydra-trio serve` in its own process (as in production: no shared GIL with the
    benchmark driver)."""

    model: str
    slots: int = 4
    ctx_size: int = 8192
    threads: int = 2
    batch_size: int = 512
    extra: Sequence[str] = ()
    http_port: int = field(default_factory=free_port)
    rpc_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, log_dir: Path, name: str) -> EngineProcess:
        self.log_path = log_dir / f"{name}.log"
        cmd = [
            sys.executable, "-m", "hydra_trio.cli", "serve",
            "--model", self.model,
            "--port", str(self.http_port), "--rpc-port", str(self.rpc_port),
            "--slots", str(self.slots), "--ctx-size", str(self.ctx_size),
            "--threads", str(self.threads), "--batch-size", str(self.batch_size),
            "--default-n-predict", "64", "--log-level", "WARNING",
            *self.extra,
        ]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_http(self.url + "/health", self.proc, timeout=300)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def rss_bytes(self) -> int:
        return _status_kb(self.pid, "VmRSS") * 1024

    def reset_peak_rss(self) -> None:
        # Linux: writing 5 resets VmHWM (peak RSS) to the current RSS.
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def peak_rss_bytes(self) -> int:
        return _status_kb(self.pid, "VmHWM") * 1024

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@contextlib.contextmanager
def engines(*procs: EngineProcess, log_dir: Path, names: Sequence[str]) -> Iterator[tuple[EngineProcess, ...]]:
    started = []
    try:
        for p, n in zip(procs, names, strict=True):
            started.append(p.start(log_dir, n))
        yield tuple(started)
    finally:
        for p in started:
            p.stop()


def metric_value(url: str, name: str) -> float:
    """One unlabelled sample of an engine's /metrics; RuntimeError when it is not there."""
    value = sample_value(httpx.get(url + "/metrics", timeout=10).text, name)
    if value is None:
        raise RuntimeError(f"{name} missing from {url}/metrics")
    return value


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median and spread (min, max, and the interquartile range when there are enough)."""
    vals = sorted(float(v) for v in values)
    out: dict[str, Any] = {"n": len(vals), "median": statistics.median(vals), "min": vals[0], "max": vals[-1]}
    if len(vals) >= 4:
        q = statistics.quantiles(vals, n=4)
        out["p25"], out["p75"] = q[0], q[2]
    return out


def percentile(values: Sequence[float], p: float) -> float:
    vals = sorted(values)
    if not vals:
        return float("nan")
    k = (len(vals) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def fmt_summary(s: dict[str, Any], unit: str = "", digits: int = 1) -> str:
    return f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def words_prompt(n_words: int, seed: int = 0) -> str:
    """Deterministic English-looking text; the synthetic vocabulary tokenizes it ~1 token/word."""
    from hydra_trio.model.synthetic import _WORDS

    out = []
    x = seed * 2654435761 + 12345
    for _ in range(n_words):
        x = (x * 6364136223846793005 + 1442695040888963407) & ((1 << 64) - 1)
        out.append(_WORDS[(x >> 33) % len(_WORDS)])
    return " ".join(out)


def env_info() -> dict[str, Any]:
    import platform
    from importlib.metadata import version

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": version("llama-cpp-python"),
        "hydra_trio": version("hydra-trio"),
    }


def stream_chat(url: str, messages: list[dict[str, str]], n_predict: int) -> tuple[float, str, dict[str, Any]]:
    """One streamed, greedy chat completion: (seconds to the first content token, the answer,
    the last chunk, which carries ``usage`` and any ``kv_transfer``)."""
    req = {"messages": messages, "max_tokens": n_predict, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, parts, final = None, [], {}
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/chat/completions", json=req) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if (chunk := sse_chunk(line)) is None:
                continue
            final = {**final, **{k: v for k, v in chunk.items() if v is not None}}
            if text := delta_text(chunk):
                first = first if first is not None else time.perf_counter() - t0
                parts.append(text)
    assert first is not None, "no content token"
    return first, "".join(parts), final
