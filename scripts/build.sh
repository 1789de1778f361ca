#!/usr/bin/env bash
# Builds pagedkv._C in place (incremental, ninja). PAGEDKV_CUDA=auto compiles the CUDA kernels when torch
# has CUDA and a toolkit is found (no GPU needed: `make test` does this); =0 skips them. Unset, the kernels
# are compiled only when a GPU is visible, so a first run on a CPU machine does not wait for nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
if [ -z "${PAGEDKV_CUDA:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    export PAGEDKV_CUDA=auto
  else
    export PAGEDKV_CUDA=0
    echo "build: no GPU visible, building without the CUDA kernels (PAGEDKV_CUDA=auto compiles them; make test does)"
  fi
fi
echo "build: compiling pagedkv._C (PAGEDKV_CUDA=$PAGEDKV_CUDA; incremental; a first build takes a few minutes)"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0}
export MAX_JOBS=${MAX_JOBS:-2}
"$py" setup.py -q build_ext --inplace
