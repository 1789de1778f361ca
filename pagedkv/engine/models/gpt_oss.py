"""gpt-oss: the Llama decoder with biased projections, a learned attention sink per query head (an extra
softmax logit that carries no value, through the kernels' `sinks`), sliding-window layers (128 tokens)
alternating with full ones, YaRN rope, and a mixture of experts in place of the MLP (top-k of the router's
logits, softmax over those k, each expert a clamped SwiGLU with biases). The experts are plain torch: the
KV cache, not the GEMMs, is this library's product. Under tensor parallelism each rank holds its query
heads' sinks and its columns of every expert (gate and up interleaved, so a rank's columns stay pairs; the
down projection row-parallel, its bias added by rank 0), and the experts' outputs are summed over ranks."""
import torch
from torch import nn
from torch.nn import functional as F

from ..config import ModelConfig
from .layers import Attention, DecoderLayer
from .llama import LlamaForCausalLM, LlamaModel


def expert_numbers(cfg: ModelConfig) -> tuple[int, int, float, float]:
    """(num_local_experts, num_experts_per_tok, swiglu_alpha, swiglu_limit) of config.json, checked."""
    extra = cfg.extra
    experts, top_k = extra.get("num_local_experts", 128), extra.get("num_experts_per_tok", 4)
    for name, value in (("num_local_experts", experts), ("num_experts_per_tok", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
    if top_k > experts:
        raise ValueError(f"config.json: num_experts_per_tok={top_k} exceeds num_local_experts={experts}")
    alpha, limit = extra.get("swiglu_alpha", 1.702), extra.get("swiglu_limit", 7.0)
    for name, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"config.json: {name} must be a positive number, got {value!r}")
    return experts, top_k, float(alpha), float(limit)


class GptOssAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, tp=None):
        super().__init__(cfg, layer, tp)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads, dtype=torch.float32))

    def after_loading(self) -> None:
        # The kernels take the sinks in float32 whatever the model's dtype (transformers adds them to the
        # logits in the logits' dtype: in fp32 the same).
        self.sink_logits = self.sinks.detach().float().contiguous()


class GptOssExperts(nn.Module):
    """The checkpoint's layout: gate_up_proj [E, hidden, 2 * inter] with gate and up interleaved by column,
    down_proj [E, inter, hidden], a bias for each."""

    def __init__(self, cfg: ModelConfig, experts: int):
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.zeros(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))


class GptOssMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp=None):
        super().__init__()
        self.tp = tp     # tensor parallel: cfg holds this rank's columns of each expert
        experts, self.top_k, self.alpha, self.limit = expert_numbers(cfg)
        self.router = nn.Linear(cfg.hidden_size, experts)
        self.experts = GptOssExperts(cfg, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, chosen = torch.topk(self.router.forward(x), self.top_k, dim=-1)        # [T, k]
        weights = F.softmax(top, dim=-1)
        e = self.experts
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():                              # ascending, as transformers
            tokens, slot = torch.where(chosen == expert)
            gate_up = x[tokens] @ e.gate_up_proj[expert] + e.gate_up_proj_bias[expert]
            gate = gate_up[:, ::2].clamp(max=self.limit)
            up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
            h = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
            y = h @ e.down_proj[expert] + e.down_proj_bias[expert]
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out if self.tp is None else self.tp.all_reduce(out)


class GptOssDecoderLayer(DecoderLayer):
    attention_class, mlp_class = GptOssAttention, GptOssMLP


class GptOssModel(LlamaModel):
    decoder_layer = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel

    # Under tensor parallelism, by the checkpoint tensor's last name: (dim, unit, elements per unit).
    _tp_rules = {
        "sinks": (0, "q_heads", 1),                      # [num_heads]
        "gate_up_proj": (2, "intermediate", 2),          # [experts, hidden, 2 * inter], gate/up interleaved
        "gate_up_proj_bias": (1, "intermediate", 2),     # [experts, 2 * inter]
        "down_proj": (1, "intermediate", 1),             # [experts, inter, hidden]: row-parallel
        "down_proj_bias": (None, "rank0", 0),            # [experts, hidden]: added once
    }

    def tensor_parallel_rule(self, name: str):
        return self._tp_rules.get(name.rsplit(".", 1)[-1])
