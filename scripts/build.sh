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
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0}
export MAX_JOBS=${MAX_JOBS:-2}
# Objects go to build/inplace, apart from pip's build/temp.*, so a `pip install .` does not force a rebuild.
cmd=("$py" setup.py build_ext --inplace --build-temp build/inplace)
if [ "${PAGEDKV_VERBOSE:-0}" = 1 ]; then
  exec "${cmd[@]}"
fi
# Quiet: one line per compiled file; the full log (compiler command lines and warnings) in build/build.log.
mkdir -p build
log=build/build.log
if ! "${cmd[@]}" 2>&1 | tee "$log" | while IFS= read -r line; do
    case $line in
      "["[0-9]*/[0-9]*"]"*)
        src=$(grep -oE -- ' -c /[^ ]+' <<<"$line" | head -n 1 | cut -c5-)
        if [ -n "$src" ]; then what="compiling ${src#"$PWD"/}"; else what="linking pagedkv/_C"; fi
        echo "build: ${line%%]*}] $what" ;;
    esac
  done; then
  echo "build: FAILED; the errors (full log: $log, or rerun with PAGEDKV_VERBOSE=1):" >&2
  grep -E -A 12 "error|Error" "$log" | head -n 80 >&2
  exit 1
fi
echo "build: done (log: $log)"
