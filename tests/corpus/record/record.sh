#!/usr/bin/env bash
# Re-record the compatibility corpus with the clients' newest releases (tests/corpus/README.md).
#   tests/corpus/record/record.sh [--only NAME ...]
# Needs node >= 20 with npm, python3 >= 3.11, and the npm registry and PyPI. Installs into
# $HYDRA_CORPUS_TOOLS (default ~/.cache/hydra-trio-corpus), never into the repository.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tools="${HYDRA_CORPUS_TOOLS:-$HOME/.cache/hydra-trio-corpus}"
mkdir -p "$tools/npm"
# @latest each time: the point is what the clients send today.
npm install --silent --no-audit --no-fund --prefix "$tools/npm" \
  @anthropic-ai/claude-code@latest @openai/codex@latest openai@latest zod@latest zod-to-json-schema@latest
[ -x "$tools/venv/bin/python" ] || python3 -m venv "$tools/venv"
"$tools/venv/bin/pip" install --quiet --upgrade \
  openai anthropic pydantic openai-agents 'pydantic-ai-slim[openai,anthropic]' \
  langchain langchain-core langchain-openai langchain-anthropic langgraph
cd "$here"
exec "$tools/venv/bin/python" record.py --npm-prefix "$tools/npm" "$@"
