"""A small pure-Python model of the BlockManager contract (DESIGN.md section 1), used by the stateful
test. The prefix cache is a dict keyed by the whole prefix (salt, tokens of blocks 0..i), so exactness
holds by construction; the free list is an OrderedDict in LRU order."""
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Seq:
    tokens: list
    table: list
    salt: bytes
    computed: int = 0
    registered: int = 0
    swapped: bool = False


@dataclass
class Model:
    num_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
    free: OrderedDict = field(default_factory=OrderedDict)
    cpu_free: OrderedDict = field(default_factory=OrderedDict)
    ref: dict = field(default_factory=dict)
    cpu_ref: dict = field(default_factory=dict)
    tag: dict = field(default_factory=dict)       # block -> prefix key it was registered with
    registry: dict = field(default_factory=dict)  # prefix key -> block (latest registration wins)
    seqs: dict = field(default_factory=dict)
    copies: list = field(default_factory=list)
    evictions: int = 0

    def __post_init__(self):
        self.free = OrderedDict((b, None) for b in range(self.num_blocks))
        self.cpu_free = OrderedDict((b, None) for b in range(self.num_cpu_blocks))
        self.ref = {b: 0 for b in range(self.num_blocks)}
        self.cpu_ref = {b: 0 for b in range(self.num_cpu_blocks)}

    def key(self, tokens, salt, i):
        return (salt, tuple(tokens[: (i + 1) * self.block_size]))

    def nblocks(self, n):
        return -(-n // self.block_size)

    def hits(self, tokens, salt):
        out = []
        for i in range(self.nblocks(len(tokens)) - 1):
            b = self.registry.get(self.key(tokens, salt, i))
            if b is None:
                break
            out.append(b)
        return out

    # --- pool -----------------------------------------------------------------------------------
    def take(self):
        b, _ = self.free.popitem(last=False)
        k = self.tag.pop(b, None)
        if k is not None and self.registry.get(k) == b:
            del self.registry[k]
            self.evictions += 1
        self.ref[b] = 1
        return b

    def to_free_list(self, b):
        self.free[b] = None
        k = self.tag.get(b)
        if k is None or self.registry.get(k) != b:
            self.free.move_to_end(b, last=False)

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
    def allocate(self, sid, tokens, salt=b""):
        hits = self.hits(tokens, salt)
        table = []
        for b in hits:
            if self.ref[b] == 0 and b in self.free:
                del self.free[b]
            self.ref[b] += 1
            table.append(b)
        while len(table) < self.nblocks(len(tokens)):
            table.append(self.take())
        n = len(hits) * self.block_size
        self.seqs[sid] = Seq(list(tokens), table, salt, computed=n, registered=len(hits))
        return n

    def free_blocks_needed(self, tokens, salt=b""):
        return self.nblocks(len(tokens)) - sum(self.ref[b] > 0 for b in self.hits(tokens, salt))

    def mark_computed(self, sid, n=None):
        s = self.seqs[sid]
        s.computed = len(s.tokens) if n is None else n
        for i in range(s.registered, s.computed // self.block_size):
            b, k = s.table[i], self.key(s.tokens, s.salt, i)
            old = self.tag.get(b)
            if old is not None and old != k and self.registry.get(old) == b:
                del self.registry[old]
            self.tag[b] = k
            self.registry[k] = b
            s.registered = i + 1

    def must_copy(self, b):
        return self.ref[b] > 1 or b in self.tag  # shared, or cached KV left partial by truncate

    def append_need(self, sids, counts=None, extra=0):
        need, shared = 0, {}
        for i, sid in enumerate(sids):
            s = self.seqs[sid]
            c = (1 if counts is None else counts[i]) + extra
            if c <= 0:
                continue
            need += self.nblocks(len(s.tokens) + c) - self.nblocks(len(s.tokens))
            if len(s.tokens) % self.block_size == 0:
                continue
            if s.table[-1] in self.tag:
                need += 1
            elif self.ref[s.table[-1]] > 1:
                shared[s.table[-1]] = shared.get(s.table[-1], 0) + 1
        return need + sum(k if k < self.ref[b] else k - 1 for b, k in shared.items())

    def append(self, sid, tok):
        return self.append_many(sid, [tok])[0]

    def append_many(self, sid, toks):
        s, slots = self.seqs[sid], []
        for j, tok in enumerate(toks):
            pos = len(s.tokens)
            if pos % self.block_size == 0:
                s.table.append(self.take())
            elif j == 0 and self.must_copy(s.table[-1]):
                new = self.take()
                pending = [src for src, dst in self.copies if dst == s.table[-1]]
                self.copies.append((pending[0] if pending else s.table[-1], new))
                self.release(s.table[-1])
                s.table[-1] = new
            s.tokens.append(tok)
            slots.append(s.table[pos // self.block_size] * self.block_size + pos % self.block_size)
        return slots

    def truncate(self, sid, n):
        s = self.seqs[sid]
        while len(s.table) > self.nblocks(n):
            self.release(s.table.pop())
        del s.tokens[n:]
        s.computed = min(s.computed, n)
        s.registered = min(s.registered, n // self.block_size)

    def free_seq(self, sid):
        s = self.seqs.pop(sid)
        for b in reversed(s.table):
            (self.release_cpu if s.swapped else self.release)(b)

    def fork(self, parent, child):
        p = self.seqs[parent]
        self.seqs[child] = Seq(list(p.tokens), list(p.table), p.salt, p.computed, p.registered)
        for b in p.table:
            self.ref[b] += 1

    def move(self, sids, to_cpu):
        take, dst_ref = (self.take_cpu, self.cpu_ref) if to_cpu else (self.take, self.ref)
        release = self.release if to_cpu else self.release_cpu
        mapping, m = [], {}
        copy_source = {dst: src for src, dst in self.copies} if to_cpu else {}  # not yet copied
        for sid in sids:
            s = self.seqs[sid]
            new = []
            for b in s.table:
                if b not in m:
                    m[b] = take()
                    mapping.append((copy_source.get(b, b), m[b]))
                else:
                    dst_ref[m[b]] += 1
                new.append(m[b])
            for b in reversed(s.table):
                release(b)
            s.table, s.swapped, s.registered = new, to_cpu, 0
        return mapping

    def swap_out(self, sids):
        return self.move(sids, to_cpu=True)

    def swap_in(self, sids):
        return self.move(sids, to_cpu=False)

    def distinct_blocks(self, sids):
        return len({b for sid in sids for b in self.seqs[sid].table})
