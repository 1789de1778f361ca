"""Builds pagedkv._C: the block manager (csrc/core + csrc/bindings*.cpp), pagedkv._ops: the torch ops' schemas
and CPU kernels (csrc/ops), and, when torch has CUDA and a CUDA toolkit is found (set CUDA_HOME) unless
PAGEDKV_CUDA=0, pagedkv._C_cuda: the CUDA kernels (csrc/ops/cuda), which pagedkv loads only under a torch
with CUDA, so _C and _ops never need libc10_cuda or libcudart. The default arch list covers sm_80 and sm_90
(override with TORCH_CUDA_ARCH_LIST).
"""
import glob
import os
import runpy

import shutil

from setuptools import Extension, find_packages, setup
from setuptools.command.sdist import sdist

ROOT = os.path.dirname(os.path.abspath(__file__))

# torch derives CUDA_HOME when cpp_extension is imported: set it first, by the project's one rule.
_cuda_home = runpy.run_path(os.path.join(ROOT, "scripts", "cuda_toolkit.py"))["find_cuda_home"]()
if _cuda_home:
    os.environ["CUDA_HOME"] = _cuda_home

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402


# The oldest torch the installed-wheel tests (scripts/wheel_check.sh) pass under. _C links no torch and _ops
# is built on torch's stable ABI (target 2.10), so a newer torch keeps working without a rebuild; only the
# CUDA kernels (_C_cuda, ATen) are tied to the building torch's release series, and pagedkv loads them under
# that series alone (pagedkv/_cuda_kernels.py).
TORCH_REQUIREMENT = "torch>=2.13"


def _write_build_info():
    """pagedkv/_build_info.py: the torch this build compiled against (which series _C_cuda takes)."""
    _write_if_changed(os.path.join("pagedkv", "_build_info.py"),
                      '"""Written by setup.py: the torch pagedkv was built against."""\n'
                      f'TORCH_VERSION = "{torch.__version__}"\n')


def _rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _want_cuda():
    flag = os.environ.get("PAGEDKV_CUDA", "auto").lower()
    if flag in ("0", "off", "false", "no"):
        return False
    found = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if flag in ("1", "on", "true", "yes") and not found:
        raise RuntimeError("PAGEDKV_CUDA=1 but torch has no CUDA or CUDA_HOME is not set")
    return found


def _include_dirs():
    dirs = [os.path.join(ROOT, "csrc")]
    # Headers copied by hand for machines without Debian -dev packages (e.g. xxhash.h on a lent GPU).
    extra = os.path.join(ROOT, "build_deps", "include")
    if os.path.isdir(extra):
        dirs.append(extra)
    return dirs


class _SDist(sdist):
    """The sdist carries xxhash.h (header only, BSD-2-Clause, with its copyright notice) in build_deps/include,
    taken from the building machine's xxHash headers, so `pip install pagedkv-*.tar.gz` needs a compiler
    and nothing else: no -dev package on the installing machine."""

    def run(self):
        source = next((os.path.join(d, "xxhash.h") for d in ["/usr/include", "/usr/local/include"]
                       if os.path.exists(os.path.join(d, "xxhash.h"))), None)
        if source is None:
            raise RuntimeError("the sdist carries xxhash.h: install libxxhash-dev (or xxhash-devel) to make one")
        dest = os.path.join(ROOT, "build_deps", "include")
        os.makedirs(dest, exist_ok=True)
        shutil.copyfile(source, os.path.join(dest, "xxhash.h"))
        notice = "/usr/share/doc/libxxhash-dev/copyright"
        with open(os.path.join(dest, "xxhash-LICENSE"), "w") as f:
            f.write("xxhash.h is xxHash's header, https://github.com/Cyan4973/xxHash, under the BSD 2-Clause "
                    "License.\n\n")
            if os.path.exists(notice):
                f.write(open(notice).read())
        super().run()


def _have_header(name):
    return any(os.path.exists(os.path.join(d, name)) for d in _include_dirs() + ["/usr/include"])


def _core_unity():
    """csrc/core/*.cpp as one translation unit, written to build/unity/core.cpp: the core is split by
    concept, but its hot paths (admission, registration, decode appends) cross the parts, and one unit lets
    the compiler inline across them. The GoogleTest build (CMake) compiles the parts one by one."""
    text = "".join(f'#include "{os.path.relpath(p, "csrc")}"\n' for p in _rel("csrc/core/*.cpp"))
    path = os.path.join("build", "unity", "core.cpp")
    _write_if_changed(path, text)
    return [path]


def _cuda_op_checks():
    """The argument checks the CUDA kernels share with the CPU ones, for pagedkv._C_cuda: one stub per file
    in build/cuda_checks that includes it, so its object does not overwrite the one _ops links (the two
    libraries compile with different flags)."""
    paths = []
    for name in ("checks", "tensor_checks", "view_overlap", "mla", "int4"):
        path = os.path.join("build", "cuda_checks", f"{name}.cpp")
        _write_if_changed(path, f'#include "ops/{name}.cpp"\n')
        paths.append(path)
    return paths


def _write_if_changed(path, text):
    full = os.path.join(ROOT, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    if not os.path.exists(full) or open(full).read() != text:  # unchanged: no rebuild
        with open(full, "w") as f:
            f.write(text)


def _dlpack_include():
    """A folder holding dlpack/dlpack.h, copied from the building torch (which ships it as ATen/dlpack.h):
    the header alone, so pagedkv._C sees no other torch header. torch >= 2.10's copy declares the DLPack
    exchange table that _C uses."""
    src = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "dlpack.h")
    if not os.path.exists(src):
        raise RuntimeError(f"building pagedkv._C needs DLPack's header, looked for {src}")
    _write_if_changed(os.path.join("build", "dlpack", "dlpack", "dlpack.h"), open(src).read())
    return os.path.join(ROOT, "build", "dlpack")


def _extension():
    """pagedkv._C: the block manager (csrc/core) and its Python bindings (csrc/bindings*.cpp). A plain
    pybind11 module that includes and links nothing of torch (tensors cross through DLPack), so it does not
    tie the wheel to one torch release."""
    import pybind11

    # xxHash is compiled in (XXH_INLINE_ALL), but its header comes from the system: no PyPI package
    # installs xxhash.h (the `xxhash` wheel carries only its compiled module), so pip cannot supply it.
    if not _have_header("xxhash.h"):
        raise RuntimeError("building pagedkv needs xxhash.h (header only, nothing is linked): "
                           "apt-get install libxxhash-dev, dnf install xxhash-devel, "
                           "or put xxhash.h in build_deps/include")
    return Extension(
        name="pagedkv._C",
        sources=_core_unity() + _rel("csrc/bindings*.cpp"),
        include_dirs=_include_dirs() + [_dlpack_include(), pybind11.get_include()],
        language="c++",
        # torch's BuildExtension compiles it too (ninja); it adds no torch path or library to a plain Extension.
        extra_compile_args=["-O3", "-fvisibility=hidden", "-std=c++20"],
    )


# The oldest torch whose stable ABI has what the ops use (std::vector<Tensor> and str arguments, typed
# data pointers, torch::stable::parallel_for / empty / to): 2.10. TORCH_VERSION_2_10_0 of
# torch/csrc/stable/version.h.
STABLE_ABI_TARGET = "0x020A000000000000"


def _ops_extension():
    """pagedkv._ops: STABLE_TORCH_LIBRARY(pagedkv) (the op schemas) and the CPU kernels (csrc/ops, csrc/ops/cpu).
    A library without a Python module, registered with torch.ops.load_library (pagedkv/_ops_library.py).
    Built against torch's stable ABI only (TORCH_STABLE_ONLY: an ATen or c10 include is a compile error),
    so one binary loads under every torch from STABLE_ABI_TARGET on."""
    # csrc/ops/cpu/attention_<isa>.cpp: one copy of the CPU attention kernels per instruction set, chosen at
    # run time; each sets its ISA with `#pragma GCC target` (x86 only), so no -m flag is passed here.
    # Threads come from torch::stable::parallel_for (torch's own pool); -fopenmp-simd only honours the
    # kernels' `omp simd` loops and links no OpenMP runtime.
    return cpp_extension.CppExtension(
        name="pagedkv._ops",
        sources=_rel("csrc/ops/*.cpp") + _rel("csrc/ops/cpu/*.cpp"),
        include_dirs=_include_dirs(),
        define_macros=[("TORCH_STABLE_ONLY", None), ("TORCH_TARGET_VERSION", STABLE_ABI_TARGET)],
        extra_compile_args={"cxx": ["-O3", "-fvisibility=hidden", "-fopenmp-simd"]},
    )


def _cuda_extension():
    """pagedkv._C_cuda: TORCH_LIBRARY_IMPL(pagedkv, CUDA) for the schemas _ops defines; no Python module
    (loaded with torch.ops.load_library). --no-undefined: every symbol it needs is in it or in torch."""
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    nvcc = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
    return cpp_extension.CUDAExtension(
        name="pagedkv._C_cuda",
        sources=_rel("csrc/ops/cuda/*.cu") + _cuda_op_checks(),
        include_dirs=_include_dirs(),
        define_macros=[("PAGEDKV_WITH_CUDA", "1")],
        extra_compile_args={"cxx": ["-O3", "-fvisibility=hidden"], "nvcc": nvcc},
        extra_link_args=["-Wl,--no-undefined"],
    )


if not _want_cuda():
    # An in-place build without the CUDA kernels leaves none behind from an earlier one: pagedkv would load it.
    for stale in glob.glob(os.path.join(ROOT, "pagedkv", "_C_cuda*.so")):
        os.remove(stale)

_write_build_info()
setup(
    name="pagedkv",
    version="0.1.0",
    description="Paged KV cache for LLM inference: C++ block manager with exact prefix caching, CPU/CUDA kernels",
    packages=find_packages(include=["pagedkv", "pagedkv.*"]),
    package_data={"pagedkv": ["py.typed", "_C.pyi"]},     # PEP 561: the native module's types
    ext_modules=[_extension(), _ops_extension()] + ([_cuda_extension()] if _want_cuda() else []),
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True), "sdist": _SDist},
    python_requires=">=3.11",
    install_requires=[TORCH_REQUIREMENT, "tqdm"],
    extras_require={"engine": ["safetensors", "tokenizers", "matplotlib", "gguf", "jinja2"],
                    "events": ["pyzmq", "msgspec"],          # LLM(kv_events_endpoint=...)
                    "metrics": ["prometheus_client"],        # LLM(metrics_port=...)
                    "nixl": ["nixl", "pyzmq"],               # pagedkv.engine.kv.transfer
                    "transformers": ["transformers>=5.23"]},  # pagedkv.integrations.transformers
    # vLLM runs this in each of its processes; it does nothing unless PAGEDKV_VLLM_ATTENTION=1.
    entry_points={"vllm.general_plugins": ["pagedkv = pagedkv.integrations.vllm:register"]},
)
