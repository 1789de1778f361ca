"""Runs every CUDA op once on small shapes (for compute-sanitizer memcheck / racecheck): each dtype,
the 16-byte and the scalar paths, a mixed decode/prefill batch, split-K with its merge, copy/swap, and
the model-layer ops."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import pagedkv.ops as ops  # noqa: E402


def attention(dtype, head_dim, block_size, group, seq_lens, q_lens, **kwargs):
    device = "cuda"
    num_kv_heads = 2
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    tables = torch.full((len(seq_lens), max(blocks) + 1), num_blocks + 7, dtype=torch.int32)  # garbage padding
    perm, used = torch.randperm(num_blocks), 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[used:used + n]
        used += n
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, dtype=dtype, device=device)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out, lse = ops.paged_attention_with_lse(q, kc, vc, tables.to(device), sl, qsl, head_dim ** -0.5, **kwargs)
    key = torch.randn(len(q_lens), num_kv_heads, head_dim, dtype=dtype, device=device)
    slots = torch.tensor([0, -1] + list(range(3, len(q_lens) + 1)), device=device)[:len(q_lens)]
    ops.reshape_and_cache(key, key.clone(), kc, vc, slots)
    return out, lse


def main():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        attention(dtype, 128, 16, 4, [37, 20, 1], [1, 9, 1])                   # mixed, 16-byte path
        attention(dtype, 72 if dtype == torch.float32 else 36, 8, 2, [50, 5], [3, 1])  # scalar path (odd D)
        attention(dtype, 64, 16, 8, [3000], [1], max_seq_len=3000)             # split-K + merge
        attention(dtype, 256, 256, 1, [600, 300], [40, 1], sliding_window=100, softcap=20.0)
    kc = torch.randn(16, 16, 2, 64, device="cuda")
    vc = torch.randn_like(kc)
    ops.copy_blocks([kc], [vc], torch.tensor([[0, 5], [1, 6]], device="cuda"))
    ops.copy_blocks([kc], [vc], torch.tensor([[2, 7]]))
    host = torch.empty(8, 16, 2, 64).pin_memory()
    ops.swap_blocks(kc, host, torch.tensor([[0, 1], [3, 2]]))
    ops.swap_blocks(host, kc, torch.tensor([[1, 9]]))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):            # model-layer ops
        x = torch.randn(5, 300, dtype=dtype, device="cuda")
        w = torch.randn(300, dtype=dtype, device="cuda")
        ops.rms_norm(x, w, 1e-6)
        ops.fused_add_rms_norm(x, x.clone(), w, 1e-6)
        ops.silu_and_mul(torch.randn(5, 2, 130, dtype=dtype, device="cuda"))
        qkv = torch.randn(5, 6, 64, dtype=dtype, device="cuda")
        ops.rotary_embedding(torch.tensor([0, 3, 99, 4, 1000], device="cuda"), qkv[:, :4],
                             torch.randn(100, 64, device="cuda"))                  # 1000: out of range, skipped
    torch.cuda.synchronize()
    print("cuda_ops_smoke: ok")


if __name__ == "__main__":
    main()
