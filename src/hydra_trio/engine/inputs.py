"""Input processing: a request's prompt from its body (chat template or plain text), its
tokens, and the limits a prompt must fit before any slot is claimed (vLLM's input processor).

Each check here is the one place its limit is decided: what text is refused untokenized, what
prompt no slot can hold, how large a prompt-route or token-id JSON body is worth parsing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import trio

from ..config import Settings
from ..wire import sampling as sampling_keys
from ..wire.errors import ErrorCode, PromptTooLong, ProtocolError, Status, bad_param
from .chat import Chat, ChatPlan, ChatTemplate
from .llama import ImageError, LlamaBackend, apply_builtin_chat_template, kv_layout
from .media import has_images, read_images, split_images
from .params import GenerationParams, parse_generation
from .slices import tokenize_sliced
from .structured import GuidanceCache, OutputGrammar, ThinkPlan
from .worker import GpuWorker

# The most prompt text per context position: longer text cannot fit a slot with any usual
# vocabulary, so it is refused before it is tokenized (tokenizing holds the GPU worker, and
# a multi-megabyte prompt would stall every stream for seconds).
MAX_PROMPT_BYTES_PER_POSITION = 32
# A token id in a JSON array: up to 7 digits, its comma, and the indentation of a
# pretty-printed body (json.dumps(indent=4) inside an object: 8 spaces and a newline).
MAX_TOKEN_ID_JSON_BYTES = 24
# Threads writing and compiling requests' grammars at once (schemas, tool lists): off the trio
# thread and the GPU worker, so neither waits on them; llguidance releases the GIL.
GRAMMAR_THREADS = 2


class Inputs:
    """Turns request bodies into prompts and tokens, within the served model's limits.
    ``backend`` gives the model serving now (a T3 reload replaces it)."""

    def __init__(self, backend: Callable[[], LlamaBackend], worker: GpuWorker, settings: Settings) -> None:
        self._backend = backend
        self._worker = worker
        self._settings = settings
        self.chat: Chat | None = None  # set with the template (set_chat_template)
        self._grammar_threads = trio.CapacityLimiter(GRAMMAR_THREADS)
        self._grammars: tuple[LlamaBackend | None, GuidanceCache | None] = (None, None)
        # Think tags' tokens (think_plan), by tags and shown tokens: a template has a few.
        self._tags: tuple[
            LlamaBackend | None, dict[tuple[bytes, bytes, frozenset[int]], tuple[tuple[int, ...], tuple[int, ...]]]
        ] = (None, {})

    @property
    def n_ctx(self) -> int:
        return self._backend().n_ctx

    @property
    def n_ctx_slot(self) -> int:
        return self._backend().n_ctx_slot

    def set_chat_template(self, template: ChatTemplate) -> None:
        backend = self._backend()
        info = backend.info
        self.chat = Chat(
            template,
            tool_call_parser=self._settings.tool_call_parser,
            reasoning_format=self._settings.reasoning_format,
            bos_token=info.bos_text,
            eos_token=info.eos_text,
            tokenizer_adds_bos=info.add_bos,
            run_on_worker=self._worker.call,
            apply_builtin=apply_builtin_chat_template,
            special_text=backend.vocabulary.special,
            unshown=backend.eog_ids | {info.bos},
        )

    @property
    def chat_template(self) -> ChatTemplate:
        assert self.chat is not None, "set at construction"
        return self.chat.template

    @property
    def grammars(self) -> GuidanceCache:
        """The served model's compiled grammars (a T3 reload's model gets its own)."""
        backend = self._backend()
        if self._grammars[0] is not backend:
            self._grammars = (backend, GuidanceCache(backend.grammar_pieces, backend.eog_ids, backend.info.bos))
        cache = self._grammars[1]
        assert cache is not None
        return cache

    async def warm_grammars(self) -> None:
        """Build the served model's tokenizer view for llguidance now (about a second for a
        large vocabulary), off the worker and the trio thread, so the first constrained
        request does not wait for it."""
        await trio.to_thread.run_sync(self.grammars.warm, limiter=self._grammar_threads)

    def generation_params(self, request: dict[str, Any]) -> GenerationParams:
        """A request's generation settings, with this engine's defaults and limits."""
        s = self._settings
        return parse_generation(
            request,
            default_n_predict=s.default_n_predict,
            n_ctx=self.n_ctx_slot,
            default_stream_interval=s.stream_interval,
            default_reasoning_budget=s.reasoning_budget,
        )

    async def generation_params_off_loop(self, request: dict[str, Any]) -> GenerationParams:
        """``generation_params``, a request's tool list validated on a worker thread (at most
        GRAMMAR_THREADS at once), never on the trio thread. A request that declares no tools
        is read here at once: a thread hop each, two at a time, staggered requests that came
        together (their prompts then joined the streams' batches one by one: issue 53's
        8-stream regression)."""
        keys = sampling_keys.flatten(request)
        if not keys.get("tools") and not keys.get("functions"):
            return self.generation_params(request)
        return await trio.to_thread.run_sync(self.generation_params, request, limiter=self._grammar_threads)

    async def plan(self, request: dict[str, Any], params: GenerationParams) -> ChatPlan:
        """The request's chat side, decided once (``Chat.plan``)."""
        return await self._chat().plan(
            request,
            tools=params.tools,
            constraint=params.constraint,
            budget=params.reasoning_budget,
            off_loop=self._off_loop,
        )

    async def _off_loop(self, fn: Callable[[], Any]) -> Any:
        return await trio.to_thread.run_sync(fn, limiter=self._grammar_threads)

    async def think_plan(self, plan: ThinkPlan | None, shown: frozenset[int]) -> ThinkPlan | None:
        """``plan`` with its tags tokenized on the GPU worker (once per template's tags)."""
        if plan is None:
            return None
        backend = self._backend()
        key = (plan.open_text, plan.close_text, shown)
        if self._tags[0] is not backend:  # a reload's model tokenizes its own way
            self._tags = (backend, {})
        known = self._tags[1].get(key)
        if known is None:
            opening, closing = plan.open_text.decode(), plan.close_text.decode()
            open_ids, close_ids = await self._worker.call(
                lambda: (backend.tokenize(opening, add_special=False), backend.tokenize(closing, add_special=False))
            )
            text_of = backend.text_of(shown)
            known = (_spelling(open_ids, plan.open_text, text_of), _spelling(close_ids, plan.close_text, text_of))
            self._tags[1][key] = known
        return replace(plan, open_tokens=known[0], close_tokens=known[1])

    def _chat(self) -> Chat:
        assert self.chat is not None, "set at construction"
        return self.chat

    async def compile_grammar(self, grammar: OutputGrammar | None) -> None:
        """Compile a request's grammar before any slot is claimed (a GrammarError, a 400
        naming the problem, when it cannot be); a cached one costs nothing. Off the worker and
        the trio thread (GRAMMAR_THREADS at once): a large grammar takes up to a second."""
        if grammar is None:
            return
        grammars = self.grammars
        if not grammars.known(grammar):
            await trio.to_thread.run_sync(grammars.compile, grammar, limiter=self._grammar_threads)

    async def render_prompt(self, request: dict[str, Any]) -> str:
        """The prompt text of a request (chat template or plain prompt); refuses bad shapes."""
        return await self._chat().render(request)

    async def tokenize_request(self, request: dict[str, Any]) -> list[int]:
        """A request's prompt tokens: ``messages`` through the chat template (its images'
        positions included), or its ``prompt`` (text, token ids, or a one-element batch of
        either)."""
        if "prompt" in request and "messages" not in request:
            return await self.prompt_tokens(request["prompt"])
        request, images = await self.read_images(request)
        prompt = await self.render_prompt(request)
        return await self.tokenize_with_images(prompt, images) if images else await self.tokenize_text(prompt)

    async def read_images(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
        """A chat request's images read (engine/media.py), each part a placeholder in its
        text; refused (400) when the model has no projector (--mmproj)."""
        if not has_images(request):
            return request, []
        if self._backend().projector is None:
            raise bad_param("image input is not supported: this model is served without a vision projector (--mmproj)")
        return await read_images(request, self._settings)

    async def tokenize_with_images(self, prompt: str, images: list[bytes]) -> list[int]:
        """Rendered prompt text with image placeholders -> its tokens, each image its
        positions (engine/llama/vision.py), on the GPU worker; refuses images that do not
        decode and prompts that cannot fit."""
        backend = self._backend()
        projector = backend.projector
        if projector is None:  # a T3 reload between reading and tokenizing
            raise bad_param("image input is not supported: this model is served without a vision projector (--mmproj)")
        self.check_text_fits(prompt)
        text, ordered = split_images(prompt, images, projector.marker)
        try:
            tokens, _ = await self._worker.call(lambda: projector.tokenize(text, ordered))
        except ImageError as exc:
            raise bad_param(str(exc)) from None
        except UnicodeEncodeError:
            raise bad_param("text holds a lone surrogate (U+D800..U+DFFF): not valid Unicode") from None
        self.check_prompt_fits(len(tokens))
        return tokens

    async def prompt_tokens(self, prompt: Any) -> list[int]:
        """``prompt`` as a string, a token array, or a one-element array of either (OpenAI's
        batch form with one prompt) -> tokens. Strings get the model's BOS like any prompt."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self.tokenize_text(prompt)
        if isinstance(prompt, list) and len(prompt) >= self.n_ctx_slot:
            self.check_prompt_fits(len(prompt))  # before any per-token check (a 4 M-token array: ~1 s)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            n_vocab = self._backend().info.n_vocab
            bad = [t for t in prompt if not 0 <= t < n_vocab]
            if bad:
                raise bad_param(f"prompt holds token ids outside the vocabulary (0..{n_vocab - 1}): {bad[:5]}")
            self.check_prompt_fits(len(prompt))
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
            raise bad_param("one prompt per request: batched prompts are not supported")
        raise bad_param("prompt must be a non-empty string or a non-empty array of token ids")

    @property
    def max_request_json_bytes(self) -> int:
        """The largest prompt-route JSON body worth parsing: the longest text a slot can take
        (MAX_PROMPT_BYTES_PER_POSITION a position), three times over for JSON's escapes
        (a six-byte \\u escape for a 2- or 3-byte character, two for a 4-byte one), plus 1 MiB for the rest
        of the request (messages' structure, a tool schema, sampling fields). Token-id arrays
        take at most 8 bytes an id."""
        return 3 * MAX_PROMPT_BYTES_PER_POSITION * self.n_ctx_slot + (1 << 20)

    @property
    def max_token_ids_json_bytes(self) -> int:
        """The largest /detokenize body worth parsing: an array of at most n_ctx ids (what all
        slots hold together; more is refused anyway), MAX_TOKEN_ID_JSON_BYTES an id, plus
        64 KiB for the rest. Parsing holds the GIL even on another thread, so a body this
        route refuses must never cost more to parse than the largest one it serves (a
        12 MB array of 4 M ids: 0.2-0.4 s of every stream's time)."""
        return MAX_TOKEN_ID_JSON_BYTES * self.n_ctx + (64 << 10)

    def check_text_fits(self, text: str) -> None:
        """Refuse text too long for a slot before any per-token work (see
        MAX_PROMPT_BYTES_PER_POSITION)."""
        limit = MAX_PROMPT_BYTES_PER_POSITION * self.n_ctx_slot
        if len(text) <= limit // 4:  # 4 UTF-8 bytes a character at most: no need to encode
            return
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        if n_bytes > limit:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"text of {n_bytes} bytes: a slot holds {self.n_ctx_slot} positions, "
                f"and text over {MAX_PROMPT_BYTES_PER_POSITION} bytes a position is refused untokenized",
                status=Status.BAD_REQUEST,
            )

    async def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        """Text -> tokens on the GPU worker, bounded: text no slot could hold is refused first."""
        self.check_text_fits(text)
        try:
            if parse_special:  # in slices: the worker is every stream's (engine/slices.py)
                return await tokenize_sliced(self._worker, self._backend(), text, add_special=add_special)
            return await self._worker.call(
                lambda: self._backend().tokenize(text, add_special=add_special, parse_special=parse_special)
            )
        except UnicodeEncodeError:  # JSON's "\ud800": a str, but no UTF-8 (benchmarks/hostile.py)
            raise ProtocolError(
                ErrorCode.BAD_JSON, "text holds a lone surrogate "
                "(U+D800..U+DFFF): not valid Unicode", status=Status.BAD_REQUEST
            ) from None

    async def tokenize_text(self, text: str) -> list[int]:
        """Prompt text -> tokens, refusing prompts that cannot fit."""
        tokens = await self.tokenize(text, add_special=True)
        if not tokens:
            raise ProtocolError(ErrorCode.BAD_JSON, "prompt is empty", status=Status.BAD_REQUEST)
        self.check_prompt_fits(len(tokens))
        return tokens

    def slot_room(self) -> str:
        """What a prompt or blob refused for its length is told of the slots."""
        return (
            f"a slot holds {self.n_ctx_slot} with room for one generated token "
            f"({kv_layout(self._backend())} KV cache of {self.n_ctx} cells, {self._backend().n_slots} slots)"
        )

    def check_prompt_fits(self, n_tokens: int) -> None:
        """Refuse a prompt no slot can hold (with room for one generated token)."""
        if n_tokens >= self.n_ctx_slot:
            raise PromptTooLong(f"prompt has {n_tokens} tokens; {self.slot_room()}")


def _spelling(tokens: list[int], text: bytes, text_of: Callable[[int], bytes]) -> tuple[int, ...]:
    """A tag's tokens without the leading ones it can do without: a SentencePiece vocabulary
    tokenizes ``</think>`` with its word-start space first, and a forced space would end up in
    the reasoning's text."""
    while len(tokens) > 1 and text in b"".join(text_of(t) for t in tokens[1:]):
        tokens = tokens[1:]
    return tuple(tokens)
