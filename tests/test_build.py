"""The build itself: CUDA kernels are compiled in whenever the toolkit was there and the build asked for
them (make test does), every op has a kernel for each backend it was built for, the CUDA kernels are a
library of their own (pagedkv/_C_cuda), so that a CPU-only torch never loads a CUDA library, and the block
manager's module (pagedkv/_C) links no torch library at all."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import pagedkv
from pagedkv._cuda_kernels import cuda_kernels_path

OPS = ["reshape_and_cache", "paged_attention", "paged_attention_with_lse", "copy_blocks", "swap_blocks",
       "concat_and_cache_mla", "paged_attention_mla", "paged_attention_mla_with_lse",
       "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"]


def toolkit_present():
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return torch.version.cuda is not None and os.path.exists(os.path.join(home, "bin", "nvcc"))


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_cpu_kernel(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedkv::{op}", "CPU")


def cuda_build_requested():
    """make test builds with PAGEDKV_CUDA=auto: then the kernels must be compiled wherever the toolkit is.
    (make demo on a machine without a GPU builds without them.)"""
    return os.environ.get("PAGEDKV_CUDA", "").lower() in ("auto", "1", "on", "true", "yes")


def built_for_this_torch_series():
    from pagedkv._cuda_kernels import _built_against, _series

    return _series(_built_against()) == _series(torch.__version__)


@pytest.mark.skipif(not (cuda_build_requested() and toolkit_present() and built_for_this_torch_series()),
                    reason="no CUDA toolkit, this build was not asked for the CUDA kernels, or it was built against "
                           "another torch series (its ATen CUDA kernels are not loaded then)")
@pytest.mark.parametrize("op", OPS)
def test_cuda_kernels_compiled_in(op):
    assert pagedkv._C.built_with_cuda
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedkv::{op}", "CUDA")


# The libraries of torch's CUDA build and of the CUDA toolkit (file names, as in NEEDED and /proc/self/maps).
CUDA_LIBRARIES = ("libc10_cuda", "libcudart", "libtorch_cuda", "libcuda.so", "libnvrtc", "libcublas")


def needed(path):
    """The shared libraries an ELF file names as NEEDED (readelf -d)."""
    out = subprocess.run(["readelf", "-d", path], check=True, capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def cuda_names(names):
    return [n for n in names if os.path.basename(n).startswith(CUDA_LIBRARIES)]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_block_manager_module_needs_no_cuda_library():
    """pagedkv._C (the block manager) imports under a CPU-only torch, whatever the build."""
    names = needed(pagedkv._C.__file__)
    assert "libc.so.6" in names, names          # the parse found the list
    assert cuda_names(names) == [], names


# What a plain C++ extension module may need: the C and C++ runtimes and the dynamic loader.
SYSTEM_LIBRARIES = ("libstdc++.so", "libm.so", "libgcc_s.so", "libc.so", "ld-linux")


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_block_manager_module_links_no_torch_library():
    """pagedkv._C is a plain pybind11 module: it needs no torch library (tensors cross through DLPack), so
    one build serves every torch release."""
    names = needed(pagedkv._C.__file__)
    assert "libc.so.6" in names, names
    assert not [n for n in names if "torch" in n or "c10" in n], names
    assert [n for n in names if not n.startswith(SYSTEM_LIBRARIES)] == [], names


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
@pytest.mark.skipif(cuda_kernels_path() is None, reason="this build has no CUDA kernels")
def test_cuda_kernels_are_a_library_of_their_own():
    names = needed(cuda_kernels_path())
    assert "libc10_cuda.so" in names and any(n.startswith("libcudart") for n in names), names
    assert os.path.dirname(cuda_kernels_path()) == os.path.dirname(pagedkv._C.__file__)


CPU_RUN = """
import torch, pagedkv
key = torch.randn(5, 2, 8)
kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
torch.ops.pagedkv.reshape_and_cache(key, key, kc, vc, torch.arange(5))
out = torch.ops.pagedkv.paged_attention(
    torch.randn(1, 2, 8), kc, vc, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
    torch.tensor([0, 1], dtype=torch.int32), 0.35)
assert torch.isfinite(out).all() and torch.equal(kc.view(16, 2, 8)[:5], key)
print(pagedkv._C.built_with_cuda)
print(open("/proc/self/maps").read())
"""


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch")
def test_cpu_only_torch_never_loads_a_cuda_library():
    """Under a CPU-only torch, importing pagedkv and running its ops on CPU maps no CUDA library, whether
    or not the build compiled the CUDA kernels."""
    out = subprocess.run([sys.executable, "-c", CPU_RUN], check=True, capture_output=True, text=True).stdout
    built_with_cuda, maps = out.split("\n", 1)
    assert built_with_cuda == "False"
    mapped = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    assert any(os.path.basename(p).startswith("_C.") for p in mapped), "pagedkv._C is not mapped"
    assert cuda_names(mapped) == [] and not any("_C_cuda" in p for p in mapped), sorted(mapped)


def test_cuda_kernels_of_another_torch_series_are_skipped_with_a_warning(monkeypatch):
    """_C_cuda uses ATen's C++ API: under a torch of another release series than the build's it is not loaded
    (the ops keep their CPU kernels) and a warning says why; the same series would load it."""
    from pagedkv import _cuda_kernels

    loaded = []
    monkeypatch.setattr(_cuda_kernels.torch.version, "cuda", "13.0")
    monkeypatch.setattr(_cuda_kernels, "cuda_kernels_path", lambda: "/nowhere/_C_cuda.so")
    monkeypatch.setattr(_cuda_kernels.torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(_cuda_kernels, "_built_against", lambda: "1.99.0+cu130")
    with pytest.warns(UserWarning, match="built against torch 1.99.0.*not loaded"):
        assert _cuda_kernels.load_cuda_kernels() is False
    assert loaded == []
    monkeypatch.setattr(_cuda_kernels, "_built_against", lambda: torch.__version__.split("+")[0] + "+cpu")
    assert _cuda_kernels.load_cuda_kernels() is True and loaded == ["/nowhere/_C_cuda.so"]


def test_the_build_records_its_torch():
    from pagedkv._build_info import TORCH_VERSION

    assert re.fullmatch(r"\d+\.\d+\.\d+.*", TORCH_VERSION), TORCH_VERSION


def test_ops_library_uses_only_the_stable_abi():
    """pagedkv/_ops*.so is built against torch's stable C ABI (TORCH_STABLE_ONLY): it may import the C shims
    (aoti_torch_*, torch_*) but no C++ symbol of at::, c10:: or torch::, which would tie it to one release."""
    nm, cxxfilt = shutil.which("nm"), shutil.which("c++filt")
    if nm is None or cxxfilt is None:
        pytest.skip("nm / c++filt (binutils) not installed")
    from pagedkv._ops_library import library_path
    symbols = subprocess.run([nm, "-D", "--undefined-only", library_path()], check=True, capture_output=True,
                             text=True).stdout
    demangled = subprocess.run([cxxfilt], input=symbols, check=True, capture_output=True, text=True).stdout
    unstable = [line.strip() for line in demangled.splitlines() if re.search(r"\b(at|c10|torch|caffe2)::", line)]
    assert not unstable, f"{len(unstable)} unstable torch C++ symbols imported, e.g. {unstable[:5]}"
    assert any(re.search(r"\b(aoti_torch|torch)_\w+", line) for line in demangled.splitlines())
