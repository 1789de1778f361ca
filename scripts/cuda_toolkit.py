"""Finds the CUDA toolkit root: the one rule used by setup.py (and so by scripts/build.sh and pip) and by
scripts/gpu_check.sh (for compute-sanitizer). Run as a script, it prints the root, or nothing.

Order: $CUDA_HOME; /usr/local/cuda when it holds nvcc; else the nvcc on PATH with its symlinks resolved,
if its parent folder is a toolkit (has include/cuda_runtime.h). The last check matters: the nvcc first on
PATH may be a wrapper script outside the toolkit, and torch's own guess (the folder above it) is then wrong.
"""
import os
import shutil


def find_cuda_home() -> str | None:
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    if os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


if __name__ == "__main__":
    print(find_cuda_home() or "")
