"""A llama model and its context with one sequence per slot: loading, decoding, sampling.
Its slots' KV state in and out is kv_state.py's half of the class; the batched generation
steps (with speculative drafts) are steps.py's; its LoRA adapter sets lora_sets.py's; its
tokens (tokenizing, each token's text, end of generation) tokens.py's. What the model says of
itself (``ModelInfo``) is read by model_info.py.

Every method here is synchronous and must run on the GPU worker (engine/worker.py). The
backend owns the per-slot token lists so they always describe exactly what the KV holds,
whatever happens to the trio task that asked for the work.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from .chat import builtin_chat_templates
from .checkpoints import Checkpoints
from .devices import (
    OffloadReport,
    OffloadSettings,
    cpu_flags,
    flash_attn_applied,
    heap_for_buffers,
    offloaded_layers,
    read_ggml_devices,
    repack_choice,
    repacked_mib,
)
from .embedding import EmbeddingContext
from .kv_state import DecodeAborted, NoKvSpace, SlotStates
from .log import captured, init_llama
from .lora_sets import LoraSets
from .model_info import read_model_info
from .statematch import type_name
from .steps import BatchSteps
from .tokens import VocabTokens
from .types import (
    LogitsRow,
    LoraSet,
    SlotWatcher,
    StepPlanner,
    TokenSampler,
    common_prefix_len,
)

if TYPE_CHECKING:
    from .vision import Projector

log = logging.getLogger(__name__)


class LlamaBackend(SlotStates, BatchSteps, LoraSets, VocabTokens):
    """One llama model + context with ``n_slots`` sequences, one per slot.

    The KV cache is unified (one pool of cells shared by all slots, any slot may use all of
    it) or split (``kv_unified`` False: one stream of ``n_ctx / n_slots`` cells per slot, as
    llama-server lays it out; a sequence's attention then spans only its own cells).
    Unified: sequence ``n_slots`` is a scratch sequence, restores land there first and move
    into the slot only once llama.cpp accepted them, so a refused blob never touches a slot.
    Split: a restore goes straight into the slot's own stream (moving it between streams
    would copy the whole stream), and a refused one leaves the slot empty.
    """

    def __init__(
        self,
        model_path: str,
        *,
        n_slots: int,
        n_ctx: int,
        n_threads: int,
        n_batch: int = 512,
        type_k: int | None = None,
        type_v: int | None = None,
        offload: OffloadSettings | None = None,
        kv_unified: bool = True,
        swa_full: bool = False,
        ctx_checkpoints: int = 8,
        lora_paths: Sequence[str] = (),
        mmproj: str | None = None,
    ) -> None:
        init_llama()
        heap_for_buffers()  # before any buffer of the model or context is allocated
        self.kv_unified = kv_unified or n_slots == 1
        # Sliding-window layers keep only their window (+ one ubatch) of cells, as
        # llama-server does (common_params.swa_full false). llama.cpp's own context default
        # is the full-size SWA cache, where those layers' attention (and mask) spans every
        # cell of the sequence: measured 1.3x slower prefill at 16k (docs/performance.md).
        self.swa_full = swa_full
        self.ctx_checkpoints = ctx_checkpoints
        self.model_path = model_path
        self.n_slots = n_slots
        self.n_batch = n_batch
        self.offload_settings = offload or OffloadSettings()
        self.gpu_offload_supported = bool(llama_cpp.llama_supports_gpu_offload())
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = self.offload_settings.resolved_gpu_layers(self.gpu_offload_supported)
        mparams.main_gpu = self.offload_settings.main_gpu
        self.repack = repack_choice(self.offload_settings.repack, cpu_flags())
        mparams.use_extra_bufts = self.repack.enabled
        # What llama.cpp was really given (read back from the struct), for tests and reports.
        self.model_params_applied = {
            "n_gpu_layers": mparams.n_gpu_layers,
            "main_gpu": mparams.main_gpu,
            "use_extra_bufts": bool(mparams.use_extra_bufts),
        }
        self._model, load_log = captured(lambda: llama_cpp.llama_model_load_from_file(model_path.encode(), mparams))
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load model {model_path!r}")
        self._load_log = load_log
        # LoRA adapters (--lora), loaded with the model: an adapter's id is its place here.
        self.lora_paths = tuple(lora_paths)
        self._adapters = [self._load_adapter(path) for path in self.lora_paths]
        self.lora_switch_s = 0.0  # measured by measure_lora_switch (steps.py)
        self.devices = read_ggml_devices()
        self.builtin_templates = builtin_chat_templates()
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        # Sliding-window attention (Gemma 2/3, ...): llama.cpp drops a sequence's SWA-layer
        # cells older than the window as it advances, so a slot cut back by more than one
        # position cannot be continued (the window before the cut is gone), and its state
        # size is not linear in n_past. 0: no SWA layers.
        self.n_swa = max(0, int(llama_cpp.llama_model_n_swa(self._model)))
        self.info = read_model_info(self._model, self._vocab)
        self._read_tokens()  # tokens.py
        self._ctx = None
        self._embedding: EmbeddingContext | None = None  # made on first use (embedding_context)
        self._abort_flag: threading.Event | None = None
        # ctypes callbacks must outlive the context, or they are garbage-collected under it.
        self._abort_cb = llama_cpp.ggml_abort_callback(self._should_abort)
        self._no_abort_cb = llama_cpp.ggml_abort_callback(0)  # NULL: no per-node callback
        self._batch = None
        # Seconds inside llama_decode (the model's compute, prompts and steps), written by
        # the GPU worker, read at scrape time: the worker's busy time less this is the
        # engine's own work there, and tokens over it the rate a free front end would reach.
        self.decode_s = 0.0
        self.planner: StepPlanner | None = None  # the engine's speculation (engine/speculation/): set after load
        self._retired: deque[TokenSampler] = deque()  # freed by the next GPU-worker call
        self._logits_view: tuple[int, np.ndarray] | None = None  # _first_logits': (address, rows)
        self.seq_tokens: list[list[int]] = []
        # Per slot: the cache_salt its history was computed under (None: unsalted). With the
        # tokens it is the history's identity: see ``shared_prefix``.
        self.seq_salt: list[str | None] = []
        # Per slot: the LoRA adapter set its history was computed under; with the salt, the
        # rest of the history's identity. A batch runs under its slots' one set (_decode_batch).
        self.seq_lora: list[LoraSet] = []
        # Told of every change of a slot's KV (engine/kv/ ``SlotBlocks``: the KV events); None: nobody.
        self.watcher: SlotWatcher | None = None
        self.type_k = type_k
        self.type_v = type_v
        self.offload: OffloadReport | None = None
        self.context_params_applied: dict[str, object] = {}
        self._build_context(n_ctx, n_threads)
        # Image input (--mmproj): mtmd's projector on this model (vision.py); None: text only.
        self.projector: Projector | None = None
        if mmproj is not None:
            from .vision import Projector  # libmtmd is opened by those who serve images only

            try:
                self.projector = Projector(self._model, mmproj, n_threads=n_threads,
                                           use_gpu=self.gpu_offload_supported and mparams.n_gpu_layers != 0)
            except BaseException:
                self.close()
                raise

    # ---- setup -------------------------------------------------------------------------

    def _build_context(self, n_ctx: int, n_threads: int) -> None:
        cp = llama_cpp.llama_context_default_params()
        # Split: n_ctx cells for the slots, n_ctx / n_slots each (llama.cpp rounds a stream up
        # to a multiple of 256 cells).
        cp.n_ctx = n_ctx if self.kv_unified else -(-n_ctx // self.n_slots) * self.n_slots
        cp.n_batch = self.n_batch
        cp.n_ubatch = self.n_batch  # one ubatch per call: an abort undoes the whole call
        # Unified: + the scratch sequence for restores.
        cp.n_seq_max = self.n_slots + 1 if self.kv_unified else self.n_slots
        cp.kv_unified = self.kv_unified
        cp.swa_full = self.swa_full
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads
        if self.type_k is not None:
            cp.type_k = self.type_k
        if self.type_v is not None:
            cp.type_v = self.type_v
        cp.flash_attn_type = self.offload_settings.flash_attn_type
        cp.offload_kqv = self.offload_settings.kv_offload
        ctx, ctx_log = captured(lambda: llama_cpp.llama_init_from_model(self._model, cp))
        if not ctx:
            said = "; ".join(
                line.strip() for line in ctx_log if line.startswith("llama_init_from_model") or "error" in line.lower()
            )
            raise RuntimeError(
                f"llama.cpp could not create a context (n_ctx={n_ctx}, --cache-type-k {type_label(self.type_k)}, "
                f"--cache-type-v {type_label(self.type_v)}, --flash-attn {self.offload_settings.flash_attn})"
                + (f": {said}" if said else "")
            )
        self.context_params_applied = {
            "flash_attn_type": cp.flash_attn_type,
            "offload_kqv": bool(cp.offload_kqv),
            "swa_full": bool(cp.swa_full),
        }
        n_layers = self.info.n_layer + 1  # llama.cpp counts the output layer as one more
        self.offload = OffloadReport(
            requested=self.offload_settings,
            gpu_offload_supported=self.gpu_offload_supported,
            n_gpu_layers_param=self.model_params_applied["n_gpu_layers"],
            n_gpu_layers=offloaded_layers(self._load_log, n_layers, self.gpu_offload_supported,
                                          self.model_params_applied["n_gpu_layers"]),
            n_layers=n_layers,
            flash_attn=flash_attn_applied(ctx_log, self.offload_settings.flash_attn),
            repack=self.repack,
            repacked_mib=repacked_mib(self._load_log),
            devices=self.devices,
        )
        self._ctx = ctx
        self._mem = llama_cpp.llama_get_memory(ctx)
        self.generates = bool(self._mem)  # no KV cache (an encoder, BERT): no slots to generate in
        # n_ctx_slot: the most one slot can hold; n_ctx: the cells all slots hold together.
        self.n_ctx_slot = int(llama_cpp.llama_n_ctx_seq(ctx))
        self.n_ctx = llama_cpp.llama_n_ctx(ctx) if self.kv_unified else self.n_ctx_slot * self.n_slots
        self.n_stream = 1 if self.kv_unified else self.n_slots
        self.n_threads = n_threads
        self._batch = batch = llama_cpp.llama_batch_init(self.n_batch, 0, self.n_slots + 1)
        # The batch's arrays as ctypes pointers made once: reading a field of the struct makes
        # a new pointer object each time, five a token, cache misses each after a decode.
        # Every entry names one sequence.
        self._b_arrays = (batch.token, batch.pos, batch.logits, [batch.seq_id[i] for i in range(self.n_batch)])
        for i in range(self.n_batch):
            batch.n_seq_id[i] = 1
        self.seq_tokens = [[] for _ in range(self.n_slots)]
        self.seq_salt = [None] * self.n_slots
        self.seq_lora = [()] * self.n_slots
        self._lora_applied: LoraSet = ()  # a new context applies none
        # Per slot: how many leading positions are unchanged since the watcher last saw it.
        # A cut needs no update (the watcher keeps at most the blocks the slot still fills);
        # a restore, which may replace every position, sets it to 0.
        self._kept = [0] * self.n_slots
        # The logits of each slot's last position, kept when the evaluation that ended there
        # asked for them (a prefill for a hand-off) or a restored blob carried them: a
        # request that continues the slot with exactly its prompt samples its first token
        # from them instead of re-evaluating the last position in a batch of one (which
        # rounds differently). Any change of the slot's KV drops them (``_advanced``).
        self.tail_logits: list[bytes | None] = [None] * self.n_slots
        # Lowest position each slot's SWA cells still hold (see n_swa), and, for SWA models,
        # what gives the slot's exact state size, kept on the worker after each change: the
        # cells of its SWA cache its state holds (``_swa_cells``), or, where those are not
        # computed, the size itself.
        self._swa_low = [0] * self.n_slots
        self._swa_n = [0] * self.n_slots
        # Only a window-sized SWA cache and a recurrent state lose what a cut needs
        # (checkpoints.py), as llama-server takes checkpoints for them alone.
        needed = (self.n_swa and not self.swa_full) or not self.info.can_roll_back
        self.checkpoints = Checkpoints(self.n_slots, self.ctx_checkpoints if needed else 0, self.n_batch)
        self._measure_state_size()
        self._sizes = [self._state_base] * self.n_slots

    def _advanced(self, slot: int, tail_logits: bytes | None = None) -> None:
        """Bookkeeping after the slot's sequence changed (runs on the worker); ``tail_logits``:
        those of its new last position, when the change computed or restored them."""
        self.tail_logits[slot] = tail_logits
        if self.watcher is not None:
            self.watcher.slot_changed(
                slot, self.seq_tokens[slot], self._kept[slot], self.seq_salt[slot], self.seq_lora[slot]
            )
        self._kept[slot] = len(self.seq_tokens[slot])
        if self.n_swa:
            n_past = len(self.seq_tokens[slot])
            self._swa_low[slot] = max(self._swa_low[slot], n_past - self.n_swa)
            if self._swa_per_cell:
                self._swa_n[slot] = self._swa_cells(slot, n_past)
            else:
                self._sizes[slot] = self.state_size(slot)

    def rebuild_context(
        self, *, n_ctx: int | None = None, type_k: int | None = None, type_v: int | None = None
    ) -> None:
        """Recreate the context (CONFIGURE T2). All slot contents are dropped."""
        old = (self.n_ctx, self.type_k, self.type_v)
        self.type_k = type_k if type_k is not None else self.type_k
        self.type_v = type_v if type_v is not None else self.type_v
        self._free_context()
        try:
            self._build_context(n_ctx or old[0], self.n_threads)
        except Exception:
            _, self.type_k, self.type_v = old  # keep serving with the previous setup
            self._build_context(old[0], self.n_threads)
            raise

    def _free_context(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        self._logits_view = None  # a next context's buffer may come at the same address

    def embedding_context(self, pooling: str | None, n_seq_max: int) -> EmbeddingContext:
        """The model's embedding context (embedding.py: ``pooling``, None for the model's
        own), made on first use, freed with the model."""
        if self._embedding is None:
            self._embedding = EmbeddingContext(self._model, pooling=pooling, n_batch=self.n_batch, n_seq_max=n_seq_max,
                                               n_threads=self.n_threads, offload=self.offload_settings)
        return self._embedding

    def close(self) -> None:
        self._free_retired()
        if getattr(self, "projector", None) is not None:
            self.projector.close()
            self.projector = None
        if self._embedding is not None:
            self._embedding.close()
            self._embedding = None
        self._free_context()
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    @property
    def scratch_seq(self) -> int:
        """The unified cache's restore sequence (a split cache has none)."""
        assert self.kv_unified, "a split KV cache has no scratch sequence"
        return self.n_slots

    def _should_abort(self, _data: ctypes.c_void_p) -> bool:
        # Runs on ggml's threads: read a flag, never call into trio.
        flag = self._abort_flag
        return flag is not None and flag.is_set()

    # ---- samplers ----------------------------------------------------------------------

    def retire(self, sampler: TokenSampler) -> None:
        """Hand a finished request's sampler back; any thread (deque appends are atomic)."""
        self._retired.append(sampler)

    def _free_retired(self) -> None:
        while self._retired:
            self._retired.popleft().close()

    # ---- sequences ---------------------------------------------------------------------

    def n_past(self, slot: int) -> int:
        return len(self.seq_tokens[slot])

    def shared_prefix(self, slot: int, tokens: Sequence[int], salt: str | None, lora: LoraSet = ()) -> int:
        """How many leading ``tokens`` the slot's KV holds for a request under ``salt`` and
        the adapter set ``lora``: the one rule of slot reuse (slot choice, prefix reuse, the
        prompt cache's swap). KV computed under one cache_salt is never continued under
        another, so a request learns nothing (cached_tokens, timing) of what other salts'
        requests sent; nor KV computed under one adapter set under another (other weights)."""
        if self.seq_salt[slot] != salt or self.seq_lora[slot] != lora:
            return 0
        return common_prefix_len(self.seq_tokens[slot], tokens)

    def cells_in_use(self) -> int:
        """Upper bound of occupied KV cells (shared cells are counted once per sequence)."""
        return sum(len(t) for t in self.seq_tokens)

    def pool_is_tight(self, needed: int) -> bool:
        """Whether ``needed`` more cells may not fit the shared pool (unified cache only:
        split streams cannot take each other's cells, so evicting another slot frees none)."""
        return self.kv_unified and self.cells_in_use() + needed > self.n_ctx

    def clear_slot(self, slot: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, slot, -1, -1)
        self.seq_tokens[slot] = []
        self._swa_low[slot] = 0
        self.checkpoints.forget(slot)
        self._advanced(slot)

    def truncate_slot(self, slot: int, n_keep: int) -> int:
        """Drop positions >= n_keep from the slot; returns the positions it holds now.

        Where the cut loses what continuing needs (a recurrent state, sliding-window cells
        before it), the slot resumes from its context checkpoint at ``n_keep``
        (``reusable_prefix`` plans cuts there). 0 when there is none, or the memory refused
        the cut (llama_memory_seq_rm false): the slot is emptied then, so the prompt is
        recomputed instead of continuing a state that still holds the tail."""
        n_held = len(self.seq_tokens[slot])
        if n_keep == 0:
            self.clear_slot(slot)
        elif n_keep < n_held:
            if not (
                (not self._cut_needs_checkpoint(slot, n_keep) or self._resume_from_checkpoint(slot, n_keep))
                and llama_cpp.llama_memory_seq_rm(self._mem, slot, n_keep, -1)
                # A checkpoint's recurrent state carries its own position: it must be the cut's.
                and llama_cpp.llama_memory_seq_pos_max(self._mem, slot) + 1 == n_keep
            ):
                log.warning(
                    "slot %d: the KV cannot be cut back to %d of its %d positions (no context checkpoint "
                    "there, or the memory refused); cleared", slot, n_keep, n_held,
                )  # fmt: skip
                self.clear_slot(slot)
                return 0
            del self.seq_tokens[slot][n_keep:]
            self.checkpoints.forget(slot, above=n_keep)
            self._advanced(slot)
        return len(self.seq_tokens[slot])

    def _resync(self, seq: int) -> None:
        # After a failed decode, believe the KV cache, not our bookkeeping.
        n = llama_cpp.llama_memory_seq_pos_max(self._mem, seq) + 1
        del self.seq_tokens[seq][max(n, 0):]
        self.checkpoints.forget(seq, above=max(n, 0))
        self._advanced(seq)

    def warmup(self) -> None:
        """llama-server's warm-up: decode a prompt of two tokens, then one more as a step,
        and forget them. The kernels prompts and steps use (matrix-matrix and
        matrix-vector) each run once, so a kernel that faults on this CPU faults at start,
        before the engine says it is healthy, never on a user's first request."""
        if self._ctx is None:
            raise RuntimeError("warmup needs a context")
        bos, eos = self.info.bos, self.info.eos
        prompt = [t if 0 <= t < self.info.n_vocab else 0 for t in (bos, eos)]
        try:
            self._decode_batch([(0, prompt[0], 0, False), (0, prompt[1], 1, True)], None)
            self._decode_batch([(0, prompt[1], 2, True)], None)
        finally:
            llama_cpp.llama_memory_seq_rm(self._mem, 0, -1, -1)
            self.decode_s = 0.0  # the model's compute counts users' tokens only

    def _decode_batch(self, entries: Sequence[tuple[int, int, int, bool]], abort: threading.Event | None) -> None:
        """Decode (seq, token, pos, want_logits) entries as one llama_batch."""
        if self._retired:
            self._free_retired()
        batch = self._batch
        tokens, positions, want, seq_ids = self._b_arrays
        for i, (seq, token, pos, logits) in enumerate(entries):
            tokens[i] = token
            positions[i] = pos
            seq_ids[i][0] = seq
            want[i] = logits
        batch.n_tokens = len(entries)
        if self._adapters:
            self._use_lora(entries)
        # The abort callback is Python: ggml calls it for every graph node, and each call
        # takes the GIL from the trio thread. So it is attached only to calls that can be
        # cancelled (prefill chunks); a generation step is short and runs without it.
        if abort is not None:
            self._abort_flag = abort
            llama_cpp.llama_set_abort_callback(self._ctx, self._abort_cb, None)
        start = time.perf_counter()
        try:
            rc = llama_cpp.llama_decode(self._ctx, batch)
        finally:
            self.decode_s += time.perf_counter() - start
            if abort is not None:
                llama_cpp.llama_set_abort_callback(self._ctx, self._no_abort_cb, None)
                self._abort_flag = None
        if rc == 0:
            return
        for seq in {e[0] for e in entries}:
            if seq < self.n_slots:
                self._resync(seq)
        if rc == 2:
            raise DecodeAborted
        if rc == 1:
            raise NoKvSpace
        raise RuntimeError(f"llama_decode failed with code {rc}")

    def eval_chunk(
        self,
        slot: int,
        tokens: Sequence[int],
        abort: threading.Event | None,
        *,
        sampler: TokenSampler | None = None,
        want_logits: bool = False,
        rows: Callable[[np.ndarray], None] | None = None,
    ) -> tuple[int | None, bytes | None]:
        """Append ``tokens`` (at most n_batch) to the slot's KV.

        With ``sampler``, samples the next token from the last position's logits in the same
        call (another slot's decode would overwrite the logits buffer afterwards). With
        ``want_logits``, also returns those logits as n_vocab little-endian f32 bytes. With
        ``rows``, every position's logits are computed and handed to it (prompt logprobs).
        """
        if not tokens:
            raise ValueError("eval_chunk needs at least one token")
        if len(tokens) > self.n_batch:
            raise ValueError(f"chunk of {len(tokens)} tokens exceeds n_batch {self.n_batch}")
        if abort is not None and abort.is_set():
            raise DecodeAborted
        start = len(self.seq_tokens[slot])
        if start + len(tokens) > self.n_ctx_slot:
            raise NoKvSpace
        last = len(tokens) - 1
        need_logits = sampler is not None or want_logits
        entries = [(slot, t, start + i, rows is not None or (need_logits and i == last)) for i, t in enumerate(tokens)]
        self._decode_batch(entries, abort)
        self.seq_tokens[slot].extend(tokens)
        if rows is not None:
            rows(self._first_logits(len(tokens)))
        logits = self.logits_bytes(-1) if want_logits else None
        token = None
        if sampler is not None:
            token = self._sample(sampler, -1)
        self._advanced(slot, logits)  # after the logits are read: nothing may come between
        return token, logits

    def eval_image(self, slot: int, ids: Sequence[int]) -> int:
        """Append the image whose positions' ids are ``ids`` (vision.py) to the slot's KV, all
        its positions in one call (mtmd encodes it, then decodes its embeddings in n_batch
        batches); returns the positions it took. No logits: a prompt's last position is
        always text."""
        projector = self.projector
        if projector is None:
            raise RuntimeError("an image position, but no projector is loaded")
        self._free_retired()
        start = len(self.seq_tokens[slot])
        n = len(ids)
        if start + n > self.n_ctx_slot:
            raise NoKvSpace
        if self._adapters:
            self._use_lora([(slot, 0, start, False)])
        t0 = time.perf_counter()
        try:
            taken = projector.eval_image(self._ctx, ids, start, slot, self.n_batch)
        except BaseException:
            self._drop_after(slot, start)
            raise
        finally:
            self.decode_s += time.perf_counter() - t0
        if taken != n:
            self._drop_after(slot, start)
            raise RuntimeError(f"an image took {taken} positions, {n} expected")
        self.seq_tokens[slot].extend(ids)
        self._advanced(slot)
        return n

    def _drop_after(self, slot: int, n_keep: int) -> None:
        # An image that failed part-way: its positions are in the KV, not in seq_tokens.
        llama_cpp.llama_memory_seq_rm(self._mem, slot, n_keep, -1)
        self._resync(slot)

    def _sample(self, sampler: TokenSampler, idx: int, row: np.ndarray | None = None) -> int:
        """The token ``sampler`` picks from the last decode's output ``idx`` (``row``: those
        logits, when the caller has them): a view of llama.cpp's buffer, which an
        end-of-generation ban edits in place (after any copy of these logits, tail_logits or
        a hand-off's, was taken: those stay as the model computed them). A chain reads the
        row there itself (``LogitsRow``)."""
        return sampler.sample(self._logits(idx) if row is None else row, self._eog_index, LogitsRow(self._ctx, idx))

    def _logits(self, idx: int) -> np.ndarray:
        """The last decode's logits of output ``idx``: a view of llama.cpp's buffer, valid
        until the next decode."""
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, idx)
        if not ptr:
            raise RuntimeError(f"llama.cpp has no logits for output {idx}")
        return np.ctypeslib.as_array(ptr, shape=(self.info.n_vocab,))

    def _first_logits(self, n: int) -> np.ndarray:
        """The logits of the last decode's first ``n`` entries, which all asked for them, as
        one (n, n_vocab) view of llama.cpp's buffer (valid until the next decode): a step
        reads its streams' rows from it, instead of a view per stream (that view was half of
        the worker's Python per streamed token at 64 streams). The view is made again only
        when llama.cpp's buffer moved or more rows are read (making one, a ctypes array
        type each time, was 15-25 us of every step)."""
        ptr = llama_cpp.llama_get_logits(self._ctx)
        if not ptr:
            raise RuntimeError("llama.cpp has no logits")
        address = ctypes.addressof(ptr.contents)
        view = self._logits_view
        if view is None or view[0] != address or len(view[1]) < n:
            self._logits_view = view = (address, np.ctypeslib.as_array(ptr, shape=(n, self.info.n_vocab)))
        return view[1][:n]

    def logits_bytes(self, idx: int) -> bytes:
        return self._logits(idx).tobytes()

    def sample_from_logits(self, sampler: TokenSampler, logits: bytes | memoryview) -> int:
        """Sample with the request's chain from logits that came with a KV blob."""
        return sampler.sample(np.frombuffer(logits, dtype="<f4", count=self.info.n_vocab), self._eog_index)


def type_label(ggml_type: int | None) -> str:
    return "f16" if ggml_type is None else type_name(ggml_type)  # None: llama.cpp's default


def kv_layout(backend: LlamaBackend) -> str:
    """The KV cache layout's name: one pool any slot may fill, or a stream per slot."""
    return "unified" if backend.kv_unified else "split"
