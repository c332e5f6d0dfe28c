"""A Responses generation answered (``answer_responses``): the whole response object, or its
event stream, written by the one event machine (http/generation/event_machine.py) from this
dialect's table (``ResponseTable``): response.created and .in_progress, an output item per
run of reasoning or text (with its content part and deltas) and per function call, then
response.completed (or .incomplete) holding the whole response; every event numbered."""

from __future__ import annotations

from typing import Any, ClassVar

from ...engine import GenerationResult, ReplyParser, ToolCall
from ..generation import Answer, BlockStream, Event, Exchange, error_event_body
from .responses_protocol import Shell, item_of, new_id, response_body, status_of


class ResponseTable:
    """The Responses API's events for each step of a reply's stream; the output items as
    they stand (the last event's response holds them all)."""

    numbered: ClassVar[bool] = True

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.output: list[dict[str, Any]] = []

    def start(self) -> list[Event]:
        start = self.shell.response("in_progress", [])
        return [("response.created", {"response": start}), ("response.in_progress", {"response": start})]

    def open(self, index: int, kind: str) -> list[Event]:
        item = item_of((kind, ""), new_id("rs" if kind == "reasoning" else "msg"))
        if kind == "reasoning":
            item["content"] = []
        else:
            item.update(status="in_progress", content=[])
        self.output.append(item)
        part = (
            {"type": "reasoning_text", "text": ""}
            if kind == "reasoning"
            else {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        )
        return [
            ("response.output_item.added", {"output_index": index, "item": dict(item, content=[])}),
            (
                "response.content_part.added",
                {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
            ),
        ]

    def text(self, index: int, kind: str, text: str) -> list[Event]:
        loc = {"item_id": self.output[index]["id"], "output_index": index, "content_index": 0}
        if kind == "reasoning":
            return [("response.reasoning_text.delta", {**loc, "delta": text})]
        return [("response.output_text.delta", {**loc, "delta": text, "logprobs": []})]

    def close(self, index: int, kind: str, text: str) -> list[Event]:
        item = self.output[index]
        loc = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            done: Event = ("response.reasoning_text.done", {**loc, "text": text})
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item.update(status="completed", content=[part])
            done = ("response.output_text.done", {**loc, "text": text, "logprobs": []})
        return [
            done,
            ("response.content_part.done", {**loc, "part": part}),
            ("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def call(self, index: int, call: ToolCall) -> list[Event]:
        item = item_of(call, new_id("fc"))
        self.output.append(item)
        loc = {"item_id": item["id"], "output_index": index}
        return [
            (
                "response.output_item.added",
                {"output_index": index, "item": {**item, "status": "in_progress", "arguments": ""}},
            ),
            ("response.function_call_arguments.delta", {**loc, "delta": call.arguments}),
            ("response.function_call_arguments.done", {**loc, "name": call.name, "arguments": call.arguments}),
            ("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def end(self, res: GenerationResult, calls: bool) -> list[Event]:
        status = status_of(res)
        return [(f"response.{status}", {"response": self.shell.response(status, self.output, res)})]

    def failed(self, exc: BaseException) -> list[Event]:
        err = error_event_body(exc)["error"]
        return [("error", {"code": str(err["code"]), "message": err["message"], "param": None})]


def response_events(shell: Shell, parser: ReplyParser | None) -> BlockStream:
    """One response's event stream (``parser`` fresh; None: the text is the content)."""
    return BlockStream(ResponseTable(shell), parser)


async def answer_responses(ex: Exchange) -> Answer:
    model = ex.body["model"] if isinstance(ex.body.get("model"), str) else ex.engine.served_name
    shell = Shell(ex.id, model, ex.body, ex.request)
    return Answer(
        body=lambda _slot_id, res: response_body(shell, res, ex.parser()),
        events=lambda _stream: response_events(shell, ex.parser()).events(),
    )
