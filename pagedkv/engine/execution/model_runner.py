"""Runs one scheduled batch: moves blocks (swap, copy-on-write), builds the paged-attention inputs
from the block manager, runs the model and samples the next tokens."""
import torch

from pagedkv import BlockManager
from pagedkv.cache import allocate_host_tier, allocate_kv_cache, allocate_mla_cache, block_bytes, mla_block_bytes
from pagedkv.disk_store import DiskStore
from pagedkv.ops import load_blocks, offload_blocks

from ..config import EngineConfig
from .cpu_linear import pack_wide_linears
from ..kv.quant import attach_kv_scales, kv_cache_dtype
from ..kv.recent import LayerRecentKV, RecentPool
from ..models.layers import AttentionMetadata, KVGroupInputs
from ..models.llama import LlamaForCausalLM
from ..checkpoints.loader import Checkpoint, load_model
from ..serving.sampling import sample, sampling_probs
from ..serving.scheduler import ScheduledBatch
from ..serving.speculative import accept_greedy, accept_sampled


def num_cache_tensors(model: LlamaForCausalLM) -> int:
    """KV cache slots: one per layer, except that layer i of every KV group shares slot i (Gemma 2:
    num_layers / 2). A slot is a (key, value) pair of tensors, or a 1-tuple (latent,) for an MLA model."""
    return max(model.config.layer_cache_slots) + 1


def kv_cache_block_bytes(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block id across all cache tensors: keys and values, or the latent rows of an MLA model."""
    cfg = model.config
    if cfg.latent_cache is not None:
        kv_lora_rank, rope_dim = cfg.latent_cache
        return mla_block_bytes(num_layers=num_cache_tensors(model), block_size=block_size, kv_lora_rank=kv_lora_rank,
                               qk_rope_head_dim=rope_dim, dtype=dtype)
    return block_bytes(num_layers=num_cache_tensors(model), block_size=block_size, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, dtype=dtype)


RECENT_POOL_SHARE = 4     # the recent pool takes at most 1 / RECENT_POOL_SHARE of the KV budget


def _kv_budget(config: EngineConfig) -> tuple[int, str]:
    if config.device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(config.device)[0] * config.gpu_memory_utilization)
        return budget, f"gpu_memory_utilization={config.gpu_memory_utilization} of the free GPU memory ({budget} bytes)"
    return config.kv_cache_bytes, f"kv_cache_bytes={config.kv_cache_bytes}"


def _recent_block_bytes(model: LlamaForCausalLM, config: EngineConfig) -> int:
    cfg = model.config
    layers = sum(1 for g in cfg.layer_groups if cfg.group_windows[g] is None)
    return block_bytes(num_layers=layers, block_size=config.block_size, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, dtype=next(model.parameters()).dtype)


def recent_pool_blocks(model: LlamaForCausalLM, config: EngineConfig) -> int:
    """Blocks of the float8 rule's recent pool (kv.recent): what max_num_seqs sequences and a full step
    need, within a quarter of the KV budget (and at least one sequence's); 0 without a float8 cache, without
    a full-attention KV group, or with kv_recent_tokens=0 and kv_first_block=False."""
    if kv_cache_dtype(config.kv_cache_dtype, torch.float32) == torch.float32:
        return 0
    if not (config.kv_recent_tokens or config.kv_first_block) or None not in model.config.group_windows:
        return 0
    needed = RecentPool.blocks_needed(config.max_num_seqs, config.max_num_batched_tokens, config.block_size,
                                      config.kv_recent_tokens)
    one = RecentPool.blocks_needed(1, config.block_size, config.block_size, config.kv_recent_tokens)
    share = _kv_budget(config)[0] // RECENT_POOL_SHARE // _recent_block_bytes(model, config)
    return min(needed, max(one, share))


def recent_pool_bytes(model: LlamaForCausalLM, config: EngineConfig) -> int:
    """Bytes of the recent pool: its blocks' keys and values in the model's dtype, in each layer of the
    full-attention group."""
    blocks = recent_pool_blocks(model, config)
    return blocks and blocks * _recent_block_bytes(model, config)


def check_cache_features(model: LlamaForCausalLM, config: EngineConfig) -> None:
    """Refuses the engine features the model's cache format cannot take: the latent cache of an MLA model
    has no float8 format."""
    if model.config.latent_cache is None:
        return
    arch = model.config.architecture
    if config.kv_cache_dtype != "auto":
        raise ValueError(f"{arch}: kv_cache_dtype={config.kv_cache_dtype!r} is not supported (the latent cache is "
                         "kept in the model's dtype); pass kv_cache_dtype='auto'")


def load_rank_model(checkpoint: Checkpoint, config: EngineConfig, *, pack_cpu_weights: bool,
                    tp=None) -> LlamaForCausalLM:
    """The checkpoint's model (this rank's shard of it under tensor parallelism) on config.device, its
    wide CPU projections packed when asked."""
    model = load_model(checkpoint, config.device, config.dtype, tp)
    if pack_cpu_weights and config.device.type == "cpu":
        pack_wide_linears(model, batch_hint=min(config.max_num_seqs, 16))
    return model


def pool_size(model: LlamaForCausalLM, config: EngineConfig, tp=None) -> int:
    """KV blocks in the pool: config.num_blocks, or what the memory budget holds (never more than every
    sequence at full length needs); under tensor parallelism the smallest rank's, so every rank has one."""
    check_cache_features(model, config)
    num_blocks = config.num_blocks or _num_blocks_for_budget(model, config)
    return num_blocks if tp is None else tp.min_over_ranks(num_blocks)


def host_tier_size(model: LlamaForCausalLM, config: EngineConfig, tp=None) -> int:
    """Slots of the prefix cache's host tier that host_cache_bytes holds (per rank; the smallest rank's)."""
    if not config.host_cache_bytes:
        return 0
    block_bytes = kv_cache_block_bytes(model, config.block_size,
                                       kv_cache_dtype(config.kv_cache_dtype, next(model.parameters()).dtype))
    if config.host_cache_bytes < block_bytes:
        raise ValueError(f"host_cache_bytes={config.host_cache_bytes} holds no KV block ({block_bytes} bytes "
                         "each); raise it, or pass 0 for no host tier")
    num = min(config.host_cache_bytes // block_bytes, 2**31 - 1)
    return num if tp is None else tp.min_over_ranks(num)


def disk_tier_size(model: LlamaForCausalLM, config: EngineConfig) -> int:
    """Records of the prefix cache's disk tier that disk_cache_bytes holds (each a host-tier block and its
    header, DiskStore.record_stride bytes)."""
    if not config.disk_cache_bytes:
        return 0
    block_bytes = kv_cache_block_bytes(model, config.block_size,
                                       kv_cache_dtype(config.kv_cache_dtype, next(model.parameters()).dtype))
    stride = DiskStore.record_stride(block_bytes, config.block_size)
    if config.disk_cache_bytes < stride:
        raise ValueError(f"disk_cache_bytes={config.disk_cache_bytes} holds no KV block ({stride} bytes each with "
                         "its header); raise it, or pass 0 for no disk tier")
    return min(config.disk_cache_bytes // stride, 2**31 - 1)


def _num_blocks_for_budget(model: LlamaForCausalLM, config: EngineConfig) -> int:
    # Pool = budget // bytes per block. An MLA model's block costs pagedkv.mla_block_bytes(...) instead
    # (num_layers * block_size * (kv_lora_rank + qk_rope_head_dim) * itemsize): the same division, and the
    # same block manager (block_size tokens per block, one KV group).
    block_bytes = kv_cache_block_bytes(model, config.block_size,
                                       kv_cache_dtype(config.kv_cache_dtype, next(model.parameters()).dtype))
    budget, what = _kv_budget(config)
    recent = recent_pool_bytes(model, config)
    if recent:      # the float8 rule's full-precision window comes out of the same budget
        budget -= recent
        what += f" less the float8 rule's recent pool ({recent} bytes: kv_recent_tokens, kv_first_block)"
    if budget < block_bytes:
        raise ValueError(f"{what} holds no KV block ({block_bytes} bytes each); raise it or pass num_blocks")
    # More is never used: every sequence at full length, admitted with its blocks in every KV group.
    cfg = model.config
    enough = config.max_num_seqs * -(-cfg.max_position_embeddings // config.block_size) * len(cfg.group_windows)
    return min(budget // block_bytes, enough)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, num_blocks: int, num_cpu_blocks: int,
                 seed: int = 0, num_host_blocks: int = 0):
        self.model = model
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        dtype = kv_cache_dtype(config.kv_cache_dtype, next(model.parameters()).dtype)
        self.kv_scales = attach_kv_scales(model, config.kv_cache_dtype, config.kv_scale, self.device)
        self.kv_caches = self._allocate(num_blocks, self.device, dtype)
        self.cpu_kv_caches = self._allocate(num_cpu_blocks, torch.device("cpu"), dtype,
                                            pin=self.device.type == "cuda") if num_cpu_blocks else []
        cfg = model.config
        # The prefix cache's host tier: block-major, so a demoted block moves as one region.
        self.host_tier = self._allocate_host_tier(num_host_blocks, dtype) if num_host_blocks else None
        self.layer_caches = [self.kv_caches[i] for i in model.config.layer_cache_slots]   # what layer i reads
        self.num_groups = len(model.config.group_windows)
        self.recent, self.recent_group = self._attach_recent_pool(config), None
        if self.recent is not None:
            self.recent_group = model.config.group_windows.index(None)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def _attach_recent_pool(self, config: EngineConfig) -> "RecentPool | None":
        """The float8 rule's recent pool (kv.recent) and each full-attention layer's part of it."""
        num = recent_pool_blocks(self.model, config)
        if not num:
            return None
        cfg, dtype = self.model.config, next(self.model.parameters()).dtype
        full = cfg.group_windows.index(None)
        for layer in self.model.model.layers:
            attn = layer.self_attn
            if cfg.layer_groups[attn.layer_index] == full:
                (k, v), = allocate_kv_cache(1, num, self.block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype,
                                            device=self.device)
                attn.kv_recent = LayerRecentKV(k, v, config.kv_recent_tokens)
        return RecentPool(num, self.block_size, config.kv_recent_tokens, config.kv_first_block, self.device)

    def _allocate_host_tier(self, num_host_blocks: int, dtype: torch.dtype) -> torch.Tensor:
        cfg, pin = self.model.config, self.device.type == "cuda"
        if cfg.latent_cache is not None:     # [num_host_blocks, num_layers, block_size, latent row]
            return torch.empty((num_host_blocks, num_cache_tensors(self.model), self.block_size, sum(cfg.latent_cache)),
                               dtype=dtype, pin_memory=pin)
        return allocate_host_tier(num_host_blocks, num_cache_tensors(self.model), self.block_size, cfg.num_kv_heads,
                                  cfg.head_dim, dtype=dtype, pin_memory=pin)

    def _allocate(self, num_blocks, device, dtype, pin=False):
        cfg = self.model.config
        if cfg.latent_cache is not None:
            kv_lora_rank, rope_dim = cfg.latent_cache
            return [(latent,) for latent in allocate_mla_cache(num_cache_tensors(self.model), num_blocks, self.block_size,
                                                               kv_lora_rank, rope_dim, dtype=dtype, device=device,
                                                               pin_memory=pin)]
        return allocate_kv_cache(num_cache_tensors(self.model), num_blocks, self.block_size, cfg.num_kv_heads,
                                 cfg.head_dim, dtype=dtype, device=device, pin_memory=pin)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, bm: BlockManager) -> list[list[int]]:
        loads = self._move_blocks(batch, defer_loads=bool(batch.seqs))
        if not batch.seqs:
            return []
        input_ids, positions, meta = self._prepare(batch, bm)
        hidden = self._forward(input_ids, positions, meta, loads)
        logits = self.model.compute_logits(hidden)
        return self._sample(logits, batch)

    def _forward(self, input_ids, positions, meta: AttentionMetadata, loads: "LayerLoads | None") -> torch.Tensor:
        """The model on the step's inputs, with the step's host-tier loads arriving layer by layer."""
        meta.layer_loads = loads
        hidden = self.model(input_ids, positions, self.layer_caches, meta)
        if loads is not None:       # a forward that raised fails the step: its loads count as failed
            loads.finish()
        return hidden

    @torch.inference_mode()
    def forward_chunk(self, token_ids: list[int], start: int, bm: BlockManager, seq_id: int) -> torch.Tensor:
        """Logits of every token of positions [start, start + len(token_ids)) of sequence `seq_id`, whose
        KV before `start` is in the cache (LLM.prompt_logits)."""
        end = start + len(token_ids)
        meta = self._attention_metadata(bm, [seq_id], [start], [end])
        meta.logits_indices = torch.arange(len(token_ids), device=self.device)
        hidden = self.model(torch.tensor(token_ids, dtype=torch.int64, device=self.device),
                            torch.arange(start, end, device=self.device), self.layer_caches, meta)
        return self.model.compute_logits(hidden)

    def _attention_metadata(self, bm: BlockManager, seq_ids: list[int], starts: list[int],
                            ends: list[int]) -> AttentionMetadata:
        """The paged-attention inputs of a step whose sequence i has queries at positions [starts[i],
        ends[i]): one bm.attention_inputs call per KV group."""
        dev, groups, recent = self.device, [], None
        for g in range(self.num_groups):
            slots, tables, seq_lens, query_start_loc = bm.attention_inputs(seq_ids, starts, ends, group=g)
            groups.append(KVGroupInputs(slots.to(dev, non_blocking=True), tables.to(dev, non_blocking=True)))
            if g == self.recent_group:
                first = self.block_size
                recent = self.recent.prepare(seq_ids, starts, ends, tables,
                                             first_tokens=lambda seq_id: bm.token_ids(seq_id)[:first])
        return AttentionMetadata(seq_lens=seq_lens.to(dev, non_blocking=True),
                                 query_start_loc=query_start_loc.to(dev, non_blocking=True),
                                 max_seq_len=max(ends), groups=groups, recent=recent)

    @torch.inference_mode()
    def move_blocks(self, moves: ScheduledBatch) -> None:
        """Block moves outside a step (the engine's clean-ahead offloads)."""
        self._move_blocks(moves)

    def _move_blocks(self, moves, defer_loads: bool = False) -> "LayerLoads | None":
        """The step's block moves (a ScheduledBatch or a StepMessage: [n, 2] pairs): swap-ins (cpu, gpu),
        swap-outs (gpu, cpu), host-tier offloads (gpu, host slot) and loads (host slot, gpu), copy-on-write
        copies (src, dst). defer_loads (a forward follows): the loads are returned as LayerLoads for the
        forward to take layer by layer, unless a copy-on-write copy must follow them."""
        # The scheduler swaps in before it preempts, so this order is the order of its decisions: a group
        # swapped in may be swapped out again at once, and blocks freed by a swap-out may be the
        # destination of a copy or of this step's new KV. Offloads read blocks the manager holds for them
        # and loads write fresh blocks of their sequences: disjoint from each other and from the rest.
        for mapping, to_cpu in ((moves.swap_in, False), (moves.swap_out, True)):
            if not len(mapping):
                continue
            pairs = torch.as_tensor(mapping, dtype=torch.int64).view(-1, 2).cpu()
            for gpu, cpu in zip(self.kv_caches, self.cpu_kv_caches):
                for g, c in zip(gpu, cpu):
                    src, dst = (g, c) if to_cpu else (c, g)
                    torch.ops.pagedkv.swap_blocks(src, dst, pairs)
        if len(moves.offloads):
            offload_slots(self.kv_caches, self.host_tier, moves.offloads)
        layer_loads = None
        if len(moves.loads):
            if defer_loads and not len(moves.copies):
                layer_loads = LayerLoads(self.host_tier, self.kv_caches, moves.loads, self.model.config.layer_cache_slots)
            else:
                load_slots(self.host_tier, self.kv_caches, moves.loads)
        if len(moves.copies):
            pairs = torch.as_tensor(moves.copies, dtype=torch.int64).view(-1, 2)
            if self.model.config.latent_cache is not None:     # one latent tensor per slot: moved within itself
                for (latent,) in self.kv_caches:
                    torch.ops.pagedkv.swap_blocks(latent, latent, pairs.cpu())
            else:
                torch.ops.pagedkv.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches],
                                              pairs.to(self.device))
        return layer_loads

    def _prepare(self, batch: ScheduledBatch, bm: BlockManager):
        """The step's (input_ids, positions, AttentionMetadata): each decode's input token (and its drafts
        when speculating), then each prefill's chunk."""
        drafts = batch.decode_drafts or [[]] * len(batch.decodes)
        input_ids, starts, ends = [], [], []
        for s, draft in zip(batch.decodes, drafts):
            input_ids += [s.token_ids[-1], *draft]
            starts.append(len(s) - 1)
            ends.append(len(s) + len(draft))
        for seq, start, end in zip(batch.prefills, batch.prefill_starts, batch.prefill_ends):
            input_ids += seq.token_ids[start:end]
        starts += batch.prefill_starts
        ends += batch.prefill_ends
        positions = [p for start, end in zip(starts, ends) for p in range(start, end)]
        meta = self._attention_metadata(bm, [s.seq_id for s in batch.seqs], starts, ends)
        if batch.decode_drafts:     # every decode token is verified; a prefill samples after its last
            num_decode_tokens = sum(ends[i] - starts[i] for i in range(len(batch.decodes)))
            last = meta.query_start_loc[len(batch.decodes) + 1:].long() - 1
            meta.logits_indices = torch.cat([torch.arange(num_decode_tokens, device=self.device), last])
        return (torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device), meta)

    def _sample(self, logits: torch.Tensor, batch: ScheduledBatch) -> list[list[int]]:
        if not batch.decode_drafts:
            return self._sample_last(logits, batch)
        # Rows: 1 + len(draft) per decode, then one per prefill. A drafting sequence keeps the drafts the
        # model accepts and then the model's next token; the others sample from their last row.
        rows = [1 + len(d) for d in batch.decode_drafts] + [1] * len(batch.prefills)
        ends = torch.tensor(rows).cumsum(0).tolist()
        sampled = self._sample_last(logits[torch.tensor(ends, device=logits.device) - 1], batch)
        targets = logits.argmax(dim=-1).tolist()
        for i, (seq, draft, end) in enumerate(zip(batch.decodes, batch.decode_drafts, ends)):
            if not draft:
                continue
            params, start = seq.request.params, end - 1 - len(draft)
            if params.temperature == 0:
                sampled[i] = accept_greedy(draft, targets[start:end])
            else:
                n = len(draft) + 1
                probs = sampling_probs(logits[start:end], torch.full((n,), params.temperature, device=logits.device),
                                       torch.full((n,), params.top_p, device=logits.device))
                sampled[i] = accept_sampled(probs, draft, self.generator)
        return sampled

    def _sample_last(self, logits: torch.Tensor, batch: ScheduledBatch) -> list[list[int]]:
        """logits: one row per sequence of the batch; returns its num_samples tokens each."""
        counts = batch.num_samples
        params = [s.request.params for s in batch.seqs]
        if all(p.temperature == 0 for p in params):      # greedy: every sample of a row is its argmax
            return [[token] * c for token, c in zip(logits.argmax(dim=-1).tolist(), counts)]
        repeats = torch.tensor(counts, device=logits.device)
        temperatures = torch.tensor([p.temperature for p in params], device=logits.device)
        top_ps = torch.tensor([p.top_p for p in params], device=logits.device)
        tokens = sample(logits.repeat_interleave(repeats, dim=0), temperatures.repeat_interleave(repeats),
                        top_ps.repeat_interleave(repeats), self.generator).tolist()
        out, i = [], 0
        for c in counts:
            out.append(tokens[i:i + c])
            i += c
        return out


def offload_slots(kv_caches, host_tier: torch.Tensor, mapping) -> None:
    """(device block, host slot) pairs: whole blocks of every cache slot into the host tier (offload_blocks for
    K/V pairs; an MLA model's latent tensors by indexing, one copy per layer)."""
    if len(kv_caches[0]) == 2:
        offload_blocks([k for k, _ in kv_caches], [v for _, v in kv_caches], host_tier, mapping)
        return
    pairs = torch.as_tensor(mapping, dtype=torch.int64).view(-1, 2).cpu()
    for t, (latent,) in enumerate(kv_caches):
        host_tier[pairs[:, 1], t] = latent[pairs[:, 0].to(latent.device)].cpu()


def load_slots(host_tier: torch.Tensor, kv_caches, mapping, first_layer: int = 0) -> None:
    """(host slot, device block) pairs: whole blocks from the host tier into the cache slots, the first of which
    is the host tier's layer `first_layer`."""
    if len(kv_caches[0]) == 2:
        load_blocks(host_tier, [k for k, _ in kv_caches], [v for _, v in kv_caches], mapping, first_layer=first_layer)
        return
    pairs = torch.as_tensor(mapping, dtype=torch.int64).view(-1, 2).cpu()
    for t, (latent,) in enumerate(kv_caches, first_layer):
        latent[pairs[:, 1].to(latent.device)] = host_tier[pairs[:, 0], t].to(latent.device, non_blocking=True)


class LayerLoads:
    """A step's host-tier loads, one layer at a time, so that the blocks of layer l + 1 arrive while layer l
    computes. On a GPU every layer's copy is queued at once on a side stream, with an event each, and the
    model's stream waits for a layer's event just before that layer runs; on the CPU, where there is one
    stream, each layer's blocks are copied just before the layer (the same order and checks, no overlap).
    `finish` (after the forward) makes every copy part of the step."""

    _streams: dict = {}        # one side stream per CUDA device, made on first use

    def __init__(self, host_tier: torch.Tensor, kv_caches, mapping: torch.Tensor, layer_cache_slots: list[int]):
        self.host_tier, self.kv_caches, self.slots = host_tier, kv_caches, layer_cache_slots
        self.mapping = torch.as_tensor(mapping, dtype=torch.int64).view(-1, 2).cpu()
        device = kv_caches[0][0].device
        self.events = None
        self.loaded = [False] * len(kv_caches)
        if device.type == "cuda":
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            # The side stream starts after what the step queued so far (the blocks' earlier readers).
            stream.wait_stream(torch.cuda.current_stream(device))
            self.events = []
            with torch.cuda.stream(stream):
                for t in range(len(kv_caches)):
                    load_slots(host_tier, [kv_caches[t]], self.mapping, first_layer=t)
                    event = torch.cuda.Event()
                    event.record(stream)
                    self.events.append(event)

    def wait(self, layer: int) -> None:
        """Before layer `layer` reads its cache: its blocks are there (or queued ahead of it on the GPU)."""
        self._wait_tensor(self.slots[layer])

    def finish(self) -> None:
        """Every cache tensor's blocks are part of the step (those of tensors no layer waited for too)."""
        for t in range(len(self.kv_caches)):
            self._wait_tensor(t)

    def _wait_tensor(self, t: int) -> None:
        if self.events is not None:
            torch.cuda.current_stream(self.kv_caches[t][0].device).wait_event(self.events[t])
        elif not self.loaded[t]:
            load_slots(self.host_tier, [self.kv_caches[t]], self.mapping, first_layer=t)
            self.loaded[t] = True
