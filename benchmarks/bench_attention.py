"""paged_attention vs torch SDPA and FlexAttention (compiled) on the same KV stored contiguously: decode
at several batch / context sizes and prefill over a cached prefix. Prints a table (median of repeats
after warm-up; CUDA events on GPU) with speed ratios; on CUDA also the KV bandwidth achieved and its
share of a measured device-to-device copy. FlexAttention is compiled once per shape (seconds on a CPU;
`--no-flex` skips it) and its output is checked against SDPA before it is timed.

    python benchmarks/bench_attention.py                  # CPU (or CUDA when present), short run
    python benchmarks/bench_attention.py --device cpu --dtype float32 --repeats 20
    python benchmarks/bench_attention.py --roofline       # CPU decode against the machine's read bandwidth
    python benchmarks/bench_attention.py --roofline --isa avx2 --threads 1   # one ISA copy, one thread

`--roofline` times CPU decode (best of --repeats calls) on shuffled block tables for fp32, bf16 and fp16
K/V and prints each case's K/V bytes per second as a share of a streaming read measured in the same
process (the sum of a 256 MiB fp32 tensor, best of the same number of calls, measured again before
every case so that load from other processes shows in both).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import pagedkv.ops as ops  # noqa: E402
from pagedkv import _C  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import DTYPES, time_ms  # noqa: E402


def copy_bandwidth_gbs(device, warmup, repeats):
    """Device-to-device copy bandwidth (bytes read + written per second) of a 1 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * src.numel() / ms / 1e6


def read_bandwidth_gbs(repeats):
    """Streaming read bandwidth of this process's threads: bytes of a 256 MiB fp32 tensor summed per second
    (best of repeats)."""
    data = torch.ones(64 << 20, dtype=torch.float32)
    best = min(_seconds(data.sum) for _ in range(repeats + 1))
    return data.numel() * data.element_size() / best / 1e9


def _seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


ROOFLINE_CASES = [(16, 2048), (4, 8192), (4, 32768), (64, 512)]
ROOFLINE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def roofline(args):
    """Decode paged_attention on the CPU as a share of the read bandwidth, per case and K/V dtype."""
    repeats = args.repeats or 7
    print(f"CPU decode roofline: Hq={args.num_q_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
          f"block_size={args.block_size} threads={torch.get_num_threads()} isa={_C._cpu_attention_isa()} "
          f"best of {repeats} calls; "
          f"share = K/V bytes / time / read bandwidth (measured before each case)")
    names = [str(d).split(".")[-1] for d in ROOFLINE_DTYPES]
    print(f"{'case':<14}{'read GB/s':>10}" + "".join(f"{n + ' ms':>13}{'share':>7}" for n in names)
          + f"{'bf16 speed / fp32':>19}")
    for batch, ctx in ROOFLINE_CASES:
        bandwidth = read_bandwidth_gbs(repeats)
        line, ms = f"{f'B{batch} L{ctx}':<14}{bandwidth:>10.1f}", {}
        for dtype in ROOFLINE_DTYPES:
            case = Case(batch, ctx, 1, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                        head_dim=args.head_dim, block_size=args.block_size, dtype=dtype, device=torch.device("cpu"),
                        contiguous_copies=False)
            case.paged()
            ms[dtype] = 1e3 * min(_seconds(case.paged) for _ in range(repeats))
            line += f"{ms[dtype]:>13.2f}{case.kv_bytes / ms[dtype] / 1e6 / bandwidth:>7.2f}"
            del case
        print(line + f"{ms[torch.float32] / ms[torch.bfloat16]:>18.2f}x", flush=True)


class Case:
    """B sequences of equal length ctx (q_len new tokens each) over a shuffled paged cache, plus the
    same K/V laid out contiguously for SDPA."""

    def __init__(self, batch, ctx, q_len, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
                 contiguous_copies=True):
        self.batch, self.ctx, self.q_len = batch, ctx, q_len
        blocks_per_seq = -(-ctx // block_size)
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.randn(shape, dtype=dtype, device=device)
        self.value_cache = torch.randn(shape, dtype=dtype, device=device)
        self.block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
        self.query = torch.randn(batch * q_len, num_q_heads, head_dim, dtype=dtype, device=device)
        self.scale = head_dim ** -0.5
        self.kv_bytes = 2 * self.key_cache[0].numel() * self.key_cache.element_size() * num_blocks
        if not contiguous_copies:
            return
        # SDPA layout: [B, H, L, D]; keys gathered once through the block tables (outside the timing).
        blocks = self.block_tables.long()
        def contiguous(cache):
            return cache[blocks].reshape(batch, -1, num_kv_heads, head_dim)[:, :ctx].transpose(1, 2).contiguous()
        self.k, self.v = contiguous(self.key_cache), contiguous(self.value_cache)
        self.group = num_q_heads // num_kv_heads
        self.k_expanded = self.k.repeat_interleave(self.group, dim=1)
        self.v_expanded = self.v.repeat_interleave(self.group, dim=1)
        self.q = self.query.view(batch, q_len, num_q_heads, head_dim).transpose(1, 2)
        # Bottom-right causal mask (queries are the last q_len positions); None for decode.
        pos_q = torch.arange(ctx - q_len, ctx, device=device).view(-1, 1)
        self.mask = None if q_len == 1 else (torch.arange(ctx, device=device).view(1, -1) <= pos_q)
        self.block_mask = None   # set by use_flex

    def paged(self):
        return ops.paged_attention(self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                                   self.query_start_loc, self.scale, max_seq_len=self.ctx)

    def sdpa_gqa(self):
        return F.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=self.mask, scale=self.scale,
                                              enable_gqa=True)

    def sdpa_expanded(self):
        return F.scaled_dot_product_attention(self.q, self.k_expanded, self.v_expanded, attn_mask=self.mask,
                                              scale=self.scale)

    def flex(self, compiled_flex):
        return compiled_flex(self.q, self.k, self.v, block_mask=self.block_mask, scale=self.scale, enable_gqa=True)

    def max_error(self):
        ref = self.sdpa_expanded().transpose(1, 2).reshape_as(self.query).float()
        return (self.paged().float() - ref).abs().max().item()


def use_flex(case):
    """Prepares the case for FlexAttention (a bottom-right causal block mask for prefill); returns the
    compiled kernel, or None when this torch cannot compile it here."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        if case.q_len > 1:
            offset = case.ctx - case.q_len
            case.block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + offset >= kv_idx, None, None,
                                                case.q_len, case.ctx, device=case.q.device)
        compiled = torch.compile(flex_attention, dynamic=False)
        torch.testing.assert_close(case.flex(compiled), case.sdpa_expanded(), atol=2e-2, rtol=2e-2)
        return compiled
    except Exception as e:  # noqa: BLE001 (any compile failure only drops the column)
        print(f"  (FlexAttention unavailable for this case: {type(e).__name__}: {str(e).splitlines()[0][:100]})")
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=None, help="default: 10 on CPU, 50 on CUDA")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiled once per shape)")
    parser.add_argument("--roofline", action="store_true",
                        help="CPU decode as a share of the read bandwidth (fp32, bf16, fp16; default 7 repeats)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--isa", default="auto", choices=["auto"] + _C._cpu_attention_isas(),
                        help="copy of the CPU attention kernels (default: the best this CPU runs)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    _C._set_cpu_attention_isa(args.isa)
    if args.roofline:
        return roofline(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    repeats = args.repeats or (50 if cuda else 10)
    if cuda:
        cases = [(1, 4096, 1), (8, 4096, 1), (64, 2048, 1), (256, 1024, 1), (1, 32768, 1), (4, 4096, 512)]
    else:
        cases = [(1, 4096, 1), (8, 1024, 1), (32, 512, 1), (1, 2048, 128)]
    copy_gbs = copy_bandwidth_gbs(device, args.warmup, repeats) if cuda else None

    print(f"device={device} dtype={str(dtype).split('.')[-1]} Hq={args.num_q_heads} Hkv={args.num_kv_heads} "
          f"D={args.head_dim} block_size={args.block_size} threads={torch.get_num_threads()}"
          + ("" if cuda else f" isa={_C._cpu_attention_isa()}")
          + (f" d2d_copy={copy_gbs:.0f} GB/s" if cuda else ""))
    header = f"{'kind':<8}{'B':>5}{'ctx':>7}{'q_len':>6}{'paged ms':>10}{'sdpa_gqa ms':>12}{'sdpa_exp ms':>12}" \
             f"{'flex ms':>9}{'speed vs best sdpa':>20}{'vs flex':>9}{'max err':>10}"
    if cuda:
        header += f"{'KV GB/s':>9}{'% copy':>8}"
    print(header)
    for batch, ctx, q_len in cases:
        case = Case(batch, ctx, q_len, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                    head_dim=args.head_dim, block_size=args.block_size, dtype=dtype, device=device)
        paged = time_ms(case.paged, device, args.warmup, repeats)
        gqa = time_ms(case.sdpa_gqa, device, args.warmup, repeats)
        expanded = time_ms(case.sdpa_expanded, device, args.warmup, repeats)
        compiled = None if args.no_flex else use_flex(case)
        flex = time_ms(lambda: case.flex(compiled), device, args.warmup, repeats) if compiled else float("nan")
        kind = "decode" if q_len == 1 else "prefill"
        line = (f"{kind:<8}{batch:>5}{ctx:>7}{q_len:>6}{paged:>10.3f}{gqa:>12.3f}{expanded:>12.3f}{flex:>9.3f}"
                f"{min(gqa, expanded) / paged:>19.2f}x{flex / paged:>8.2f}x{case.max_error():>10.1e}")
        if cuda:
            gbs = case.kv_bytes / paged / 1e6
            line += f"{gbs:>9.0f}{100 * gbs / copy_gbs:>7.0f}%"
        print(line)
        del case


if __name__ == "__main__":
    main()
