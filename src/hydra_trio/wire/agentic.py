"""Which agent session a request belongs to, as agents and routers say it (docs/operations.md,
"Agent sessions"): the one reading of every spelling, into one ``SessionHint``.

In order of precedence (the first that names a session wins, as vllm-router's program
identity reads them, src/program_scheduling/identity.rs):

1. ``vllm_xargs.agentic_context`` (body; an object or its JSON text): ``program_id``, or
   ``task_id``/``session_id`` with ``agent_id`` (``"lead"`` by default) as ``TASK:AGENT``;
   the parent as ``parent_program_id``, or ``parent_agent_id`` as ``TASK:PARENT``, or
   ``TASK:lead`` for any other agent; ``priority``, ``deadline_seconds``,
   ``kv_retention_ttl_seconds``, ``expected_resume``, ``blocks_parent``.
2. Claude Code's ``x-claude-code-session-id`` / ``-agent-id`` / ``-parent-agent-id``
   headers, read the same way (``SESSION:AGENT``, parent ``SESSION:PARENT`` or
   ``SESSION:lead``).
3. Codex's ``session_id`` header (``session-id`` too), with ``thread-id`` as its agent.
4. ``X-Session-Id`` (vLLM's and vllm-router's generic header), with our own
   ``X-Parent-Session-Id`` naming its parent.
5. ``prompt_cache_key`` (body; OpenAI's, which Codex sets to its conversation).

The agentic context's hints (priority, deadline, retention) apply whichever names the
session. A malformed recognized field is refused (400 naming it), never guessed at.
Pure: no engine, no I/O.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import bad_param

MAX_ID_CHARS = 256  # vllm-router's bound on an identity component
MAX_CONTEXT_CHARS = 16 * 1024  # an agentic_context given as JSON text
MAX_SECONDS = 7 * 86400.0  # a deadline or a retention TTL
MAX_PRIORITY = 1 << 31
LEAD = "lead"
# Ids are names: printable, no control characters (they reach log lines and KV events).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


@dataclass(frozen=True, slots=True)
class SessionHint:
    """What a request says of its session. ``session_id`` is the client's name for it; the
    engine scopes it by the caller's tenant and cache_salt (engine/sched/session_tree.py)."""

    session_id: str
    parent_id: str | None = None
    priority: int = 0  # higher is kept longer
    deadline_s: float | None = None  # the request's cancel-scope deadline, from its arrival
    ttl_s: float | None = None  # KV retention after the turn (None: --session-ttl-s)
    expected_resume: bool | None = None  # False: this turn is the session's last
    blocks_parent: bool = False  # a subagent its parent waits on
    source: str = "x-session-id"  # where it was read (logs, tests)


Header = Callable[[str], str | None]


def session_hint(header: Header, body: Mapping[str, Any]) -> SessionHint | None:
    """The request's session, or None when it names none. ``header``: a case-insensitive
    header lookup (None: absent)."""
    context = _agentic_context(body)
    hints = _context_hints(context) if context is not None else {}
    named = _from_context(context, header) if context is not None else None
    if named is None:
        named = _from_headers(header)
    if named is None:
        key = body.get("prompt_cache_key")
        if key is not None:
            named = (checked_id(key, "prompt_cache_key"), None, False, "prompt_cache_key")
    if named is None:
        return None
    session_id, parent_id, blocks_parent, source = named
    if parent_id == session_id:
        raise bad_param("a session cannot be its own parent", "vllm_xargs.agentic_context")
    return SessionHint(
        session_id,
        parent_id,
        priority=hints.get("priority", 0),
        deadline_s=hints.get("deadline_s"),
        ttl_s=hints.get("ttl_s"),
        expected_resume=hints.get("expected_resume"),
        blocks_parent=hints.get("blocks_parent", blocks_parent),
        source=source,
    )


def _agentic_context(body: Mapping[str, Any]) -> dict[str, Any] | None:
    xargs = body.get("vllm_xargs")
    if xargs is None:
        return None
    if not isinstance(xargs, dict):
        raise bad_param("vllm_xargs must be an object", "vllm_xargs")
    raw = xargs.get("agentic_context")
    if raw is None:
        return None
    if isinstance(raw, str):
        if len(raw) > MAX_CONTEXT_CHARS:
            raise bad_param(f"vllm_xargs.agentic_context is over {MAX_CONTEXT_CHARS} "
                            "characters", "vllm_xargs.agentic_context")
        try:
            raw = json.loads(raw)
        except ValueError:
            raise bad_param("vllm_xargs.agentic_context must be a JSON object", "vllm_xargs.agentic_context") from None
    if not isinstance(raw, dict):
        raise bad_param("vllm_xargs.agentic_context must be an object", "vllm_xargs.agentic_context")
    return raw


def _where(key: str) -> str:
    return f"vllm_xargs.agentic_context.{key}"


def checked_id(value: Any, where: str) -> str:
    """A session id as given (an integer reads as its digits), trimmed; 400 naming ``where``
    unless it is 1..MAX_ID_CHARS printable characters."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise bad_param(f"{where} must be a string", where)
    value = value.strip()
    if not value or len(value) > MAX_ID_CHARS or _CONTROL.search(value):
        raise bad_param(f"{where} must be 1..{MAX_ID_CHARS} printable characters", where)
    return value


def _context_id(context: Mapping[str, Any], *keys: str) -> str | None:
    for key in keys:
        if context.get(key) is not None:
            return checked_id(context[key], _where(key))
    return None


def _seconds(context: Mapping[str, Any], *keys: str) -> float | None:
    for key in keys:
        value = context.get(key)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or not 0 <= value <= MAX_SECONDS
        ):
            raise bad_param(f"{_where(key)} must be seconds, 0..{MAX_SECONDS:g}", _where(key))
        return float(value)
    return None


def _flag(context: Mapping[str, Any], key: str) -> bool | None:
    value = context.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_param(f"{_where(key)} must be a boolean", _where(key))
    return value


def _context_hints(context: Mapping[str, Any]) -> dict[str, Any]:
    hints: dict[str, Any] = {}
    priority = context.get("priority")
    if priority is not None:
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
            raise bad_param(f"{_where('priority')} must be an integer, |p| <= 2^31", _where("priority"))
        hints["priority"] = priority
    if (deadline := _seconds(context, "deadline_seconds", "deadline")) is not None:
        hints["deadline_s"] = deadline
    if (ttl := _seconds(context, "kv_retention_ttl_seconds", "kv_retention_ttl")) is not None:
        hints["ttl_s"] = ttl
    if (resume := _flag(context, "expected_resume")) is not None:
        hints["expected_resume"] = resume
    if (blocks := _flag(context, "blocks_parent")) is not None:
        hints["blocks_parent"] = blocks
    return hints


def _scoped(task: str, agent: str) -> str:
    return agent if agent.startswith(task + ":") else f"{task}:{agent}"


def _from_context(context: Mapping[str, Any], header: Header) -> tuple[str, str | None, bool, str] | None:
    claude_session, claude_agent, claude_parent = _claude(header)
    program = _context_id(context, "program_id")
    task = _context_id(context, "task_id", "session_id") or claude_session
    agent = _context_id(context, "agent_id") or claude_agent or (LEAD if task is not None else None)
    if program is None and task is not None and agent is not None:
        program = _scoped(task, agent)
    if program is None:
        return None
    parent = _context_id(context, "parent_program_id", "parent_id")
    parent_agent = _context_id(context, "parent_agent_id") or claude_parent
    subagent = agent is not None and agent != LEAD
    if parent is None and task is not None:
        if parent_agent is not None:
            parent = _scoped(task, parent_agent)
        elif subagent:
            parent = _scoped(task, LEAD)
    return program, parent, subagent and parent is not None, "agentic_context"


def _header_id(header: Header, name: str) -> str | None:
    value = header(name)
    if value is None or not value.strip():
        return None
    return checked_id(value, name)


def _claude(header: Header) -> tuple[str | None, str | None, str | None]:
    return (
        _header_id(header, "x-claude-code-session-id"),
        _header_id(header, "x-claude-code-agent-id"),
        _header_id(header, "x-claude-code-parent-agent-id"),
    )


def _from_headers(header: Header) -> tuple[str, str | None, bool, str] | None:
    session, agent, parent_agent = _claude(header)
    source = "claude-code"
    if session is None:
        session = _header_id(header, "session_id") or _header_id(header, "session-id")
        agent, parent_agent, source = _header_id(header, "thread-id"), None, "codex"
    if session is not None:
        agent = agent or LEAD
        subagent = agent != LEAD
        parent = _scoped(session, parent_agent) if parent_agent else _scoped(session, LEAD) if subagent else None
        return _scoped(session, agent), parent, subagent, source
    session = _header_id(header, "x-session-id")
    if session is None:
        return None
    parent = _header_id(header, "x-parent-session-id")
    return session, parent, parent is not None, "x-session-id"
