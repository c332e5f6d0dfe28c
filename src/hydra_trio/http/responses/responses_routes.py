"""``POST /v1/responses`` and ``POST /v1/responses/input_tokens``: OpenAI's Responses API on
the one dialect route (http/generation/dialect.py): its codec and its names
(responses_protocol.py) and its answer (responses_serving.py); its errors are OpenAI's shape,
every route's."""

from __future__ import annotations

from ..generation import Dialect
from .responses_protocol import param_names, to_chat
from .responses_serving import answer_responses

RESPONSES = Dialect(
    "responses",
    "/v1/responses",
    "resp_",
    answer_responses,
    codec=to_chat,
    names=param_names,
    count_rule="/v1/responses/input_tokens",
    count_reply=lambda n: {"object": "response.input_tokens", "input_tokens": n},
)
