"""Tensor parallelism over torch.distributed: how the Llama model is sharded over N ranks (Megatron
style), the process group of an LLM and the workers it spawns (or that torchrun started), and the step
protocol: rank 0 schedules and samples, broadcasts each step's inputs once, and every rank runs its
shard of the forward pass.

Sharding: QKV and gate/up are column-parallel (each rank holds Hq/N query heads, Hkv/N KV heads, or one
KV head replicated over N/Hkv ranks when N > Hkv, and I/N of the MLP), o_proj and down are row-parallel
with one all-reduce each; the embedding and the LM head are vocabulary-parallel (an all-reduce after the
embedding, a gather of the logits to rank 0)."""
import dataclasses
import datetime
import multiprocessing
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .config import EngineConfig, ModelConfig
from .llama import AttentionMetadata
from .loader import ZERO, open_checkpoint
from .model_runner import ModelRunner
from .scheduler import ScheduledBatch

# How long rank 0 waits in a collective before it declares a worker hung (PAGEDKV_TP_TIMEOUT_S, 300 s by
# default); a worker waits for the next step without limit (it may idle between generate() calls) and
# learns of rank 0's exit from its socket.
IDLE_TIMEOUT = datetime.timedelta(days=365)


def timeout() -> datetime.timedelta:
    value = os.environ.get("PAGEDKV_TP_TIMEOUT_S", "300")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"PAGEDKV_TP_TIMEOUT_S must be a positive number of seconds, got {value!r}")
    return datetime.timedelta(seconds=seconds)
STARTUP_POLL_S = 0.02

# The step message: a header, then the step's tensors, all int64, in one buffer of STEP_BUFFER elements
# broadcast every step (a step that does not fit sends the rest in a second broadcast).
STEP_FIELDS = ("kind", "num_tokens", "num_seqs", "max_blocks", "num_swap_in", "num_swap_out", "num_copies",
               "max_seq_len", "num_logits", "length")
HEADER = len(STEP_FIELDS)
STEP, STOP = 1, 0
STEP_BUFFER = 4096


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed (raised, died or hung); the group is shut down."""


# ---- sharding ---------------------------------------------------------------------------------------
def _split(n: int, size: int, rank: int) -> range:
    """Rank's part of range(n) cut into `size` contiguous parts whose lengths differ by at most one."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclasses.dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds of a model: pure geometry, no process group."""
    rank: int
    size: int

    def check(self, cfg: ModelConfig) -> None:
        n, hq, hkv = self.size, cfg.num_heads, cfg.num_kv_heads
        if hq % n:
            raise ValueError(f"tensor_parallel_size={n} must divide num_attention_heads={hq}")
        if hkv % n and n % hkv:
            raise ValueError(f"tensor_parallel_size={n} must divide num_key_value_heads={hkv} or be a multiple "
                             f"of it (KV heads are then replicated)")
        if cfg.intermediate_size < n:
            raise ValueError(f"tensor_parallel_size={n} exceeds intermediate_size={cfg.intermediate_size}")

    def q_heads(self, cfg: ModelConfig) -> range:
        per = cfg.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, cfg: ModelConfig) -> range:
        if self.size <= cfg.num_kv_heads:
            per = cfg.num_kv_heads // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        head = self.rank // (self.size // cfg.num_kv_heads)      # the KV head of this rank's query heads
        return range(head, head + 1)

    def intermediate(self, cfg: ModelConfig) -> range:
        return _split(cfg.intermediate_size, self.size, self.rank)

    def vocab_rows(self, cfg: ModelConfig) -> int:
        """Rows of every rank's embedding and LM head (the last rank's may end in padding)."""
        return -(-cfg.vocab_size // self.size)

    def vocab(self, cfg: ModelConfig) -> range:
        rows = self.vocab_rows(cfg)
        return range(min(self.rank * rows, cfg.vocab_size), min((self.rank + 1) * rows, cfg.vocab_size))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's layers have (the vocabulary stays whole: sharded modules read it)."""
        self.check(cfg)
        return dataclasses.replace(cfg, num_heads=len(self.q_heads(cfg)), num_kv_heads=len(self.kv_heads(cfg)),
                                   intermediate_size=len(self.intermediate(cfg)))

    def piece(self, name: str, cfg: ModelConfig):
        """The part of checkpoint tensor `name` this rank loads: None (all of it), ZERO (none: a
        row-parallel bias is added once, by rank 0), or (dim, range along dim, full length of dim)."""
        d = cfg.head_dim
        q, kv, inter, vocab = self.q_heads(cfg), self.kv_heads(cfg), self.intermediate(cfg), self.vocab(cfg)
        heads = lambda r: range(r.start * d, r.stop * d)   # noqa: E731
        layer = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        is_bias = name.endswith(".bias")
        if layer == "q_proj":
            return 0, heads(q), cfg.num_heads * d
        if layer in ("k_proj", "v_proj"):
            return 0, heads(kv), cfg.num_kv_heads * d
        if layer in ("gate_proj", "up_proj"):
            return 0, inter, cfg.intermediate_size
        if layer in ("o_proj", "down_proj"):
            if is_bias:
                return None if self.rank == 0 else ZERO
            return (1, heads(q), cfg.num_heads * d) if layer == "o_proj" else (1, inter, cfg.intermediate_size)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, vocab, cfg.vocab_size
        return None


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; tokens outside them embed to zero and an all-reduce sums the
    ranks' rows (exactly: every token has one non-zero term)."""

    def __init__(self, cfg: ModelConfig, tp: "TensorParallel"):
        super().__init__()
        vocab = tp.shard.vocab(cfg)
        self.start, self.stop, self.tp = vocab.start, vocab.stop, tp
        self.weight = nn.Parameter(torch.zeros(tp.shard.vocab_rows(cfg), cfg.hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        h = F.embedding((input_ids - self.start).masked_fill_(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0.0))


# ---- the process group --------------------------------------------------------------------------------
class TensorParallel:
    """This process's place in a tensor-parallel group: its shard, the collectives the model calls, the
    step protocol, and (on rank 0) the workers' lifecycle."""

    def __init__(self, shard: Shard, device: torch.device, backend: str, store, processes=()):
        self.shard, self.rank, self.size, self.device = shard, shard.rank, shard.size, device
        self.backend = backend
        self.store = store
        self.processes = list(processes)      # the workers this rank spawned (none under torchrun)
        prefix = dist.PrefixStore("pagedkv_tp", store)
        # Step messages go over gloo on the CPU (a worker waits for them without limit); the model's
        # collectives over the backend (NCCL keeps tensors on the GPUs).
        self.cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu", prefix), self.rank, self.size, timeout())
        if backend == "gloo":
            self.group = self.cpu_group
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout()
            self.group = dist.ProcessGroupNCCL(dist.PrefixStore("dev", prefix), self.rank, self.size, options)
        self.buffer = torch.zeros(STEP_BUFFER, dtype=torch.int64)
        self.closed = False
        self.gather_options = dist.GatherOptions()
        self.gather_options.rootRank = 0
        # Communication so far (rank 0's view, which every rank shares): steps, and per collective the
        # calls and bytes (a broadcast counts its buffer, an all-reduce its tensor, a gather all ranks' parts).
        self.stats = dict(steps=0, broadcasts=0, broadcast_bytes=0, all_reduces=0, all_reduce_bytes=0,
                          gathers=0, gather_bytes=0)

    def _count(self, what: str, nbytes: int) -> None:
        self.stats[what + "s"] += 1
        self.stats[what + "_bytes"] += nbytes

    def embedding(self, cfg: ModelConfig) -> nn.Module:
        return VocabParallelEmbedding(cfg, self)

    # ---- collectives --------------------------------------------------------------------------------
    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            if self.rank == 0:
                raise TensorParallelError(self._failure_report(e)) from e
            raise

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place."""
        self._count("all_reduce", x.numel() * x.element_size())
        self._wait(self.group.allreduce(x))
        return x

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        self._wait(self.cpu_group.allreduce(t, dist.ReduceOp.MIN))
        return int(t.item())

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Every rank's vocabulary columns, on rank 0 ([B, vocab_size]); None on the others."""
        local = local.contiguous()
        self._count("gather", local.numel() * local.element_size() * self.size)
        if self.rank:
            self._wait(self.group.gather([], [local], self.gather_options))
            return None
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self._wait(self.group.gather([parts], [local], self.gather_options))
        return torch.cat(parts, dim=1)[:, :vocab_size]

    # ---- the step message ---------------------------------------------------------------------------
    def send_step(self, batch: ScheduledBatch, step) -> None:
        """Rank 0: broadcasts what the workers need to run `batch` (step: _prepare's tensors or None)."""
        moves = [m.reshape(-1) for m in (batch.swap_in, batch.swap_out, batch.copies)]
        num_logits = 0      # rows of hidden states kept: 0 = each sequence's last (else speculative rows)
        if step is None:
            tensors, shape, max_seq_len = [], (0, 0, 0), 0
        else:
            input_ids, positions, meta = step
            tensors = [input_ids, positions, meta.slot_mapping, meta.block_tables.view(-1), meta.seq_lens,
                       meta.query_start_loc]
            if meta.logits_indices is not None:
                tensors.append(meta.logits_indices)
                num_logits = meta.logits_indices.numel()
            for slots, tables in meta.other_groups:       # each: its table width, slots, tables
                tensors += [torch.tensor([tables.shape[1]]), slots, tables.view(-1)]
            shape = (input_ids.numel(), *meta.block_tables.shape)
            max_seq_len = meta.max_seq_len
        length = HEADER + sum(t.numel() for t in tensors + moves)
        header = torch.tensor([STEP, *shape, *(len(m) // 2 for m in moves), max_seq_len, num_logits, length])
        packed = torch.cat([header] + [t.to("cpu", torch.int64) for t in tensors] + moves)
        self.stats["steps"] += 1
        self._broadcast(packed)

    def _broadcast(self, packed: torch.Tensor) -> None:
        n = min(packed.numel(), STEP_BUFFER)
        self.buffer[:n] = packed[:n]
        self._count("broadcast", self.buffer.numel() * 8)
        self._wait(self.cpu_group.broadcast(self.buffer, 0))
        if packed.numel() > STEP_BUFFER:
            rest = packed[STEP_BUFFER:].contiguous()
            self._count("broadcast", rest.numel() * 8)
            self._wait(self.cpu_group.broadcast(rest, 0))

    def receive_step(self, num_groups: int = 1):
        """A worker: the next step as (moves, step) with step like _prepare's (or None: blocks move only),
        or None when rank 0 is closing. num_groups: the model's KV groups (each past the first sends its
        slots and block tables)."""
        self._wait(self.cpu_group.broadcast(self.buffer, 0, IDLE_TIMEOUT))
        head = dict(zip(STEP_FIELDS, self.buffer[:HEADER].tolist()))
        if head["kind"] == STOP:
            return None
        data = self.buffer
        if head["length"] > STEP_BUFFER:
            rest = torch.empty(head["length"] - STEP_BUFFER, dtype=torch.int64)
            self._wait(self.cpu_group.broadcast(rest, 0))
            data = torch.cat([self.buffer, rest])
        t, b, m = head["num_tokens"], head["num_seqs"], head["max_blocks"]
        data = data[:head["length"]]
        sizes = [HEADER, t, t, t, b * m, b, b + 1 if b else 0, head["num_logits"]]
        _, ids, pos, slots, tables, lens, starts, logits_rows = data[:sum(sizes)].to(self.device).split(sizes)
        at, other_groups = sum(sizes), []
        for _ in range(num_groups - 1 if b else 0):
            width = int(data[at])
            group_slots, group_tables = data[at + 1:at + 1 + t + b * width].to(self.device).split([t, b * width])
            other_groups.append((group_slots, group_tables.view(b, width).int()))
            at += 1 + t + b * width
        swap_in, swap_out, copies = data[at:].split([2 * head["num_swap_in"], 2 * head["num_swap_out"],
                                                     2 * head["num_copies"]])
        moves = ScheduledBatch(swap_in=swap_in.view(-1, 2).cpu(), swap_out=swap_out.view(-1, 2).cpu(),
                               copies=copies.view(-1, 2).cpu())
        if not b:
            return moves, None
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(b, m).int(), seq_lens=lens.int(),
                                 query_start_loc=starts.int(), max_seq_len=head["max_seq_len"],
                                 logits_indices=logits_rows if head["num_logits"] else None,
                                 other_groups=tuple(other_groups))
        return moves, (ids, pos, meta)

    # ---- failures and shutdown ------------------------------------------------------------------------
    def report(self, text: str) -> None:
        """A worker: leaves its error for rank 0 (best effort: rank 0 may be gone)."""
        try:
            self.store.set(f"error/{self.rank}", text)
        except Exception:                                          # noqa: BLE001 (nothing more to do)
            pass

    def _failure_report(self, error: BaseException, wait_s: float = 2.0) -> str:
        """Rank 0, after a collective failed: what the failed workers reported (their error first, then
        their traceback), or how they ended."""
        deadline = time.monotonic() + wait_s
        while not (failed := [(r, why) for r in range(1, self.size) if (why := self._worker_failure(r))]):
            if time.monotonic() > deadline:
                break
            time.sleep(STARTUP_POLL_S)
        seen = str(error).splitlines()[0] if str(error) else type(error).__name__
        if not failed:
            return f"tensor-parallel group failed and no worker said why (rank 0: {seen})"
        lines = [f"tensor-parallel worker rank {r} failed: {why.strip().splitlines()[-1]}" for r, why in failed]
        lines += [f"\nworker rank {r}: {why}" for r, why in failed if "\n" in why.strip()]
        return "\n".join(lines + [f"(rank 0: {seen})"])

    def _worker_failure(self, rank: int) -> str | None:
        key = f"error/{rank}"
        if self.store.check([key]):
            return self.store.get(key).decode(errors="replace")
        proc = self.processes[rank - 1] if self.processes else None
        if proc is not None and not proc.is_alive():
            return f"(pid {proc.pid}) died with exit code {proc.exitcode}"
        return None

    def close(self, stop_workers: bool = True) -> None:
        """Rank 0: tells the workers to exit (when the group still works) and reaps them; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0 and stop_workers:
            try:
                self.buffer[:HEADER] = STOP                          # the header of a STOP message
                self.cpu_group.broadcast(self.buffer, 0, datetime.timedelta(seconds=5)).wait()
            except RuntimeError:
                pass
        _reap(self.processes, grace_s=10.0 if stop_workers else 0.0)
        self.group = self.cpu_group = None

    def check_open(self) -> None:
        if self.closed:
            raise TensorParallelError("the tensor-parallel group was shut down after an error or close(); "
                                      "create a new LLM")


def _reap(processes, grace_s: float) -> None:
    """Waits up to grace_s for the processes to exit, then terminates and at last kills them."""
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for stop in ("terminate", "kill"):
        alive = [p for p in processes if p.is_alive()]
        for p in alive:
            getattr(p, stop)()
        for p in alive:
            p.join(2.0)


# ---- runners ------------------------------------------------------------------------------------------
class DriverRunner(ModelRunner):
    """Rank 0's model runner: broadcasts each step, runs its shard, samples from the gathered logits.
    A failure once the step is sent leaves the ranks out of step, so it shuts the group down; one before
    (building the step's inputs) leaves them in step, and the engine rolls the step back as usual."""

    def __init__(self, model, config: EngineConfig, num_blocks: int, num_cpu_blocks: int, seed: int,
                 tp: TensorParallel):
        super().__init__(model, config, num_blocks, num_cpu_blocks, seed)
        self.tp = tp

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, bm) -> list[list[int]]:
        self.tp.check_open()
        step = self._prepare(batch, bm) if batch.seqs else None
        try:
            self.tp.send_step(batch, step)
            self._move_blocks(batch)
            if step is None:
                return []
            input_ids, positions, meta = step
            logits = self.model.compute_logits(self.model(input_ids, positions, self.layer_caches, meta))
        except BaseException:
            self.tp.close(stop_workers=False)
            raise
        return self._sample(logits, batch)


@torch.inference_mode()
def serve(runner: ModelRunner, tp: TensorParallel):
    """A worker: runs rank 0's steps until it closes, then exits the process (SystemExit(0))."""
    try:
        while (message := tp.receive_step(runner.num_groups)) is not None:
            moves, step = message
            runner._move_blocks(moves)
            if step is not None:
                input_ids, positions, meta = step
                runner.model.compute_logits(runner.model(input_ids, positions, runner.layer_caches, meta))
    except BaseException:
        tp.report(traceback.format_exc())
        raise
    raise SystemExit(0)


# ---- joining a group ------------------------------------------------------------------------------------
_SPAWNED = None      # (store, rank) in a worker process this module spawned


def join(config: EngineConfig, model_path: str, llm_kwargs: dict) -> TensorParallel | None:
    """This process's TensorParallel for an LLM being built (None when it runs alone): in a spawned
    worker, the group it was spawned for; under torchrun (WORLD_SIZE > 1), the launched group; else rank
    0 of a new group whose N-1 workers it spawns. Sets config.device to this rank's device."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    backend = config.distributed_backend or ("nccl" if config.device.type == "cuda" else "gloo")
    if _SPAWNED is not None:
        store, rank = _SPAWNED
        local_rank, processes = rank, ()
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} processes")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout()))
        processes = ()
    else:
        Shard(0, size).check(open_checkpoint(model_path).config)     # before starting anything
        rank = local_rank = 0
        store, processes = _spawn_workers(size, model_path, llm_kwargs)
    config.device = _rank_device(config.device, local_rank, size)
    try:
        return TensorParallel(Shard(rank, size), config.device, backend, store, processes)
    except BaseException:
        _reap(processes, grace_s=0.0)
        raise


def _rank_device(device: torch.device, local_rank: int, size: int) -> torch.device:
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} on CUDA needs a GPU per rank on this machine: rank "
                         f"{local_rank} has none ({torch.cuda.device_count()} visible)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _spawn_workers(size: int, model_path: str, llm_kwargs: dict):
    """Rank 0: starts workers 1..size-1 (spawn: fork is unsafe with torch's threads) on a store on a free
    local port; returns once each has connected, or raises with the report of one that did not."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout(), wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    threads = torch.get_num_threads()
    processes = []
    try:
        for rank in range(1, size):
            p = ctx.Process(target=_worker_main, name=f"pagedkv-tp-rank{rank}", daemon=True,
                            args=(rank, store.port, model_path, llm_kwargs, threads))
            p.start()
            processes.append(p)
        deadline = time.monotonic() + timeout().total_seconds()
        keys = [f"ready/{r}" for r in range(1, size)]
        while not store.check(keys):
            dead = [(r, p) for r, p in enumerate(processes, start=1) if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                raise TensorParallelError(_startup_report(store, dead))
            time.sleep(STARTUP_POLL_S)
    except BaseException:
        _reap(processes, grace_s=0.0)
        raise
    return store, processes


def _startup_report(store, dead) -> str:
    if not dead:
        return f"tensor-parallel workers did not start within {timeout().total_seconds():.0f} s"
    rank, p = dead[0]
    key = f"error/{rank}"
    why = store.get(key).decode(errors="replace") if store.check([key]) else f"exit code {p.exitcode}"
    return f"tensor-parallel worker rank {rank} failed to start: {why}"


def _worker_main(rank: int, port: int, model_path: str, llm_kwargs: dict, num_threads: int) -> None:
    """A spawned worker: builds its LLM shard, which serves rank 0 until it closes."""
    global _SPAWNED
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is rank 0's to handle; it stops us
    torch.set_num_threads(num_threads)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout())
    _SPAWNED = (store, rank)
    store.set(f"ready/{rank}", "1")
    try:
        from .llm_engine import LLM
        LLM(model_path, **llm_kwargs)
    except SystemExit:
        raise
    except BaseException:
        try:
            store.set(f"error/{rank}", traceback.format_exc())
        finally:
            sys.exit(1)
