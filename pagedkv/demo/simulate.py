"""Serving-trace simulation through the BlockManager alone (no model): requests that share system
prompts arrive over time, are admitted with can_allocate, decode one token per step, are preempted by
swap (or recompute) when blocks run out, and finish. Every step produces the tensors a model runner
would need. Prints the prefix-cache hit rate, peak blocks used, preemptions and the bookkeeping cost.

  python -m pagedkv.demo.simulate [--requests 2000] [--num-blocks 2048] [--cpu-blocks 512]
"""
import argparse
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from tqdm import tqdm

from pagedkv import AllocStatus, BlockManager
from pagedkv._cli import HelpFormatter
from pagedkv.validation import int_at_least


@dataclass
class Request:
    seq_id: int
    prompt: list
    max_new: int
    arrival: int
    output: list = field(default_factory=list)

    @property
    def tokens(self):
        return self.prompt + self.output


class Simulator:
    def __init__(self, args):
        self.bm = BlockManager(args.num_blocks, args.block_size, num_cpu_blocks=args.cpu_blocks, watermark=0.0)
        self.max_batch = args.max_batch
        self.waiting, self.running, self.swapped = deque(), [], deque()
        self.preempt_swap = self.preempt_recompute = self.never = self.outgrew = 0
        self.peak_used = 0
        self.bookkeeping_s = 0.0
        self.steps = 0
        self.batch_sum = 0
        self.next_seq = 0

    def admit(self):
        while self.swapped and len(self.running) < self.max_batch:  # swapped sequences come back first
            req = self.swapped[0]
            if self.bm.can_swap_in([req.seq_id]) != AllocStatus.OK:
                return
            self.bm.swap_in([req.seq_id])
            self.running.append(self.swapped.popleft())
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            status = self.bm.can_allocate(req.tokens)
            if status == AllocStatus.NEVER:
                self.waiting.popleft()
                self.never += 1
                continue
            if status == AllocStatus.LATER:
                return
            self.waiting.popleft()
            self.bm.allocate(req.seq_id, req.tokens)
            self.running.append(req)

    def preempt(self):
        victim = self.running.pop()  # the newest
        if self.bm.can_swap_out([victim.seq_id]):
            self.bm.swap_out([victim.seq_id])
            self.swapped.appendleft(victim)
            self.preempt_swap += 1
        else:  # recompute: drop its KV, re-admit with prompt + output so far under a fresh id
            self.bm.free(victim.seq_id)
            victim.seq_id = self.new_id()
            self.waiting.appendleft(victim)
            self.preempt_recompute += 1

    def reject_head(self):
        if self.swapped:
            self.bm.free(self.swapped.popleft().seq_id)
        else:
            self.waiting.popleft()
        self.never += 1

    def new_id(self):
        self.next_seq += 1
        return self.next_seq

    def step(self, rng):
        t0 = time.perf_counter()
        self.admit()
        if not self.running and (self.waiting or self.swapped):
            self.reject_head()       # an empty pool cannot take it: it would wait forever
        while self.running and not self.bm.can_append([r.seq_id for r in self.running]):
            if len(self.running) > 1:
                self.preempt()
            else:                    # alone and still no room: it outgrew the KV cache, as in the engine
                self.bm.free(self.running.pop().seq_id)
                self.outgrew += 1
        ids = [r.seq_id for r in self.running]
        self.batch_sum += len(ids)
        finished = []
        if ids:
            # Prefill/decode of this step wrote the KV of every token so far.
            self.bm.mark_computed(ids)
            new_tokens = [rng.randrange(32_000) for _ in ids]
            self.bm.append_tokens(ids, new_tokens)  # slot mapping of the next decode input
            self.bm.block_tables(ids)
            self.bm.num_tokens(ids)
            self.bm.take_copies()
            for req, tok in zip(self.running, new_tokens):
                req.output.append(tok)
                if len(req.output) >= req.max_new:
                    finished.append(req)
            for req in finished:
                self.bm.free(req.seq_id)
            self.running = [r for r in self.running if len(r.output) < r.max_new]
        self.bookkeeping_s += time.perf_counter() - t0
        self.peak_used = max(self.peak_used, self.bm.stats()["used_blocks"])
        self.steps += 1
        return len(finished)


def make_trace(args, rng):
    systems = [[rng.randrange(32_000) for _ in range(rng.randrange(200, 600))] for _ in range(args.system_prompts)]
    trace, sid = [], 0
    for i in range(args.requests):
        user = [rng.randrange(32_000) for _ in range(rng.randrange(20, 200))]
        sid += 1
        trace.append(Request(-sid, rng.choice(systems) + user, rng.randrange(16, 256), arrival=i // args.arrivals_per_step))
    return trace


def main(argv=None) -> int:
    """Runs the simulation; returns the exit status: 0, or 1 when some request failed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--requests", type=int_at_least(1), default=2000, help="requests in the trace")
    ap.add_argument("--system-prompts", type=int_at_least(1), default=8, help="distinct shared system prompts")
    ap.add_argument("--arrivals-per-step", type=int_at_least(1), default=4, help="requests arriving per step")
    ap.add_argument("--num-blocks", type=int_at_least(1), default=2048, help="GPU KV blocks")
    ap.add_argument("--cpu-blocks", type=int_at_least(0), default=512, help="CPU blocks for swapping (0: recompute)")
    ap.add_argument("--block-size", type=int_at_least(1), default=16, help="tokens per block")
    ap.add_argument("--max-batch", type=int_at_least(1), default=256, help="sequences decoded per step at most")
    ap.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the trace")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    trace = deque(make_trace(args, rng))
    sim = Simulator(args)
    done = 0
    with tqdm(total=args.requests, desc="requests", unit="req") as bar:
        while done + sim.never + sim.outgrew < args.requests:
            while trace and trace[0].arrival <= sim.steps:
                sim.waiting.append(trace.popleft())
            finished = sim.step(rng)
            done += finished
            bar.update(finished)
    sim.bm.check_invariants()
    st = sim.bm.stats()
    print(f"\nsteps: {sim.steps}   requests finished: {done}   rejected (can never fit): {sim.never}   "
          f"failed (outgrew the KV cache): {sim.outgrew}")
    print(f"prefix-cache hit rate: {st['hit_rate']:.1%} ({st['hits']} of {st['queries']} prompt tokens)")
    print(f"peak blocks used: {sim.peak_used} of {args.num_blocks}   evictions: {st['evictions']}")
    print(f"preemptions: {sim.preempt_swap} by swap, {sim.preempt_recompute} by recompute")
    print(f"bookkeeping: {sim.bookkeeping_s / sim.steps * 1e6:.0f} us per step "
          f"(mean batch {sim.batch_sum / sim.steps:.0f})")
    if sim.never or sim.outgrew:
        print(f"error: {sim.never + sim.outgrew} of {args.requests} requests failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
