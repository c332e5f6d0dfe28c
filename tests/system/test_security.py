"""--api-key for HTTP, --rpc-allow for RPC, and the warning for an exposed bind without them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from helpers import ENGINE, http, rpc
from hydra_trio import cli
from hydra_trio.config import is_loopback, settings_from
from hydra_trio.transport import DecodeHttpClient

KEY = "s3cret-key"


def sample(ep: Any, name: str) -> float:
    return ep.state.metrics.registry.get_sample_value(name) or 0.0


# ---- HTTP API key ---------------------------------------------------------------------------


async def test_http_routes_need_the_api_key_but_health(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, api_key=KEY, **ENGINE)
    refused = [
        {},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": "Bearer"},
    ]
    async with http(ep, api_key="") as anonymous:
        assert "authorization" not in anonymous.headers
        assert (await anonymous.get("/health")).status_code == 200  # probes need no key
        for i, headers in enumerate(refused):
            r = await anonymous.get("/v1/models", headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json() == {
                "error": {
                    "code": 401,
                    "message": r.json()["error"]["message"],
                    "type": "authentication_error",
                    "param": None,
                }
            }
            assert r.headers["www-authenticate"] == "Bearer"
            assert sample(ep, "hydra_http_auth_rejected_total") == i + 1
        for method, path in (("GET", "/metrics"), ("GET", "/slots"), ("GET", "/v1/decode/1"),
                             ("DELETE", "/v1/decode/1"), ("PUT", "/slots/0/state"), ("GET", "/no/such/route")):
            r = await anonymous.request(method, path)
            assert r.status_code == 401, (method, path, r.text)
        rejected = sample(ep, "hydra_http_auth_rejected_total")
        assert rejected == len(refused) + 6
    async with http(ep) as keyed:  # the helper sends the engine's key
        assert keyed.headers["authorization"] == f"Bearer {KEY}"
        assert (await keyed.get("/v1/models")).status_code == 200
        r = await keyed.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        assert (await keyed.get("/v1/decode/1")).status_code == 404  # past the check: a real answer
        assert "hydra_http_auth_rejected_total" in (await keyed.get("/metrics")).text
    assert sample(ep, "hydra_http_auth_rejected_total") == rejected


async def test_the_api_key_from_a_file(start_engine: Any, tiny_model: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    ep = await start_engine(tiny_model, api_key_file=str(key_file), **ENGINE)
    async with http(ep, api_key=KEY) as keyed, http(ep, api_key="") as anonymous:
        assert (await keyed.get("/v1/models")).status_code == 200
        assert (await anonymous.get("/v1/models")).status_code == 401


def test_api_key_settings(tmp_path: Path) -> None:
    s = settings_from(env={"HYDRA_API_KEY": KEY})
    assert s.http_api_key() == KEY and KEY not in repr(s)
    assert settings_from(env={}).http_api_key() is None
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}  \nignored\n")
    assert settings_from(env={"HYDRA_API_KEY_FILE": str(key_file)}).http_api_key() == KEY
    with pytest.raises(SystemExit, match="not both"):
        settings_from(env={"HYDRA_API_KEY": KEY, "HYDRA_API_KEY_FILE": str(key_file)})
    with pytest.raises(SystemExit, match="cannot read"):
        settings_from(env={"HYDRA_API_KEY_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match="no key"):
        settings_from(env={"HYDRA_API_KEY_FILE": str(tmp_path / "empty")})
    with pytest.raises(SystemExit, match="api_key must not be empty"):
        settings_from(api_key=" ")


async def test_clients_send_the_key(
    start_engine: Any, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ep = await start_engine(tiny_model, api_key=KEY, **ENGINE)
    url = f"http://127.0.0.1:{ep.http_port}"
    monkeypatch.delenv("HYDRA_API_KEY", raising=False)
    async with DecodeHttpClient(url) as c:
        assert (await c.result(1, wait_s=0)).status_code == 401
    async with DecodeHttpClient(url, api_key=KEY) as c:
        assert (await c.result(1, wait_s=0)).status_code == 404  # no such decode: past the check

    async def run(*argv: str) -> tuple[int, dict[str, Any]]:
        rc = await trio.to_thread.run_sync(cli.main, list(argv))
        return rc, json.loads(capsys.readouterr().out)

    rc, out = await run("result", "1", "--http", url, "--wait", "0")
    assert rc == 1 and out["error"]["type"] == "authentication_error"
    rc, out = await run("result", "1", "--http", url, "--wait", "0", "--api-key", KEY)
    assert rc == 1 and out["error"]["type"] == "not_found_error"
    rc, out = await run("result", "1", "--http", url, "--stream", "--api-key", KEY)
    assert rc == 1 and out["error"]["type"] == "not_found_error"
    rc, out = await run("cancel", "1", "--http", url)
    assert rc == 1 and out["error"]["type"] == "authentication_error"
    monkeypatch.setenv("HYDRA_API_KEY", KEY)
    rc, out = await run("cancel", "1", "--http", url)  # no such decode: past the check
    assert rc == 1 and "authentication_error" not in json.dumps(out), out
    async with DecodeHttpClient(url) as c:
        assert (await c.result(1, wait_s=0)).status_code == 404


# ---- roles: --admin-api-key -------------------------------------------------------------------

ADMIN = "adm1n-key"
# (method, path) of each admin route; a plain key gets 403 on each, the admin key an answer.
ADMIN_ROUTES = [
    ("GET", "/slots"),
    ("GET", "/slots/0/state"),
    ("GET", "/slots/0/state/meta"),
    ("PUT", "/slots/0/state"),
    ("POST", "/slots/0?action=erase"),
    ("GET", "/v1/decode"),
]


async def test_a_plain_key_is_refused_the_admin_routes(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, api_key=KEY, admin_api_key=ADMIN, **ENGINE)
    async with http(ep, api_key=KEY) as plain, http(ep, api_key=ADMIN) as admin, http(ep, api_key="") as anonymous:
        for method, path in ADMIN_ROUTES:
            r = await anonymous.request(method, path)
            assert r.status_code == 401, (method, path, r.text)
            r = await anonymous.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, (method, path, r.text)
            r = await plain.request(method, path, content=b"x" * 100 if method == "PUT" else None)
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["error"]["type"] == "permission_error"
        assert sample(ep, "hydra_http_auth_forbidden_total") == len(ADMIN_ROUTES)
        # The admin key: a real answer on every admin route.
        assert (await admin.get("/slots")).status_code == 200
        assert (await admin.get("/v1/decode")).status_code == 200
        assert (await admin.get("/slots/0/state/meta")).status_code == 200
        got = await admin.get("/slots/0/state")
        assert got.status_code == 200, got.text
        put = await admin.put("/slots/1/state", content=got.content)
        assert put.status_code == 200, put.text
        assert (await admin.post("/slots/1?action=erase")).status_code == 200
        # The plain routes: both keys; nobody without one.
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for client in (plain, admin):
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code == 200
            assert (await client.post("/tokenize", json={"content": "hi"})).status_code == 200
            assert (await client.post("/detokenize", json={"tokens": [1, 2]})).status_code == 200
            assert (await client.get("/v1/decode/1")).status_code == 404  # a result by its id: past the check
            assert (await client.delete("/v1/decode/1")).status_code == 404
            assert (await client.get("/v1/models")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200
        assert (await anonymous.post("/v1/chat/completions", json=body)).status_code == 401
        assert (await anonymous.get("/health")).status_code == 200


async def test_the_api_key_alone_keeps_every_route(start_engine: Any, tiny_model: Path) -> None:
    """Deployments from before roles (--api-key only) keep what they had: that key is admin."""
    ep = await start_engine(tiny_model, api_key=KEY, **ENGINE)
    async with http(ep, api_key=KEY) as keyed:
        assert (await keyed.get("/v1/decode")).status_code == 200
        assert (await keyed.get("/slots/0/state")).status_code == 200
        assert (await keyed.get("/slots")).status_code == 200


async def test_the_admin_key_alone_guards_the_admin_routes_only(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, admin_api_key=ADMIN, **ENGINE)
    async with http(ep, api_key="") as anonymous, http(ep, api_key=ADMIN) as admin:
        r = await anonymous.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        for method, path in ADMIN_ROUTES:
            r = await anonymous.request(method, path)
            assert r.status_code == 401, (method, path, r.text)
        assert (await admin.get("/v1/decode")).status_code == 200
        assert (await admin.get("/slots")).status_code == 200


def test_admin_key_settings(tmp_path: Path) -> None:
    s = settings_from(env={"HYDRA_ADMIN_API_KEY": ADMIN})
    assert s.http_admin_api_key() == ADMIN and ADMIN not in repr(s)
    key_file = tmp_path / "admin"
    key_file.write_text(ADMIN + "\n")
    assert settings_from(env={"HYDRA_ADMIN_API_KEY_FILE": str(key_file)}).http_admin_api_key() == ADMIN
    with pytest.raises(SystemExit, match="not both"):
        settings_from(admin_api_key=ADMIN, admin_api_key_file=str(key_file))
    with pytest.raises(SystemExit, match="must differ"):
        settings_from(api_key=ADMIN, admin_api_key=ADMIN)
    with pytest.raises(SystemExit, match="admin_api_key must not be empty"):
        settings_from(admin_api_key=" ")


def test_the_access_decision() -> None:
    from hydra_trio.http.plumbing import KeyRing, Role, access
    from hydra_trio.http.plumbing import role_of as route_role

    both = KeyRing(KEY, ADMIN)
    assert access(Role.ADMIN, both, f"Bearer {ADMIN}") is None
    assert access(Role.PLAIN, both, f"Bearer {ADMIN}") is None
    assert access(Role.PLAIN, both, f"Bearer {KEY}") is None
    assert access(Role.ADMIN, both, f"Bearer {KEY}") == (403, access(Role.ADMIN, both, f"Bearer {KEY}")[1])  # type: ignore[index]
    assert access(Role.ADMIN, both, "")[0] == 401  # type: ignore[index]
    assert access(Role.PLAIN, both, "Bearer nope")[0] == 401  # type: ignore[index]
    assert access(Role.NONE, both, "") is None
    assert access(Role.ADMIN, KeyRing(KEY, None), f"Bearer {KEY}") is None
    assert access(Role.PLAIN, KeyRing(None, ADMIN), "") is None
    assert access(Role.ADMIN, KeyRing(None, ADMIN), "")[0] == 401  # type: ignore[index]
    assert route_role("/v1/decode", "GET") is Role.ADMIN
    assert route_role("/v1/decode/<raw_id>", "DELETE") is Role.PLAIN
    assert route_role("/slots/<raw_id>/state", "PUT") is Role.ADMIN
    assert route_role("/health", "GET") is Role.NONE
    assert route_role(None, "GET") is Role.PLAIN
    # HEAD is GET's facts: the decode listing's length is the admin's too.
    assert route_role("/v1/decode", "HEAD") is Role.ADMIN
    assert route_role("/slots", "HEAD") is Role.ADMIN
    # A method a rule does not serve (a 405 to come) needs the rule's strictest role.
    assert route_role("/v1/decode", "POST") is Role.ADMIN


# ---- RPC allowlist --------------------------------------------------------------------------


async def test_an_rpc_peer_outside_the_allowlist_is_closed_at_accept(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, rpc_allow="10.0.0.0/8, 192.168.0.0/16", **ENGINE)
    for n in (1, 2):
        async with await trio.open_tcp_stream("127.0.0.1", ep.rpc_port) as stream:
            with trio.fail_after(5):
                assert await stream.receive_some() == b""  # closed without a byte
        assert sample(ep, "hydra_rpc_peers_refused_total") == n
    assert sample(ep, "hydra_rpc_connections") == 0


@pytest.mark.parametrize("allow", ["127.0.0.1", "10.0.0.0/8,127.0.0.0/8", "::1/128, 127.0.0.1/32"])
async def test_an_rpc_peer_in_the_allowlist_is_served(start_engine: Any, tiny_model: Path, allow: str) -> None:
    ep = await start_engine(tiny_model, rpc_allow=allow, **ENGINE)
    async with await rpc(ep) as c:
        assert (await c.info()).meta["engine"] == "hydra-trio"
    assert sample(ep, "hydra_rpc_peers_refused_total") == 0


def test_rpc_allow_settings() -> None:
    nets = settings_from(env={"HYDRA_RPC_ALLOW": "10.1.2.3/8,::1"}).rpc_networks()
    assert nets is not None and [str(n) for n in nets] == ["10.0.0.0/8", "::1/128"]
    assert settings_from(env={}).rpc_networks() is None
    with pytest.raises(SystemExit, match="rpc_allow"):
        settings_from(rpc_allow="10.0.0.0/33")
    with pytest.raises(SystemExit, match="rpc_allow"):
        settings_from(rpc_allow="")


# ---- exposed binds --------------------------------------------------------------------------


def test_is_loopback() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.org"]))


async def test_an_exposed_bind_without_protection_is_warned_about(
    start_engine: Any, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    await start_engine(tiny_model, host="0.0.0.0", **ENGINE)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("HTTP binds 0.0.0.0 without an API key" in w for w in warnings), warnings
    assert any("RPC binds 0.0.0.0 without --rpc-allow" in w for w in warnings), warnings


async def test_a_protected_or_loopback_bind_is_not_warned_about(
    start_engine: Any, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    await start_engine(tiny_model, host="0.0.0.0", api_key=KEY, rpc_allow="127.0.0.1", **ENGINE)
    await start_engine(tiny_model, **ENGINE)  # 127.0.0.1
    assert not [r for r in caplog.records if "binds" in r.getMessage()]


async def test_http_errors_still_answer_behind_the_key(start_engine: Any, tiny_model: Path) -> None:
    """The key check sits in front of routing and error handling, not instead of it."""
    ep = await start_engine(tiny_model, api_key=KEY, **ENGINE)
    async with http(ep) as keyed:
        assert (await keyed.get("/no/such/route")).status_code == 404
        assert (await keyed.get("/slots/x/state/meta")).status_code == 400
        with pytest.raises(httpx.HTTPStatusError):
            (await keyed.get("/v1/decode/x")).raise_for_status()


# ---- agent sessions: a key is a tenant ------------------------------------------------------------


async def test_a_key_cannot_pin_release_or_cancel_another_keys_session(start_engine: Any, tiny_model: Path) -> None:
    """The plain key and the admin key name the same session ids: each names its own. The
    admin's hints, its finish and its cancelled "root" leave the plain key's session, its
    settings and its live subagent alone; a finish of another key's session finds nothing,
    exactly as an id nobody used."""
    ep = await start_engine(tiny_model, api_key=KEY, admin_api_key=ADMIN, **{**ENGINE, "slots": 3})
    sessions = ep.state.engine._core.sessions
    prompt = {"prompt": "the plain tenant's long task " * 8, "max_tokens": 2, "temperature": 0}
    async with http(ep, api_key=KEY) as plain, http(ep, api_key=ADMIN) as admin:
        assert (await plain.post("/v1/completions", json=prompt, headers={"x-session-id": "s"})).status_code == 200
        mine = sessions.get(("plain", None, "s"))
        assert mine is not None
        pin = {
            "vllm_xargs": {"agentic_context": {"program_id": "s", "priority": 1000, "kv_retention_ttl_seconds": 604800}}
        }
        assert (await admin.post("/v1/completions", json={**prompt, **pin})).status_code == 200
        assert (mine.priority, mine.ttl_s) == (0, 300.0)  # not pinned by the other key
        nobody = (await plain.post("/finish_session", params={"session_id": "never-named"})).json()
        for body in ((await admin.post("/finish_session", params={"session_id": "child"})).json(), nobody):
            assert body["found"] is False and body["sessions"] == 0  # another key's, or nobody's: alike
        events: list[dict[str, Any]] = []
        started = trio.Event()

        async def child() -> None:
            body = {**prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
            headers = {"x-session-id": "child", "x-parent-session-id": "s"}
            async with plain.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        started.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
            await started.wait()
            cut = {"vllm_xargs": {"agentic_context": {"program_id": "s", "deadline_seconds": 0}}}
            r = await admin.post("/v1/completions", json={**prompt, **cut})
            assert r.json()["receipt"]["cut"] == "deadline"  # the admin's own "s": cut, its tree with it
            done = (await admin.post("/finish_session", params={"session_id": "s"})).json()
            assert done["found"] and done["cancelled_requests"] == 0
        assert events[-1]["choices"][0]["finish_reason"] == "length" and "receipt" not in events[-1]
        assert sessions.get(("plain", None, "s")) is mine and not mine.released
