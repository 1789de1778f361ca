"""Speculative decoding by prompt lookup: drafts are n-gram continuations found in the sequence's own
tokens (no draft model), verified by one forward over the input token and the drafts, accepted greedily.

Only greedy requests (temperature 0) speculate: their output is then the output without speculation,
token for token, wherever the verifying forward computes the same logits as one-token decodes (fp32).
Sampled requests decode one token a step as before."""
from array import array

from .sampling import check_int

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


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """targets[i] is the model's greedy token after the input token and drafts[:i] (len(drafts) + 1 of
    them). Returns the accepted drafts (the longest prefix that matches) and then the model's own next
    token: what greedy decoding one token at a time would have produced."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]
