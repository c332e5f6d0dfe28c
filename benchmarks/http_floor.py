"""`python -m benchmarks.http_floor [--bursts 30] [--requests 64]`

What a request costs the HTTP stack this project is built on (quart-trio on Hypercorn), with
nothing of ours: a bare ``QuartTrio`` app with one route, served by ``hypercorn.trio.serve``
in its own process, and ``hydra-trio serve`` (the synthetic ``tiny`` model), bursts of
``GET /health`` on as many connections at once (the client of ``benchmarks.ceiling
--burst``), the two servers taking turns. Printed: each one's CPU per request and ours / the
bare app's: the part of a request that no route of ours can cut, and what ours adds to it
(the connection gate, the middlewares, the route).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .ceiling import cpu_s, run_health_burst
from .harness import EngineProcess, free_port, wait_http

BARE_APP = """
import sys, trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart_trio import QuartTrio

app = QuartTrio("bare")

@app.route("/health")
async def health():
    return {"status": "ok"}

config = Config()
config.bind = [f"127.0.0.1:{sys.argv[1]}"]
config.accesslog = config.errorlog = None
trio.run(serve, app, config)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.http_floor", description=__doc__.split("\n\n")[1])
    ap.add_argument("--bursts", type=int, default=30)
    ap.add_argument("--requests", type=int, default=64, help="connections at once in a burst")
    args = ap.parse_args(argv)
    port = free_port()
    bare = subprocess.Popen([sys.executable, "-c", BARE_APP, str(port)])
    work = Path(tempfile.mkdtemp(prefix="hydra-http-floor-"))
    ours: EngineProcess | None = None
    try:
        from hydra_trio.model.synthetic import write_model

        write_model(work / "tiny.gguf", "tiny", seed=0)
        ours = EngineProcess(str(work / "tiny.gguf"), slots=4, ctx_size=4 * 256, threads=1).start(work, "hydra-trio")
        wait_http(f"http://127.0.0.1:{port}/health", bare, timeout=60)
        servers = {"bare quart-trio": (port, bare.pid), "hydra-trio": (ours.http_port, ours.pid)}
        spent = dict.fromkeys(servers, 0.0)
        for rnd in range(3 + args.bursts):  # 3 unmeasured, then the bursts, in turns
            for name, (p, pid) in servers.items() if rnd % 2 else reversed(servers.items()):
                c0 = cpu_s(pid)
                run_health_burst(p, args.requests)
                if rnd >= 3:
                    spent[name] += cpu_s(pid) - c0
        ms = {name: s / (args.bursts * args.requests) * 1000 for name, s in spent.items()}
        print(f"bursts of {args.requests} GET /health, {args.bursts} each, CPU a request:")
        for name, v in ms.items():
            print(f"  {name:16s} {v:.2f} ms")
        print(f"  ours / bare: {ms['hydra-trio'] / ms['bare quart-trio']:.2f}x")
    finally:
        bare.terminate()
        bare.wait(timeout=15)
        if ours is not None:
            ours.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
