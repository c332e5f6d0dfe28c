"""A Messages generation answered (``answer_messages``): the whole message, or Anthropic's
event stream, written by the one event machine (http/generation/event_machine.py) from this
dialect's table (``MessageTable``): message_start and a ping, then a content block per run of
thinking or text (``*_delta`` events) and per tool call (one ``input_json_delta``), then
message_delta (stop_reason, usage) and message_stop."""

from __future__ import annotations

from typing import Any, ClassVar

from ...engine import GenerationResult, ReplyParser, ToolCall
from ..generation import Answer, BlockStream, Event, Exchange, error_event_body, receipt_fields
from .messages_protocol import call_id, error_shape, message_body, stop_reason, usage


class MessageTable:
    """Anthropic's events for each step of a reply's stream."""

    numbered: ClassVar[bool] = False

    def __init__(self, mid: str, model: str, n_prompt: int, stop: list[str]) -> None:
        self.mid, self.model, self.n_prompt, self.stop = mid, model, n_prompt, stop

    def start(self) -> list[Event]:
        message = {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.n_prompt,
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            },
        }
        return [("message_start", {"message": message}), ("ping", {})]

    def open(self, index: int, kind: str) -> list[Event]:
        empty = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "reasoning"
            else {"type": "text", "text": ""}
        )
        return [("content_block_start", {"index": index, "content_block": empty})]

    def text(self, index: int, kind: str, text: str) -> list[Event]:
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "reasoning"
            else {"type": "text_delta", "text": text}
        )
        return [("content_block_delta", {"index": index, "delta": delta})]

    def close(self, index: int, kind: str, text: str) -> list[Event]:
        return [("content_block_stop", {"index": index})]

    def call(self, index: int, call: ToolCall) -> list[Event]:
        start = {"type": "tool_use", "id": call_id(call), "name": call.name, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        return [
            ("content_block_start", {"index": index, "content_block": start}),
            ("content_block_delta", {"index": index, "delta": delta}),
            ("content_block_stop", {"index": index}),
        ]

    def end(self, res: GenerationResult, calls: bool) -> list[Event]:
        reason, sequence = stop_reason(res, calls, self.stop)
        delta: dict[str, Any] = {"stop_reason": reason, "stop_sequence": sequence}
        return [("message_delta", {"delta": delta, "usage": usage(res), **receipt_fields(res)}), ("message_stop", {})]

    def failed(self, exc: BaseException) -> list[Event]:
        err = error_event_body(exc)["error"]
        return [("error", {"error": error_shape(int(err["code"]), err["message"])["error"]})]


def message_events(mid: str, model: str, n_prompt: int, parser: ReplyParser | None, stop: list[str]) -> BlockStream:
    """One message's event stream (``parser`` fresh; None: the text is the content)."""
    return BlockStream(MessageTable(mid, model, n_prompt, stop), parser)


async def answer_messages(ex: Exchange) -> Answer:
    stop = list(ex.params.stop)
    model = ex.body["model"] if isinstance(ex.body.get("model"), str) else ex.engine.served_name
    return Answer(
        body=lambda _slot_id, res: message_body(ex.id, model, res, ex.parser(), stop),
        events=lambda _stream: message_events(ex.id, model, len(ex.tokens), ex.parser(), stop).events(),
    )
