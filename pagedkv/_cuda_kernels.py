"""The CUDA kernels live in their own library, pagedkv/_C_cuda*.so, loaded only under a torch with CUDA:
pagedkv._C (the block manager) and pagedkv/_ops*.so (the op schemas and CPU kernels) need no CUDA library, so one build imports
under a CPU-only torch too."""
import glob
import os

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
    try:
        torch.ops.load_library(path)
    except OSError as e:  # e.g. a wheel built for CUDA 13 under a torch built for CUDA 12: another libcudart
        raise ImportError(f"pagedkv's CUDA kernels ({os.path.basename(path)}) do not load under this torch "
                          f"({torch.__version__}, CUDA {torch.version.cuda}); build pagedkv against it "
                          f"(pip install --no-build-isolation .): {e}") from e
    return True
