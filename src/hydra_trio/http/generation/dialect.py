"""Every generation route, one way (``dialect_blueprint``): the body read (the engine of
the model it names, under its caps), mapped by the dialect's codec, prepared by the one
request policy with a refusal in the client's own names, claimed and generated whole or
streamed (``respond``), and answered in the dialect's shape, its errors too. Who may call it
and how large a body it takes are the route table's (http/plumbing/routes.py). A dialect
(``Dialect``) says only what differs: its rules, its codec, its ids, its error shape, and
how it answers one generation (``Answer``)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from quart import Blueprint, Response, request

from ...engine import GenerationParams, GenerationResult, Prepared, ReplyParser, Route
from ...wire.errors import ParamError
from ..plumbing import (
    RequestSession,
    app_state,
    error_body,
    generation_owner,
    json_response,
    needs_no_slot,
    off_loop,
    request_session,
    routed_json,
)
from .generation import (
    GenerationStream,
    Prepare,
    Run,
    StreamEvents,
    generate_buffered,
    sse_body,
    start_stream,
)

if TYPE_CHECKING:
    from ...engine import Engine
    from ...serving import AppState


class Codec(Protocol):
    """A dialect's request as the engine's chat request (``count_only``: what counting its
    prompt's tokens needs); a 400 for what cannot be mapped."""

    def __call__(self, body: dict[str, Any], *, count_only: bool = False) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Exchange:
    """One generation request, read, mapped and prepared: what a dialect's answer is built from."""

    state: AppState
    engine: Engine
    body: dict[str, Any]  # as the client sent it
    request: dict[str, Any]  # the engine's request (the body itself for a dialect without a codec)
    prepared: Prepared
    session: RequestSession | None  # its agent session (None: a route without one)
    route: str  # its name in request lines and metrics
    id: str  # its reply's id
    owner: str  # the slot owner's and request line's name of it

    @property
    def params(self) -> GenerationParams:
        return self.prepared.params

    @property
    def tokens(self) -> list[int]:
        tokens = self.prepared.tokens
        assert tokens is not None, "tokenized"
        return tokens

    def parser(self) -> ReplyParser | None:
        """A fresh reader of the reply (None: its text is the content)."""
        replies = self.prepared.replies
        return None if replies is None else replies()


@dataclass(frozen=True, slots=True)
class Answer:
    """How a dialect answers one generation: its whole reply (``body(slot_id, result)``) or
    its stream's events; what runs in the claimed slot first (``prepare``), and whether the
    slot is held for that alone (``prompt_only``: no token generated)."""

    body: Callable[[int | None, GenerationResult], dict[str, Any]]
    events: Callable[[GenerationStream], StreamEvents]
    prepare: Prepare | None = None
    prompt_only: bool = False


@dataclass(frozen=True, slots=True)
class Dialect:
    """One API's generation routes: only what it says differently."""

    name: str  # its blueprint's, and its requests' in request lines and metrics
    rule: str  # its generation route
    id_prefix: str  # of its replies' ids
    answer: Callable[[Exchange], Awaitable[Answer | Response]]  # a Response: answered before any slot
    prepares_as: Route = "chat"  # the engine's request it becomes (engine.prepare)
    codec: Codec | None = None  # None: the body is the engine's request already
    # the client's names of the engine's parameters
    names: Callable[[dict[str, Any]], Callable[[str], str]] | None = None
    count_rule: str | None = None  # its route that counts a prompt's tokens
    count_reply: Callable[[int], dict[str, Any]] | None = None
    # Its error object from OpenAI's (the one shape every route answers in), for every error on
    # a path under ``rule``: the routes', the auth check's, the drain's, a 404. None: OpenAI's.
    error_shape: Callable[[int, dict[str, Any]], dict[str, Any]] | None = None

    @contextmanager
    def in_its_names(self, body: dict[str, Any]) -> Iterator[None]:
        """A parameter's refusal names what the client sent (``tools[3].input_schema``)."""
        try:
            yield
        except ParamError as exc:
            if self.names is None:
                raise
            raise exc.renamed(self.names(body)) from None


async def respond(ex: Exchange, answer: Answer) -> Response:
    """The one way a generation is answered: whole (JSON), or streamed (SSE) when it asked."""
    run = Run(
        ex.state, ex.engine, ex.tokens, ex.params, ex.owner, ex.route, answer.prepare, ex.session, answer.prompt_only
    )
    if not ex.params.stream:
        slot_id, res = await generate_buffered(run)
        return json_response(answer.body(slot_id, res))
    stream = await start_stream(run)
    return Response(
        sse_body(stream, answer.events(stream)),
        status=200,
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _generate(dialect: Dialect) -> Response:
    state = app_state()
    engine, body = await routed_json()  # the engine of the model it names
    codec = dialect.codec
    chat = body if codec is None else await off_loop(lambda: codec(body))
    session = request_session(body)  # its agent session (400 for a malformed hint)
    with dialect.in_its_names(body):
        prepared = await engine.prepare(dialect.prepares_as, chat)  # 400 for what this engine would not honour
    rid = dialect.id_prefix + secrets.token_hex(12)
    ex = Exchange(state, engine, body, chat, prepared, session, dialect.name, rid, generation_owner(rid))
    answer = await dialect.answer(ex)
    return answer if isinstance(answer, Response) else await respond(ex, answer)


async def _count(dialect: Dialect) -> Response:
    codec, reply = dialect.codec, dialect.count_reply
    assert codec is not None and reply is not None, "a count route maps its body and says its count"
    engine, body = await routed_json()
    chat = await off_loop(lambda: codec(body, count_only=True))
    with dialect.in_its_names(body):
        n = len(await engine.prompt_tokens(chat))
    return json_response(reply(n))


def dialect_blueprint(dialect: Dialect) -> Blueprint:
    """The dialect's routes: its generation route, its count route, its error shape."""
    bp = Blueprint(dialect.name, __name__)

    async def generate() -> Response:
        return await _generate(dialect)

    bp.add_url_rule(dialect.rule, "generate", generate, methods=["POST"])
    if dialect.count_rule is not None:

        async def count() -> Response:
            return await _count(dialect)

        bp.add_url_rule(dialect.count_rule, "count", needs_no_slot(count), methods=["POST"])
    shape = dialect.error_shape
    if shape is not None:

        @bp.after_app_request
        async def in_its_shape(response: Response) -> Response:
            if (
                not request.path.startswith(dialect.rule)
                or response.status_code < 400
                or response.mimetype != "application/json"
            ):
                return response
            try:
                shaped = shape(response.status_code, json.loads(await response.get_data())["error"])
            except (ValueError, KeyError, TypeError):
                return response
            response.set_data(json.dumps(shaped, separators=(",", ":")))
            return response

    return bp


def error_in_shape(dialects: tuple[Dialect, ...], path: str, status: int, message: str) -> dict[str, Any]:
    """An error answered before the app sees the request (a body over its cap), in the shape
    of the dialect that owns ``path`` (else OpenAI's), as its routes' errors are."""
    body = error_body(status, message, "invalid_request_error")
    for dialect in dialects:
        if dialect.error_shape is not None and path.startswith(dialect.rule):
            return dialect.error_shape(status, body["error"])
    return body


_TOOL_PARAM = re.compile(r"tools\[(\d+)\](.*)", re.S)


def dialect_names(
    tool_index: Sequence[int], tool_parts: Sequence[tuple[str, str]], keys: Sequence[tuple[str, str]]
) -> Callable[[str], str]:
    """A codec's spelling of the engine's parameter names (``ParamError.renamed``): the
    engine's ``tools[i]`` is the request's ``tools[tool_index[i]]`` (a dialect may drop tools
    it cannot run), its parts renamed by ``tool_parts``; a key or any part under it by
    ``keys`` (first match)."""

    def rename(param: str) -> str:
        if (m := _TOOL_PARAM.fullmatch(param)) is not None:
            i, rest = int(m.group(1)), m.group(2)
            for old, new in tool_parts:
                if rest.startswith(old):
                    rest = new + rest[len(old):]
                    break
            return f"tools[{tool_index[i] if i < len(tool_index) else i}]{rest}"
        for old, new in keys:
            if param == old or param.startswith((old + ".", old + "[")):
                return new + param[len(old):]
        return param

    return rename


def chat_tool(name: str, parameters: Any, description: Any) -> dict[str, Any]:
    """A dialect's tool as the chat request's function tool (its description only when it is
    a string)."""
    fn: dict[str, Any] = {"name": name, "parameters": parameters}
    if isinstance(description, str):
        fn["description"] = description
    return {"type": "function", "function": fn}
