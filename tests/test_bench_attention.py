"""The attention benchmark's roofline table: every K/V dtype (fp8 with fp32 queries and per-head scales)
gets a time, a share of the read bandwidth and, past fp32, its time as a share of fp32's."""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import bench_attention as ba  # noqa: E402


def test_roofline_prints_a_row_per_case_with_every_dtype(monkeypatch, capsys):
    monkeypatch.setattr(ba, "ROOFLINE_CASES", [(2, 40)])
    monkeypatch.setattr(ba, "read_bandwidth_gbs", lambda repeats: 0.001)
    monkeypatch.setattr(ba, "gemm_gflops", lambda repeats: 0.001)
    # Fixed call times per K/V dtype (the call still runs), so the printed ratios are checked exactly.
    seconds = {torch.float32: 0.004, torch.bfloat16: 0.002, torch.float16: 0.003, torch.float8_e4m3fn: 0.001}

    def fixed_seconds(fn):
        fn()
        return seconds[fn.__self__.key_cache.dtype]
    monkeypatch.setattr(ba, "_seconds", fixed_seconds)
    args = argparse.Namespace(repeats=1, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    ba.roofline(args)
    lines = capsys.readouterr().out.splitlines()
    header, row = lines[1].split(), lines[2].split()
    assert [h for h in header if h in ("float32", "bfloat16", "float16", "fp8")] == \
        ["float32", "bfloat16", "float16", "fp8", "bfloat16", "float16", "fp8"]
    assert row[0] == "B2" and row[1] == "L40"
    numbers = [float(x) for x in row[2:]]
    n = len(ba.ROOFLINE_DTYPES)
    assert len(numbers) == 2 + 2 * n + n - 1 + 1 and numbers[:2] == [0.0, 0.0]
    times, shares = numbers[2:2 + 2 * n:2], numbers[3:3 + 2 * n:2]
    ratios, fma_share = numbers[2 + 2 * n:-1], numbers[-1]
    assert abs(fma_share - 4 * 2 * 4 * 40 * 64 / times[0] / 1e6 / 0.001) < 0.01 + 0.01 * fma_share
    assert abs(shares[0] - 2 * 6 * 16 * 2 * 64 * 4 / times[0] / 1e6 / 0.001) < 0.01 + 0.01 * shares[0]
    assert shares[0] > 1 and fma_share > 1  # the formulas, not rounding, decide the comparisons above
    assert times == [1e3 * seconds[d] for d in ba.ROOFLINE_DTYPES]
    for t, ratio in zip(times[1:], ratios):
        assert abs(ratio - t / times[0]) < 0.01 + 0.01 * ratio


def test_an_fp8_case_matches_the_dequantised_reference():
    case = ba.Case(2, 40, 1, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                   dtype=torch.float8_e4m3fn, device=torch.device("cpu"))
    assert case.query.dtype == torch.float32 and case.kv_bytes == 2 * case.key_cache.numel()
    out = case.paged()
    # The reference reads the fp8 cache as float(x) * 0.5, its per-head scale.
    k, v = case.k.float() * 0.5, case.v.float() * 0.5
    ref = torch.nn.functional.scaled_dot_product_attention(case.q, k, v, scale=case.scale, enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape_as(out), atol=1e-4, rtol=1e-4)
