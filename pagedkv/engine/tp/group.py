"""Forming a tensor-parallel group for an LLM: rank 0 of a group whose workers it starts, or a rank of
the group torchrun started; each rank on its own device."""
import os

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..checkpoints.loader import open_checkpoint
from .collectives import TensorParallel, timeout
from .shard import Shard
from .workers import Workers, WorkerSpec


def backend(config: EngineConfig) -> str:
    return config.distributed_backend or ("nccl" if config.device.type == "cuda" else "gloo")


def rank_device(device: torch.device, local_rank: int, size: int) -> torch.device:
    """The device of this rank: cuda:local_rank on CUDA (made current), else `device`."""
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} on CUDA needs a GPU per rank on this machine: rank "
                         f"{local_rank} has none ({torch.cuda.device_count()} visible)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def worker_spec(config: EngineConfig, model_path: str, seed: int, pack_cpu_weights: bool) -> WorkerSpec:
    settings = {**vars(config), "device": config.device.type,
                "dtype": None if config.dtype is None else str(config.dtype).removeprefix("torch.")}
    return WorkerSpec(os.path.abspath(model_path), settings, seed, pack_cpu_weights, torch.get_num_threads())


def join(config: EngineConfig, model_path: str, seed: int, pack_cpu_weights: bool) -> TensorParallel | None:
    """This process's TensorParallel (None when tensor_parallel_size is 1): under torchrun (WORLD_SIZE >
    1), its rank of the launched group; else rank 0 of a new group whose workers it starts. Sets
    config.device to this rank's device."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} processes")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout()))
        workers = Workers(store, size) if rank == 0 else None
    else:
        Shard(0, size).check(open_checkpoint(model_path).config)     # before starting anything
        rank = local_rank = 0
        workers = Workers.start(size, worker_spec(config, model_path, seed, pack_cpu_weights))
        store = workers.store
    try:
        config.device = rank_device(config.device, local_rank, size)
        return TensorParallel(Shard(rank, size), config.device, backend(config), store, workers)
    except BaseException:
        if workers is not None:
            workers.reap(grace_s=0.0)
        raise
