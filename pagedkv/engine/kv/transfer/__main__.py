"""A prefill instance from the command line (python -m pagedkv.engine.kv.transfer)."""
import argparse

from .server import KVTransferServer


def main(argv=None) -> None:
    """python -m pagedkv.engine.kv.transfer MODEL [--endpoint ...]: serves MODEL as a prefill instance;
    prints "pagedkv-kv-transfer ENDPOINT" once it serves."""
    from ...serving.llm_engine import LLM

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model")
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:0")
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--kv-recent-tokens", type=int, default=None,
                        help="the recent pool's window of a float8 / int4 cache (0: every key from it)")
    parser.add_argument("--kv-first-block", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--cpu-threads", default="auto")
    args = parser.parse_args(argv)
    threads = args.cpu_threads if args.cpu_threads == "auto" else int(args.cpu_threads)
    recent = {k: v for k, v in (("kv_recent_tokens", args.kv_recent_tokens),
                                ("kv_first_block", args.kv_first_block)) if v is not None}
    llm = LLM(args.model, block_size=args.block_size, num_blocks=args.num_blocks, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, cpu_threads=threads, **recent)
    with KVTransferServer(llm, args.endpoint, lease_s=args.lease_s) as server:
        print(f"pagedkv-kv-transfer {server.endpoint}", flush=True)
        try:
            server.serve()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
