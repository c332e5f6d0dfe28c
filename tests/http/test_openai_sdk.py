"""The OpenAI Python SDK against a live engine, unmodified (issue 30): structured output with
``chat.completions.parse(response_format=PydanticModel)``, tool calls with ``tools`` (plain,
streamed through the SDK's own accumulator, and ``pydantic_function_tool`` parsed back).

The synthetic model's weights are random, so the requests force what they check (a schema,
``tool_choice: required`` or a named function)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from helpers import MESSAGES
from test_tools_http import PARAMS_OF, ROOMY, TOOLS


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)
    sunny: bool


class GetWeather(BaseModel):
    """Weather of a city."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=3)


def client(ep: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{ep.http_port}/v1", api_key="unused", max_retries=0)


@pytest.fixture
async def sdk(start_engine: Any, tiny_model: Path) -> openai.AsyncOpenAI:
    return client(await start_engine(tiny_model, **ROOMY))


async def test_parse_with_a_pydantic_model(sdk: openai.AsyncOpenAI) -> None:
    for prompt in ("forecast?", "weather in Oslo"):
        completion = await sdk.chat.completions.parse(
            model="any",
            messages=[{"role": "user", "content": prompt}],
            response_format=Forecast,
            max_tokens=80,
            temperature=0,
        )
        message = completion.choices[0].message
        assert isinstance(message.parsed, Forecast), message
        assert message.parsed == Forecast.model_validate_json(message.content or "")


async def test_tools_with_required_choice(sdk: openai.AsyncOpenAI) -> None:
    completion = await sdk.chat.completions.create(
        model="any", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=1500, temperature=0  # type: ignore[arg-type]
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in PARAMS_OF
        json.loads(call.function.arguments)


async def test_streamed_tool_calls_through_the_sdk_accumulator(sdk: openai.AsyncOpenAI) -> None:
    async with sdk.chat.completions.stream(
        model="any", messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},  # type: ignore[arg-type]
        parallel_tool_calls=False, max_tokens=1500, temperature=0,
    ) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and [c.function.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")
    assert final.choices[0].finish_reason == "tool_calls"


async def test_pydantic_function_tool_is_parsed_back(sdk: openai.AsyncOpenAI) -> None:
    completion = await sdk.chat.completions.parse(
        model="any", messages=MESSAGES, tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
        max_tokens=1500, temperature=0,
    )
    calls = completion.choices[0].message.tool_calls
    assert calls
    parsed = calls[0].function.parsed_arguments
    assert isinstance(parsed, GetWeather), calls[0]
