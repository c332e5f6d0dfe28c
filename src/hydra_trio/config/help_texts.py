"""Each setting's help: the words `hydra-trio serve --help` and docs/operations.md's "Every
flag" table show an operator (flags.py puts them there)."""

from __future__ import annotations

# setting name -> its help. "{choices}": the words a layer above hands in (``Choices``),
# listed where the help is shown.
HELP: dict[str, str] = {
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
    "slot_overtakes": "requests waiting for a slot go least work first (prompt tokens to compute: a history in a "
    "slot or the prompt cache before a full prefill); each is overtaken at most this many times; 0 = first come, "
    "first served",
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
    "as many prompt tokens as keep it under this; 0 = the machine's own (the larger of 20 one-stream steps and a "
    "step with a 128-token part, as measured, so parts stay efficient)",
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
