"""Speculative decoding by prompt lookup: drafts are n-gram continuations found in the sequence's own
tokens (no draft model), verified by one forward over the input token and the drafts, accepted greedily.

Greedy requests accept the drafts the model's argmax agrees with: their output is then the output
without speculation, token for token, wherever the verifying forward computes the same logits as
one-token decodes (fp32). Sampled requests use speculative sampling for a deterministic draft: a draft
is kept with the probability the model gives it, and at the first rejection the token is drawn from the
model's distribution without the draft, so every token is distributed exactly as without speculation."""
from array import array

import torch

from pagedkv.validation import check_int

SPECULATIVE_METHODS = ("ngram",)


def check_speculative(method, num_tokens, lookup_min, lookup_max) -> tuple[str | None, int, int, int]:
    """The speculative knobs, checked: method None (off) or "ngram"; with "ngram", num_tokens >= 1 drafts
    a step from n-grams of lookup_min..lookup_max tokens."""
    if method is not None and method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative must be None or one of {SPECULATIVE_METHODS}, got {method!r}")
    num_tokens = check_int("num_speculative_tokens", num_tokens, minimum=0)
    lookup_min = check_int("prompt_lookup_min", lookup_min, minimum=1)
    lookup_max = check_int("prompt_lookup_max", lookup_max, minimum=1)
    if lookup_max < lookup_min:
        raise ValueError(f"prompt_lookup_max={lookup_max} must be >= prompt_lookup_min={lookup_min}")
    if method is not None and num_tokens == 0:
        raise ValueError(f"speculative={method!r} needs num_speculative_tokens >= 1")
    if method is None and num_tokens:
        raise ValueError(f"num_speculative_tokens={num_tokens} needs speculative='ngram'")
    return method, num_tokens, lookup_min, lookup_max


class NgramProposer:
    """Prompt lookup: the longest suffix of n tokens (lookup_max down to lookup_min) that occurred earlier
    in the sequence proposes the tokens that followed its latest earlier occurrence."""

    def __init__(self, num_tokens: int, lookup_min: int = 1, lookup_max: int = 3):
        self.num_tokens, self.lookup_min, self.lookup_max = num_tokens, lookup_min, lookup_max

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(num_tokens, limit) draft tokens to follow token_ids; [] when no n-gram recurs."""
        limit = min(self.num_tokens, limit)
        length = len(token_ids)
        if limit <= 0 or length < self.lookup_min + 1:
            return []
        # Byte search over int32 tokens (C speed); a match must start on a token boundary.
        buf = array("i", token_ids).tobytes()
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            suffix = buf[4 * (length - n):]
            end = 4 * (length - 1)          # an occurrence ending before the last token has a follower
            while True:
                at = buf.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    start = at // 4 + n
                    return token_ids[start:start + limit]
                end = at + len(suffix) - 1   # a misaligned hit: look further left
        return []


def accept_sampled(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None = None) -> list[int]:
    """probs[i] (normalised, len(drafts) + 1 rows): the model's sampling distribution after the input
    token and drafts[:i]. Keeps draft i with probability probs[i][draft]; at the first rejection draws
    from probs[i] with the draft removed (the residual max(p - q, 0) of a one-hot draft q), after
    accepting all from the last row. Returns the accepted drafts and the drawn token."""
    k = len(drafts)
    draft_probs = probs[:k].gather(1, torch.tensor(drafts, device=probs.device)[:, None]).squeeze(1)
    uniform = torch.rand(k, generator=generator, device=probs.device)
    rejected = (uniform >= draft_probs).tolist()
    accepted = rejected.index(True) if True in rejected else k
    row = probs[accepted]
    if accepted < k:
        row = row.clone()
        row[drafts[accepted]] = 0.0
        if not bool(row.any()):      # rounding left no mass outside the draft: it was certain after all
            return drafts[:accepted + 1]
    return drafts[:accepted] + [int(torch.multinomial(row, 1, generator=generator))]


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """targets[i] is the model's greedy token after the input token and drafts[:i] (len(drafts) + 1 of
    them). Returns the accepted drafts (the longest prefix that matches) and then the model's own next
    token: what greedy decoding one token at a time would have produced."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]
