#!/usr/bin/env bash
# The ops library (pagedkv/_ops*.so) is built against torch's stable ABI: this checks that the binary built
# here imports no unstable torch C++ symbol, then runs the op tests under each other torch given, with the
# same binary. Usage: scripts/stable_abi_check.sh PYTHON...   (each a python whose venv has another torch,
# numpy, pytest, hypothesis, xxhash and transformers (test_layer_ops compares with HF Llama); e.g.
# /tmp/t213/bin/python).
# pagedkv/_C (the block manager) is copied along as built; where it does not import under another torch,
# a _C is built against that torch in the copy (setup.py needs ninja there), leaving _ops as built here.
set -euo pipefail
cd "$(dirname "$0")/.."
ops=$(ls pagedkv/_ops*.so)
tests=${STABLE_ABI_TESTS:-"tests/test_attention.py tests/test_cache_ops.py tests/test_op_errors.py tests/test_mla.py
  tests/test_int4_kv.py tests/test_layer_ops.py tests/test_host_tier_ops.py tests/test_fp8_attention.py
  tests/test_fp8_cache.py tests/test_op_compile.py tests/test_cache_layouts.py"}

echo "stable_abi_check: unstable torch C++ symbols that $ops imports:"
if nm -D --undefined-only "$ops" | c++filt | grep -E '\b(at|c10|torch|caffe2)::'; then
  echo "stable_abi_check: FAILED: $ops is tied to one torch release" >&2
  exit 1
fi
echo "  none"

status=0
for py in "$@"; do
  version=$("$py" -c 'import torch; print(torch.__version__)')
  work=$(mktemp -d)
  cp -r pagedkv tests "$work"/
  find "$work" -name __pycache__ -prune -exec rm -rf {} +
  rm -f "$work"/pagedkv/_C_cuda*.so  # CUDA kernels are release-bound; the op tests here are the CPU ones
  if ! (cd "$work" && "$py" -c 'import torch, pagedkv._C' 2>/dev/null); then
    echo "stable_abi_check: torch $version: building a pagedkv._C against it in $work"
    cp -r setup.py csrc scripts "$work"/
    (cd "$work" && PAGEDKV_CUDA=0 "$py" setup.py build_ext --inplace --build-temp build >"$work/build.log" 2>&1)
    cp "$ops" "$work/pagedkv/"  # the binary under test, not one built against this torch
  fi
  echo "stable_abi_check: torch $version: the op tests with $ops"
  # shellcheck disable=SC2086
  if (cd "$work" && PYTHONPATH=. "$py" -m pytest -o addopts="" -q -p no:cacheprovider -W ignore::DeprecationWarning \
        $tests); then
    echo "stable_abi_check: torch $version: passed"
  else
    echo "stable_abi_check: torch $version: FAILED (copy kept in $work)" >&2
    status=1
    continue
  fi
  rm -rf "$work"
done
exit $status
