"""Rank 0's worker processes. Each starts from its own entry point, `python -m pagedkv.engine.tp.worker`
(never a re-import of the caller's main module, so scripts without a main guard, `python -c` and
`python -` work), finds rank 0 through a TCPStore whose address it gets in its environment, reads what to
build from the store, and leaves its error there if it fails. Rank 0 reaps them; they exit by themselves
if rank 0 is gone."""
import dataclasses
import json
import os
import subprocess
import sys
import time

import torch.distributed as dist

from .collectives import TensorParallelError, timeout

# A worker's environment: the store's address, its rank, the group's size and rank 0's pid (it exits
# when its parent is no longer that process).
STORE_ENV, RANK_ENV, SIZE_ENV, PARENT_ENV = ("PAGEDKV_TP_STORE", "PAGEDKV_TP_RANK", "PAGEDKV_TP_WORLD_SIZE",
                                             "PAGEDKV_TP_PARENT_PID")
ENTRY_POINT = "pagedkv.engine.tp.worker"
POLL_S = 0.02


@dataclasses.dataclass
class WorkerSpec:
    """What every worker builds, sent as JSON through the store: rank 0's engine settings."""
    model_path: str
    config: dict              # EngineConfig's fields; device and dtype by name
    seed: int
    pack_cpu_weights: bool
    num_threads: int

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        return cls(**json.loads(text))


# Keys in the store (besides the process groups' own, under their prefix).
SPEC_KEY = "worker/spec"


def ready_key(rank: int) -> str:
    return f"worker/ready/{rank}"


def error_key(rank: int) -> str:
    return f"worker/error/{rank}"


def report_failure(store, rank: int, text: str) -> None:
    """A worker: leaves its error for rank 0 (best effort: rank 0 may be gone)."""
    try:
        store.set(error_key(rank), text)
    except Exception:                                          # noqa: BLE001 (nothing more to do)
        pass


class WorkerProcess:
    """One worker process (a subprocess.Popen), with multiprocessing.Process's vocabulary."""

    def __init__(self, rank: int, popen: subprocess.Popen):
        self.rank, self.popen, self.pid = rank, popen, popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout_s: float | None = None) -> None:
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()


class Workers:
    """Rank 0's view of ranks 1..size-1: the processes it started (none under torchrun) and what they left
    in the store."""

    def __init__(self, store, size: int, processes=()):
        self.store, self.size, self.processes = store, size, list(processes)

    @classmethod
    def start(cls, size: int, spec: WorkerSpec) -> "Workers":
        """Starts ranks 1..size-1 on a new store on a free local port; returns once each has connected and
        read its spec, or raises with the report of one that did not."""
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout(), wait_for_workers=False)
        store.set(SPEC_KEY, spec.to_json())
        workers = cls(store, size)
        try:
            for rank in range(1, size):
                workers.processes.append(WorkerProcess(rank, _launch(rank, size, store.port)))
            workers._wait_ready()
        except BaseException:
            workers.reap(grace_s=0.0)
            raise
        return workers

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + timeout().total_seconds()
        keys = [ready_key(r) for r in range(1, self.size)]
        while not self.store.check(keys):
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                raise TensorParallelError(f"tensor-parallel worker rank {dead[0].rank} failed to start: "
                                          f"{self.failure(dead[0].rank)}")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not start within "
                                          f"{timeout().total_seconds():.0f} s")
            time.sleep(POLL_S)

    def failure(self, rank: int) -> str | None:
        """What worker `rank` reported (its traceback), or how its process ended; None while it runs."""
        key = error_key(rank)
        if self.store.check([key]):
            return self.store.get(key).decode(errors="replace")
        proc = next((p for p in self.processes if p.rank == rank), None)
        if proc is not None and not proc.is_alive():
            return f"(pid {proc.pid}) died with exit code {proc.exitcode}"
        return None

    def failure_report(self, error: BaseException, wait_s: float = 2.0) -> str:
        """After a collective failed: what the failed workers reported (their error first, then their
        traceback), or how they ended."""
        deadline = time.monotonic() + wait_s
        while not (failed := [(r, why) for r in range(1, self.size) if (why := self.failure(r))]):
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        seen = str(error).splitlines()[0] if str(error) else type(error).__name__
        if not failed:
            return f"tensor-parallel group failed and no worker said why (rank 0: {seen})"
        lines = [f"tensor-parallel worker rank {r} failed: {why.strip().splitlines()[-1]}" for r, why in failed]
        lines += [f"\nworker rank {r}: {why}" for r, why in failed if "\n" in why.strip()]
        return "\n".join(lines + [f"(rank 0: {seen})"])

    def reap(self, grace_s: float) -> None:
        """Waits up to grace_s for the processes to exit, then terminates and at last kills them."""
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for stop in ("terminate", "kill"):
            alive = [p for p in self.processes if p.is_alive()]
            for p in alive:
                getattr(p, stop)()
            for p in alive:
                p.join(2.0)


def _launch(rank: int, size: int, port: int) -> subprocess.Popen:
    """`python -m pagedkv.engine.tp.worker` with this interpreter, the pagedkv this process imported first on
    its path, and the worker's place in the group in its environment."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, STORE_ENV: f"127.0.0.1:{port}", RANK_ENV: str(rank),
           SIZE_ENV: str(size), PARENT_ENV: str(os.getpid())}
    return subprocess.Popen([sys.executable, "-m", ENTRY_POINT], env=env, stdin=subprocess.DEVNULL)
