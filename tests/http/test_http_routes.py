"""http/plumbing/routes.py is the one table of route facts: it names every route the app serves (each
rule and method, and nothing the app does not serve), and the auth, body-cap, drain and
upload-gate decisions all read it."""

from __future__ import annotations

from typing import Any

from hydra_trio.http.plumbing import routes
from hydra_trio.http.server import body_cap, create_app


class _State:
    """What create_app reads of the app state before any request."""

    class settings:
        max_kv_bytes = 1000
        max_json_bytes = 100
        drain_limit_bytes = 10
        idle_timeout_s = 1.0

        @staticmethod
        def http_api_key() -> None:
            return None

        @staticmethod
        def http_admin_api_key() -> None:
            return None

        host = "127.0.0.1"


def _served(app: Any) -> set[tuple[str, str]]:
    out = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        out.update((rule.rule, m) for m in rule.methods if m not in ("HEAD", "OPTIONS"))
    return out


def test_the_table_names_every_route_the_app_serves_and_only_those() -> None:
    app = create_app(_State())  # type: ignore[arg-type]
    table = {(r.rule, r.method) for r in routes.ROUTES}
    assert _served(app) == table


def test_every_decision_reads_the_table() -> None:
    state: Any = _State()
    assert body_cap("PUT", "/slots/3/state", state) == 1000  # a KV blob
    assert body_cap("POST", "/v1/chat/completions", state) == 100  # JSON
    assert body_cap("POST", "/slots/3", state) == routes.SMALL_BODY_BYTES  # erase takes llama-server's {}
    assert body_cap("GET", "/v1/decode/7", state) == 0
    assert body_cap("HEAD", "/v1/decode", state) == 0
    found = routes.by_path("POST", "/v1/completions")
    assert found is not None and found.new_work
    assert {r.rule for r in routes.ROUTES if r.new_work} == {
        "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/models/load", "/infill",
        "/v1/embeddings", "/embeddings", "/v1/rerank", "/rerank", "/v1/reranking", "/reranking",
    }
    assert routes.by_path("PUT", "/slots/1/state/meta") is None
