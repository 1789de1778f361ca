"""A small pure-Python model of the BlockManager contract (DESIGN.md section 1), used by the stateful
test. The prefix cache is a dict keyed by the whole prefix (salt, tokens of blocks 0..i), so exactness
holds by construction; the free list is one OrderedDict per level in LRU order (level 0: no cached KV,
level 1 + p: cached KV at retention priority p); pins hold references; durations expire on set_time.
Groups of layers (hybrid models): one table per group, each with its window (None: full attention); a
windowed table releases the leading blocks no future query reads (a pad, 0, stays in their place), and
the prefix cache keys each group's blocks apart. The host tier (every group) is a second pool of the same
kind keyed by the same prefixes: offloads hold their device block and host slot until completed, loads
hold theirs, and a failed load truncates its sequence's computed prefix to its first failed block when
every window there is held (device hits after it replaced by fresh blocks), else sends the sequence back
to admission (its failed host entries dropped). The disk tier
is a third pool of the same kind below the host tier: writes hold their host slot and record, reads
(prefetch) hold their record and a host slot, and a dirty host entry about to be evicted is written first
while another host slot stays free."""
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
    loading: int = 0              # loads not yet completed
    serial: int = 0
    failed_at: int = None         # the first block index a load failed at, while loading
    readmit: bool = False         # a failed load left no safe point: freed and admitted again

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
    num_host_blocks: int = 0
    host_min_priority: int = 0
    num_disk_blocks: int = 0

    def __post_init__(self):
        self.free = FreeLists(range(self.num_blocks))
        self.cpu_free = OrderedDict((b, None) for b in range(self.num_cpu_blocks))
        self.ref = {b: 0 for b in range(self.num_blocks)}
        self.cpu_ref = {b: 0 for b in range(self.num_cpu_blocks)}
        self.retention = {b: (self.default_priority, FOREVER) for b in range(self.num_blocks)}
        self.pin_count = {b: 0 for b in range(self.num_blocks)}
        self.max_pinned = int(self.max_pinned_fraction * self.num_blocks)
        self.tier = self.num_host_blocks > 0
        self.host_free = FreeLists(range(self.num_host_blocks))
        self.host_ref = {s: 0 for s in range(self.num_host_blocks)}
        self.host_tag = {}        # slot -> prefix key
        self.host_registry = {}   # prefix key -> slot
        self.host_retention = {s: (self.default_priority, FOREVER) for s in range(self.num_host_blocks)}
        self.host_expiry = {}
        self.offloading = set()   # keys with a pending offload
        self.offloads, self.offloads_taken = [], []  # (block, slot, key, epoch)
        self.loads, self.loads_taken = [], []        # (slot, block, serial, group, index)
        self.epoch = 0
        self.next_serial = 1
        self.spare = 0            # free blocks write-backs may hold during the current call
        self.host_evictions = 0
        self.disk = self.tier and self.num_disk_blocks > 0
        self.disk_free = FreeLists(range(self.num_disk_blocks))
        self.disk_ref = {r: 0 for r in range(self.num_disk_blocks)}
        self.disk_tag = {}        # record -> prefix key
        self.disk_registry = {}   # prefix key -> record
        self.disk_retention = {r: (self.default_priority, FOREVER) for r in range(self.num_disk_blocks)}
        self.disk_expiry = {}
        self.disk_writing, self.disk_reading = set(), set()  # keys with a pending write / read
        self.writes, self.writes_taken = [], []  # (slot, record, key, epoch)
        self.reads, self.reads_taken = [], []    # (record, slot, key, epoch)
        self.disk_evictions = 0

    def key(self, tokens, salt, i, g=0):
        return (g, salt, tuple(tokens[: (i + 1) * self.block_size]))

    def nblocks(self, n):
        return -(-n // self.block_size)

    def released_for(self, g, computed):
        w = self.windows[g]
        return 0 if w is None or computed < w else (computed - w + 1) // self.block_size

    def blocks_held(self, n, computed=0):
        return sum(self.nblocks(n) - self.released_for(g, computed) for g in range(len(self.windows)))

    def max_held(self, n, chunk=None):
        """The most blocks a prompt of n tokens holds: whole, or prefilled in chunks of `chunk` tokens."""
        if chunk is None:
            return self.blocks_held(n)
        bs = self.block_size
        return sum(self.nblocks(n) if w is None else min(self.nblocks(n), (w + bs - 2) // bs + 1 + self.nblocks(chunk))
                   for w in self.windows)

    def allocated(self, sid):
        s = self.seqs[sid]
        return min(len(s.tokens), len(s.tables[0]) * self.block_size)

    def first_chunk(self, tokens, k, chunk):
        return len(tokens) if chunk is None else min(len(tokens), k * self.block_size + chunk)

    def match(self, tokens, salt):
        """(k, held): the longest k leading blocks every group serves, and each group's cached blocks
        [released_for(g, k * bs), k) (windows >= 2: the chain then reaches block k - 1). With the host
        tier a held entry may be ("host", slot): a full group's loaded hits are the tail of its hit, a
        windowed group takes the device's blocks and loads the others."""
        full = {}
        limit = self.nblocks(len(tokens)) - 1
        for g, w in enumerate(self.windows):
            if w is not None or not self.tier:
                continue
            chain, on_host = [], False
            for i in range(limit):
                key = self.key(tokens, salt, i, g)
                on_host = on_host or key not in self.registry
                if on_host and key not in self.host_registry:
                    break
                chain.append(("host", self.host_registry[key]) if on_host else self.registry[key])
            full[g] = chain
            limit = min(limit, len(chain))

        def entry(g, i):
            if g in full:
                return full[g][i]
            key = self.key(tokens, salt, i, g)
            if key in self.registry:
                return self.registry[key]
            return ("host", self.host_registry[key]) if self.tier and key in self.host_registry else None

        for k in range(limit, -1, -1):
            held = []
            for g in range(len(self.windows)):
                blocks = [entry(g, i) for i in range(self.released_for(g, k * self.block_size), k)]
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
        for s in sorted((s for s, e in self.host_expiry.items() if e[0] <= now), key=self.host_expiry.get):
            self.host_retention[s] = (self.default_priority, FOREVER)
            del self.host_expiry[s]
            self.host_free.remove(s)
            self.host_free.push(s, 1 + self.default_priority)
        for r in sorted((r for r, e in self.disk_expiry.items() if e[0] <= now), key=self.disk_expiry.get):
            self.disk_retention[r] = (self.default_priority, FOREVER)
            del self.disk_expiry[r]
            self.disk_free.remove(r)
            self.disk_free.push(r, 1 + self.default_priority)

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

    def alloc_status(self, tokens, salt=b"", watermark_blocks=0, chunk=None):
        """"OK" | "LATER" | "NEVER", as can_allocate answers."""
        if self.max_held(len(tokens), chunk) > self.num_blocks - watermark_blocks:
            return "NEVER"
        k, held = self.match(tokens, salt)
        need = self.blocks_held(self.first_chunk(tokens, k, chunk), k * self.block_size)
        pinned_hits = sum(self.pin_count[b] > 0 for h in held for b in h if isinstance(b, int))
        if need - pinned_hits > self.num_blocks - watermark_blocks - self.pinned_blocks():
            return "NEVER"
        return "OK" if len(self.free) - self.free_blocks_needed(tokens, salt, chunk) >= watermark_blocks else "LATER"

    def swap_in_status(self, sids):
        need = self.distinct_blocks(sids)
        if need > self.num_blocks - self.pinned_blocks():
            return "NEVER"
        return "OK" if need <= len(self.free) else "LATER"

    def reset(self):
        self.epoch += 1  # offloads, writes and reads in flight enter nothing; those not taken are dropped
        for slot, record, _, _ in self.writes:
            self.disk_release(record)
            self.host_release(slot, cold=True)
        for record, slot, _, _ in self.reads:
            self.host_release(slot)
            self.disk_release(record)
        self.writes, self.reads = [], []
        self.disk_writing.clear()
        self.disk_reading.clear()
        self.disk_registry.clear()
        self.disk_tag.clear()
        for record in self.disk_free.order():
            self.disk_retention[record] = (self.default_priority, FOREVER)
            if self.disk_free.where[record] != 0:
                self.disk_free.remove(record)
                self.disk_free.push(record, 0)
        self.disk_expiry.clear()
        for b, slot, _, _ in self.offloads:
            self.host_release(slot)
            self.release(b, cold=True)
        self.offloads = []
        self.offloading.clear()
        self.host_registry.clear()
        self.host_tag.clear()
        for slot in self.host_free.order():
            self.host_retention[slot] = (self.default_priority, FOREVER)
            if self.host_free.where[slot] != 0:
                self.host_free.remove(slot)
                self.host_free.push(slot, 0)
        self.host_expiry.clear()
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
        while self.spare > 0 and self.cached(self.free.order()[0]) and self.write_back(self.free.order()[0]):
            self.spare -= 1
        b = self.free.pop()
        self.expiry.pop(b, None)
        k = self.tag.pop(b, None)
        if k is not None and self.registry.get(k) == b:
            del self.registry[k]
            self.evictions += 1
        self.ref[b] = 1
        return b

    def to_free_list(self, b, cold=False):
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
        self.free.push(b, 1 + p, front=cold)

    def is_copy_source(self, b):
        return any(src == b for src, _ in self.copies)

    def release(self, b, cold=False):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            moot = [src for src, dst in self.copies if dst == b]  # its destination is free: drop the copy
            self.copies = [(src, dst) for src, dst in self.copies if dst != b]
            for src in moot:
                if self.ref[src] == 0 and not self.is_copy_source(src) and src not in self.free:
                    self.to_free_list(src)
            if not self.is_copy_source(b):  # else held until the copy is taken
                self.to_free_list(b, cold)

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

    # --- host tier --------------------------------------------------------------------------------
    def host_cached(self, s):
        k = self.host_tag.get(s)
        return k is not None and self.host_registry.get(k) == s

    def host_take(self, r):
        s = self.host_free.pop()
        self.host_expiry.pop(s, None)
        k = self.host_tag.pop(s, None)
        if k is not None and self.host_registry.get(k) == s:
            del self.host_registry[k]
            self.host_evictions += 1
        self.host_ref[s] = 1
        self.host_retention[s] = r
        return s

    def host_acquire(self, s):
        if self.host_ref[s] == 0 and s in self.host_free:
            self.host_free.remove(s)
            self.host_expiry.pop(s, None)
        self.host_ref[s] += 1

    def host_release(self, s, cold=False):
        self.host_ref[s] -= 1
        if self.host_ref[s]:
            return
        if not self.host_cached(s):
            self.host_free.push(s, 0, front=True)
            return
        p, d = self.host_retention[s]
        if d != FOREVER:
            if self.now + d > self.now:
                self.host_expiry[s] = (self.now + d, self.expiry_order)
                self.expiry_order += 1
            else:
                p, d = self.host_retention[s] = (self.default_priority, FOREVER)
        self.host_free.push(s, 1 + p, front=cold)

    def take_slot(self, r):
        """A host slot for KV of retention r, after writing the dirty entries ahead of it to disk while
        another slot stays free; None when none can be taken without evicting a stronger entry."""
        while (self.disk and len(self.host_free) > 1 and self.can_take_slot(r[0])
               and self.host_cached(self.host_free.order()[0]) and self.disk_write_back(self.host_free.order()[0])):
            pass
        return self.host_take(r) if self.can_take_slot(r[0]) else None

    def dirty(self, b):
        k = self.tag.get(b)
        return (self.cached(b) and k not in self.host_registry and k not in self.offloading
                and k not in self.disk_reading and self.retention[b][0] >= self.host_min_priority)

    def can_take_slot(self, p):
        if not len(self.host_free):
            return False
        front = self.host_free.order()[0]
        return not self.host_cached(front) or self.host_retention[front][0] <= p

    def queue_offload(self, b, slot):
        if b in self.free:
            self.unfree(b)
        self.ref[b] += 1
        self.offloading.add(self.tag[b])
        self.offloads.append((b, slot, self.tag[b], self.epoch))

    def write_back(self, b):
        if not self.tier or not self.dirty(b) or not self.can_take_slot(self.retention[b][0]):
            return False
        slot = self.take_slot(self.retention[b])
        if slot is None:
            return False
        self.queue_offload(b, slot)
        return True

    def allow_write_backs(self, needed, watermark_blocks=0):
        self.spare = max(0, len(self.free) - needed - watermark_blocks) if self.tier else 0

    def plan_offloads(self, n):
        if not self.tier or n <= 0:
            return 0
        picked = [b for b in [b for b in self.free.order() if self.free.where[b] > 0][:n] if self.dirty(b)]
        queued = 0
        for b in picked:
            slot = self.take_slot(self.retention[b])
            if slot is None:
                break
            self.queue_offload(b, slot)
            queued += 1
        return queued

    def take_offloads(self):
        self.offloads_taken += self.offloads
        out, self.offloads = [(b, s) for b, s, _, _ in self.offloads], []
        return out

    def complete_offloads(self, ok):
        done, self.offloads_taken = self.offloads_taken, []
        for (b, slot, k, epoch), good in zip(done, ok):
            current = epoch == self.epoch
            if good and current:
                self.host_tag[slot] = k
                self.host_registry[k] = slot
            if current:
                self.offloading.discard(k)
            self.host_release(slot)
            self.release(b, cold=True)

    def take_loads(self):
        self.loads_taken += self.loads
        out, self.loads = [(s, b) for s, b, _, _, _ in self.loads], []
        return out

    def complete_loads(self, ok):
        """Returns the ids of the sequences that must be freed and admitted again."""
        done, self.loads_taken = self.loads_taken, []
        by_serial = {q.serial: (sid, q) for sid, q in self.seqs.items() if q.loading}
        finished = []
        for (slot, b, serial, g, i), good in zip(done, ok):
            self.host_release(slot)
            self.release(b)
            if serial not in by_serial:
                continue
            sid, q = by_serial[serial]
            if not good:
                q.failed_at = i if q.failed_at is None else min(q.failed_at, i)
            q.loading -= 1
            if q.loading == 0:
                finished.append(sid)
        readmit = []
        for sid in finished:
            q = self.seqs[sid]
            if q.failed_at is not None:
                self.recover(q)
            if q.readmit:
                for (slot, _, serial, _, _), good in zip(done, ok):
                    if not good and serial == q.serial:
                        self.host_drop(slot)
                readmit.append(sid)
                continue
            self.mark_computed(sid, q.computed)
        return readmit

    def recover(self, q):
        """After a failed load: recompute from the first failed block when every window there is the one
        the table holds (registered blocks after it replaced by fresh ones), else re-admission."""
        bs = self.block_size
        j = min(q.failed_at, q.computed // bs)
        q.failed_at = None
        safe = all(self.released_for(g, j * bs) == q.released[g] for g in range(len(q.tables)))
        hits = [(g, i) for g, t in enumerate(q.tables) for i in range(max(j, q.released[g]), len(t))
                if t[i] in self.tag or self.ref[t[i]] > 1]  # registered or shared: device hits
        freed = sum(1 for g, i in hits if self.ref[q.tables[g][i]] == 1 and not self.is_copy_source(q.tables[g][i]))
        if not safe or len(hits) > len(self.free) + freed:
            q.readmit, q.computed = True, 0
            q.registered = [0] * len(q.tables)
            return
        for g, t in enumerate(q.tables):
            mine = [i for h, i in hits if h == g]
            for i in mine:
                self.release(t[i])
            for i in mine:
                b = t[i] = self.take()
                self.retention[b] = self.retention_of(q, i)
            q.registered[g] = min(q.registered[g], j)
        q.computed = min(q.computed, j * bs)

    def host_drop(self, s):
        """The slot's entry leaves the host tier (a failed load's, when its sequence is re-admitted)."""
        k = self.host_tag.get(s)
        if k is None:
            return
        self.host_acquire(s)
        if self.host_registry.get(k) == s:
            del self.host_registry[k]
        del self.host_tag[s]
        self.host_release(s)

    # --- disk tier --------------------------------------------------------------------------------
    def disk_cached(self, r):
        k = self.disk_tag.get(r)
        return k is not None and self.disk_registry.get(k) == r

    def disk_take(self, ret):
        r = self.disk_free.pop()
        self.disk_expiry.pop(r, None)
        k = self.disk_tag.pop(r, None)
        if k is not None and self.disk_registry.get(k) == r:
            del self.disk_registry[k]
            self.disk_evictions += 1
        self.disk_ref[r] = 1
        self.disk_retention[r] = ret
        return r

    def disk_acquire(self, r):
        if self.disk_ref[r] == 0 and r in self.disk_free:
            self.disk_free.remove(r)
            self.disk_expiry.pop(r, None)
        self.disk_ref[r] += 1

    def disk_release(self, r):
        self.disk_ref[r] -= 1
        if self.disk_ref[r]:
            return
        if not self.disk_cached(r):
            self.disk_free.push(r, 0, front=True)
            return
        p, d = self.disk_retention[r]
        if d != FOREVER:
            if self.now + d > self.now:
                self.disk_expiry[r] = (self.now + d, self.expiry_order)
                self.expiry_order += 1
            else:
                p, d = self.disk_retention[r] = (self.default_priority, FOREVER)
        self.disk_free.push(r, 1 + p)

    def disk_dirty(self, s):
        k = self.host_tag.get(s)
        return self.host_cached(s) and k not in self.disk_registry and k not in self.disk_writing

    def can_take_record(self, p):
        if not len(self.disk_free):
            return False
        front = self.disk_free.order()[0]
        return not self.disk_cached(front) or self.disk_retention[front][0] <= p

    def queue_write(self, s):
        record = self.disk_take(self.host_retention[s])
        self.host_acquire(s)
        self.disk_writing.add(self.host_tag[s])
        self.writes.append((s, record, self.host_tag[s], self.epoch))

    def disk_write_back(self, s):
        if not self.disk or not self.disk_dirty(s) or not self.can_take_record(self.host_retention[s][0]):
            return False
        self.queue_write(s)
        return True

    def plan_disk_writes(self, n):
        if not self.disk or n <= 0:
            return 0
        cached = [s for s in self.host_free.order() if self.host_free.where[s] > 0][:n]
        queued = 0
        for s in [s for s in cached if self.disk_dirty(s)]:
            if not self.can_take_record(self.host_retention[s][0]):
                break
            self.queue_write(s)
            queued += 1
        return queued

    def take_disk_writes(self):
        self.writes_taken += self.writes
        out, self.writes = [(s, r) for s, r, _, _ in self.writes], []
        return out

    def complete_disk_writes(self, ok):
        done, self.writes_taken = self.writes_taken, []
        for (slot, record, k, epoch), good in zip(done, ok):
            current = epoch == self.epoch
            if good and current:
                self.disk_tag[record] = k
                self.disk_registry[k] = record
            if current:
                self.disk_writing.discard(k)
            self.disk_release(record)
            self.host_release(slot, cold=True)

    def tier_walk(self, tokens, salt):
        """(hit, keys): per group, the keys the longest extension of the hit needs (a windowed group: those
        its window reads) once the disk tier's reads are done; a full group's extension stops at the first
        block no tier holds (or is reading). Returns (hit, reach, keys per group)."""
        bs = self.block_size
        hit = self.match(tokens, salt)[0]

        def somewhere(key):
            return (key in self.registry or key in self.host_registry or key in self.disk_registry
                    or key in self.disk_reading)

        limit = self.nblocks(len(tokens)) - 1
        for g, w in enumerate(self.windows):
            if w is None:
                n = 0
                while n < limit and (n < hit or somewhere(self.key(tokens, salt, n, g))):
                    n += 1
                limit = n
        reach = max(limit, hit)
        while reach > hit and not all(somewhere(self.key(tokens, salt, i, g)) for g in range(len(self.windows))
                                      for i in range(self.released_for(g, reach * bs), reach)):
            reach -= 1
        keys = [[self.key(tokens, salt, i, g) for i in range(min(self.released_for(g, reach * bs), reach), reach)]
                for g in range(len(self.windows))]
        return hit, reach, keys

    def lookup(self, tokens, salt=b""):
        k, held = self.match(tokens, salt)
        first = min([self.released_for(g, k * self.block_size) + j for g, h in enumerate(held)
                     for j, b in enumerate(h) if not isinstance(b, int)], default=k) if self.tier else k
        disk = 0
        if self.disk:
            hit, reach, _ = self.tier_walk(tokens, salt)
            disk = reach - hit
        return first, k - first, disk

    def prefetch(self, tokens, salt=b""):
        if not self.disk:
            return 0
        hit, reach, keys = self.tier_walk(tokens, salt)
        held = [self.host_registry[k] for group in keys for k in group if k in self.host_registry]
        for s in held:
            self.host_acquire(s)
        queued = 0
        for k in [k for group in keys for k in group]:
            if k in self.registry or k in self.host_registry or k in self.disk_reading:
                continue
            if k not in self.disk_registry:
                break
            record = self.disk_registry[k]
            self.disk_acquire(record)
            slot = self.take_slot(self.disk_retention[record])
            if slot is None:
                self.disk_release(record)
                break
            self.disk_reading.add(k)
            self.reads.append((record, slot, k, self.epoch))
            queued += 1
        for s in held:
            self.host_release(s)
        return queued

    def take_disk_reads(self):
        self.reads_taken += self.reads
        out, self.reads = [(r, s) for r, s, _, _ in self.reads], []
        return out

    def complete_disk_reads(self, ok):
        done, self.reads_taken = self.reads_taken, []
        for (record, slot, k, epoch), good in zip(done, ok):
            if epoch == self.epoch:
                self.disk_reading.discard(k)
                if good and k not in self.host_registry:
                    self.host_tag[slot] = k
                    self.host_registry[k] = slot
                elif not good and self.disk_tag.get(record) == k:
                    if self.disk_registry.get(k) == record:
                        del self.disk_registry[k]
                    del self.disk_tag[record]
            self.host_release(slot)
            self.disk_release(record)

    # --- API ------------------------------------------------------------------------------------
    def allocate(self, sid, tokens, salt=b"", retention=(), chunk=None):
        k, held = self.match(tokens, salt)
        n = self.nblocks(self.first_chunk(tokens, k, chunk))
        s = Seq(list(tokens), [[] for _ in self.windows], salt, prompt_len=len(tokens), retention=list(retention))
        s.computed = k * self.block_size
        s.serial, self.next_serial = self.next_serial, self.next_serial + 1
        for g, t in enumerate(s.tables):
            s.released[g], s.registered[g] = self.released_for(g, s.computed), k
            t += [PAD] * s.released[g]
            for b in held[g]:
                if not isinstance(b, int):  # a host hit: its slot is held, a fresh block comes later
                    self.host_acquire(b[1])
                    s.registered[g] = min(s.registered[g], len(t))
                    t.append(b)
                    continue
                if self.ref[b] == 0 and b in self.free:
                    self.unfree(b)
                self.ref[b] += 1
                self.keep_stronger(b, self.retention_of(s, len(t)))
                t.append(b)
        hosted = [(g, i) for g, t in enumerate(s.tables) for i, b in enumerate(t) if not isinstance(b, int)]
        self.allow_write_backs((n - k) * len(s.tables) + len(hosted))
        for g, i in hosted:
            slot = s.tables[g][i][1]
            b = s.tables[g][i] = self.take()
            self.retention[b] = self.retention_of(s, i)
            self.ref[b] += 1  # the load's hold
            self.loads.append((slot, b, s.serial, g, i))
            s.loading += 1
        for t in s.tables:  # after every group's hits: a fresh block never evicts one
            while len(t) < n:
                b = self.take()
                self.retention[b] = self.retention_of(s, len(t))
                t.append(b)
        self.spare = 0
        self.seqs[sid] = s
        return s.computed

    def free_blocks_needed(self, tokens, salt=b"", chunk=None):
        k, held = self.match(tokens, salt)
        n = self.nblocks(self.first_chunk(tokens, k, chunk))
        return sum(n - k + sum(not isinstance(b, int) or self.ref[b] == 0 for b in h) for h in held)

    def reserve_need(self, sids, ns):
        return sum(max(0, self.nblocks(n) - len(self.seqs[sid].tables[0])) for sid, n in zip(sids, ns)) * len(self.windows)

    def reserve(self, sid, n):
        s = self.seqs[sid]
        self.allow_write_backs(self.reserve_need([sid], [n]))
        for t in s.tables:
            while len(t) < self.nblocks(n):
                b = self.take()
                self.retention[b] = self.retention_of(s, len(t))
                t.append(b)
        self.spare = 0

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
        self.allow_write_backs(self.distinct_blocks(sids))
        mapping = self.move(sids, to_cpu=False)
        self.spare = 0
        return mapping

    def distinct_blocks(self, sids):
        return len({b for sid in sids for g in range(len(self.seqs[sid].tables)) for b in self.seqs[sid].held(g)})
