#!/usr/bin/env python3
"""Long random run of the BlockManager against a KV-content oracle.

Drives the manager the way an engine does (shared prefixes, salts, partial mark_computed, batched
appends, speculative appends of several tokens rolled back by truncate, fork, copy-on-write with copies
sometimes left pending, swap out/in, prefix-cache resets, retention priorities and durations with a clock
that advances, pins and unpins, pools rebuilt with other shapes, hash functions and retention settings,
weak8 included so that hashes collide) and plays the model runner: every KV write stores, per slot, the
identity of the prefix it was computed for. It checks that every prefix hit and every computed token
holds exactly its own prefix's KV, that returned slots follow the block tables, that every pinned prefix
still hits in full (with its own KV) however much was evicted, that about 5% invalid calls raise the
documented exception and change nothing, and check_invariants() every 1000 operations, and that
replaying the KV events gives cached_blocks() (resyncing, as a router would, after events dropped by a
full buffer). With --groups / --sliding-window the pools have groups of layers with windows: every
group's held blocks are checked, released entries must be pads that slot_mapping refuses, and a rollback
into released blocks must be refused. Pools with a host tier offload (clean ahead and write-back) and load
(host hits) through copies the fuzzer performs and sometimes fails (a failed copy scribbles over its
destination): every loaded prefix must hold its own KV once confirmed, a failed load must lower the
computed tokens (to the first failed block of any group; a windowed pool's sequence that has no safe point
there is returned for re-admission and freed), and each medium's events must replay to its cached blocks. Pools with a disk tier below
the host tier write host slots to records (clean ahead and write-back) and prefetch them back into host
slots, the I/O lagging a step behind as on a background thread; each record keeps the identity the manager
gave when it was written as its header, a read whose header is not the record's identity now (or that
fails at random) is reported failed, and the device -> host -> disk -> host -> device round trip must
leave every loaded prefix with its own KV. Prints the figures; exits 1 at the first failure.

    python scripts/fuzz_block_manager.py --ops 1000000 [--seed N] [--groups 2] [--sliding-window 0]
"""
import argparse
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from pagedkv import AllocStatus, BlockManager


@dataclass
class Seq:
    tokens: list
    ids: list          # ids[p]: identity of the prefix tokens[:p + 1] (with the salt)
    salt: object
    computed: int = 0  # KV written for positions [0, computed)
    swapped: bool = False


@dataclass
class Figures:
    ops: Counter = field(default_factory=Counter)
    invalid_checked: int = 0
    invariant_checks: int = 0
    kv_tokens_checked: int = 0
    hit_tokens_checked: int = 0
    copies: int = 0
    pending_copies_across_ops: int = 0
    swapped_blocks: int = 0
    draft_tokens: int = 0
    events: int = 0
    event_resyncs: int = 0
    rejected_tokens: int = 0
    readmitted: int = 0
    pools: int = 0
    retained_prompts: int = 0
    pins: int = 0
    pins_refused: int = 0
    pinned_hit_tokens_checked: int = 0
    released_blocks_seen: int = 0
    reserved_chunks: int = 0
    offloads: int = 0
    loads: int = 0
    failed_copies: int = 0
    loaded_tokens_checked: int = 0
    disk_writes: int = 0
    disk_reads: int = 0
    failed_disk_io: int = 0
    stale_headers: int = 0
    prefetched_blocks: int = 0


def prefix_ids(tokens, salt):
    out, h = [], hash(("salt", salt))
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class Fuzzer:
    def __init__(self, rng: random.Random, figures: Figures, groups: int = 1, sliding_window: int | None = None):
        self.rng, self.fig = rng, figures
        self.num_groups, self.sliding_window = groups, sliding_window
        self.new_pool()

    def pool_windows(self):
        """One window per group: with a fixed window, groups alternate full / windowed (Gemma 2 style; a
        single group is windowed); window 0 draws a window (or full attention) per group and pool."""
        r, w = self.rng, self.sliding_window
        if w is None:
            return [None] * self.num_groups
        if w > 0:
            return [w] if self.num_groups == 1 else [None if g % 2 == 0 else w for g in range(self.num_groups)]
        return [r.choice([None, r.randint(1, 3 * self.bs), r.randint(2, 10)]) for _ in range(self.num_groups)]

    # --- set-up --------------------------------------------------------------------------------------
    def new_pool(self):
        r = self.rng
        self.bs = r.choice([1, 2, 3, 4, 8, 16])
        self.nb = r.randint(8, 96)
        self.ncpu = r.choice([0, r.randint(4, 64)])
        self.nhost = r.choice([0, r.randint(4, 96), r.randint(4, 24)])
        self.ndisk = r.choice([0, r.randint(4, 160)]) if self.nhost else 0
        if self.ndisk:  # upper tiers smaller than the prompts' prefixes: blocks end up only on disk
            self.nb = r.randint(8, 32)
        self.vocab = r.randint(2, 6)
        self.events = r.random() < 0.6
        self.windows = self.pool_windows()
        self.nb = self.nb * self.num_groups
        self.bm = BlockManager(self.nb, self.bs, num_cpu_blocks=self.ncpu, hash_algo=r.choice(["xxh64", "weak8"]),
                               enable_prefix_caching=r.random() < 0.9, watermark=r.choice([0.0, 0.0, 0.05]),
                               enable_events=self.events, max_pending_events=r.choice([64, 1 << 16, 1 << 16]),
                               default_priority=r.choice([35, 35, 0, 60]), decode_priority=r.choice([None, 10, 80]),
                               max_pinned_fraction=r.choice([0.0, 0.25, 0.5, 0.9]), group_windows=self.windows,
                               num_host_blocks=self.nhost, host_offload_min_priority=r.choice([0, 0, 35, 50]),
                               num_disk_blocks=self.ndisk)
        self.pins: dict[int, tuple] = {}  # seq id -> (tokens, ids, salt, pinned leading blocks)
        self.replayed = {m: Counter() for m in MEDIA}  # block hashes the events say each medium holds
        self.next_event = 0
        self.dropped_seen = 0
        self.seqs: dict[int, Seq] = {}
        self.gpu: dict[int, dict] = {}   # block -> {offset: prefix identity}
        self.cpu: dict[int, dict] = {}
        self.host: dict[int, dict] = {}  # host-tier slot -> {offset: prefix identity}
        self.loading: set[int] = set()   # sequences whose loads are not confirmed yet
        self.disk: dict[int, tuple] = {}  # disk record -> (header: the identity written, {offset: prefix identity})
        self.disk_writes: list = []       # (host slot, disk record, identity) taken, completed next step
        self.disk_reads: list = []        # (disk record, host slot, identity) taken, completed next step
        self.pending = False              # copies queued by append_tokens and not yet taken
        self.next_id = 0
        num_prefixes = 12 if self.ndisk else 4  # more distinct prefixes than the upper tiers hold
        self.prefixes = [[r.randrange(self.vocab) for _ in range(r.randint(1, 4 * self.bs))] for _ in range(num_prefixes)]
        self.fig.pools += 1

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def prompt(self):
        r = self.rng
        head = r.choice(self.prefixes) if r.random() < 0.7 else []
        tail = [r.randrange(self.vocab) for _ in range(r.randint(0 if head else 1, 3 * self.bs))]
        return head + tail, r.choice([None, None, b"s1", "s2"])

    def retention(self, n):
        """None (the default) half the time, else a few ranges over the prompt and beyond."""
        r = self.rng
        if r.random() < 0.5:
            return None
        self.fig.retained_prompts += 1
        out = []
        for _ in range(r.randint(1, 3)):
            start = r.randint(0, n)
            end = r.choice([None, r.randint(start, n + 2 * self.bs)])
            out.append((start, end, r.choice([0, 20, 35, 50, 90, 100]))
                       + ((r.choice([None, 0, 0.5, 2.0, 7.5]),) if r.random() < 0.5 else ()))
        return out

    def resident(self):
        """Sequences on the device whose KV is there (loads confirmed)."""
        return [i for i, s in self.seqs.items() if not s.swapped and i not in self.loading]

    def fail(self, what):
        raise AssertionError(what)

    # --- the model runner's side -----------------------------------------------------------------------
    def perform_copies(self):
        for src, dst in self.bm.take_copies().tolist():
            self.gpu[dst] = dict(self.gpu.get(src, {}))
            self.fig.copies += 1
        self.pending = False

    def transfer(self):
        """The runner's tier copies of a step: offloads (device -> host), then loads (host -> device), each
        failed now and then (a failed copy leaves garbage in its destination); then the loaded sequences'
        computed tokens must hold their own KV."""
        r = self.rng
        ok = []
        for block, slot in self.bm.take_offloads().tolist():
            ok.append(r.random() > 0.1)
            self.host[slot] = dict(self.gpu.get(block, {})) if ok[-1] else {o: "garbage" for o in range(self.bs)}
        self.bm.complete_offloads(ok)
        self.fig.offloads += len(ok)
        self.fig.failed_copies += ok.count(False)
        ok, failed = [], set()
        for slot, block in self.bm.take_loads().tolist():
            ok.append(r.random() > 0.1)
            self.gpu[block] = dict(self.host.get(slot, {})) if ok[-1] else {o: "garbage" for o in range(self.bs)}
            if not ok[-1]:
                failed.add(block)
        readmit = set(self.bm.complete_loads(ok))
        self.fig.loads += len(ok)
        self.fig.failed_copies += ok.count(False)
        if not readmit <= self.loading:
            self.fail(f"complete_loads returned {sorted(readmit - self.loading)}, which were not loading")
        for sid in self.loading:
            s = self.seqs[sid]
            computed = self.bm.num_computed_tokens(sid)
            if sid in readmit:  # no safe point to recompute from: freed, to be admitted again
                tables = [self.bm.block_table(sid, group=g) for g in range(len(self.windows))]
                if computed != 0 or not self.bm.must_readmit(sid) or not any(b in failed for t in tables for b in t):
                    self.fail(f"sequence {sid} was returned for re-admission with {computed} computed tokens")
                self.bm.free(sid)
                del self.seqs[sid]
                self.fig.readmitted += 1
                continue
            # Recomputed from the first failed block of any group (its windows are the ones held there).
            first_failed = min((i for _, t, released in self.held_tables(sid)
                                for i in range(released, s.computed // self.bs) if t[i] in failed), default=None)
            expected = s.computed if first_failed is None else first_failed * self.bs
            if computed != expected:
                self.fail(f"sequence {sid} has {computed} computed tokens after its loads, expected {expected}")
            s.computed = computed
            self.fig.loaded_tokens_checked += self.check_kv(sid, computed)
        self.loading.clear()

    def op_transfer(self):
        if self.rng.random() < 0.5:
            self.bm.plan_offloads(self.rng.randint(0, 8))
        self.transfer()
        if self.ndisk:
            if self.rng.random() < 0.5:
                self.bm.plan_disk_writes(self.rng.randint(0, 8))
            self.disk_io()

    def disk_io(self, lag=True):
        """The runner's disk I/O: completes the writes and reads taken at the previous call (a background
        thread's files), then takes the new ones (lag=False: completes those too). A write stores the host
        slot's KV under the record's identity as header; a read succeeds only if the header is the identity
        the manager gives now, and fails now and then (a failed read leaves garbage in its slot)."""
        r, bm = self.rng, self.bm
        for _ in range(1 if lag else 2):
            ok = []
            for slot, record, identity in self.disk_writes:
                ok.append(r.random() > 0.1)
                if ok[-1]:  # a whole file or nothing: a failed write leaves the old file
                    self.disk[record] = (identity, dict(self.host.get(slot, {})))
            if ok:
                bm.complete_disk_writes(ok)
            self.fig.disk_writes += ok.count(True)
            self.fig.failed_disk_io += ok.count(False)
            ok = []
            for record, slot, identity in self.disk_reads:
                header, kv = self.disk.get(record, (None, {}))
                if header != identity:
                    self.fig.stale_headers += 1
                ok.append(header == identity and r.random() > 0.1)
                self.host[slot] = dict(kv) if ok[-1] else {o: "garbage" for o in range(self.bs)}
            if ok:
                bm.complete_disk_reads(ok)
            self.fig.disk_reads += ok.count(True)
            self.fig.failed_disk_io += ok.count(False)
            self.disk_writes = [(s, d, bm.disk_record_identity(d)) for s, d in bm.take_disk_writes().tolist()]
            self.disk_reads = [(d, s, bm.disk_record_identity(d)) for d, s in bm.take_disk_reads().tolist()]
        if bm.num_pending_disk_reads != len(self.disk_reads):
            self.fail(f"{bm.num_pending_disk_reads} disk reads pending, {len(self.disk_reads)} taken")

    def op_prefetch(self):
        """An engine prefetches a waiting prompt: the blocks it reads are disk-only blocks after the hit."""
        tokens, salt = self.prompt()
        device, host, disk = self.bm.lookup(tokens, cache_salt=salt)
        if device + host + disk > max(0, (len(tokens) - 1) // self.bs):
            self.fail(f"lookup found {device} + {host} + {disk} blocks of a {len(tokens)}-token prompt")
        if disk and not self.ndisk:
            self.fail("lookup found disk blocks without a disk tier")
        queued = self.bm.prefetch(tokens, cache_salt=salt)
        if queued > disk * len(self.windows):  # a read per group's block
            self.fail(f"prefetch queued {queued} reads but lookup said {disk} disk blocks")
        self.fig.prefetched_blocks += queued
        if queued and self.rng.random() < 0.5:  # the reads are done: admit the prompt, its hit loaded
            self.disk_io(lag=False)
            if self.bm.can_allocate(tokens, cache_salt=salt) == AllocStatus.OK:
                sid = self.new_id()
                self.admitted(sid, tokens, salt, self.bm.allocate(sid, tokens, cache_salt=salt))
                self.transfer()

    def held_tables(self, sid):
        """(group, table, first held entry) of each group; checks that released entries are pads."""
        out = []
        for g, w in enumerate(self.windows):
            table, released = self.bm.block_table(sid, group=g), self.bm.num_released_blocks(sid, group=g)
            computed = self.seqs[sid].computed
            expect = 0 if w is None or computed < w else (computed - w + 1) // self.bs
            if released != expect or table[:released] != [0] * released:
                self.fail(f"sequence {sid} group {g} (window {w}) released {released} blocks at {computed} "
                          f"computed tokens, expected {expect} pads: {table[:released]}")
            self.fig.released_blocks_seen += released
            out.append((g, table, released))
        return out

    def check_kv(self, sid, upto):
        s = self.seqs[sid]
        store = self.cpu if s.swapped else self.gpu
        for g, table, released in self.held_tables(sid):
            for p in range(released * self.bs, upto):
                if store.get(table[p // self.bs], {}).get(p % self.bs) != s.ids[p]:
                    self.fail(f"sequence {sid} group {g} position {p}: the KV of another prefix (swapped={s.swapped})")
        return upto

    def write_kv(self, sid, start, end):
        """The runner writes positions [start, end) of every group through its slot mapping."""
        s = self.seqs[sid]
        for g, table, _ in self.held_tables(sid):
            slots = self.bm.slot_mapping(sid, start, end, group=g).tolist()
            for p, slot in zip(range(start, end), slots):
                if slot != table[p // self.bs] * self.bs + p % self.bs:
                    self.fail(f"slot_mapping gave slot {slot} for position {p} of sequence {sid} group {g}")
                self.gpu.setdefault(table[p // self.bs], {})[p % self.bs] = s.ids[p]

    def admitted(self, sid, tokens, salt, cached):
        self.seqs[sid] = Seq(list(tokens), prefix_ids(tokens, salt), salt, computed=cached)
        if cached % self.bs or cached >= len(tokens):  # whole blocks, and the last token is always computed
            self.fail(f"allocate reported {cached} cached tokens of a {len(tokens)}-token prompt")
        if self.bm.num_loading_blocks(sid):  # checked once its loads are confirmed
            self.loading.add(sid)
        else:
            self.fig.hit_tokens_checked += self.check_kv(sid, cached)

    # --- operations ----------------------------------------------------------------------------------------
    def op_allocate(self):
        tokens, salt = self.prompt()
        chunk = self.rng.choice([None, None, self.rng.randint(1, 3 * self.bs)])  # chunked prefill
        if self.bm.can_allocate(tokens, cache_salt=salt, num_new_tokens=chunk) != AllocStatus.OK:
            return
        sid = self.new_id()
        self.admitted(sid, tokens, salt, self.bm.allocate(sid, tokens, cache_salt=salt, num_new_tokens=chunk,
                                                          retention=self.retention(len(tokens))))

    def op_allocate_batch(self):
        batch = [self.prompt() for _ in range(self.rng.randint(1, 4))]
        ids = [self.new_id() for _ in batch]
        cached = self.bm.allocate_batch(ids, [t for t, _ in batch], cache_salts=[s for _, s in batch],
                                        retentions=[self.retention(len(t)) for t, _ in batch])
        for sid, (tokens, salt), c in zip(ids, batch, cached):
            self.admitted(sid, tokens, salt, c)

    def op_compute(self):
        todo = [i for i in self.resident() if self.seqs[i].computed < len(self.seqs[i].tokens)]
        if not todo:
            return
        ids = self.rng.sample(todo, self.rng.randint(1, min(4, len(todo))))
        self.perform_copies()  # the runner copies before it writes
        counts = []
        for sid in list(ids):
            s = self.seqs[sid]
            allocated = self.bm.num_allocated_tokens(sid)
            if allocated == s.computed:  # a chunked prefill: the next chunk's blocks first
                end = min(len(s.tokens), allocated + self.rng.randint(1, 3 * self.bs))
                if not self.bm.can_reserve(sid, end):
                    ids.remove(sid)
                    continue
                self.bm.reserve(sid, end)
                self.fig.reserved_chunks += 1
                allocated = end
            n = allocated if self.rng.random() < 0.7 else self.rng.randint(s.computed + 1, allocated)
            self.write_kv(sid, s.computed, n)
            counts.append(n)
        if not ids:
            return
        self.bm.mark_computed(ids, counts)
        for sid, n in zip(ids, counts):
            self.seqs[sid].computed = n

    def op_append(self):
        ready = [i for i in self.resident() if self.seqs[i].computed == len(self.seqs[i].tokens)
                 and len(self.seqs[i].tokens) < 12 * self.bs]
        if not ready:
            return
        ids = self.rng.sample(ready, self.rng.randint(1, min(6, len(ready))))
        if not self.bm.can_append(ids):
            return
        toks = [self.rng.randrange(self.vocab) for _ in ids]
        slots = self.bm.append_tokens(ids, toks).tolist()
        for sid, t, slot in zip(ids, toks, slots):
            s = self.seqs[sid]
            p = len(s.tokens)
            s.tokens.append(t)
            s.ids.append(hash((s.ids[-1], t)))
            table = self.bm.block_table(sid)
            if slot != table[p // self.bs] * self.bs + p % self.bs:
                self.fail(f"append_tokens gave slot {slot} for position {p} of sequence {sid}")
        if self.rng.random() < 0.5:
            self.perform_copies()
        else:
            self.pending = True

    def op_speculate(self):
        """A speculative step: append an input token and drafts, write all their KV, keep a prefix."""
        ready = [i for i in self.resident() if self.seqs[i].computed == len(self.seqs[i].tokens)
                 and len(self.seqs[i].tokens) < 12 * self.bs]
        if not ready:
            return
        ids = self.rng.sample(ready, self.rng.randint(1, min(4, len(ready))))
        k = self.rng.randint(0, 4)  # draft tokens per sequence
        if not self.bm.can_append(ids, num_lookahead_slots=k):
            return
        toks = [self.rng.randrange(self.vocab) for _ in range(len(ids) * (k + 1))]
        slots = self.bm.append_tokens(ids, toks, counts=[k + 1] * len(ids)).tolist()
        self.perform_copies()
        for n, sid in enumerate(ids):
            s = self.seqs[sid]
            table = self.bm.block_table(sid)
            start = len(s.tokens)
            for t, slot in zip(toks[n * (k + 1):(n + 1) * (k + 1)], slots[n * (k + 1):(n + 1) * (k + 1)]):
                p = len(s.tokens)
                s.tokens.append(t)
                s.ids.append(hash((s.ids[-1], t)))
                if slot != table[p // self.bs] * self.bs + p % self.bs:
                    self.fail(f"append_tokens(counts=) gave slot {slot} for position {p} of sequence {sid}")
            self.write_kv(sid, start, len(s.tokens))  # verification forward
        keep = [len(self.seqs[sid].tokens) - self.rng.randint(0, k) for sid in ids]
        self.fig.draft_tokens += k * len(ids)
        self.fig.rejected_tokens += sum(len(self.seqs[sid].tokens) - n for sid, n in zip(ids, keep))
        self.bm.truncate(ids, keep)
        self.bm.mark_computed(ids, keep)
        for sid, n in zip(ids, keep):
            s = self.seqs[sid]
            del s.tokens[n:], s.ids[n:]
            s.computed = n

    def op_fork(self):
        res = self.resident()
        if res:
            parent = self.rng.choice(res)
            child = self.new_id()
            self.bm.fork(parent, child)
            p = self.seqs[parent]
            self.seqs[child] = Seq(list(p.tokens), list(p.ids), p.salt, p.computed)

    def op_free(self):
        if self.seqs:
            sid = self.rng.choice(list(self.seqs))
            self.bm.free(sid)
            del self.seqs[sid]
            self.loading.discard(sid)

    def op_swap_out(self):
        res = self.resident()
        if not res or not self.ncpu:
            return
        ids = self.rng.sample(res, self.rng.randint(1, min(3, len(res))))
        if self.bm.can_swap_out(ids):
            for g, c in self.bm.swap_out(ids).tolist():  # copies may still be pending: the mapping accounts for them
                self.cpu[c] = dict(self.gpu.get(g, {}))
                self.fig.swapped_blocks += 1
            for sid in ids:
                self.seqs[sid].swapped = True

    def op_swap_in(self):
        out = [i for i, s in self.seqs.items() if s.swapped]
        if not out:
            return
        ids = self.rng.sample(out, self.rng.randint(1, min(3, len(out))))
        if self.bm.can_swap_in(ids) == AllocStatus.OK:
            for c, g in self.bm.swap_in(ids).tolist():
                self.gpu[g] = dict(self.cpu[c])
                self.fig.swapped_blocks += 1
            for sid in ids:
                self.seqs[sid].swapped = False

    def op_reset(self):
        if self.rng.random() < 0.1:
            self.bm.reset_prefix_cache()
            self.pins.clear()  # a reset lets every pin go

    def op_clock(self):
        self.bm.set_time(self.bm.now + self.rng.choice([0.0, 0.25, 1.0, 4.0]))

    def op_pin(self):
        res = self.resident()
        if not res:
            return
        sid = self.rng.choice(res)
        before = self.snapshot()
        try:
            n = self.bm.pin(sid)
        except RuntimeError as e:
            if "cap" not in str(e) or self.snapshot() != before:
                self.fail(f"a refused pin raised {e!r} or changed the manager's state")
            self.fig.pins_refused += 1
            return
        s, blocks = self.seqs[sid], self.bm.pinned_blocks(sid)
        full = {b for _, table, released in self.held_tables(sid) for b in table[released:s.computed // self.bs]}
        if len(blocks) != n or any(b not in full for b in blocks):
            self.fail(f"pin({sid}) holds {blocks}, not full computed blocks of its tables")
        table = self.bm.block_table(sid)
        k = 0  # the pinned blocks that lead the table: that prefix must keep hitting (one full group)
        while self.windows == [None] and k < len(blocks) and blocks[k] == table[k]:
            k += 1
        self.pins[sid] = (list(s.tokens[:k * self.bs]), s.ids[:k * self.bs], s.salt, blocks[:k])
        self.fig.pins += 1

    def op_unpin(self):
        if self.pins:
            sid = self.rng.choice(list(self.pins))
            self.bm.unpin(sid)
            del self.pins[sid]

    def check_pins(self):
        """Every pinned prefix still hits in full, on the pinned blocks, holding its own KV."""
        for sid, (tokens, ids, salt, blocks) in self.pins.items():
            if not blocks:
                continue
            probe = tokens + [0]
            if self.bm.can_allocate(probe, cache_salt=salt) != AllocStatus.OK:
                continue
            pid = self.new_id()
            cached = self.bm.allocate(pid, probe, cache_salt=salt)
            if cached != len(tokens) or self.bm.block_table(pid)[:len(blocks)] != blocks:
                self.fail(f"the pinned prefix of sequence {sid} hit {cached} of {len(tokens)} tokens")
            self.seqs[pid] = Seq(probe, ids + [hash((ids[-1], 0))], salt, computed=cached)
            self.fig.pinned_hit_tokens_checked += self.check_kv(pid, cached)
            self.bm.free(pid)
            del self.seqs[pid]

    def op_new_pool(self):
        if self.rng.random() < 0.02:
            if self.events:
                self.replay_events()
            self.new_pool()

    # --- invalid calls: the documented exception, and nothing changed ------------------------------------
    def snapshot(self):
        bm = self.bm
        return (bm.num_free_blocks, bm.num_free_cpu_blocks, bm.num_free_host_blocks, bm.num_free_disk_blocks,
                bm.num_pending_disk_reads, bm.stats(), bm.now,
                [bm.block_priority(b) for b in range(self.nb)], {i: bm.pinned_blocks(i) for i in self.pins},
                {i: ([bm.block_table(i, group=g) for g in range(len(self.windows))], bm.num_tokens(i),
                     bm.num_computed_tokens(i), bm.is_swapped(i)) for i in self.seqs})

    def op_invalid(self):
        r, bm = self.rng, self.bm
        some = r.choice(list(self.seqs)) if self.seqs else 1
        res = self.resident()
        unknown = self.next_id + 1000
        calls = [
            (KeyError, lambda: bm.free(unknown)),
            (KeyError, lambda: bm.mark_computed([unknown])),
            (KeyError, lambda: bm.can_append([unknown])),
            (ValueError, lambda: bm.allocate(unknown, [])),
            (TypeError, lambda: bm.allocate(unknown, [1.0, 2.0])),
            (TypeError, lambda: bm.allocate(unknown, [1], cache_salt=3)),
            (OverflowError, lambda: bm.allocate(unknown, [2 ** 63])),
            (ValueError, lambda: bm.allocate_batch([unknown, unknown + 1, unknown], [[1], [2], [3]])),
            (ValueError, lambda: bm.allocate_batch([unknown, unknown + 1], [[1], []])),
            (TypeError, lambda: bm.allocate_batch([unknown, unknown + 1], [[1], [2.5]])),
            (ValueError, lambda: bm.allocate(unknown, [1, 2], retention=[(0, 2, 101)])),
            (ValueError, lambda: bm.allocate(unknown, [1, 2], retention=[(0, 2, 50), (3, 1, 50)])),
            (ValueError, lambda: bm.allocate(unknown, [1, 2], retention=[(0, None, 50, -1.0)])),
            (TypeError, lambda: bm.allocate(unknown, [1, 2], retention=[(0, 2, 50.0)])),
            (ValueError, lambda: bm.allocate_batch([unknown, unknown + 1], [[1], [2]], retentions=[None, [(0, 1)]])),
            (ValueError, lambda: bm.set_time(bm.now - 1.0)),
            (KeyError, lambda: bm.pin(unknown)),
            (KeyError, lambda: bm.unpin(unknown)),
            (ValueError, lambda: bm.plan_disk_writes(-1)),
            (ValueError, lambda: bm.disk_record_identity(self.ndisk)),
            (ValueError, lambda: bm.prefetch([])),
            (ValueError, lambda: bm.complete_disk_writes([True] * (len(self.disk_writes) + 1))),
            (ValueError, lambda: bm.complete_disk_reads([True] * (len(self.disk_reads) + 1))),
            (ValueError, lambda: bm.cached_blocks("disk")),
        ]
        if self.seqs:
            calls += [
                (ValueError, lambda: bm.allocate(some, [1, 2])),
                (ValueError, lambda: bm.allocate_batch([unknown, some], [[1], [2]])),
                (ValueError, lambda: bm.fork(some, some)),
            ]
        if res:
            sid = r.choice(res)
            n = len(self.seqs[sid].tokens)
            calls += [
                (ValueError, lambda: bm.mark_computed([sid, sid])),
                (ValueError, lambda: bm.mark_computed([sid], [n + 1])),
                (ValueError, lambda: bm.append_tokens([sid, sid], [1, 1])),
                (ValueError, lambda: bm.slot_mapping(sid, 0, n + 1)),
                (ValueError, lambda: bm.slot_mappings([sid], [n], [n - 1])),
                (ValueError, lambda: bm.swap_in([sid])),
                (OverflowError, lambda: bm.mark_computed(sid, 2 ** 64)),
                (ValueError, lambda: bm.truncate([sid], [n + 1])),
                (ValueError, lambda: bm.truncate([sid, sid], [1, 1])),
                (ValueError, lambda: bm.append_tokens([sid], [1, 2], counts=[3])),
                (ValueError, lambda: bm.append_tokens([sid], [1], counts=[-1])),
            ]
            if len(bm.block_table(sid)) > 1:
                calls.append((ValueError, lambda: bm.block_tables([sid], max_blocks=0)))
            calls.append((ValueError, lambda: bm.block_table(sid, group=len(self.windows))))
            calls.append((ValueError, lambda: bm.reserve([sid], [n + 1])))
            if bm.num_allocated_tokens(sid) < n:  # in the middle of a chunked prefill
                calls += [(ValueError, lambda: bm.append_tokens([sid], [1])),
                          (ValueError, lambda: bm.mark_computed([sid])),
                          (ValueError, lambda: bm.slot_mapping(sid, 0, n))]
            for g in range(len(self.windows)):
                released = bm.num_released_blocks(sid, group=g)
                if released:  # the window's released blocks: no slots, no rollback into them
                    calls.append((ValueError, lambda g=g, r=released: bm.slot_mapping(sid, r * self.bs - 1, n, group=g)))
                if released * self.bs >= 2:
                    calls.append((ValueError, lambda r=released: bm.truncate([sid], [r * self.bs - 1])))
        out = [i for i, s in self.seqs.items() if s.swapped]
        if out:
            calls += [(ValueError, lambda: bm.append_tokens([out[0]], [1])),
                      (ValueError, lambda: bm.mark_computed([out[0]]))]
        exc, call = r.choice(calls)
        before = self.snapshot()
        try:
            call()
        except exc:
            pass
        else:
            self.fail(f"an invalid call did not raise {exc.__name__}")
        if self.snapshot() != before:
            self.fail("an invalid call changed the manager's state")
        self.fig.invalid_checked += 1

    def replay_events(self):
        """Mirror the cache from its events, as a router would; after a gap (dropped events) resync from
        cached_blocks() and check that the gap is what stats() counts as dropped."""
        events = self.bm.take_events()
        if not self.nhost and any(e["medium"] != "GPU" for e in events):
            self.fail("a manager without a host tier recorded an event of another medium than GPU")
        for e in events:
            if e["seq"] != self.next_event:
                dropped = self.bm.stats()["events_dropped"]
                if e["seq"] - self.next_event != dropped - self.dropped_seen:
                    self.fail(f"event seq jumped {e['seq'] - self.next_event} but {dropped - self.dropped_seen} "
                              "drops were counted")
                self.dropped_seen = dropped
                self.fig.event_resyncs += 1
                self.replayed = None  # unknown until the resync below
            self.next_event = e["seq"] + 1
            if self.replayed is None:
                continue
            replayed = self.replayed[e["medium"]]
            if e["kind"] == "stored":
                replayed.update(e["block_hashes"])
            elif e["kind"] == "removed":
                for h in e["block_hashes"]:
                    if replayed[h] <= 0:
                        self.fail(f"event {e['seq']} removes hash {h} from {e['medium']}, which no event stored")
                    replayed[h] -= 1
            else:
                for r in self.replayed.values():
                    r.clear()
        self.fig.events += len(events)
        cached = {m: Counter(h for h, _ in self.bm.cached_blocks(m)) for m in MEDIA}
        if self.replayed is None:
            self.replayed = cached
        for m in MEDIA:
            if +self.replayed[m] != cached[m]:
                self.fail(f"replaying the {m} KV events does not give cached_blocks({m!r})")

    # --- periodic full check ---------------------------------------------------------------------------------
    def full_check(self):
        self.transfer()  # no copy pending: every block is a sequence's, a pin's or free
        self.check_pins()
        if self.events:
            self.replay_events()
        self.bm.check_invariants()
        self.fig.invariant_checks += 1
        if self.pending:
            self.fig.pending_copies_across_ops += 1
        self.perform_copies()
        for sid, s in self.seqs.items():
            self.fig.kv_tokens_checked += self.check_kv(sid, s.computed)
        self.transfer()  # the probes of check_pins may have queued write-backs
        held = {b for i in self.resident() for _, table, released in self.held_tables(i) for b in table[released:]}
        held |= {b for i in self.pins for b in self.bm.pinned_blocks(i)}
        if self.bm.num_free_blocks + len(held) != self.nb:
            self.fail("blocks leaked or double counted")


MEDIA = ("GPU", "CPU", "DISK")
WEIGHTS = {"allocate": 14, "allocate_batch": 5, "compute": 22, "append": 18, "speculate": 6, "fork": 5, "free": 12,
           "swap_out": 5, "swap_in": 5, "reset": 1, "new_pool": 1, "invalid": 5, "clock": 3, "pin": 2, "unpin": 2,
           "transfer": 8, "prefetch": 4}


def run(num_ops: int, seed: int, quiet: bool = False, groups: int = 1, sliding_window: int | None = None) -> Figures:
    rng = random.Random(seed)
    fig = Figures()
    fz = Fuzzer(rng, fig, groups, sliding_window)
    names, weights = list(WEIGHTS), list(WEIGHTS.values())
    for i in range(1, num_ops + 1):
        name = rng.choices(names, weights)[0]
        getattr(fz, "op_" + name)()
        fig.ops[name] += 1
        if len(fz.seqs) > 48:  # keep pools busy but not stuck
            fz.op_free()
        if i % 1000 == 0:
            fz.full_check()
        if not quiet and i % 100_000 == 0:
            print(f"  {i:>9,} operations ok", flush=True)
    fz.full_check()
    return fig


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ops", type=int, default=1_000_000, help="number of random operations")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    parser.add_argument("--groups", type=int, default=1, help="groups of layers per pool (hybrid models)")
    parser.add_argument("--sliding-window", type=int, default=None,
                        help="window in tokens (groups alternate full / windowed); 0: a random window or full "
                             "attention per group and pool; default: full attention")
    args = parser.parse_args()
    if args.ops < 1:
        parser.error("--ops must be >= 1")
    if not 1 <= args.groups <= 64:
        parser.error("--groups must be in [1, 64]")
    if args.sliding_window is not None and args.sliding_window < 0:
        parser.error("--sliding-window must be >= 0")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2 ** 32)
    print(f"fuzzing the block manager: {args.ops:,} operations, seed {seed}, {args.groups} group(s), "
          f"sliding window {args.sliding_window}", flush=True)
    t0 = time.perf_counter()
    try:
        fig = run(args.ops, seed, groups=args.groups, sliding_window=args.sliding_window)
    except AssertionError as e:
        print(f"FAILED (seed {seed}): {e}")
        return 1
    dt = time.perf_counter() - t0
    print(f"ok: {args.ops:,} operations in {dt:.1f} s over {fig.pools} pools; "
          f"{fig.invalid_checked:,} invalid calls raised and changed nothing; "
          f"{fig.invariant_checks:,} invariant checks; {fig.kv_tokens_checked:,} computed tokens and "
          f"{fig.hit_tokens_checked:,} prefix-hit tokens held their own KV; {fig.copies:,} CoW copies "
          f"({fig.pending_copies_across_ops:,} checks found copies still pending); {fig.swapped_blocks:,} blocks swapped; "
          f"{fig.draft_tokens:,} draft tokens appended, {fig.rejected_tokens:,} rolled back; "
          f"{fig.retained_prompts:,} prompts with retention ranges; {fig.pins:,} pins ({fig.pins_refused:,} refused "
          f"by the cap), {fig.pinned_hit_tokens_checked:,} pinned prefix tokens hit with their own KV; {fig.events:,} KV events "
          f"replayed to cached_blocks() ({fig.event_resyncs:,} resyncs after a full buffer); "
          f"{fig.released_blocks_seen:,} released table entries checked; {fig.reserved_chunks:,} prefill chunks reserved; "
          f"host tier: {fig.offloads:,} offloads, {fig.loads:,} loads, {fig.failed_copies:,} failed copies, "
          f"{fig.loaded_tokens_checked:,} loaded tokens held their own KV, {fig.readmitted:,} sequences re-admitted; "
          f"disk tier: {fig.disk_writes:,} writes, "
          f"{fig.disk_reads:,} reads ({fig.prefetched_blocks:,} blocks prefetched), {fig.failed_disk_io:,} failed, "
          f"{fig.stale_headers:,} stale headers refused")
    print("operations: " + ", ".join(f"{k} {v:,}" for k, v in sorted(fig.ops.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
