"""The user-facing engine: LLM(model_path).generate(prompts, SamplingParams(...)).

Error contract: every argument is checked where it is taken (TypeError/ValueError naming it) before
anything is queued; a step that raises (Ctrl-C included) leaves every request as before it, its
sequences waiting to be recomputed; generate() aborts the requests it added when it is interrupted."""
import numbers
import os
import time
import warnings
import weakref
from collections import deque

import torch
from tqdm.auto import tqdm

from pagedkv import AllocStatus, BlockManager
from pagedkv._threads import ThreadTuner, available_cpus
from pagedkv.validation import check_bool, check_int, token_id_list

from ..checkpoints.chat import conversation_list
from ..config import EngineConfig
from ..kv.events import KVEventPublisher, require_packages as require_kv_events_packages
from ..kv.quant import cache_salt
from ..checkpoints.loader import open_checkpoint
from .metrics import PrometheusExporter, require_prometheus
from ..kv.disk_tier import DiskTier
from ..kv.identity import fingerprint_digest, host_record_layout, kv_fingerprint
from ..execution.model_runner import ModelRunner, disk_tier_size, host_tier_size, load_rank_model, pool_size
from .sampling import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import CompletionOutput, Request, RequestOutput
from ..tp import group
from ..tp.runners import DriverRunner, serve_rank


class LLM:
    def __init__(self, model_path: str | os.PathLike, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str | None = None, block_size: int = 16, num_blocks: int | None = None,
                 num_cpu_blocks: int = 0, host_cache_bytes: int = 0, disk_cache_dir: str | os.PathLike | None = None,
                 disk_cache_bytes: int = 0, disk_cache_persist: bool = False, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 4096, kv_cache_bytes: int = 256 << 20,
                 gpu_memory_utilization: float = 0.5, seed: int = 0, pack_cpu_weights: bool = True,
                 history_size: int = 0, tensor_parallel_size: int = 1, distributed_backend: str | None = None,
                 speculative: str | None = None, num_speculative_tokens: int = 0,
                 prompt_lookup_min: int = 1, prompt_lookup_max: int = 3, kv_events_endpoint: str | None = None,
                 kv_events_replay_endpoint: str | None = None, kv_events_topic: str = "",
                 kv_events_include_token_ids: bool = True, metrics_port: int | None = None,
                 metrics_addr: str = "127.0.0.1", cpu_threads: int | str = "auto", kv_cache_dtype: str = "auto",
                 kv_scale: str | float = "rotated", kv_recent_tokens: int = 256, kv_first_block: bool = True):
        if not isinstance(model_path, (str, os.PathLike)):
            raise TypeError(f"model_path must be a str or os.PathLike (a checkpoint directory), got {model_path!r}")
        self.config = EngineConfig(device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
                                   num_cpu_blocks=num_cpu_blocks, host_cache_bytes=host_cache_bytes,
                                   disk_cache_dir=disk_cache_dir, disk_cache_bytes=disk_cache_bytes,
                                   disk_cache_persist=disk_cache_persist,
                                   enable_prefix_caching=enable_prefix_caching,
                                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   kv_cache_bytes=kv_cache_bytes, gpu_memory_utilization=gpu_memory_utilization,
                                   tensor_parallel_size=tensor_parallel_size, distributed_backend=distributed_backend,
                                   speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                                   prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max,
                                   kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale,
                                   kv_recent_tokens=kv_recent_tokens, kv_first_block=kv_first_block)
        if cpu_threads != "auto":
            try:
                cpu_threads = check_int("cpu_threads", cpu_threads, minimum=1)
            except (TypeError, ValueError) as e:
                raise type(e)(f"cpu_threads must be 'auto' or an int >= 1, got {cpu_threads!r}") from None
        self.thread_tuner = None
        if self.config.device.type == "cpu":
            if cpu_threads != "auto":
                torch.set_num_threads(cpu_threads)
            elif torch.get_num_threads() > available_cpus():
                torch.set_num_threads(available_cpus())   # e.g. a container's CPU quota below the core count
            if cpu_threads == "auto" and self.config.tensor_parallel_size == 1:
                # The CPUs other processes leave free decide each step's thread count (pagedkv/_threads.py).
                self.thread_tuner = ThreadTuner(torch.get_num_threads())
        seed = check_int("seed", seed, minimum=0)
        pack_cpu_weights = check_bool("pack_cpu_weights", pack_cpu_weights)
        history_size = check_int("history_size", history_size, minimum=0)
        kv_events_include_token_ids = check_bool("kv_events_include_token_ids", kv_events_include_token_ids)
        if kv_events_replay_endpoint is not None and kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if metrics_port is not None:
            metrics_port = check_int("metrics_port", metrics_port, minimum=0, maximum=65535)
        self.kv_events = self.metrics = None     # made last; their packages are checked now
        if kv_events_endpoint is not None:
            require_kv_events_packages()
        if metrics_port is not None:
            require_prometheus()
        model_path = os.fspath(model_path)
        # Tensor parallelism: rank 0 starts its workers here (each builds its shard with these settings);
        # under torchrun, the other ranks serve rank 0 from here and exit their process when it closes.
        self.tp = group.join(self.config, model_path, seed, pack_cpu_weights)
        if self.tp is not None and self.tp.rank:
            serve_rank(self.tp, self.config, model_path, seed, pack_cpu_weights)      # never returns
        if self.tp is not None:
            weakref.finalize(self, self.tp.close)      # garbage collection and exit stop the workers
        try:
            self._build(model_path, seed, pack_cpu_weights, enable_events=kv_events_endpoint is not None)
        except BaseException:
            if self.tp is not None:
                self.tp.close(stop_workers=False)
            raise
        self.scheduler = Scheduler(self.bm, self.config, self.model_config.eos_token_ids, self.max_model_len)
        self._update_cache_salt()
        self.tokenizer = self.checkpoint.tokenizer()
        self.chat_template = self.checkpoint.chat_template()
        # The last history_size steps (blocks used / cached, batch shape), for plots; 0 keeps none.
        self.history: deque[dict] = deque(maxlen=history_size)
        self.num_steps = 0
        self.peak_used_blocks = 0
        self.requests: dict[int, Request] = {}     # unfinished requests by id
        self.next_request_id = 0
        # Serving extras, off unless asked for: KV events (pyzmq + msgspec) and Prometheus metrics.
        if kv_events_endpoint is not None:
            self.kv_events = KVEventPublisher(kv_events_endpoint, kv_events_replay_endpoint, topic=kv_events_topic,
                                              include_token_ids=kv_events_include_token_ids)
        if metrics_port is not None:
            try:
                self.metrics = PrometheusExporter(self.stats, metrics_port, metrics_addr,
                                                  labels={"model_name": model_path})
            except BaseException:
                self.close()
                raise

    def _build(self, model_path: str, seed: int, pack_cpu_weights: bool, enable_events: bool) -> None:
        """Model, block manager and runner (rank 0's under tensor parallelism)."""
        self.device = self.config.device
        self.checkpoint = open_checkpoint(model_path)
        self.model = load_rank_model(self.checkpoint, self.config, pack_cpu_weights=pack_cpu_weights, tp=self.tp)
        self.model_config = self.model.config
        self.max_model_len = self.model_config.max_position_embeddings
        self.num_blocks = pool_size(self.model, self.config, self.tp)
        num_host_blocks = host_tier_size(self.model, self.config, self.tp)
        num_disk_blocks = disk_tier_size(self.model, self.config)
        runner_args = (self.model, self.config, self.num_blocks, self.config.num_cpu_blocks, seed, num_host_blocks)
        self.runner = ModelRunner(*runner_args) if self.tp is None else DriverRunner(*runner_args, self.tp)
        # Windowed layers hold only their window's blocks: one windowed group (Mistral) or a group per window
        # beside the full-attention one (Gemma 2), all in one pool.
        self.bm = BlockManager(self.num_blocks, self.config.block_size, num_cpu_blocks=self.config.num_cpu_blocks,
                               enable_prefix_caching=self.config.enable_prefix_caching, enable_events=enable_events,
                               group_windows=self.model_config.group_windows, num_host_blocks=num_host_blocks,
                               num_disk_blocks=num_disk_blocks)
        self.disk_tier = None
        self.disk_restored = 0     # disk records a persistent cache brought back at start
        if num_disk_blocks:
            # The digest of what a record's bytes mean goes into each record's header: a record written under
            # another model, dtype, scale or layout reads as a miss.
            fingerprint = fingerprint_digest(kv_fingerprint(self, host_record=host_record_layout(self.runner.host_tier)))
            persist = self.config.disk_cache_persist
            self.disk_tier = DiskTier(self.config.disk_cache_dir, num_disk_blocks, self.runner.host_tier,
                                      self.config.block_size, fingerprint, self.config.device, persist=persist)
            if persist and not self.disk_tier.store.persistent:
                warnings.warn(f"disk_cache_persist=True: another process holds this model's disk cache in "
                              f"{self.config.disk_cache_dir!r}; this engine uses a private file that ends with it",
                              stacklevel=3)
            self.disk_restored = self.disk_tier.restore(self.bm) if self.disk_tier.store.persistent else 0

    def _update_cache_salt(self) -> None:
        """float8 KV: blocks are cached under a salt naming the format and the scales (rank 0's under
        tensor parallelism), so blocks written under other scales never hit."""
        if self.scheduler.cache_salt is None or self.scheduler.cache_salt.endswith(b":unset"):
            self.scheduler.cache_salt = cache_salt(self.config.kv_cache_dtype, self.runner.kv_scales)

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None) -> Request:
        """Queues one prompt (a string with a tokenizer, or token ids: a list of ints or a 1-D integer
        numpy array / torch tensor) after checking it completely; returns its Request."""
        token_ids, params = self._check_request(prompt, params)
        return self._queue(prompt, token_ids, params)

    def _check_request(self, prompt, params) -> tuple[list[int], SamplingParams]:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams (or None: the defaults), got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer (tokenizer.json in the model directory, or a "
                                 "GGUF file's tokenizer metadata); pass token ids instead")
            token_ids = self.tokenizer.encode(prompt).ids
        else:
            token_ids = token_id_list("prompt", prompt)
        vocab = self.model_config.vocab_size
        bad = next(((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad[1]} at position {bad[0]} is outside the vocabulary [0, {vocab})")
        if not 1 <= len(token_ids) < self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens: need 1 to {self.max_model_len - 1} "
                             f"(max_position_embeddings={self.max_model_len})")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop} are outside the vocabulary [0, {vocab})")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} samples exceed max_num_seqs={self.config.max_num_seqs}")
        return token_ids, params

    def _queue(self, prompt, token_ids: list[int], params: SamplingParams) -> Request:
        request = Request(self.next_request_id, token_ids, params, prompt if isinstance(prompt, str) else token_ids)
        self.next_request_id += 1
        self.scheduler.add_request(request)
        self.requests[request.request_id] = request
        return request

    def abort(self, request_id: int) -> bool:
        """Stops an unfinished request (its outputs so far stay, finish_reason "abort") and frees its
        blocks; False when no unfinished request has that id."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """Schedules and runs one batch; returns the requests that ended in it (finished or failed).
        If it raises, every request is as before the step and its sequences are recomputed next step."""
        if not self.scheduler.has_unfinished():
            return []
        snapshot, rng_state = self.scheduler.snapshot(), self.runner.generator.get_state()
        try:
            if self.bm.host_tier_enabled:
                self._clean_ahead()
            if self.disk_tier is not None:
                # After clean ahead, whose offloads may evict host entries: the disk reads land in host slots
                # just before the admission that loads them.
                self._disk_step()
            batch = self.scheduler.schedule()
            if batch.empty:
                raise RuntimeError("scheduler made no progress: the KV pool is too small for any waiting sequence "
                                   "(raise num_blocks or kv_cache_bytes)")
            if self.thread_tuner is not None:
                threads = self.thread_tuner.threads
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
            sampled = self.runner.execute(batch, self.bm)
            if self.bm.host_tier_enabled:
                # The runner moved the step's host-tier blocks on the stream its kernels run on, so what
                # runs next sees them; the manager may now hand the offloaded blocks out again.
                self.bm.complete_offloads(True)
                self.bm.complete_loads(True)
            self._update_cache_salt()
            finished = self.scheduler.postprocess(batch, sampled)
        except BaseException:
            self.scheduler.restore(snapshot)
            self.runner.generator.set_state(rng_state)
            raise
        finally:
            if self.kv_events is not None:      # what the cache did, failed steps included
                self.kv_events.publish(self.bm.take_events())
        stats = self.bm.stats()
        self.peak_used_blocks = max(self.peak_used_blocks, stats["used_blocks"])
        if self.history.maxlen:
            self.history.append(dict(step=self.num_steps, used_blocks=stats["used_blocks"],
                                     cached_blocks=stats["cached_blocks"], running=len(self.scheduler.running),
                                     tokens=batch.num_tokens, decodes=len(batch.decodes)))
        self.num_steps += 1
        ended = {s.request.request_id: s.request for s in finished + batch.failed if s.request.finished}
        for request_id in ended:
            self.requests.pop(request_id, None)
        return list(ended.values())

    def _disk_step(self) -> None:
        """Confirms the disk transfers that finished and starts the next: write-backs of host entries, and
        reads of the waiting prompts' disk-resident blocks into the host tier (those prompts wait for them
        unless nothing else can run)."""
        sched = self.scheduler
        budget = -(-self.config.max_num_batched_tokens // self.config.block_size) + len(sched.running)
        self.disk_tier.before_step(self.bm, sched.waiting, sched.cache_salt, budget,
                                   must_progress=not sched.running and not sched.swapped)
        sched.disk_wait = self.disk_tier.waiting_for_reads

    def _clean_ahead(self) -> None:
        """Copies the coldest cached free blocks the host tier lacks (as many as one step may take: a token
        budget of blocks and one per running sequence) before the step allocates, so that the blocks it
        reuses are already backed on the host and admission never waits on a copy."""
        budget = -(-self.config.max_num_batched_tokens // self.config.block_size) + len(self.scheduler.running)
        if self.bm.plan_offloads(budget):
            self.runner.move_blocks(ScheduledBatch(offloads=self.bm.take_offloads()))
            self.bm.complete_offloads(True)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs the prompts (one prompt or a list of them: strings with a tokenizer, token-id lists, 1-D
        integer arrays or tensors) to completion; outputs in order. Nothing is queued unless every prompt
        and parameter is valid; if interrupted (any exception, Ctrl-C included) it aborts the requests
        it added and re-raises."""
        checked = self._checked_requests(prompts, sampling_params)
        requests = [self._queue(p, ids, sp) for p, ids, sp in checked]
        try:
            with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
                start, computed = time.perf_counter(), self._computed_tokens()
                while self.scheduler.has_unfinished():
                    bar.update(len(self.step()))
                    rate = (self._computed_tokens() - computed) / (time.perf_counter() - start)
                    bar.set_postfix(tok_s=f"{rate:.0f}", refresh=False)
        except BaseException:
            for r in requests:
                self.abort(r.request_id)
            raise
        return [self._output(r) for r in requests]

    def _checked_requests(self, prompts, sampling_params) -> list[tuple[object, list[int], SamplingParams]]:
        """(prompt, token ids, params) of every prompt, each checked (generate's rules), before any is queued."""
        prompts = self._prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
            for i, sp in enumerate(params):
                if sp is not None and not isinstance(sp, SamplingParams):
                    raise TypeError(f"sampling_params[{i}] must be a SamplingParams or None, got {type(sp).__name__}")
        else:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        checked = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            try:
                checked.append((prompt, *self._check_request(prompt, sp)))
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
        return checked

    def chat(self, conversations, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        """Answers one conversation (a list of {"role", "content"} messages) or a list of them: each is
        rendered with the model's chat template as transformers' apply_chat_template renders it, tokenized
        without added special tokens (the template writes its own), and generated like generate()'s prompts;
        generation stops at the model's end-of-turn tokens (its EOS ids) unless ignore_eos. Outputs carry
        the rendered prompt, prompt_token_ids, token_ids and the decoded text."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json's chat_template, "
                             "chat_template.jinja, or a GGUF file's tokenizer.chat_template); use generate()")
        if self.tokenizer is None:
            raise ValueError("chat needs the model's tokenizer (tokenizer.json or GGUF tokenizer metadata)")
        add_generation_prompt = check_bool("add_generation_prompt", add_generation_prompt)
        prompts = [self.chat_template.render(c, add_generation_prompt=add_generation_prompt)
                   for c in conversation_list(conversations)]
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
        outputs = self.generate(token_ids, sampling_params, use_tqdm=use_tqdm)
        for out, prompt in zip(outputs, prompts):
            out.prompt = prompt
        return outputs

    @torch.inference_mode()
    def prompt_logits(self, token_ids, *, chunk_size: int = 512) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] of every position of a text (row i scores token i + 1),
        computed as the engine computes a prompt: prefilled chunk by chunk (`chunk_size` tokens) over the
        paged KV cache, each chunk attending to the cached chunks before it. For log-likelihoods and for
        comparing cache dtypes under teacher forcing. Runs between generate() calls, on one process; uses
        blocks of the pool for the text (no prefix-cache hits, nothing cached afterwards)."""
        ids = token_id_list("token_ids", token_ids)
        chunk_size = check_int("chunk_size", chunk_size, minimum=1)
        vocab = self.model_config.vocab_size
        if not 1 <= len(ids) <= self.max_model_len or any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token_ids must be 1 to {self.max_model_len} ids in [0, {vocab})")
        if self.tp is not None:
            raise ValueError("prompt_logits runs on one process; this engine has tensor_parallel_size > 1")
        if self.scheduler.has_unfinished():
            raise RuntimeError("prompt_logits runs between generate() calls; requests are unfinished")
        seq_id = self.scheduler.next_seq_id
        self.scheduler.next_seq_id += 1
        salt = os.urandom(16)       # a salt no block has: no hit, and no block of it is ever shared
        if self.bm.can_allocate(ids, cache_salt=salt) != AllocStatus.OK:
            raise ValueError(f"{len(ids)} tokens do not fit in the free KV blocks; raise num_blocks or "
                             f"kv_cache_bytes")
        self.bm.allocate(seq_id, ids, cache_salt=salt)
        try:
            rows = []
            for start in range(0, len(ids), chunk_size):
                end = min(start + chunk_size, len(ids))
                rows.append(self.runner.forward_chunk(ids[start:end], start, self.bm, seq_id))
            return torch.cat(rows).float()
        finally:
            self.bm.free(seq_id)

    @staticmethod
    def _prompt_list(prompts) -> list:
        """generate()'s prompts as a list of single prompts."""
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, torch.Tensor) or type(prompts).__module__ == "numpy":
            if prompts.ndim not in (1, 2):
                raise TypeError(f"prompts must be a 1-D (one prompt) or 2-D (one per row) array, got "
                                f"{prompts.ndim}-D")
            return [prompts] if prompts.ndim == 1 else list(prompts)
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a string, a token-id list or a list of prompts, got "
                            f"{type(prompts).__name__}")
        if prompts and (prompts[0] is None or isinstance(prompts[0], numbers.Number)):
            return [prompts]          # one prompt of token ids
        return list(prompts)

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
        """Scheduler counters (preemptions, tokens, failed steps, speculative drafts), the block manager's
        stats (prefix-cache queries and hits in tokens and blocks, hit_rate, evictions, CoW copies, block
        usage), queue lengths, kv_cache_usage (fraction of blocks in use), spec_acceptance_rate."""
        sched, bm = self.scheduler, self.bm.stats()
        s = sched.stats
        return {**s, **bm, "peak_used_blocks": self.peak_used_blocks,
                "kv_cache_usage": bm["used_blocks"] / bm["num_blocks"],
                "num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "num_swapped": sum(map(len, sched.swapped)),
                "num_preemptions": s["preempted_swap"] + s["preempted_recompute"],
                "spec_acceptance_rate": s["spec_accepted_tokens"] / max(s["spec_draft_tokens"], 1)}

    def close(self) -> None:
        """Stops the KV-event publisher (after sending what is queued), the metrics server and the
        tensor-parallel workers. Idempotent. A single-process engine stays usable (without events and
        metrics); a closed tensor-parallel one raises on generate(). Garbage collection and interpreter
        exit stop the workers too."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.tp is not None:
            self.tp.close()
        if getattr(self, "disk_tier", None) is not None:
            if self.disk_tier.store.persistent and not self.disk_tier.closed:
                # What the device pool caches goes down too (as much as the host tier holds), so that a
                # restart finds the prefixes that were hottest; close() writes the host tier to disk.
                if self.bm.plan_offloads(self.bm.num_blocks):
                    self.runner.move_blocks(ScheduledBatch(offloads=self.bm.take_offloads()))
                    self.bm.complete_offloads(True)
            self.disk_tier.close(self.bm)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
