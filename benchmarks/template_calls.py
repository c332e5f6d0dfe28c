"""What `python -m benchmarks.templates` measures beyond render parity (issue 41), per
template: forced tool calls through a server's ``/v1/chat/completions`` on the random-weight
synthetic model, the reasoning split of a reply in the template's own syntax, and the time
``/apply-template`` takes, for the corpus's four conversations and a 20-turn agent
conversation with 20 tools. The HTTP parts run the same requests against hydra-trio and
llama-server, each on its own port, so the two are measured side by side."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import httpx
import jsonschema
import trio

from hydra_trio.engine.chat import Chat, ChatPlan
from hydra_trio.testing.sse_reader import sse_chunk

# Bounded strings and numbers: a random-weight model under a grammar writes until the
# grammar lets it stop, so an unbounded string is a loop to max_tokens (a property of the
# model, not of the call syntax); the bounds keep each call within FORCED_MAX_TOKENS.
FORCED_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 12},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the documentation",
        "parameters": {"type": "object",
                       "properties": {"query": {"type": "string", "maxLength": 16},
                                      "exact": {"type": "boolean"}},
                       "required": ["query", "exact"]}}},
]
FORCED_MAX_TOKENS = 512
# Where the prompt opens a think block (or the template thinks and the engine opens it), the
# call's grammar is held until the block closes (engine/llama/thinking.py): a random-weight
# model never writes the close tag, so a thinking budget writes it, then the call follows.
FORCED_THINK_BUDGET = 24
FORCED: dict[str, dict[str, Any]] = {
    # greedy, any tool
    "required": {"tool_choice": "required", "temperature": 0},
    # sampled (seeded), the second tool by name
    "named": {"tool_choice": {"type": "function", "function": {"name": "search_docs"}},
              "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 7},
    # sampled (another seed), any tool, streamed: the calls as the deltas build them
    "streamed": {"tool_choice": "required", "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 11,
                 "stream": True},
}


def forced_body(case: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": FORCED_TOOLS, "max_tokens": FORCED_MAX_TOKENS, "parallel_tool_calls": False,
            "reasoning_budget_tokens": FORCED_THINK_BUDGET, **FORCED[case]}


def check_forced(case: str, status: int, body: Any) -> tuple[bool, str]:
    """Whether a forced call's reply is one parsed call of the right tool whose arguments
    validate against its parameters; the reason when not."""
    if status != 200:
        return False, f"{status} {str(body)[:160]}"
    choice = body["choices"][0]
    msg = choice.get("message") or {}
    calls = msg.get("tool_calls") or []
    if not calls:
        return False, f"no tool_calls ({choice.get('finish_reason')}): content {str(msg.get('content'))[:120]!r}"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
    for call in calls:
        fn = call.get("function") or {}
        name = fn.get("name")
        if case == "named" and name != "search_docs":
            return False, f"called {name!r}, not the named search_docs"
        if name not in schemas:
            return False, f"undeclared tool {name!r}"
        try:
            args = json.loads(fn.get("arguments") or "")
            jsonschema.validate(args, schemas[name])
        except (ValueError, jsonschema.ValidationError) as exc:
            return False, f"arguments {str(fn.get('arguments'))[:80]!r}: {str(exc).splitlines()[0][:80]}"
    return True, ""


def _streamed(client: httpx.Client, body: dict[str, Any]) -> tuple[int, Any]:
    """A streamed chat completion as the one reply its deltas add up to (content, reasoning,
    each call's name and arguments by its index), in the unstreamed shape."""
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode("utf-8", "replace")
        content, reasoning, finish = [], [], None
        calls: dict[int, dict[str, Any]] = {}
        for line in r.iter_lines():
            if (chunk := sse_chunk(line)) is None:
                continue
            if "error" in chunk:
                return 500, chunk
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning_content") or "")
                finish = choice.get("finish_reason") or finish
                for tc in delta.get("tool_calls") or []:
                    call = calls.setdefault(tc.get("index", 0), {"function": {"name": "", "arguments": ""}})
                    fn = tc.get("function") or {}
                    call["function"]["name"] += fn.get("name") or ""
                    call["function"]["arguments"] += fn.get("arguments") or ""
    msg = {"content": "".join(content), "reasoning_content": "".join(reasoning),
           "tool_calls": [calls[k] for k in sorted(calls)]}
    return 200, {"choices": [{"message": msg, "finish_reason": finish}]}


def forced_calls(client: httpx.Client) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for case in FORCED:
        t0 = time.perf_counter()
        try:
            body_in = forced_body(case)
            if body_in.get("stream"):
                status, body = _streamed(client, body_in)
            else:
                r = client.post("/v1/chat/completions", json=body_in)
                status, body = (
                    r.status_code,
                    (r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text),
                )
        except (httpx.HTTPError, ValueError) as exc:
            status, body = 0, f"{type(exc).__name__}: {exc}"
        ok, why = check_forced(case, status, body)
        out[case] = {"ok": ok, "why": why, "s": round(time.perf_counter() - t0, 2)}
        if not ok:
            reply = body if isinstance(body, str) else body.get("choices", [{}])[0].get("message", body)
            out[case]["reply"] = json.dumps(reply, ensure_ascii=False)[:400]  # its start: what it wrote
    return out


def agent_conversation(turns: int = 20, n_tools: int = 20) -> dict[str, Any]:
    """A 20-turn agent conversation with 20 tools: every other turn calls a tool (9-character
    call ids, which Mistral's templates require), gets its result and answers."""
    tools = [{"type": "function", "function": {
        "name": f"tool_{i:02d}", "description": f"Tool number {i}: reads or changes file state",
        "parameters": {"type": "object",
                       "properties": {"path": {"type": "string", "description": "A file path"},
                                      "count": {"type": "integer", "description": "How many"},
                                      "recursive": {"type": "boolean"},
                                      "mode": {"type": "string", "enum": ["read", "write", "append"]}},
                       "required": ["path"]}}} for i in range(n_tools)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. Use the tools."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Step {t}: look at src/module_{t}.py and report."})
        if t % 2 == 0:
            cid = f"c{t:08d}"
            args = {"path": f"src/module_{t}.py", "count": t, "recursive": False, "mode": "read"}
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": cid,
                            "type": "function",
                            "function": {"name": f"tool_{t % n_tools:02d}", "arguments": json.dumps(args)},
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": cid, "content": json.dumps({"lines": 40 + t, "ok": True})})
        messages.append({"role": "assistant", "content": f"Module {t} has {40 + t} lines and looks fine."})
    messages.append({"role": "user", "content": "Summarise what you found."})
    return {"messages": messages, "tools": tools}


AGENT = agent_conversation()


def apply_template_ms(client: httpx.Client, body: dict[str, Any], repeats: int) -> dict[str, Any]:
    """The median round trip of ``/apply-template`` (after one unmeasured call), or the error."""
    r = client.post("/apply-template", json=body)
    if r.status_code != 200:
        return {"error": f"{r.status_code} {r.text[:120]}"}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        client.post("/apply-template", json=body)
        times.append((time.perf_counter() - t0) * 1000)
    return {"ms": round(statistics.median(times), 2), "chars": len(r.json()["prompt"])}


def render_times(client: httpx.Client, conversations: dict[str, dict[str, Any]], repeats: int) -> dict[str, Any]:
    out = {name: apply_template_ms(client, body, repeats) for name, body in conversations.items()}
    out["agent20"] = apply_template_ms(client, AGENT, repeats)
    return out


def server_session(url: str, conversations: dict[str, dict[str, Any]], *, calls: bool, repeats: int) -> dict[str, Any]:
    """Everything asked of one server over HTTP: forced calls and render times."""
    with httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        out: dict[str, Any] = {"times": render_times(client, conversations, repeats)}
        if calls:
            out["forced"] = forced_calls(client)
    return out


async def _in_process_ms(chat: Chat, body: dict[str, Any], repeats: int) -> float | None:
    try:
        await chat.render(json.loads(json.dumps(body)))
    except Exception:
        return None
    times = []
    for _ in range(repeats):
        b = json.loads(json.dumps(body))
        t0 = time.perf_counter()
        await chat.render(b)
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)


def in_process_times(chat: Chat, conversations: dict[str, dict[str, Any]], repeats: int) -> dict[str, float | None]:
    """Our render alone (``Chat.render``, no HTTP), per conversation and for the agent one."""
    out = {name: trio.run(_in_process_ms, chat, body, repeats) for name, body in conversations.items()}
    out["agent20"] = trio.run(_in_process_ms, chat, AGENT, repeats)
    return out


REASONING, ANSWER = "Two plus two is four.", "4"


def reasoning_split(chat: Chat, renders_reasoning: bool) -> dict[str, Any]:
    """A reply with reasoning in the template's own syntax (its think tags, or gpt-oss's
    analysis channel, Muse Glimmer's ``to=self`` message), after the prompt the template renders with
    ``enable_thinking``: is it split into reasoning_content and content, whole and streamed a character at a time?
    ``renders_reasoning``: llama-server's render of an earlier turn shows its reasoning (the
    template thinks even if we did not see it)."""
    caps = chat.caps
    if not caps.thinks:
        return {"result": "miss" if renders_reasoning else "-",
                "why": "the template renders reasoning but no think syntax was detected" if renders_reasoning else ""}
    request = {
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "chat_template_kwargs": {"enable_thinking": True},
    }
    try:
        plan = trio.run(_plan, chat, json.loads(json.dumps(request)))
    except Exception as exc:
        return {"result": "ERR", "why": f"render: {exc}"}
    prompt = plan.prompt or ""
    want = REASONING
    if caps.tool_format.name == "harmony":
        reply = f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
    elif caps.tool_format.name == "muse_glimmer":  # the prompt ends with <|start|>assistant
        reply = f" to=self<|message|>{REASONING}<|eom|><|start|>assistant to=user<|message|>{ANSWER}<|eot|>"
    else:
        open_, close = caps.think_tags
        opened = prompt.rstrip().endswith(open_)
        reply = ("" if opened else open_ + "\n") + REASONING + "\n" + close + "\n\n" + ANSWER
        if opened and caps.think_lead:  # Apriel 1.6: the prompt's opening words are the reasoning's (as llama.cpp)
            want = prompt[prompt.rfind(open_):] + REASONING
    factory = plan.replies
    if factory is None:
        return {"result": "FAIL", "why": "no reasoning parser for this template", "reply": reply}
    got = {}
    for how, pieces in (("whole", [reply]), ("streamed", list(reply))):
        parser = factory()
        reasoning, content = "", ""
        for piece in pieces:
            d = parser.feed(piece)
            reasoning, content = reasoning + d.reasoning, content + d.content
        d = parser.finish()
        got[how] = (reasoning + d.reasoning, content + d.content)
    ok = all(v == (want, ANSWER) for v in got.values())
    return {"result": "ok" if ok else "FAIL", "why": "" if ok else f"got {got}", "reply": reply}


async def _plan(chat: Chat, request: dict[str, Any]) -> ChatPlan:
    """The request's chat plan, as the engine makes it (its grammar written on this thread)."""
    from hydra_trio.engine.params import parse_generation

    params = parse_generation(request, default_n_predict=16, n_ctx=4096)

    async def here(fn: Any) -> Any:
        return fn()

    return await chat.plan(
        request, tools=params.tools, constraint=params.constraint, budget=params.reasoning_budget, off_loop=here
    )
