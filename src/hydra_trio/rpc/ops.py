"""What each opcode does (spec §2). The connection loop (listener.py) owns the framing rules."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .. import __version__
from ..concurrency import CPU_OFFLOAD_MIN_BYTES, run_cpu_bound
from ..config import Settings
from ..engine import GenerationParams, KvCopy
from ..observability import request_extra
from ..serving import slot_state
from ..wire.errors import ErrorCode, ProtocolError, Status
from ..wire.frames import parse_decode_frame, v3_head_len, v3_kv_span
from ..wire.kvpull import KV_PULL_MAX_REQUEST_BYTES, parse_pull_request
from ..wire.protocol import Op, decode_json_object, parse_slot_key
from .connection import Connection
from .peer import HangUp

if TYPE_CHECKING:
    import logging

    from ..engine import Engine
    from ..serving import AppState

Buffer = bytes | bytearray | memoryview


@dataclass(slots=True)
class OpContext:
    conn: Connection
    key: bytes
    trace: str
    log: logging.LoggerAdapter  # type: ignore[type-arg]
    payload_len: int
    slot_id: int = 0
    kv_digest: int | None = None  # XXH3 of the DECODE kv segment, hashed as it arrived
    # Gives the request payload's budget back early (idempotent): an op that has parsed it
    # (PREFILL's JSON) and will charge its reply must not wait behind its own request.
    release_payload: Callable[[], None] = field(default=lambda: None)

    def request_line(self, route: str, status: str, **fields: Any) -> dict[str, Any]:
        """``extra=`` for an RPC op's request line: its trace is the request id (a router's
        X-Request-Id when it sent one)."""
        fields.setdefault("slot", self.slot_id)
        fields.setdefault("request_id", self.trace or None)
        return request_extra(route=route, status=status, **fields)


class StartedWork(Protocol):
    """Work an op started that must not outlive an unsent reply (a DECODE request)."""

    def commit(self) -> None: ...

    async def abandon(self) -> None: ...


@dataclass(slots=True)
class Reply:
    status: Status
    meta: dict[str, Any]
    payload: list[Buffer] = field(default_factory=list)
    send_chunk: int | None = None
    # Committed once the reply is written; abandoned if it could not be (nobody will learn
    # what it started).
    started: StartedWork | None = None
    # Payload-budget bytes the payload was charged (a snapshot): released once it is sent,
    # or could not be.
    held: int = 0

    @property
    def payload_len(self) -> int:
        return sum(len(p) for p in self.payload)

    @classmethod
    def ok(
        cls,
        meta: dict[str, Any],
        payload: list[Buffer] | None = None,
        send_chunk: int | None = None,
        started: StartedWork | None = None,
    ) -> Reply:
        return cls(Status.OK, meta, payload or [], send_chunk, started)

    @classmethod
    def error(cls, err: ProtocolError) -> Reply:
        return cls(err.status, err.meta())


@dataclass(frozen=True, slots=True)
class OpSpec:
    name: str
    cap: Callable[[Settings], int]
    precheck: Callable[[OpContext], None]
    run: Callable[[OpContext, memoryview], Awaitable[Reply]]
    hang_up: HangUp = HangUp.NEVER  # what stops the op as its caller's hang-up (peer.py)
    # Reads the payload (default: Connection.read_payload); may fill in the context.
    receive: Callable[[OpContext], Awaitable[np.ndarray]] | None = None
    # A refusal before the payload drains up to the op's cap, not just --drain-limit-bytes:
    # clients of the KV ops write the whole blob before they read (rpc/listener.py).
    drain_to_cap: bool = False


CAPABILITIES = (
    "prefill",
    "decode",
    "state_transfer",
    "tokenizer",
    "model_name",
    "model_quant",
    "model_capabilities",
    "configure",
    "kv_hash",
    "chat_completions",
    "completions",
)

class OpTable:
    def __init__(self, state: AppState) -> None:
        self.state = state
        no_payload = self._no_payload_cap
        self._ops: dict[int, OpSpec] = {
            Op.STATE_GET: OpSpec("STATE_GET", no_payload, self._slot_free, self.state_get),
            Op.STATE_PUT: OpSpec(
                "STATE_PUT", lambda st: st.max_kv_bytes, self._slot_free, self.state_put, drain_to_cap=True
            ),
            Op.STATE_META: OpSpec("STATE_META", no_payload, self._slot_exists, self.state_meta),
            Op.CONFIGURE: OpSpec("CONFIGURE", lambda st: st.max_json_bytes, self._slot_or_empty, self.configure),
            Op.INFO: OpSpec("INFO", no_payload, self._slot_or_empty, self.info),
            Op.PREFILL: OpSpec(
                "PREFILL", lambda st: st.max_json_bytes, self._slot_free, self.prefill, hang_up=HangUp.EOF
            ),
        }
        if state.decodes is not None:
            self._ops[Op.DECODE] = OpSpec(
                "DECODE",
                self._decode_cap,
                self._slot_exists,
                self.decode,
                hang_up=HangUp.RESET,
                receive=self._receive_decode,
                drain_to_cap=True,
            )
        if state.exports is not None:
            self._ops[Op.KV_PULL] = OpSpec(
                "KV_PULL", lambda _st: KV_PULL_MAX_REQUEST_BYTES, self._empty_key, self.kv_pull
            )

    @property
    def engine(self) -> Engine:
        engine = self.state.engine
        assert engine is not None, "RPC starts after the engine"
        return engine

    def name(self, op: int) -> str:
        try:
            return Op(op).name
        except ValueError:
            return f"0x{op:02x}"

    def get(self, op: int) -> OpSpec:
        spec = self._ops.get(op)
        if spec is not None:
            return spec
        if op in (Op.EXPERT_MODE, Op.QUANT_SWAP, Op.PIPELINE_ATTACH):
            raise ProtocolError(ErrorCode.NOT_IMPLEMENTED, f"{Op(op).name} is not implemented by hydra-trio")
        if op == Op.DECODE:
            raise ProtocolError(ErrorCode.NOT_IMPLEMENTED, "DECODE is not available")
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op 0x{op:02x}")

    # ---- prechecks (before the payload is read) ----------------------------------------

    def _decode_cap(self, settings: Settings) -> int:
        return 12 + settings.max_decode_header_bytes + settings.max_json_bytes + settings.max_kv_bytes

    def _no_payload_cap(self, settings: Settings) -> int:
        return settings.drain_limit_bytes  # ignored, but bounded

    def _slot_exists(self, ctx: OpContext) -> None:
        ctx.slot_id = parse_slot_key(ctx.key)
        self.engine.slot_info(ctx.slot_id)  # NO_SLOT

    def _slot_free(self, ctx: OpContext) -> None:
        self._slot_exists(ctx)
        slot = self.engine.slot_info(ctx.slot_id)
        if slot.busy:
            raise ProtocolError(ErrorCode.SLOT_BUSY, f"slot {ctx.slot_id} is busy ({slot.owner})")

    def _slot_or_empty(self, ctx: OpContext) -> None:
        ctx.slot_id = parse_slot_key(ctx.key, empty_means_zero=True)
        self.engine.slot_info(ctx.slot_id)  # NO_SLOT

    def _empty_key(self, ctx: OpContext) -> None:
        if ctx.key:
            raise ProtocolError(ErrorCode.BAD_KEY, "KV_PULL takes an empty key (the export id is in the payload)")

    def _owner(self, ctx: OpContext, op: str) -> str:
        return f"rpc:{op}:{ctx.trace or ctx.conn.peer}"

    # ---- ops ---------------------------------------------------------------------------

    async def state_get(self, ctx: OpContext, _payload: memoryview) -> Reply:
        engine = self.engine
        settings = self.state.settings
        snap = await slot_state.snapshot(
            engine, ctx.slot_id, self._owner(ctx, "STATE_GET"), self.state.payload_budget, settings.idle_timeout_s
        )
        ctx.log.info(
            "STATE_GET slot %d: n_past %d, %d bytes in %.1f ms", ctx.slot_id, snap.n_past, snap.size, snap.ms,
            extra=ctx.request_line("STATE_GET", "done", e2e_ms=round(snap.ms, 3)),
        )
        meta = {
            "n_past": snap.n_past,
            "state_size": snap.state_size,
            "kv_hash": snap.kv_hash,
            **identity_fields(engine),
            **(snap.made_under or {}),  # ours: "lora", the adapter set the slot's KV was made under
        }
        reply = Reply.ok(meta, list(snap.parts), send_chunk=snap.send_chunk)
        reply.held = snap.held
        return reply

    async def state_put(self, ctx: OpContext, payload: memoryview) -> Reply:
        meta = await slot_state.restore(self.engine, ctx.slot_id, payload, self._owner(ctx, "STATE_PUT"))
        self.state.metrics.restore_bytes.inc(len(payload))
        ctx.log.info(
            "STATE_PUT slot %d: n_past "
            "%d, %d bytes in %.1f ms", ctx.slot_id, meta["n_past"], len(payload), meta["restore_ms"],
            extra=ctx.request_line("STATE_PUT", "done", e2e_ms=round(meta["restore_ms"], 3)),
        )
        return Reply.ok(meta)

    async def state_meta(self, ctx: OpContext, _payload: memoryview) -> Reply:
        return Reply.ok(slot_state.slot_meta(self.engine, ctx.slot_id))

    async def info(self, _ctx: OpContext, _payload: memoryview) -> Reply:
        return Reply.ok(self.info_meta())

    def info_meta(self) -> dict[str, Any]:
        engine = self.engine
        identity = engine.identity
        caps = list(CAPABILITIES)
        if Op.DECODE in self._ops:
            caps.insert(0, "merged_decode")
        if Op.KV_PULL in self._ops:
            caps.append("kv_pull")
        if identity.model_hash:  # computed at every load (engine/modelfile.py)
            caps.append("model_hash")
        return {
            "engine": "hydra-trio",
            "version": __version__,
            "capabilities": caps,
            "mode": "solo",
            "solo_active": True,
            "pipeline_capable": False,
            "n_slots": engine.n_slots,
            "n_ctx": engine.n_ctx,
            "n_vocab": engine.n_vocab,
            "preset_aliases": [engine.served_name],
            **identity.info_fields(),
            **engine.runtime_fields(),  # ours: devices, n_gpu_layers, flash_attn, chat_template
        }

    async def configure(self, ctx: OpContext, payload: memoryview) -> Reply:
        body = await run_cpu_bound(partial(decode_json_object, payload, "CONFIGURE"), len(payload))
        outcome = await self.engine.configure(ctx.slot_id, body)
        ctx.log.info(
            "CONFIGURE slot %d: applied %s, unused %s, deferred %s",
            ctx.slot_id, sorted(outcome.applied), sorted(outcome.unused), outcome.deferred,
        )
        return Reply.ok(outcome.meta())

    async def _receive_decode(self, ctx: OpContext) -> np.ndarray:
        """A large DECODE's kv segment is hashed as it arrives (each read as it lands), so
        its check costs nothing once the last byte is in."""
        if ctx.payload_len < CPU_OFFLOAD_MIN_BYTES:
            return await ctx.conn.read_payload(ctx.payload_len)
        max_header = self.state.settings.max_decode_header_bytes
        total = ctx.payload_len

        def span_of(head: memoryview) -> int | tuple[int, int] | None:
            if len(head) < 4:
                return 4
            need = v3_head_len(head[:4])
            if need > 12 + max_header:
                return None  # a simple frame or an oversized header: the parse decides
            if len(head) < need:
                return need
            return v3_kv_span(head, total, max_header_bytes=max_header)

        payload, ctx.kv_digest = await ctx.conn.read_payload_hashing(total, span_of)
        return payload

    async def decode(self, ctx: OpContext, payload: memoryview) -> Reply:
        settings = self.state.settings
        parse = partial(
            parse_decode_frame,
            payload,
            max_header_bytes=settings.max_decode_header_bytes,
            max_prompt_bytes=settings.max_json_bytes,
            max_kv_bytes=settings.max_kv_bytes,
            kv_digest=ctx.kv_digest,
        )
        # JSON, and the kv hash unless it was computed as the bytes arrived.
        frame = await run_cpu_bound(parse, len(payload))
        decodes = self.state.decodes
        assert decodes is not None
        # Validation and restore run under this handler's scope (a peer that hangs up
        # cancels them); refusals arrive here as ProtocolError.
        started = await decodes.nursery.start(
            partial(decodes.run_request, ctx.slot_id, frame, trace=ctx.trace, rlog=ctx.log)
        )
        meta = started.meta
        ctx.log.info(
            "DECODE slot %d: id %d, %d kv bytes restored in %.1f ms",
            ctx.slot_id,
            meta["decode_request_id"],
            meta["kv_bytes"],
            meta["restore_slot_ms"],
            # Its end is the decode manager's line, under the same id.
            extra=ctx.request_line("DECODE", "accepted", request_id=ctx.trace or f"decode-{meta['decode_request_id']}"),
        )
        return Reply.ok(meta, started=started)

    async def kv_pull(self, ctx: OpContext, payload: memoryview) -> Reply:
        """Hand an export's blob to the decode engine that names it (wire/kvpull.py). The
        export leaves the store now: pulled once, whether or not the reply gets through."""
        export_id, wants_shm = parse_pull_request(payload)
        exports = self.state.exports
        assert exports is not None
        export = exports.take(export_id, hand_over=wants_shm)
        if export is None:
            raise ProtocolError(
                ErrorCode.EXPORT_NOT_FOUND, f"no KV export {export_id}: unknown, expired or already pulled"
            )
        meta = {
            "export_id": export.id,
            "n_past": export.n_past,
            "state_size": len(export.parts[1]),
            "kv_bytes": export.nbytes,
            "kv_hash": export.kv_hash,
            **export.identity,  # of the model that made the KV
        }
        # Same host: the puller maps the file (and unlinks it); no byte crosses the socket.
        shm = export.shm if wants_shm else None
        meta["transport"] = "tcp" if shm is None else "shm"
        if shm is not None:
            meta["shm_path"] = str(shm.path)
        ctx.log.info(
            "KV_PULL %s: %d positions, %d bytes%s", export.id, export.n_past, export.nbytes,
            "" if shm is None else " handed over in shared memory",
            extra=ctx.request_line("KV_PULL", "done", slot=None),
        )
        return Reply.ok(meta, list(export.parts)) if shm is None else Reply.ok(meta)

    async def prefill(self, ctx: OpContext, payload: memoryview) -> Reply:
        if self.state.draining:
            raise ProtocolError(ErrorCode.SLOT_BUSY, "engine is draining for shutdown")
        body = await run_cpu_bound(partial(decode_json_object, payload, "PREFILL"), len(payload))
        ctx.release_payload()  # parsed: its bytes are no longer needed
        engine = self.engine
        t0 = time.perf_counter()
        # The one request policy (a DECODE of the same request would be refused the same).
        prepared = await engine.prepare("decode", body)
        tokens = prepared.tokens
        assert tokens is not None, "tokenized"
        budget, held = self.state.payload_budget, 0

        async def reserve(size: int) -> None:  # the copy is charged until the reply is sent
            nonlocal held
            await budget.take(size, within_s=self.state.settings.idle_timeout_s, what="a PREFILL reply")
            held = size

        params = prepared.params
        try:
            async with engine.claim(self._owner(ctx, "PREFILL"), slot=ctx.slot_id, lora=params.lora) as lease:
                logits = await lease.prefill(tokens, salt=params.cache_salt, lora=params.lora)
                copy = await lease.copy_out(logits=logits, reserve=reserve)
                made_under = lease.kv_claims()  # the LoRA adapter set: a DECODE's kv_metadata claims it
            return await self._prefill_reply(ctx, body, tokens, copy, t0, held, made_under, params)
        except BaseException:
            budget.release(held)
            raise

    async def _prefill_reply(
        self, ctx: OpContext, body: dict[str, Any], tokens: list[int], copy: KvCopy, t0: float, held: int,
        made_under: dict[str, Any], params: GenerationParams,
    ) -> Reply:
        lora = params.lora_name
        engine = self.engine
        identity = engine.identity
        prefill_ms = (time.perf_counter() - t0) * 1000.0
        parts = copy.parts
        n_past = copy.n_past
        self.state.metrics.prompt_tokens.labels("prefill").inc(len(tokens))
        ctx.log.info(
            "PREFILL slot %d: %d "
            "tokens in %.1f ms%s", ctx.slot_id, n_past, prefill_ms, "" if lora is None else f", LoRA {lora}",
            extra=ctx.request_line("PREFILL", "done", prompt_tokens=n_past, e2e_ms=round(prefill_ms, 3), lora=lora),
        )
        meta = {
            "n_past": n_past,
            "state_size": copy.state_size,
            "logits_size": len(parts[2]),
            "prefill_ms": round(prefill_ms, 3),
            "kv_hash": await copy.kv_hash(),
            # One model is served: a PREFILL that names another is served by it, and says so
            # (the spec's model_fallback), rather than answered as if it were that model.
            # (A "model" naming a LoRA adapter was served by it: params.model.)
            "model_fallback": params.model is None and _names_another_model(body.get("model"), identity.model_alias,
                                                                            identity.model_name),
            **identity.fields(),
            **made_under,
        }
        reply = Reply.ok(meta, parts)
        reply.held = held
        return reply


def identity_fields(engine: Engine) -> dict[str, Any]:
    """The resident model's identity fields, as replies carry them."""
    identity = engine.identity
    return identity.fields()


def _names_another_model(asked: Any, alias: str, name: str) -> bool:
    """Whether a request's ``model`` names a model this engine does not serve (absent or
    null: it names none)."""
    if asked is None:
        return False
    if not isinstance(asked, str):
        raise ProtocolError(ErrorCode.BAD_JSON, "model must be a string", status=Status.BAD_REQUEST)
    return asked not in (alias, name)
