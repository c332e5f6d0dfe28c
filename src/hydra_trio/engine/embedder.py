"""Embedding and rerank requests (vLLM's pooling runner): inputs tokenized, admitted within
their own limits, batched into calls of the embedding context (llama/embedding.py: a second
context on the served model) on the one GPU worker, and read as vectors or scores.

No task of its own: a request puts its inputs at the end of a bounded line and, holding the
turn (a fair ``trio.Lock``), takes the oldest inputs there, its own or others', into one
worker call, until its own are done. Inputs that arrive together share calls, and every wait
stays in its request's scope: a request cancelled or out of time takes its inputs out of the
line (inputs of a call it led that did not finish go back to the line's head for the next).
The worker serves calls first come, first served, so between two embedding calls every step
batch that waits runs; while streams generate, a call carries at most --step-token-budget
tokens of inputs (at least one input), as a prompt's part in a step batch does, so the
streams keep their pace.
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


def embeddings_wanted(settings: Settings, model_pooling: str | None) -> tuple[bool, str | None]:
    """Whether the engine serves embeddings, and with which pooling (None: the model's own):
    --embeddings, --pooling and --reranking ask; a GGUF that declares a pooling type (an
    embedding model, a reranker) gets them unless --no-embeddings."""
    pooling = "rank" if settings.reranking else None if settings.pooling == "model" else settings.pooling
    if settings.embeddings is not None:
        return settings.embeddings, pooling
    return pooling is not None or model_pooling not in (None, "none"), pooling


@dataclass(slots=True)
class _Input:
    tokens: Sequence[int]
    vector: np.ndarray | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class Pooled:
    """A request's outcome: per input its vector (a rank head's: its scores) and tokens."""

    vectors: list[np.ndarray]
    n_tokens: list[int]
    wait_s: float = 0.0  # in line and on the worker
    calls: int = 0  # worker calls it led
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
        self._turn = trio.Lock()  # FIFO: requests lead calls in the order they came
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

    # ---- inputs ----------------------------------------------------------------------------

    async def tokenize(self, texts: Sequence[str | Sequence[int]], *, add_special: bool = True) -> list[list[int]]:
        """Each input as tokens (texts with the model's BOS/EOS, as llama-server tokenizes
        them, all in one worker call; token ids checked), each within one embedding batch."""
        shape, n_vocab = self._shape(), self._backend().info.n_vocab
        limit = _BYTES_PER_TOKEN * shape.n_batch
        for i, t in enumerate(texts):
            if isinstance(t, str):
                if not t:
                    raise bad_param(f"input {i} is an empty string", "input")
                if len(t) > limit // 4 and len(t.encode("utf-8", "surrogatepass")) > limit:
                    raise ProtocolError(ErrorCode.TOO_LARGE, f"input {i} is over {limit} bytes: an input holds at most {shape.n_batch} tokens (--batch-size)", status=Status.BAD_REQUEST)
            elif not t or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n_vocab for x in t):
                raise bad_param(f"input {i} must be a non-empty string or array of token ids (0..{n_vocab - 1})", "input")
        backend = self._backend()
        try:
            tokens = await self._worker.call(
                lambda: [backend.tokenize(t, add_special=add_special) if isinstance(t, str) else list(t) for t in texts]
            )
        except UnicodeEncodeError:
            raise bad_param("an input holds a lone surrogate (U+D800..U+DFFF): not valid Unicode", "input") from None
        return tokens

    async def pair_tokens(self, query: str, documents: Sequence[str]) -> list[list[int]]:
        """The rank head's input for each document, in one worker call, as llama-server's
        format_prompt_rerank writes it: the GGUF's "rerank" template with both filled in
        (tokenized without BOS, specials parsed), else [BOS] query [EOS] [SEP] document [EOS],
        each mark as the tokenizer adds it (EOS: SEP where the vocabulary has none)."""
        backend = self._backend()
        template = backend.info.rerank_template
        roles = backend.info.roles
        eos = roles.get("eos") if roles.get("eos") is not None else roles.get("sep")
        texts = [query, *documents]
        if any(not isinstance(t, str) for t in texts):
            raise bad_param("query and documents must be strings", "documents")
        limit = _BYTES_PER_TOKEN * self._shape().n_batch
        for t in texts:
            if len(t) > limit // 4 and len(t.encode("utf-8", "surrogatepass")) > limit:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"a query or document is over {limit} bytes: a pair holds at most {self._shape().n_batch} tokens (--batch-size)", status=Status.BAD_REQUEST)

        def marks(*pairs: tuple[bool, int | None]) -> list[int]:
            return [t for add, t in pairs if add and t is not None]

        def run() -> list[list[int]]:
            if template is not None:
                return [backend.tokenize(template.replace("{query}", query).replace("{document}", d), add_special=False)
                        for d in documents]
            q = backend.tokenize(query, add_special=False, parse_special=False)
            head = [*marks((roles.add_bos, roles.get("bos"))), *q, *marks((roles.add_eos, eos), (roles.add_sep, roles.get("sep")))]
            tail = marks((roles.add_eos, eos))
            return [[*head, *backend.tokenize(d, add_special=False, parse_special=False), *tail] for d in documents]

        try:
            return await self._worker.call(run)
        except UnicodeEncodeError:
            raise bad_param("the query or a document holds a lone surrogate (U+D800..U+DFFF): not valid Unicode", "documents") from None

    # ---- running ---------------------------------------------------------------------------

    async def run(self, inputs: Sequence[Sequence[int]], *, wait_s: float = math.inf, what: str = "input") -> Pooled:
        """The vectors of tokenized ``inputs`` (raw: normalise with ``normalized``), each
        refused (400) past one embedding batch; the line full: 503 (busy, retry); waited
        ``wait_s`` without being done: 503 too. ``what``: the request's name for an input
        (its parameter in a refusal: ``input``, or a rerank's ``documents``)."""
        shape, s = self._shape(), self._settings
        name = "document" if what == "documents" else what
        for i, tokens in enumerate(inputs):
            if not tokens:
                raise bad_param(f"{name} {i} has no tokens", what)
            if len(tokens) > shape.n_batch:
                raise bad_param(f"{name} {i} has {len(tokens)} tokens{' with the query' if what == 'documents' else ''}; "
                                f"an input holds at most {shape.n_batch} (--batch-size: the embedding context's batch, "
                                "which pools an input whole)", what)
        if len(inputs) > s.embd_max_waiting:
            raise bad_param(f"{len(inputs)} {what}; at most {s.embd_max_waiting} a request (--embd-max-waiting)", what)
        if len(self._line) + len(inputs) > s.embd_max_waiting:
            raise ProtocolError(ErrorCode.SLOT_BUSY, f"{len(self._line)} embedding inputs are waiting (--embd-max-waiting {s.embd_max_waiting})", status=Status.BUSY)
        mine = [_Input(t) for t in inputs]
        self._line.extend(mine)
        t0 = trio.current_time()
        calls = 0
        try:
            with trio.move_on_after(wait_s) as waited:
                while any(x.vector is None and x.error is None for x in mine):
                    async with self._turn:
                        if self._line and any(x.vector is None and x.error is None for x in mine):
                            await self._call()
                            calls += 1
            if waited.cancelled_caught:
                raise ProtocolError(ErrorCode.SLOT_BUSY, f"embedding inputs not done in {wait_s:g} s", status=Status.BUSY)
        finally:
            pending = set(map(id, mine))
            self._line = deque(x for x in self._line if id(x) not in pending)  # what is left of ours
        for x in mine:
            if x.error is not None:
                raise x.error
        return Pooled([x.vector for x in mine if x.vector is not None], [len(x.tokens) for x in mine],
                      trio.current_time() - t0, calls)

    def normalized(self, vector: np.ndarray, norm: int | None) -> np.ndarray:
        """A pooled vector normalised as llama-server does (``norm``: the request's
        embd_normalize, None: --embd-normalize); token vectors (pooling none) are not."""
        return normalize(vector, self._settings.embd_normalize if norm is None else norm)

    async def _call(self) -> None:
        """One worker call of the inputs at the line's head: at most embd_batch_inputs of them
        and the batch's tokens (--step-token-budget while streams generate), at least one."""
        shape, line = self._shape(), self._line
        budget = min(self._settings.step_token_budget, shape.n_batch) if self._streams_running() else shape.n_batch
        taken: list[_Input] = []
        n = 0
        while line and len(taken) < shape.n_seq_max and (not taken or n + len(line[0].tokens) <= budget):
            x = line.popleft()
            taken.append(x)
            n += len(x.tokens)
        batch = [x.tokens for x in taken]

        def work() -> list[np.ndarray]:
            # On the worker: after a CONFIGURE T3 reload the new model's context is made here.
            context = self._backend().embedding_context(self._pooling, shape.n_seq_max)
            self.shape = context.shape
            return context.run(batch)

        try:
            vectors = await self._worker.call(work)
        except trio.Cancelled:
            line.extendleft(reversed(taken))  # not done: the next one in turn takes them
            raise
        except ProtocolError as exc:  # the engine stopped
            for x in taken:
                x.error = exc
            return
        except Exception as exc:  # each owner raises it; the engine stays up
            err = ProtocolError(ErrorCode.INTERNAL, f"embedding call failed: {type(exc).__name__}: {exc}")
            for x in taken:
                x.error = err
            return
        for x, v in zip(taken, vectors, strict=True):
            x.vector = v
        self.inputs_done += len(taken)
        self.calls += 1
