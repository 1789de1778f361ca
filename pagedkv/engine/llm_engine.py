"""The user-facing engine: LLM(model_path).generate(prompts, SamplingParams(...))."""
import os
import time

import torch
from tqdm.auto import tqdm

from pagedkv import BlockManager

from .config import EngineConfig
from .cpu_linear import pack_wide_linears
from .loader import load_model
from .model_runner import ModelRunner, kv_cache_block_bytes
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import CompletionOutput, Request, RequestOutput


class LLM:
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: torch.dtype | str | None = None,
                 block_size: int = 16, num_blocks: int | None = None, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 4096, kv_cache_bytes: int = 256 << 20,
                 gpu_memory_utilization: float = 0.5, seed: int = 0, pack_cpu_weights: bool = True):
        self.config = EngineConfig(device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
                                   num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=enable_prefix_caching,
                                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   kv_cache_bytes=kv_cache_bytes, gpu_memory_utilization=gpu_memory_utilization)
        self.model = load_model(model_path, device, dtype)
        if pack_cpu_weights and device == "cpu":
            pack_wide_linears(self.model, batch_hint=min(max_num_seqs, 16))
        self.model_config = self.model.config
        self.max_model_len = self.model_config.max_position_embeddings
        self.num_blocks = num_blocks or self._num_blocks_from_budget()
        self.bm = BlockManager(self.num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                               enable_prefix_caching=enable_prefix_caching)
        self.runner = ModelRunner(self.model, self.config, self.num_blocks, num_cpu_blocks, seed)
        self.scheduler = Scheduler(self.bm, self.config, self.model_config.eos_token_ids, self.max_model_len)
        self.tokenizer = self._load_tokenizer(model_path)
        self.history: list[dict] = []      # per step: blocks used / cached, for plots
        self.next_request_id = 0

    def _num_blocks_from_budget(self) -> int:
        cfg = self.config
        block_bytes = kv_cache_block_bytes(self.model, cfg.block_size, next(self.model.parameters()).dtype)
        if cfg.device.startswith("cuda"):
            budget = int(torch.cuda.mem_get_info(torch.device(cfg.device))[0] * cfg.gpu_memory_utilization)
        else:
            budget = cfg.kv_cache_bytes
        enough = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)   # more is never used
        return max(1, min(budget // block_bytes, enough))

    @staticmethod
    def _load_tokenizer(model_path: str):
        path = os.path.join(model_path, "tokenizer.json")
        if not os.path.exists(path):
            return None
        from tokenizers import Tokenizer
        return Tokenizer.from_file(path)

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer.json in the model directory")
            token_ids = self.tokenizer.encode(prompt).ids
        else:
            token_ids = list(prompt)
        request = Request(self.next_request_id, token_ids, params, prompt)
        self.next_request_id += 1
        if not token_ids or len(token_ids) >= self.max_model_len:
            request.error = f"prompt of {len(token_ids)} tokens: need 1 to {self.max_model_len - 1}"
        else:
            self.scheduler.add_request(request)
        return request

    def step(self) -> list[Request]:
        """Schedules and runs one batch; returns the requests that finished in it."""
        batch = self.scheduler.schedule()
        if batch.empty:
            raise RuntimeError("scheduler made no progress: the KV pool is too small for any waiting sequence")
        sampled = self.runner.execute(batch, self.bm)
        finished = self.scheduler.postprocess(batch, sampled)
        stats = self.bm.stats()
        self.history.append(dict(step=len(self.history), used_blocks=stats["used_blocks"],
                                 cached_blocks=stats["cached_blocks"], running=len(self.scheduler.running),
                                 tokens=batch.num_tokens, decodes=len(batch.decodes)))
        requests = {s.request.request_id: s.request for s in finished + batch.failed if s.request.finished}
        return list(requests.values())

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs the prompts (token-id lists, or strings with a tokenizer) to completion; outputs in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        if self.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError("string prompts need a tokenizer.json in the model directory")
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        bar = tqdm(total=len(requests), desc="generate", disable=not use_tqdm)
        bar.update(sum(r.error is not None for r in requests))
        start, computed = time.perf_counter(), self._computed_tokens()
        while self.scheduler.has_unfinished():
            bar.update(len(self.step()))
            rate = (self._computed_tokens() - computed) / (time.perf_counter() - start)
            bar.set_postfix(tok_s=f"{rate:.0f}", refresh=False)
        bar.close()
        return [self._output(r) for r in requests]

    def _computed_tokens(self) -> int:
        return self.scheduler.stats["prefill_tokens"] + self.scheduler.stats["decode_tokens"]

    def _output(self, request: Request) -> RequestOutput:
        outputs = [CompletionOutput(i, s.output_token_ids, self._decode(s.output_token_ids), s.finish_reason)
                   for i, s in enumerate(request.seqs)]
        if not outputs:
            outputs = [CompletionOutput(0, [], self._decode([]), "error")]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, request.error)

    def _decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def stats(self) -> dict:
        """Scheduler counters (preemptions, CoW copies, tokens), the block manager's stats, peak usage."""
        peak = max((h["used_blocks"] for h in self.history), default=0)
        return {**self.scheduler.stats, **self.bm.stats(), "peak_used_blocks": peak}
