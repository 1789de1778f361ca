#!/usr/bin/env bash
# No-GPU compile gate for the CUDA kernels: compiles csrc/ops/cuda/*.cu with nvcc for sm_80 and sm_90
# (the flags setup.py uses) with `-Xptxas -v`, and prints registers, spill stores/loads and stack per
# kernel and arch, so a change that starts spilling is visible without a GPU. Exits 1 if any kernel
# spills. Usage: scripts/cuda_compile_gate.sh   (the toolkit as setup.py finds it; PY defaults to .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CUDA_HOME=$("$PY" scripts/cuda_toolkit.py)
[ -n "$CUDA_HOME" ] || { echo "no CUDA toolkit found (set CUDA_HOME)"; exit 2; }
NVCC=$CUDA_HOME/bin/nvcc
includes=$("$PY" -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))" 2>/dev/null)
logs=build/compile_gate  # nvcc's -Xptxas -v output per source, kept for a look
mkdir -p "$logs"
if [ "${GATE_REUSE_LOGS:-0}" != 1 ]; then
  for cu in csrc/ops/cuda/*.cu; do
    name=$(basename "$cu")
    "$NVCC" -std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -Xptxas -v -Icsrc $includes \
      -DPAGEDKV_WITH_CUDA=1 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
      -c "$cu" -o "$logs/$name.o" 2>"$logs/$name.log" || { cat "$logs/$name.log"; exit 2; }
  done
fi
"$PY" - "$logs"/*.cu.log <<'PYEOF'
import re, subprocess, sys
rows = {}
for path in sys.argv[1:]:
    entry = arch = None
    for line in open(path):
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
        if m:
            entry, arch = m.group(1), m.group(2)
            continue
        if entry is None:
            continue
        cell = rows.setdefault(entry, {}).setdefault(arch, {})
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cell.update(stack=int(m[1]), spill=int(m[2]) + int(m[3]))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cell["regs"] = int(m[1])
mangled = sorted(rows)
names = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True).stdout.split("\n")


def short(name):
    name = re.sub(r"\(.*\)$", "", name)
    for prefix in ("pagedkv::attention_cuda::", "pagedkv::cache_cuda::", "pagedkv::layer_cuda::", "pagedkv::",
                   "c10::"):
        name = name.replace(prefix, "")
    return name.replace("unsigned ", "u")


table = sorted((short(n), rows[m]) for m, n in zip(mangled, names))
spills = 0
print(f"{'kernel':<52} {'sm_80 regs/spill/stack':>23} {'sm_90 regs/spill/stack':>23}")
for name, archs in table:
    cells = []
    for arch in ("sm_80", "sm_90"):
        r = archs.get(arch, {})
        spills += r.get("spill", 0)
        cells.append(f"{r.get('regs', '?')}/{r.get('spill', 0)}/{r.get('stack', 0)}")
    print(f"{name:<52} {cells[0]:>23} {cells[1]:>23}")
print(f"{len(table)} kernels; spill bytes (stores + loads) over all kernels and archs: {spills}")
sys.exit(1 if spills else 0)
PYEOF
