"""Record the compatibility corpus: run today's clients against the recorder and store what they
send (tests/corpus/README.md). Run by record.sh, which installs the clients' latest versions;
by hand: ``python record.py --npm-prefix DIR [--only NAME ...]`` from an environment holding the
Python clients (openai, anthropic, pydantic, openai-agents, pydantic-ai, langchain).

Each recorder gives a client a conversation it can finish: a call of one of its tools on the
first turn, then (after the tool result) the typed answer it asks for, or text. What a client
could not do is written into the capture's ``note`` and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import enum
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Optional

from recorder import Captured, Plan, Recorder, dialect
from store import Store, scrub

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent
USER = "What is the weather in Paris for the next 3 days?"


def pyversions(*names: str) -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


class Session:
    """One client's recording: its scenarios, each a list of captured requests."""

    def __init__(self, rec: Recorder, store: Store, client: str, versions: dict[str, str], work: Path) -> None:
        self.rec, self.store, self.client, self.versions, self.work = rec, store, client, versions, work
        self.written: list[str] = []

    def run(self, scenario: str, plan: Plan, action: Callable[[], Any], note: str | None = None) -> None:
        self.rec.take()
        self.rec.scenario(scenario, plan)
        error = None
        try:
            result = action()
            if asyncio.iscoroutine(result):
                asyncio.run(result)
        except Exception as exc:  # the client's own failure is part of what is recorded
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc(limit=2)
        self.save(scenario, self.rec.take(), note if error is None else f"{note + '; ' if note else ''}client "
                  f"raised {error}")

    def save(self, scenario: str, captured: list[Captured], note: str | None = None) -> None:
        requests = [self._request(i, c) for i, c in enumerate(c for c in captured if c.body is not None)]
        if not requests:  # kept, with its note: the index says what could not be recorded and why
            print(f"  {self.client}/{scenario}: nothing sent ({note})")
        doc: dict[str, Any] = {"client": self.client, "versions": self.versions, "scenario": scenario}
        if note:
            doc["note"] = note
        doc["requests"] = requests
        # Claude Code also names the project's folder with every other character a dash.
        paths = {str(self.work): "/work/project", re.sub(r"[^A-Za-z0-9]", "-", str(self.work)): "-work-project"}
        self.store.write_capture(self.client, scenario, scrub(doc, paths))
        self.written.append(scenario)
        print(f"  {self.client}/{scenario}: {len(requests)} requests {[r['recorder_reply'] for r in requests]}")

    @staticmethod
    def _request(turn: int, c: Captured) -> dict[str, Any]:
        body = c.body
        if isinstance(body, dict) and isinstance(body.get("metadata"), dict) and "user_id" in body["metadata"]:
            body = {**body, "metadata": {**body["metadata"], "user_id": "redacted"}}
        return {"turn": turn, "method": c.method, "path": c.path, "dialect": dialect(c.path.split("?")[0]),
                "headers": c.headers, "recorder_reply": c.reply, "body": body}


# -- Claude Code ---------------------------------------------------------------------------------


def record_claude_code(rec: Recorder, store: Store, work: Path, npm: Path) -> None:
    exe = npm / "node_modules" / ".bin" / "claude"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout.split()[0]
    project = work / "cc-project"
    project.mkdir(exist_ok=True)
    (project / "notes.txt").write_text("The meeting moved to Thursday.\n")
    home = work / "cc-home"
    (home / ".claude").mkdir(parents=True, exist_ok=True)
    session = Session(rec, store, "claude-code", {"claude-code": version}, work)
    read = {"Read": {"file_path": str(project / "notes.txt")}}

    def claude(*args: str, **env: str) -> Callable[[], None]:
        def run() -> None:
            base = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_", "ENABLE_"))}
            base.update(
                ANTHROPIC_BASE_URL=rec.url,
                ANTHROPIC_API_KEY="dummy",
                HOME=str(home),
                CLAUDE_CONFIG_DIR=str(home / ".claude"),
                # No traffic but the conversation: no telemetry, update checks or error reports.
                CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                DISABLE_TELEMETRY="1",
                DISABLE_ERROR_REPORTING="1",
                DISABLE_AUTOUPDATER="1",
                **env,
            )
            p = subprocess.run([str(exe), "-p", *args], cwd=project, env=base, capture_output=True, text=True,
                               timeout=300, stdin=subprocess.DEVNULL)
            if p.returncode:
                raise RuntimeError(f"claude exited {p.returncode}: {p.stderr[-300:]}")
        return run

    ask = "Read notes.txt and tell me what it says."
    session.run("tool-search-off", Plan(prefer=["Read"], args=read), claude(ask, ENABLE_TOOL_SEARCH="false"),
                note="ENABLE_TOOL_SEARCH=false: all 21 tools on every turn")
    session.run(
        "tool-search-on",
        Plan(prefer=["ToolSearch"], args={"ToolSearch": {"query": "select:SendMessage,WebFetch"}}),
        claude(ask, ENABLE_TOOL_SEARCH="true"),
        note="ENABLE_TOOL_SEARCH=true: 12 tools with a deferred placeholder; turn 1 loads SendMessage and WebFetch",
    )
    session.run("default-custom-base-url", Plan(prefer=["Read"], args=read), claude(ask),
                note="ENABLE_TOOL_SEARCH unset, as a user of a custom ANTHROPIC_BASE_URL has it")
    session.run("model-local", Plan(prefer=["Read"], args=read),
                claude(ask, ANTHROPIC_MODEL="local", ANTHROPIC_SMALL_FAST_MODEL="local"),
                note="ANTHROPIC_MODEL=local, as examples/agents.md sets it")
    agent = {"description": "Read the notes", "prompt": "Read notes.txt and report its first line.",
             "subagent_type": "general-purpose", "run_in_background": False}
    session.run("subagent", Plan(prefer=["Agent", "Read"], args={"Agent": agent, **read}, once=["Agent"]),
                claude(ask, ENABLE_TOOL_SEARCH="false"),
                note="turn 1 starts a general-purpose subagent; its own requests follow")
    schema = {
        "type": "object",
        "properties": {"summary": {"type": "string"}, "lines": {"type": "integer", "minimum": 0}},
        "required": ["summary", "lines"],
        "additionalProperties": False,
    }
    session.run("json-schema", Plan(prefer=["Read"], args=read, final_tools=["StructuredOutput"]),
                claude("--json-schema", json.dumps(schema), ask, ENABLE_TOOL_SEARCH="false"),
                note="--json-schema: a typed final answer beside the tools")


# -- Codex ---------------------------------------------------------------------------------------


def record_codex(rec: Recorder, store: Store, work: Path, npm: Path) -> None:
    exe = npm / "node_modules" / ".bin" / "codex"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout.split()[-1]
    project = work / "codex-project"
    project.mkdir(exist_ok=True)
    (project / "notes.txt").write_text("The meeting moved to Thursday.\n")
    session = Session(rec, store, "codex", {"codex": version}, work)

    def codex(wire: str, *extra: str) -> Callable[[], None]:
        def run() -> None:
            home = work / f"codex-home-{wire}"
            home.mkdir(exist_ok=True)
            (home / "config.toml").write_text(
                'model = "local"\nmodel_provider = "recorder"\n\n[model_providers.recorder]\nname = "recorder"\n'
                f'base_url = "{rec.url}/v1"\nwire_api = "{wire}"\nenv_key = "RECORDER_API_KEY"\n'
            )
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
            env.update(CODEX_HOME=str(home), RECORDER_API_KEY="dummy", HOME=str(work / "codex-user"))
            p = subprocess.run(
                [str(exe), "exec", "--skip-git-repo-check", *extra, "List the files here, then read notes.txt."],
                cwd=project,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                stdin=subprocess.DEVNULL,
            )
            if p.returncode:
                said = [line for line in p.stderr.splitlines() if "rror" in line or "How to fix" in line]
                raise RuntimeError(f"codex exited {p.returncode}: {' '.join(said)[-400:]}")
        return run

    plan = Plan(
        prefer=["exec_command", "shell", "shell_command"],
        args={"exec_command": {"cmd": "ls"}, "shell": {"command": ["ls"]}},
    )
    session.run("exec-responses", plan, codex("responses"), note='wire_api = "responses"')
    schema = work / "codex-schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"files": {"type": "array", "items": {"type": "string"}}},
                "required": ["files"],
                "additionalProperties": False,
            }
        )
    )
    session.run(
        "exec-output-schema",
        Plan(prefer=plan.prefer, args=plan.args),
        codex("responses", "--output-schema", str(schema)),
        note="--output-schema: the tools beside a typed final answer (text.format)",
    )
    session.run("exec-chat", plan, codex("chat"), note='wire_api = "chat"')


# -- the Python SDKs -----------------------------------------------------------------------------


class Unit(str, enum.Enum):  # noqa: UP042 (as pydantic users write it)
    celsius = "celsius"
    fahrenheit = "fahrenheit"


def pydantic_models() -> dict[str, Any]:
    from pydantic import AnyUrl, BaseModel, Field, HttpUrl

    class Forecast(BaseModel):
        """A weather forecast."""

        city: Literal["Paris", "Rome", "Oslo"]
        days: int = Field(ge=1, le=7)
        unit: Unit
        sunny: bool

    class Address(BaseModel):
        street: str = Field(min_length=1, max_length=80)
        zip_code: str = Field(pattern=r"^[0-9]{5}$")
        country: Literal["FR", "IT", "NO"]

    class Person(BaseModel):
        name: str = Field(description="Full name")
        age: int = Field(ge=0, le=150)
        email: Optional[str] = None  # noqa: UP045 (Optional, as users write it)
        homepage: HttpUrl | None = None
        avatar: AnyUrl
        born: dt.datetime
        day: dt.date
        id: uuid.UUID
        unit: Unit
        address: Address
        tags: list[str] = Field(default_factory=list, max_length=5)
        score: float = Field(gt=0, lt=1)
        nickname: str | None = Field(default=None, pattern=r"^[a-z]+$")

    class TreeNode(BaseModel):
        """A recursive model."""

        label: str
        children: list[TreeNode] = Field(default_factory=list)

    class GetWeather(BaseModel):
        """Weather of a city."""

        city: Literal["Paris", "Rome", "Oslo"]
        days: int = Field(ge=1, le=7, default=1)

    TreeNode.model_rebuild()
    return {"Forecast": Forecast, "Address": Address, "Person": Person, "TreeNode": TreeNode, "GetWeather": GetWeather}


def example_instances() -> dict[str, dict[str, Any]]:
    """Values the recorder answers for the typed outputs (valid for pydantic's own checks)."""
    return {
        "Forecast": {"city": "Paris", "days": 3, "unit": "celsius", "sunny": True},
        "Person": {"name": "Ada", "age": 36, "email": None, "homepage": None, "avatar": "https://example.com/a.png",
                   "born": "1815-12-10T00:00:00Z", "day": "2025-01-01", "id": "00000000-0000-4000-8000-000000000000",
                   "unit": "celsius", "address": {"street": "Main", "zip_code": "75001", "country": "FR"}, "tags": [],
                   "score": 0.5, "nickname": None},
        "TreeNode": {"label": "root", "children": [{"label": "leaf", "children": []}]},
    }


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"], "additionalProperties": False},
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "description": "IANA zone, e.g. Europe/Paris"}},
            "required": ["zone"],
        },
    },
}


def record_openai_python(rec: Recorder, store: Store, work: Path, npm: Path) -> None:
    import openai

    models, values = pydantic_models(), example_instances()
    session = Session(rec, store, "openai-python", pyversions("openai", "pydantic"), work)
    client = openai.OpenAI(base_url=f"{rec.url}/v1", api_key="dummy", max_retries=0)
    user = [{"role": "user", "content": USER}]
    tools = [WEATHER_TOOL, TIME_TOOL]
    weather = Plan(prefer=["get_weather"], args={"get_weather": {"city": "Paris", "days": 3}})

    def chat_loop(**kw: Any) -> None:
        """Two turns: the call, then its tool result."""
        messages: list[Any] = list(user)
        first = client.chat.completions.create(model="gpt-test", messages=messages, **kw)
        msg = first.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
        client.chat.completions.create(model="gpt-test", messages=messages, **kw)

    session.run("chat-tools-auto", weather, lambda: chat_loop(tools=tools))
    session.run(
        "chat-tools-required",
        weather,
        lambda: chat_loop(tools=tools, tool_choice="required", parallel_tool_calls=False),
    )

    def stream_named() -> None:
        with client.chat.completions.stream(model="gpt-test", messages=user, tools=tools,  # type: ignore[arg-type]
                                            tool_choice={"type": "function", "function": {"name": "get_time"}}) as s:
            s.get_final_completion()
    session.run("chat-tools-named-stream", Plan(), stream_named)
    for name in ("Forecast", "Person", "TreeNode"):
        plan = Plan(args={"$format": values[name]})
        session.run(f"chat-parse-{name}", plan, lambda m=models[name]: client.chat.completions.parse(
            model="gpt-test", messages=user, response_format=m))
    session.run(
        "chat-json-object",
        Plan(args={"$format": {"ok": True}}),
        lambda: client.chat.completions.create(
            model="gpt-test",
            messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format={"type": "json_object"},
        ),
    )
    strict_tools = [
        openai.pydantic_function_tool(models["GetWeather"]),
        openai.pydantic_function_tool(models["Person"]),
        openai.pydantic_function_tool(models["TreeNode"]),
    ]
    session.run(
        "chat-pydantic-function-tools",
        Plan(prefer=["GetWeather"], args={"GetWeather": {"city": "Rome", "days": 2}}),
        lambda: client.chat.completions.parse(
            model="gpt-test", messages=user, tools=strict_tools, tool_choice="required"
        ),
    )

    def typed_and_tools() -> None:
        messages: list[Any] = list(user)
        tools_ = [openai.pydantic_function_tool(models["GetWeather"])]
        first = client.chat.completions.parse(
            model="gpt-test", messages=messages, tools=tools_, response_format=models["Forecast"]
        )
        msg = first.choices[0].message
        messages.append(
            {"role": "assistant", "content": msg.content, "tool_calls": [c.model_dump() for c in msg.tool_calls or []]}
        )
        for call in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
        client.chat.completions.parse(
            model="gpt-test", messages=messages, tools=tools_, response_format=models["Forecast"]
        )

    session.run(
        "chat-parse-tools-and-format",
        Plan(prefer=["GetWeather"], args={"GetWeather": {"city": "Rome", "days": 2}, "$format": values["Forecast"]}),
        typed_and_tools,
    )

    # Responses
    rtools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
               "parameters": t["function"]["parameters"], "strict": False} for t in tools]

    def responses_loop(**kw: Any) -> None:
        items: list[Any] = [{"role": "user", "content": USER}]
        first = client.responses.create(model="gpt-test", input=items, **kw)
        for out in first.output:
            items.append(out.model_dump(exclude_none=True))
            if out.type == "function_call":
                items.append({"type": "function_call_output", "call_id": out.call_id, "output": "sunny"})
        client.responses.create(model="gpt-test", input=items, **kw)
    session.run("responses-tools-auto", weather, lambda: responses_loop(tools=rtools))

    def responses_stream(choice: Any) -> None:
        with client.responses.stream(model="gpt-test", input=USER, tools=rtools, tool_choice=choice) as s:
            s.get_final_response()
    session.run("responses-tools-required-stream", weather, lambda: responses_stream("required"))
    session.run(
        "responses-tools-named-stream", Plan(), lambda: responses_stream({"type": "function", "name": "get_time"})
    )
    for name in ("Person", "TreeNode"):
        session.run(f"responses-parse-{name}", Plan(args={"$format": values[name]}),
                    lambda m=models[name]: client.responses.parse(model="gpt-test", input=USER, text_format=m))

    def responses_typed_and_tools() -> None:
        items: list[Any] = [{"role": "user", "content": USER}]
        first = client.responses.parse(model="gpt-test", input=items, tools=rtools, text_format=models["Forecast"])
        for out in first.output:
            items.append(out.model_dump(exclude_none=True, exclude={"parsed_arguments"}))
            if out.type == "function_call":
                items.append({"type": "function_call_output", "call_id": out.call_id, "output": "sunny"})
        client.responses.parse(model="gpt-test", input=items, tools=rtools, text_format=models["Forecast"])

    session.run(
        "responses-parse-tools-and-format",
        Plan(prefer=["get_weather"], args={**weather.args, "$format": values["Forecast"]}),
        responses_typed_and_tools,
    )


def record_anthropic_python(rec: Recorder, store: Store, work: Path, npm: Path) -> None:
    import anthropic

    models, values = pydantic_models(), example_instances()
    session = Session(rec, store, "anthropic-python", pyversions("anthropic", "pydantic"), work)
    client = anthropic.Anthropic(base_url=rec.url, api_key="dummy", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (WEATHER_TOOL, TIME_TOOL)]
    user = [{"role": "user", "content": USER}]
    weather = Plan(prefer=["get_weather"], args={"get_weather": {"city": "Paris", "days": 3}})

    def loop(**kw: Any) -> None:
        messages: list[Any] = list(user)
        first = client.messages.create(model="claude-test", max_tokens=1024, messages=messages, **kw)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": "sunny, 21 C"}
            for b in first.content
            if b.type == "tool_use"
        ]
        if results:
            messages.append({"role": "user", "content": results})
        client.messages.create(model="claude-test", max_tokens=1024, messages=messages, **kw)
    session.run("messages-tools-auto", weather, lambda: loop(tools=tools, tool_choice={"type": "auto"}))

    def stream_any() -> None:
        with client.messages.stream(
            model="claude-test", max_tokens=1024, messages=user, tools=tools, tool_choice={"type": "any"}
        ) as s:
            s.get_final_message()
    session.run("messages-tools-any-stream", weather, stream_any)
    session.run(
        "messages-tool-named",
        Plan(),
        lambda: loop(
            tools=tools, tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
        ),
    )
    for name in ("Forecast", "Person", "TreeNode"):
        session.run(
            f"messages-parse-{name}",
            Plan(args={"$format": values[name]}),
            lambda m=models[name]: client.messages.parse(
                model="claude-test", max_tokens=1024, messages=user, output_format=m
            ),
        )

    def typed_and_tools() -> None:
        messages: list[Any] = list(user)
        first = client.messages.parse(
            model="claude-test", max_tokens=1024, messages=messages, tools=tools, output_format=models["Forecast"]
        )
        messages.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True, exclude={"parsed_output"}) for b in first.content],
            }
        )
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "sunny"}
                                                     for b in first.content if b.type == "tool_use"]})
        client.messages.parse(
            model="claude-test", max_tokens=1024, messages=messages, tools=tools, output_format=models["Forecast"]
        )

    session.run(
        "messages-parse-tools-and-format",
        Plan(prefer=["get_weather"], args={**weather.args, "$format": values["Forecast"]}),
        typed_and_tools,
    )

    @anthropic.beta_tool
    def search_docs(query: str, limit: int = 5, since: dt.date | None = None) -> str:
        """Search the documentation.

        Args:
            query: what to look for
            limit: how many hits at most
            since: only pages changed since this day
        """
        return f"3 hits for {query}"

    @anthropic.beta_tool
    def convert(amount: float, currency: Literal["EUR", "USD", "NOK"]) -> str:
        """Convert an amount to another currency."""
        return "1.0"

    def runner() -> None:
        for _ in client.beta.messages.tool_runner(
            model="claude-test", max_tokens=1024, messages=user, tools=[search_docs, convert]
        ):
            pass
    session.run("beta-tool-runner", Plan(prefer=["search_docs"], args={"search_docs": {"query": "weather"}}), runner)
    session.run(
        "count-tokens-tools",
        Plan(),
        lambda: client.messages.count_tokens(model="claude-test", messages=user, tools=tools),
    )


def record_pydantic(rec: Recorder, store: Store, work: Path, npm: Path) -> None:
    """The schemas pydantic writes and the SDKs' strict conversions of them (data for the replay
    to wrap in requests; the SDKs' own requests are openai-python's and anthropic-python's)."""
    import openai
    from anthropic.lib._parse._transform import (
        transform_schema,  # the SDK's output_format conversion
    )
    from openai.lib._pydantic import to_strict_json_schema

    schemas: dict[str, Any] = {}
    for name, model in pydantic_models().items():
        schemas[f"model_json_schema/{name}"] = model.model_json_schema()
        schemas[f"to_strict_json_schema/{name}"] = to_strict_json_schema(model)
        schemas[f"pydantic_function_tool/{name}"] = openai.pydantic_function_tool(model)["function"]["parameters"]
        schemas[f"anthropic_transform_schema/{name}"] = transform_schema(model)
    path = store.write_schemas(
        "pydantic",
        {"source": "pydantic", "versions": pyversions("pydantic", "openai", "anthropic"), "schemas": schemas},
    )
    print(f"  pydantic: {len(schemas)} schemas -> {path.name}")


# -- zod and the openai npm SDK -------------------------------------------------------------------


def record_zod(rec: Recorder, store: Store, work: Path, npm: Path) -> None:
    script = npm / "zod_clients.mjs"
    shutil.copy(HERE / "zod_clients.mjs", script)
    rec.take()
    rec.scenario("zod", Plan())
    p = subprocess.run(["node", str(script), rec.url], cwd=npm, capture_output=True, text=True, timeout=300)
    captured = rec.take()
    if p.returncode:
        print(p.stderr[-2000:])
    out = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"versions": {}, "schemas": {}}
    store.write_schemas("zod", {"source": "zod", "versions": out["versions"], "schemas": out["schemas"]})
    session = Session(rec, store, "openai-node", out["versions"], work)
    for name in dict.fromkeys(c.scenario for c in captured):
        failed = out.get("failures", {}).get(name)
        session.save(name, [c for c in captured if c.scenario == name], f"client raised {failed}" if failed else None)
    print(f"  zod: {len(out['schemas'])} schemas; openai-node: {session.written}")


# -- agent frameworks: tools beside a typed final output ------------------------------------------


def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: int = 1) -> str:
    """Weather of a city for the next days.

    Args:
        city: the city
        days: how many days, 1 to 7
    """
    return f"sunny in {city} for {days} days"


def search_docs(query: str, limit: int = 5, since: dt.date | None = None) -> list[str]:
    """Search the documentation.

    Args:
        query: what to look for
        limit: how many hits at most
        since: only pages changed since this day
    """
    return [f"{query} page"]


# Real model names: the frameworks choose what to send (native structured output or an output
# tool, strict schemas) from a profile of the model they name.
OPENAI_MODEL, ANTHROPIC_MODEL = "gpt-4o", "claude-sonnet-5-5"
FRAMEWORK_PLAN = dict(prefer=["get_weather"], args={"get_weather": {"city": "Paris", "days": 3}})


def record_openai_agents(rec: Recorder, store: Store, work: Path, npm: Path) -> None:
    import agents
    import openai

    models, values = pydantic_models(), example_instances()
    session = Session(rec, store, "openai-agents", pyversions("openai-agents", "openai", "pydantic"), work)
    agents.set_tracing_disabled(True)
    tools = [agents.function_tool(get_weather), agents.function_tool(search_docs)]

    def model(api: str) -> Any:
        # A client a run: each scenario is its own asyncio.run, and a pool outlives no loop.
        client = openai.AsyncOpenAI(base_url=f"{rec.url}/v1", api_key="dummy", max_retries=0)
        return (
            agents.OpenAIResponsesModel(OPENAI_MODEL, client)
            if api == "responses"
            else agents.OpenAIChatCompletionsModel(OPENAI_MODEL, client)
        )

    for api in ("responses", "chat"):
        plan = Plan(**FRAMEWORK_PLAN)
        plan.args["$format"] = values["Forecast"]
        agent = agents.Agent(
            name="weather",
            instructions="Answer with a forecast.",
            tools=tools,
            output_type=models["Forecast"],
            model=model(api),
        )
        session.run(f"agent-tools-output-type-{api}", plan, lambda a=agent: agents.Runner.run(a, USER))
        forced = agents.Agent(
            name="weather",
            instructions="Use a tool.",
            tools=tools,
            output_type=models["Forecast"],
            model=model(api),
            model_settings=agents.ModelSettings(tool_choice="required"),
            reset_tool_choice=True,
        )
        session.run(f"agent-required-output-type-{api}", plan, lambda a=forced: agents.Runner.run(a, USER))


def record_pydantic_ai(rec: Recorder, store: Store, work: Path, npm: Path) -> None:
    from pydantic_ai import Agent, NativeOutput, PromptedOutput
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.anthropic import AnthropicProvider
    from pydantic_ai.providers.openai import OpenAIProvider

    models, values = pydantic_models(), example_instances()
    session = Session(
        rec, store, "pydantic-ai", pyversions("pydantic-ai-slim", "openai", "anthropic", "pydantic"), work
    )
    openai_provider = OpenAIProvider(base_url=f"{rec.url}/v1", api_key="dummy")
    chat = OpenAIChatModel(OPENAI_MODEL, provider=openai_provider)
    responses = OpenAIResponsesModel(OPENAI_MODEL, provider=openai_provider)
    claude = AnthropicModel(ANTHROPIC_MODEL, provider=AnthropicProvider(base_url=rec.url, api_key="dummy"))
    tool_output = Plan(**FRAMEWORK_PLAN, final_tools=["final_result"])
    tool_output.args["final_result"] = values["Forecast"]
    native = Plan(**FRAMEWORK_PLAN)
    native.args["$format"] = values["Forecast"]
    for label, model in (("chat", chat), ("responses", responses), ("anthropic", claude)):
        agent = Agent(
            model,
            output_type=models["Forecast"],
            tools=[get_weather, search_docs],
            instructions="Answer with a forecast.",
        )
        session.run(f"tool-output-{label}", tool_output, lambda a=agent: a.run(USER))
    for label, model in (("chat", chat), ("responses", responses), ("anthropic", claude)):
        agent = Agent(model, output_type=NativeOutput(models["Forecast"]), tools=[get_weather, search_docs])
        session.run(f"native-output-{label}", native, lambda a=agent: a.run(USER))
    agent = Agent(chat, output_type=PromptedOutput(models["Forecast"]), tools=[get_weather])
    session.run("prompted-output-chat", native, lambda: agent.run(USER))

    async def streamed() -> None:
        agent = Agent(chat, output_type=models["Forecast"], tools=[get_weather])
        async with agent.run_stream(USER) as result:
            await result.get_output()
    session.run("tool-output-chat-stream", tool_output, streamed)


def record_langchain(rec: Recorder, store: Store, work: Path, npm: Path) -> None:
    from langchain.agents import create_agent
    from langchain.agents.structured_output import ProviderStrategy, ToolStrategy
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    models, values = pydantic_models(), example_instances()
    session = Session(
        rec,
        store,
        "langchain",
        pyversions(
            "langchain", "langchain-core", "langchain-openai", "langchain-anthropic", "langgraph", "openai", "anthropic"
        ),
        work,
    )
    chat = ChatOpenAI(model=OPENAI_MODEL, base_url=f"{rec.url}/v1", api_key="dummy", max_retries=0)  # type: ignore[arg-type]
    responses = ChatOpenAI(
        model=OPENAI_MODEL, base_url=f"{rec.url}/v1", api_key="dummy", max_retries=0, use_responses_api=True
    )  # type: ignore[arg-type]
    claude = ChatAnthropic(model=ANTHROPIC_MODEL, base_url=rec.url, api_key="dummy", max_retries=0)  # type: ignore[arg-type,call-arg]
    tools = [tool(get_weather), tool(search_docs)]
    strategy_tool = Plan(**FRAMEWORK_PLAN, final_tools=["Forecast"])
    strategy_tool.args["Forecast"] = values["Forecast"]
    provider = Plan(**FRAMEWORK_PLAN)
    provider.args["$format"] = values["Forecast"]
    for label, model in (("chat", chat), ("responses", responses), ("anthropic", claude)):
        agent = create_agent(model, tools=tools, response_format=models["Forecast"])
        both = Plan(**FRAMEWORK_PLAN, final_tools=["Forecast"])
        both.args.update({"Forecast": values["Forecast"], "$format": values["Forecast"]})
        session.run(f"create-agent-auto-{label}", both, lambda a=agent: a.invoke({"messages": [("user", USER)]}))
        agent = create_agent(model, tools=tools, response_format=ToolStrategy(models["Forecast"]))
        session.run(
            f"create-agent-tool-strategy-{label}",
            strategy_tool,
            lambda a=agent: a.invoke({"messages": [("user", USER)]}),
        )
    agent = create_agent(chat, tools=tools, response_format=ProviderStrategy(models["Forecast"]))
    session.run("create-agent-provider-strategy-chat", provider, lambda: agent.invoke({"messages": [("user", USER)]}))
    session.run("with-structured-output-chat", Plan(args={"$format": values["Person"]}),
                lambda: chat.with_structured_output(models["Person"]).invoke(USER))
    session.run("with-structured-output-function-calling-chat", Plan(args={"Person": values["Person"]}),
                lambda: chat.with_structured_output(models["Person"], method="function_calling").invoke(USER))
    session.run(
        "with-structured-output-anthropic",
        Plan(args={"Forecast": values["Forecast"], "$format": values["Forecast"]}),
        lambda: claude.with_structured_output(models["Forecast"]).invoke(USER),
    )
    session.run(
        "bind-tools-stream-chat",
        Plan(**FRAMEWORK_PLAN),
        lambda: list(chat.bind_tools(tools, tool_choice="any").stream(USER)),
    )


# The captures' folder of a recorder whose client has another name (zod's requests are the
# openai npm SDK's).
CAPTURED_AS = {"zod": "openai-node"}
RECORDERS: dict[str, Callable[[Recorder, Store, Path, Path], None]] = {
    "claude-code": record_claude_code,
    "codex": record_codex,
    "openai-python": record_openai_python,
    "anthropic-python": record_anthropic_python,
    "pydantic": record_pydantic,
    "zod": record_zod,
    "openai-agents": record_openai_agents,
    "pydantic-ai": record_pydantic_ai,
    "langchain": record_langchain,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--npm-prefix", type=Path, required=True, help="where @anthropic-ai/claude-code, @openai/codex, "
                    "openai, zod are installed")
    ap.add_argument("--out", type=Path, default=CORPUS, help="the corpus folder (default: tests/corpus)")
    ap.add_argument("--only", nargs="*", choices=sorted(RECORDERS), help="record these clients only")
    args = ap.parse_args()
    store = Store(args.out)
    with Recorder() as rec, tempfile.TemporaryDirectory(prefix="hydra-corpus-") as tmp:
        work = Path(tmp)
        for name in args.only or RECORDERS:
            print(f"recording {name}")
            for stale in (args.out / "captures" / CAPTURED_AS.get(name, name)).glob("*.json"):
                stale.unlink()
            RECORDERS[name](rec, store, work, args.npm_prefix.resolve())
    store.finish()
    if args.only is None or "claude-code" in args.only:
        write_claude_code_tools(args.out)


def write_claude_code_tools(out: Path) -> None:
    """Claude Code's full tool list (tool search off) as one file: the input of the compile-time
    and first-token measurements (benchmarks/agent_tools.py)."""
    from store import resolve

    path = out / "captures" / "claude-code" / "tool-search-off.json"
    if not path.exists():
        return
    doc = json.loads(path.read_text())
    first = doc["requests"][0]
    tools = resolve(first["body"]["tools"], out)
    (out / "claude-code-tools.json").write_text(
        json.dumps(
            {
                "client": "claude-code",
                "versions": doc["versions"],
                "source": path.relative_to(out).as_posix(),
                "tools": tools,
            },
            indent=1,
            ensure_ascii=False,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
