"""A tensor-parallel group's communication: its two process groups (step messages over gloo on the CPU,
the model's collectives over NCCL on GPUs or gloo), the collectives the sharded model calls, and the
transport of rank 0's step messages. The group is private (its own TCPStore, never the default process
group), so several engines and the user's own torch.distributed coexist."""
import datetime
import os

import torch
import torch.distributed as dist

# A worker waits for the next step without limit (it may idle between generate() calls) and learns of
# rank 0's exit from its socket.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# Step messages travel in a fixed buffer, so a worker can wait for the next one without knowing its size
# (a message that does not fit sends the rest in a second broadcast). Its first two elements frame the
# message: STEP or STOP, and the message's length.
MESSAGE_BUFFER = 4096
FRAME = 2
STEP, STOP = 1, 0


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed (raised, died or hung); the group is shut down."""


def timeout() -> datetime.timedelta:
    """How long rank 0 waits in a collective before it declares a worker hung (PAGEDKV_TP_TIMEOUT_S, 300 s
    by default)."""
    value = os.environ.get("PAGEDKV_TP_TIMEOUT_S", "300")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"PAGEDKV_TP_TIMEOUT_S must be a positive number of seconds, got {value!r}")
    return datetime.timedelta(seconds=seconds)


class TensorParallel:
    """This process's place in a tensor-parallel group: its shard, the collectives the model calls and
    the step-message transport. On rank 0, `workers` (workers.Workers) owns the worker processes and
    explains a failed collective; close() stops them."""

    def __init__(self, shard, device: torch.device, backend: str, store, workers=None):
        self.shard, self.rank, self.size, self.device = shard, shard.rank, shard.size, device
        self.backend, self.store, self.workers = backend, store, workers
        prefix = dist.PrefixStore("pagedkv_tp", store)
        self.cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu", prefix), self.rank, self.size, timeout())
        if backend == "gloo":
            self.group = self.cpu_group
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout()
            self.group = dist.ProcessGroupNCCL(dist.PrefixStore("dev", prefix), self.rank, self.size, options)
        self.buffer = torch.zeros(MESSAGE_BUFFER, dtype=torch.int64)
        self.closed = False
        self.gather_options = dist.GatherOptions()
        self.gather_options.rootRank = 0
        # Communication so far (rank 0's view, which every rank shares): steps, and per collective the
        # calls and bytes (a broadcast counts its buffer, an all-reduce its tensor, a gather all ranks' parts).
        self.stats = dict(steps=0, broadcasts=0, broadcast_bytes=0, all_reduces=0, all_reduce_bytes=0,
                          gathers=0, gather_bytes=0)

    @property
    def processes(self) -> list:
        """The worker processes this rank started (none on a worker, none under torchrun)."""
        return [] if self.workers is None else self.workers.processes

    def _count(self, what: str, nbytes: int) -> None:
        self.stats[what + "s"] += 1
        self.stats[what + "_bytes"] += nbytes

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            if self.workers is not None:
                raise TensorParallelError(self.workers.failure_report(e)) from e
            raise

    # ---- the model's collectives ----------------------------------------------------------------------
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

    # ---- step messages --------------------------------------------------------------------------------
    def send(self, message: torch.Tensor) -> None:
        """Rank 0: broadcasts one packed step message (1-D int64)."""
        self.stats["steps"] += 1
        self._broadcast(torch.cat([torch.tensor([STEP, message.numel()]), message]))

    def _broadcast(self, framed: torch.Tensor) -> None:
        n = min(framed.numel(), MESSAGE_BUFFER)
        self.buffer[:n] = framed[:n]
        self._count("broadcast", self.buffer.numel() * 8)
        self._wait(self.cpu_group.broadcast(self.buffer, 0))
        if framed.numel() > MESSAGE_BUFFER:
            rest = framed[MESSAGE_BUFFER:].contiguous()
            self._count("broadcast", rest.numel() * 8)
            self._wait(self.cpu_group.broadcast(rest, 0))

    def receive(self) -> torch.Tensor | None:
        """A worker: the next packed step message, or None when rank 0 is closing."""
        self._wait(self.cpu_group.broadcast(self.buffer, 0, IDLE_TIMEOUT))
        kind, length = self.buffer[:FRAME].tolist()
        if kind == STOP:
            return None
        end = FRAME + length
        if end <= MESSAGE_BUFFER:
            return self.buffer[FRAME:end].clone()
        rest = torch.empty(end - MESSAGE_BUFFER, dtype=torch.int64)
        self._wait(self.cpu_group.broadcast(rest, 0))
        return torch.cat([self.buffer[FRAME:], rest])

    # ---- shutdown ---------------------------------------------------------------------------------------
    def close(self, stop_workers: bool = True) -> None:
        """Rank 0: tells the workers to exit (when the group still works) and reaps them; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0 and stop_workers:
            try:
                self.buffer[:FRAME] = torch.tensor([STOP, 0])
                self.cpu_group.broadcast(self.buffer, 0, datetime.timedelta(seconds=5)).wait()
            except RuntimeError:
                pass
        if self.workers is not None:
            self.workers.reap(grace_s=10.0 if stop_workers else 0.0)
        self.group = self.cpu_group = None

    def check_open(self) -> None:
        if self.closed:
            raise TensorParallelError("the tensor-parallel group was shut down after an error or close(); "
                                      "create a new LLM")
