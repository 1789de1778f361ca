"""KV block transfer between two engine instances (disaggregated prefill): a prefill instance computes
prompts and lends their full blocks under a lease (server); a decode instance reads the blocks its prefix
cache lacks over NIXL straight into its own KV cache (client: connection, receive), checks each block's
identity, registers the blocks as cached and decodes. Control messages travel over ZeroMQ, KV bytes over
NIXL (UCX); protocol holds what both sides agree on, region a cache registered with NIXL.
`python -m pagedkv.engine.kv.transfer MODEL` serves a prefill instance.

Optional: needs nixl and pyzmq (pip install "pagedkv[nixl]"). docs/design.md ("KV transfer") has the
protocol and its failure rules."""
from .client import KVTransferClient
from .protocol import (FingerprintMismatch, KVTransferError, PendingTransfer, TransferResult, block_descriptors,
                       check_fingerprint, coalesce, fingerprint, require_packages)
from .server import KVTransferServer

__all__ = ["KVTransferServer", "KVTransferClient", "KVTransferError", "FingerprintMismatch", "PendingTransfer",
           "TransferResult", "fingerprint", "check_fingerprint", "require_packages", "coalesce", "block_descriptors"]
