"""What each rank of a tensor-parallel group holds of a model (Megatron's sharding): pure geometry, no
process group. QKV and gate/up are column-parallel (each rank holds Hq/N query heads, Hkv/N KV heads, or
one KV head replicated over N/Hkv ranks when N > Hkv, and I/N of the MLP), o_proj and down are
row-parallel, the embedding and the LM head vocabulary-parallel. An MLA model's latent (one row per token
that every query head reads) is replicated: each rank holds Hq/N query heads and the whole latent."""
import dataclasses

from ..config import ModelConfig

ZERO = "zero"      # Shard.piece's answer for a tensor this rank holds as zeros


def split(n: int, size: int, rank: int) -> range:
    """Rank's part of range(n) cut into `size` contiguous parts whose lengths differ by at most one."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclasses.dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds of a model."""
    rank: int
    size: int

    def check(self, cfg: ModelConfig) -> None:
        n, hq, hkv = self.size, cfg.num_heads, cfg.num_kv_heads
        if hq % n:
            raise ValueError(f"tensor_parallel_size={n} must divide num_attention_heads={hq}")
        if cfg.latent_cache is None and hkv % n and n % hkv:
            raise ValueError(f"tensor_parallel_size={n} must divide num_key_value_heads={hkv} or be a multiple "
                             f"of it (KV heads are then replicated)")
        if cfg.intermediate_size < n:
            raise ValueError(f"tensor_parallel_size={n} exceeds intermediate_size={cfg.intermediate_size}")

    def q_heads(self, cfg: ModelConfig) -> range:
        per = cfg.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, cfg: ModelConfig) -> range:
        if cfg.latent_cache is not None:      # MLA: num_key_value_heads sizes no cache; the latent is whole
            return range(cfg.num_kv_heads)
        if self.size <= cfg.num_kv_heads:
            per = cfg.num_kv_heads // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        head = self.rank // (self.size // cfg.num_kv_heads)      # the KV head of this rank's query heads
        return range(head, head + 1)

    def intermediate(self, cfg: ModelConfig) -> range:
        return split(cfg.intermediate_size, self.size, self.rank)

    def vocab_rows(self, cfg: ModelConfig) -> int:
        """Rows of every rank's embedding and LM head (the last rank's may end in padding)."""
        return -(-cfg.vocab_size // self.size)

    def vocab(self, cfg: ModelConfig) -> range:
        rows = self.vocab_rows(cfg)
        return range(min(self.rank * rows, cfg.vocab_size), min((self.rank + 1) * rows, cfg.vocab_size))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's layers have (the vocabulary stays whole: sharded modules read it)."""
        self.check(cfg)
        return dataclasses.replace(cfg, num_heads=len(self.q_heads(cfg)), num_kv_heads=len(self.kv_heads(cfg)),
                                   intermediate_size=len(self.intermediate(cfg)))

    def piece(self, name: str, cfg: ModelConfig, rule: tuple | None = None):
        """The part of checkpoint tensor `name` this rank loads: None (all of it), ZERO (none: a
        row-parallel bias is added once, by rank 0), or (dim, range along dim, full length of dim).
        rule: the model's own split of it (LlamaForCausalLM.tensor_parallel_rule), else the Llama names'."""
        d = cfg.head_dim
        q, kv, inter, vocab = self.q_heads(cfg), self.kv_heads(cfg), self.intermediate(cfg), self.vocab(cfg)
        if rule is not None:
            dim, unit, width = rule
            if unit == "rank0":
                return None if self.rank == 0 else ZERO
            units, total = {"q_heads": (q, cfg.num_heads),
                            "intermediate": (inter, cfg.intermediate_size)}.get(unit, (None, unit))
            if units is None:
                units = split(total, self.size, self.rank)
            return dim, range(units.start * width, units.stop * width), total * width
        heads = lambda r: range(r.start * d, r.stop * d)   # noqa: E731
        layer = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        is_bias = name.endswith(".bias")
        if layer == "q_proj":
            return 0, heads(q), cfg.num_heads * d
        if layer in ("k_proj", "v_proj"):
            return 0, heads(kv), cfg.num_kv_heads * d
        if layer in ("gate_proj", "up_proj"):
            return 0, inter, cfg.intermediate_size
        if layer in ("o_proj", "down_proj"):
            if is_bias:
                return None if self.rank == 0 else ZERO
            return (1, heads(q), cfg.num_heads * d) if layer == "o_proj" else (1, inter, cfg.intermediate_size)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, vocab, cfg.vocab_size
        return None
