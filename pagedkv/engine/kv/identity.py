"""What a KV block's bytes mean, as one fingerprint: two places may exchange blocks (a disk record read
back, a block read from another instance) only when every field is equal. The disk tier keeps its digest
in each record's header; KV transfer compares the fields in its handshake and names the first that differs."""
import hashlib
import json

import torch

SALT_SCHEME = "block0-salt:kv-scales-v1"   # kv_quant.cache_salt mixed into block 0 (hash_block_tokens)


def model_identity(model, model_config) -> str:
    """A digest of the model's configuration and of a sample of its first and last weights."""
    digest = hashlib.sha256(repr(sorted((k, repr(v)) for k, v in vars(model_config).items())).encode())
    params = list(model.parameters())
    for p in (params[0], params[-1]):
        digest.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def kv_fingerprint(llm, **extra) -> dict:
    """The fields that fix a block's meaning: model, KV dtype and scales, block size, cache layout, tensor
    parallel shard, hash algorithm and salt scheme; `extra` adds fields of the caller's own (a protocol
    version, the host tier's record layout)."""
    runner = llm.runner
    key = runner.kv_caches[0][0]
    fields = {
        "model": model_identity(llm.model, llm.model_config),
        "kv_dtype": str(key.dtype),
        # fixed scales or the rule ("rotated", "dynamic", ...): dynamic ones are set by each instance's first batch, and blocks written
        # under other scales differ in their salted hash, so the per-block identity check rejects them
        "kv_scales": None if llm.config.kv_cache_dtype == "auto" else llm.config.kv_scale,
        "block_size": llm.config.block_size,
        "cache_layout": cache_layout(runner.kv_caches),
        "tp_shard": [0, 1] if llm.tp is None else [llm.tp.rank, llm.tp.size],
        "hash_algo": llm.bm.hash_algo,
        "salt_scheme": SALT_SCHEME,
    }
    fields.update(extra)
    return fields


def cache_layout(kv_caches) -> str:
    """The cache tensors' layout: K/V pairs (NHD), or MLA's one latent tensor per layer."""
    first = kv_caches[0][0]
    kind = "NHD" if len(kv_caches[0]) == 2 else "MLA latent"
    return (f"{kind} x{len(kv_caches)} ({'K, V' if kind == 'NHD' else 'latent'}) "
            f"[blocks, {', '.join(str(d) for d in first.shape[1:])}] contiguous")


def fingerprint_digest(fields: dict) -> str:
    """sha256 of the fields in a canonical form (sorted keys, JSON)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=repr).encode()).hexdigest()


def host_record_layout(host_tier: torch.Tensor) -> str:
    """The host tier's block-major record layout (what a disk record holds)."""
    return f"{host_tier.dtype} {tuple(host_tier.shape[1:])} block-major"
