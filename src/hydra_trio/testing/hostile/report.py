"""What the campaign found: the streams' gaps attributed to what was in flight, RSS, and the
rendered report."""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import pairwise
from typing import Any

from ..workload import (
    percentile,
)
from .campaign_config import NOTABLE_GAP_MS, STOPPED

# ---- analysis ---------------------------------------------------------------------------------


def analyse(runs: list[dict[str, Any]], spans: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Inter-token gaps of the well-formed streams; each gap over NOTABLE_GAP_MS is matched
    with the hostile requests in flight during it."""
    gaps: list[tuple[float, float, float]] = []  # ms, start, end
    for run in runs:
        a = run["arrivals"]
        gaps += [((b - x) * 1000, x, b) for x, b in pairwise(a)]
        if run["error"].startswith("HANG") and a:
            gaps.append(((run["t1"] - a[-1]) * 1000, a[-1], run["t1"]))
    ms = [g[0] for g in gaps]
    out: dict[str, Any] = {
        "stream_runs": len(runs),
        "tokens_timed": sum(len(r["arrivals"]) for r in runs),
        "stream_errors": [r["error"] for r in runs if r["error"] and r["error"] != STOPPED][:10],
        "streams_without_done": sum(1 for r in runs if not r["done"] and r["error"] != STOPPED),
        "gap_ms": {
            "p50": round(percentile(ms, 50), 2),
            "p99": round(percentile(ms, 99), 2),
            "max": round(max(ms), 2),
        }
        if ms
        else {},
    }
    spans_by_start = sorted(spans, key=lambda s: s[1])

    def in_flight(t0: float, t1: float) -> list[str]:
        return sorted({k for k, s0, s1 in spans_by_start if s0 < t1 and s1 > t0})

    worst = sorted(gaps, reverse=True)[:10]
    out["worst_gaps"] = [
        {
            "gap_ms": round(g, 1),
            "at_s": round(a - (runs[0]["t0"] if runs else 0), 2),
            "started_just_before": sorted({k for k, s0, _ in spans_by_start if a - 0.5 < s0 < b}),
            "in_flight": in_flight(a, b),
        }
        for g, a, b in worst
    ]
    # Per kind: the worst gap (and p99) among gaps it was in flight for, and how many
    # notable gaps it overlapped: the kind whose presence moves the tail is the offender.
    per_kind: dict[str, list[float]] = defaultdict(list)
    for g, a, b in gaps:
        for k in in_flight(a, b) if g > NOTABLE_GAP_MS or len(gaps) < 20000 else ():
            per_kind[k].append(g)
    out["by_kind_in_flight"] = {
        k: {
            "gaps": len(v),
            "p99_ms": round(percentile(v, 99), 1),
            "max_ms": round(max(v), 1),
            "notable": sum(1 for x in v if x > NOTABLE_GAP_MS),
        }
        for k, v in sorted(per_kind.items(), key=lambda kv: -max(kv[1]))
    }
    # The solo phase: one request at a time, so a gap over its span is its own doing.
    out["solo"] = {}
    for kind, s0, s1 in spans:
        if kind.startswith("solo "):
            during = [g for g, a, b in gaps if a < s1 and b > s0]
            out["solo"][kind[5:]] = {
                "ms": round((s1 - s0) * 1000, 1),
                "gaps": len(during),
                "max_gap_ms": round(max(during), 1) if during else None,
            }
    return out


def _rss_peak(
    rss: list[tuple[float, int]], spans: list[tuple[str, float, float]]
) -> dict[str, Any]:
    """The largest sampled RSS, and what was in flight then (what the memory was for)."""
    if not rss:
        return {}
    t, b = max(rss, key=lambda x: x[1])
    return {
        "sampled_peak": round(b / 2**20, 1),
        "in_flight_at_peak": sorted({k for k, s0, s1 in spans if s0 <= t <= s1}),
    }


def _ms(v: list[float]) -> dict[str, float]:
    return (
        {
            "n": len(v),
            "p50": round(percentile(v, 50), 1),
            "p99": round(percentile(v, 99), 1),
            "max": round(max(v), 1),
        }
        if v
        else {}
    )


def _span_ms(spans: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    by: dict[str, list[float]] = defaultdict(list)
    for kind, t0, t1 in spans:
        by[kind].append((t1 - t0) * 1000)
    return {
        k: {"n": len(v), "p50": round(percentile(v, 50), 1), "max": round(max(v), 1)}
        for k, v in sorted(by.items())
    }


def _first_traceback(log: str) -> str:
    i = log.find("Traceback")
    start = log.rfind("\n", 0, log.rfind("\n", 0, i)) + 1  # the line before: what was logged
    return log[start : i + 8000]


def render(report: dict[str, Any]) -> str:
    r = report
    s = r["streams"]
    lines = [
        f"hostile campaign: {r['config']['duration_s']:g} s, {r['requests']:,} HTTP/shape requests, "
        f"{r['rpc_frames']:,} RPC frames",
        f"  findings: {r['findings'] or 'none'}",
        f"  engine: alive={r['engine_alive_at_end']} exit={r['engine_exit_code']} tracebacks={r['tracebacks_in_log']} "
        f"healthy after={r['after'].get('ok')}",
        f"  RSS MB: start {r['rss_mb']['start']}, peak {r['rss_mb']['peak']}, budget {r['rss_mb']['budget']}; "
        "in flight at the sampled peak: "
        f"{[k for k in r['rss_mb'].get('in_flight_at_peak', []) if not k.startswith('fuzz ')]}",
        f"  /health ms: from the driver {r['health_ms']}; from a light client {r['health_ms_light_client']}",
        f"  streams: {s['stream_runs']} runs, {s['tokens_timed']:,} tokens; gap ms {s['gap_ms']}",
        f"  the engine's own inter-token gaps (all generating requests): {report['after'].get('server_itl')}",
    ]
    for g in s["worst_gaps"][:3]:
        shapes = [k for k in g["in_flight"] if not k.startswith("fuzz ")]
        n_fuzz = len(g["in_flight"]) - len(shapes)
        lines.append(
            f"    gap {g['gap_ms']} ms at {g['at_s']} s; in flight: {shapes} and {n_fuzz} fuzz kinds"
        )
    top = Counter({k: n for k, n in r["by_kind_and_status"].items()}).most_common(14)
    lines.append("  top kinds: " + ", ".join(f"{k}={n}" for k, n in top))
    for k, v in list(r["finding_examples"].items())[:6]:
        lines.append(f"  {k}: {v[0][:200]}")
    if s.get("solo"):
        lines.append(
            "  alone beside the streams (request ms / worst gap ms): "
            + ", ".join(
                f"{k} {v['ms']:.0f}/{v['max_gap_ms']}"
                for k, v in sorted(s["solo"].items(), key=lambda kv: -(kv[1]["max_gap_ms"] or 0))
            )
        )
    for goal, ok in r["goals"].items():
        lines.append(f"  GOAL {goal}: {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines)
