"""Embedding and rerank requests (vLLM's pooling runner): inputs admitted within their own
limits, batched into calls of the embedding context (llama/embedding.py: a second context on
the served model) on the one GPU worker, and read as vectors or scores.

A task of its own, the pump (``run``, in the engine's nursery): a request puts its inputs at
the end of a bounded line and waits until they are settled; the pump takes the oldest inputs
there, whoever's, into one worker call after another while the line holds any. Inputs that
arrive together share calls. It has a task because the worker sat idle between calls when
requests led them in turn (3-4 % of the wall time at 8 clients, measured): the request that
led a call answered, and the others its call settled answered (~2 ms of trio-thread work
each), before the next leader was scheduled and handed the worker its call. The pump hands
it the next call first, and the call's requests are woken from the worker thread as that
call goes into llama_decode (which releases the GIL), so replies are written while it
computes. Every wait stays in its request's scope: a request cancelled or out of time
(``wait_s`` bounds the wait until one of its inputs is in a call) takes its inputs out of the
line; those in a call then running are computed and dropped.
An input is tokenized in the call that computes it (texts are a llama.cpp call too): one
trip to the worker a call, where a separate tokenizing call would wait behind the embedding
call running then. The worker serves calls first come, first served, so between two
embedding calls every step batch that waits runs; while streams generate, a call carries at
most --step-token-budget tokens of inputs (at least one input), as a prompt's part in a step
batch does, so the streams keep their pace.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import trio

from ..config import Settings
from ..wire.errors import ErrorCode, ProtocolError, Status, bad_param
from .llama import LlamaBackend, PooledShape, normalize
from .worker import GpuWorker

# Text refused untokenized past this many bytes a token of the embedding batch (inputs.py's rule).
_BYTES_PER_TOKEN = 32

# How an input becomes tokens on the worker (a text's tokenizer call, a rerank pair's layout).
Tokenizer = Callable[[LlamaBackend], list[int]]


def embeddings_wanted(settings: Settings, model_pooling: str | None) -> tuple[bool, str | None]:
    """Whether the engine serves embeddings, and with which pooling (None: the model's own):
    --embeddings, --pooling and --reranking ask; a GGUF that declares a pooling type (an
    embedding model, a reranker) gets them unless --no-embeddings."""
    pooling = "rank" if settings.reranking else None if settings.pooling == "model" else settings.pooling
    if settings.embeddings is not None:
        return settings.embeddings, pooling
    return pooling is not None or model_pooling not in (None, "none"), pooling


@dataclass(slots=True, eq=False)
class _Request:
    """A request's inputs not yet settled, and its wait: ``done`` once none is left."""

    left: int
    # Its wait for a call: ``wait_s``, lifted (deadline inf) once any of its inputs is in one.
    waited: trio.CancelScope
    done: trio.Event = field(default_factory=trio.Event)
    calls: int = 0  # worker calls that settled its inputs
    gone: bool = False  # left (cancelled, out of time): its inputs are no call's business

    def settled(self, n: int) -> None:
        self.left -= n
        self.calls += 1
        if self.left <= 0:
            self.done.set()


@dataclass(slots=True)
class _Input:
    name: str  # what a refusal calls it: "input 3", "document 0"
    param: str  # the request's parameter it came from
    tokens: list[int] | None  # None: not tokenized yet (``tokenizer`` runs in its call)
    request: _Request = field(init=False)
    tokenizer: Tokenizer | None = None
    vector: np.ndarray | None = None
    error: BaseException | None = None

    @property
    def pending(self) -> bool:
        return self.vector is None and self.error is None


@dataclass(slots=True)
class Pooled:
    """A request's outcome: per input its vector (a rank head's: its scores) and tokens."""

    vectors: list[np.ndarray]
    n_tokens: list[int]
    wait_s: float = 0.0  # in line and on the worker
    calls: int = 0  # worker calls that settled its inputs
    prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_tokens = sum(self.n_tokens)


class Embedder:
    """The engine's pooled requests (``Engine.pooling``): embeddings and rerank scores."""

    def __init__(
        self, backend: Callable[[], LlamaBackend], worker: GpuWorker, settings: Settings, *, pooling: str | None,
        streams_running: Callable[[], bool],
    ) -> None:
        self._backend = backend
        self._worker = worker
        self._settings = settings
        self._pooling = pooling
        self._streams_running = streams_running
        self._line: deque[_Input] = deque()
        self._filled = trio.Event()  # set when inputs join the line: the pump's wait
        self._stopped = False  # the pump has ended with the engine: requests are refused
        self.shape: PooledShape | None = None  # set by open()
        self.inputs_done = 0
        self.calls = 0

    async def open(self) -> PooledShape:
        """Make the embedding context at load, and (unless --no-warmup) run one input through
        it: a model it cannot serve, or a kernel that faults, fails the start."""
        s = self._settings
        backend = self._backend()

        def make() -> PooledShape:
            context = backend.embedding_context(self._pooling, s.embd_batch_inputs)
            if s.warmup:
                bos = backend.info.roles.get("bos")
                context.run([[bos if bos is not None else 0]])
            return context.shape

        self.shape = await self._worker.call(make)
        return self.shape

    def _shape(self) -> PooledShape:
        assert self.shape is not None, "open() ran at load"
        return self.shape

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The pump, one of the engine's own tasks (``EngineCore.run`` owns it): while the line
        holds inputs, one worker call of its head after another, each call's requests woken
        once the next call is computing. It ends with the engine: a call running then
        finishes (its thread cannot be abandoned) and answers its inputs; those still in the
        line are refused (engine is stopped), as is every request after."""
        wake: Callable[[], None] = _nobody
        task_status.started()
        try:
            while True:
                if not self._line:
                    wake()  # nothing to compute next: answer now
                    self._filled = trio.Event()
                    await self._filled.wait()
                    continue
                wake = await self._call(wake)
        finally:
            wake()
            self._stopped = True
            stopped = ProtocolError(ErrorCode.INTERNAL, "engine is stopped", status=Status.BUSY)
            left = list(self._line)
            self._line.clear()
            for x in left:
                x.error = stopped
            _settled(left)

    # ---- requests --------------------------------------------------------------------------

    async def embed(self, inputs: Sequence[str | Sequence[int]], *, wait_s: float = math.inf) -> Pooled:
        """Each input's vector (raw: normalise with ``normalized``): a text tokenized with the
        model's BOS/EOS as llama-server tokenizes it, or token ids. Refused (400, naming the
        input) when empty, out of the vocabulary, or past one embedding batch."""
        n_vocab, limit = self._backend().info.n_vocab, self._text_limit()
        items = []
        for i, t in enumerate(inputs):
            if isinstance(t, str):
                if not t:
                    raise bad_param(f"input {i} is an empty string", "input")
                self._check_text(t, f"input {i}", "input", limit)
                items.append(_Input(f"input {i}", "input", None, _text_tokens(t)))
            elif t and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n_vocab for x in t):
                items.append(_Input(f"input {i}", "input", list(t)))
            else:
                raise bad_param(f"input {i} must be a non-empty string or array of token ids "
                                f"(0..{n_vocab - 1})", "input")
        return await self._run(items, wait_s)

    async def rerank(self, query: str, documents: Sequence[str], *, wait_s: float = math.inf) -> Pooled:
        """The rank head's scores of each (query, document) pair, written as llama-server's
        format_prompt_rerank writes it: the GGUF's "rerank" template with both filled in
        (tokenized without BOS, specials parsed), else [BOS] query [EOS] [SEP] document [EOS],
        each mark as the tokenizer adds it (EOS: SEP where the vocabulary has none)."""
        limit = self._text_limit()
        self._check_text(query, "the query", "query", limit)
        for i, d in enumerate(documents):
            self._check_text(d, f"document {i}", "documents", limit)
        return await self._run(
            [_Input(f"document {i}", "documents", None, _pair_tokens(query, d)) for i, d in enumerate(documents)],
            wait_s,
        )

    def _text_limit(self) -> int:
        return _BYTES_PER_TOKEN * self._shape().n_batch

    def _check_text(self, text: str, name: str, param: str, limit: int) -> None:
        """Text no embedding batch could hold is refused before it is tokenized."""
        if len(text) > limit // 4 and len(text.encode("utf-8", "surrogatepass")) > limit:
            raise bad_param(f"{name} is over {limit} bytes: an input holds at most {self._shape().n_batch} tokens "
                            "(--batch-size)", param)

    # ---- the line --------------------------------------------------------------------------

    async def _run(self, mine: list[_Input], wait_s: float) -> Pooled:
        """``mine`` through the line: the line full, 503 (busy, retry); none of them in a
        call within ``wait_s`` (as a slot's claim waits), 503 too: once one is, the request
        runs to its end; an input refused in its call (too long), 400 naming it."""
        s = self._settings
        if len(mine) > s.embd_max_waiting:
            param = mine[0].param
            raise bad_param(f"{len(mine)} {param}; at most {s.embd_max_waiting} a request (--embd-max-waiting)", param)
        if self._stopped:
            raise ProtocolError(ErrorCode.INTERNAL, "engine is stopped", status=Status.BUSY)
        if len(self._line) + len(mine) > s.embd_max_waiting:
            raise ProtocolError(ErrorCode.SLOT_BUSY, f"{len(self._line)} embedding inputs are waiting "
                                f"(--embd-max-waiting {s.embd_max_waiting})", status=Status.BUSY)
        t0 = trio.current_time()
        request = _Request(len(mine), trio.CancelScope(deadline=t0 + wait_s))
        for x in mine:
            x.request = request
        self._line.extend(mine)
        self._filled.set()
        try:
            with request.waited:
                await request.done.wait()
            if request.waited.cancelled_caught:
                raise ProtocolError(ErrorCode.SLOT_BUSY, "embedding inputs waited "
                                    f"{wait_s:g} s for the worker", status=Status.BUSY)
        finally:
            if not request.done.is_set():  # cancelled, or out of time: what is left of ours leaves the line
                request.gone = True  # a call running now drops ours (puts none back)
                # In place: the pump holds this deque.
                kept = [x for x in self._line if x.request is not request]
                self._line.clear()
                self._line.extend(kept)
        for x in mine:
            if x.error is not None:
                raise x.error
        return Pooled([x.vector for x in mine if x.vector is not None], [len(x.tokens or ()) for x in mine],
                      trio.current_time() - t0, request.calls)

    def normalized(self, vector: np.ndarray, norm: int | None) -> np.ndarray:
        """A pooled vector normalised as llama-server does (``norm``: the request's
        embd_normalize, None: --embd-normalize); token vectors (pooling none) are not."""
        return normalize(vector, self._settings.embd_normalize if norm is None else norm)

    async def _call(self, previous: Callable[[], None]) -> Callable[[], None]:
        """One worker call of the inputs at the line's head: at most embd_batch_inputs of them
        and the batch's tokens (--step-token-budget while streams generate), at least one.
        Inputs not tokenized yet are taken on trust and tokenized in the call; those of them
        that do not fit go back to the line's head, tokenized, and one past a whole batch is
        refused. Returns what wakes this call's requests (the pump runs it once the next
        call computes, or at once when none follows).

        ``previous`` wakes the requests of the call before: from the worker thread as this
        call's inputs go into llama_decode, which releases the GIL, so the trio thread writes
        their replies while the worker computes instead of before the next call is handed
        to it (3-4 % of the wall time at 8 clients, measured). If this call must wait for
        the worker (a step batch holds it or is ahead), they are woken now."""
        shape, line = self._shape(), self._line
        budget = min(self._settings.step_token_budget, shape.n_batch) if self._streams_running() else shape.n_batch
        taken: list[_Input] = []
        n = 0
        while line and len(taken) < shape.n_seq_max:
            request = line[0].request
            if request.gone or request.waited.cancel_called:  # leaving (out of time): its own wait removes it
                line.popleft()
                continue
            if taken and n + len(line[0].tokens or (0,)) > budget:
                break
            taken.append(line.popleft())
            n += len(taken[-1].tokens or (0,))
            request.waited.deadline = math.inf  # its request has its turn: it runs to its end
        if not taken:
            return previous
        deferred = previous if self._worker.idle() else None  # idle: this call starts at once
        if deferred is None:
            previous()
        token = trio.lowlevel.current_trio_token()
        backend_of, pooling = self._backend, self._pooling

        def work() -> tuple[list[list[int] | BaseException], int, list[np.ndarray]]:
            backend = backend_of()
            tokens: list[list[int] | BaseException] = []
            for x in taken:
                try:
                    tokens.append(x.tokens if x.tokens is not None else x.tokenizer(backend))  # type: ignore[misc]
                except UnicodeEncodeError:  # JSON's "\ud800": a str, but no UTF-8
                    tokens.append(bad_param(f"{x.name} holds a lone surrogate "
                                            "(U+D800..U+DFFF): not valid Unicode", x.param))
            # The inputs this call takes, in line order: a refused one (it never runs), and the
            # first that runs, and the next while the budget holds.
            fit, total = 0, 0
            for t in tokens:
                runs = isinstance(t, list) and 0 < len(t) <= shape.n_batch
                if runs and total and total + len(t) > budget:
                    break
                fit, total = fit + 1, total + (len(t) if runs else 0)  # type: ignore[arg-type]
            context = backend.embedding_context(pooling, shape.n_seq_max)  # after a T3 reload, the new model's
            self.shape = context.shape
            runs = [t for t in tokens[:fit] if isinstance(t, list) and 0 < len(t) <= shape.n_batch]
            if deferred is not None:
                token.run_sync_soon(deferred)
            return tokens, fit, context.run(runs) if runs else []

        try:
            tokens, fit, vectors = await self._worker.call(work)
        except trio.Cancelled:  # it never started (the engine stops): back first in line
            line.extendleft(reversed([x for x in taken if not x.request.gone]))
            raise
        except ProtocolError as exc:  # the engine stopped
            for x in taken:
                x.error = exc
            return _waker(taken)
        except Exception as exc:  # each owner raises it; the engine stays up
            err = ProtocolError(ErrorCode.INTERNAL, f"embedding call failed: {type(exc).__name__}: {exc}")
            for x in taken:
                x.error = err
            return _waker(taken)
        finally:
            previous()  # woken from the thread already (a no-op), or the call never got there
        done = iter(vectors)
        for x, t in zip(taken, tokens, strict=True):
            if isinstance(t, BaseException):
                x.error = t
                continue
            x.tokens = t
            if not t:
                x.error = bad_param(f"{x.name} has no tokens", x.param)
            elif len(t) > shape.n_batch:
                x.error = bad_param(
                    f"{x.name} has {len(t)} "
                    f"tokens{' with the query' if x.param == 'documents' else ''}; an input holds at "
                    f"most {shape.n_batch} (--batch-size: the embedding "
                    "context's batch, which pools an input whole)", x.param)
        for x in taken[:fit]:
            if x.error is None:
                x.vector = next(done)
        # Tokenized now, first in line (a request gone meanwhile takes none back).
        line.extendleft(reversed([x for x in taken[fit:] if x.error is None and not x.request.gone]))
        self.inputs_done += sum(1 for x in taken[:fit] if x.vector is not None)
        self.calls += 1
        return _waker(taken)


def _nobody() -> None:
    pass


def _waker(taken: list[_Input]) -> Callable[[], None]:
    """What settles a call's inputs against their requests, once however often it runs."""
    woken = False

    def wake() -> None:
        nonlocal woken
        if not woken:
            woken = True
            _settled(taken)

    return wake


def _settled(taken: list[_Input]) -> None:
    """Count a call's settled inputs against their requests (each input is taken pending
    and settles once: one put back to the line is still pending)."""
    counts: dict[int, tuple[_Request, int]] = {}
    for x in taken:
        if not x.pending:
            request, n = counts.get(id(x.request), (x.request, 0))
            counts[id(x.request)] = (request, n + 1)
    for request, n in counts.values():
        request.settled(n)


def _text_tokens(text: str) -> Tokenizer:
    """A text as llama-server tokenizes an embedding input: with the model's BOS/EOS, specials parsed."""
    return lambda backend: backend.tokenize(text, add_special=True)


def _pair_tokens(query: str, document: str) -> Tokenizer:
    def tokens(backend: LlamaBackend) -> list[int]:
        template = backend.info.rerank_template
        if template is not None:
            return backend.tokenize(
                template.replace("{query}", query).replace("{document}", document), add_special=False
            )
        roles = backend.info.roles
        eos = roles.get("eos") if roles.get("eos") is not None else roles.get("sep")
        marks = [
            (roles.add_bos, roles.get("bos")),
            (roles.add_eos, eos),
            (roles.add_sep, roles.get("sep")),
            (roles.add_eos, eos),
        ]
        bos, q_end, sep, d_end = ([t] if add and t is not None else [] for add, t in marks)
        q = backend.tokenize(query, add_special=False, parse_special=False)
        d = backend.tokenize(document, add_special=False, parse_special=False)
        return [*bos, *q, *q_end, *sep, *d, *d_end]

    return tokens
