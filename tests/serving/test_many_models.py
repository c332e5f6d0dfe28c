"""Many models behind one process (serving/model_pool.py, http/models/model_routes.py): a request's ``model``
picks the model on every dialect, at most --models-max hold memory (the least recently used
idle one evicted), pinned ones stay, an idle one sleeps and wakes, concurrent requests share
one load, and nothing is unloaded under a running request.

Every wait for the pool is on its own events (``ModelPool.wait_changed``); a request is held
in place by holding the GPU worker's lane (``helpers.gate``: every model's engine shares it).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from helpers import gate, http, metric_samples
from hydra_trio.app import serve
from hydra_trio.serving import ModelEntry, ModelState
from hydra_trio.testing.net import free_port

pytestmark = pytest.mark.slow  # starts engines of several models

MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Five synthetic models told apart by their weights (seeds); c's vocabulary is larger."""
    from hydra_trio.model.synthetic import write_model

    folder = tmp_path_factory.mktemp("many-models")
    return {
        "a": write_model(folder / "a.gguf", "tiny", seed=10, name="Model A"),
        "b": write_model(folder / "b.gguf", "tiny", seed=11, name="Model B"),
        "c": write_model(folder / "c.gguf", "tiny", seed=12, n_vocab=600, name="Model C"),
        "d": write_model(folder / "d.gguf", "tiny", seed=13, name="Model D"),
        "e": write_model(folder / "e.gguf", "tiny", seed=14, name="Model E"),
    }


@asynccontextmanager
async def serve_models(paths: dict[str, Path], **overrides: Any) -> AsyncIterator[Any]:
    """One process serving ``paths`` by name (the first is the RPC model)."""
    from conftest import test_settings  # (imported here: at the top, pytest would collect it)

    named = tuple(f"{name}={path}" for name, path in paths.items())
    settings = replace(test_settings(next(iter(paths.values()))), model=None, named_models=named, **overrides)
    async with trio.open_nursery() as nursery:
        ep = await nursery.start(serve, settings)
        try:
            yield ep
        finally:
            nursery.cancel_scope.cancel()


def three(models: dict[str, Path]) -> dict[str, Path]:
    return {n: models[n] for n in "abc"}


def entry(ep: Any, name: str) -> ModelEntry:
    found = ep.state.models.find(name)
    assert found is not None
    return found


async def until(ep: Any, check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Until ``check()`` holds, looked at on each change of the pool."""
    with trio.fail_after(timeout_s):
        while not check():
            await ep.state.models.wait_changed()


async def complete(h: httpx.AsyncClient, model: str | None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"prompt": "hello world", "max_tokens": 8, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return await h.post("/v1/completions", json=body)


async def completion_text(h: httpx.AsyncClient, model: str, ep: Any = None) -> str:
    """The model's text; with ``ep``, once the exchange has let go of the model too (it holds
    it until after its last byte, which the client may read first)."""
    r = await complete(h, model)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    if ep is not None:
        await until(ep, lambda: entry(ep, model).users == 0)
    return str(r.json()["choices"][0]["text"])


async def states(h: httpx.AsyncClient) -> dict[str, str]:
    r = await h.get("/models")
    assert r.status_code == 200, r.text
    return {m["id"]: m["status"]["value"] for m in r.json()["data"]}


async def test_every_request_is_served_by_the_model_it_names(models: dict[str, Path], run_engine: Any) -> None:
    async with serve_models(three(models), models_max=2) as ep, http(ep) as h:
        assert await states(h) == {"a": "loaded", "b": "unloaded", "c": "unloaded"}
        # b, c, b, a, c with room for two (a, the RPC model, is pinned): b and c evict each other.
        texts: dict[str, str] = {}
        for name in "bcbac":
            text = await completion_text(h, name)
            assert texts.setdefault(name, text) == text, f"{name} answered differently after a reload"
        assert len(set(texts.values())) == 3, texts
        assert entry(ep, "b").loads == 2 and entry(ep, "c").loads == 2 and entry(ep, "a").loads == 1

        # Every dialect routes by ``model``: each model's chat text, and the same text from
        # the Anthropic and Responses codecs (the same prompt, the same greedy reply).
        chat: dict[str, str] = {}
        for name in "abc":
            r = await h.post(
                "/v1/chat/completions", json={"model": name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
            )
            assert r.status_code == 200 and r.json()["model"] == name, r.text
            chat[name] = r.json()["choices"][0]["message"]["content"]
        assert len(set(chat.values())) == 3, chat
        for name in "cab":
            r = await h.post(
                "/v1/messages", json={"model": name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
            )
            assert r.status_code == 200, r.text
            assert r.json()["content"][0]["text"] == chat[name]
            r = await h.post(
                "/v1/responses", json={"model": name, "input": "hello world", "max_output_tokens": 8, "temperature": 0}
            )
            assert r.status_code == 200, r.text
            assert r.json()["output"][0]["content"][0]["text"] == chat[name]
        # The tokenizer routes too: only c's vocabulary holds id 599.
        r = await h.post("/detokenize", json={"model": "c", "tokens": [599]})
        assert r.status_code == 200, r.text
        r = await h.post("/detokenize", json={"model": "a", "tokens": [599]})
        assert r.status_code == 400 and "outside the vocabulary" in r.text
        tokens = [
            (await h.post("/tokenize", json={"model": n, "prompt": "hello world"})).json()["max_model_len"]
            for n in "ab"
        ]
        assert tokens[0] == tokens[1] > 0

        # No ``model``: the default (the RPC model); an unknown one: 404 in each dialect's shape.
        r = await complete(h, None)
        assert r.status_code == 200 and r.json()["model"] == "a"
        for path, body in (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": MESSAGES}),
            ("/v1/responses", {"input": "x"}),
            ("/tokenize", {"prompt": "x"}),
        ):
            r = await h.post(path, json={"model": "nope", **body})
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"] == {
                "message": "The model `nope` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": 404,
            }
        r = await h.post("/v1/messages", json={"model": "nope", "messages": MESSAGES, "max_tokens": 4})
        assert r.status_code == 404 and r.json() == {
            "type": "error",
            "error": {"type": "not_found_error", "message": "The model `nope` does not exist."},
        }
        r = await h.post("/v1/completions", json={"model": 7, "prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        # Every engine runs its llama.cpp calls on the pool's one lane.
        lane = ep.state.models.lane
        assert all(engine._core.worker.lane is lane for _, engine in ep.state.models.loaded())
        assert (await h.get("/health")).json()["status"] == "ok"
        b_text = texts["b"]

    # The pool's b is the model b alone: a process serving only its file says the same.
    async with run_engine(models["b"]) as single, http(single) as h:
        r = await h.post(
            "/v1/completions", json={"prompt": "hello world", "max_tokens": 8, "temperature": 0, "model": "anything"}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == b_text


async def test_pooled_and_infill_routes_are_served_by_the_model_they_name(
    models: dict[str, Path], embed_model: Path, rerank_model: Path, fim_model: Path, run_engine: Any
) -> None:
    """A RAG setup in one process: a chat model (the default), an embedding model, a reranker
    and a code model. /v1/embeddings, /v1/rerank and /infill go to the model their ``model``
    names (they went to the default model whatever it said: a 501 here), an unknown name is
    a 404, and no ``model`` is the default model's answer."""
    named = {"a": models["a"], "emb": embed_model, "rr": rerank_model, "fim": fim_model}
    async with serve_models(named, models_max=4, batch_size=256) as ep, http(ep) as h:
        r = await h.post("/v1/embeddings", json={"model": "emb", "input": ["hello world", "bye"]})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "emb" and len(r.json()["data"]) == 2
        vectors = [d["embedding"] for d in r.json()["data"]]
        r = await h.post("/v1/rerank", json={"model": "rr", "query": "hello", "documents": ["a", "b c"]})
        assert r.status_code == 200, r.text
        assert sorted(x["index"] for x in r.json()["results"]) == [0, 1]
        r = await h.post("/infill", json={"model": "fim", "input_prefix": "a", "input_suffix": "b", "n_predict": 2})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "fim"
        assert [m for m in "emb rr fim".split() if entry(ep, m).loads != 1] == []
        for path, body in (
            ("/v1/embeddings", {"input": "x"}),
            ("/v1/rerank", {"query": "x", "documents": ["y"]}),
            ("/infill", {"input_prefix": "a", "input_suffix": "b"}),
        ):
            r = await h.post(path, json={"model": "nope", **body})
            assert r.status_code == 404 and r.json()["error"]["param"] == "model", (path, r.text)
            r = await h.post(path, json=body)  # the default model: a chat model without them
            assert r.status_code in (400, 501), (path, r.text)
        assert (await h.get("/health")).json()["status"] == "ok"

    # The pool's embedding model is that model alone: a process serving only its file agrees.
    async with run_engine(embed_model) as single, http(single) as h:
        r = await h.post("/v1/embeddings", json={"input": ["hello world", "bye"]})
        assert r.status_code == 200, r.text
        alone = [d["embedding"] for d in r.json()["data"]]
        assert len(alone) == len(vectors)
        assert all(a == pytest.approx(v, abs=1e-5) for a, v in zip(alone, vectors, strict=True))


async def test_agent_sessions_live_in_the_model_that_served_them(
    models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A routed request's session hint makes a turn in its model's engine (its log line names
    the model and the session); POST /finish_session finds it there, in every loaded model
    by default or in the one ``model`` names."""
    headers = {"x-claude-code-session-id": "S", "x-claude-code-agent-id": "sub-1"}
    async with serve_models(three(models), models_max=3) as ep, http(ep) as h:
        with caplog.at_level("INFO", logger="hydra_trio"):
            r = await h.post(
                "/v1/completions", json={"model": "b", "prompt": "hello world", "max_tokens": 2}, headers=headers
            )
        assert r.status_code == 200, r.text
        (line,) = [
            r.request
            for r in caplog.records
            if getattr(r, "request", None) and r.request.get("session_id") == "S:sub-1"
        ]
        assert line["model"] == "b" and line["route"] == "completions"
        assert ep.state.models.find("b").engine.stats().sessions.sessions == 2  # the root and its subagent
        assert ep.state.models.find("a").engine.stats().sessions.sessions == 0
        r = await h.post("/finish_session", params={"session_id": "S:lead", "model": "a"})
        assert r.status_code == 200 and r.json()["found"] is False  # not a's
        r = await h.post("/finish_session", json={"session_id": "S:lead"})
        assert r.status_code == 200 and r.json()["found"] is True and r.json()["sessions"] == 2, r.text
        assert ep.state.models.find("b").engine.stats().sessions.sessions == 0


async def test_lru_eviction_spares_pinned_and_recently_used_models(models: dict[str, Path]) -> None:
    async with serve_models(models, models_max=4, model_pin="b") as ep, http(ep) as h:
        assert await states(h) == {"a": "loaded", "b": "loaded", "c": "unloaded", "d": "unloaded", "e": "unloaded"}
        texts = {n: await completion_text(h, n, ep) for n in "cd"}
        await completion_text(h, "c", ep)  # c is now used more recently than d; b (pinned) least
        await completion_text(h, "e", ep)
        assert await states(h) == {"a": "loaded", "b": "loaded", "c": "loaded", "d": "unloaded", "e": "loaded"}
        assert entry(ep, "d").evictions == 1 and entry(ep, "b").evictions == 0
        assert await completion_text(h, "d", ep) == texts["d"]  # reloaded: c, now the LRU, makes room
        assert await states(h) == {"a": "loaded", "b": "loaded", "c": "unloaded", "d": "loaded", "e": "loaded"}
        for name in "ab":
            r = await h.post("/models/unload", json={"model": name})
            assert r.status_code == 400 and "pinned" in r.json()["error"]["message"], r.text
        samples = metric_samples((await h.get("/metrics")).text)
        assert samples[("hydra_model_loads_total", (("model_name", "d"),))] == 2
        assert samples[("hydra_model_evictions_total", (("model_name", "c"),))] == 1
        assert samples[("hydra_model_state", (("model_name", "c"), ("state", "unloaded")))] == 1
        assert samples[("vllm:generation_tokens_total", (("engine", "0"), ("model_name", "d")))] == 16
        assert ("hydra_slots_total", (("model_name", "e"),)) in samples


async def test_an_idle_model_sleeps_and_wakes(models: dict[str, Path]) -> None:
    async with serve_models(three(models), models_max=2, sleep_idle_seconds=0.3) as ep, http(ep) as h:
        before = await completion_text(h, "b")
        b = entry(ep, "b")
        await until(ep, lambda: b.state is ModelState.SLEEPING and b.transition is None)
        assert b.engine is None and b.sleeps == 1
        assert await states(h) == {"a": "loaded", "b": "sleeping", "c": "unloaded"}  # the RPC model never sleeps
        assert await completion_text(h, "b") == before
        assert b.wakes == 1 and b.loads == 1 and b.last_wake_s is not None

        # A model someone holds (as a request does, to its last byte) does not sleep, however
        # long it is held; let go, it sleeps again.
        pool = ep.state.models
        await until(ep, lambda: b.state is ModelState.SLEEPING and b.transition is None)
        await pool.acquire(b)  # wakes it
        await trio.sleep(1.0)  # over three times --sleep-idle-seconds
        assert b.state is ModelState.LOADED and b.users == 1 and b.sleeps == 2
        pool.release(b)
        await until(ep, lambda: b.state is ModelState.SLEEPING)
        assert b.sleeps == 3 and b.wakes == 2


async def test_concurrent_requests_for_a_loading_model_share_one_load(models: dict[str, Path]) -> None:
    async with serve_models(three(models), models_max=2) as ep, http(ep) as h:
        b = entry(ep, "b")
        replies: list[httpx.Response] = []

        async def ask(path: str, body: dict[str, Any]) -> None:
            replies.append(await h.post(path, json={"model": "b", **body}))

        async with gate(ep) as g, trio.open_nursery() as nursery:  # the load cannot run yet
            for _ in range(3):
                nursery.start_soon(ask, "/v1/completions", {"prompt": "hello world", "max_tokens": 8, "temperature": 0})
            nursery.start_soon(ask, "/v1/messages", {"messages": MESSAGES, "max_tokens": 8, "temperature": 0})
            await until(ep, lambda: b.waiting == 4)
            assert b.state is ModelState.LOADING and b.loads == 0
            assert (await states(h))["b"] == "loading"
            g.open()
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        texts = {r.json()["choices"][0]["text"] for r in replies if "choices" in r.json()}
        assert len(texts) == 1 and b.loads == 1


async def test_a_request_gives_up_on_its_deadline_and_the_load_goes_on(models: dict[str, Path]) -> None:
    async with serve_models(three(models), models_max=2, model_wait_s=0.3) as ep, http(ep) as h:
        c = entry(ep, "c")
        async with gate(ep) as g:
            r = await complete(h, "c")
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
            assert "not ready after 0.3 s" in r.json()["error"]["message"]
            assert c.state is ModelState.LOADING
            g.open()
        await until(ep, lambda: c.state is ModelState.LOADED)  # no request waits for it now
        assert c.loads == 1


async def test_a_model_that_fails_to_load_fails_its_requests_and_is_tried_again(
    models: dict[str, Path], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    async with serve_models({"a": models["a"], "bad": bad}, models_max=2) as ep, http(ep) as h:
        for _ in range(2):  # each request tries again
            r = await complete(h, "bad")
            assert r.status_code == 500 and "model bad failed to load" in r.json()["error"]["message"], r.text
        listed = {m["id"]: m for m in (await h.get("/models")).json()["data"]}
        assert listed["bad"]["status"]["value"] == "unloaded" and listed["bad"]["status"]["failed"] is True
        assert "not a readable GGUF" in listed["bad"]["status"]["error"]
        assert await completion_text(h, "a")  # the others serve on
        assert (await h.post("/models/load", json={"model": "bad"})).status_code == 500


async def test_no_model_is_unloaded_under_a_running_request(models: dict[str, Path]) -> None:
    async with serve_models(three(models), models_max=2) as ep, http(ep) as h:
        await completion_text(h, "b", ep)
        b, c = entry(ep, "b"), entry(ep, "c")
        replies: dict[str, httpx.Response] = {}

        async def ask(name: str) -> None:
            replies[name] = await complete(h, name)

        async with gate(ep) as g, trio.open_nursery() as nursery:
            nursery.start_soon(ask, "b")
            await until(ep, lambda: b.users == 1)
            r = await h.post("/models/unload", json={"model": "b"})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
            assert "serving 1 requests" in r.json()["error"]["message"]
            # c needs b's place (a is pinned): its eviction waits for b's request.
            nursery.start_soon(ask, "c")
            await until(ep, lambda: c.waiting == 1)
            assert b.state is ModelState.LOADED and c.state is ModelState.UNLOADED
            g.open()
        assert replies["b"].status_code == 200 and replies["c"].status_code == 200
        assert b.evictions == 1 and b.state is ModelState.UNLOADED and c.state is ModelState.LOADED

        r = await h.post("/models/unload", json={"model": "c"})
        assert r.status_code == 200 and r.json() == {"success": True}
        assert c.state is ModelState.UNLOADED and c.transition is None  # its memory is free
        r = await h.post("/models/unload", json={"model": "c"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "model is not running"
        r = await h.post("/models/unload", json={"model": "zz"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "model is not found"
        r = await h.post("/models/load", json={"model": "zz"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = await h.post("/models/load", json={"model": "c"})
        assert r.status_code == 200 and c.state is ModelState.LOADED and c.loads == 2
        r = await h.post("/models/load", json={"model": "c"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "model is already running"


def test_sigterm_drains_the_requests_of_every_model(models: dict[str, Path]) -> None:
    """A stream on a model other than the RPC model runs to its end through the drain."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hydra_trio.cli", "serve", "--model", f"a={models['a']}", "--model", f"b={models['b']}",
         "--port", str(port), "--rpc-port", "0", "--slots", "1", "--ctx-size", "2048", "--threads", "1",
         "--shutdown-grace-s", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        body = {"model": "b", "prompt": "once upon a time", "max_tokens": 1500, "stream": True, "temperature": 0}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            proc.send_signal(signal.SIGTERM)
            events += [line for line in lines if line.startswith("data: ")]
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = out.decode()
    assert proc.returncode == 0, text
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    done = text.index("model b slot 0 done")
    assert text.index("received SIGTERM") < done < text.index("stopped"), text


def test_bad_model_flags_stop_the_start_with_one_line(models: dict[str, Path], tmp_path: Path) -> None:
    def start(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "hydra_trio.cli",
                "serve",
                "--port",
                "0",
                "--rpc-port",
                "0",
                "--log-level",
                "WARNING",
                *args,
            ],
            capture_output=True,
            timeout=60,
        )

    a, b = f"a={models['a']}", f"b={models['b']}"
    for args, said in (
        (("--model", a, "--model", f"c={tmp_path / 'none.gguf'}"), "no such file"),
        (("--model", a, "--model", b, "--rpc-model", "x"), "--rpc-model: no model named x"),
        (("--model", a, "--model", b, "--model", f"c={models['c']}", "--model-pin", "b", "--models-max", "2"),
         "--models-max 2 leaves no room"),
        (("--model", a, "--model", str(models["b"])), "give one PATH, or NAME=PATH"),
        (("--model", str(models["a"]), "--model-pin", "a"), "name models of --model NAME=PATH"),
        (("--models-dir", str(tmp_path)), "holds no GGUF model"),
    ):
        done = start(*args)
        lines = done.stderr.decode().strip().splitlines()
        assert done.returncode != 0 and len(lines) == 1 and said in lines[0], (args, done.stderr)
