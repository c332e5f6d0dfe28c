"""Operator-facing output: JSON log lines, --no-log-requests, the throughput line, the values
(not just the names) on /metrics, and the Grafana dashboard's queries."""

from __future__ import annotations

import io
import json
import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from helpers import MESSAGES, http, metric_samples, scrape, wait_until
from hydra_trio.config import Settings
from hydra_trio.observability import BASE_FIELDS, REQUEST_FIELDS, STATS_FIELDS, configure_logging

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "hydra-trio.json"


@contextmanager
def captured_logs(**settings: Any) -> Iterator[io.StringIO]:
    """The process log as ``hydra-trio serve`` configures it, written to a buffer."""
    buf = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = configure_logging(replace(Settings(), **settings), stream=buf)
    try:
        yield buf
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _chat_body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


async def test_json_log_lines_parse_and_request_lines_carry_their_fields(start_engine: Any, tiny_model: Path) -> None:
    with captured_logs(log_format="json") as buf:
        ep = await start_engine(tiny_model)
        async with http(ep) as c:
            r = await c.post("/v1/chat/completions", json=_chat_body(5), headers={"X-Request-Id": "rq-json-1"})
            assert r.status_code == 200
            r = await c.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True, "stream": True}
            )
            assert r.status_code == 200
        lines = [json.loads(line) for line in buf.getvalue().splitlines()]  # every line is one object
    assert any(rec["msg"].startswith("ready: ") for rec in lines)
    for rec in lines:
        assert set(BASE_FIELDS) <= rec.keys()
        extra = rec.keys() - set(BASE_FIELDS) - {"exc"}
        assert extra in (set(), set(REQUEST_FIELDS), set(STATS_FIELDS)), rec
    chat = [rec for rec in lines if rec.get("request_id") == "rq-json-1"]
    assert len(chat) == 1, chat
    (line,) = chat
    assert line["route"] == "chat" and line["status"] == "done" and line["finish_reason"] == "length"
    assert line["completion_tokens"] == 5 and line["prompt_tokens"] > 0 and line["cached_tokens"] >= 0
    assert 0 < line["ttft_ms"] <= line["e2e_ms"] and line["level"] == "INFO" and line["error"] is None
    text = [rec for rec in lines if rec.get("route") == "completions"]
    assert len(text) == 1 and text[0]["completion_tokens"] == 3, text
    assert text[0]["request_id"].startswith("cmpl-")  # no X-Request-Id: the completion's own id


async def test_no_log_requests_drops_request_lines_only(start_engine: Any, tiny_model: Path) -> None:
    with captured_logs(log_requests=False) as buf:
        ep = await start_engine(tiny_model)
        async with http(ep) as c:
            r = await c.post("/v1/chat/completions", json=_chat_body(4), headers={"X-Request-Id": "rq-quiet-1"})
            assert r.status_code == 200
        out = buf.getvalue()
    assert "ready: HTTP port" in out  # the rest of the log is there
    assert "rq-quiet-1" not in out and " generated, " not in out


class _Seen(logging.Handler):
    """Keeps the throughput lines; a threading.Event, so it is safe whichever thread logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.event.set()


async def test_throughput_line_after_work_and_none_while_idle(start_engine: Any, tiny_model: Path) -> None:
    seen = _Seen()
    stats = logging.getLogger("hydra_trio.stats")
    stats.addHandler(seen)
    level = stats.level
    stats.setLevel(logging.INFO)
    try:
        ep = await start_engine(tiny_model, log_stats_interval_s=0.02)
        # Idle: the intervals see no tokens and no request, so nothing is written (a negative
        # check: it can only wait a few intervals, and passes however slow the machine is).
        async with http(ep) as c:
            await trio.sleep(0.1)
            idle_before = len(seen.records)
            r = await c.post("/v1/chat/completions", json=_chat_body(8))
            assert r.status_code == 200
            await wait_until(
                lambda: any(rec.stats["generation_tokens_per_s"] > 0 for rec in seen.records), timeout_s=30
            )
    finally:
        stats.removeHandler(seen)
        stats.setLevel(level)
    assert idle_before == 0
    msg = next(rec.getMessage() for rec in seen.records if rec.stats["generation_tokens_per_s"] > 0)
    assert re.fullmatch(
        r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
        r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%",
        msg,
    ), msg
    assert set(seen.records[-1].stats) == set(STATS_FIELDS)


async def test_metrics_values_after_known_requests(engine: Any) -> None:
    model = engine.state.engine.identity.model_alias
    labels = (("engine", "0"), ("model_name", model))

    def lab(**kw: str) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((*labels, *kw.items())))

    usages = []
    async with http(engine) as c:
        for n in (5, 7):
            r = await c.post("/v1/chat/completions", json=_chat_body(n))
            assert r.status_code == 200
            usages.append(r.json()["usage"])
        m = await scrape(c)
        text = (await c.get("/metrics")).text
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert m[("vllm:generation_tokens_total", labels)] == 12
    assert m[("vllm:prompt_tokens_total", labels)] == prompt - cached  # evaluated, not reused
    assert m[("vllm:prefix_cache_queries_total", labels)] == prompt
    assert m[("vllm:prefix_cache_hits_total", labels)] == cached
    assert m[("vllm:request_success_total", lab(finished_reason="length"))] == 2
    assert m[("vllm:request_success_total", lab(finished_reason="stop"))] == 0
    assert m[("vllm:request_success_total", lab(finished_reason="abort"))] == 0
    for hist in (
        "time_to_first_token",
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
    ):
        assert m[(f"vllm:{hist}_seconds_count", labels)] == 2, hist
        assert m[(f"vllm:{hist}_seconds_bucket", lab(le="+Inf"))] == 2, hist
    assert m[("vllm:inter_token_latency_seconds_count", labels)] == 4 + 6  # gaps between tokens
    # e2e = queue + prefill + decode; TTFT = queue + prefill (both from the arrival).
    s = {h: m[(f"vllm:request_{h}_time_seconds_sum", labels)] for h in ("queue", "prefill", "decode")}
    assert m[("vllm:e2e_request_latency_seconds_sum", labels)] == pytest.approx(sum(s.values()), abs=1e-6)
    assert m[("vllm:time_to_first_token_seconds_sum", labels)] == pytest.approx(s["queue"] + s["prefill"], abs=1e-6)
    assert m[("hydra_completion_tokens_total", (("path", "chat"),))] == 12
    assert m[("hydra_ttft_seconds_count", (("path", "chat"),))] == 2
    assert m[("hydra_engine_tokens_generated_total", ())] >= 12
    # The model's compute is part of the worker's busy time, and was spent (12 tokens, 2 prompts).
    assert 0 < m[("hydra_llama_decode_seconds_total", ())] <= m[("hydra_gpu_worker_busy_seconds_total", ())]
    assert m[("hydra_http_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == 2
    # Base units and counter types: no millisecond metric is left, and what only grows is a counter.
    assert not [name for name, _ in m if "_ms" in name]
    types = {fam.name: fam.type for fam in text_string_to_metric_families(text)}
    for name in (
        "hydra_step_batches",
        "hydra_gpu_worker_calls",
        "hydra_gpu_worker_busy_seconds",
        "hydra_llama_decode_seconds",
        "hydra_engine_tokens_evaluated",
    ):
        assert types[name] == "counter", name


# ---- the dashboard -----------------------------------------------------------------------------

_PROMQL_WORDS = {
    "sum", "rate", "irate", "increase", "histogram_quantile", "by", "without", "avg", "max", "min",
    "count", "clamp_min", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
}


def _panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        yield p
        yield from _panels(p.get("panels", []))


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers once label matchers, range
    selectors, grouping clauses, strings and numbers are taken out, and that are no function."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        word, call = match.group(1), match.group(2)
        if call or word in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def _exposed(text: str) -> set[str]:
    """Every sample name /metrics has or will have (a labelled family with no child yet has
    only its TYPE line)."""
    out = set(name for name, _ in metric_samples(text))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for fam in text_string_to_metric_families(text):
        out.update(fam.name + suffix for suffix in suffixes.get(fam.type, ("",)))
    return out


def test_promql_metric_names_parser() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{instance=~"$instance"}[$_'
        "_rate_interval])))"
    )
    assert promql_metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket"}
    assert promql_metric_names("sum(rate(a_total[5m])) / "
                               "clamp_min(sum(rate(b_total[5m])), 1)") == {"a_total", "b_total"}


async def test_dashboard_queries_name_metrics_the_engine_exposes(engine: Any) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in dash["templating"]["list"])
    exprs = [t["expr"] for p in _panels(dash["panels"]) for t in p.get("targets", [])]
    assert len(exprs) >= 10
    async with http(engine) as c:
        r = await c.post("/v1/chat/completions", json=_chat_body(4))
        assert r.status_code == 200
        exposed = _exposed((await c.get("/metrics")).text)
    wanted = set().union(*map(promql_metric_names, exprs))
    for must in ("vllm:prompt_tokens_total", "vllm:inter_token_la"
                 "tency_seconds_bucket", "hydra_kv_pulls_total", "hydra_kv_exports_total"):
        assert must in wanted, must
    assert wanted <= exposed, sorted(wanted - exposed)


FORGED = "x\n2099-01-01 00:00:00,000 INFO hydra_trio: forged\r\x1b[2J\u2028\x85\u202e"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_client_text_never_reaches_a_log_line_raw(log_format: str) -> None:
    """Issue 28, 1.8: a remote_host, an RPC trace, a peer's error words go into log lines;
    whatever they hold, each record stays one line (a traceback's lines indented), and no
    control character, line separator or bidi override is written raw."""
    log = logging.getLogger("hydra_trio.test_escape")
    with captured_logs(log_format=log_format, log_level="INFO") as buf:
        log.info("KV hand-off falls back (%s): %s", "pull_failed", f"cannot resolve {FORGED}")
        log.info(f"a message built from client text: {FORGED}")
        try:
            raise ValueError(FORGED)
        except ValueError:
            log.exception("request %s failed", FORGED)
    out = buf.getvalue()
    lines = out.split("\n")[:-1]
    for bad in ("\r", "\x1b", "\u2028", "\x85", "\u202e"):
        assert bad not in out, repr(bad)
    if log_format == "json":
        records = [json.loads(line) for line in lines]
        assert len(records) == 3
        assert FORGED in records[0]["msg"] and FORGED in records[2]["exc"]  # escaped, not lost
    else:
        starts = [line for line in lines if not line.startswith("    ")]
        assert len(starts) == 3 and not any(line.startswith("2099") for line in lines), lines
        assert "\\n2099-01-01" in starts[0] and "\\x1b[2J" in starts[0] and "\\u2028" in starts[1]
