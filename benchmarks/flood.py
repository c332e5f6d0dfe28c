"""`python -m benchmarks.flood [--limit 256] [--factor 2]`

Issue "Safe on a shared network", item 4b, at its own scale: an engine whose open-file
limit is ``--limit`` (soft and hard, so it cannot raise it) holds ``--factor`` x that many
idle HTTP connections that never send a byte; meanwhile ``/health`` must answer within 1 s,
and within 2 s after they close a completion must work. Prints the times.
"""

from __future__ import annotations

import argparse
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .harness import free_port


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=256, help="the engine's open-file limit")
    ap.add_argument("--factor", type=int, default=2, help="idle connections, as a multiple of the limit")
    args = ap.parse_args(argv)
    from hydra_trio.model.synthetic import write_model

    work = Path(tempfile.mkdtemp(prefix="hydra-flood-"))
    model = write_model(work / "tiny.gguf", "tiny", seed=0)
    port = free_port()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.limit, args.limit))

    cmd = [sys.executable, "-m", "hydra_trio.cli", "serve", "--model", str(model), "--port", str(port),
           "--rpc-port", "0", "--log-level", "WARNING"]
    engine = subprocess.Popen(cmd, preexec_fn=limit, stdout=open(work / "engine.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or engine.poll() is not None:
                raise SystemExit(f"engine did not start: see {work / 'engine.log'}")
            time.sleep(0.2)
        n = args.factor * args.limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 256)), hard))  # ours, not the engine's
        idle = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port))
            idle.append(s)
        health = []
        for _ in range(10):
            t0 = time.perf_counter()
            status = httpx.get(url + "/health", timeout=5).status_code
            health.append((round((time.perf_counter() - t0) * 1000), status))
            time.sleep(0.2)
        for s in idle:
            s.close()
        t0 = time.perf_counter()
        after = None
        while time.perf_counter() - t0 < 5:
            try:
                r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=2)
                after = (round(time.perf_counter() - t0, 2), r.status_code)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        print(f"open-file limit {args.limit}; {n} idle connections held")
        print(f"/health while held (ms, status): {health}  goal: each within 1000 ms")
        print(f"first completion after they closed (s, status): {after}  goal: within 2 s")
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
