"""Runs one scheduled batch: moves blocks (swap, copy-on-write), builds the paged-attention inputs
from the block manager, runs the model and samples the next tokens."""
import torch

from pagedkv import BlockManager
from pagedkv.cache import allocate_kv_cache, block_bytes

from .config import EngineConfig
from .kv_quant import attach_kv_scales, kv_cache_dtype
from .llama import AttentionMetadata, LlamaForCausalLM
from .sampling import sample, sampling_probs
from .scheduler import ScheduledBatch
from .speculative import accept_greedy, accept_sampled


def num_cache_tensors(model: LlamaForCausalLM) -> int:
    """KV cache tensors (pairs): one per layer, except that layer i of every KV group shares tensor i
    (Gemma 2: num_layers / 2)."""
    return max(model.config.layer_cache_slots) + 1


def kv_cache_block_bytes(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block id across all cache tensors, keys and values."""
    cfg = model.config
    return block_bytes(num_layers=num_cache_tensors(model), block_size=block_size, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, dtype=dtype)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, num_blocks: int, num_cpu_blocks: int,
                 seed: int = 0):
        self.model = model
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        dtype = kv_cache_dtype(config.kv_cache_dtype, next(model.parameters()).dtype)
        self.kv_scales = attach_kv_scales(model, config.kv_cache_dtype, config.kv_scale, self.device)
        self.kv_caches = self._allocate(num_blocks, self.device, dtype)
        self.cpu_kv_caches = self._allocate(num_cpu_blocks, torch.device("cpu"), dtype,
                                            pin=self.device.type == "cuda") if num_cpu_blocks else []
        self.layer_caches = [self.kv_caches[i] for i in model.config.layer_cache_slots]   # what layer i reads
        self.num_groups = len(model.config.group_windows)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def _allocate(self, num_blocks, device, dtype, pin=False):
        cfg = self.model.config
        return allocate_kv_cache(num_cache_tensors(self.model), num_blocks, self.block_size, cfg.num_kv_heads,
                                 cfg.head_dim, dtype=dtype, device=device, pin_memory=pin)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, bm: BlockManager) -> list[list[int]]:
        self._move_blocks(batch)
        if not batch.seqs:
            return []
        input_ids, positions, meta = self._prepare(batch, bm)
        hidden = self.model(input_ids, positions, self.layer_caches, meta)
        logits = self.model.compute_logits(hidden)
        return self._sample(logits, batch)

    @torch.inference_mode()
    def forward_chunk(self, token_ids: list[int], start: int, bm: BlockManager, seq_id: int) -> torch.Tensor:
        """Logits of every token of positions [start, start + len(token_ids)) of sequence `seq_id`, whose
        KV before `start` is in the cache (LLM.prompt_logits)."""
        end = start + len(token_ids)
        dev, n = self.device, len(token_ids)
        slots, tables, seq_lens, query_start_loc = (t.to(dev) for t in bm.attention_inputs([seq_id], [start], [end]))
        other_groups = tuple((slots_g.to(dev), tables_g.to(dev)) for slots_g, tables_g, _, _ in
                             (bm.attention_inputs([seq_id], [start], [end], group=g) for g in range(1, self.num_groups)))
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                                 query_start_loc=query_start_loc, max_seq_len=end,
                                 logits_indices=torch.arange(n, device=dev), other_groups=other_groups)
        hidden = self.model(torch.tensor(token_ids, dtype=torch.int64, device=dev),
                            torch.arange(start, end, device=dev), self.layer_caches, meta)
        return self.model.compute_logits(hidden)

    def _move_blocks(self, batch: ScheduledBatch) -> None:
        # The scheduler swaps in before it preempts, so this order is the order of its decisions: a group
        # swapped in may be swapped out again at once, and blocks freed by a swap-out may be the
        # destination of a copy or of this step's new KV.
        for mapping, to_cpu in ((batch.swap_in, False), (batch.swap_out, True)):
            if not len(mapping):
                continue
            for gpu, cpu in zip(self.kv_caches, self.cpu_kv_caches):
                for g, c in zip(gpu, cpu):
                    src, dst = (g, c) if to_cpu else (c, g)
                    torch.ops.pagedkv.swap_blocks(src, dst, mapping)
        if len(batch.copies):
            pairs = batch.copies.to(self.device)
            torch.ops.pagedkv.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], pairs)

    def _prepare(self, batch: ScheduledBatch, bm: BlockManager):
        if batch.decode_drafts:     # speculative: each decode's input token, then its drafts
            input_ids, positions, query_lens = [], [], []
            for s, draft in zip(batch.decodes, batch.decode_drafts):
                input_ids += [s.token_ids[-1], *draft]
                positions += range(len(s) - 1, len(s) + len(draft))
                query_lens.append(1 + len(draft))
        else:
            input_ids = [s.token_ids[-1] for s in batch.decodes]
            positions = [len(s) - 1 for s in batch.decodes]
            query_lens = [1] * len(batch.decodes)
        slots = [batch.decode_slots] if batch.decodes else []
        for seq, start, end in zip(batch.prefills, batch.prefill_starts, batch.prefill_ends):
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            query_lens.append(end - start)
        if batch.prefills:
            slots.append(bm.slot_mappings([s.seq_id for s in batch.prefills], batch.prefill_starts, batch.prefill_ends))
        ids = [s.seq_id for s in batch.seqs]
        seq_lens = [q - 1 + len(s) for q, s in zip(query_lens, batch.decodes)] + batch.prefill_ends
        query_start_loc = [0]
        for q in query_lens:
            query_start_loc.append(query_start_loc[-1] + q)
        dev = self.device
        logits_indices = None
        if batch.decode_drafts:     # every decode token is verified; a prefill samples after its last
            num_decode_tokens = query_start_loc[len(batch.decodes)]
            rows = list(range(num_decode_tokens)) + [e - 1 for e in query_start_loc[len(batch.decodes) + 1:]]
            logits_indices = torch.tensor(rows, dtype=torch.int64, device=dev)
        other_groups = ()
        if self.num_groups > 1:     # every group's slots of the step's tokens (decodes first), and tables
            starts = [len(s) - 1 for s in batch.decodes] + batch.prefill_starts
            ends = [len(s) + q - 1 for q, s in zip(query_lens, batch.decodes)] + batch.prefill_ends
            other_groups = tuple((bm.slot_mappings(ids, starts, ends, group=g).to(dev, non_blocking=True),
                                  bm.block_tables(ids, group=g).to(dev, non_blocking=True))
                                 for g in range(1, self.num_groups))
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev, non_blocking=True),
            block_tables=bm.block_tables(ids).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            max_seq_len=max(seq_lens),
            logits_indices=logits_indices,
            other_groups=other_groups,
        )
        return (torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta)

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
