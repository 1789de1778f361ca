"""The ops library, pagedkv/_ops*.so: the schemas of torch.ops.pagedkv.* and their CPU kernels. It has no
Python module: ``load()`` registers it with ``torch.ops.load_library`` (once), and the CPU attention copy
switch is three C functions of it, called through ctypes."""
from __future__ import annotations

import ctypes
import glob
import os

import torch

_library: ctypes.CDLL | None = None


def library_path() -> str:
    found = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "_ops*.so")))
    if not found:
        raise ImportError("pagedkv's ops library (pagedkv/_ops*.so) is missing: build pagedkv "
                          "(scripts/build.sh, or pip install --no-build-isolation .)")
    return found[0]


def load() -> ctypes.CDLL:
    """Registers torch.ops.pagedkv.* (schemas and CPU kernels); returns the library for its C functions."""
    global _library
    if _library is None:
        path = library_path()
        torch.ops.load_library(path)
        lib = ctypes.CDLL(path)  # the handle torch just opened
        for name in ("pagedkv_set_cpu_attention_isa", "pagedkv_cpu_attention_isa", "pagedkv_cpu_attention_isas"):
            getattr(lib, name).restype = ctypes.c_char_p
        lib.pagedkv_set_cpu_attention_isa.argtypes = [ctypes.c_char_p]
        _library = lib
    return _library


def set_cpu_attention_isa(isa: str) -> None:
    """Testing hook: 'amx', 'avx512', 'avx2', 'neon_bf16', 'sve', 'neon' or 'baseline' caps the CPU attention
    kernel copy, 'auto' picks the fastest. An unknown or unsupported name raises ValueError and changes
    nothing."""
    if not isinstance(isa, str):
        raise TypeError(f"isa must be a str, not {type(isa).__name__}")
    error = load().pagedkv_set_cpu_attention_isa(isa.encode())
    if error is not None:
        raise ValueError(error.decode())


def cpu_attention_isa() -> str:
    """The CPU attention kernel copy in use: 'amx', 'avx512', 'avx2', 'neon_bf16', 'sve', 'neon' or 'baseline'."""
    return load().pagedkv_cpu_attention_isa().decode()


def cpu_attention_isas() -> list[str]:
    """The CPU attention kernel copies this CPU runs, best first."""
    return load().pagedkv_cpu_attention_isas().decode().split(",")
