"""The build itself: CUDA kernels are compiled in whenever the toolkit was there, and every op has a
kernel for each backend it was built for."""
import os

import pytest
import torch

import pagedkv

OPS = ["reshape_and_cache", "paged_attention", "paged_attention_with_lse", "copy_blocks", "swap_blocks",
       "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"]


def toolkit_present():
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return torch.version.cuda is not None and os.path.exists(os.path.join(home, "bin", "nvcc"))


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_cpu_kernel(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedkv::{op}", "CPU")


@pytest.mark.skipif(os.environ.get("PAGEDKV_CUDA", "auto") == "0" or not toolkit_present(),
                    reason="no CUDA toolkit, or CUDA disabled for this build")
@pytest.mark.parametrize("op", OPS)
def test_cuda_kernels_compiled_in(op):
    assert pagedkv._C.built_with_cuda
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedkv::{op}", "CUDA")
