"""All settings in one place: each flag of `hydra-trio serve` and its HYDRA_* variable."""

from __future__ import annotations

import argparse
import ipaddress
import os
import string
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import gguf

from .model.lora import adapter_specs
from .wire.sampling import SPEC_TYPES

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_MiB = 1024 * 1024
_GiB = 1024 * _MiB


@dataclass(frozen=True, slots=True)
class Settings:
    model: str | None = None  # None: the synthetic demo model from the user cache
    alias: str | None = None
    # Many models (serving/model_pool.py; docs/operations.md "Many models"): named_models has no flag of its own.
    named_models: tuple[str, ...] = ()
    models_dir: str | None = None
    models_max: int = 4
    model_pin: str = ""
    sleep_idle_seconds: float = -1.0
    model_wait_s: float = 300.0
    rpc_model: str | None = None
    # LoRA adapters (llama-server's flags, repeated or comma lists): [NAME=]PATH at scale 1,
    # [NAME=]PATH:SCALE; ids in that order (--lora first). A request's "model" picks one by
    # NAME (vLLM's), default the file stem; the scales are what requests without "lora" get
    # (model/lora.py ``adapter_specs``).
    lora: tuple[str, ...] = ()
    lora_scaled: tuple[str, ...] = ()
    lora_init_without_apply: bool = False  # every default scale 0 until POST /lora-adapters
    # Image input (llama-server's --mmproj): the vision projector GGUF loaded through mtmd beside
    # the model; --media-path: the one folder file:// image URLs may read (none: refused);
    # --media-url-prefix: http(s) image URLs fetched only under these prefixes (none: refused).
    mmproj: str | None = None
    media_path: str | None = None
    media_url_prefix: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080  # HTTP; 0 = ephemeral
    rpc_port: int = 9504  # binary RPC; 0 = ephemeral
    slots: int = 4
    ctx_size: int = 4096  # KV cells of all slots together (docs/operations.md "KV cache layout")
    # Split (default, llama-server's): one KV stream per slot, ctx_size / slots cells each, and
    # a step's attention reads only its own slot's cells. Unified: one pool any slot may fill,
    # but every sequence's attention spans all used cells (measured: docs/operations.md "KV cache layout").
    kv_unified: bool = False
    # Sliding-window layers (Gemma 2/3, ...) keep their window of cells, as llama-server does:
    # a full-size SWA cache makes their attention span the whole sequence (a 16k prefill
    # 1.3x slower, docs/performance.md) and buys nothing here (prefix reuse already honours
    # the window: LlamaBackend.reusable_prefix).
    swa_full: bool = False
    # Context checkpoints per slot of the sliding-window layers' or the recurrent state
    # (llama-server's --ctx-checkpoints; engine/llama/checkpoints.py): a prompt that leaves a
    # slot's history a few tokens before its end resumes there instead of recomputing everything.
    ctx_checkpoints: int = 8
    # Slot choice (llama-server's --slot-prompt-similarity): a prompt continues a slot's KV
    # only when the shared prefix is at least this share of the prompt; otherwise it takes an
    # empty slot, else the least recently used. 0: always the longest shared prefix.
    slot_prompt_similarity: float = 0.5
    # Host memory for slots' KV kept past the slots (llama-server's --cache-ram), MiB; 0: off.
    cache_ram_mib: int = 8192
    # A third tier for what RAM must drop (engine/kv/disktier.py): a folder and its bound in
    # GiB; None: off.
    cache_disk: str | None = None
    cache_disk_gib: float = 16.0
    # Agent sessions (engine/sched/session_tree.py): a session's KV is kept this long after
    # its last turn (a request's kv_retention_ttl_seconds wins), and what leaves for room is
    # chosen by the session (engine/kv/retention.py) or by recency alone ("lru").
    session_ttl_s: float = 300.0
    session_policy: str = "session"
    # One core is left to the trio thread: ggml's spinning thread barriers collapse (3-6
    # instead of 35-44 tok/s measured on 2 cores) when a llama thread has to share a core.
    threads: int = max(1, min(8, (os.cpu_count() or 2) - 1))
    batch_size: int = 512  # prefill chunk: one cancellable GPU-worker call
    # Tokens per generation-step batch while streams run: their next tokens, then a part of an
    # arriving prompt. Small on CPUs (each prompt token costs about what a whole step does);
    # a GPU takes hundreds at almost no extra step time.
    step_token_budget: int = 32
    # While streams run, each step carries as many prompt tokens as keep it under this
    # inter-token latency (engine/sched/chunks.py); 0: the machine's own, 20 one-stream steps
    # as measured (a long prompt then goes about as fast as alone).
    itl_target_ms: float = 0.0
    # Streaming: up to this many tokens per chunk (vLLM's --stream-interval); the first token
    # and the end are sent at once. A request's own "stream_interval" wins.
    stream_interval: int = 1
    # GPU offload. n_gpu_layers None: every layer when the llama.cpp build can offload, else 0.
    n_gpu_layers: int | None = None
    main_gpu: int = 0
    flash_attn: str = "auto"  # on | off | auto
    # KV cache element types (llama-server's -ctk/-ctv): a blob carries rows in these types,
    # so q8_0 halves what a hand-off moves. A quantized V needs flash attention.
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    no_kv_offload: bool = False  # keep the KV cache in host memory even with layers on a GPU
    # Weights repacked into CPU-specific layouts (llama-server's --repack/--no-repack). None:
    # decided from the CPU (engine/llama/devices.py repack_choice: off where AMX kernels would crash).
    repack: bool | None = None
    # One prompt and one step at load, so a kernel that faults does so before /health is ok.
    warmup: bool = True
    # Each token picked where its logits are (engine/sample/sampler.py): greedy's argmax on
    # llama.cpp's row, a sampler chain by llama_sampler_sample on it; off: the path before
    # (kept to measure one against the other: benchmarks/hostwork.py --ab).
    sampling_fast_path: bool = True
    # Chat template: a llama.cpp built-in name (or Jinja source), or a Jinja file.
    chat_template: str | None = None
    chat_template_file: str | None = None
    # Tool calls (vLLM's --tool-call-parser): the syntax replies are parsed for; auto: read
    # from the chat template (engine/chat/caps.py).
    tool_call_parser: str = "auto"
    # Reasoning (llama-server's --reasoning-format): auto splits <think>...</think> into
    # reasoning_content when the template has thinking tags; deepseek always; none keeps it inline.
    reasoning_format: str = "auto"
    # Thinking budget (llama-server's --reasoning-budget): -1 unlimited, 0 thinking off (the
    # template's enable_thinking false), N > 0 at most N tokens of reasoning, then the engine
    # writes the close tag itself and the reply goes on. A request's reasoning_budget_tokens wins.
    reasoning_budget: int = -1
    default_n_predict: int = 512  # when a request names no max_tokens / n_predict
    # n-gram speculative decoding (engine/speculation/), llama-server's flag names: drafts
    # from the request's own prompt and output, verified in the step batch.
    spec_type: str = "none"
    # A step's every draft position has a row of logits in llama.cpp's output buffer, which
    # keeps the largest size it was ever asked for (Gemma 3's 262,144-token vocabulary: 1 MiB
    # a row, so 8 streams drafting 16 hold 136 MiB).
    spec_draft_n_max: int = 16
    spec_draft_n_min: int = 0
    spec_ngram_size_n: int = 12  # a match's context is compared over this many tokens at most
    spec_ngram_min_n: int = 1
    # Drafting stops in steps with more generating slots than this. Below it, how much each
    # stream drafts is priced per step at the measured cost of the batch's forward passes
    # (engine/speculation/policy.py: plan_drafts), which drafts less as the batch grows; the cap
    # bounds that planning's work on the worker (docs/performance.md, "Speculative decoding").
    spec_max_batch: int = 8
    slot_wait_s: float = 30.0  # chat completions wait this long for a free slot, then 503
    # Embeddings and rerank (engine/embedder.py): a second context on the model with a pooling
    # type. None: on when the GGUF declares a pooling type (an embedding model, a reranker),
    # --pooling or --reranking is given.
    embeddings: bool | None = None
    pooling: str = "model"  # none | mean | cls | last | rank; model: the GGUF's own (llama-server's --pooling)
    reranking: bool = False  # llama-server's --reranking: embeddings with rank pooling
    embd_normalize: int = 2  # llama-server's --embd-normalize: -1 none, 0 max-abs int16, 2 Euclidean, p: p-norm
    embd_batch_inputs: int = 32  # inputs per embedding call at most (the embedding context's sequences)
    embd_max_waiting: int = 4096  # inputs waiting for the worker at most (one request's too); past it, 503
    # /infill: llama-server's --spm-infill, suffix first (some code models' own order).
    spm_infill: bool = False
    # RPC transport (spec §1)
    max_connections: int = 64
    http_idle_timeout_s: float = 30.0  # an HTTP connection with no request in progress this long is closed
    # HTTP connections served at once; 0: derived from the open-file limit (http/plumbing/connections.py).
    max_http_connections: int = 0
    # A request body (state upload, JSON) must average this rate once its grace is over:
    # a trickling sender cannot hold its payload budget or its buffer indefinitely. 0: no floor.
    min_upload_bytes_per_s: int = 1 * _MiB
    upload_grace_s: float = 10.0
    # The same floor for a large response body (a slot's state): a client that stops reading
    # cannot keep its snapshot, charged to the payload budget, for ever. 0: no floor.
    min_download_bytes_per_s: int = 1 * _MiB
    download_grace_s: float = 10.0
    idle_timeout_s: float = 120.0
    drain_limit_bytes: int = 64 * _MiB
    max_kv_bytes: int = 4 * _GiB
    max_json_bytes: int = 64 * _MiB
    max_decode_header_bytes: int = 32 * 1024
    max_inflight_bytes: int = 8 * _GiB  # payload bytes held by all RPC connections together
    # DECODE lifecycle (spec §4, §6.4)
    decode_validate_timeout_s: float = 30.0
    decode_result_ttl_s: float = 300.0
    decode_result_max: int = 1024
    shutdown_grace_s: float = 10.0
    # P/D hand-off through a router's kv_transfer_params (docs/protocol-extensions.md)
    advertise_host: str | None = None  # None: the bind host
    kv_export_max_bytes: int = 2 * _GiB
    kv_export_ttl_s: float = 30.0
    kv_pull_timeout_s: float = 30.0
    # A failed pull's fallback waits out --kv-pull-timeout-s (holding no slot, no budget) so
    # that a closed, a silent and a talking port answer alike; off: it falls back at once.
    kv_pull_uniform_timing: bool = False
    # Networks a decode engine may pull KV exports from (a request names the address): the
    # default keeps an HTTP client from aiming the engine anywhere but this machine.
    kv_pull_allow: str = "127.0.0.0/8,::1"
    # Same-host hand-offs through shared memory (handoff/shm.py): exports live in files of
    # this folder, which a decode engine on the same host maps instead of pulling over TCP.
    # Empty: off (every pull goes over TCP).
    kv_shm_dir: str = "/dev/shm"
    # KV events for routers that route by cache (vllm-router --policy kv_aware): a ZMQ PUB
    # endpoint to bind (None: off), an optional ROUTER endpoint serving replays of recent
    # batches from a ring of this many bytes, the topic, and tokens per block.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_replay_bytes: int = 64 * _MiB
    # The topic may name {pod} and {model}; "llm-d" is the preset kv@{pod}@{model}, the topic
    # llm-d's KV-cache indexer reads the pod and model from (observability/kv_publisher.py).
    kv_events_topic: str = ""
    # Events as tagged maps (vllm-router), or as vLLM's positional arrays (llm-d); auto: arrays
    # with the llm-d preset, maps otherwise.
    kv_events_encoding: str = "auto"
    kv_events_block_size: int = 16
    kv_events_hwm: int = 100_000  # messages queued per subscriber; past it PUB drops (never waits)
    # Replay requests answered per second per peer (a burst of as many); the rest are dropped.
    kv_events_replay_rate: float = 10.0
    # A resync (AllBlocksCleared, then every chain, to every subscriber) at most this often;
    # the subscriptions heard meanwhile share the next one.
    kv_events_resync_interval_s: float = 10.0
    # CURVE (libzmq's encryption and authentication): the sockets' secret key, and the client
    # public keys allowed (None: any client that knows the server's public key).
    kv_events_curve_secret_key_file: str | None = None
    kv_events_curve_allowed_keys_file: str | None = None
    # CONFIGURE over RPC: the tiers accepted (T2 rebuilds the context, T3 loads another
    # model), and the folder T3 may load from (None: the served model's folder).
    configure_tiers: str = "T1,T2,T3"
    model_dir: str | None = None
    log_level: str = "INFO"
    log_format: str = "text"  # text | json (one object per line: observability/logs.py)
    log_requests: bool = True  # a line per finished request (completion, DECODE, hand-off, ...)
    log_stats_interval_s: float = 10.0  # the throughput line while busy; 0: never
    # Security (docs/operations.md "Security"). repr=False: a logged Settings never shows the key.
    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None
    # The admin role (docs/operations.md "Roles"): slot state, erase, the decode listing and
    # /slots need this key; the plain --api-key serves completions and tokenizer routes.
    admin_api_key: str | None = field(default=None, repr=False)
    admin_api_key_file: str | None = None
    rpc_allow: str | None = None  # comma-separated CIDRs; None: every peer

    def http_api_key(self) -> str | None:
        """The key every HTTP request but /health must present: --api-key, else the first
        line of --api-key-file; None when neither is set (HTTP open to whoever reaches it)."""
        return _key(self.api_key, self.api_key_file, "api_key_file")

    def http_admin_api_key(self) -> str | None:
        """The admin role's key (--admin-api-key, else the first line of
        --admin-api-key-file); None when neither is set (http/plumbing/auth.py says what that means)."""
        return _key(self.admin_api_key, self.admin_api_key_file, "admin_api_key_file")

    def rpc_networks(self) -> tuple[IPNetwork, ...] | None:
        """The networks RPC peers must come from; None: no allowlist (every peer)."""
        return None if self.rpc_allow is None else parse_networks(self.rpc_allow, "rpc_allow")

    def configure_tier_set(self) -> frozenset[str]:
        return frozenset(t.strip().upper() for t in self.configure_tiers.split(",") if t.strip())

    def kv_pull_networks(self) -> tuple[IPNetwork, ...]:
        """The networks KV exports may be pulled from (``--kv-pull-allow``)."""
        return parse_networks(self.kv_pull_allow, "kv_pull_allow")


def _key(value: str | None, path: str | None, name: str) -> str | None:
    """A key given as a value, or as the first line of the file at ``path``."""
    if value is not None:
        return value
    if path is None:
        return None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise SystemExit(f"{name}: cannot read {path}: {exc.strerror}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise SystemExit(f"{name}: {path} holds no key on its first line")
    return key


def parse_networks(value: str, name: str) -> tuple[IPNetwork, ...]:
    """``CIDR[,CIDR...]`` (a bare address is its own /32 or /128); SystemExit naming ``name``."""
    nets = []
    for item in value.split(","):
        try:
            nets.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError as exc:
            raise SystemExit(f"{name}: {exc}") from None
    return tuple(nets)


# flag name -> (env var, help). The env var is read when the flag is not given. "{choices}": the
# words a layer above hands in (``Choices``), listed where the help is shown.
_HELP: dict[str, str] = {
    "model": "GGUF model path (default: a synthetic random-weight demo model); repeated as NAME=PATH, several models "
    "served by name (a request's model picks one, loaded on demand)",
    "models_dir": "serve every GGUF of this folder by name, as llama-server's router: NAME.gguf at the top, or NAME/ "
    "holding one model (mmproj and draft files skipped)",
    "models_max": "models holding memory at once (loaded or loading); a request for another evicts the least recently "
    "used idle one (llama-server's --models-max)",
    "model_pin": "models kept loaded from start to stop, never evicted nor put to sleep, a comma list of names (the "
    "RPC model always is)",
    "sleep_idle_seconds": "a model idle this long frees its memory (sleeping) and wakes on its next request "
    "(llama-server's flag); <= 0 = never; the RPC model and pinned ones never sleep",
    "model_wait_s": "seconds a request waits for its model to load or wake (and for room to load it) before 503",
    "rpc_model": "the model the RPC port (PREFILL, DECODE, STATE_*, KV events) serves, pinned (default: the first "
    "--model NAME=PATH, else the first of --models-dir by name)",
    "alias": "model alias reported in identity (default: the file stem)",
    "lora": "LoRA adapter [NAME=]PATH, applied at scale 1 to requests without a \"lora\" list (repeat or "
    "comma-separate; llama-server's --lora); a request's \"model\" NAME selects it alone (vLLM's), NAME defaulting to "
    "the file stem",
    "lora_scaled": "LoRA adapter [NAME=]PATH:SCALE, as --lora with that default scale (llama-server's --lora-scaled); "
    "ids follow the --lora ones",
    "mmproj": "a vision projector GGUF for the model (llama-server's --mmproj), loaded through llama.cpp's mtmd: chat "
    "image parts (OpenAI image_url, Anthropic image, Responses input_image) become image positions of the prompt; "
    "without it, image parts are refused (400)",
    "media_path": "the folder whose files file:// image URLs may name (llama-server's --media-path); unset: file:// "
    "URLs are refused (400)",
    "media_url_prefix": "http(s) image URLs the server fetches, by prefix (repeat or comma-separate; e.g. "
    "https://images.example.com/); unset: http(s) image URLs are refused (400), only data: URIs are read",
    "lora_init_without_apply": "load the LoRA adapters with every default scale 0 (llama-server's "
    "--lora-init-without-apply): requests choose them, or POST /lora-adapters sets the scales",
    "host": "address to bind HTTP and RPC",
    "port": "HTTP port (0 = ephemeral)",
    "rpc_port": "binary RPC port (0 = ephemeral)",
    "slots": "number of slots (llama sequences)",
    "ctx_size": "KV cells of all slots together (split cache: each slot "
    "holds ctx_size/slots; unified: any slot may hold all)",
    "slot_prompt_similarity": "a prompt reuses a slot's KV only when the shared prefix is at least this share of the "
    "prompt (else an empty, then the least recently used slot); 0 = always the longest prefix",
    "cache_ram_mib": "host memory (MiB) for slots' KV kept past the slots: a slot's history is copied here before it "
    "is dropped, and comes back for a prompt that continues it; 0 = off",
    "cache_disk": "a folder for KV that RAM (--cache-ram-mib) must drop: written crash-safe (temporary file, fsync, "
    "rename; checksummed, a torn file is never read back), cleaned at start, published as KV events of medium DISK "
    "(default: off)",
    "cache_disk_gib": "GiB the --cache-disk folder may hold (the retention order picks what leaves)",
    "session_ttl_s": "seconds an agent session's KV is kept after its last turn before it ranks as expired (a "
    "request's kv_retention_ttl_seconds wins)",
    "session_policy": "what KV leaves first for room: session (finished subagents, then one-off prompts, then expired "
    "sessions, then live ones by priority and when their next turn "
    "is expected) or lru (least recently used, sessions ignored)",
    "kv_unified": "one KV cache shared by all slots instead of one stream per slot (a slot may then hold the whole "
    "context, but every step's attention spans all slots' cells)",
    "ctx_checkpoints": "context checkpoints kept per slot for sliding-window, recurrent and hybrid models "
    "(llama-server's --ctx-checkpoints): a prefill copies the window's or the recurrent state 4 and --batch-size "
    "tokens before the prompt's end, and a restored KV blob's checkpoint section is kept as one, so a next prompt that "
    "leaves the history there resumes instead of recomputing; 0 = off",
    "swa_full": "full-size KV cache for sliding-window layers (llama.cpp's swa_full): their attention then spans the "
    "whole sequence; off (default, llama-server's) keeps only the window, faster prefill of long prompts",
    "threads": "CPU threads for llama.cpp (default: the cores but "
    "one, at most 8: the engine's own thread needs a core)",
    "batch_size": "prefill chunk size in tokens (each chunk is one cancellable call); the embedding context's batch "
    "too: an embedding or rerank input holds at most this many tokens",
    "embeddings": "serve /v1/embeddings and /v1/rerank from a second context on the model (default: when the GGUF "
    "declares a pooling type, or --pooling or --reranking is given)",
    "pooling": "the embedding context's pooling (llama-server's --pooling): none, mean, cls, last, rank; model: the "
    "GGUF's own",
    "reranking": "llama-server's --reranking: embeddings with rank pooling (a model with a rank head, for /v1/rerank)",
    "embd_normalize": "how pooled embeddings are normalised when a request does not say (llama-server's "
    "--embd-normalize): -1 none, 0 max absolute in int16's range, 2 Euclidean, p > 2 a p-norm",
    "embd_batch_inputs": "embedding or rerank inputs per call of the embedding context at most",
    "embd_max_waiting": "embedding and rerank inputs waiting for the GPU worker at most (one request's included); past "
    "it a request gets 503 with Retry-After",
    "spm_infill": "/infill: suffix before prefix (llama-server's --spm-infill), the order some code models were "
    "trained with",
    "stream_interval": "streamed tokens per chunk at most (the first token and the end go at once); a request's "
    "stream_interval wins",
    "step_token_budget": "prompt tokens per generation-step batch while streams run, until the ITL target's step costs "
    "are measured (each further waiting prompt adds up to this many)",
    "itl_target_ms": "inter-token latency target while a prompt is prefilled beside running streams: each step carries "
    "as many prompt tokens as keep it under this; 0 = the machine's own (20 one-stream steps, as measured)",
    "n_gpu_layers": "layers to offload to the GPU, -1 = all (default: "
    "all when the llama.cpp build can offload, else 0)",
    "main_gpu": "llama.cpp's main_gpu: the GPU for scratch work and, when layers are not split across GPUs, the model",
    "flash_attn": "flash attention: on, off or auto",
    "cache_type_k": "KV cache type of K: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0 or q5_1 (llama-server's -ctk)",
    "cache_type_v": "KV cache type of V, as --cache-type-k; a quantized "
    "one needs flash attention (--flash-attn on or auto)",
    "no_kv_offload": "keep the KV cache in host memory even when layers are on a GPU",
    "repack": "repack weights into CPU-specific layouts for faster prompts (llama-server's --repack/--no-repack); "
    "default: on, except on CPUs with AMX, where llama.cpp's AMX kernels crash on repacked weights "
    "(ggml-org/llama.cpp#20824)",
    "warmup": "run one prompt and one step at load, so a kernel that faults on this machine stops the start instead of "
    "a user's first request (--no-warmup skips it)",
    "sampling_fast_path": "pick each token where its logits are: greedy's argmax on llama.cpp's logits row with no "
    "other sampler step, a sampler chain's pick (temperature, top-k/p, min-p, penalties) by llama.cpp on that row "
    "(llama_sampler_sample); --no-sampling-fast-path: the path before (every step, a chain over a NumPy copy of the "
    "row), to measure one against the other",
    "chat_template": "chat template: a llama.cpp built-in name (e.g. gemma, chatml, llama3) or Jinja source",
    "chat_template_file": "chat template: path of a Jinja file",
    "tool_call_parser": "tool-call syntax written and parsed, one of {choices}: auto reads it from the chat template's "
    "markers, any other is one tool-call family's (docs/templates.md)",
    "reasoning_budget": "thinking budget in tokens (llama-server's): -1 unlimited, 0 thinking off (enable_thinking "
    "false), N > 0 at most N tokens of reasoning, then the close tag (e.g. </think>) is written and the reply goes on; "
    "a request's reasoning_budget_tokens wins",
    "reasoning_format": "reasoning in replies: auto (split <think> into reasoning_content when the template has "
    "thinking tags), deepseek (always split), none (keep inline)",
    "default_n_predict": "tokens to generate when a request does not say",
    "spec_type": "speculative decoding: none, or ngram-simple (alias ngram): drafts from the request's own prompt and "
    "output (the tokens that followed the earlier occurrence of its last tokens whose context matches furthest back) "
    "and from what earlier requests of its cache_salt generated, verified in the step batch, each step drafting what "
    "makes the most tokens per second at the measured cost; a request's \"speculative\": {\"type\": ...} wins; "
    "recurrent and hybrid models refuse it",
    "spec_draft_n_max": "draft tokens per step at most (a request's speculative.n_max wins)",
    "spec_draft_n_min": "a shorter draft is not verified (a request's speculative.n_min wins)",
    "spec_ngram_size_n": "how many tokens of context a draft's match is compared over at most (a longer match is "
    "trusted more); matches as short as --spec-ngram-min-n draft too",
    "spec_ngram_min_n": "the shortest match (tokens of context) that drafts",
    "spec_max_batch": "no drafting in a step with more generating slots than this (below it, each step drafts what "
    "pays at the measured cost of its forward passes)",
    "slot_wait_s": "seconds a chat completion waits for a free slot before 503",
    "http_idle_timeout_s": "an HTTP connection with no request in progress "
    "(also one that never sent a byte) this long is closed",
    "max_connections": "RPC connections served at once (as many more wait in the listen backlog)",
    "max_http_connections": "HTTP connections served at once; past it, up to 64 more at a time get one answer each "
    "(/health as usual, else 503) and are closed; 0 = the open-file limit less RPC's --max-connections, that reserve "
    "and 256, at most 4096",
    "min_upload_bytes_per_s": "a request body (state upload, JSON) must arrive at this average rate, counted after "
    "--upload-grace-s, else 408 and its payload budget is released; "
    "0 = no floor (--idle-timeout-s of silence still ends it)",
    "upload_grace_s": "seconds a request body may take before --min-upload-bytes-per-s applies (its deadline: grace + "
    "bytes received / rate)",
    "min_download_bytes_per_s": "a slot state response (GET /slots/{id}/state) must be read at this average rate: past "
    "--download-grace-s + bytes / rate its connection is closed "
    "and its snapshot's payload budget released; 0 = no floor",
    "download_grace_s": "seconds a slot state response may take before --min-download-bytes-per-s applies",
    "idle_timeout_s": "an RPC peer idle, or sending/reading no byte mid-request, this long is "
    "closed; also the wait for payload room",
    "drain_limit_bytes": "a refused request's payload up to this size is drained (the connection kept); larger is "
    "answered, read on while it comes (up to 4x this), then closed",
    "max_kv_bytes": "largest KV blob accepted",
    "max_json_bytes": "largest JSON payload accepted",
    "max_decode_header_bytes": "largest DECODE control header accepted",
    "max_inflight_bytes": "payload bytes RPC connections and HTTP state uploads may hold at once "
    "(more wait)",
    "decode_validate_timeout_s": "deadline for DECODE validate + restore",
    "decode_result_ttl_s": "seconds a finished decode result stays readable",
    "decode_result_max": "decode results kept at most",
    "shutdown_grace_s": "seconds what runs (streams, completions, DECODEs, exports not yet pulled) gets to finish "
    "after SIGTERM/SIGINT, new work refused meanwhile",
    "advertise_host": "RPC host a decode engine pulls KV exports from (default: --host)",
    "kv_export_max_bytes": "bytes all KV exports may hold; past it the oldest are evicted",
    "kv_export_ttl_s": "seconds a KV export waits to be pulled before it is dropped",
    "kv_pull_timeout_s": "deadline for pulling a KV export from a prefill engine",
    "kv_pull_uniform_timing": "a failed KV pull falls back to the local prefill only at --kv-pull-timeout-s, so a "
    "closed, a silent and a talking port look alike to HTTP clients (the wait holds no slot and no payload budget); "
    "default: fall back at once (--kv-pull-allow already decides which hosts may be pulled from)",
    "kv_pull_allow": "networks a decode engine may pull KV exports from, CIDR[,CIDR...] (a hand-off naming another "
    "address falls back to a local prefill)",
    "kv_shm_dir": "folder (tmpfs) where KV exports live so that a decode engine on the same host maps them instead of "
    "pulling them over TCP; used only when the decode engine can read it; empty = off",
    "kv_events_endpoint": "publish vLLM KV events (what the slots hold) on this ZMQ PUB endpoint, for vllm-router "
    "--policy kv_aware, e.g. tcp://127.0.0.1:5557; bind loopback or a private network only (BlockStored carries every "
    "user's token ids), or set --kv-events-curve-secret-key-file (default: off)",
    "kv_events_replay_endpoint": "serve replays of recent KV event batches on this ZMQ ROUTER endpoint (vllm-router "
    "--kv-event-replay-source)",
    "kv_events_replay_bytes": "bytes of recent KV event batches kept for replays (the oldest go first)",
    "kv_events_topic": "topic of every KV event message (vllm-router's default: empty); {pod} is replaced by $POD_NAME "
    "(else the host name) and {model} by the served model name; llm-d is the preset kv@{pod}@{model} that llm-d's "
    "KV-cache indexer parses",
    "kv_events_encoding": "KV event layout: map (tagged maps, as vllm-router decodes), array (vLLM's msgspec "
    "array_like structs, as llm-d's KV-cache indexer decodes), or auto (array with --kv-events-topic llm-d, else map)",
    "kv_events_block_size": "tokens per KV event block (vllm-router's --kv-event-block-size; 16 in P/D mode)",
    "kv_events_hwm": "KV event messages queued per subscriber; past it a slow subscriber misses messages (and asks for "
    "a replay) instead of the engine waiting",
    "kv_events_replay_rate": "KV event replay requests answered per second from each peer (a burst of as many); past "
    "it a request gets no answer",
    "kv_events_resync_interval_s": "seconds between two resyncs at most (AllBlocksCleared, then everything held, to "
    "every subscriber: sent for a new subscription when the replay ring no longer reaches back to seq 0, or there is "
    "no replay socket); the subscriptions heard meanwhile share the next",
    "kv_events_curve_secret_key_file": "CURVE-encrypt both KV event sockets with the secret key in this file (Z85, 40 "
    "characters, as zmq.curve_keypair() makes; or a zmq.auth certificate); subscribers need its public key (logged at "
    "start); needs libzmq with CURVE",
    "kv_events_curve_allowed_keys_file": "with CURVE: only clients whose public key (Z85, one a line; lines starting "
    "with # are comments) is in this file may subscribe or ask for replays (default: any client that knows the "
    "server's public key)",
    "configure_tiers": "CONFIGURE tiers accepted over RPC, a comma list of T1 (per-slot sampling), T2 (context "
    "rebuild), T3 (model reload); others are refused",
    "model_dir": "the folder CONFIGURE T3 may load a model_path from (a regular GGUF file inside it, symlinks "
    "resolved); default: the served model's folder",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": "log lines as text, or json: one object per line with ts, level, logger, msg (request lines add "
    "request_id, route, status, tokens, timings)",
    "log_requests": "an INFO line per finished request (completion, DECODE, hand-off, state transfer); "
    "--no-log-requests turns them off",
    "log_stats_interval_s": "seconds between throughput lines (prompt and generation tok/s, running, waiting, KV "
    "usage), written only when the interval saw work; 0 = off",
    "api_key": "HTTP requests (all but /health) must send 'Authorization: Bearer KEY' "
    "(prefer the file or the variable: a flag shows in ps)",
    "api_key_file": "read the API key from the first line of this file",
    "admin_api_key": "the admin role's key: slot state GET/PUT, erase, /slots and the decode listing need it, "
    "and it serves every other route too; the plain --api-key then gets 403 there. Without it, "
    "--api-key alone is admin (as before roles). With it alone, the plain routes need no key",
    "admin_api_key_file": "read the admin API key from the first line of this file",
    "rpc_allow": "RPC peers allowed, CIDR[,CIDR...] (e.g. 10.0.0.0/8,127.0.0.1); others are "
    "closed at accept (default: all)",
}

# Spec §6.4 names these two variables; the rest follow HYDRA_<FLAG>.
_ENV_OVERRIDES = {
    "decode_result_ttl_s": "HYDRA_DECODE_RESULT_TTL_S",
    "decode_result_max": "HYDRA_DECODE_RESULT_MAX",
}


# Fields whose default is None still have a type (the rest take the type of their default).
_FIELD_TYPES: dict[str, type] = {"n_gpu_layers": int, "repack": bool, "embeddings": bool}
FLASH_ATTN_MODES = ("on", "off", "auto")
LOG_FORMATS = ("text", "json")
REASONING_FORMATS = ("auto", "deepseek", "none")
# KV cache types by llama-server's names (-ctk/-ctv) -> ggml type ids, as gguf numbers them.
CACHE_TYPES = {
    name: int(gguf.GGMLQuantizationType[name.upper()])
    for name in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
}
UNQUANTIZED_CACHE_TYPES = frozenset({"f32", "f16", "bf16"})
# Settings that take one of a few words: argparse offers them, validate() holds any source to them.
# Words a layer above decides are handed in by the caller (``Choices``): config.py is below
# engine/, so the CLI gives tool_call_parser the engine's tool-call families (their roster,
# engine/chat/families/), and this module keeps no list of them.
Choices = Mapping[str, Collection[str]]
_CHOICES: dict[str, tuple[str, ...]] = {
    "flash_attn": FLASH_ATTN_MODES,
    "cache_type_k": tuple(CACHE_TYPES),
    "cache_type_v": tuple(CACHE_TYPES),
    "log_format": LOG_FORMATS,
    "reasoning_format": REASONING_FORMATS,
    "spec_type": SPEC_TYPES,
    "kv_events_encoding": ("auto", "map", "array"),
    "session_policy": ("session", "lru"),
    "pooling": ("model", "none", "mean", "cls", "last", "rank"),
}


def _field_type(field_name: str, default: Any) -> type:
    if field_name in _FIELD_TYPES:
        return _FIELD_TYPES[field_name]
    return type(default) if default is not None else str


def _env_bool(raw: str, name: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"{name}: expected a boolean (1/0, true/false), got {raw!r}")


def env_name(field_name: str) -> str:
    return _ENV_OVERRIDES.get(field_name, "HYDRA_" + field_name.upper())


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _convert(kind: type, raw: str, name: str) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"{name}: expected {kind.__name__}, got {raw!r}") from None


# Settings filled from another flag's values (repeated --model NAME=PATH), with no flag of their own.
_NO_FLAG = frozenset({"named_models"})
def _comma_list(given: list[str]) -> tuple[str, ...]:
    return tuple(item for text in given for item in text.split(",") if item.strip())


def _help(name: str, choices: Choices, *, listed: bool) -> str:
    """A setting's help, its "{choices}" the words handed in: listed here, or (``listed``
    false: argparse's help) argparse's own ``%(choices)s``, read only when help is shown."""
    words = choices.get(name)
    if words is None:
        return _HELP[name].replace("{choices}", "the words its caller gives")
    return _HELP[name].replace("{choices}", ", ".join(words) if listed else "%(choices)s")


def add_arguments(parser: argparse.ArgumentParser, choices: Choices | None = None) -> None:
    """Every setting's flag; ``choices``: the words of settings a layer above decides."""
    defaults = Settings()
    words = {**_CHOICES, **(choices or {})}
    for f in (f for f in fields(Settings) if f.name not in _NO_FLAG):
        if f.name == "model":  # one PATH, or NAME=PATH repeated
            parser.add_argument("--model", dest="model", action="append", default=None, help=f"{_HELP['model']} [env "
                                "HYDRA_MODEL; default None]")
            continue
        default = getattr(defaults, f.name)
        kind = _field_type(f.name, default)
        help_text = f"{_help(f.name, words, listed=False)} [env {env_name(f.name)}; default {default}]"
        if kind is bool and default is not False:  # on, or decided, by default: --NAME and --no-NAME
            parser.add_argument(
                flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        if kind is bool:  # a switch: given means True
            parser.add_argument(
                flag_name(f.name), dest=f.name, action="store_const", const=True, default=None, help=help_text
            )
            continue
        if kind is tuple:  # repeatable, each a comma list (llama-server's --lora)
            parser.add_argument(flag_name(f.name), dest=f.name, action="append", default=None, help=help_text)
            continue
        parser.add_argument(
            flag_name(f.name), dest=f.name, type=kind, choices=words.get(f.name), default=None, help=help_text
        )


def settings_from(
    args: argparse.Namespace | None = None,
    env: dict[str, str] | None = None,
    *,
    choices: Choices | None = None,
    **overrides: Any,
) -> Settings:
    """Flags win over HYDRA_* variables, which win over defaults; ``choices``: as ``validate``'s."""
    env = dict(os.environ) if env is None else env
    defaults = Settings()
    values: dict[str, Any] = {}
    for f in (f for f in fields(Settings) if f.name not in _NO_FLAG):
        default = getattr(defaults, f.name)
        kind = _field_type(f.name, default)
        given = getattr(args, f.name, None) if args is not None else None
        if f.name == "model" and given is not None:
            values["model"], values["named_models"] = split_model_flags(given)
            continue
        if given is not None:
            values[f.name] = _comma_list(given) if kind is tuple else given
        elif env.get(env_name(f.name)):
            raw = env[env_name(f.name)]
            if kind is tuple:
                values[f.name] = _comma_list([raw])
            else:
                values[f.name] = (
                    _env_bool(raw, env_name(f.name)) if kind is bool else _convert(kind, raw, env_name(f.name))
                )
    values.update(overrides)
    settings = Settings(**{**{f.name: getattr(defaults, f.name) for f in fields(Settings)}, **values})
    validate(settings, choices)
    return settings


def split_model_flags(given: list[str]) -> tuple[str | None, tuple[str, ...]]:
    """--model flags as (one PATH alone, as always; or NAME=PATH each: an existing file is a PATH)."""
    named = [v for v in given if "=" in v and not os.path.isfile(v) and "/" not in v.partition("=")[0]]
    if len(given) == 1 and not named:
        return given[0], ()
    if len(named) != len(given):
        raise SystemExit("--model: give one PATH, or NAME=PATH for each of several models; got "
                         f"{', '.join(map(repr, given))}")
    return None, tuple(named)


# Settings that must lie in a closed range.
_RANGES: dict[str, tuple[float, float]] = {
    "slots": (1, 256),
    "batch_size": (1, 8192),
    "step_token_budget": (1, 8192),
    "itl_target_ms": (0.0, 600_000.0),
    "slot_prompt_similarity": (0.0, 1.0),
    "stream_interval": (1, 4096),
    "kv_events_block_size": (1, 4096),
    "kv_events_hwm": (1, 10_000_000),
    "kv_events_replay_bytes": (0, 1 << 40),
    "kv_events_replay_rate": (0.01, 1e6),
    "kv_events_resync_interval_s": (0.0, 86400.0),
    "spec_draft_n_max": (1, 256),
    "spec_draft_n_min": (0, 256),
    "spec_ngram_size_n": (1, 64),
    "spec_ngram_min_n": (1, 64),
    "spec_max_batch": (0, 256),
    "models_max": (1, 1024),
    "model_wait_s": (0.001, 1e6),
    "embd_batch_inputs": (1, 256),  # llama.cpp's LLAMA_MAX_SEQ
    "embd_max_waiting": (1, 1 << 20),
    "embd_normalize": (-1, 64),
}


def cache_type_problem(cache_type_v: str, flash_attn: str) -> str | None:
    """The one cache-type rule, for start-up and CONFIGURE T2 alike: llama.cpp refuses a
    context whose V cache is quantized without flash attention (only flash attention reads
    one). ``flash_attn``: on | off | auto (auto may turn it on)."""
    if cache_type_v in UNQUANTIZED_CACHE_TYPES or flash_attn != "off":
        return None
    return (
        f"cache_type_v {cache_type_v} is quantized, which needs flash attention: set --flash-attn on or auto, or an "
        "unquantized --cache-type-v (f16, bf16, f32)"
    )


def _topic_problem(topic: str) -> str | None:
    """A KV events topic names no placeholder but {pod} and {model} (kvevents.expand_topic)."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(topic) if name is not None}
    except ValueError as exc:
        return f"kv_events_topic: {exc} (write a brace as {{{{ or }}}})"
    if names - {"pod", "model"}:
        return f"kv_events_topic may name {{pod}} and {{model}} only, not {', '.join(sorted(names - {'pod', 'model'}))}"
    return None


def validate(s: Settings, choices: Choices | None = None) -> None:
    """SystemExit naming every problem; ``choices``: the words of settings a layer above
    decides (a setting not given its words here is held to them where it is used)."""
    problems = [
        f"{name} must be {lo:g}..{hi:g}" for name, (lo, hi) in _RANGES.items() if not lo <= getattr(s, name) <= hi
    ]
    if s.ctx_size < 64:
        problems.append("ctx_size must be at least 64")
    if s.slots > s.batch_size:
        # llama.cpp aborts the process (GGML_ASSERT n_outputs_max) when the slots' steps
        # cannot all go into one batch.
        problems.append(f"slots ({s.slots}) must not exceed batch_size ({s.batch_size}): every generating slot's step "
                        "goes into one batch (--slots, --batch-size)")
    if not set(s.configure_tier_set()) <= {"T1", "T2", "T3"}:
        problems.append("configure_tiers must be a comma list of T1, T2, T3")
    if s.cache_ram_mib < 0:
        problems.append("cache_ram_mib must be >= 0 (0 = off)")
    if s.cache_disk is not None and (not s.cache_disk.strip() or s.cache_ram_mib == 0):
        problems.append("cache_disk must name a folder and needs cache_ram_mib > 0 (the disk takes what RAM drops)")
    if not 0 < s.cache_disk_gib <= 1 << 20 or not 0 <= s.session_ttl_s <= 7 * 86400:
        problems.append("cache_disk_gib must be > 0 and session_ttl_s 0..604800")
    if not s.kv_unified and s.ctx_size // s.slots < 16:
        problems.append(f"ctx_size ({s.ctx_size}) gives each of {s.slots} slots fewer than 16 cells with a split KV "
                        "cache (--ctx-size, --slots, --kv-unified)")
    if s.threads < 1:
        problems.append("threads must be >= 1")
    if s.max_http_connections < 0 or s.min_upload_bytes_per_s < 0:
        problems.append("max_http_connections and min_upload_bytes_per_s "
                        "must be >= 0 (0 = the default bound / no floor)")
    if s.upload_grace_s <= 0 or s.download_grace_s <= 0:
        problems.append("upload_grace_s and download_grace_s must be positive")
    if s.min_download_bytes_per_s < 0:
        problems.append("min_download_bytes_per_s must be >= 0 (0 = no floor)")
    for name in ("port", "rpc_port"):
        if not 0 <= getattr(s, name) <= 65535:
            problems.append(f"{name} must be 0..65535")
    if s.kv_export_max_bytes < 1 or s.kv_export_ttl_s <= 0 or s.kv_pull_timeout_s <= 0:
        problems.append("kv_export_max_bytes, kv_export_ttl_s and kv_pull_timeout_s must be positive")
    if s.decode_result_max < 1:
        problems.append("decode_result_max must be >= 1")
    if s.api_key is not None and s.api_key_file is not None:
        problems.append("give api_key or api_key_file, not both")
    if s.api_key is not None and not s.api_key.strip():
        problems.append("api_key must not be empty")
    if s.admin_api_key is not None and s.admin_api_key_file is not None:
        problems.append("give admin_api_key or admin_api_key_file, not both")
    if s.admin_api_key is not None and not s.admin_api_key.strip():
        problems.append("admin_api_key must not be empty")
    if s.rpc_allow is not None and not s.rpc_allow.strip():
        problems.append("rpc_allow must name at least one network")
    if s.n_gpu_layers is not None and s.n_gpu_layers < -1:
        problems.append("n_gpu_layers must be -1 (all) or >= 0")
    if s.main_gpu < 0:
        problems.append("main_gpu must be >= 0")
    for name, words in {**_CHOICES, **(choices or {})}.items():
        if getattr(s, name) not in words:
            problems.append(f"{name} must be one of {', '.join(words)}")
    if (problem := cache_type_problem(s.cache_type_v, s.flash_attn)) is not None:
        problems.append(problem)
    if s.ctx_checkpoints < 0:
        problems.append("ctx_checkpoints must be >= 0 (0 = off)")
    if s.reasoning_budget < -1:
        problems.append("reasoning_budget must be -1 (unlimited), 0 (thinking off) or a number of tokens, got "
                        f"{s.reasoning_budget}")
    if s.log_stats_interval_s < 0:
        problems.append("log_stats_interval_s must be >= 0 (0 = off)")
    if s.kv_events_replay_endpoint and not s.kv_events_endpoint:
        problems.append("kv_events_replay_endpoint needs kv_events_endpoint (the replays are of its batches)")
    if (problem := _topic_problem(s.kv_events_topic)) is not None:
        problems.append(problem)
    if s.kv_events_curve_allowed_keys_file and not s.kv_events_curve_secret_key_file:
        problems.append("kv_events_curve_allowed_keys_file needs kv_events_curve_secret_key_file (CURVE on)")
    if s.spec_draft_n_min > s.spec_draft_n_max:
        problems.append(f"spec_draft_n_min ({s.spec_draft_n_min}) must not exceed spec_draft_n_max "
                        f"({s.spec_draft_n_max})")
    if s.spec_ngram_min_n > s.spec_ngram_size_n:
        problems.append(f"spec_ngram_min_n ({s.spec_ngram_min_n}) must not exceed spec_ngram_size_n "
                        f"({s.spec_ngram_size_n})")
    if s.reranking and s.pooling not in ("model", "rank"):
        problems.append(f"reranking is rank pooling: it cannot go with pooling {s.pooling}")
    if s.embeddings is False and (s.reranking or s.pooling != "model"):
        problems.append("no_embeddings cannot go with pooling or reranking (they serve embeddings)")
    if s.chat_template and s.chat_template_file:
        problems.append("give chat_template or chat_template_file, not both")
    adapter_specs(s.lora, s.lora_scaled)  # a malformed or missing adapter stops startup here, named
    if s.mmproj is not None and not os.path.isfile(s.mmproj):
        problems.append(f"mmproj {s.mmproj!r}: no such file")
    if s.media_path is not None and not os.path.isdir(s.media_path):
        problems.append(f"media_path {s.media_path!r}: no such folder")
    problems.extend(f"media_url_prefix {p!r} must start with http:// or https://" for p in s.media_url_prefix
                    if not p.startswith(("http://", "https://")))
    if problems:
        raise SystemExit("invalid settings: " + "; ".join(problems))
    # An unreadable key file or a bad CIDR stops startup here, with its reason.
    plain, admin = s.http_api_key(), s.http_admin_api_key()
    if plain is not None and plain == admin:
        raise SystemExit("invalid settings: api_key and admin_api_key must differ (one key cannot hold two roles)")
    s.rpc_networks()
    s.kv_pull_networks()


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a port to this machine ("0.0.0.0", "::", a LAN address or
    a name other than localhost do not)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def settings_table(choices: Choices | None = None) -> str:
    """Markdown table of every setting (docs/operations.md "Every flag")."""
    rows = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    defaults = Settings()
    for f in (f for f in fields(Settings) if f.name not in _NO_FLAG):
        meaning = _help(f.name, {**_CHOICES, **(choices or {})}, listed=True)
        rows.append(f"| `{flag_name(f.name)}` | `{env_name(f.name)}` | `{getattr(defaults, f.name)}` | {meaning} |")
    return "\n".join(rows)
