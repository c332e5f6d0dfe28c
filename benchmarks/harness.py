"""Statistics, environment and small timing helpers; engines as subprocesses on loopback
(hydra_trio.testing.process, shared with the tests)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import httpx

# Shared with the tests (hydra_trio.testing); re-exported for the benchmarks' one import.
from hydra_trio.testing.metrics_reader import sample_value as sample_value
from hydra_trio.testing.net import free_port as free_port
from hydra_trio.testing.process import EngineProcess as EngineProcess
from hydra_trio.testing.process import engines as engines
from hydra_trio.testing.process import wait_http as wait_http
from hydra_trio.testing.sse_reader import delta_text, sse_chunk
from hydra_trio.testing.workload import percentile as percentile
from hydra_trio.testing.workload import words_prompt as words_prompt


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


def fmt_summary(s: dict[str, Any], unit: str = "", digits: int = 1) -> str:
    return f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


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


def stream_chat(
    url: str, messages: list[dict[str, str]], n_predict: int, headers: dict[str, str] | None = None
) -> tuple[float, str, dict[str, Any]]:
    """One streamed, greedy chat completion: (seconds to the first content token, the answer,
    the last chunk, which carries ``usage`` and any ``kv_transfer``)."""
    req = {"messages": messages, "max_tokens": n_predict, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, parts, final = None, [], {}
    with httpx.Client(timeout=600, headers=headers) as c, c.stream("POST", url + "/v1/chat/completions", json=req) as r:
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
