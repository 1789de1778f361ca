"""The build itself: CUDA kernels are compiled in whenever the toolkit was there and the build asked for
them (make test does), and every op has a kernel for each backend it was built for."""
import os

import pytest
import torch

import pagedkv

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


@pytest.mark.skipif(not (cuda_build_requested() and toolkit_present()),
                    reason="no CUDA toolkit, or this build was not asked for the CUDA kernels")
@pytest.mark.parametrize("op", OPS)
def test_cuda_kernels_compiled_in(op):
    assert pagedkv._C.built_with_cuda
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedkv::{op}", "CUDA")
