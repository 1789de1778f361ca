"""A small pure-Python model of the BlockManager contract (DESIGN.md section 1), used by the stateful
test. The prefix cache is a dict keyed by the whole prefix (salt, tokens of blocks 0..i), so exactness
holds by construction; the free list is one OrderedDict per level in LRU order (level 0: no cached KV,
level 1 + p: cached KV at retention priority p); pins hold references; durations expire on set_time.
Groups of layers (hybrid models): one table per group, each with its window (None: full attention); a
windowed table releases the leading blocks no future query reads (a pad, 0, stays in their place), and
the prefix cache keys each group's blocks apart."""
import math
from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_PRIORITY = 35
FOREVER = math.inf
TO_THE_END = 2 ** 63 - 1


PAD = 0


@dataclass
class Seq:
    tokens: list
    tables: list                  # one block table per group; [0, released[g]) hold PAD
    salt: bytes
    computed: int = 0
    registered: list = None       # per group
    released: list = None         # per group
    swapped: bool = False
    prompt_len: int = 0
    retention: list = field(default_factory=list)  # (start, end, priority, duration)

    def __post_init__(self):
        n = len(self.tables)
        self.registered = self.registered or [0] * n
        self.released = self.released or [0] * n

    @property
    def table(self):
        return self.tables[0]

    def held(self, g):
        return self.tables[g][self.released[g]:]


class FreeLists:
    """The free list: one LRU list per level; pop takes the oldest block of the lowest non-empty level."""

    def __init__(self, blocks=()):
        self.levels = {0: OrderedDict((b, None) for b in blocks)}
        self.where = {b: 0 for b in blocks}

    def __len__(self):
        return len(self.where)

    def __contains__(self, b):
        return b in self.where

    def push(self, b, level, front=False):
        q = self.levels.setdefault(level, OrderedDict())
        q[b] = None
        if front:
            q.move_to_end(b, last=False)
        self.where[b] = level

    def remove(self, b):
        del self.levels[self.where.pop(b)][b]

    def pop(self):
        level = min(lv for lv, q in self.levels.items() if q)
        b, _ = self.levels[level].popitem(last=False)
        del self.where[b]
        return b

    def order(self):
        return [b for lv in sorted(self.levels) for b in self.levels[lv]]


@dataclass
class Model:
    num_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
    default_priority: int = DEFAULT_PRIORITY
    decode_priority: int = DEFAULT_PRIORITY
    max_pinned_fraction: float = 0.5
    windows: tuple = (None,)
    free: FreeLists = None
    cpu_free: OrderedDict = field(default_factory=OrderedDict)
    ref: dict = field(default_factory=dict)
    cpu_ref: dict = field(default_factory=dict)
    tag: dict = field(default_factory=dict)       # block -> prefix key it was registered with
    registry: dict = field(default_factory=dict)  # prefix key -> block (latest registration wins)
    seqs: dict = field(default_factory=dict)
    copies: list = field(default_factory=list)
    evictions: int = 0
    now: float = 0.0
    retention: dict = field(default_factory=dict)  # block -> (priority, duration)
    expiry: dict = field(default_factory=dict)     # free cached block -> (time, order) it falls back at
    expiry_order: int = 0
    pins: dict = field(default_factory=dict)       # seq id -> blocks its pin holds
    pin_count: dict = field(default_factory=dict)

    def __post_init__(self):
        self.free = FreeLists(range(self.num_blocks))
        self.cpu_free = OrderedDict((b, None) for b in range(self.num_cpu_blocks))
        self.ref = {b: 0 for b in range(self.num_blocks)}
        self.cpu_ref = {b: 0 for b in range(self.num_cpu_blocks)}
        self.retention = {b: (self.default_priority, FOREVER) for b in range(self.num_blocks)}
        self.pin_count = {b: 0 for b in range(self.num_blocks)}
        self.max_pinned = int(self.max_pinned_fraction * self.num_blocks)

    def key(self, tokens, salt, i, g=0):
        return (g, salt, tuple(tokens[: (i + 1) * self.block_size]))

    def nblocks(self, n):
        return -(-n // self.block_size)

    def released_for(self, g, computed):
        w = self.windows[g]
        return 0 if w is None or computed < w else (computed - w + 1) // self.block_size

    def blocks_held(self, n, computed=0):
        return sum(self.nblocks(n) - self.released_for(g, computed) for g in range(len(self.windows)))

    def match(self, tokens, salt):
        """(k, held): the longest k leading blocks every group serves, and each group's cached blocks
        [released_for(g, k * bs), k) (windows >= 2: the chain then reaches block k - 1)."""
        for k in range(self.nblocks(len(tokens)) - 1, -1, -1):
            held = []
            for g in range(len(self.windows)):
                blocks = [self.registry.get(self.key(tokens, salt, i, g))
                          for i in range(self.released_for(g, k * self.block_size), k)]
                if None in blocks:
                    break
                held.append(blocks)
            else:
                return k, held

    # --- retention -------------------------------------------------------------------------------
    def retention_of(self, s, i):
        """A block takes the strongest (priority, then duration) of the ranges overlapping it."""
        first, last = i * self.block_size, (i + 1) * self.block_size
        overlapping = [(p, d) for start, end, p, d in s.retention if max(start, first) < min(end, last)]
        if overlapping:
            return max(overlapping)
        return (self.default_priority if first < s.prompt_len else self.decode_priority, FOREVER)

    def keep_stronger(self, b, r):
        self.retention[b] = max(self.retention[b], r)

    def cached(self, b):
        k = self.tag.get(b)
        return k is not None and self.registry.get(k) == b

    def unfree(self, b):
        self.free.remove(b)
        self.expiry.pop(b, None)

    def relevel(self, b, level):
        self.unfree(b)
        self.free.push(b, level)

    def set_time(self, now):
        assert now >= self.now
        self.now = now
        for b in sorted((b for b, e in self.expiry.items() if e[0] <= now), key=self.expiry.get):
            self.retention[b] = (self.default_priority, FOREVER)
            self.relevel(b, 1 + self.default_priority)

    def pinned_blocks(self):
        return sum(c > 0 for c in self.pin_count.values())

    def pin(self, sid):
        """Returns the blocks pinned, or None when the cap refuses the pin (nothing changes)."""
        s = self.seqs[sid]
        blocks = [b for g, t in enumerate(s.tables) for b in t[s.released[g]:s.registered[g]] if self.cached(b)]
        old = self.pins.get(sid, [])
        after = {b for b, c in self.pin_count.items() if c > 0 and not (c == 1 and b in old)} | set(blocks)
        if len(after) > self.max_pinned:
            return None
        for b in blocks:
            self.ref[b] += 1
            self.pin_count[b] += 1
        self.pins[sid] = blocks
        self.drop_pin(old)
        return blocks

    def drop_pin(self, blocks):
        for b in reversed(blocks):
            self.pin_count[b] -= 1
            self.release(b)

    def unpin(self, sid):
        self.drop_pin(self.pins.pop(sid))

    def alloc_status(self, tokens, salt=b"", watermark_blocks=0):
        """"OK" | "LATER" | "NEVER", as can_allocate answers."""
        if self.blocks_held(len(tokens)) > self.num_blocks - watermark_blocks:
            return "NEVER"
        k, held = self.match(tokens, salt)
        need = self.blocks_held(len(tokens), k * self.block_size)
        pinned_hits = sum(self.pin_count[b] > 0 for h in held for b in h)
        if need - pinned_hits > self.num_blocks - watermark_blocks - self.pinned_blocks():
            return "NEVER"
        return "OK" if len(self.free) - self.free_blocks_needed(tokens, salt) >= watermark_blocks else "LATER"

    def swap_in_status(self, sids):
        need = self.distinct_blocks(sids)
        if need > self.num_blocks - self.pinned_blocks():
            return "NEVER"
        return "OK" if need <= len(self.free) else "LATER"

    def reset(self):
        self.registry.clear()
        self.tag.clear()
        for q in self.seqs.values():
            q.registered = [0] * len(q.tables)
        for sid in sorted(self.pins):
            self.drop_pin(self.pins[sid])
        self.pins.clear()
        for b in self.free.order():
            self.retention[b] = (self.default_priority, FOREVER)
            if self.free.where[b] != 0:
                self.relevel(b, 0)
        self.expiry.clear()

    # --- pool -----------------------------------------------------------------------------------
    def take(self):
        b = self.free.pop()
        self.expiry.pop(b, None)
        k = self.tag.pop(b, None)
        if k is not None and self.registry.get(k) == b:
            del self.registry[k]
            self.evictions += 1
        self.ref[b] = 1
        return b

    def to_free_list(self, b):
        if not self.cached(b):
            self.free.push(b, 0, front=True)
            return
        p, d = self.retention[b]
        if d != FOREVER:
            if self.now + d > self.now:
                self.expiry[b] = (self.now + d, self.expiry_order)
                self.expiry_order += 1
            else:
                p, d = self.retention[b] = (self.default_priority, FOREVER)
        self.free.push(b, 1 + p)

    def is_copy_source(self, b):
        return any(src == b for src, _ in self.copies)

    def release(self, b):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            moot = [src for src, dst in self.copies if dst == b]  # its destination is free: drop the copy
            self.copies = [(src, dst) for src, dst in self.copies if dst != b]
            for src in moot:
                if self.ref[src] == 0 and not self.is_copy_source(src) and src not in self.free:
                    self.to_free_list(src)
            if not self.is_copy_source(b):  # else held until the copy is taken
                self.to_free_list(b)

    def take_copies(self):
        copies, self.copies = self.copies, []
        for src, _ in copies:
            if self.ref[src] == 0 and src not in self.free:
                self.to_free_list(src)
        return copies

    def take_cpu(self):
        b, _ = self.cpu_free.popitem(last=False)
        self.cpu_ref[b] = 1
        return b

    def release_cpu(self, b):
        self.cpu_ref[b] -= 1
        if self.cpu_ref[b] == 0:
            self.cpu_free[b] = None

    # --- API ------------------------------------------------------------------------------------
    def allocate(self, sid, tokens, salt=b"", retention=()):
        k, held = self.match(tokens, salt)
        n = self.nblocks(len(tokens))
        s = Seq(list(tokens), [[] for _ in self.windows], salt, prompt_len=len(tokens), retention=list(retention))
        s.computed = k * self.block_size
        for g, t in enumerate(s.tables):
            s.released[g], s.registered[g] = self.released_for(g, s.computed), k
            t += [PAD] * s.released[g]
            for b in held[g]:
                if self.ref[b] == 0 and b in self.free:
                    self.unfree(b)
                self.ref[b] += 1
                self.keep_stronger(b, self.retention_of(s, len(t)))
                t.append(b)
        for t in s.tables:  # after every group's hits: a fresh block never evicts one
            while len(t) < n:
                b = self.take()
                self.retention[b] = self.retention_of(s, len(t))
                t.append(b)
        self.seqs[sid] = s
        return s.computed

    def free_blocks_needed(self, tokens, salt=b""):
        k, held = self.match(tokens, salt)
        n = self.nblocks(len(tokens))
        return sum(n - k + sum(self.ref[b] == 0 for b in h) for h in held)

    def mark_computed(self, sid, n=None):
        s = self.seqs[sid]
        s.computed = len(s.tokens) if n is None else n
        for g, t in enumerate(s.tables):
            for i in range(max(s.registered[g], s.released[g]), s.computed // self.block_size):
                b, k = t[i], self.key(s.tokens, s.salt, i, g)
                old = self.tag.get(b)
                if old is not None and old != k and self.registry.get(old) == b:
                    del self.registry[old]
                previous = self.registry.get(k)
                self.tag[b] = k
                if previous is None or self.pin_count[previous] == 0:  # a pinned registration keeps hitting
                    self.registry[k] = b
                if previous is not None and previous != b and previous in self.free:
                    self.relevel(previous, 0)  # superseded: no longer a hit
                s.registered[g] = i + 1
        for g, t in enumerate(s.tables):  # then the windows let go of what no future query reads
            while s.released[g] < self.released_for(g, s.computed):
                self.release(t[s.released[g]])
                t[s.released[g]] = PAD
                s.released[g] += 1

    def must_copy(self, b):
        return self.ref[b] > 1 or b in self.tag  # shared, or cached KV left partial by truncate

    def append_need(self, sids, counts=None, extra=0):
        need, shared = 0, {}
        for i, sid in enumerate(sids):
            s = self.seqs[sid]
            c = (1 if counts is None else counts[i]) + extra
            if c <= 0:
                continue
            need += (self.nblocks(len(s.tokens) + c) - self.nblocks(len(s.tokens))) * len(s.tables)
            if len(s.tokens) % self.block_size == 0:
                continue
            for t in s.tables:
                if t[-1] in self.tag:
                    need += 1
                elif self.ref[t[-1]] > 1:
                    shared[t[-1]] = shared.get(t[-1], 0) + 1
        return need + sum(k if k < self.ref[b] else k - 1 for b, k in shared.items())

    def append(self, sid, tok):
        return self.append_many(sid, [tok])[0]

    def append_many(self, sid, toks):
        s, n = self.seqs[sid], len(self.seqs[sid].tokens)
        for t in s.tables:
            for pos in range(n, n + len(toks)):
                if pos % self.block_size == 0:
                    b = self.take()
                    self.retention[b] = self.retention_of(s, len(t))
                    t.append(b)
                elif pos == n and self.must_copy(t[-1]):
                    new = self.take()
                    self.retention[new] = self.retention_of(s, len(t) - 1)
                    pending = [src for src, dst in self.copies if dst == t[-1]]
                    self.copies.append((pending[0] if pending else t[-1], new))
                    self.release(t[-1])
                    t[-1] = new
        s.tokens += toks
        return [s.table[p // self.block_size] * self.block_size + p % self.block_size for p in range(n, len(s.tokens))]

    def can_truncate(self, sid, n):
        s = self.seqs[sid]
        return all(self.released_for(g, min(s.computed, n)) >= s.released[g] for g in range(len(s.tables)))

    def truncate(self, sid, n):
        s = self.seqs[sid]
        for g, t in enumerate(s.tables):
            while len(t) > self.nblocks(n):
                self.release(t.pop())
            s.registered[g] = min(s.registered[g], n // self.block_size)
        del s.tokens[n:]
        s.computed = min(s.computed, n)

    def free_seq(self, sid):
        s = self.seqs.pop(sid)
        for g in range(len(s.tables)):
            for b in reversed(s.held(g)):
                (self.release_cpu if s.swapped else self.release)(b)

    def fork(self, parent, child):
        p = self.seqs[parent]
        self.seqs[child] = Seq(list(p.tokens), [list(t) for t in p.tables], p.salt, p.computed, list(p.registered),
                               list(p.released), prompt_len=p.prompt_len, retention=list(p.retention))
        for g in range(len(p.tables)):
            for b in p.held(g):
                self.ref[b] += 1

    def move(self, sids, to_cpu):
        take, dst_ref = (self.take_cpu, self.cpu_ref) if to_cpu else (self.take, self.ref)
        release = self.release if to_cpu else self.release_cpu
        mapping, m = [], {}
        copy_source = {dst: src for src, dst in self.copies} if to_cpu else {}  # not yet copied
        for sid in sids:
            s = self.seqs[sid]
            for g, t in enumerate(s.tables):
                new = [PAD] * s.released[g]
                for i in range(s.released[g], len(t)):
                    b = t[i]
                    if b not in m:
                        m[b] = take()
                        mapping.append((copy_source.get(b, b), m[b]))
                        if not to_cpu:
                            self.retention[m[b]] = self.retention_of(s, i)
                    else:
                        dst_ref[m[b]] += 1
                        if not to_cpu:
                            self.keep_stronger(m[b], self.retention_of(s, i))
                    new.append(m[b])
                for b in reversed(s.held(g)):
                    release(b)
                s.tables[g] = new
            s.swapped, s.registered = to_cpu, [0] * len(s.tables)
        return mapping

    def swap_out(self, sids):
        return self.move(sids, to_cpu=True)

    def swap_in(self, sids):
        return self.move(sids, to_cpu=False)

    def distinct_blocks(self, sids):
        return len({b for sid in sids for g in range(len(self.seqs[sid].tables)) for b in self.seqs[sid].held(g)})
