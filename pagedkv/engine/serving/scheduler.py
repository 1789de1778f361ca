"""Continuous batching over the block manager: waiting / running / swapped queues, admission through
the prefix cache, decode appends, preemption (swap or recompute) and forking of n > 1 samples."""
from collections import deque
from dataclasses import dataclass, field

import torch

from pagedkv import AllocStatus, BlockManager

from ..config import EngineConfig
from .sequence import Request, Sequence, SequenceStatus
from .speculative import NgramProposer


def _no_pairs() -> torch.Tensor:
    return torch.empty(0, 2, dtype=torch.int64)


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    decode_drafts: list[list[int]] = field(default_factory=list)   # speculative drafts per decode (or [])
    prefills: list[Sequence] = field(default_factory=list)      # new prompts and continued chunks
    prefill_starts: list[int] = field(default_factory=list)   # first position computed in this step
    prefill_ends: list[int] = field(default_factory=list)     # one past the last (len(seq) when it completes)
    prefill_samples: list[int] = field(default_factory=list)  # n for a request's first prefill, 0 mid-prompt
    # Block mappings, int64 [n, 2] CPU tensors as the block manager returns them and the ops take them.
    swap_out: torch.Tensor = field(default_factory=_no_pairs)   # (gpu block, cpu block)
    swap_in: torch.Tensor = field(default_factory=_no_pairs)    # (cpu block, gpu block)
    copies: torch.Tensor = field(default_factory=_no_pairs)     # copy-on-write (src, dst)
    offloads: torch.Tensor = field(default_factory=_no_pairs)   # to the host tier (gpu block, host slot)
    loads: torch.Tensor = field(default_factory=_no_pairs)      # host-tier hits (host slot, gpu block)
    admitted: list[Sequence] = field(default_factory=list)          # waiting -> running in this step
    failed: list[Sequence] = field(default_factory=list)            # sequences failed while scheduling

    @property
    def empty(self) -> bool:
        return not (self.decodes or self.prefills or len(self.swap_in) or len(self.swap_out) or self.failed)

    @property
    def seqs(self) -> list[Sequence]:
        return self.decodes + self.prefills

    @property
    def num_samples(self) -> list[int]:
        return [1] * len(self.decodes) + self.prefill_samples

    @property
    def num_tokens(self) -> int:
        return (len(self.decodes) + self.num_draft_tokens
                + sum(e - b for b, e in zip(self.prefill_starts, self.prefill_ends)))

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.decode_drafts))


@dataclass
class Snapshot:
    requests: list      # (request, error, [(sequence, number of tokens, status, finish_reason)])
    stats: dict
    next_seq_id: int


class Scheduler:
    def __init__(self, bm: BlockManager, config: EngineConfig, eos_token_ids: list[int], max_model_len: int):
        self.bm = bm
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # arrival order: the newest is preempted first
        self.swapped: deque[list[Sequence]] = deque()   # groups swapped out together, oldest first
        self.next_seq_id = 0
        self.cache_salt: bytes | None = None       # prefix-cache salt of new blocks (float8 KV: its scales)
        self.disk_wait: set[int] = set()           # waiting sequences whose disk blocks are being read to the host
        self.stats = dict(preempted_swap=0, preempted_recompute=0, swapped_in=0,
                          prefill_tokens=0, cached_prompt_tokens=0, decode_tokens=0, steps=0, failed_steps=0,
                          generation_tokens=0, spec_draft_tokens=0, spec_accepted_tokens=0)
        self.proposer = (NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                       config.prompt_lookup_max) if config.speculative else None)
        # Windowed layers: a prompt that cannot take all its blocks at once is admitted by its first chunk
        # and gets each later chunk's blocks as the window releases the oldest (one such prompt at a time).
        self.windowed = any(w is not None for w in bm.group_windows)

    # ---- queue management -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        seq = self._new_seq(request, request.prompt_token_ids)
        self.waiting.append(seq)

    def _new_seq(self, request: Request, token_ids: list[int]) -> Sequence:
        seq = Sequence(self.next_seq_id, request, token_ids)
        self.next_seq_id += 1
        request.seqs.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request: Request, reason: str = "aborted") -> None:
        """Ends every unfinished sequence of the request (finish_reason "abort") and frees its blocks."""
        seqs = [s for s in request.seqs if s.status != SequenceStatus.FINISHED]
        for s in seqs:
            if s.seq_id in self.bm:
                self.bm.free(s.seq_id)
            s.status, s.finish_reason = SequenceStatus.FINISHED, "abort"
        if seqs:
            request.error = reason
            self.waiting = deque(s for s in self.waiting if s.request is not request)
            self.running = [s for s in self.running if s.request is not request]
            self.swapped = deque(g for g in self.swapped if g[0].request is not request)

    # ---- who owns a sequence's tokens ----------------------------------------------------------------
    def check_consistency(self) -> None:
        """The ownership rule (docs/design.md, "Engine"): a sequence's tokens live in its `Sequence` (it
        exists before it has KV and after a recompute preemption drops it); the block manager holds a view
        of them, the prefix that has KV slots, `seq.token_ids[:bm.num_tokens(id)]`, and is the only source
        of slots, block tables and computed lengths. Between steps a decoding sequence's KV covers every
        token but the last sampled one (that token is appended to the manager when the next step writes
        its KV); a sequence still prefilling has all its prompt tokens there and fewer computed. Raises
        AssertionError naming the first sequence that breaks this (tests call it after every step)."""
        resident = self.running + [s for group in self.swapped for s in group]
        for seq in resident:
            held = self.bm.num_tokens(seq.seq_id)
            computed = self.bm.num_computed_tokens(seq.seq_id)
            if self.bm.token_ids(seq.seq_id) != seq.token_ids[:held]:
                raise AssertionError(f"sequence {seq.seq_id}: the block manager's tokens are not a prefix of its own")
            want = (len(seq) - 1, len(seq) - 1) if seq.prefilled else (len(seq), None)
            if held != want[0] or (want[1] is not None and computed != want[1]) or computed > held:
                raise AssertionError(f"sequence {seq.seq_id} ({len(seq)} tokens, prefilled={seq.prefilled}): "
                                     f"the block manager holds {held} tokens, {computed} computed")
        for seq in self.waiting:
            if seq.seq_id in self.bm:
                raise AssertionError(f"waiting sequence {seq.seq_id} still holds blocks")

    # ---- failed steps -----------------------------------------------------------------------------
    def snapshot(self) -> "Snapshot":
        """What restore() needs to undo a step: every unfinished request's sequences and counters."""
        seqs = list(self.waiting) + self.running + [s for g in self.swapped for s in g]
        requests = {id(s.request): s.request for s in seqs}.values()
        return Snapshot(
            requests=[(r, r.error, [(s, len(s.token_ids), s.status, s.finish_reason) for s in r.seqs])
                      for r in requests],
            stats=dict(self.stats), next_seq_id=self.next_seq_id)

    def restore(self, snap: "Snapshot") -> None:
        """After a step that raised: every request is as in the snapshot (tokens, error, samples) and
        every unfinished sequence waits to be recomputed, its blocks freed. The block manager may have
        done part of the step (appends, allocations, swaps, forks), and the KV a partial forward wrote
        is not trusted, so no unfinished sequence keeps blocks; prefix-cache entries stay (they are
        registered only once their KV was complete). Host-tier copies of the step count as failed."""
        if self.bm.host_tier_enabled:
            self.bm.complete_offloads(False)
            self.bm.complete_loads(False)
        waiting = []
        for request, error, seq_states in snap.requests:
            for s in request.seqs[len(seq_states):]:        # forked in the failed step
                if s.seq_id in self.bm:
                    self.bm.free(s.seq_id)
            del request.seqs[len(seq_states):]
            request.error = error
            for s, length, status, reason in seq_states:
                if s.seq_id in self.bm:
                    self.bm.free(s.seq_id)
                del s.token_ids[length:]
                s.finish_reason, s.prefilled = reason, False
                s.status = SequenceStatus.FINISHED if status == SequenceStatus.FINISHED else SequenceStatus.WAITING
                if s.status == SequenceStatus.WAITING:
                    waiting.append(s)
        self.bm.take_copies()          # copy-on-write pairs of the failed step name freed blocks
        self.waiting = deque(sorted(waiting, key=lambda s: (s.arrival, s.seq_id)))
        self.running, self.swapped = [], deque()
        self.stats = {**snap.stats, "failed_steps": snap.stats["failed_steps"] + 1}
        self.next_seq_id = snap.next_seq_id

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Decodes first, then the next chunks of prompts already running, then new prompts, all within
        max_num_batched_tokens (a prompt that does not fit is prefilled over several steps)."""
        batch = ScheduledBatch()
        self._swap_in(batch)
        preempted = self._make_room_for_decodes(batch)
        batch.decodes = [s for s in self.running if s.prefilled]
        if batch.decodes:
            ids = [s.seq_id for s in batch.decodes]
            drafts = self._propose(batch.decodes) if self.proposer else []
            # Each decode's input token (and drafts) gets its blocks in every group; the runner reads their
            # slots with the step's other attention inputs.
            if drafts:
                batch.decode_drafts = drafts
                self.bm.append_tokens(ids, [t for s, d in zip(batch.decodes, drafts) for t in [s.token_ids[-1], *d]],
                                      counts=[1 + len(d) for d in drafts])
            else:
                self.bm.append_tokens(ids, [s.token_ids[-1] for s in batch.decodes])
        for seq in self.running:
            if not seq.prefilled:
                budget = self.config.max_num_batched_tokens - batch.num_tokens
                if budget > 0:
                    start = self.bm.num_computed_tokens(seq.seq_id)
                    end = self._reserve_chunk(seq, min(len(seq), start + budget))
                    if end > start:
                        self._add_prefill_chunk(batch, seq, start, end, samples=self._fork_width(seq))
        if not preempted and not self.swapped:
            self._admit_waiting(batch)
        batch.copies = self.bm.take_copies()
        if self.bm.host_tier_enabled:
            # Write-backs of blocks this step reused, and the loads of its host hits.
            batch.offloads, batch.loads = self.bm.take_offloads(), self.bm.take_loads()
        self.stats["steps"] += 1
        return batch

    def _propose(self, decodes: list[Sequence]) -> list[list[int]]:
        """Draft tokens for each decoding sequence, or [] when none has any. Drafts
        stay within the sequence's max_tokens and the model's length, the step's token budget, and the
        free blocks: speculation never preempts (without room for every draft, none is made)."""
        budget = self.config.max_num_batched_tokens - len(decodes)
        drafts = []
        for s in decodes:
            params = s.request.params
            limit = min(params.max_tokens - s.num_output_tokens, self.max_model_len - len(s), budget + 1) - 1
            draft = self.proposer.propose(s.token_ids, limit)
            budget -= len(draft)
            drafts.append(draft)
        longest = max(map(len, drafts))
        if not longest or not self.bm.can_append([s.seq_id for s in decodes], longest):
            return []
        return drafts

    def _swap_in(self, batch: ScheduledBatch) -> None:
        while self.swapped:
            group = self.swapped[0]
            ids = [s.seq_id for s in group]
            # Room for the group's blocks and for one new block per running sequence after it, so that
            # it is not preempted again at once.
            need = self.bm.distinct_blocks(ids) + (len(self.running) + len(group) if self.running else 0)
            if (len(self.running) + len(group) > self.config.max_num_seqs
                    or self.bm.can_swap_in(ids) != AllocStatus.OK or self.bm.num_free_blocks < need):
                return
            self.swapped.popleft()
            batch.swap_in = torch.cat((batch.swap_in, self.bm.swap_in(ids)))
            for s in group:
                s.status = SequenceStatus.RUNNING
            self.running = sorted(self.running + group, key=lambda s: (s.arrival, s.seq_id))
            self.stats["swapped_in"] += len(group)

    def _make_room_for_decodes(self, batch: ScheduledBatch) -> bool:
        """Preempts the newest request's sequences until every decoding sequence can append a token."""
        preempted = False
        while self.running and not self.bm.can_append([s.seq_id for s in self.running if s.prefilled]):
            newest = self.running[-1].arrival
            group = [s for s in self.running if s.arrival == newest]
            if len(group) < len(self.running):
                self.running = self.running[:-len(group)]
                self._preempt(group, batch)
            elif len(group) > 1:          # one request left: shed its samples one at a time
                self._recompute([self.running.pop()])
            else:                         # alone and still no room: it has outgrown the whole pool
                self.running = []
                self._fail(group, batch, f"sequence outgrew the KV cache ({self.bm.num_blocks} blocks of "
                                         f"{self.config.block_size} tokens) at {len(group[0])} tokens")
            preempted = True
        return preempted

    def _preempt(self, group: list[Sequence], batch: ScheduledBatch) -> None:
        ids = [s.seq_id for s in group]
        if self.config.num_cpu_blocks > 0 and not self._reserving(group) and self.bm.can_swap_out(ids):
            batch.swap_out = torch.cat((batch.swap_out, self.bm.swap_out(ids)))
            for s in group:
                s.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.stats["preempted_swap"] += len(group)
        else:
            self._recompute(group)

    def _recompute(self, seqs: list[Sequence]) -> None:
        """Drops the sequences' KV; they wait to prefill prompt + outputs again, ahead of new requests."""
        for s in reversed(seqs):
            self.bm.free(s.seq_id)
            s.status, s.prefilled = SequenceStatus.WAITING, False
            self.waiting.appendleft(s)
        self.stats["preempted_recompute"] += len(seqs)

    def _admit_waiting(self, batch: ScheduledBatch) -> None:
        num_seqs = len(self.running)
        # A prompt whose first block equals that of a prompt prefilled in this step waits one step: the
        # block is registered in the prefix cache only once its KV is written, and then it hits.
        first_blocks, deferred = set(), []
        while self.waiting:
            seq = self.waiting[0]
            width = self._fork_width(seq)
            if width > self.config.max_num_seqs:
                self.waiting.popleft()
                self._fail([seq], batch, f"n={width} samples exceed max_num_seqs={self.config.max_num_seqs}")
                continue
            if num_seqs + width > self.config.max_num_seqs:
                break
            budget = self.config.max_num_batched_tokens - batch.num_tokens
            if budget <= 0:
                break
            first = self._first_block(seq)
            if (first is not None and first in first_blocks) or seq.seq_id in self.disk_wait:
                deferred.append(self.waiting.popleft())
                continue
            salt = self.cache_salt
            status = self.bm.can_allocate(seq.token_ids, cache_salt=salt)
            chunk = None          # admitted whole
            if status != AllocStatus.OK and self.windowed:
                # NEVER only if even 1-token chunks could not fit; one prompt at a time is admitted by chunks
                if self.bm.can_allocate(seq.token_ids, cache_salt=salt, num_new_tokens=1) == AllocStatus.NEVER:
                    status = AllocStatus.NEVER
                elif self._reserving(self.running) or self.bm.can_allocate(
                        seq.token_ids, cache_salt=salt, num_new_tokens=budget) != AllocStatus.OK:
                    status = AllocStatus.LATER
                else:
                    status, chunk = AllocStatus.OK, budget
            if status == AllocStatus.LATER:
                break
            self.waiting.popleft()
            if status == AllocStatus.NEVER:
                self._fail([seq], batch, f"sequence of {len(seq)} tokens can never fit in the KV cache: it needs "
                                         f"{self.bm.blocks_held(len(seq))} blocks of {self.config.block_size} "
                                         f"tokens, the pool has {self.bm.num_blocks}")
                continue
            num_cached = self.bm.allocate(seq.seq_id, seq.token_ids, cache_salt=self.cache_salt, num_new_tokens=chunk)
            seq.status = SequenceStatus.RUNNING
            batch.admitted.append(seq)
            end = min(len(seq), num_cached + budget, self.bm.num_allocated_tokens(seq.seq_id))
            self._add_prefill_chunk(batch, seq, num_cached, end, samples=width)
            self.stats["cached_prompt_tokens"] += num_cached
            num_seqs += width
            if first is not None and num_cached == 0:   # its first block is computed in this step
                first_blocks.add(first)
        self.waiting.extendleft(reversed(deferred))

    def _reserving(self, seqs: list[Sequence]) -> bool:
        """Whether one of the sequences was admitted by chunks and still lacks blocks for its prompt."""
        return self.windowed and any(not s.prefilled and self.bm.num_allocated_tokens(s.seq_id) < len(s)
                                     for s in seqs)

    def _reserve_chunk(self, seq: Sequence, end: int) -> int:
        """The end of the prompt chunk seq prefills this step, at most `end`: a sequence admitted by chunks
        reserves the chunk's blocks now (the window released the oldest at the last step), or one block's
        worth when that is all that fits, or waits (its computed length returned)."""
        have = self.bm.num_allocated_tokens(seq.seq_id)
        if end <= have:
            return end
        for target in (end, min(end, have + self.config.block_size)):
            if self.bm.can_reserve([seq.seq_id], [target]):
                self.bm.reserve([seq.seq_id], [target])
                return target
        return have

    def _add_prefill_chunk(self, batch: ScheduledBatch, seq: Sequence, start: int, end: int, samples: int) -> None:
        """Tokens [start, end) of seq's prompt (start: prefix-cache hits and earlier chunks); it samples only
        when they are its last."""
        batch.prefills.append(seq)
        batch.prefill_starts.append(start)
        batch.prefill_ends.append(end)
        batch.prefill_samples.append(samples if end == len(seq) else 0)
        self.stats["prefill_tokens"] += end - start

    def _first_block(self, seq: Sequence) -> tuple[int, ...] | None:
        """The tokens of the sequence's first block when that block could be a prefix-cache hit."""
        bs = self.config.block_size
        if not self.config.enable_prefix_caching or len(seq) <= bs:
            return None
        return tuple(seq.token_ids[:bs])

    def _fork_width(self, seq: Sequence) -> int:
        """Sequences this prefill turns into: n for a request's first prefill, else 1."""
        return seq.request.params.n if len(seq.request.seqs) == 1 and seq.num_output_tokens == 0 else 1

    def _fail(self, seqs: list[Sequence], batch: ScheduledBatch, message: str) -> None:
        """Ends these sequences with an error (their siblings go on); they are out of every queue."""
        request = seqs[0].request
        request.error = message
        for s in seqs:
            if s.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
                self.bm.free(s.seq_id)
            s.status = SequenceStatus.FINISHED
            s.finish_reason = "error"
        self.running = [s for s in self.running if s.status != SequenceStatus.FINISHED]
        batch.failed += seqs

    # ---- after the forward pass -------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, sampled: list[list[int]]) -> list[Sequence]:
        """sampled[i]: the tokens drawn for batch.seqs[i] (n of them for a first prefill of n > 1).
        Returns the sequences that finished in this step."""
        seqs, num_decodes = batch.seqs, len(batch.decodes)
        # A decode's tokens: its accepted drafts, then the token the model sampled after them.
        decode_tokens = sampled[:num_decodes]
        computed = [len(s) + len(t) - 1 for s, t in zip(batch.decodes, decode_tokens)] + batch.prefill_ends
        if batch.decode_drafts:         # rejected drafts leave the block manager unhashed
            self.bm.truncate([s.seq_id for s in batch.decodes], computed[:num_decodes])
            self.stats["spec_draft_tokens"] += batch.num_draft_tokens
            self.stats["spec_accepted_tokens"] += sum(len(t) - 1 for t in decode_tokens)
        self.bm.mark_computed([s.seq_id for s in seqs], computed)
        for seq, n in zip(batch.prefills, batch.prefill_ends):
            seq.prefilled = n == len(seq)
        self.running += batch.admitted
        finished = []
        self.stats["decode_tokens"] += len(batch.decodes) + batch.num_draft_tokens
        for seq, tokens in zip(batch.decodes, decode_tokens):
            for token in tokens:
                if self._append(seq, token):
                    finished.append(seq)
                    break
        for seq, tokens in zip(batch.prefills, sampled[num_decodes:]):
            if not tokens:                      # a prompt chunk that is not its last: nothing sampled
                continue
            for token in tokens[1:]:            # n > 1: children share the prompt's blocks
                child = self._new_seq(seq.request, seq.token_ids)
                self.bm.fork(seq.seq_id, child.seq_id)
                child.status, child.prefilled = SequenceStatus.RUNNING, True
                self.running.append(child)
                finished += self._append(child, token)
            finished += self._append(seq, tokens[0])
        self.running.sort(key=lambda s: (s.arrival, s.seq_id))
        return finished

    def _append(self, seq: Sequence, token: int) -> list[Sequence]:
        seq.token_ids.append(token)
        self.stats["generation_tokens"] += 1
        params = seq.request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            seq.finish_reason = "length"
        else:
            return []
        seq.status = SequenceStatus.FINISHED
        self.bm.free(seq.seq_id)
        self.running.remove(seq)
        return [seq]
