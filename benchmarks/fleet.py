"""`python -m benchmarks.fleet`: a chaos campaign on a fleet across hosts (issue 42 item 6).

Each phase builds a fresh fleet (benchmarks/netns.py): two prefill and two decode engines,
each in its own network namespace on a link-local segment, vllm-router in P/D mode in this
namespace. Clients stream chats through the router (every one a hand-off) and straight to
the decode engines, in bounded loops, while one fault strikes: kill -9 a prefill engine,
kill -9 a decode engine, SIGSTOP a prefill engine (continued later), or cut a prefill or a
decode engine's link (mended later). Then everything is stopped. Two more phases drive a
hand-off by hand and strike its prefill engine between the export and the pull (kill -9,
or a cut link), to time the decode engine's fallback.

Measured per phase: requests that succeeded, ended in a clean error (an HTTP error status
with a body, or an SSE error event), ended in a transport error (the connection reset or
closed), or hung (no end within --hang-s: the figure that must be 0); hand-offs that fell
back to a local prefill and how long those took; what the router answered; and, once the
faults are over, whether a surviving engine leaks a slot, payload budget, a KV export or a
shared-memory file (waited for up to --settle-s, as export TTLs run out).

Needs root and iproute2 (``ip netns``) and vllm-router; prints why and exits 2 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from .netns import Fabric, NetnsEngine, available

FAULTS = ("kill9-prefill", "kill9-decode", "sigstop-prefill", "cut-prefill", "cut-decode")
# Hand-offs driven by hand, the prefill engine struck between its reply and the decode
# engine's pull (a window the router's traffic seldom hits): how long the fallback takes.
HANDOFF_FAULTS = ("handoff-kill9-prefill", "handoff-cut-prefill")
PROMPTS = [f"session {i}: the slot cache engine moves its keys and values " * 6 for i in range(8)]
_SHM_NAME = re.compile(r"^hydra-kv-(\d+)-(\d+)-[0-9a-f]{8}-(.+)$")


def _router_binary() -> str | None:
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def _gauges(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        for name in (
            "hydra_slots_busy",
            "hydra_payload_bytes_held",
            "hydra_kv_exports_held",
            "hydra_decode_requests_running",
        ):
            if line.startswith(name + " "):
                out[name] = float(line.split()[1])
    return out


def _pulls(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("hydra_kv_pulls_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len("hydra_kv_pulls_total") :]] = float(value)
    return out


class Phase:
    def __init__(self, fault: str, args: argparse.Namespace, model: str, log_dir: Path) -> None:
        self.fault, self.args, self.model, self.log_dir = fault, args, model, log_dir
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.fallback_s: list[float] = []
        self.restored_s: list[float] = []
        self.fault_at: float | None = None
        self.done = trio.Event()  # the fault is over and --after-s has passed: clients stop

    async def run(self) -> dict[str, Any]:
        if self.fault in HANDOFF_FAULTS:
            return await self._handoffs()
        a = self.args
        with Fabric(4) as fabric:
            net = f"{fabric.caller_addr.rsplit('.', 1)[0]}.0/24"
            common = ("--slots", "2", "--ctx-size", "1024", "--kv-pull-timeout-s", str(a.pull_timeout_s))
            engines = [
                NetnsEngine(
                    h,
                    self.model,
                    net,
                    self.log_dir,
                    f"{self.fault}-{role}{i % 2}",
                    extra=(*common, "--kv-export-ttl-s", "2") if role == "prefill" else common,
                )
                for i, (h, role) in enumerate(
                    zip(fabric.hosts, ("prefill", "prefill", "decode", "decode"), strict=True)
                )
            ]
            try:
                for e in engines:
                    await trio.to_thread.run_sync(e.start)
                return await self._with_router(fabric, engines)
            finally:
                for e in engines:
                    await trio.to_thread.run_sync(e.stop)

    async def _handoffs(self) -> dict[str, Any]:
        """``--handoffs`` times: a fresh prefill engine exports (do_remote_decode), is then
        killed or cut off, and the decode engine gets the reply's kv_transfer_params: it
        must fall back to a local prefill and answer. Timed from the decode request."""
        a = self.args
        times: list[float] = []
        outcomes: Counter[str] = Counter()
        leaks: dict[str, Any] = {}
        with Fabric(2) as fabric:
            net = f"{fabric.caller_addr.rsplit('.', 1)[0]}.0/24"
            common = ("--slots", "2", "--ctx-size", "1024", "--kv-pull-timeout-s", str(a.pull_timeout_s))
            decode = NetnsEngine(fabric.hosts[1], self.model, net, self.log_dir, f"{self.fault}-decode", extra=common)
            await trio.to_thread.run_sync(decode.start)
            try:
                async with httpx.AsyncClient(timeout=a.hang_s) as c:
                    for n in range(a.handoffs):
                        prefill = NetnsEngine(
                            fabric.hosts[0], self.model, net, self.log_dir, f"{self.fault}-prefill{n}", extra=common
                        )
                        await trio.to_thread.run_sync(prefill.start)
                        body = {"messages": [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}], "temperature": 0}
                        r = await c.post(
                            prefill.url + "/v1/chat/completions",
                            json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
                        )
                        params = r.json()["kv_transfer_params"]
                        if self.fault == "handoff-kill9-prefill":
                            prefill.signal(signal.SIGKILL)
                            await trio.to_thread.run_sync(prefill.proc.wait)  # type: ignore[union-attr]
                        else:
                            await trio.to_thread.run_sync(fabric.cut, 0)
                        t = trio.current_time()
                        outcome = "hung"
                        with trio.move_on_after(a.hang_s + 5):
                            try:
                                d = await c.post(
                                    decode.url + "/v1/chat/completions",
                                    json={**body, "max_tokens": a.max_tokens, "kv_transfer_params": params},
                                )
                                kv = d.json().get("kv_transfer") or {}
                                outcome = f"{d.status_code} {kv.get('status')} {kv.get('reason', '')}".strip()
                            except httpx.HTTPError as exc:
                                outcome = type(exc).__name__
                        times.append(trio.current_time() - t)
                        outcomes[outcome] += 1
                        if self.fault == "handoff-cut-prefill":
                            await trio.to_thread.run_sync(fabric.mend, 0)
                        await trio.to_thread.run_sync(prefill.stop)
                    text = (await c.get(decode.url + "/metrics")).text
                    g = _gauges(text)
                    leaks = {
                        "engines": {decode.name: {**g, "pulls": _pulls(text)}},
                        "leaked": {k: v for k, v in g.items() if v},
                    }
            finally:
                await trio.to_thread.run_sync(decode.stop)
        return {
            "fault": self.fault,
            "outcomes": dict(outcomes),
            "hung": outcomes.get("hung", 0),
            "fallback_s": _summary(times),
            "pull_timeout_s": a.pull_timeout_s,
            "leaks": leaks,
        }

    async def _with_router(self, fabric: Fabric, engines: list[NetnsEngine]) -> dict[str, Any]:
        a = self.args
        port = 18000 + os.getpid() % 1000
        router_log = self.log_dir / f"{self.fault}-router.log"
        cmd = [
            a.router, "--vllm-pd-disaggregation",
            "--prefill", engines[0].url, "--prefill", engines[1].url,
            "--decode", engines[2].url, "--decode", engines[3].url,
            "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(port + 1000), "--request-timeout-secs", str(int(a.hang_s)),
            "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
        ]  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        victim = {"prefill": 0, "decode": 2}[self.fault.rsplit("-", 1)[1]]
        async with trio.open_nursery() as nursery:
            out = router_log.open("wb")
            nursery.start_soon(partial(trio.run_process, cmd, check=False, stdout=out, stderr=subprocess.STDOUT))
            await self._wait_ready(base)
            t0 = trio.current_time()
            async with trio.open_nursery() as clients:
                for i in range(a.clients):
                    clients.start_soon(self._client, base, i, "router")
                for e in engines[2:]:
                    clients.start_soon(self._client, e.url, 100 + engines.index(e), "direct")
                clients.start_soon(self._strike, fabric, engines, victim, t0)
            survivors = [e for i, e in enumerate(engines) if not (i == victim and self.fault.startswith("kill9"))]
            leaks = await self._leaks(survivors, engines[victim])
            nursery.cancel_scope.cancel()
            out.close()
        return {
            "fault": self.fault,
            "victim": engines[victim].name,
            "outcomes": dict(self.outcomes),
            "hung": self.outcomes.get("router:hung", 0) + self.outcomes.get("direct:hung", 0),
            "errors": dict(self.errors.most_common(12)),
            "fallbacks": len(self.fallback_s),
            "fallback_s": _summary(self.fallback_s),
            "restored_s": _summary(self.restored_s),
            "leaks": leaks,
        }

    async def _wait_ready(self, base: str) -> None:
        with trio.fail_after(60):
            while True:
                try:
                    async with httpx.AsyncClient(timeout=2) as c:
                        if (await c.get(base + "/readiness")).status_code == 200:
                            return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.2)

    async def _strike(self, fabric: Fabric, engines: list[NetnsEngine], victim: int, t0: float) -> None:
        a = self.args
        await trio.sleep(a.fault_after_s)
        self.fault_at = trio.current_time() - t0
        e = engines[victim]
        if self.fault.startswith("kill9"):
            e.signal(signal.SIGKILL)
        elif self.fault.startswith("sigstop"):
            e.signal(signal.SIGSTOP)
            await trio.sleep(a.fault_s)
            e.signal(signal.SIGCONT)
        else:
            await trio.to_thread.run_sync(fabric.cut, victim)
            await trio.sleep(a.fault_s)
            await trio.to_thread.run_sync(fabric.mend, victim)
        await trio.sleep(a.after_s)
        self.done.set()

    async def _client(self, base: str, i: int, kind: str) -> None:
        a = self.args
        async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(a.hang_s, connect=5.0)) as c:
            for n in range(a.requests):  # bounded, and ended early once the fault is over
                if self.done.is_set():
                    break
                stream = (i + n) % 2 == 0 or kind == "direct"
                body = {
                    "messages": [{"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]}],
                    "max_tokens": a.max_tokens, "temperature": 0, "stream": stream,
                }  # fmt: skip
                t = trio.current_time()
                outcome = "hung"
                with trio.move_on_after(a.hang_s + 5):
                    outcome = await self._one(c, body, stream, trio.current_time() - t)
                self.outcomes[f"{kind}:{outcome}"] += 1

    async def _one(self, c: httpx.AsyncClient, body: dict[str, Any], stream: bool, _t: float) -> str:
        t = trio.current_time()
        try:
            if not stream:
                r = await c.post("/v1/chat/completions", json=body)
                if r.status_code != 200:
                    self.errors[f"HTTP {r.status_code}: {r.text[:120]}"] += 1
                    return "clean_error"
                kv = r.json().get("kv_transfer") or {}
                took = trio.current_time() - t
                if kv.get("status") == "fallback":
                    self.fallback_s.append(took)
                elif kv.get("status") == "restored":
                    self.restored_s.append(took)
                return "ok"
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    self.errors[f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:120]}"] += 1
                    return "clean_error"
                done = False
                async for line in r.aiter_lines():
                    if line.startswith("data: [DONE]"):
                        done = True
                    elif line.startswith("data: ") and '"error"' in line:
                        self.errors[f"SSE error: {line[6:126]}"] += 1
                        return "clean_error"
                if not done:
                    self.errors["stream ended without [DONE]"] += 1
                    return "transport_error"
                return "ok"
        except httpx.TimeoutException:
            return "hung"
        except httpx.TransportError as exc:
            self.errors[f"{type(exc).__name__}: {str(exc)[:100]}"] += 1
            return "transport_error"

    async def _leaks(self, survivors: list[NetnsEngine], victim: NetnsEngine) -> dict[str, Any]:
        """Every survivor's slots, budget and exports, waited for to reach 0 (export TTLs);
        and the shared-memory files left, by whether their owner is alive."""
        a = self.args
        final: dict[str, dict[str, float]] = {}
        deadline = trio.current_time() + a.settle_s
        async with httpx.AsyncClient(timeout=5) as c:
            for e in survivors:
                while True:
                    try:
                        text = (await c.get(e.url + "/metrics")).text
                        g = _gauges(text)
                        final[e.name] = {**g, "pulls": _pulls(text)}  # type: ignore[dict-item]
                    except httpx.HTTPError as exc:
                        final[e.name] = {"unreachable": str(exc)[:80]}  # type: ignore[dict-item]
                        g = {"x": 1.0}
                    if not any(g.values()) or trio.current_time() > deadline:
                        break
                    await trio.sleep(0.5)
        alive = {e.proc.pid for e in survivors if e.proc is not None and e.proc.poll() is None}
        shm: Counter[str] = Counter()
        for p in await trio.to_thread.run_sync(lambda: list(Path("/dev/shm").glob("hydra-kv-*"))):
            m = _SHM_NAME.match(p.name)
            if not m or m.group(3) == "probe":
                continue
            pid = int(m.group(2))
            if victim.proc is not None and pid == victim.proc.pid:
                shm["of the killed engine (removed by the next start)"] += 1
            elif pid in alive:
                shm["of a surviving engine"] += 1
        leaked = {
            name: {k: v for k, v in g.items() if k != "pulls" and v}
            for name, g in final.items()
        }  # fmt: skip
        return {"engines": final, "leaked": {k: v for k, v in leaked.items() if v}, "shm_files": dict(shm)}


def _summary(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"n": len(xs), "median": round(statistics.median(xs), 3), "max": round(max(xs), 3)}


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    from hydra_trio.model.synthetic import write_model

    results = []
    with tempfile.TemporaryDirectory(prefix="hydra-fleet-") as tmp:
        model = str(write_model(Path(tmp) / "tiny.gguf", "tiny", seed=0))
        log_dir = Path(args.log_dir or tmp)
        os.makedirs(log_dir, exist_ok=True)
        for fault in args.faults:
            t = time.monotonic()
            res = await Phase(fault, args, model, log_dir).run()
            res["wall_s"] = round(time.monotonic() - t, 1)
            print(json.dumps(res), flush=True)
            results.append(res)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", nargs="+", default=list(FAULTS + HANDOFF_FAULTS), choices=FAULTS + HANDOFF_FAULTS)
    p.add_argument("--handoffs", type=int, default=3, help="hand-offs per hand-off fault (a fresh prefill engine each)")
    p.add_argument("--clients", type=int, default=4, help="router clients (each also a hand-off)")
    p.add_argument("--requests", type=int, default=400, help="requests per client at most (the loops end --after-s "
                   "past the fault)")
    p.add_argument("--after-s", type=float, default=3.0, help="traffic goes on this long after the fault is over")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--fault-after-s", type=float, default=1.0)
    p.add_argument("--fault-s", type=float, default=4.0, help="how long a pause or a cut lasts")
    p.add_argument("--hang-s", type=float, default=40.0, help="a request with no end by then is hung")
    p.add_argument("--settle-s", type=float, default=20.0)
    p.add_argument("--pull-timeout-s", type=float, default=5.0, help="the decode engines' --kv-pull-timeout-s")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    why = available()
    args.router = _router_binary()
    if why is not None or args.router is None:
        print(f"benchmarks.fleet: cannot run: {why or 'vllm-router is not installed'}", file=sys.stderr)
        return 2
    results = trio.run(main_async, args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["hung"] == 0 and not r["leaks"]["leaked"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
