#!/usr/bin/env bash
# One prefill + two decode hydra-trio engines behind vllm-router's P/D mode: the router asks
# the prefill engine for one token, which keeps the prompt's KV as an export and names it in
# kv_transfer_params; a decode engine pulls it over the binary RPC (KV_PULL) and generates.
# Wire additions: docs/protocol-extensions.md. Needs: pip install hydra-trio vllm-router.
# On several machines: bind with --host 0.0.0.0 and set --advertise-host to the address the
# decode engines reach the prefill engine's RPC port on.
set -euo pipefail
trap 'kill $(jobs -p) 2>/dev/null' EXIT

MODEL=${MODEL:-/tmp/hydra-router-demo.gguf}
[ -f "$MODEL" ] || hydra-trio make-model --preset small "$MODEL"

hydra-trio serve --model "$MODEL" --port 8101 --rpc-port 9601 --kv-export-ttl-s 30 &  # prefill
hydra-trio serve --model "$MODEL" --port 8102 --rpc-port 9602 &                       # decode 1
hydra-trio serve --model "$MODEL" --port 8103 --rpc-port 9603 &                       # decode 2
for port in 8101 8102 8103; do
  until curl -sf "localhost:$port/health" >/dev/null; do sleep 0.5; done
done

vllm-router --vllm-pd-disaggregation --policy round_robin \
  --prefill http://127.0.0.1:8101 \
  --decode http://127.0.0.1:8102 --decode http://127.0.0.1:8103 \
  --host 127.0.0.1 --port 8100 --prometheus-port 29100 &
until curl -sf localhost:8100/readiness >/dev/null; do sleep 0.5; done

# Two requests (one per decode engine): each answer says where its prompt's KV came from
# ("kv_transfer"). The router copies "usage" details from the prefill engine's reply.
for i in 1 2; do
  curl -s localhost:8100/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"messages":[{"role":"user","content":"tell me about the sea"}],"max_tokens":16}' \
    | python3 -c 'import json,sys; b=json.load(sys.stdin); print(b["kv_transfer"], b["usage"])'
done
# The decode engines computed no prompt token; the gauges routers and autoscalers read:
curl -s localhost:8102/metrics | grep -E '^(hydra_kv_pulls_total|hydra_engine_prompt_tokens_processed_total|vllm:)'
