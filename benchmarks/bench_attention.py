"""paged_attention vs torch SDPA and FlexAttention (compiled) on the same KV stored contiguously: decode
at several batch / context sizes and prefill over a cached prefix. Prints a table (median of repeats
after warm-up; CUDA events on GPU) with speed ratios; on CUDA also the KV bandwidth achieved and its
share of a measured device-to-device copy. FlexAttention is compiled once per shape (seconds on a CPU;
`--no-flex` skips it) and its output is checked against SDPA before it is timed.

    python benchmarks/bench_attention.py                  # CPU (or CUDA when present), short run
    python benchmarks/bench_attention.py --device cpu --dtype float32 --repeats 20
    python benchmarks/bench_attention.py --roofline       # CPU decode against the machine's read bandwidth
    python benchmarks/bench_attention.py --roofline --isa avx2 --threads 1   # one ISA copy, one thread

`--layouts` times paged_attention on the caches other engines allocate (vLLM's interleaved K|V cells,
FlashInfer's [pages, 2, ...], the HND order), each holding the same K/V as a contiguous pair, against that
pair on the same shape: the layouts take turns call by call, each gets the median of --repeats calls
(default 15), and the table prints each layout's time as a ratio to the contiguous one (decode B16 L2048
and a prefill of 128 queries over 2048 keys, fp32 and bf16, or --dtype's only).

    python benchmarks/bench_attention.py --layouts --device cpu

`--sinks` times paged_attention with learned attention sinks (gpt-oss's one extra logit per query head)
against the same call without them, the two alternating call by call (median of --repeats, default 21),
for decode and a prefill over a cached prefix, fp32 and bf16 (or --dtype's only); the ratio is the sinks'
cost.

    python benchmarks/bench_attention.py --sinks --device cpu

`--int4` times decode over an int4 cache (paged_attention_int4, group 32) against paged_attention over bf16
K/V of the same shape (bf16 queries), best of --repeats calls each.

    python benchmarks/bench_attention.py --int4 --device cpu

`--roofline` times CPU decode (best of --repeats calls) on shuffled block tables for fp32, bf16, fp16 and fp8
K/V and prints each case's K/V bytes per second as a share of a streaming read measured in the same
process (the sum of a 256 MiB fp32 tensor, best of the same number of calls, measured again before
every case so that load from other processes shows in both).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import pagedkv.ops as ops  # noqa: E402
from pagedkv import _ops_library, int4_row_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import DTYPES, gemm_gflops, read_bandwidth_gbs, time_ms  # noqa: E402


def copy_bandwidth_gbs(device, warmup, repeats):
    """Device-to-device copy bandwidth (bytes read + written per second) of a 1 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * src.numel() / ms / 1e6


def _seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


ROOFLINE_CASES = [(16, 2048), (4, 8192), (4, 32768), (64, 512)]
ROOFLINE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]  # fp8: fp32 queries


def roofline(args):
    """Decode paged_attention on the CPU as a share of the read bandwidth, per case and K/V dtype, and each
    narrow dtype's time as a share of fp32's (bytes read halve for bf16 / fp16 and quarter for fp8)."""
    repeats = args.repeats or 7
    print(f"CPU decode roofline: Hq={args.num_q_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
          f"block_size={args.block_size} threads={torch.get_num_threads()} isa={_ops_library.cpu_attention_isa()} "
          f"best of {repeats} calls; "
          f"share = K/V bytes / time / read bandwidth (measured before each case); "
          f"x fp32 = time / fp32's time; fp32 FMA share = the two products' flops (4 B Hq L D) / time / "
          f"an fp32 GEMM's rate (torch.mm 1536^2, measured before each case)")
    names = [str(d).split(".")[-1].replace("float8_e4m3fn", "fp8") for d in ROOFLINE_DTYPES]
    print(f"{'case':<14}{'read GB/s':>10}{'GEMM GF/s':>10}" + "".join(f"{n + ' ms':>13}{'share':>7}" for n in names)
          + "".join(f"{n + ' x fp32':>17}" for n in names[1:]) + f"{'fp32 FMA share':>16}")
    for batch, ctx in ROOFLINE_CASES:
        bandwidth, gemm = read_bandwidth_gbs(repeats), gemm_gflops(repeats)
        line, ms = f"{f'B{batch} L{ctx}':<14}{bandwidth:>10.1f}{gemm:>10.1f}", {}
        for dtype in ROOFLINE_DTYPES:
            case = Case(batch, ctx, 1, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                        head_dim=args.head_dim, block_size=args.block_size, dtype=dtype, device=torch.device("cpu"),
                        contiguous_copies=False)
            case.paged()
            ms[dtype] = 1e3 * min(_seconds(case.paged) for _ in range(repeats))
            line += f"{ms[dtype]:>13.2f}{case.kv_bytes / ms[dtype] / 1e6 / bandwidth:>7.2f}"
            del case
        fp32 = ms[torch.float32]
        flops = 4 * batch * args.num_q_heads * ctx * args.head_dim
        print(line + "".join(f"{ms[d] / fp32:>17.2f}" for d in ROOFLINE_DTYPES[1:])
              + f"{flops / fp32 / 1e6 / gemm:>16.2f}", flush=True)


INT4_CASES = [(1, 4096), (8, 2048), (4, 8192)]


def int4_decode(args):
    """Decode over an int4 cache (paged_attention_int4, group 32) against paged_attention over bf16 K/V of the
    same shape, bf16 queries; best of --repeats calls each, the two taking turns."""
    repeats, device, group = args.repeats or 7, torch.device(args.device), 32
    hq, hkv, d, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    print(f"int4 decode: device={device} Hq={hq} Hkv={hkv} D={d} block_size={bs} group={group} "
          f"threads={torch.get_num_threads()} best of {repeats} calls")
    print(f"{'case':<14}{'bf16 ms':>10}{'int4 ms':>10}{'int4 speed / bf16':>19}{'KV bytes int4 / bf16':>22}")
    row = int4_row_bytes(d, group)
    for batch, ctx in INT4_CASES:
        blocks = -(-ctx // bs)
        tables = torch.randperm(batch * blocks, device=device).int().view(batch, blocks)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=device)
        kv16 = [torch.randn(batch * blocks, bs, hkv, d, dtype=torch.bfloat16, device=device) for _ in range(2)]
        kv4 = [torch.empty(batch * blocks, bs, hkv, row, dtype=torch.uint8, device=device) for _ in range(2)]
        slots = torch.arange(batch * blocks * bs, device=device)
        ops.reshape_and_cache_int4(kv16[0].flatten(0, 1), kv16[1].flatten(0, 1), *kv4, slots, group)
        bf16 = lambda: ops.paged_attention(q, *kv16, tables, lens, qsl, d ** -0.5)  # noqa: E731
        int4 = lambda: ops.paged_attention_int4(q, *kv4, tables, lens, qsl, d ** -0.5, group)  # noqa: E731
        bf16(), int4()
        t16, t4 = [], []
        for _ in range(repeats):
            t16.append(_seconds(bf16))
            t4.append(_seconds(int4))
        ms16, ms4 = 1e3 * min(t16), 1e3 * min(t4)
        print(f"{f'B{batch} L{ctx}':<14}{ms16:>10.2f}{ms4:>10.2f}{ms16 / ms4:>18.2f}x{row / (2 * d):>21.3f}x",
              flush=True)


def cache_views(layout, shape, dtype, device):
    """(key_cache, value_cache) [blocks, block_size, Hkv, D] views in one engine's layout (uninitialised)."""
    n, bs, h, d = shape
    if layout == "contiguous":
        return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
    if layout == "vllm_cells":  # one tensor per layer, K|V interleaved in each cell
        x = torch.empty(n, bs, h, 2 * d, dtype=dtype, device=device)
        return x[..., :d], x[..., d:]
    if layout == "flashinfer":  # [pages, 2, page, Hkv, D]
        x = torch.empty(n, 2, bs, h, d, dtype=dtype, device=device)
        return x[:, 0], x[:, 1]
    if layout == "hnd":  # [pages, 2, Hkv, page, D], each half seen in NHD order
        x = torch.empty(n, 2, h, bs, d, dtype=dtype, device=device)
        return x[:, 0].transpose(1, 2), x[:, 1].transpose(1, 2)
    raise ValueError(layout)


SINK_CASES = [(16, 2048, 1), (4, 8192, 1), (1, 2048, 128)]


def sinks_cost(args, device):
    """paged_attention with sinks against the same call without, alternating call by call."""
    repeats = args.repeats or 21
    dtypes = [DTYPES[args.dtype]] if args.dtype else [torch.float32, torch.bfloat16]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"paged_attention with sinks vs without: device={device} Hq={args.num_q_heads} Hkv={args.num_kv_heads} "
          f"D={args.head_dim} block_size={args.block_size} threads={torch.get_num_threads()}"
          + ("" if device.type == "cuda" else f" isa={_ops_library.cpu_attention_isa()}")
          + f"; the two alternate call by call, median of {repeats} calls each")
    print(f"{'case':<24}{'dtype':<10}{'without ms':>12}{'with ms':>10}{'ratio':>8}")
    for batch, ctx, q_len in SINK_CASES:
        for dtype in dtypes:
            case = Case(batch, ctx, q_len, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                        head_dim=args.head_dim, block_size=args.block_size, dtype=dtype, device=device,
                        contiguous_copies=False)
            sinks = torch.randn(args.num_q_heads, dtype=torch.float32, device=device)
            calls = {"without": case.paged,
                     "with": lambda: ops.paged_attention(case.query, case.key_cache, case.value_cache,
                                                         case.block_tables, case.seq_lens, case.query_start_loc,
                                                         case.scale, max_seq_len=ctx, sinks=sinks)}
            assert not torch.equal(calls["with"](), calls["without"]()), "the sinks did not change the output"
            for _ in range(args.warmup):
                for call in calls.values():
                    call()
            sync()
            samples = {name: [] for name in calls}
            for r in range(repeats):
                for name in (["without", "with"] if r % 2 == 0 else ["with", "without"]):
                    t0 = time.perf_counter()
                    calls[name]()
                    sync()
                    samples[name].append((time.perf_counter() - t0) * 1e3)
            ms = {name: statistics.median(v) for name, v in samples.items()}
            kind = "decode" if q_len == 1 else "prefill"
            label = f"{kind} B{batch} L{ctx}" + (f" q{q_len}" if q_len > 1 else "")
            print(f"{label:<24}{str(dtype).split('.')[-1]:<10}{ms['without']:>12.3f}{ms['with']:>10.3f}"
                  f"{ms['with'] / ms['without']:>7.3f}x", flush=True)
            del case, calls


CACHE_LAYOUTS = ["contiguous", "vllm_cells", "flashinfer", "hnd"]
LAYOUT_CASES = [(16, 2048, 1), (1, 2048, 128)]


def layouts(args, device):
    """paged_attention on each engine's cache layout against contiguous caches holding the same K/V."""
    repeats = args.repeats or 15
    dtypes = [DTYPES[args.dtype]] if args.dtype else [torch.float32, torch.bfloat16]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"paged_attention on cache views vs contiguous caches: device={device} Hq={args.num_q_heads} "
          f"Hkv={args.num_kv_heads} D={args.head_dim} block_size={args.block_size} threads={torch.get_num_threads()}"
          + ("" if device.type == "cuda" else f" isa={_ops_library.cpu_attention_isa()}")
          + f"; layouts alternate call by call, median of {repeats} calls each; ratio = layout / contiguous")
    print(f"{'case':<24}{'dtype':<10}{'contiguous ms':>14}" + "".join(f"{name + ' ms':>16}{'ratio':>7}"
                                                                   for name in CACHE_LAYOUTS[1:]))
    for batch, ctx, q_len in LAYOUT_CASES:
        for dtype in dtypes:
            case = Case(batch, ctx, q_len, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                        head_dim=args.head_dim, block_size=args.block_size, dtype=dtype, device=device,
                        contiguous_copies=False)
            calls, outs = {}, {}
            for name in CACHE_LAYOUTS:
                k, v = cache_views(name, case.key_cache.shape, dtype, device)
                k.copy_(case.key_cache)
                v.copy_(case.value_cache)
                calls[name] = (lambda k=k, v=v: ops.paged_attention(
                    case.query, k, v, case.block_tables, case.seq_lens, case.query_start_loc, case.scale,
                    max_seq_len=ctx))
                outs[name] = calls[name]()  # also the warm-up
            del case.key_cache, case.value_cache
            for name in CACHE_LAYOUTS[1:]:
                assert torch.equal(outs[name], outs["contiguous"]), f"{name} differs from contiguous"
            samples = {name: [] for name in CACHE_LAYOUTS}
            for _ in range(args.warmup):
                for name in CACHE_LAYOUTS:
                    calls[name]()
            sync()
            for r in range(repeats):
                order = CACHE_LAYOUTS if r % 2 == 0 else CACHE_LAYOUTS[::-1]
                for name in order:
                    t0 = time.perf_counter()
                    calls[name]()
                    sync()
                    samples[name].append((time.perf_counter() - t0) * 1e3)
            ms = {name: statistics.median(s) for name, s in samples.items()}
            kind = "decode" if q_len == 1 else "prefill"
            line = f"{f'{kind} B{batch} L{ctx}' + (f' q{q_len}' if q_len > 1 else ''):<24}" \
                   f"{str(dtype).split('.')[-1]:<10}{ms['contiguous']:>14.3f}"
            line += "".join(f"{ms[name]:>16.3f}{ms[name] / ms['contiguous']:>6.2f}x" for name in CACHE_LAYOUTS[1:])
            print(line, flush=True)
            del calls, outs, case


class Case:
    """B sequences of equal length ctx (q_len new tokens each) over a shuffled paged cache, plus the
    same K/V laid out contiguously for SDPA."""

    def __init__(self, batch, ctx, q_len, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
                 contiguous_copies=True):
        self.batch, self.ctx, self.q_len = batch, ctx, q_len
        blocks_per_seq = -(-ctx // block_size)
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)  # float8 K/V, fp32 queries, per-head scales
        self.key_cache = torch.randn(shape, device=device).to(dtype)
        self.value_cache = torch.randn(shape, device=device).to(dtype)
        self.k_scale = self.v_scale = torch.full((num_kv_heads,), 0.5, device=device) if fp8 else None
        self.block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
        self.query = torch.randn(batch * q_len, num_q_heads, head_dim, dtype=torch.float32 if fp8 else dtype,
                                 device=device)
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
                                   self.query_start_loc, self.scale, max_seq_len=self.ctx,
                                   k_scale=self.k_scale, v_scale=self.v_scale)

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
                        help="CPU decode as a share of the read bandwidth (fp32, bf16, fp16, fp8; default 7 repeats)")
    parser.add_argument("--sinks", action="store_true", help="the cost of learned attention sinks")
    parser.add_argument("--int4", action="store_true", help="decode over an int4 cache against bf16 K/V")
    parser.add_argument("--layouts", action="store_true",
                        help="paged_attention on vLLM / FlashInfer / HND cache views vs contiguous caches")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--isa", default="auto", choices=["auto"] + _ops_library.cpu_attention_isas(),
                        help="copy of the CPU attention kernels (default: the best this CPU runs)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    _ops_library.set_cpu_attention_isa(args.isa)
    if args.roofline:
        return roofline(args)
    if args.int4:
        return int4_decode(args)
    device = torch.device(args.device)
    if args.layouts:
        return layouts(args, device)
    if args.sinks:
        return sinks_cost(args, device)
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
          + ("" if cuda else f" isa={_ops_library.cpu_attention_isa()}")
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
