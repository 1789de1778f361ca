#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (H200: python3, torch + CUDA 13, nvcc, ninja; headers
# such as xxhash.h carried in build_deps/include/): builds pagedkv in place for sm_90, runs the CUDA
# tests, the PAGEDKV_CHECK_INDICES=1 device flag once, compute-sanitizer memcheck + racecheck on
# scripts/cuda_ops_smoke.py, both benchmarks, a TP=2 NCCL engine check (skipped below two GPUs), and
# prints a summary table last. (The kernels' results, barriers and bounds are also checked without a GPU
# by the emulated tests in tests/cuda_emu.)
# Logs go to $OUT (or /tmp/pagedkv_gpu_check). Usage: scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/pagedkv_gpu_check}
mkdir -p "$LOGS"
export TORCH_CUDA_ARCH_LIST=9.0 PAGEDKV_CUDA=1 MAX_JOBS=${MAX_JOBS:-16}
CUDA_HOME=$($PY scripts/cuda_toolkit.py)  # the rule setup.py applies too
[ -n "$CUDA_HOME" ] && export CUDA_HOME
echo "CUDA_HOME=${CUDA_HOME:-unset (torch will guess)}"
SANITIZER=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
declare -a NAMES STATUS SECONDS_TAKEN

step() {  # step NAME TIMEOUT_S CMD...: runs CMD with a timeout, logs to $LOGS/NAME.log, records the result
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$LOGS/$name.log"
  NAMES+=("$name")
  STATUS+=("$([ $rc -eq 0 ] && echo ok || echo "FAIL rc=$rc")")
  SECONDS_TAKEN+=("$((SECONDS - t0))")
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" || true

if step build 420 $PY setup.py build_ext --inplace; then
  step pytest_cuda 300 $PY -m pytest tests/test_attention.py tests/test_cache_ops.py tests/test_op_compile.py tests/test_op_errors.py tests/test_fp8_attention.py tests/test_fp8_cache.py tests/test_layer_ops.py tests/test_host_tier_ops.py tests/test_int4_kv.py tests/test_engine.py tests/test_engine_host_tier.py -k cuda -q
  step check_indices 120 env PAGEDKV_CHECK_INDICES=1 $PY -c "
import torch, pagedkv
from pagedkv import ops
kc = torch.zeros(4, 16, 2, 64, device='cuda'); vc = torch.zeros_like(kc)
k = torch.randn(3, 2, 64, device='cuda'); v = torch.randn_like(k)
try:
    ops.reshape_and_cache(k, v, kc, vc, torch.tensor([0, 999, 5], device='cuda'))
except RuntimeError as e:
    assert 'slot_mapping holds 999 at flat index 1' in str(e), e
    print('PAGEDKV_CHECK_INDICES=1 raised:', str(e).splitlines()[0])
else:
    raise SystemExit('PAGEDKV_CHECK_INDICES=1 did not raise on slot 999')
"
  step memcheck 240 "$SANITIZER" --tool memcheck --error-exitcode 3 $PY scripts/cuda_ops_smoke.py
  step racecheck 300 "$SANITIZER" --tool racecheck --error-exitcode 3 $PY scripts/cuda_ops_smoke.py
  step bench_attention 180 $PY benchmarks/bench_attention.py --no-flex   # Flex compiles per shape: too slow here
  step bench_cache_ops 120 $PY benchmarks/bench_cache_ops.py
  # Tensor parallelism over NCCL: TP=2 greedy output equals the single-GPU engine and transformers.
  gpus=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$gpus" -ge 2 ]; then
    step tp_nccl 300 $PY -c "
import sys; sys.path.insert(0, 'tests')
import tempfile
from engine_fixtures import hf_greedy, save_tiny_llama, shared_prefix_prompts
from pagedkv.engine import LLM, SamplingParams
path = tempfile.mkdtemp()
hf = save_tiny_llama(path)
prompts = shared_prefix_prompts(hf.config.vocab_size)
expected = [hf_greedy(hf, p, 16) for p in prompts]
params = SamplingParams(max_tokens=16, ignore_eos=True)
single = [o.token_ids for o in LLM(path, device='cuda', block_size=8).generate(prompts, params)]
with LLM(path, device='cuda', block_size=8, tensor_parallel_size=2, num_blocks=24, num_cpu_blocks=64) as llm:
    assert llm.tp.backend == 'nccl', llm.tp.backend
    tp = [o.token_ids for o in llm.generate(prompts, params)]
    print('stats', llm.stats(), 'communication', llm.tp.stats)
print('TP=2 == single GPU:', tp == single, ' == transformers:', tp == expected)
assert tp == single == expected
"
  else
    echo "=== tp_nccl: skipped (tensor parallelism over NCCL needs 2 GPUs; $gpus visible)"
    NAMES+=(tp_nccl); STATUS+=(skipped); SECONDS_TAKEN+=(0)
  fi
fi

echo
echo "=== benchmark tables"
for b in bench_attention bench_cache_ops; do [ -f "$LOGS/$b.log" ] && cat "$LOGS/$b.log"; done
echo
echo "=== summary (logs in $LOGS)"
printf "%-18s %-14s %8s\n" step result seconds
for i in "${!NAMES[@]}"; do printf "%-18s %-14s %8s\n" "${NAMES[$i]}" "${STATUS[$i]}" "${SECONDS_TAKEN[$i]}"; done
for s in "${STATUS[@]}"; do [ "$s" = ok ] || [ "$s" = skipped ] || exit 1; done
