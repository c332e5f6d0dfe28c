"""Which agent session a request names (wire/agentic.py): every spelling agents and routers
use, in vllm-router's precedence, and a malformed one refused naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hydra_trio.wire.agentic import SessionHint, session_hint
from hydra_trio.wire.errors import ParamError


def _hint(headers: dict[str, str] | None = None, **body: Any) -> SessionHint | None:
    lower = {k.lower(): v for k, v in (headers or {}).items()}
    return session_hint(lambda name: lower.get(name.lower()), body)


def test_no_hint_is_a_one_off_request() -> None:
    assert _hint() is None
    assert _hint({"x-request-id": "r1"}, user="u") is None  # request ids never name sessions


def test_claude_code_headers_make_a_tree() -> None:
    lead = _hint({"x-claude-code-session-id": "S"})
    assert lead == SessionHint("S:lead", None, source="claude-code")
    sub = _hint({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "explore-1"})
    assert sub is not None and (sub.session_id, sub.parent_id, sub.blocks_parent) == ("S:explore-1", "S:lead", True)
    nested = _hint({
        "X-Claude-Code-Session-Id": "S", "X-Claude-Code-Agent-Id": "a2", "X-Claude-Code-Parent-Agent-Id": "explore-1",
    })
    assert nested is not None and (nested.session_id, nested.parent_id) == ("S:a2", "S:explore-1")


def test_codex_header_and_prompt_cache_key() -> None:
    for name in ("session_id", "session-id"):
        hint = _hint({name: "conv-9"}, prompt_cache_key="other")
        assert hint is not None and (hint.session_id, hint.source) == ("conv-9:lead", "codex")
    hint = _hint(prompt_cache_key="conv-9")
    assert hint is not None and (hint.session_id, hint.parent_id, hint.source) == ("conv-9", None, "prompt_cache_key")


def test_our_header_names_a_parent() -> None:
    hint = _hint({"X-Session-Id": "child", "X-Parent-Session-Id": "root"})
    assert hint is not None and (hint.session_id, hint.parent_id, hint.blocks_parent) == ("child", "root", True)


def test_the_agentic_context_wins_and_carries_the_hints() -> None:
    context = {
        "task_id": "T", "agent_id": "researcher", "priority": 3, "deadline_seconds": 2.5,
        "kv_retention_ttl_seconds": 60, "expected_resume": False,
    }
    for given in (context, json.dumps(context)):  # an object, or its JSON text
        hint = _hint({"x-claude-code-session-id": "S", "x-session-id": "X"}, vllm_xargs={"agentic_context": given})
        assert hint == SessionHint(
            "T:researcher", "T:lead", priority=3, deadline_s=2.5, ttl_s=60.0, expected_resume=False,
            blocks_parent=True, source="agentic_context",
        )
    explicit = _hint(vllm_xargs={"agentic_context": {"program_id": "p1", "parent_program_id": "p0"}})
    assert explicit is not None and (explicit.session_id, explicit.parent_id) == ("p1", "p0")
    # A context with hints but no identity: the headers name the session, the hints apply.
    hint = _hint({"x-session-id": "X"}, vllm_xargs={"agentic_context": {"priority": -1}})
    assert hint is not None and (hint.session_id, hint.priority) == ("X", -1)


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({}, {"vllm_xargs": []}, "vllm_xargs"),
        ({}, {"vllm_xargs": {"agentic_context": "not json"}}, "vllm_xargs.agentic_context"),
        ({}, {"vllm_xargs": {"agentic_context": "x" * 20000}}, "vllm_xargs.agentic_context"),
        ({}, {"vllm_xargs": {"agentic_context": {"program_id": ["a"]}}}, "vllm_xargs.agentic_context.program_id"),
        ({}, {"vllm_xargs": {"agentic_context": {"program_id": "a", "priority": 1.5}}},
         "vllm_xargs.agentic_context.priority"),
        ({}, {"vllm_xargs": {"agentic_context": {"program_id": "a", "deadline_seconds": -1}}},
         "vllm_xargs.agentic_context.deadline_seconds"),
        ({}, {"vllm_xargs": {"agentic_context": {"program_id": "a", "kv_retention_ttl_seconds": float("nan")}}},
         "vllm_xargs.agentic_context.kv_retention_ttl_seconds"),
        ({}, {"vllm_xargs": {"agentic_context": {"program_id": "a", "expected_resume": "yes"}}},
         "vllm_xargs.agentic_context.expected_resume"),
        ({}, {"vllm_xargs": {"agentic_context": {"program_id": "a", "parent_program_id": "a"}}},
         "vllm_xargs.agentic_context"),
        ({}, {"prompt_cache_key": ""}, "prompt_cache_key"),
        ({}, {"prompt_cache_key": "k" * 257}, "prompt_cache_key"),
        ({}, {"prompt_cache_key": "a\nb"}, "prompt_cache_key"),
        ({"x-session-id": "a\x1bb"}, {}, "x-session-id"),
    ],
)
def test_a_malformed_hint_is_refused_naming_it(headers: dict[str, str], body: dict[str, Any], param: str) -> None:
    with pytest.raises(ParamError) as err:
        _hint(headers, **body)
    assert err.value.param == param
