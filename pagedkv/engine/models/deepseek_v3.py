"""DeepSeek V3: multi-head latent attention (MLA) over the latent cache, one row per token and layer of the
normalised latent and the rope key, read in absorbed form (kv_b_proj folded into the query and the output),
and a mixture of experts after the first `first_k_dense_replace` dense layers: sigmoid scores, group-limited
top-k routing with the score correction bias, and shared experts beside the routed ones. The experts are plain
torch: the KV cache, not the GEMMs, is this library's product."""
import re

import torch
from torch import nn
from torch.nn import functional as F

from pagedkv import ops

from ..config import ModelConfig
from .layers import MLP, DecoderLayer, RMSNorm, yarn_mscale
from .llama import LlamaForCausalLM, LlamaModel

NORM_EPS = 1e-6     # transformers' q_a_layernorm and kv_a_layernorm keep their default eps, whatever rms_norm_eps


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
    return value


class MLANumbers:
    """The attention and routing fields of config.json (ModelConfig.extra), checked."""

    def __init__(self, cfg: ModelConfig):
        extra = cfg.extra
        self.kv_lora_rank, self.rope_dim = cfg.latent_cache
        self.nope_dim = _positive_int("qk_nope_head_dim", extra["qk_nope_head_dim"])
        self.v_dim = _positive_int("v_head_dim", extra["v_head_dim"])
        q_lora_rank = extra["q_lora_rank"]
        self.q_lora_rank = None if q_lora_rank is None else _positive_int("q_lora_rank", q_lora_rank)
        if self.rope_dim % 2:
            raise ValueError(f"config.json: qk_rope_head_dim must be even (rope turns pairs), got {self.rope_dim}")
        if not isinstance(extra["rope_interleave"], bool):
            raise ValueError(f"config.json: rope_interleave must be true or false, got {extra['rope_interleave']!r}")
        self.rope_interleave = extra["rope_interleave"]
        self.experts = _positive_int("n_routed_experts", extra["n_routed_experts"])
        self.shared = _positive_int("n_shared_experts", extra["n_shared_experts"])
        self.top_k = _positive_int("num_experts_per_tok", extra["num_experts_per_tok"])
        self.inter = _positive_int("moe_intermediate_size", extra["moe_intermediate_size"])
        self.groups = _positive_int("n_group", extra["n_group"])
        self.topk_group = _positive_int("topk_group", extra["topk_group"])
        dense = extra["first_k_dense_replace"]
        if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
            raise ValueError(f"config.json: first_k_dense_replace must be an integer >= 0, got {dense!r}")
        self.first_k_dense = dense
        if self.experts % self.groups or self.experts // self.groups < 2:
            raise ValueError(f"config.json: n_routed_experts={self.experts} must be a multiple of n_group="
                             f"{self.groups} with at least 2 experts a group (a group scores by its top two)")
        if self.topk_group > self.groups:
            raise ValueError(f"config.json: topk_group={self.topk_group} exceeds n_group={self.groups}")
        if self.top_k > self.topk_group * (self.experts // self.groups):
            raise ValueError(f"config.json: num_experts_per_tok={self.top_k} exceeds the experts of topk_group="
                             f"{self.topk_group} groups ({self.topk_group * (self.experts // self.groups)})")
        factor = extra["routed_scaling_factor"]
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"config.json: routed_scaling_factor must be a positive number, got {factor!r}")
        self.routed_scaling_factor = float(factor)
        if not isinstance(extra["norm_topk_prob"], bool):
            raise ValueError(f"config.json: norm_topk_prob must be true or false, got {extra['norm_topk_prob']!r}")
        self.norm_topk_prob = extra["norm_topk_prob"]


def softmax_scale(cfg: ModelConfig, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared (transformers'
    yarn_apply_mscale: the scale of every dimension, where the rope's attention factor scales only the rope's)."""
    scale = qk_head_dim ** -0.5
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.get("mscale_all_dim"):
        m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale *= m * m
    return scale


def deinterleave(rope_dim: int) -> torch.Tensor:
    """The order that turns DeepSeek's interleaved rope pairs (x0, x1), (x2, x3), ... into the half-split
    layout (evens, then odds), which rotates with the same frequencies as rotate_half does."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


class MLAttention(nn.Module):
    """Multi-head latent attention. Per token the cache keeps kv_c = norm(kv_a_proj(x)[:kv_lora_rank]) and the
    rope key k_pe (one "head" shared by every query head); head h's key is (W_UK[h] kv_c, k_pe) and its value
    W_UV[h] kv_c, so q . k = (q_nope W_UK[h]) . kv_c + q_pe . k_pe and the output is W_UV[h] applied to the
    attention-weighted sum of kv_c: the kernel attends with absorbed queries [q_nope W_UK[h], q_pe] to the
    latent rows, and W_UV (kv_b_proj's value rows) turns its output into values."""

    def __init__(self, cfg: ModelConfig, layer: int, tp=None):
        super().__init__()
        if tp is not None:
            raise ValueError("DeepSeek V3: tensor_parallel_size > 1 is not supported (its latent attention and "
                             "experts are not sharded)")
        n = self.numbers = MLANumbers(cfg)
        self.num_heads, hidden, bias = cfg.num_heads, cfg.hidden_size, cfg.attention_bias
        self.qk_head_dim = n.nope_dim + n.rope_dim
        q_width = self.num_heads * self.qk_head_dim
        if n.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, n.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(n.q_lora_rank, NORM_EPS)
            self.q_b_proj = nn.Linear(n.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, n.kv_lora_rank + n.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(n.kv_lora_rank, NORM_EPS)
        self.kv_b_proj = nn.Linear(n.kv_lora_rank, self.num_heads * (n.nope_dim + n.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * n.v_dim, hidden, bias=bias)
        self.scale = softmax_scale(cfg, self.qk_head_dim)
        self.kv_group = cfg.layer_groups[layer]
        self.kv_scales = None      # the latent cache is in the model's dtype (float8 is refused by the runner)
        self.rope_deinterleaved = False

    @property
    def query_proj(self) -> nn.Linear:
        return self.q_proj if self.numbers.q_lora_rank is None else self.q_b_proj

    @torch.no_grad()
    def after_loading(self) -> None:
        n = self.numbers
        if n.rope_interleave and not self.rope_deinterleaved:
            # Reorder the rope rows of the projections once: the rope then runs half-split in place, and
            # the cached k_pe is transformers' rotated key exactly (its interleaved rope outputs this order).
            order = deinterleave(n.rope_dim).to(self.kv_a_proj_with_mqa.weight.device)
            head = torch.arange(self.qk_head_dim, device=order.device)
            head[n.nope_dim:] = n.nope_dim + order
            rows = (torch.arange(self.num_heads, device=order.device)[:, None] * self.qk_head_dim + head).reshape(-1)
            self.query_proj.weight.copy_(self.query_proj.weight[rows])
            kv_rows = torch.cat([torch.arange(n.kv_lora_rank, device=order.device), n.kv_lora_rank + order])
            self.kv_a_proj_with_mqa.weight.copy_(self.kv_a_proj_with_mqa.weight[kv_rows])
            if self.kv_a_proj_with_mqa.bias is not None:
                self.kv_a_proj_with_mqa.bias.copy_(self.kv_a_proj_with_mqa.bias[kv_rows])
            self.rope_deinterleaved = True
        w = self.kv_b_proj.weight.detach().view(self.num_heads, n.nope_dim + n.v_dim, n.kv_lora_rank)
        self.w_uk = w[:, :n.nope_dim].contiguous()                    # [H, nope, kv_lora_rank]
        self.w_uv_t = w[:, n.nope_dim:].transpose(1, 2).contiguous()  # [H, kv_lora_rank, v]

    def forward(self, positions, x, rope, kv_cache, meta):
        n, heads = self.numbers, self.num_heads
        group = meta.groups[self.kv_group]
        (latent_cache,) = kv_cache
        if n.q_lora_rank is None:
            q = self.q_proj.forward(x)
        else:
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(self.q_a_proj.forward(x)))
        q_nope, q_pe = q.view(-1, heads, self.qk_head_dim).split([n.nope_dim, n.rope_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa.forward(x).split([n.kv_lora_rank, n.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm.forward(kv_c.contiguous())
        pe = torch.cat([q_pe, k_pe[:, None]], dim=1)        # [T, H + 1, rope]: queries and key in one call
        rope.forward(positions, pe)
        ops.concat_and_cache_mla(kv_c, pe[:, heads], latent_cache, group.slot_mapping)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)     # [T, H, kv_lora_rank]
        query = torch.cat([q_latent, pe[:, :heads]], dim=-1)
        out = ops.paged_attention_mla(query, latent_cache, group.block_tables, meta.seq_lens, meta.query_start_loc,
                                      self.scale, n.kv_lora_rank)
        values = torch.bmm(out.transpose(0, 1), self.w_uv_t).transpose(0, 1)        # [T, H, v]
        return self.o_proj.forward(values.reshape(-1, heads * n.v_dim))


class ExpertMLP(nn.Module):
    """A SwiGLU expert under the checkpoint's names (gate_proj, up_proj, down_proj, no bias)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(F.silu(self.gate_proj.forward(x)) * self.up_proj.forward(x))


class Router(nn.Module):
    """Sigmoid scores in float32; the choice adds e_score_correction_bias, keeps the topk_group groups whose
    two best corrected scores sum highest, and takes the top-k experts among them; the weights are the
    uncorrected scores of those experts (normalised to sum 1 with norm_topk_prob), times
    routed_scaling_factor."""

    def __init__(self, cfg: ModelConfig, n: MLANumbers):
        super().__init__()
        self.n = n
        self.weight = nn.Parameter(torch.zeros(n.experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n.experts))

    def after_loading(self) -> None:
        # Routing runs in float32 whatever the model's dtype, as transformers keeps these two in float32.
        self.weight_f32 = self.weight.detach().float()
        self.bias_f32 = self.e_score_correction_bias.detach().float()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.n
        scores = F.linear(x.float(), self.weight_f32).sigmoid()                      # [T, E]
        choice = scores + self.bias_f32
        group_scores = choice.view(-1, n.groups, n.experts // n.groups).topk(2, dim=-1)[0].sum(dim=-1)
        kept = torch.topk(group_scores, k=n.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand(-1, -1, n.experts // n.groups).reshape(-1, n.experts)
        chosen = torch.topk(choice.masked_fill(~expert_mask, float("-inf")), k=n.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if n.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * n.routed_scaling_factor


class DeepseekV3MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, n: MLANumbers):
        super().__init__()
        self.gate = Router(cfg, n)
        self.experts = nn.ModuleList(ExpertMLP(cfg.hidden_size, n.inter) for _ in range(n.experts))
        self.shared_experts = ExpertMLP(cfg.hidden_size, n.inter * n.shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.gate.forward(x)                                       # [T, k] each
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():             # ascending, as transformers adds them
            tokens, slot = torch.where(chosen == expert)
            y = self.experts[expert].forward(x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out + self.shared_experts.forward(x)


class DeepseekV3DecoderLayer(DecoderLayer):
    attention_class = MLAttention

    def __init__(self, cfg: ModelConfig, layer: int, tp=None):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n = self.self_attn.numbers
        self.mlp = MLP(cfg) if layer < n.first_k_dense else DeepseekV3MoE(cfg, n)


class DeepseekV3Model(LlamaModel):
    decoder_layer = DeepseekV3DecoderLayer


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    model_class = DeepseekV3Model
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}   # the dense MLPs'

    def unused_checkpoint_tensor(self, name: str) -> bool:
        """The multi-token-prediction modules (layers num_hidden_layers ..., as transformers ignores them)."""
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        return layer is not None and int(layer.group(1)) >= self.config.num_layers
