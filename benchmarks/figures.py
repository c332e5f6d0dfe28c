"""The six figures of the benchmark issue (plus a presets table). Each returns a dict of
raw samples, summaries and the headline ratio; __main__ prints and plots them."""

from __future__ import annotations

import ctypes
import itertools
import socket
import statistics
import string
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from hydra_trio.rpc.client import RpcClient, SyncRpcClient, build_decode_frame, identity_kv_metadata
from hydra_trio.testing.sse_reader import sse_chunk
from hydra_trio.wire.kvblob import parse_kv_blob

from .harness import EngineProcess, metric_value, percentile, summary, words_prompt


@dataclass
class Tokenizer:
    """Vocab-only llama-cpp-python model: sizes prompts in tokens without a server."""

    model: str

    def __post_init__(self) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(self.model, vocab_only=True, verbose=False)

    def count_chat(self, content: str) -> int:
        from hydra_trio.engine.chat import render_jinja

        text = render_jinja(
            {"messages": [{"role": "user", "content": content}]},
            self.llm.metadata.get("tokenizer.chat_template"),
            bos_token="<s>",
            eos_token="",
        )
        return len(self.llm.tokenize(text.encode(), add_bos=True, special=True))

    def content_for(self, n_tokens: int, seed: int = 0) -> str:
        """User content whose chat prompt is n_tokens long (± a few)."""
        words = n_tokens
        for _ in range(6):
            n = self.count_chat(words_prompt(words, seed))
            if abs(n - n_tokens) <= 2:
                break
            words = max(1, int(words * n_tokens / n))
        return words_prompt(words, seed)


def chat_request(content: str, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}


def erase_all(engine: EngineProcess) -> None:
    for i in range(engine.slots):
        httpx.post(f"{engine.url}/slots/{i}", params={"action": "erase"}, timeout=60).raise_for_status()


def first_content_time(resp: httpx.Response) -> float:
    """perf_counter() at the first SSE chunk carrying text; reads the stream to its end."""
    first = None
    for line in resp.iter_lines():
        if first is None and _has_text(line):
            first = time.perf_counter()
    if first is None:
        raise RuntimeError("stream ended without any text")
    return first


# ---- 0. presets ------------------------------------------------------------------------


def fig_presets(models: dict[str, str], log_dir: Any, n_tokens: int) -> dict[str, Any]:
    rows = {}
    for preset, path in models.items():
        e = EngineProcess(path, slots=1, ctx_size=2048).start(log_dir, f"preset-{preset}")
        try:
            load_ms = 1000.0 * metric_value(e.url, "hydra_model_load_seconds")
            body = chat_request("hello there, how are you today", n_tokens)
            httpx.post(e.url + "/v1/chat/completions", json=body, timeout=120)  # warm-up
            erase_all(e)
            runs = [
                httpx.post(e.url + "/v1/chat/completions", json=body, timeout=120).json()["timings"][
                    "predicted_per_second"
                ]
                for _ in range(3)
            ]
            rows[preset] = {"load_ms": load_ms, "tokens_per_s": summary(runs)}
        finally:
            e.stop()
    return {"rows": rows}


# ---- 1. hand-off vs recompute ----------------------------------------------------------


def fig_handoff(a: EngineProcess, b: EngineProcess, tok: Tokenizer, sizes: list[int], repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with (
        SyncRpcClient("127.0.0.1", a.rpc_port, timeout=600) as rpc_a,
        SyncRpcClient("127.0.0.1", b.rpc_port, timeout=600) as rpc_b,
        httpx.Client(base_url=b.url, timeout=600) as http_b,
    ):
        for n in sizes:
            content = tok.content_for(n, seed=n)
            req = chat_request(content, 4)
            handoff, recompute, n_past = [], [], 0
            for _ in range(repeats):
                erase_all(a)
                erase_all(b)
                pre = rpc_a.prefill(0, req)
                n_past = pre.meta["n_past"]
                frame = build_decode_frame(req, pre.payload, kv_metadata=identity_kv_metadata(pre.meta, n_past))
                t0 = time.perf_counter()
                rid = rpc_b.decode(0, frame).meta["decode_request_id"]
                with http_b.stream("GET", f"/v1/decode/{rid}", headers={"Accept": "text/event-stream"}) as resp:
                    t1 = first_content_time(resp)
                handoff.append((t1 - t0) * 1000.0)
                erase_all(b)
                t0 = time.perf_counter()
                with http_b.stream("POST", "/v1/chat/completions", json={**req, "stream": True}) as resp:
                    t1 = first_content_time(resp)
                recompute.append((t1 - t0) * 1000.0)
            ratios = [r / h for r, h in zip(recompute, handoff, strict=True)]
            out[str(n)] = {
                "n_past": n_past,
                "kv_bytes": len(pre.payload),
                "handoff_ttft_ms": summary(handoff),
                "recompute_ttft_ms": summary(recompute),
                "speedup": summary(ratios),
            }
    return out


def fig_handoff_llama_server(
    handoff: dict[str, Any], b: EngineProcess, tok: Tokenizer, binary: Any, model: str, repeats: int, log_dir: Any
) -> dict[str, Any]:
    """P1 against llama-server: for each hand-off size of figure 1, llama-server restoring the
    same prompt's slot file (``--slot-save-path``) and producing its first token. Adds
    ``llama_server_restore`` and ``handoff_over_llama_server`` (ratio of medians) to the rows."""
    from .llama_server import LlamaServer, slot_restore_ttft_ms

    with LlamaServer(binary, model, ctx=8192, slots=1, log_dir=log_dir, tag="llama-server-p1") as server:
        for n, row in handoff.items():
            req = chat_request(tok.content_for(int(n), seed=int(n)), 4)
            prompt = httpx.post(f"{b.url}/apply-template", json={"messages": req["messages"]}, timeout=60).json()[
                "prompt"
            ]
            peer = slot_restore_ttft_ms(server, prompt, repeats)
            row["llama_server_restore"] = peer
            row["handoff_over_llama_server"] = row["handoff_ttft_ms"]["median"] / peer["ttft_ms"]["median"]
    return {n: row.get("llama_server_restore") for n, row in handoff.items()}


# ---- 2. restore path vs its limits -----------------------------------------------------


_RECEIVER = r"""
import socket, sys, time
n = int(sys.argv[1])
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
buf = bytearray(n)
view = memoryview(buf)
got = 0
while got < n:
    k = conn.recv_into(view[got:], n - got)
    if k == 0:
        break
    got += k
conn.sendall(b"1")  # done: the sender stops its clock on this byte
conn.close()
"""


def _raw_loopback_copy(data: memoryview) -> float:
    """Seconds to push ``data`` over loopback TCP into one preallocated buffer in another
    process (the engine's situation, minus everything the engine does)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(len(data))], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        c.sendall(data)
        c.recv(1)
        dt = time.perf_counter() - t0
    proc.wait()
    return dt


class InProcessRestore:
    """llama_state_seq_set_data in this process, on the same model: the floor for restore."""

    def __init__(self, model: str, n_ctx: int) -> None:
        from hydra_trio.engine.llama.context import LlamaBackend

        self.backend = LlamaBackend(model, n_slots=1, n_ctx=n_ctx, n_threads=2)

    def seconds(self, state: memoryview) -> float:
        import llama_cpp

        b = self.backend
        buf = (
            (ctypes.c_uint8 * len(state)).from_buffer(state)
            if not state.readonly
            else (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        )
        llama_cpp.llama_memory_seq_rm(b._mem, 0, -1, -1)
        t0 = time.perf_counter()
        n = llama_cpp.llama_state_seq_set_data(b._ctx, buf, len(state), 0)
        dt = time.perf_counter() - t0
        if n == 0:
            raise RuntimeError("in-process restore refused the blob")
        return dt

    def close(self) -> None:
        self.backend.close()


def fig_restore(
    a: EngineProcess, b: EngineProcess, tok: Tokenizer, sizes_mb: list[int], repeats: int, model: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    local = InProcessRestore(model, n_ctx=a.ctx_size)
    per_token = None
    try:
        with (
            SyncRpcClient("127.0.0.1", a.rpc_port, timeout=600) as rpc_a,
            SyncRpcClient("127.0.0.1", b.rpc_port, timeout=600) as rpc_b,
        ):
            for mb in sizes_mb:
                if per_token is None:
                    probe = rpc_a.prefill(0, chat_request(tok.content_for(64), 1))
                    per_token = probe.meta["state_size"] / probe.meta["n_past"]
                n_tokens = max(8, int(mb * 1024 * 1024 / per_token))
                content = tok.content_for(n_tokens, seed=mb)
                req = chat_request(content, 1)
                erase_all(a)
                pre = rpc_a.prefill(0, req)
                blob = pre.payload
                frame = build_decode_frame(req, blob, kv_metadata=identity_kv_metadata(pre.meta, pre.meta["n_past"]))
                state = parse_kv_blob(blob).state[: pre.meta["state_size"]]
                ack, setdata, put, raw = [], [], [], []
                for _ in range(repeats):
                    erase_all(b)
                    t0 = time.perf_counter()
                    rid = rpc_b.decode(0, frame).meta["decode_request_id"]
                    ack.append((time.perf_counter() - t0) * 1000.0)
                    httpx.get(f"{b.url}/v1/decode/{rid}", params={"wait": 60}, timeout=120)
                    setdata.append(local.seconds(state) * 1000.0)
                    t0 = time.perf_counter()
                    rpc_b.state_put(1, blob)
                    put.append(len(blob) / (time.perf_counter() - t0) / 1e6)
                    raw.append(len(blob) / _raw_loopback_copy(memoryview(blob)) / 1e6)
                out[str(mb)] = {
                    "blob_bytes": len(blob),
                    "n_past": pre.meta["n_past"],
                    "decode_ack_ms": summary(ack),
                    "inprocess_set_data_ms": summary(setdata),
                    "ack_over_set_data": summary([x / y for x, y in zip(ack, setdata, strict=True)]),
                    "state_put_MBps": summary(put),
                    "raw_loopback_MBps": summary(raw),
                    "put_over_raw": summary([x / y for x, y in zip(put, raw, strict=True)]),
                }
    finally:
        local.close()
    return out


# ---- 3. generation overhead ------------------------------------------------------------


def plain_llama_loop(model: str, prompt_tokens: list[int], n: int) -> float:
    """Tokens/s of a plain greedy loop through llama-cpp-python's low-level API."""
    import llama_cpp

    from hydra_trio.engine.llama.context import LlamaBackend
    from hydra_trio.engine.params import SamplingParams
    from hydra_trio.engine.sample import Sampler

    b = LlamaBackend(model, n_slots=1, n_ctx=4096, n_threads=2)
    try:
        smpl = Sampler(SamplingParams())
        tok, _ = b.eval_chunk(0, prompt_tokens, None, sampler=smpl)
        chain = smpl.chain(b.info.n_vocab)
        batch = llama_cpp.llama_batch_get_one
        t0 = time.perf_counter()
        arr = (llama_cpp.llama_token * 1)()
        for _ in range(n - 1):
            arr[0] = tok
            if llama_cpp.llama_decode(b._ctx, batch(arr, 1)) != 0:
                raise RuntimeError("decode failed")
            tok = llama_cpp.llama_sampler_sample(chain, b._ctx, -1)
        dt = time.perf_counter() - t0
        smpl.close()
        return (n - 1) / dt
    finally:
        b.close()


def fig_generation(b: EngineProcess, tok: Tokenizer, n_tokens: int, repeats: int, model: str) -> dict[str, Any]:
    """One DECODE stream over SSE against the plain loop on the same prompt. Each repeat
    runs one of each back to back and their ratio is taken within the repeat: this VM's
    speed drifts by several percent over a minute, which a ratio of separate series would
    charge to one side."""
    content = "Tell me a long story about a slot."
    req = chat_request(content, n_tokens)
    from llama_cpp import Llama

    from hydra_trio.engine.chat import render_jinja

    llm = Llama(model, vocab_only=True, verbose=False)
    text = render_jinja(req, llm.metadata.get("tokenizer.chat_template"), bos_token="<s>", eos_token="")
    prompt_tokens = llm.tokenize(text.encode(), add_bos=True, special=True)
    del llm
    ours, plain = [], []
    with SyncRpcClient("127.0.0.1", b.rpc_port, timeout=600) as rpc, httpx.Client(base_url=b.url, timeout=600) as http:
        for _ in range(repeats):
            erase_all(b)
            rpc.prefill(0, req)
            rid = rpc.decode(0, build_decode_frame(req, b"")).meta["decode_request_id"]
            times = []
            with http.stream("GET", f"/v1/decode/{rid}", headers={"Accept": "text/event-stream"}) as resp:
                for line in resp.iter_lines():
                    if _has_text(line):
                        times.append(time.perf_counter())
            final = http.get(f"/v1/decode/{rid}").json()
            n = final["usage"]["completion_tokens"]
            # Client-side rate over the streamed tokens (chunks can merge bytes; use the count).
            ours.append((n - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0)
            plain.append(plain_llama_loop(model, prompt_tokens, n_tokens))
    return {
        "decode_sse_tokens_per_s": summary(ours),
        "plain_loop_tokens_per_s": summary(plain),
        "ours_over_plain": summary([x / y for x, y in zip(ours, plain, strict=True)]),
    }


# ---- 4. cancellation -------------------------------------------------------------------


def fig_cancel(b: EngineProcess, tok: Tokenizer, cancels: int, prefill_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with SyncRpcClient("127.0.0.1", b.rpc_port, timeout=600) as rpc, httpx.Client(base_url=b.url, timeout=600) as http:
        for phase in ("token_loop", "prefill"):
            latency, after, computed = [], [], []
            if phase == "token_loop":
                req = chat_request("Write a very long story.", 4000)
            else:
                req = chat_request(tok.content_for(prefill_tokens, seed=7), 4)
            for _ in range(cancels):
                erase_all(b)
                if phase == "token_loop":
                    pre = rpc.prefill(0, req)
                    frame = build_decode_frame(
                        req, pre.payload, kv_metadata=identity_kv_metadata(pre.meta, pre.meta["n_past"])
                    )
                else:
                    frame = build_decode_frame(req, b"")  # the whole prompt is prefilled by DECODE
                rid = rpc.decode(0, frame).meta["decode_request_id"]
                if phase == "token_loop":
                    seen = 0
                    with http.stream("GET", f"/v1/decode/{rid}", headers={"Accept": "text/event-stream"}) as resp:
                        for line in resp.iter_lines():
                            if _has_text(line):
                                seen += 1
                            if seen >= 20:
                                break
                else:
                    # Wait until the prefill is visibly under way (counter moves), then cancel.
                    start = metric_value(b.url, "hydra_engine_prompt_tokens_processed_total")
                    deadline = time.monotonic() + 30
                    while metric_value(b.url, "hydra_engine_prompt_t"
                                       "okens_processed_total") <= start and time.monotonic() < deadline:
                        time.sleep(0.02)
                t0 = time.perf_counter()
                r = http.delete(f"/v1/decode/{rid}").json()
                latency.append((time.perf_counter() - t0) * 1000.0)
                settle = time.perf_counter() + 0.3
                while time.perf_counter() < settle:  # give any stray work time to show
                    time.sleep(0.05)
                computed.append(r.get("completion_tokens", 0))
                after.append(metric_value(b.url, "hydra_engine_tokens_evaluated_total") - r["engine_tokens_evaluated"])
            out[phase] = {
                "delete_ms": summary(latency),
                "delete_ms_max": max(latency),
                "tokens_after_reply": summary(after),
                "tokens_after_reply_max": max(after),
                "tokens_before_cancel": summary(computed),
            }
    return out


# ---- 5. concurrency --------------------------------------------------------------------


async def _stream_times(http: httpx.AsyncClient, method: str, url: str, **kw: Any) -> list[float]:
    times: list[float] = []
    async with http.stream(method, url, **kw) as resp:
        async for line in resp.aiter_lines():
            if _has_text(line):
                times.append(time.perf_counter())
    return times


def _has_text(line: str) -> bool:
    """An SSE line carrying generated text (any JSON spacing: other servers differ)."""
    chunk = sse_chunk(line)
    return chunk is not None and bool((chunk.get("choices") or [{}])[0].get("delta", {}).get("content"))


_prompt_serial = itertools.count()


def _story_prompts(k: int) -> list[str]:
    """k prompts that no server has seen before, all equally long.

    Servers keep finished prompts' KV and skip the prefix a new prompt shares with it
    (llama-server's slots and llama_cpp.server both do), so what makes a prompt new must
    come first: a tag of three letters, little end first, so prompts fewer than 26 apart
    differ in their first character (a run number further in left the first half of the
    prompt shared with the previous run's)."""
    prompts = []
    for _ in range(k):
        n = next(_prompt_serial)
        tag = "".join(string.ascii_uppercase[n // 26**j % 26] for j in range(3))
        prompts.append(f"{tag}: a story for you, once upon a time")
    return prompts


async def _ours_decode(b: EngineProcess, prompts: list[str], n_tokens: int) -> list[list[float]]:
    k = len(prompts)
    reqs = [chat_request(p, n_tokens) for p in prompts]
    results: list[list[float]] = [[] for _ in range(k)]
    async with httpx.AsyncClient(base_url=b.url, timeout=600) as http:

        async def one(i: int) -> None:
            # Each stream prefills when it starts, as each chat request does (the engine
            # batches the prompts that arrive together): one after another, the prefills
            # had made DECODE look slower than chat by their sum.
            async with await RpcClient.connect("127.0.0.1", b.rpc_port) as rpc:
                await rpc.prefill(i, reqs[i])
                rid = (await rpc.decode(i, build_decode_frame(reqs[i], b""))).meta["decode_request_id"]
            results[i] = await _stream_times(http, "GET", f"/v1/decode/{rid}", headers={"Accept": "text/event-stream"})

        async with trio.open_nursery() as n:
            for i in range(k):
                n.start_soon(one, i)
    return results


async def _chat_streams(url: str, prompts: list[str], n_tokens: int, model_name: str | None) -> list[list[float]]:
    k = len(prompts)
    results: list[list[float]] = [[] for _ in range(k)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def one(i: int) -> None:
            body = {**chat_request(prompts[i], n_tokens), "stream": True}
            if model_name:
                body["model"] = model_name
            results[i] = await _stream_times(http, "POST", "/v1/chat/completions", json=body)

        async with trio.open_nursery() as n:
            for i in range(k):
                n.start_soon(one, i)
    return results


def _concurrency_stats(streams: list[list[float]], t_start: float) -> dict[str, Any]:
    total = sum(len(s) for s in streams)
    end = max(s[-1] for s in streams if s)
    first = min(s[0] for s in streams if s)
    gaps = [(s[i] - s[i - 1]) * 1000.0 for s in streams for i in range(1, len(s))]
    return {
        "tokens": total,
        "aggregate_tokens_per_s": total / (end - t_start),
        # From the first token anywhere to the last: the streams alone, without the prompts'
        # prefill (a DECODE's PREFILL also exports the slot's KV, which a coordinator runs
        # on another engine), so DECODE and chat streams compare like for like.
        "stream_tokens_per_s": total / (end - first) if end > first else float("nan"),
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p99_ms": percentile(gaps, 99),
    }


def _median_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-run stats folded into their medians, with every run's aggregate kept."""
    out = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    out["aggregate_runs"] = [r["aggregate_tokens_per_s"] for r in runs]
    return out


def fig_concurrency(
    b: EngineProcess, levels: list[int], n_tokens: int, peers: dict[str, str], repeats: int
) -> dict[str, Any]:
    """Aggregate tokens/s and ITL at k concurrent streams: ours (DECODE and chat) and each
    peer's chat endpoint (``peers``: name -> base URL, e.g. llama_server, llama_cpp_server).

    Each round gives every server the same k prompts, new to all of them, so the same text
    is generated everywhere and an early end of generation weighs on all alike; the
    servers' order alternates between rounds. Every server keeps what its slots hold (the
    chat template's first tokens, common to all prompts, may be reused by each; erasing
    ours made it prefill 4 tokens per prompt more than llama-server). Ratios are per
    round, then summarised."""

    def ours_decode(prompts: list[str]) -> list[list[float]]:
        return trio.run(_ours_decode, b, prompts, n_tokens)

    def ours_chat(prompts: list[str]) -> list[list[float]]:
        return trio.run(_chat_streams, b.url, prompts, n_tokens, None)

    def peer_chat(url: str) -> Callable[[list[str]], list[list[float]]]:
        return lambda ps: trio.run(_chat_streams, url, ps, n_tokens, None)

    servers: list[tuple[str, Callable[[list[str]], list[list[float]]]]] = [
        ("ours_decode", ours_decode),
        ("ours_chat", ours_chat),
        *((f"{peer}_chat", peer_chat(url)) for peer, url in peers.items()),
    ]
    out: dict[str, Any] = {}
    for k in levels:
        runs: dict[str, list[dict[str, Any]]] = {}
        for r in range(repeats):
            prompts = _story_prompts(k)
            for name, run in servers if r % 2 == 0 else servers[::-1]:
                # The PREFILL time is inside t0..end for ours_decode (its prompts are
                # prefilled over RPC first), as the prompt's prefill is for every chat.
                t0 = time.perf_counter()
                runs.setdefault(name, []).append(_concurrency_stats(run(prompts), t0))
        row: dict[str, Any] = {name: _median_stats(stats) for name, stats in runs.items()}
        for peer in peers:
            ratios = [
                ours["aggregate_tokens_per_s"] / other["aggregate_tokens_per_s"]
                for ours, other in zip(runs["ours_chat"], runs[f"{peer}_chat"], strict=True)
            ]
            row[f"ours_chat_over_{peer}"] = summary(ratios)
        out[str(k)] = row
    return out


# ---- 6. memory -------------------------------------------------------------------------


def fig_memory(a: EngineProcess, b: EngineProcess, tok: Tokenizer, mb: int, repeats: int) -> dict[str, Any]:
    with (
        SyncRpcClient("127.0.0.1", a.rpc_port, timeout=600) as rpc_a,
        SyncRpcClient("127.0.0.1", b.rpc_port, timeout=600) as rpc_b,
    ):
        probe = rpc_a.prefill(0, chat_request(tok.content_for(64), 1))
        per_token = probe.meta["state_size"] / probe.meta["n_past"]
        req = chat_request(tok.content_for(int(mb * 1024 * 1024 / per_token), seed=99), 1)
        erase_all(a)
        blob = rpc_a.prefill(0, req).payload
        growth = []
        for _ in range(repeats):
            erase_all(b)
            time.sleep(0.2)
            b.reset_peak_rss()
            base = b.rss_bytes()
            rpc_b.state_put(0, blob)
            growth.append((b.peak_rss_bytes() - base) / len(blob))
    return {"blob_bytes": len(blob), "peak_rss_growth_over_blob": summary(growth)}


Figure = Callable[..., dict[str, Any]]
