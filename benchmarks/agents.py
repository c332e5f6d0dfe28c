"""Agent traces replayed against a fixed slot count and RAM budget (issue 52).

    python -m benchmarks.agents [--preset small | --model gemma3-270m] [--sessions 8] [--turns 8]
                                [--slots 4] [--ram-share 0.5] [--configs llama-server,lru,session,session+disk]
                                [--with-llama-server | --llama-server PATH] [--quick] [--seeds 52,53]
                                [--system 2000] [--task 300] [--answer 16] [--before-src DIR]

The trace has the shape of vLLM's published agent traces (AgentX, September 2026: a median
session of 43 turns, 142k input tokens, 444 output tokens a turn, more than 96 % of each
turn's prompt a prefix of the one before, 44 % of sessions starting subagents that share the
parent's system prompt and tools), scaled to this machine: every session opens with one
system prompt and tools (shared by all, as one agent's are), then its own task; each turn
adds the assistant's answer and a tool's output (3-4 % of the prompt); a tool runs between
turns (think time); 44 % of the sessions start two subagents at one turn, which share the
system prompt, run a few turns of their own and return, while their parent waits. Prompts
are token ids, and an answer is kept in the history as scripted tokens (not the model's own
text), so every engine and the oracle see the same tokens and can at best reuse the previous
prompt: no engine is helped or hurt by how its answers re-tokenize.

The same trace, replayed with N sessions at once, goes to:

- ``llama-server``: ``-np SLOTS`` with the same ``--cache-ram`` (its recency-ordered prompt
  cache);
- ``lru``: hydra-trio with ``--session-policy lru`` (recency, as before sessions);
- ``session``: hydra-trio's session policy (Claude Code's session headers on every request,
  ``expected_resume: false`` on a subagent's last turn, ``POST /finish_session`` at the end);
- ``session+disk``: the same with ``--cache-disk`` (the third tier);
- ``router``: vllm-router ``--policy kv_aware`` in front of two hydra-trio engines (session
  policy, each half the slots and half the RAM), routing on their KV events (both tiers:
  slots as GPU blocks, RAM as CPU); the same headers, ``/finish_session`` sent to the router
  and, as the router keeps it to itself, to each engine; ``router+affinity`` with the
  router's session affinity (``--kv-aware-session-affinity-ttl-secs 300``);
- ``NAME@before``: configuration NAME on the engine code of ``--before-src`` (another checkout's
  ``src``: the code before a change, measured in the same run);
- the oracle: an engine that computes only each turn's new tokens (it holds every history).

The RAM budget holds ``--ram-share`` of the live sessions' histories (KV bytes a token measured
on the engine). Reported: prompt tokens computed (and × the oracle's), turn TTFT p50/p99 (from
sending the request to its first streamed token, the wait for a slot included), evictions by
tier and kind, the disk tier's figures. Raw: ``benchmarks/results/agents.json``; the plot
``benchmarks/results/agents.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from .harness import EngineProcess, env_info, percentile
from .llama_server import LlamaServer, find_or_build

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("llama-server", "lru", "session", "session+disk")
ROUTER_ENGINES = 2
SUBAGENT_SHARE = 0.44  # of sessions that start subagents


@dataclass(slots=True)
class Step:
    """One request of the trace: its prompt (token ids), answer length, and the tool's run after it."""

    prompt: list[int]
    max_tokens: int
    think_s: float
    last: bool = False  # a subagent's last turn (it returns to its parent)


@dataclass(slots=True)
class Agent:
    session: str  # the root session (x-claude-code-session-id)
    agent: str  # "lead", or a subagent's id (x-claude-code-agent-id)
    steps: list[Step]
    spawns: dict[int, list[Agent]] = field(default_factory=dict)  # before step i: subagents it waits on


@dataclass(frozen=True, slots=True)
class Shape:
    """The trace's sizes, in tokens and seconds (scaled from the published medians)."""

    system: int = 2000  # the shared system prompt and tools
    task: int = 300  # a session's own first message
    answer: int = 16  # tokens generated a turn (published: 444)
    tool: tuple[int, int] = (60, 110)  # a tool's output added a turn (with the answer: 3-4 % of the prompt)
    think_s: tuple[float, float] = (0.2, 1.0)  # a tool's run between turns
    sub_turns: int = 3
    sub_task: int = 250


def make_trace(seed: int, n_sessions: int, turns: int, vocab: tuple[int, int], shape: Shape = Shape()) -> list[Agent]:
    """The sessions of one trace (deterministic for ``seed``)."""
    rng = random.Random(seed)
    lo, hi = vocab

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    system = tokens(shape.system)

    def steps(history: list[int], n: int, *, subagent: bool) -> list[Step]:
        out = []
        for t in range(n):
            out.append(Step(list(history), shape.answer, rng.uniform(*shape.think_s), last=subagent and t == n - 1))
            history = history + tokens(shape.answer) + tokens(rng.randint(*shape.tool))
        return out

    agents = []
    with_subagents = set(rng.sample(range(n_sessions), round(SUBAGENT_SHARE * n_sessions)))
    for s in range(n_sessions):
        sid = f"trace-{seed}-s{s}"
        agent = Agent(sid, "lead", steps(system + tokens(shape.task), turns, subagent=False))
        if s in with_subagents:
            at = rng.randint(2, max(2, turns - 2))
            agent.spawns[at] = [
                Agent(sid, f"sub-{at}-{k}", steps(system + tokens(shape.sub_task), shape.sub_turns, subagent=True))
                for k in range(2)
            ]
        agents.append(agent)
    return agents


def _all_steps(agents: list[Agent]) -> list[tuple[Agent, Step]]:
    out = []
    for a in agents:
        for i, step in enumerate(a.steps):
            for sub in a.spawns.get(i, []):
                out.extend(_all_steps([sub]))
            out.append((a, step))
    return out


def oracle_computed(agents: list[Agent], system_len: int) -> int:
    """Prompt tokens an engine holding every history computes: each turn's new tokens (the
    shared system prompt once)."""
    total, seen_system = 0, False
    for agent in agents:
        prev: list[int] = []
        for i, step in enumerate(agent.steps):
            for sub in agent.spawns.get(i, []):
                sub_prev: list[int] = []
                for s in sub.steps:
                    total += len(s.prompt) - (len(sub_prev) if sub_prev else system_len)
                    sub_prev = s.prompt
            total += len(step.prompt) - (len(prev) if prev else system_len if seen_system else 0)
            prev, seen_system = step.prompt, True
    return total


# ---- replay ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Replay:
    url: str
    sessions_aware: bool  # send session hints and /finish_session (hydra-trio)
    rows: list[dict[str, Any]] = field(default_factory=list)
    finish_also: list[str] = field(default_factory=list)  # engines behind a router: told too
    model: str | None = None  # the body's model (vllm-router's KV index is by model)
    # llama-server's field. vllm-router 0.1.17 credits no cached prefix to a streamed request
    # that carries it (its KV decision says credited_prefix_tokens=0 however much is held).
    cache_prompt: bool = True

    async def run(self, agents: list[Agent]) -> None:
        """The first session's first turn alone (it computes the shared system prompt, as a
        server that has served this agent before holds it), then every session at once."""
        async with httpx.AsyncClient(base_url=self.url, timeout=1800) as client:
            first = agents[0]
            await self._turn(client, first, first.steps[0])
            async with trio.open_nursery() as nursery:
                for i, agent in enumerate(agents):
                    nursery.start_soon(self._agent, client, agent, 0.05 * i, 1 if i == 0 else 0)

    async def _agent(self, client: httpx.AsyncClient, agent: Agent, delay: float, skip: int = 0) -> None:
        await trio.sleep(delay)
        for i, step in enumerate(agent.steps):
            if i < skip:
                continue
            subs = agent.spawns.get(i, [])
            if subs:  # the parent waits on its subagents
                async with trio.open_nursery() as nursery:
                    for sub in subs:
                        nursery.start_soon(self._agent, client, sub, 0.0)
            await self._turn(client, agent, step)
            await trio.sleep(step.think_s)
        if self.sessions_aware and agent.agent == "lead":
            params = {"session_id": f"{agent.session}:lead"}
            await client.post("/finish_session", params=params)
            for url in self.finish_also:
                await client.post(url + "/finish_session", params=params)

    async def _turn(self, client: httpx.AsyncClient, agent: Agent, step: Step) -> None:
        body: dict[str, Any] = {
            "prompt": step.prompt, "max_tokens": step.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.cache_prompt:
            body["cache_prompt"] = True
        if self.model is not None:
            body["model"] = self.model
        headers = {}
        if self.sessions_aware:
            headers = {"x-claude-code-session-id": agent.session}
            if agent.agent != "lead":
                headers["x-claude-code-agent-id"] = agent.agent
            if step.last:
                body["vllm_xargs"] = {"agentic_context": {"expected_resume": False}}
        t0 = time.perf_counter()
        ttft = None
        final: dict[str, Any] = {}
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                choices = event.get("choices") or []
                if ttft is None and choices and choices[0].get("text"):
                    ttft = time.perf_counter() - t0
                if event.get("usage") or event.get("timings"):
                    final = event
        usage = final.get("usage") or {}
        timings = final.get("timings") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None:
            cached = timings.get("cache_n", 0)
        self.rows.append({
            "session": agent.session, "agent": agent.agent, "prompt_tokens": len(step.prompt),
            "cached": cached, "computed": len(step.prompt) - cached, "ttft_s": ttft,
        })


def scrape_evictions(url: str) -> dict[str, Any]:
    from hydra_trio.testing.metrics_reader import metric_samples

    samples = metric_samples(httpx.get(url + "/metrics", timeout=30).text)
    out: dict[str, Any] = {"evictions": {}, "disk": {}}
    sums: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name.startswith(("vllm:request_queue_time_seconds_", "vllm:request_prefill_time_seconds_")):
            sums[name] = sums.get(name, 0.0) + value
        if name == "hydra_kv_evictions_total":
            d = dict(labels)
            out["evictions"][f"{d['tier']}/{d['kind']}"] = int(value)
        elif name.startswith("hydra_disk_cache_"):
            out["disk"][name.removeprefix("hydra_disk_cache_")] = value
    # Where a turn's wait went, over all turns: the wait for a slot, then the prefill (the
    # restore from RAM included).
    for part in ("queue", "prefill"):
        n = sums.get(f"vllm:request_{part}_time_seconds_count", 0.0)
        out[f"{part}_mean_ms"] = 1000.0 * sums.get(f"vllm:request_{part}_time_seconds_sum", 0.0) / n if n else None
    return out


def bytes_per_token(url: str, n_vocab: int) -> float:
    """KV bytes a position takes in this engine (a snapshot of a 1024-token slot, less its logits)."""
    with httpx.Client(base_url=url, timeout=600) as c:
        c.post(
            "/v1/completions", json={"prompt": [300 + (i % (n_vocab - 301)) for i in range(1024)], "max_tokens": 1}
        ).raise_for_status()
        slots = c.get("/slots").json()
    held = max(slots, key=lambda s: s["n_past"])
    return held["state_size"] / held["n_past"]


def summarize(rows: list[dict[str, Any]], oracle: int) -> dict[str, Any]:
    """All turns, and the later turns (each agent's second on): there the oracle computes
    exactly the turn's new tokens, and what an engine computes more is what it did not keep.
    (First turns of sessions that open at once compute the shared system prompt in several
    slots on every engine: no slot shares a prefix another slot is still computing.)"""
    ttfts = [r["ttft_s"] * 1000 for r in rows if r["ttft_s"] is not None]
    computed = sum(r["computed"] for r in rows)
    prev: dict[tuple[str, str], int] = {}
    later = later_oracle = 0
    later_ttfts = []
    for r in rows:  # each agent's rows are in its own order
        key = (r["session"], r["agent"])
        if key in prev:
            later += r["computed"]
            later_oracle += r["prompt_tokens"] - prev[key]
            if r["ttft_s"] is not None:
                later_ttfts.append(r["ttft_s"] * 1000)
        prev[key] = r["prompt_tokens"]
    return {
        "turns": len(rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "computed": computed,
        "x_oracle": computed / oracle if oracle else math.nan,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "later_computed": later,
        "later_oracle": later_oracle,
        "later_x_oracle": later / later_oracle if later_oracle else math.nan,
        "later_ttft_p50_ms": percentile(later_ttfts, 50),
        "later_ttft_p99_ms": percentile(later_ttfts, 99),
    }


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return
    names = [n for n in results["configs"] if results["configs"][n]]
    figs = [results["configs"][n] for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [f["x_oracle"] for f in figs], 0.4, label="all turns")
    ax1.bar([i + 0.2 for i in x], [f["later_x_oracle"] for f in figs], 0.4, label="later turns")
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax1.axhline(1.15, color="#c44e52", lw=0.8, ls=":", label="goal 1.15×")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("prompt tokens computed (× oracle)")
    ax1.legend()
    ax2.bar([i - 0.2 for i in x], [f["later_ttft_p50_ms"] for f in figs], 0.4, label="p50, later turns")
    ax2.bar([i + 0.2 for i in x], [f["later_ttft_p99_ms"] for f in figs], 0.4, label="p99, later turns")
    ax2.set_xticks(list(x), names)
    ax2.set_yscale("log")
    ax2.set_ylabel("turn TTFT (ms)")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"{results['args']['sessions']} agent sessions on {results['args']['slots']} slots, RAM for "
                 f"{results['args']['ram_share']:.0%} of their histories")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def hydra_extra(name: str, ram_mib: int, work: Path, step_token_budget: int) -> list[str]:
    """hydra-trio's flags for configuration ``name`` (lru, session, session+disk)."""
    # Prompt parts of llama-server's ubatch size ride along the streams' steps, as its do
    # (ours default to 32 tokens a step, which keeps streams' pace and lengthens TTFT).
    extra = ["--cache-ram-mib", str(ram_mib), "--session-policy", "lru" if name == "lru" else "session",
             "--step-token-budget", str(step_token_budget)]
    if name.endswith("+disk"):
        extra += ["--cache-disk", str(work / f"kv-disk-{name}"), "--cache-disk-gib", "4"]
    return extra


def run_router(model: str, work: Path, tag: str, args: argparse.Namespace, ram_mib: int, trace: list[Agent],
               env: dict[str, str] | None, affinity: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The trace through vllm-router's kv_aware policy over ROUTER_ENGINES hydra-trio engines
    that publish KV events; the same slots and RAM in all, split evenly."""
    from .harness import free_port
    from .kv_routing import engine_prompt_work, router_decisions
    from .router import start_router

    slots = max(1, args.slots // ROUTER_ENGINES)
    engines = []
    try:
        for i in range(ROUTER_ENGINES):
            pub, replay = free_port(), free_port()
            extra = [*hydra_extra("session", max(1, ram_mib // ROUTER_ENGINES), work, args.step_token_budget),
                     "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}", "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"]
            e = EngineProcess(
                model, slots=slots, ctx_size=slots * args.slot_ctx, threads=args.threads, extra=extra, env=env
            )
            engines.append((e.start(work, f"{tag}-{i}"), pub, replay))
        urls = [e.url for e, _, _ in engines]
        router_args = [
            "--policy",
            "kv_aware",
            "--worker-urls",
            *urls,
            "--kv-event-model",
            "hydra",
            "--log-level",
            "debug",
            # a slow model's turns wait long for a slot: no 503 from the router's own bounds
            "--queue-timeout-secs",
            "1800",
            "--request-timeout-secs",
            "1800",
        ]
        if affinity:  # a session's turns stay on one engine while it has turns (idle TTL)
            router_args += ["--kv-aware-session-affinity-ttl-secs", "300"]
        for e, pub, replay in engines:
            router_args += ["--kv-event-source", f"{e.url}=tcp://127.0.0.1:{pub}",
                            "--kv-event-replay-source", f"{e.url}=tcp://127.0.0.1:{replay}"]
        proc, url = start_router(router_args, work, f"router-{tag}")
        try:
            replay_ = Replay(url, sessions_aware=True, finish_also=urls, model="hydra", cache_prompt=False)
            trio.run(replay_.run, trace)
        finally:
            proc.terminate()
            proc.wait(timeout=15)
        figures: dict[str, Any] = {"engines": []}
        for e, _, _ in engines:
            got = scrape_evictions(e.url)
            got["prompt_tokens_processed"] = engine_prompt_work(e.url)
            figures["engines"].append(got)
        decisions = router_decisions(work / f"router-{tag}.log", urls)
        figures["router_decisions"] = len(decisions)
        figures["router_decisions_credited"] = sum(d["credited"] > 0 for d in decisions)
        figures["turns_per_engine"] = [sum(d["engine"] == i for d in decisions) for i in range(len(urls))]
    finally:
        for e, _, _ in engines:
            e.stop()
    return figures, replay_.rows


def run_config(name: str, model: str, work: Path, args: argparse.Namespace, ram_mib: int, trace: list[Agent],
               binary: Path | None, tag: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """One configuration's replay: (its figures besides the summary, its rows); None: skipped."""
    base, _, variant = name.partition("@")
    env = None
    if variant == "before":
        if not args.before_src:
            raise SystemExit(f"{name}: --before-src DIR names the code to measure as 'before'")
        env = {**os.environ, "PYTHONPATH": str(Path(args.before_src).resolve())}
    ctx = args.slots * args.slot_ctx
    if base == "llama-server":
        if binary is None:
            return None
        with LlamaServer(binary, model, ctx=ctx, slots=args.slots, log_dir=work, tag=tag,
                         threads=args.threads, extra=["--cache-ram", str(ram_mib)]) as ls:
            replay = Replay(ls.url, sessions_aware=False)
            trio.run(replay.run, trace)
        return {}, replay.rows
    if base in ("router", "router+affinity"):
        return run_router(model, work, tag, args, ram_mib, trace, env, affinity=base == "router+affinity")
    eng = EngineProcess(model, slots=args.slots, ctx_size=ctx, threads=args.threads,
                        extra=hydra_extra(base, ram_mib, work / tag, args.step_token_budget), env=env).start(work, tag)
    try:
        replay = Replay(eng.url, sessions_aware=base != "lru")
        trio.run(replay.run, trace)
        return scrape_evictions(eng.url), replay.rows
    finally:
        eng.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.agents", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", help="synthetic model preset (ignored with --model)")
    ap.add_argument("--model", default=None, help="a GGUF path or a named model (gemma3-270m)")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--slot-ctx", type=int, default=4096)
    ap.add_argument("--ram-share", type=float, default=0.5, help="RAM budget: this share of "
                    "the live sessions' histories")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="of llama-server, lru, session, session+disk, router; "
                    "NAME@before")
    ap.add_argument("--seed", type=int, default=52)
    ap.add_argument("--seeds", default=None, help="several traces, comma-separated (default: --seed)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--think-scale", type=float, default=1.0, help="multiply the tools' run times")
    defaults = Shape()
    ap.add_argument("--system", type=int, default=defaults.system, help="tokens of the shared system prompt and tools")
    ap.add_argument("--task", type=int, default=defaults.task, help="tokens of a session's own first message")
    ap.add_argument("--answer", type=int, default=defaults.answer, help="tokens generated a turn")
    ap.add_argument("--step-token-budget", type=int, default=512, help="hydra-trio's prompt tokens a step "
                    "(llama-server: its ubatch, 512)")
    ap.add_argument("--quick", action="store_true", help="4 sessions of 4 turns")
    ap.add_argument("--with-llama-server", action="store_true")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--before-src", default=None, help="the src folder of the code 'NAME@before' configurations run")
    ap.add_argument("--out", default=str(RESULTS / "agents.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.sessions, args.turns = 4, 4
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    from hydra_trio.model.synthetic import write_model

    work = Path(tempfile.mkdtemp(prefix="hydra-agents-"))
    if args.model:
        from hydra_trio.model.registry import named_model_path

        model = Path(args.model) if Path(args.model).is_file() else named_model_path(args.model)
    else:
        model = work / f"{args.preset}.gguf"
        write_model(model, args.preset, seed=0)
    ctx = args.slots * args.slot_ctx
    probe = EngineProcess(str(model), slots=args.slots, ctx_size=ctx, threads=args.threads).start(work, "probe")
    try:
        n_vocab = httpx.get(probe.url + "/v1/models", timeout=60).json()["data"][0]["meta"]["n_vocab"]
        per_token = bytes_per_token(probe.url, n_vocab)
    finally:
        probe.stop()
    shape = Shape(system=args.system, task=args.task, answer=args.answer,
                  think_s=(0.2 * args.think_scale, 1.0 * args.think_scale), sub_task=max(1, args.task * 5 // 6))
    binary = find_or_build(args.llama_server, args.with_llama_server)
    names = args.configs.split(",")
    results: dict[str, Any] = {
        "env": env_info(), "args": vars(args), "shape": asdict(shape), "bytes_per_token": per_token,
        "seeds": {}, "note": "this 2-core machine was shared with other jobs: see each configuration's load average",
    }
    for seed in seeds:
        trace = make_trace(seed, args.sessions, args.turns, (300, n_vocab - 1), shape)
        oracle = oracle_computed(trace, shape.system)
        # Live histories at their longest: every session's last prompt, and its subagents'.
        live = sum(
            len(a.steps[-1].prompt) + sum(len(s.steps[-1].prompt) for subs in a.spawns.values() for s in subs)
            for a in trace
        )
        ram_mib = max(1, math.ceil(args.ram_share * live * per_token / (1 << 20)))
        print(f"seed {seed}: {len(_all_steps(trace))} turns, {live} "
              f"live tokens at most, {per_token:.0f} KV bytes a token: "
              f"--cache-ram {ram_mib} MiB; oracle computes {oracle} prompt tokens", flush=True)
        one: dict[str, Any] = {
            "ram_mib": ram_mib,
            "live_tokens": live,
            "oracle_computed": oracle,
            "configs": {},
            "rows": {},
        }
        results["seeds"][str(seed)] = one
        for name in names:
            load_before = os.getloadavg()
            ran = run_config(name, str(model), work, args, ram_mib, trace, binary, f"{name.replace('@', '-')}-{seed}")
            if ran is None:
                one["configs"][name] = None
                continue
            extra, rows = ran
            f = summarize(rows, oracle)
            f.update(extra)
            f["load_avg"] = {"before": load_before, "after": os.getloadavg()}
            one["configs"][name] = f
            one["rows"][name] = rows
            print(f"  {name}: {f['computed']} prompt tokens computed ({f['x_oracle']:.2f}× oracle; later turns "
                  f"{f['later_computed']}, {f['later_x_oracle']:.2f}×), TTFT p50 {f['ttft_p50_ms']:.0f} ms, p99 "
                  f"{f['ttft_p99_ms']:.0f} ms (later turns {f['later_ttft_p50_ms']:.0f}, {f['later_ttft_p99_ms']:.0f})"
                  + (f", evictions {f.get('evictions')}" if f.get("evictions") is not None else "")
                  + (f", mean slot wait {f['queue_mean_ms']:.0f} ms, prefill {f['prefill_mean_ms']:.0f} ms"
                     if f.get("queue_mean_ms") is not None else "")
                  + f"; load {load_before[0]:.1f}", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))  # what has run so far
    first = results["seeds"][str(seeds[0])]
    results["configs"], results["rows"], results["oracle_computed"], results["ram_mib"] = (
        first["configs"], first["rows"], first["oracle_computed"], first["ram_mib"])
    if len(seeds) > 1:
        results["over_seeds"] = over_seeds(results, names)
        for name, agg in results["over_seeds"].items():
            print(f"{name}: later turns × oracle {agg['later_x_oracle']} (mean {agg['later_x_oracle_mean']:.2f}); "
                  f"later TTFT p50 {agg['later_ttft_p50_ms']} ms")
    Path(args.out).write_text(json.dumps(results, indent=1))
    plot(results, Path(args.out).with_suffix(".png"))
    print(f"results: {args.out}")
    return 0


def over_seeds(results: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Each configuration's later-turn figures, seed by seed, and their mean."""
    out = {}
    for name in names:
        runs = [one["configs"].get(name) for one in results["seeds"].values()]
        if any(r is None for r in runs):
            continue
        xs = [round(r["later_x_oracle"], 3) for r in runs]
        out[name] = {"later_x_oracle": xs, "later_x_oracle_mean": sum(xs) / len(xs),
                     "later_ttft_p50_ms": [round(r["later_ttft_p50_ms"]) for r in runs]}
    return out


if __name__ == "__main__":
    sys.exit(main())
