"""A request's generation settings: read on the trio thread unless it declares tools (issue
53's 8-stream regression: a thread hop each, two at a time, staggered requests that came
together, and their prompts joined the streams' batches one by one)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from hydra_trio.config import Settings
from hydra_trio.engine import inputs as inputs_mod
from hydra_trio.engine.inputs import Inputs
from hydra_trio.wire import ProtocolError

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _inputs() -> Inputs:
    backend = SimpleNamespace(n_ctx=4096, n_ctx_slot=1024)
    return Inputs(lambda: backend, worker=None, settings=Settings())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "hops"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}, 0),
        ({"prompt": "hi", "sampling": {"temperature": 0.5}}, 0),
        ({"prompt": "hi", "grammar": 'root ::= "a"'}, 0),  # its grammar is compiled later, off the loop
        ({"prompt": "hi", "tools": []}, 0),
        ({"messages": [], "tools": [TOOL]}, 1),
        ({"messages": [], "sampling": {"tools": [TOOL]}}, 1),
        ({"messages": [], "functions": [TOOL["function"]]}, 1),
    ],
)
async def test_only_a_tool_list_goes_to_a_thread(
    monkeypatch: pytest.MonkeyPatch, body: dict[str, Any], hops: int
) -> None:
    calls: list[Any] = []
    real = trio.to_thread.run_sync

    async def counted(fn: Any, *args: Any, **kw: Any) -> Any:
        calls.append(fn)
        return await real(fn, *args, **kw)

    monkeypatch.setattr(inputs_mod.trio.to_thread, "run_sync", counted)
    inputs = _inputs()
    params = await inputs.generation_params_off_loop(body)
    assert len(calls) == hops
    assert params == inputs.generation_params(body)


async def test_a_refusal_is_the_same_on_either_thread() -> None:
    inputs = _inputs()
    with pytest.raises(ProtocolError, match="min_tokens"):
        await inputs.generation_params_off_loop({"prompt": "hi", "max_tokens": 2, "min_tokens": 5})
    with pytest.raises(ProtocolError, match="tools"):
        await inputs.generation_params_off_loop({"messages": [], "tools": "nope"})
