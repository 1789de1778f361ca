"""The CUDA kernels live in their own library, pagedkv/_C_cuda*.so, loaded only under a torch with CUDA:
pagedkv._C (the block manager) and pagedkv/_ops*.so (the op schemas and CPU kernels) need no CUDA library, so one build imports
under a CPU-only torch too."""
import glob
import os
import warnings

import torch


def cuda_kernels_path():
    """The CUDA kernels' library next to this file, or None when this build has none."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "_C_cuda*.so")))
    return found[0] if found else None


def load_cuda_kernels():
    """Registers the CUDA kernels of torch.ops.pagedkv.* (after pagedkv/_ops*.so has defined the schemas); returns
    whether they were loaded: False under a CPU-only torch or when the build compiled none."""
    path = cuda_kernels_path()
    if torch.version.cuda is None or path is None:
        return False
    built = _series(_built_against())
    if built is not None and built != _series(torch.__version__):
        # _C_cuda uses torch's C++ API (ATen), whose ABI holds within one release series only.
        warnings.warn(f"pagedkv's CUDA kernels were built against torch {_built_against()} and are not loaded "
                      f"under torch {torch.__version__}: the ops run on CPU tensors only. Build pagedkv against "
                      f"this torch (pip install --no-build-isolation .) for its CUDA kernels.", stacklevel=3)
        return False
    try:
        torch.ops.load_library(path)
    except OSError as e:  # e.g. a wheel built for CUDA 13 under a torch built for CUDA 12: another libcudart
        raise ImportError(f"pagedkv's CUDA kernels ({os.path.basename(path)}) do not load under this torch "
                          f"({torch.__version__}, CUDA {torch.version.cuda}); build pagedkv against it "
                          f"(pip install --no-build-isolation .): {e}") from e
    return True


def _built_against() -> str | None:
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:  # a build older than the record
        return None
    return TORCH_VERSION


def _series(version: str | None) -> tuple[int, int] | None:
    if version is None:
        return None
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)
