"""Sampling parameters (validated when made) and the sampler: greedy, temperature and nucleus (top-p)."""
from dataclasses import dataclass, field

import torch

from pagedkv.validation import check_bool, check_float, check_int, token_id_list


@dataclass(frozen=True)
class SamplingParams:
    """Checked and normalised when made (a bad value raises TypeError/ValueError naming it); frozen, so
    a request's parameters cannot change under the scheduler."""
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1                        # samples per prompt; they share the prompt's KV blocks

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "temperature", check_float("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        set_(self, "top_p", check_float("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        set_(self, "max_tokens", check_int("max_tokens", self.max_tokens, minimum=1))
        set_(self, "n", check_int("n", self.n, minimum=1))
        set_(self, "ignore_eos", check_bool("ignore_eos", self.ignore_eos))
        stop = token_id_list("stop_token_ids", self.stop_token_ids)
        if any(t < 0 for t in stop):
            raise ValueError(f"stop_token_ids must be >= 0, got {stop}")
        set_(self, "stop_token_ids", stop)


def _nucleus(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor):
    """The tempered probabilities sorted in descending order, zero outside the top-p nucleus (not
    renormalised), and the token of each sorted position."""
    probs = torch.softmax(logits / temperatures.clamp(min=1e-5).unsqueeze(1), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix of tokens whose mass reaches top_p (the first token always stays).
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_ps.unsqueeze(1)
    return sorted_probs.masked_fill(outside, 0.0), order


def sampling_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """[B, V]: the distribution sample() draws each row from (temperature > 0), in vocabulary order."""
    sorted_probs, order = _nucleus(logits, temperatures, top_ps)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] float32; temperatures, top_ps [B]. Rows with temperature 0 take the argmax."""
    greedy = logits.argmax(dim=-1)
    if bool((temperatures == 0).all()):
        return greedy
    sorted_probs, order = _nucleus(logits, temperatures, top_ps)
    picked = torch.multinomial(sorted_probs, 1, generator=generator).squeeze(1)
    sampled = order.gather(1, picked.unsqueeze(1)).squeeze(1)
    return torch.where(temperatures == 0, greedy, sampled)
