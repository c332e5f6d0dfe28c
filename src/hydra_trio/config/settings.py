"""The settings catalog: every setting of `hydra-trio serve`, its default and what it is for
(``Settings``), and the values derived from it (keys read from files, allowed networks).

How a setting is read (flag, HYDRA_* variable) is flags.py's; what values it may take,
rules.py's; the words an operator reads about it, help_texts.py's."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

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
    # Requests waiting for a slot are served least work first (the prompt tokens they would
    # compute: a turn whose history is in a slot or the prompt cache before a full prefill),
    # each overtaken at most this many times by later ones; 0: first come, first served.
    slot_overtakes: int = 8
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
    # inter-token latency (engine/sched/chunks.py); 0: the machine's own, the larger of 20
    # one-stream steps and a step with an efficient 128-token part, as measured (a long prompt
    # then goes about as fast as alone).
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


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a port to this machine ("0.0.0.0", "::", a LAN address or
    a name other than localhost do not)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
