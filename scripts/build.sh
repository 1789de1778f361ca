#!/usr/bin/env bash
# Builds pagedkv._C in place (incremental, ninja). CUDA kernels are compiled when torch has CUDA and a
# toolkit is found; PAGEDKV_CUDA=0 skips them. Compiling CUDA needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0}
export MAX_JOBS=${MAX_JOBS:-2}
"$py" setup.py -q build_ext --inplace
