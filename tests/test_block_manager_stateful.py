"""Hypothesis drives the C++ BlockManager and the pure-Python model (tests/bm_model.py) with the same
random calls (retention priorities and durations, clock advances and pins included) and demands identical
results and block priorities, check_invariants() after every step, and that every prefix hit hands out a
block whose KV (tracked here) was written for exactly that prefix. It runs for full attention, one
sliding window and a hybrid of the two (one table per group, windowed entries released), and with a host
tier: offloads and loads are taken, copied (the KV tracked here moves with them), failed at random and
completed, and must match the model's; and with a disk tier below it: disk writes, prefetches and disk
reads likewise, so the tracked KV goes device -> host -> disk -> host -> device."""
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bm_model import FOREVER, TO_THE_END, Model
from pagedkv import AllocStatus, BlockManager

BS, NB, NCPU = 2, 12, 6

# (start, end, priority[, duration]) ranges; end None reaches past the prompt into decode tokens.
retention_range = st.tuples(st.integers(0, 8), st.one_of(st.none(), st.integers(0, 8)),
                            st.sampled_from([0, 10, 35, 60, 90, 100]),
                            st.sampled_from([None, None, 0, 1.0, 2.5])).map(
    lambda r: (r[0], None if r[1] is None else r[0] + r[1], r[2], r[3]))
retentions = st.one_of(st.none(), st.lists(retention_range, max_size=3))
outcome = st.sampled_from([True, True, True, False])  # of a tier copy: mostly done, sometimes failed


def model_ranges(retention):
    return [(a, TO_THE_END if b is None else b, p, FOREVER if d is None else d) for a, b, p, d in retention or ()]


class BlockManagerMachine(RuleBasedStateMachine):
    WINDOWS = (None,)  # one entry per group of layers
    NHOST = 0          # host-tier slots
    NDISK = 0          # disk-tier records

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NB, BS, num_cpu_blocks=NCPU, hash_algo="weak8", enable_events=True,
                               group_windows=list(self.WINDOWS), num_host_blocks=self.NHOST,
                               num_disk_blocks=self.NDISK)
        self.replayed = {m: Counter() for m in ("GPU", "CPU", "DISK")}  # hashes the KV events say each medium holds
        self.next_event = 0
        self.model = Model(NB, BS, NCPU, windows=self.WINDOWS, num_host_blocks=self.NHOST,
                           num_disk_blocks=self.NDISK)
        self.host_kv = {}  # host slot -> the KV it holds, as self.kv
        self.disk_kv = {}  # disk record -> the KV its file holds
        self.cached_prompts = []  # prompts cache_prompt computed and freed
        self.kv = {}  # physical block -> tokens of the prefix whose KV it holds (up to its last written slot)
        self.next_id = 0

    def resident(self):
        """Sequences on the GPU whose loads (if any) are confirmed."""
        return [s for s, q in self.model.seqs.items() if not q.swapped and not q.loading]

    def complete(self):
        """Resident sequences whose every token has a block (not in the middle of a chunked prefill)."""
        return [s for s in self.resident() if self.model.allocated(s) == len(self.model.seqs[s].tokens)]

    def prefilling(self):
        return [s for s in self.resident() if self.model.allocated(s) < len(self.model.seqs[s].tokens)]

    def swapped(self):
        return [s for s, q in self.model.seqs.items() if q.swapped]

    def write_kv(self, sid):
        """The runner wrote the KV of every token of sid (positions computed..len)."""
        q = self.model.seqs[sid]
        for g, table in enumerate(q.tables):
            for p in range(q.released[g] * BS, self.model.allocated(sid)):
                self.kv.setdefault(table[p // BS], {})[p % BS] = tuple(q.tokens[: p + 1])

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9), salt=st.sampled_from([b"", b"t1"]),
          retention=retentions, chunk=st.one_of(st.none(), st.none(), st.integers(1, 5)))
    def allocate(self, tokens, salt, retention, chunk=None):
        status = self.bm.can_allocate(tokens, cache_salt=salt or None, num_new_tokens=chunk)
        assert status == getattr(AllocStatus, self.model.alloc_status(tokens, salt, chunk=chunk))
        if status != AllocStatus.OK:
            return
        sid, self.next_id = self.next_id, self.next_id + 1
        cached = self.bm.allocate(sid, tokens, cache_salt=salt or None, retention=retention, num_new_tokens=chunk)
        assert cached == self.model.allocate(sid, tokens, salt, model_ranges(retention), chunk)
        assert self.bm.num_allocated_tokens(sid) == self.model.allocated(sid)
        q = self.model.seqs[sid]
        for g in range(len(self.WINDOWS)):
            table = self.bm.block_table(sid, group=g)
            assert table == q.tables[g]
            loading = {i for _, _, serial, h, i in self.model.loads if serial == q.serial and h == g}
            for p in range(q.released[g] * BS, cached):  # every hit it holds has exactly this prefix's KV
                if p // BS not in loading:
                    assert self.kv[table[p // BS]][p % BS] == tuple(tokens[: p + 1])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=3), retention=retentions)
    def allocate_shared_prefix(self, data, extra, retention):
        """A prompt that starts with another sequence's tokens: the way prefix hits (and a window's hits
        that need only its last blocks) happen."""
        q = self.model.seqs[data.draw(st.sampled_from(sorted(self.model.seqs)))]
        cut = data.draw(st.integers(1, len(q.tokens)))
        self.allocate(q.tokens[:cut] + extra, q.salt, retention)

    def perform_copies(self):
        """The runner performs the pending copy-on-write copies (always before it writes any KV)."""
        copies = self.bm.take_copies().tolist()
        assert copies == [list(p) for p in self.model.take_copies()]
        for src, dst in copies:
            self.kv[dst] = dict(self.kv.get(src, {}))

    @precondition(lambda self: self.prefilling())
    @rule(data=st.data(), chunk=st.integers(1, 5))
    def prefill_chunk(self, data, chunk):
        """Chunked prefill: compute the tokens that have blocks, then reserve the next chunk's."""
        sid = data.draw(st.sampled_from(self.prefilling()))
        self.perform_copies()
        self.write_kv(sid)
        done = self.model.allocated(sid)
        self.bm.mark_computed(sid, done)
        self.model.mark_computed(sid, done)
        end = min(len(self.model.seqs[sid].tokens), done + chunk)
        ok = self.model.reserve_need([sid], [end]) <= len(self.model.free)
        assert self.bm.can_reserve([sid], [end]) == ok
        if ok:
            self.bm.reserve([sid], [end])
            self.model.reserve(sid, end)

    @precondition(lambda self: self.complete())
    @rule(data=st.data())
    def compute(self, data):
        sids = data.draw(st.lists(st.sampled_from(self.complete()), min_size=1, max_size=3, unique=True))
        self.perform_copies()
        for sid in sids:
            self.write_kv(sid)
            self.model.mark_computed(sid)
        self.bm.mark_computed(sids)

    @precondition(lambda self: self.complete())
    @rule(data=st.data(), token=st.integers(0, 2), copy_now=st.booleans())
    def append(self, data, token, copy_now):
        sids = data.draw(st.lists(st.sampled_from(self.complete()), min_size=1, max_size=3, unique=True))
        ok = self.model.append_need(sids) <= len(self.model.free)
        assert self.bm.can_append(sids) == ok
        if not ok:
            return
        slots = self.bm.append_tokens(sids, [token] * len(sids)).tolist()
        self.model.allow_write_backs(self.model.append_need(sids))
        assert slots == [self.model.append(s, token) for s in sids]
        self.model.spare = 0
        if copy_now:  # else the copies stay pending across frees, forks and swaps until the next compute
            self.perform_copies()

    @precondition(lambda self: self.complete())
    @rule(data=st.data(), token=st.integers(0, 2))
    def append_speculative(self, data, token):
        """Several tokens per sequence in one call (an input and its drafts), then rejects some."""
        sids = data.draw(st.lists(st.sampled_from(self.complete()), min_size=1, max_size=3, unique=True))
        counts = data.draw(st.lists(st.integers(0, 5), min_size=len(sids), max_size=len(sids)))
        lookahead = max(counts) - 1 if max(counts) > 0 else 0
        ok = self.model.append_need(sids, counts) <= len(self.model.free)
        if min(counts) == max(counts) > 0:
            assert self.bm.can_append(sids, num_lookahead_slots=lookahead) == ok
        if not ok:
            return
        toks = [token] * sum(counts)
        slots = self.bm.append_tokens(sids, toks, counts=counts).tolist()
        self.model.allow_write_backs(self.model.append_need(sids, counts))
        assert slots == [x for sid, c in zip(sids, counts) for x in self.model.append_many(sid, [token] * c)]
        self.model.spare = 0
        keep = data.draw(st.lists(st.integers(0, 5), min_size=len(sids), max_size=len(sids)))
        lens = [max(1, len(self.model.seqs[sid].tokens) - k) for sid, k in zip(sids, keep)]
        if not all(self.model.can_truncate(sid, n) for sid, n in zip(sids, lens)):
            with pytest.raises(ValueError, match="released"):  # below what a window released: refused
                self.bm.truncate(sids, lens)
            return
        self.bm.truncate(sids, lens)
        for sid, n in zip(sids, lens):
            self.model.truncate(sid, n)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model.seqs)))
        self.bm.free(sid)
        self.model.free_seq(sid)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.resident()))
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.model.fork(parent, child)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data):
        sids = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, max_size=2, unique=True))
        ok = self.model.distinct_blocks(sids) <= len(self.model.cpu_free)
        assert self.bm.can_swap_out(sids) == ok
        if ok:
            mapping = self.bm.swap_out(sids).tolist()
            assert mapping == [list(p) for p in self.model.swap_out(sids)]
            self.cpu_kv = getattr(self, "cpu_kv", {})
            for g, c in mapping:
                self.cpu_kv[c] = dict(self.kv.get(g, {}))

    @precondition(lambda self: self.swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        sids = data.draw(st.lists(st.sampled_from(self.swapped()), min_size=1, max_size=2, unique=True))
        status = self.bm.can_swap_in(sids)
        assert status == getattr(AllocStatus, self.model.swap_in_status(sids))
        if status == AllocStatus.OK:
            mapping = self.bm.swap_in(sids).tolist()
            assert mapping == [list(p) for p in self.model.swap_in(sids)]
            for c, g in mapping:
                self.kv[g] = dict(self.cpu_kv[c])

    @precondition(lambda self: self.model.tier)
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def cache_prompt(self, tokens):
        """A prompt computed and freed at once: its blocks stay cached, dirty until offloaded."""
        sid = self.next_id
        self.allocate(tokens, b"", None)
        if sid not in self.model.seqs or self.model.seqs[sid].loading:
            return
        self.cached_prompts.append(tokens)
        self.perform_copies()
        self.write_kv(sid)
        self.bm.mark_computed(sid)
        self.model.mark_computed(sid)
        self.bm.free(sid)
        self.model.free_seq(sid)

    @precondition(lambda self: self.model.tier and self.model.free)
    @rule()
    def evict_device_copies(self, num_blocks=None):
        """A prompt of new tokens as long as the free list, allocated and freed uncomputed: every free
        block is reused, so cached prompts survive only in the host tier (or in write-backs). With
        num_blocks, only that many blocks per group are reused (the coldest)."""
        n = len(self.model.free) // len(self.WINDOWS)  # every group takes as many blocks
        n = BS * (n if num_blocks is None else min(n, num_blocks))
        if not n:
            return
        self.allocate([3] * n, b"", None)
        sid = self.next_id - 1
        if sid in self.model.seqs:
            self.bm.free(sid)
            self.model.free_seq(sid)

    @precondition(lambda self: self.model.tier and self.cached_prompts)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=2))
    def allocate_cached_prompt(self, data, extra):
        """An earlier prompt again, often right after its device copies were evicted: a host hit."""
        if data.draw(st.booleans()):
            assert self.bm.plan_offloads(NB) == self.model.plan_offloads(NB)
            self.complete_offloads(data)
            if self.model.free:
                self.evict_device_copies()
        self.allocate(data.draw(st.sampled_from(self.cached_prompts)) + extra, b"", None)

    @precondition(lambda self: self.model.tier)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=3, max_size=12), extra=st.lists(st.integers(0, 2), max_size=2))
    def host_round_trip(self, data, tokens, extra):
        """A prompt is cached, offloaded, pushed off the device and admitted again (a host hit in every
        group whose blocks the host kept), then its loads are copied, some failing."""
        self.cache_prompt(tokens)
        assert self.bm.plan_offloads(NB) == self.model.plan_offloads(NB)
        self.complete_offloads(data)
        self.evict_device_copies(data.draw(st.sampled_from([None, 1, 2, 3])))  # some device hits may stay
        self.allocate(tokens + extra, b"", None)
        self.transfer(data, 0)

    def complete_offloads(self, data):
        """Takes the offloads, copies them (a failed copy leaves garbage in its slot) and completes them."""
        offloads = self.bm.take_offloads().tolist()
        assert offloads == [list(p) for p in self.model.take_offloads()]
        ok = data.draw(st.lists(outcome, min_size=len(offloads), max_size=len(offloads)))
        for (block, slot), good in zip(offloads, ok):
            self.host_kv[slot] = dict(self.kv.get(block, {})) if good else {o: "garbage" for o in range(BS)}
        self.bm.complete_offloads(ok)
        self.model.complete_offloads(ok)

    @precondition(lambda self: self.model.tier)
    @rule(data=st.data(), n=st.integers(0, 4))
    def transfer(self, data, n):
        """The runner's tier copies: clean ahead n blocks, then the offloads and loads taken, copied (a
        failed copy leaves garbage) and completed with outcomes drawn here; the loaded sequences' computed
        tokens must follow the model."""
        assert self.bm.plan_offloads(n) == self.model.plan_offloads(n)
        self.complete_offloads(data)
        loads = self.bm.take_loads().tolist()
        assert loads == [list(p) for p in self.model.take_loads()]
        ok = data.draw(st.lists(outcome, min_size=len(loads), max_size=len(loads)))
        self.perform_copies()  # before the loads write their blocks (a pending copy may read a loaded block's old KV)
        for (slot, block), good in zip(loads, ok):
            self.kv[block] = dict(self.host_kv.get(slot, {})) if good else {o: "garbage" for o in range(BS)}
        readmit = self.bm.complete_loads(ok)
        assert readmit == self.model.complete_loads(ok)
        for sid in readmit:  # no safe point to recompute from: freed, its prompt admitted again
            assert self.bm.must_readmit(sid) and self.bm.num_computed_tokens(sid) == 0
            with pytest.raises(ValueError, match="re-admitted"):
                self.bm.mark_computed(sid)
            tokens = self.model.seqs[sid].tokens
            self.bm.free(sid)
            self.model.free_seq(sid)
            self.allocate(tokens, b"", None)
        for sid, q in self.model.seqs.items():
            assert self.bm.num_computed_tokens(sid) == q.computed
            assert self.bm.num_loading_blocks(sid) == q.loading

    @precondition(lambda self: self.model.disk)
    @rule(data=st.data(), n=st.integers(0, 4))
    def disk_io(self, data, n):
        """The runner's disk I/O: clean ahead n host slots, then the writes and reads taken, performed (a
        failed write or read leaves garbage behind) and completed with outcomes drawn here."""
        assert self.bm.plan_disk_writes(n) == self.model.plan_disk_writes(n)
        writes = self.bm.take_disk_writes().tolist()
        assert writes == [list(p) for p in self.model.take_disk_writes()]
        ok = data.draw(st.lists(outcome, min_size=len(writes), max_size=len(writes)))
        for (slot, record), good in zip(writes, ok):
            self.disk_kv[record] = dict(self.host_kv.get(slot, {})) if good else {o: "garbage" for o in range(BS)}
        self.bm.complete_disk_writes(ok)
        self.model.complete_disk_writes(ok)
        reads = self.bm.take_disk_reads().tolist()
        assert reads == [list(p) for p in self.model.take_disk_reads()]
        ok = data.draw(st.lists(outcome, min_size=len(reads), max_size=len(reads)))
        for (record, slot), good in zip(reads, ok):
            self.host_kv[slot] = dict(self.disk_kv.get(record, {})) if good else {o: "garbage" for o in range(BS)}
        self.bm.complete_disk_reads(ok)
        self.model.complete_disk_reads(ok)

    @precondition(lambda self: self.model.disk)
    @rule(data=st.data(), other=st.lists(st.integers(0, 2), min_size=3, max_size=9))
    def demote_to_disk(self, data, other):
        """Cached prompts go down a tier or two: offloaded, written to disk, then pushed out of the host tier
        by another prompt's offloads and out of the device by new tokens."""
        assert self.bm.plan_offloads(NB) == self.model.plan_offloads(NB)
        self.complete_offloads(data)
        self.disk_io(data, self.NHOST)
        self.cache_prompt(other)
        assert self.bm.plan_offloads(NB) == self.model.plan_offloads(NB)
        self.complete_offloads(data)
        if self.model.free:
            self.evict_device_copies()

    @precondition(lambda self: self.model.disk)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=3, max_size=9),
          other=st.lists(st.integers(0, 2), min_size=3, max_size=9))
    def round_trip(self, data, tokens, other):
        """A prompt is cached, demoted to disk, prefetched back to the host and admitted again."""
        self.cache_prompt(tokens)
        self.demote_to_disk(data, other)
        self.prefetch(data, [], tokens)
        self.disk_io(data, 0)
        self.allocate(tokens, b"", None)

    @precondition(lambda self: self.model.disk and self.cached_prompts)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=2))
    def prefetch(self, data, extra, tokens=None):
        """A waiting prompt (a recent one again) is prefetched: reads of its blocks only the disk holds."""
        tokens = (tokens or data.draw(st.sampled_from(self.cached_prompts[-4:]))) + extra
        assert self.bm.lookup(tokens) == self.model.lookup(tokens)
        assert self.bm.prefetch(tokens) == self.model.prefetch(tokens)
        assert self.bm.num_pending_disk_reads == len(self.model.reads) + len(self.model.reads_taken)

    @rule()
    def reset_cache(self):
        if self.model.seqs and len(self.model.seqs) % 5:
            return  # rare
        self.bm.reset_prefix_cache()
        self.model.reset()

    @rule(dt=st.sampled_from([0, 0.5, 1.0, 3.0]))
    def advance_clock(self, dt):
        self.bm.set_time(self.bm.now + dt)
        self.model.set_time(self.bm.now)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def pin(self, data):
        sid = data.draw(st.sampled_from(self.resident()))
        expected = self.model.pin(sid)
        if expected is None:
            before = self.bm.num_pinned_blocks
            with pytest.raises(RuntimeError, match="cap"):
                self.bm.pin(sid)
            assert self.bm.num_pinned_blocks == before
        else:
            assert self.bm.pin(sid) == len(expected)
            assert self.bm.pinned_blocks(sid) == expected

    @precondition(lambda self: self.model.pins)
    @rule(data=st.data())
    def unpin(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model.pins)))
        self.bm.unpin(sid)
        self.model.unpin(sid)

    @invariant()
    def every_computed_token_has_its_kv(self):
        """Once the pending copies are done, each computed position of each sequence (on the GPU or
        swapped out) holds exactly the KV of its own prefix."""
        gpu = {b: dict(slots) for b, slots in self.kv.items()}
        for src, dst in self.model.copies:
            gpu[dst] = dict(self.kv.get(src, {}))
        cpu = getattr(self, "cpu_kv", {})
        pending = self.model.loads + self.model.loads_taken
        for q in self.model.seqs.values():
            where = cpu if q.swapped else gpu
            loading = {(g, i) for _, _, serial, g, i in pending if serial == q.serial}
            for g, table in enumerate(q.tables):
                for p in range(q.released[g] * BS, q.computed):
                    if (g, p // BS) not in loading:
                        assert where[table[p // BS]][p % BS] == tuple(q.tokens[: p + 1])

    @invariant()
    def events_replay_to_the_cached_blocks(self):
        """Replaying the KV events (stored adds, removed deletes one, cleared empties) gives exactly the
        blocks the cache holds, even with an 8-bit hash where different blocks share hashes."""
        for e in self.bm.take_events():
            assert e["seq"] == self.next_event
            self.next_event += 1
            replayed = self.replayed[e["medium"]]
            if e["kind"] == "stored":
                assert len(e["token_ids"]) == BS * len(e["block_hashes"])
                replayed.update(e["block_hashes"])
            elif e["kind"] == "removed":
                for h in e["block_hashes"]:
                    assert replayed[h] > 0
                    replayed[h] -= 1
            else:
                for r in self.replayed.values():
                    r.clear()
        for medium, replayed in self.replayed.items():
            assert +replayed == Counter(h for h, _ in self.bm.cached_blocks(medium)), medium

    @invariant()
    def agrees_with_model(self):
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == len(self.model.free)
        assert self.bm.num_free_cpu_blocks == len(self.model.cpu_free)
        stats = self.bm.stats()
        assert stats["evictions"] == self.model.evictions
        assert stats["free_host_blocks"] == len(self.model.host_free)
        assert stats["cached_host_blocks"] == len(self.model.host_registry)
        assert stats["host_evictions"] == self.model.host_evictions
        assert stats["free_disk_blocks"] == len(self.model.disk_free)
        assert stats["cached_disk_blocks"] == len(self.model.disk_registry)
        assert stats["disk_evictions"] == self.model.disk_evictions
        assert [self.bm.block_priority(b) for b in range(NB)] == [self.model.retention[b][0] for b in range(NB)]
        assert self.bm.num_pinned_blocks == self.model.pinned_blocks()
        assert all(self.bm.is_pinned(sid) for sid in self.model.pins)
        for sid, q in self.model.seqs.items():
            assert self.bm.num_allocated_tokens(sid) == self.model.allocated(sid)
            for g in range(len(self.WINDOWS)):
                assert self.bm.block_table(sid, group=g) == q.tables[g]
                assert self.bm.num_released_blocks(sid, group=g) == q.released[g]
            assert self.bm.num_tokens(sid) == len(q.tokens)


class WindowedMachine(BlockManagerMachine):
    WINDOWS = (3,)


class HybridMachine(BlockManagerMachine):
    WINDOWS = (None, 3)


class TieredMachine(BlockManagerMachine):
    NHOST = 5


class DiskTieredMachine(BlockManagerMachine):
    NHOST = 3
    NDISK = 8


class WindowedTieredMachine(BlockManagerMachine):
    WINDOWS = (3,)
    NHOST = 5


class HybridTieredMachine(BlockManagerMachine):
    WINDOWS = (None, 3)
    NHOST = 10  # a hit needs every group's blocks: room for both groups' copies of a prompt


class HybridWideWindowTieredMachine(BlockManagerMachine):
    """A window about as long as the prompts: a failed load recomputes in place, replacing the windowed
    group's device hits after it."""
    WINDOWS = (9, None)
    NHOST = 10


class HybridDiskTieredMachine(BlockManagerMachine):
    WINDOWS = (3, None)
    NHOST = 4
    NDISK = 10


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestWindowedStateful = WindowedMachine.TestCase
TestWindowedStateful.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestHybridStateful = HybridMachine.TestCase
TestHybridStateful.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestTieredStateful = TieredMachine.TestCase
TestTieredStateful.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestDiskTieredStateful = DiskTieredMachine.TestCase
TestDiskTieredStateful.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestWindowedTieredStateful = WindowedTieredMachine.TestCase
TestWindowedTieredStateful.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestHybridTieredStateful = HybridTieredMachine.TestCase
TestHybridTieredStateful.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestHybridWideWindowTieredStateful = HybridWideWindowTieredMachine.TestCase
TestHybridWideWindowTieredStateful.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestHybridDiskTieredStateful = HybridDiskTieredMachine.TestCase
TestHybridDiskTieredStateful.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
