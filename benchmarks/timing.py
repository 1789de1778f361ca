"""Shared benchmark timing: warm up, then the median of repeats (CUDA events on GPU, wall clock on CPU);
thread_seconds for one call's CPU time on this thread (a shared machine's other jobs do not count)."""
import statistics
import time

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def time_ms(fn, device, warmup, repeats):
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def thread_seconds(fn) -> float:
    """This thread's CPU seconds for one call of fn."""
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def read_bandwidth_gbs(repeats):
    """Streaming read bandwidth of this process's threads: bytes of a 256 MiB fp32 tensor summed per second
    (best of repeats)."""
    data = torch.ones(64 << 20, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return data.numel() * data.element_size() / best / 1e9


def gemm_gflops(repeats, n=1536):
    """fp32 GEMM rate of this process's threads (torch.mm of two n x n matrices, best of repeats): the
    multiply-add rate a well-tuned kernel reaches on this machine, the yardstick of compute-bound work."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9
