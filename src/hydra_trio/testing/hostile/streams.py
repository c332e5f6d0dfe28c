"""The well-formed streams, read in their own process (so the driver's CPU does not delay
their reading), every token stamped with CLOCK_MONOTONIC."""

from __future__ import annotations

import json
import selectors
import socket
import time
from pathlib import Path
from typing import Any

from ..workload import (
    Stream,
    completion_request,
    consume,
    words_prompt,
)
from .campaign_config import STOPPED

# ---- the stream reader (its own process) ------------------------------------------------------


def read_streams(
    port: int, n: int, duration_s: float, n_tokens: int, hang_s: float, out: Path
) -> None:
    """``n`` streaming completions at a time, each replaced when it ends, until
    ``duration_s``; every token-bearing event stamped (CLOCK_MONOTONIC) as it arrives."""
    sel = selectors.DefaultSelector()
    until = time.monotonic() + duration_s
    stop = out.with_suffix(".stop")  # the driver's "done" (the solo phase's end is not known ahead)
    runs: list[dict[str, Any]] = []
    started = 0
    health_ms: list[float] = []
    health_errors: list[str] = []

    def probe_health() -> None:
        # /health from this light process too: the driver's own probe waits on the driver's CPU.
        import http.client

        while time.monotonic() < until and not stop.exists():
            t0 = time.monotonic()
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=hang_s)
                c.request("GET", "/health")
                status = c.getresponse().status
                c.close()
                health_ms.append((time.monotonic() - t0) * 1000)
                if status != 200:
                    health_errors.append(f"status {status}")
            except OSError as exc:
                health_errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.25)

    import threading

    prober = threading.Thread(target=probe_health, daemon=True)
    prober.start()

    def open_stream(i: int) -> None:
        nonlocal started
        try:
            sock = socket.create_connection(("127.0.0.1", port))
        except OSError as exc:  # the engine is gone or refusing: recorded, not retried
            runs.append(
                {
                    "stream": i,
                    "t0": time.monotonic(),
                    "t1": time.monotonic(),
                    "arrivals": [],
                    "tokens": 0,
                    "done": False,
                    "error": f"connect: {exc}",
                }
            )
            return
        st = Stream(sock, completion_request(port, words_prompt(24, seed=1000 * i + started), n_tokens))
        sock.sendall(st.request)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, (i, st, time.monotonic()))
        started += 1

    def finish(key: selectors.SelectorKey, error: str = "") -> None:
        i, st, t0 = key.data
        sel.unregister(st.sock)
        st.sock.close()
        runs.append(
            {
                "stream": i,
                "t0": t0,
                "t1": time.monotonic(),
                "arrivals": st.arrivals,
                "tokens": st.tokens,
                "done": st.done,
                "error": error or st.error,
            }
        )
        if time.monotonic() < until and not stop.exists():
            open_stream(i)

    for i in range(n):
        open_stream(i)
    while sel.get_map():
        for key, _ in sel.select(timeout=0.2):
            st = key.data[1]
            now = time.monotonic()
            try:
                chunk = st.sock.recv(1 << 16)
            except BlockingIOError:
                continue
            except OSError as exc:
                finish(key, f"{type(exc).__name__}: {exc}")
                continue
            if chunk:
                st.buf += chunk
                consume(st, now)
                if not st.done:
                    continue
            finish(key)
        now = time.monotonic()
        if stop.exists():  # the campaign is over: what still streams is cut, not a failure
            for key in list(sel.get_map().values()):
                finish(key, STOPPED)
            break
        for key in list(sel.get_map().values()):
            _, st, t0 = key.data
            last = st.arrivals[-1] if st.arrivals else t0
            if now - last > hang_s:
                finish(key, f"HANG: no token for {hang_s:g} s")
    prober.join(timeout=hang_s + 1)
    out.write_text(
        json.dumps({"runs": runs, "health_ms": health_ms, "health_errors": health_errors})
    )
