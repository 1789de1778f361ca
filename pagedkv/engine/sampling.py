"""Sampling parameters and the sampler: greedy, temperature and nucleus (top-p) sampling."""
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1                        # samples per prompt; they share the prompt's KV blocks

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_tokens < 1 or self.n < 1:
            raise ValueError(f"invalid SamplingParams: {self}")


def sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] float32; temperatures, top_ps [B]. Rows with temperature 0 take the argmax."""
    greedy = logits.argmax(dim=-1)
    if bool((temperatures == 0).all()):
        return greedy
    probs = torch.softmax(logits / temperatures.clamp(min=1e-5).unsqueeze(1), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix of tokens whose mass reaches top_p (the first token always stays).
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_ps.unsqueeze(1)
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    picked = torch.multinomial(sorted_probs, 1, generator=generator).squeeze(1)
    sampled = order.gather(1, picked.unsqueeze(1)).squeeze(1)
    return torch.where(temperatures == 0, greedy, sampled)
