"""A sequence (one sample being generated), the request that owns its samples, and their outputs."""
from dataclasses import dataclass, field
from enum import Enum, auto

from .sampling import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()    # needs a prefill (new, or preempted by recompute)
    RUNNING = auto()    # KV on the device: prefilling (chunk by chunk), or decoding its last token
    SWAPPED = auto()    # KV in the CPU cache
    FINISHED = auto()


class Sequence:
    def __init__(self, seq_id: int, request: "Request", token_ids: list[int]):
        self.seq_id = seq_id
        self.request = request
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = request.num_prompt_tokens
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.prefilled = False     # every token but the last sampled one has its KV: the next step decodes

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def arrival(self) -> int:
        return self.request.request_id


class Request:
    """One prompt with n samples. Sample 0 is prefilled; the others fork from it and share its blocks."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, prompt=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seqs: list[Sequence] = []
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.status == SequenceStatus.FINISHED for s in self.seqs)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None   # "length" | "stop" | "error" | "abort"


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | list[int] | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text
