"""KV transfer's wire and what both sides agree on: the protocol version, the errors, the engines' fingerprints,
block chains, descriptor runs, the message framing and the records of a lease, a read and a transfer."""
import json
from dataclasses import dataclass, field

import numpy as np

from pagedkv import hash_block_tokens

from ..identity import kv_fingerprint
from ...serving.sampling import SamplingParams
from ...serving.scheduler import ScheduledBatch

PROTOCOL = 1
LEASE_MARGIN = 0.5    # a read ended within this share of the lease (from the request) needs no confirmation
WIRE_UP_S = 10.0      # how long the server drives the transport for a connecting decode instance
IDLE_WAIT_S = 0.005   # how long KVTransferClient.step() with nothing to run waits for a reply

__all__ = ["KVTransferError", "FingerprintMismatch", "PendingTransfer", "TransferResult", "fingerprint",
           "check_fingerprint", "require_packages"]


class KVTransferError(RuntimeError):
    """A transfer session could not be set up (no answer to the handshake, a peer refusing it)."""


class FingerprintMismatch(KVTransferError):
    """The two instances' KV caches are not interchangeable; `field` names the first field that differs."""

    def __init__(self, field_name: str, local, remote):
        super().__init__(f"KV transfer peers differ in {field_name!r}: local {local!r}, remote {remote!r}")
        self.field = field_name


def require_packages():
    """(zmq, nixl_agent, nixl_agent_config), or an ImportError saying what to install."""
    try:
        import zmq
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-untyped]
    except ImportError:
        raise ImportError('KV transfer needs nixl and pyzmq: pip install "pagedkv[nixl]" '
                          "(or pip install nixl pyzmq)") from None
    return zmq, nixl_agent, nixl_agent_config


# ---- what both sides must agree on ---------------------------------------------------------------------


def check_engine(llm) -> None:
    if llm.tp is not None:
        raise ValueError("KV transfer serves single-process engines (tensor_parallel_size=1)")
    if not llm.config.enable_prefix_caching:
        raise ValueError("KV transfer needs enable_prefix_caching=True: received blocks are registered in the "
                         "prefix cache, lent blocks are pinned there")
    if llm.model_config.group_windows != [None]:
        raise ValueError(f"KV transfer serves models with full attention in every layer (one KV group); this "
                         f"model's layer windows are {llm.model_config.group_windows}")


def fingerprint(llm) -> dict:
    """What makes two instances' blocks interchangeable (kv_identity.kv_fingerprint and the protocol
    version): a block read from one means the same in the other only when every field is equal."""
    return kv_fingerprint(llm, protocol=PROTOCOL)


def check_fingerprint(local: dict, remote: dict) -> None:
    """FingerprintMismatch naming the first field whose values differ (or that one side lacks)."""
    for name in sorted(set(local) | set(remote), key=lambda k: (k != "protocol", k)):
        if local.get(name) != remote.get(name):
            raise FingerprintMismatch(name, local.get(name), remote.get(name))


def block_chain(token_ids: list[int], num_blocks: int, block_size: int, algo, salt) -> list[int]:
    """The chained hashes of the first num_blocks full blocks (the prefix cache's block hashes)."""
    hashes, parent = [], None
    for i in range(num_blocks):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent = (hash_block_tokens(block, None, algo=algo, cache_salt=salt) if i == 0
                  else hash_block_tokens(block, parent, algo=algo))
        hashes.append(parent)
    return hashes


def settle_moves(llm) -> None:
    """Performs and confirms the host-tier copies an allocation outside a step queued (write-backs of the
    blocks it took, loads of its host hits), as a step does before its attention."""
    if llm.bm.host_tier_enabled:
        moves = ScheduledBatch(offloads=llm.bm.take_offloads(), loads=llm.bm.take_loads())
        llm.runner.move_blocks(moves)
        llm.bm.complete_offloads(True)
        llm.bm.complete_loads(True)


def new_seq_id(llm) -> int:
    """A sequence id the engine never hands out (its ids only grow)."""
    seq_id = llm.scheduler.next_seq_id
    llm.scheduler.next_seq_id += 1
    return seq_id


def coalesce(local_blocks: list[int], remote_blocks: list[int]) -> list[tuple[int, int, int]]:
    """Runs (local first block, remote first block, length) where both block lists go up by one."""
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local_blocks, remote_blocks):
        if runs and runs[-1][0] + runs[-1][2] == lb and runs[-1][1] + runs[-1][2] == rb:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lb, rb, 1))
    return runs


def block_descriptors(runs, local_bases, remote_bases, block_bytes, local_dev=0, remote_dev=0):
    """NIXL descriptor arrays [n, 3] (address, bytes, device) for local and remote: one per cache tensor
    and run of contiguous blocks."""
    local, remote = [], []
    for lbase, rbase in zip(local_bases, remote_bases):
        for lb, rb, n in runs:
            local.append((lbase + lb * block_bytes, n * block_bytes, local_dev))
            remote.append((rbase + rb * block_bytes, n * block_bytes, remote_dev))
    return np.array(local, dtype=np.uint64).reshape(-1, 3), np.array(remote, dtype=np.uint64).reshape(-1, 3)


def send(sock, message: dict, *frames: bytes, identity: bytes | None = None) -> None:
    parts = ([identity] if identity is not None else []) + [json.dumps(message).encode(), *frames]
    sock.send_multipart(parts)


@dataclass


class Lease:
    seq_id: int
    expires: float          # on the block manager's clock
    num_blocks: int


@dataclass


class Read:
    """A NIXL read in flight: blocks [start, end) of the prompt."""
    start: int
    end: int
    began: float
    deadline: float
    handle: object = None
    error: str | None = None


@dataclass


class PendingTransfer:
    """One prompt submit() is bringing in: `request` is its engine Request once added."""
    prompt: object
    token_ids: list
    params: SamplingParams
    result: "TransferResult"
    reply: dict | None = None
    read: Read | None = None
    request: object = None


@dataclass


class TransferResult:
    """What one prompt took from the prefill instance: blocks hit locally, read remotely and accepted, and
    why the rest (if any) is recomputed."""
    local_blocks: int = 0
    read_blocks: int = 0
    accepted_blocks: int = 0
    bytes_read: int = 0
    fallback: str | None = None     # None: everything wanted was received
    seq_id: int | None = None       # the sequence holding the received blocks until the prompt is admitted
    runs: list = field(default_factory=list)     # what was read: (local block, remote block, count) runs
    sent_at: float = 0.0                         # time.monotonic() when the request went out
    timings: dict = field(default_factory=dict)  # seconds: prefill_s (request to reply), compute_s (the
                                                 # remote generate), receive_s (reply to registered), read_s
