"""The entry point of a tensor-parallel worker: `python -m pagedkv.engine.tp.worker`, started by rank 0
(tp/workers.py) with its place in the group in its environment. It builds its shard of the model and
replays rank 0's steps until rank 0 closes, and exits when rank 0's process is gone."""
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from ..config import EngineConfig
from .collectives import TensorParallel, timeout
from .group import backend, rank_device
from .runners import serve_rank
from .shard import Shard
from .workers import PARENT_ENV, RANK_ENV, SIZE_ENV, SPEC_KEY, STORE_ENV, WorkerSpec, ready_key, report_failure

PARENT_POLL_S = 0.5


def exit_with_parent(parent_pid: int) -> None:
    """Ends this process (exit code 1) once its parent is no longer `parent_pid`."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="pagedkv-parent-watch", daemon=True).start()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is rank 0's to handle; it stops us
    exit_with_parent(int(os.environ[PARENT_ENV]))
    rank, size = int(os.environ[RANK_ENV]), int(os.environ[SIZE_ENV])
    host, port = os.environ[STORE_ENV].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), None, False, timeout=timeout())
    try:
        spec = WorkerSpec.from_json(store.get(SPEC_KEY).decode())
        torch.set_num_threads(spec.num_threads)
        config = EngineConfig(**spec.config)
        config.device = rank_device(config.device, rank, size)
        store.set(ready_key(rank), "1")
        tp = TensorParallel(Shard(rank, size), config.device, backend(config), store)
    except BaseException:
        report_failure(store, rank, traceback.format_exc())
        sys.exit(1)
    try:
        serve_rank(tp, config, spec.model_path, spec.seed, spec.pack_cpu_weights)
    except SystemExit:
        raise
    except BaseException:
        sys.exit(1)         # serve_rank left the traceback for rank 0, which reports it


if __name__ == "__main__":
    main()
